"""Faults around the cache that must never fail a request or stop serving: a trace write
that fails (a full disk) and a prefetch that fails (a disk read)."""

import errno
import json
import threading

import pytest

from cache.expert_cache import DryRunBackend, ExpertCache
from cache.policy import LRUPolicy
from cache.prefetcher import Prefetcher
from cache.stats import CacheStats
from cache.trace import TraceWriter, read_trace
from engine.api import GenerationRequest, SamplingParams
from engine.config import EngineConfig
from engine.engine import Engine
from tests.fixtures.models import build_checkpoint


class DiskFull:
    """`os.write` that writes part of what it is given, then fails as a full disk does."""

    def __init__(self, real_write, after_bytes: int) -> None:
        self.real_write, self.left = real_write, after_bytes

    def __call__(self, fd, data):
        if self.left <= 0:
            raise OSError(errno.ENOSPC, "No space left on device")
        written = self.real_write(fd, bytes(data[: self.left]))
        self.left -= written
        return written


def record_one(writer: TraceWriter, request_id: str) -> None:
    writer.begin_request(request_id)
    for layer in range(2):
        writer.record("prefill", layer, [[0, 1], [2, 3]])
        writer.record("decode", layer, [[1, 2]])
    writer.end_request()


def test_a_failed_trace_write_is_counted_and_leaves_only_whole_lines(tmp_path, monkeypatch):
    path = tmp_path / "t.jsonl"
    writer = TraceWriter(path, "toy", num_layers=2, num_experts=4, top_k=2)
    record_one(writer, "a")
    monkeypatch.setattr("cache.trace.os.write", DiskFull(__import__("os").write, after_bytes=10))
    record_one(writer, "b")  # must not raise
    monkeypatch.undo()
    record_one(writer, "c")
    writer.close()
    assert writer.failures == 1
    lines = path.read_text().splitlines()
    assert all(json.loads(line) for line in lines)  # no partial line
    header, requests = read_trace(path)
    assert [r.id for r in requests] == ["a", "c"]


def test_a_request_finishes_and_the_eamc_is_saved_when_the_trace_disk_is_full(tmp_path, monkeypatch):
    folder = build_checkpoint("mixtral", tmp_path / "model", num_layers=2)
    config = EngineConfig(
        model=str(folder), device="cpu", expert_cache_experts=4, prefetch=False,
        record_trace=str(tmp_path / "t.jsonl"), eamc_path=str(tmp_path / "m.eamc"),
    )
    engine = Engine.load(config)
    monkeypatch.setattr("cache.trace.os.write", DiskFull(__import__("os").write, after_bytes=0))
    params = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    events = list(engine.generate(GenerationRequest("r", engine.encode("Hello there"), params)))
    assert events[-1].finish_reason == "length"
    assert engine.cache_counters()["trace_write_failures"] == 1
    monkeypatch.undo()
    engine.close()
    assert (tmp_path / "m.eamc").is_file()
    _, requests = read_trace(tmp_path / "t.jsonl")
    assert list(requests) == []


class FlakyCache(ExpertCache):
    """A cache whose first prefetches fail as a disk read would."""

    def __init__(self, failures: int) -> None:
        super().__init__(4, LRUPolicy(2, 8), CacheStats(2), DryRunBackend())
        self.failures_left = failures
        self.attempted = threading.Semaphore(0)

    def prefetch(self, key):
        try:
            if self.failures_left > 0:
                self.failures_left -= 1
                raise OSError(errno.EIO, "Input/output error")
            return super().prefetch(key)
        finally:
            self.attempted.release()


@pytest.mark.parametrize("background", [True, False])
def test_a_failed_prefetch_is_counted_and_prefetching_goes_on(background):
    cache = FlakyCache(failures=2)
    prefetcher = Prefetcher(cache, [None, None], background=background, limit=4)
    for expert in (5, 6, 7):  # two fail, the third loads on the same (still living) thread
        prefetcher._submit([((1, expert), 1.0)])
        assert cache.attempted.acquire(timeout=5)
    prefetcher.close()
    assert prefetcher.failures == 2
    assert cache.resident() == [(1, 7)]
