"""The engine worker fails (issue 11, item 7): a request that raises mid-stream ends with an error
event and `[DONE]` and the next request succeeds; a worker thread that dies turns /health 503 and
leaves no request waiting, queued or new. The real engine is left consistent by a failed step."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator

import httpx
import pytest

from engine.api import GenerationEvent, GenerationRequest, SamplingParams
from engine.config import EngineConfig
from engine.engine import Engine
from server.testing import sse_json
from tests.fixtures.models import build_checkpoint
from tests.test_server_faults import InProcessServer, ScriptedEngine, wait_for_health

CHAT = {"messages": [{"role": "user", "content": "hi"}]}
NO_HANG = httpx.Timeout(20)  # a request that waits for a dead worker fails the test by timing out


class WorkerKilled(BaseException):
    """Not an Exception: what kills a thread (as a KeyboardInterrupt or a C-level abort would)."""


class FailOnceEngine(ScriptedEngine):
    """The first request raises after two tokens; later ones finish."""

    def __init__(self) -> None:
        super().__init__(fail=True)
        self.calls = 0

    def generate(self, request: GenerationRequest, should_abort: Callable[[], bool]) -> Iterator[GenerationEvent]:
        self.calls += 1
        self.fail = self.calls == 1
        yield from super().generate(request, should_abort)


class DyingEngine(ScriptedEngine):
    """The first request sends "a", waits for `release`, then kills the worker thread."""

    def __init__(self) -> None:
        super().__init__(fail=False)
        self.running, self.release = threading.Event(), threading.Event()

    def generate(self, request: GenerationRequest, should_abort: Callable[[], bool]) -> Iterator[GenerationEvent]:
        yield GenerationEvent("a", (5,))
        self.running.set()
        self.release.wait(30)
        raise WorkerKilled("the worker thread is gone")


def test_a_failure_mid_stream_is_an_error_event_then_done_and_the_next_request_succeeds():
    with InProcessServer(FailOnceEngine) as srv:
        wait_for_health(srv.url, 200)
        with httpx.stream("POST", f"{srv.url}/v1/chat/completions", json={**CHAT, "stream": True},
                          timeout=NO_HANG) as response:
            events = list(sse_json(response.iter_lines()))
        assert "fell off the bus" in events[-2]["error"]["message"] and events[-1] == "[DONE]"
        after = httpx.post(f"{srv.url}/v1/chat/completions", json=CHAT, timeout=NO_HANG)
        assert after.status_code == 200 and after.json()["choices"][0]["message"]["content"] == "ab"
        assert httpx.get(f"{srv.url}/health").status_code == 200


def test_a_dead_worker_turns_health_503_and_no_request_hangs():
    engine = DyingEngine()
    with InProcessServer(lambda: engine) as srv:
        wait_for_health(srv.url, 200)
        queued: list[httpx.Response] = []
        with httpx.Client(base_url=srv.url, timeout=NO_HANG) as http:
            with http.stream("POST", "/v1/chat/completions", json={**CHAT, "stream": True}) as stream:
                lines = stream.iter_lines()
                assert engine.running.wait(10)
                waiters = [threading.Thread(target=lambda: queued.append(
                    httpx.post(f"{srv.url}/v1/completions", json={"prompt": "x"}, timeout=NO_HANG)))
                    for _ in range(3)]
                for waiter in waiters:
                    waiter.start()
                wait_for_queue(http, depth=4)
                engine.release.set()
                events = list(sse_json(lines))
            for waiter in waiters:
                waiter.join(30)
            assert not any(w.is_alive() for w in waiters), "a queued request still waits for the dead worker"
            assert events[-1] == "[DONE]" and "worker died" in events[-2]["error"]["message"]
            assert [r.status_code for r in queued] == [503] * 3
            assert all(r.json()["error"]["code"] == "engine_unavailable" for r in queued)
            health = http.get("/health")
            assert health.status_code == 503 and "worker died" in health.json()["error"]
            later = http.post("/v1/chat/completions", json=CHAT)
            assert later.status_code == 503 and later.json()["error"]["code"] == "engine_unavailable"
            assert "moe_queue_depth 0.0" in http.get("/metrics").text


def wait_for_queue(http: httpx.Client, depth: int) -> None:
    for _ in range(500):
        if f"moe_queue_depth {float(depth)}" in http.get("/metrics").text:
            return
        threading.Event().wait(0.02)
    raise AssertionError(f"the queue never reached {depth}")


# -- the real engine after a failed step ---------------------------------------------------------


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    folder = build_checkpoint("mixtral", tmp_path_factory.mktemp("tiny"), num_layers=2)
    loaded = Engine.load(EngineConfig(model=str(folder), device="cpu", expert_cache_experts=3, prefetch=True,
                                      eamc_path=str(tmp_path_factory.mktemp("state") / "m.eamc")))
    yield loaded
    loaded.close()


def greedy(engine: Engine, request_id: str) -> list[int]:
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    request = GenerationRequest(request_id, engine.encode("The quick brown fox"), params)
    return [t for event in engine.generate(request) for t in event.token_ids]


def test_the_engine_answers_the_same_after_a_step_that_raised(engine, monkeypatch):
    before = greedy(engine, "before")
    real_forward, calls = engine._forward, []

    def fails_on_the_third_step(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("injected: a device error mid-decode")
        return real_forward(*args, **kwargs)

    monkeypatch.setattr(engine, "_forward", fails_on_the_third_step)
    with pytest.raises(RuntimeError, match="injected"):
        greedy(engine, "failing")
    monkeypatch.undo()
    assert greedy(engine, "after") == before
    assert engine.runtime.cache.resident()  # the cache still works (three slots for 16 experts)
