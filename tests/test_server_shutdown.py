"""SIGTERM on a real process: the server stops accepting, running requests get --drain-timeout to
finish, then the rest are aborted; every stream ends with [DONE]."""

from __future__ import annotations

import re
import signal
import threading
import time

import httpx
import pytest

from server.testing import RemoteServer, sse_json

CHAT = [{"role": "user", "content": "Tell me a story."}]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from tests.fixtures.models import build_checkpoint

    return build_checkpoint("mixtral", tmp_path_factory.mktemp("tiny-mixtral"))


def start(checkpoint, drain: float) -> RemoteServer:
    return RemoteServer(["--model", str(checkpoint), "--device", "cpu", "--policy", "lru",
                         "--drain-timeout", str(drain)], env={"OMP_NUM_THREADS": "1"}).start()


def body(max_tokens: int, stream: bool) -> dict:
    return {"messages": CHAT, "max_tokens": max_tokens, "stream": stream, "ignore_eos": True}


def refuses_connections(url: str, timeout: float = 5) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            httpx.get(f"{url}/health", timeout=1)
        except httpx.TransportError:
            return True
        time.sleep(0.05)
    return False


def wait_for_queue_depth(server: RemoteServer, depth: int, timeout: float = 30) -> None:
    """Until the server counts `depth` requests waiting or running (a fixed sleep lost the race under load)."""
    deadline = time.monotonic() + timeout
    pattern = re.compile(r"^moe_queue_depth (\S+)$", re.MULTILINE)
    while float(pattern.search(httpx.get(f"{server.url}/metrics", timeout=5).text).group(1)) < depth:
        assert time.monotonic() < deadline, f"the queue never reached {depth}"
        time.sleep(0.05)


def stream_after_sigterm(server: RemoteServer, request: dict) -> list:
    """The stream's events; SIGTERM goes out once the first token has arrived."""
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", json=request, timeout=60) as response:
        events = sse_json(response.iter_lines())
        received = [next(events), next(events)]  # the role chunk, then a token: it is running
        server.process.send_signal(signal.SIGTERM)
        assert refuses_connections(server.url)  # no new requests while draining
        return received + list(events)


def test_running_requests_finish_within_the_drain(checkpoint):
    server = start(checkpoint, drain=30)
    try:
        events = stream_after_sigterm(server, body(300, stream=True))
        assert events[-1] == "[DONE]"
        finish = [e["choices"][0]["finish_reason"] for e in events[:-1] if e["choices"][0]["finish_reason"]]
        assert finish == ["length"] and not any("error" in e for e in events[:-1])
        assert server.process.wait(30) in (0, -signal.SIGTERM)
        assert "engine shut down" in server.log()
    finally:
        server.stop()
        print(server.log()[-6000:])  # shown when the test fails


def test_past_the_drain_requests_are_aborted_and_streams_end_with_an_error_then_done(checkpoint):
    server = start(checkpoint, drain=0)
    try:
        queued: dict[str, httpx.Response] = {}

        def wait_in_queue() -> None:  # behind the stream: the engine runs one request at a time
            queued["response"] = httpx.post(f"{server.url}/v1/chat/completions", json=body(490, stream=False),
                                            timeout=60)

        thread = threading.Thread(target=wait_in_queue)
        with httpx.stream("POST", f"{server.url}/v1/chat/completions", json=body(490, stream=True),
                          timeout=60) as response:
            events = sse_json(response.iter_lines())
            received = [next(events), next(events)]
            thread.start()
            wait_for_queue_depth(server, 2)  # the second request is in
            server.process.send_signal(signal.SIGTERM)
            received += list(events)
        thread.join(30)
        assert received[-1] == "[DONE]"
        assert received[-2]["error"]["code"] == "server_shutdown"
        assert queued["response"].status_code == 503
        assert queued["response"].json()["error"]["code"] == "server_shutdown"
        assert server.process.wait(30) in (0, -signal.SIGTERM)
    finally:
        server.stop()
        print(server.log()[-6000:])  # shown when the test fails


def test_past_the_drain_a_request_with_n_choices_stops_in_the_choice_it_is_in(checkpoint):
    server = start(checkpoint, drain=0)
    try:
        request = {**body(200, stream=True), "n": 3, "temperature": 0}  # greedy: the same tokens every run
        with httpx.stream("POST", f"{server.url}/v1/chat/completions", json=request, timeout=60) as response:
            events = sse_json(response.iter_lines())
            received = [next(events)]
            while received[-1]["choices"][0]["index"] == 0:  # choice 0 whole, up to choice 1's role chunk
                received.append(next(events))
            server.process.send_signal(signal.SIGTERM)
            received += list(events)
        assert received[-1] == "[DONE]" and received[-2]["error"]["code"] == "server_shutdown"
        indices = {c["index"] for e in received[:-2] for c in e["choices"]}
        assert indices == {0, 1}  # choice 2 never started
        assert server.process.wait(30) in (0, -signal.SIGTERM)
    finally:
        server.stop()
        print(server.log()[-6000:])  # shown when the test fails


def test_sigterm_during_the_model_load_ends_the_process_at_once(tmp_path):
    # the built-in demo model, built on the first start into an empty cache: a load of about a minute
    server = RemoteServer([], env={"MOE_SERVE_CACHE_DIR": str(tmp_path / "cache")}).launch()
    try:
        deadline = time.monotonic() + 60
        while True:
            assert server.process.poll() is None and time.monotonic() < deadline, server.log()[-2000:]
            try:
                if httpx.get(f"{server.url}/health", timeout=2).json().get("status") == "loading":
                    break
            except httpx.TransportError:
                time.sleep(0.1)
        server.process.send_signal(signal.SIGTERM)
        asked_to_stop = time.monotonic()
        assert server.process.wait(30) in (0, -signal.SIGTERM)
        assert time.monotonic() - asked_to_stop < 10, server.log()[-2000:]
        assert "the load is abandoned" in server.log() and "could not load the model" not in server.log()
    finally:
        server.stop()
        print(server.log()[-6000:])  # shown when the test fails
