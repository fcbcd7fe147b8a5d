"""Faults a real model cannot produce on demand (slow load, failed load, an error mid-stream), on a real
uvicorn server in this process: the real app and `EngineClient` over a scripted stand-in engine."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator

import httpx
import openai
import pytest
import uvicorn

from engine.api import ChatTemplateInfo, GenerationEvent, GenerationRequest, Usage
from engine.config import EngineConfig
from server.app import create_app
from server.config import ServerConfig
from server.testing import free_port, sse_json


class ScriptedEngine:
    """Answers every prompt with "a", "b", then fails (or finishes, with `fail=False`)."""

    model_name, max_model_len, vocab_size = "scripted", 64, 100

    model_names = (model_name,)
    chat_template_info = ChatTemplateInfo(supports_tools=False, source="", model_type="scripted")
    sampling_defaults: dict = {}

    def __init__(self, fail: bool = True) -> None:
        self.fail = fail
        self.closed = False

    def encode(self, text: str) -> list[int]:
        return [1] * len(text.split())

    def apply_chat_template(self, messages: list[dict], tools: list[dict] | None = None,
                            template_kwargs: dict | None = None, continue_final: bool = False) -> list[int]:
        return [1, 2, 3]

    def validate(self, request: GenerationRequest) -> None:
        pass

    def generate(self, request: GenerationRequest, should_abort: Callable[[], bool]) -> Iterator[GenerationEvent]:
        yield GenerationEvent("a", (5,))
        yield GenerationEvent("b", (6,))
        if self.fail:
            raise RuntimeError("the device fell off the bus")
        yield GenerationEvent("", (7,), finish_reason="stop", usage=Usage(3, 3))

    def cache_info(self) -> dict:
        return {"policy": "scripted"}

    def cache_counters(self) -> dict[str, int]:
        return {"hits": 3, "misses": 1, "prefetches": 0, "prefetch_used": 0, "bytes_transferred": 10,
                "eamc_entries": 2}

    def close(self) -> None:
        self.closed = True


class InProcessServer:
    def __init__(self, load_engine: Callable[[], object], on_load_failure: Callable[[str], None] | None = None,
                 ) -> None:
        self.port = free_port()
        app = create_app(ServerConfig(port=self.port), EngineConfig(), load_engine=load_engine,
                         on_load_failure=on_load_failure)
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.url = f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> InProcessServer:
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert time.monotonic() < deadline, "server did not start"
            time.sleep(0.02)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(30)


def wait_for_health(url: str, status: int, timeout: float = 10) -> httpx.Response:
    deadline = time.monotonic() + timeout
    while (response := httpx.get(f"{url}/health")).status_code != status:
        assert time.monotonic() < deadline, response.text
        time.sleep(0.02)
    return response


CHAT = {"messages": [{"role": "user", "content": "hi"}]}


def test_loading_answers_503_then_ready():
    loaded = threading.Event()

    def slow_load():
        loaded.wait(30)
        return ScriptedEngine(fail=False)

    with InProcessServer(slow_load) as srv:
        health = httpx.get(f"{srv.url}/health")
        assert health.status_code == 503 and health.json()["status"] == "loading"
        busy = httpx.post(f"{srv.url}/v1/chat/completions", json=CHAT)
        assert busy.status_code == 503 and "Retry-After" in busy.headers
        assert busy.json()["error"]["code"] == "engine_unavailable"
        assert httpx.get(f"{srv.url}/v1/models").status_code == 503
        loaded.set()
        wait_for_health(srv.url, 200)
        assert httpx.post(f"{srv.url}/v1/chat/completions", json=CHAT).json()["choices"][0]["message"]["content"] == "ab"


def test_failed_load_is_reported_once_with_the_reason():
    reported: list[str] = []
    failed = threading.Event()

    def broken_load():
        failed.wait(30)  # until /health has been asked while loading
        raise OSError("no such checkpoint")

    with InProcessServer(broken_load, on_load_failure=reported.append) as srv:
        assert httpx.get(f"{srv.url}/health").json()["status"] == "loading"
        failed.set()
        for _ in range(100):
            if reported:
                break
            time.sleep(0.02)
        assert reported == ["OSError: no such checkpoint"]  # the CLI exits on it (tests/test_cli.py)
        assert httpx.get(f"{srv.url}/health").json() == {"status": "error", "error": "OSError: no such checkpoint"}
        response = httpx.post(f"{srv.url}/v1/completions", json={"prompt": "x"})
        assert response.status_code == 503 and "no such checkpoint" in response.json()["error"]["message"]


def test_error_after_the_stream_started_is_an_error_event_then_done():
    with InProcessServer(lambda: ScriptedEngine(fail=True)) as srv:
        wait_for_health(srv.url, 200)
        with httpx.stream("POST", f"{srv.url}/v1/chat/completions", json={**CHAT, "stream": True}) as response:
            assert response.status_code == 200
            events = list(sse_json(response.iter_lines()))
        assert [e["choices"][0]["delta"] for e in events[:3]] == [{"role": "assistant", "content": ""},
                                                                  {"content": "a"}, {"content": "b"}]
        error = events[3]["error"]
        assert error["type"] == "server_error" and "fell off the bus" in error["message"]
        assert events[4:] == ["[DONE]"]

        client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="x", max_retries=0)
        with pytest.raises(openai.APIError, match="fell off the bus"):
            list(client.chat.completions.create(model="scripted", stream=True, **CHAT))
        full = httpx.post(f"{srv.url}/v1/chat/completions", json=CHAT)
        assert full.status_code == 500 and full.json()["error"]["code"] == "internal_error"
        metrics = httpx.get(f"{srv.url}/metrics").text
        assert 'moe_requests_total{status="error"} 3.0' in metrics
        assert "moe_expert_cache_hits_total 3.0" in metrics and "moe_eamc_entries 2.0" in metrics


@pytest.mark.parametrize("stream", [False, True])
def test_a_crash_is_logged_once_with_its_traceback(caplog, stream):
    uvicorn_log = logging.getLogger("uvicorn")  # it does not propagate to the root logger caplog listens on
    uvicorn_log.addHandler(caplog.handler)
    try:
        with InProcessServer(lambda: ScriptedEngine(fail=True)) as srv:
            wait_for_health(srv.url, 200)
            caplog.clear()
            response = httpx.post(f"{srv.url}/v1/chat/completions", json={**CHAT, "stream": stream})
            assert response.status_code == (200 if stream else 500)
            time.sleep(0.3)  # a second report would come right after the response
    finally:
        uvicorn_log.removeHandler(caplog.handler)
    tracebacks = [r for r in caplog.records if r.exc_info]
    assert len(tracebacks) == 1, [r.getMessage() for r in tracebacks]
    assert "fell off the bus" in str(tracebacks[0].exc_info[1])


def test_graceful_shutdown_closes_the_engine():
    engine = ScriptedEngine(fail=False)
    with InProcessServer(lambda: engine) as srv:
        wait_for_health(srv.url, 200)
        assert httpx.get(f"{srv.url}/v1/expert-cache").json() == {"policy": "scripted"}
    assert engine.closed


def test_shutdown_during_the_load_does_not_wait_for_it():
    finish_load = threading.Event()
    engine = ScriptedEngine(fail=False)

    def long_load():
        finish_load.wait(120)  # a real model's load can take minutes
        return engine

    reported: list[str] = []
    srv = InProcessServer(long_load, on_load_failure=reported.append)
    with srv:
        wait_for_health(srv.url, 503)
        asked_to_stop = time.monotonic()
    assert not srv.thread.is_alive() and time.monotonic() - asked_to_stop < 10
    client = srv.server.config.app.state.client
    finish_load.set()  # the abandoned load ends after the shutdown: its engine is not kept
    time.sleep(0.2)
    assert client.engine is None and not client.ready and not engine.closed
    assert reported == []  # stopping is not a load failure: the CLI exits 0, not 1


def test_out_of_device_memory_fails_that_request_with_a_503_and_the_engine_serves_on(tmp_path):
    import torch

    from engine.engine import Engine
    from tests.fixtures.models import build_checkpoint

    engine = Engine.load(EngineConfig(model=str(build_checkpoint("mixtral", tmp_path / "m")), device="cpu"))
    forward, calls = engine._forward, []

    def runs_out_at_the_third_step(input_ids, kv):
        calls.append(1)
        if len(calls) == 3:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return forward(input_ids, kv)

    engine._forward = runs_out_at_the_third_step
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 8, "ignore_eos": True}
    with InProcessServer(lambda: engine) as srv:
        wait_for_health(srv.url, 200)
        failed = httpx.post(f"{srv.url}/v1/chat/completions", json=chat)
        assert failed.status_code == 503 and "Retry-After" not in failed.headers
        error = failed.json()["error"]
        assert error["code"] == "device_out_of_memory" and "ran out of memory at" in error["message"]
        assert "--max-model-len" in error["message"]
        served = httpx.post(f"{srv.url}/v1/chat/completions", json=chat)
        assert served.status_code == 200 and served.json()["usage"]["completion_tokens"] == 8
        assert httpx.get(f"{srv.url}/health").status_code == 200
