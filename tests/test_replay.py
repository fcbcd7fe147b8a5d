"""Trace format and replay: hand-made traces whose LRU and Belady counts are worked out by hand."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from cache.replay import BeladyPolicy, access_sequence, next_use_positions, replay, sweep, write_sweep
from cache.trace import (
    TraceFormatError,
    TraceHeader,
    TraceRequest,
    TraceWriter,
    load_trace,
    read_trace,
    write_trace,
)
from cache.tracegen import SHAPES, generate

ROOT = Path(__file__).resolve().parents[1]


def decode_only(L: int, E: int, tokens: list[list[list[int]]], k: int = 1) -> tuple[TraceHeader, list]:
    header = TraceHeader("hand", L, E, k)
    empty = np.zeros((0, L, k), dtype=np.int32)
    return header, [TraceRequest("r0", empty, np.asarray(tokens, dtype=np.int32))]


# one layer, four experts, two slots: the classic paging example
SEQUENCE = [0, 1, 2, 0, 1, 3, 0, 1, 2, 3]


def one_layer_trace():
    return decode_only(1, 4, [[[e]] for e in SEQUENCE])


def test_lru_counts_match_hand_computation():
    # LRU with 2 slots never holds the expert that comes back next: every access misses
    header, requests = one_layer_trace()
    result = replay(header, requests, "lru", 2)
    assert result["decode_accesses"] == 10
    assert result["decode_misses"] == 10
    assert result["transfers"] == 10


def test_belady_counts_match_hand_computation():
    # t3 evicts 1 (0 is back at t4), t5 evicts 2, t6 evicts 1, t8 evicts 0 (never again),
    # t9 evicts 1 (never again): misses at t1 t2 t3 t5 t6 t8 t9, hits at t4 t7 t10
    header, requests = one_layer_trace()
    result = replay(header, requests, "belady", 2)
    assert result["decode_misses"] == 7
    assert result["transfers"] == 7


def test_two_layers_with_prefill():
    # prefill: layer 0 needs {0, 1} (union over 2 prompt tokens), layer 1 needs {1};
    # decode t1: (0,0) (1,2); t2: (0,2) (1,1); three slots
    header = TraceHeader("hand", 2, 3, 1)
    prefill = np.array([[[0], [1]], [[1], [1]]], dtype=np.int32)
    decode = np.array([[[0], [2]], [[2], [1]]], dtype=np.int32)
    requests = [TraceRequest("r0", prefill, decode)]
    lru = replay(header, requests, "lru", 3)
    # LRU: prefill misses 3; decode (0,0) hit, (1,2) evicts (0,1), (0,2) evicts (1,1), (1,1) evicts (0,0)
    assert (lru["prefill_misses"], lru["decode_misses"], lru["transfers"]) == (3, 3, 6)
    belady = replay(header, requests, "belady", 3)
    # Belady evicts (0,0) and (0,1) (never used again) and keeps (1,1) for t2
    assert (belady["prefill_misses"], belady["decode_misses"], belady["transfers"]) == (3, 2, 5)


def test_prefill_larger_than_the_cache_runs_in_turns():
    header = TraceHeader("hand", 1, 3, 1)
    prefill = np.array([[[0]], [[1]], [[2]]], dtype=np.int32)
    requests = [TraceRequest("r0", prefill, np.array([[[2]]], dtype=np.int32))]
    result = replay(header, requests, "lru", 1)
    assert result["prefill_misses"] == 3  # three turns of one slot
    assert result["decode_misses"] == 0  # expert 2 was the last turn


def test_cache_carries_over_between_requests():
    header = TraceHeader("hand", 1, 4, 1)
    empty = np.zeros((0, 1, 1), dtype=np.int32)
    req = [TraceRequest(f"r{i}", empty, np.array([[[1]], [[2]]], dtype=np.int32)) for i in range(3)]
    result = replay(header, req, "lru", 2)
    assert result["decode_misses"] == 2 and result["requests"] == 3


def test_next_use_positions():
    seq = np.array([5, 3, 5, 5, 3, 7])
    assert next_use_positions(seq).tolist() == [2, 4, 3, 6, 6, 6]


def test_belady_refuses_a_sequence_that_does_not_match():
    policy = BeladyPolicy(1, 4, np.array([0, 1]))
    policy.on_access((0, 0))
    with pytest.raises(RuntimeError):
        policy.on_access((0, 2))


def test_access_sequence_follows_acquire_order():
    header, requests = one_layer_trace()
    assert access_sequence(header, requests, 2).tolist() == SEQUENCE


def test_sparsity_aware_replays_the_hand_trace():
    header, requests = one_layer_trace()
    result = replay(header, requests, "sparsity-aware", 2)
    assert 7 <= result["decode_misses"] <= 10  # between Belady and LRU


# -- the trace file ------------------------------------------------------------------------


def test_writer_reader_round_trip(tmp_path):
    path = tmp_path / "t.jsonl"
    with TraceWriter(path, "m", 2, 4, 2) as writer:
        writer.begin_request("a")
        for layer in range(2):
            writer.record("prefill", layer, [[0, 1], [1, 2], [3, 0]])
        for _ in range(2):
            for layer in range(2):
                writer.record("decode", layer, [[layer, 3]])
        writer.end_request()
    with TraceWriter(path, "m", 2, 4, 2) as writer:  # appends to a matching file
        writer.begin_request("b")
        writer.record("decode", 0, [[1, 2]])  # aborted mid-pass: cut to full tokens
        writer.end_request()
    header, requests = load_trace(path)
    assert header == TraceHeader("m", 2, 4, 2)
    assert [r.id for r in requests] == ["a", "b"]
    assert requests[0].prefill.shape == (3, 2, 2) and requests[0].decode.shape == (2, 2, 2)
    assert requests[0].decode[1, 1].tolist() == [1, 3]
    assert requests[1].decode.shape[0] == 0


def test_writer_refuses_a_file_of_another_model(tmp_path):
    path = tmp_path / "t.jsonl"
    TraceWriter(path, "m", 2, 4, 2).close()
    with pytest.raises(TraceFormatError):
        TraceWriter(path, "other", 2, 4, 2)


HEADER = '{"format": "moe-trace/1", "model": "m", "num_layers": 2, "num_experts": 4, "top_k": 1}\n'


@pytest.mark.parametrize(
    "text, message",
    [
        ("", "empty"),
        ('{"format": "moe-trace/2"}\n', "not a moe-trace/1 header"),
        ('{"format": "moe-trace/1", "model": "m", "num_layers": 0, "num_experts": 4, "top_k": 1}\n', "num_layers"),
        (HEADER + "{not json\n", "invalid JSON"),
        (HEADER + '{"id": 1, "prefill": [], "decode": []}\n', "id"),
        (HEADER + '{"id": "a", "prefill": [], "decode": [[[0]]]}\n', "per layer"),
        (HEADER + '{"id": "a", "prefill": [], "decode": [[[0], [4]]]}\n', "0..3"),
        (HEADER + '{"id": "a", "prefill": [], "decode": [[[0], [-1]]]}\n', "non-negative"),
        (HEADER + '{"id": "a", "prefill": [], "decode": [[[0, 0], [1, 2]]]}\n', "twice"),
        (HEADER + '{"id": "a", "prefill": [], "decode": [[[0], ["x"]]]}\n', "integers"),
        (HEADER + '{"id": "a", "prefill": {}, "decode": []}\n', "list of tokens"),
    ],
)
def test_malformed_traces_fail_clearly(tmp_path, text, message):
    path = tmp_path / "bad.jsonl"
    path.write_text(text)
    with pytest.raises(TraceFormatError, match=message):
        load_trace(path)


def test_ragged_tokens_are_padded(tmp_path):
    path = tmp_path / "r.jsonl"
    path.write_text(HEADER.replace('"top_k": 1', '"top_k": 2') + '{"id": "a", "prefill": [], "decode": [[[0, 1], [2]]]}\n')
    _, requests = load_trace(path)
    assert requests[0].decode.tolist() == [[[0, 1], [2, -1]]]


def test_reader_is_lazy(tmp_path):
    path = tmp_path / "t.jsonl"
    header, requests = generate(SHAPES["few-large"], 3, seed=1)
    write_trace(path, header, requests)
    got_header, it = read_trace(path)
    assert got_header == header
    first = next(it)
    assert np.array_equal(first.decode, requests[0].decode)
    it.close()


# -- CLI and sweep -------------------------------------------------------------------------


def test_cli_json_has_the_contract_fields(tmp_path):
    path = tmp_path / "t.jsonl"
    header, requests = one_layer_trace()
    write_trace(path, header, requests)
    out = subprocess.run(
        [sys.executable, "-m", "cache.replay", str(path), "--policy", "belady", "--capacity", "2", "--json"],
        cwd=ROOT, capture_output=True, text=True, check=True,
    )
    result = json.loads(out.stdout)
    for key in ("policy", "capacity", "requests", "decode_accesses", "decode_misses", "decode_miss_rate",
                "transfers", "transfers_per_decode_access"):
        assert key in result
    assert result["decode_misses"] == 7 and result["decode_miss_rate"] == 0.7


def test_sweep_writes_table_json_and_plot(tmp_path):
    path = tmp_path / "t.jsonl"
    header, requests = generate(SHAPES["few-large"], 4, seed=2)
    write_trace(path, header, requests)
    data = sweep(str(path), ["lru", "belady", "sparsity-aware"], [0.1, 0.25], jobs=1, prefetch=True)
    paths = write_sweep(data, tmp_path / "out")
    assert all(p.exists() and p.stat().st_size > 0 for p in paths)
    table = paths[1].read_text()
    assert "gap closed" in table and "sparsity-aware+prefetch" in table
    assert paths[2].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
