"""End to end with `--api-key` and `--max-queue 1`: authentication and queue overflow, on a real process."""

from __future__ import annotations

import json
import time

import httpx
import openai
import pytest

from server.testing import RemoteServer

KEY = "sk-test-secret"
MODEL = "tiny-mixtral"
CHAT = [{"role": "user", "content": "Tell me a story."}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from tests.fixtures.models import build_checkpoint

    checkpoint = build_checkpoint("mixtral", tmp_path_factory.mktemp("tiny-mixtral"))
    state = tmp_path_factory.mktemp("state")
    trace = state / "trace.jsonl"
    srv = RemoteServer(["--model", str(checkpoint), "--served-model-name", MODEL, "--device", "cpu",
                        "--policy", "lru", "--eamc-path", str(state / "eamc.json"), "--max-queue", "1",
                        "--record-trace", str(trace)],
                       env={"MOE_SERVE_API_KEY": KEY, "OMP_NUM_THREADS": "1"}, api_key=KEY)
    with srv:
        yield srv
    # the graceful shutdown closed the engine, which closed the trace the flag asked for
    header, *requests = [json.loads(line) for line in trace.read_text().splitlines()]
    assert header["format"] == "moe-trace/1" and header["num_layers"] == 3
    assert requests and all(r["prefill"] for r in requests)


def test_health_needs_no_key(server):
    assert httpx.get(f"{server.url}/health").status_code == 200


@pytest.mark.parametrize("path", ["/v1/models", "/v1/chat/completions", "/metrics", "/v1/expert-cache"])
@pytest.mark.parametrize("authorization", [None, "Bearer wrong-key", f"Basic {KEY}"])
def test_missing_or_wrong_key_is_401(server, path, authorization):
    headers = {"Authorization": authorization} if authorization else {}
    method = "POST" if path.endswith("completions") else "GET"
    response = httpx.request(method, f"{server.url}{path}", headers=headers, json={"messages": CHAT})
    assert response.status_code == 401
    assert response.json()["error"]["code"] == "invalid_api_key"
    assert set(response.json()["error"]) == {"message", "type", "param", "code"}


def test_sdk_with_the_key_works_and_without_it_fails(server):
    assert [m.id for m in server.openai().models.list()] == [MODEL]
    with server.http() as http:
        assert http.get("/v1/expert-cache").json()["policy"] == "lru"  # --policy reached the engine
    wrong = openai.OpenAI(base_url=f"{server.url}/v1", api_key="nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        wrong.models.list()


def wait_until_idle(server, timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    with server.http() as http:
        while "moe_queue_depth 0.0" not in http.get("/metrics").text:
            assert time.monotonic() < deadline, "queue did not drain"
            time.sleep(0.05)


def test_queue_overflow_is_503_with_retry_after(server):
    client = server.openai()
    long = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=490, temperature=0, stream=True,
                                          extra_body={"ignore_eos": True})
    with long:
        next(long), next(long)  # the role chunk, then a token: it is running
        with server.http() as http:
            response = http.post("/v1/chat/completions", json={"model": MODEL, "messages": CHAT, "max_tokens": 1})
        assert response.status_code == 503
        assert int(response.headers["Retry-After"]) >= 1
        assert response.json()["error"]["code"] == "queue_full"
        with pytest.raises(openai.InternalServerError):
            client.completions.create(model=MODEL, prompt="hi", max_tokens=1)
    wait_until_idle(server)  # closing the stream aborted it; its slot frees within a decode step
    response = client.completions.create(model=MODEL, prompt="hi", max_tokens=1)
    assert response.choices[0].finish_reason == "length"
    with server.http() as http:
        assert 'moe_requests_total{status="rejected"} 2.0' in http.get("/metrics").text
