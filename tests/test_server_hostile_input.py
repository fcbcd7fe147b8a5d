"""Bounded input (issue 11, items 1-3): oversized and endless bodies, stop sequences, and hostile JSON
shapes each get a 400 (or 413) in OpenAI's shape, with the server's memory bounded, measured.

The real app and `EngineClient` in this process (so that tracemalloc sees the server's allocations)
over the scripted stand-in engine of tests/test_server_faults.py.
"""

from __future__ import annotations

import asyncio
import json
import time
import tracemalloc

import pytest
from starlette.testclient import TestClient

from engine.api import MAX_STOP_CHARS, MAX_STOP_SEQUENCES
from engine.config import EngineConfig
from server.app import BodyLimitMiddleware, create_app
from server.config import ServerConfig
from server.json_body import MAX_JSON_DEPTH
from server.protocol import MAX_MESSAGES, MAX_TOOLS
from tests.test_server_faults import ScriptedEngine

ERROR_KEYS = {"message", "type", "param", "code"}
HI = [{"role": "user", "content": "hi"}]
JSON = {"content-type": "application/json"}
# Parsing JSON into Python objects takes ~10x the text; the largest body allowed is 4 MiB
MEMORY_BOUND = 64 * 2**20


@pytest.fixture(scope="module")
def client():
    app = create_app(ServerConfig(), EngineConfig(), load_engine=lambda: ScriptedEngine(fail=False))
    with TestClient(app, base_url="http://localhost") as test_client:
        wait_for_health_in(test_client)
        yield test_client


def wait_for_health_in(test_client: TestClient) -> None:
    for _ in range(500):
        if test_client.get("/health").status_code == 200:
            return
        time.sleep(0.01)
    raise AssertionError("the scripted engine did not load")


def post_measured(client: TestClient, path: str, body: str | bytes) -> tuple[object, int]:
    """The response and the peak of memory allocated while the server handled it."""
    tracemalloc.start()
    try:
        response = client.post(path, content=body, headers=JSON)
        return response, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def assert_openai_error(response, status: int, param: str | None) -> dict:
    assert response.status_code == status, response.text[:300]
    assert set(response.json()) == {"error"} and set(response.json()["error"]) == ERROR_KEYS
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["message"] and error["param"] == param
    return error


def chat(**fields) -> str:
    return json.dumps({"messages": HI, **fields})


def nested(depth: int) -> str:
    return '{"a":' * depth + "1" + "}" * depth


HOSTILE = {
    # name: (body, param, words in the message)
    "100k-tiny-messages": (json.dumps({"messages": [{"role": "user", "content": ""}] * 100_000}), "messages",
                           f"at most {MAX_MESSAGES}"),
    "100k-content-parts": (json.dumps({"messages": [{"role": "user", "content": [{"type": "text", "text": ""}]
                                                     * 100_000}]}), "messages[0].content", f"at most {MAX_MESSAGES}"),
    "1k-tools": (chat(tools=[{"type": "function", "function": {"name": "f"}}] * 1000), "tools",
                 f"at most {MAX_TOOLS}"),
    "deep-array": ('{"messages": ' + "[" * 100_000 + "]" * 100_000 + "}", None, "nested too deeply"),
    "deep-object": ('{"messages": [], "x": ' + nested(100_000) + "}", None, "nested too deeply"),
    "deep-schema": (chat(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": "S"}})
                    .replace('"S"', nested(MAX_JSON_DEPTH)), None, "nested too deeply"),
    "duplicate-key": ('{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, "max_tokens": 6}', None,
                      "duplicate key 'max_tokens'"),
    "duplicate-nested-key": ('{"messages": [{"role": "user", "role": "system", "content": "hi"}]}', None,
                             "duplicate key 'role'"),
    "huge-integer": ('{"messages": [], "max_tokens": ' + "9" * 5000 + "}", None, "not valid JSON"),
    "50-stops": (chat(stop=["x"] * 50), "stop", f"at most {MAX_STOP_SEQUENCES}"),
    "long-stop": (chat(stop="x" * (MAX_STOP_CHARS + 1)), "stop", f"at most {MAX_STOP_CHARS} characters"),
}


@pytest.mark.parametrize("name", list(HOSTILE))
def test_hostile_shapes_are_400_with_bounded_memory(client, name):
    body, param, words = HOSTILE[name]
    response, peak = post_measured(client, "/v1/chat/completions", body)
    error = assert_openai_error(response, 400, param)
    assert words in error["message"]
    assert peak < MEMORY_BOUND, f"{peak / 2**20:.1f} MiB for a {len(body) / 2**20:.2f} MiB body"


def test_a_one_megabyte_message_is_read_with_bounded_memory(client):
    body = chat(messages=[{"role": "user", "content": "word " * 200_000}], max_tokens=1)
    response, peak = post_measured(client, "/v1/chat/completions", body)
    assert response.status_code == 200  # the scripted engine takes any length; the real one counts tokens
    assert peak < MEMORY_BOUND


def test_the_limits_themselves_are_accepted(client):
    response = client.post("/v1/chat/completions", headers=JSON, content=chat(
        stop=["s" * MAX_STOP_CHARS] * MAX_STOP_SEQUENCES,
        messages=[{"role": "user", "content": "hi"}] * MAX_MESSAGES,
        response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": "S"}},
    ).replace('"S"', nested(MAX_JSON_DEPTH - 4)))  # the body's own levels: schema, json_schema, ...
    assert response.status_code == 200, response.text[:300]


NUMBERS = [("max_tokens", "/v1/completions"), ("temperature", "/v1/completions"), ("top_p", "/v1/completions"),
           ("top_k", "/v1/completions"), ("min_p", "/v1/completions"), ("seed", "/v1/completions"),
           ("presence_penalty", "/v1/completions"), ("frequency_penalty", "/v1/completions"),
           ("repetition_penalty", "/v1/completions"), ("logprobs", "/v1/completions"), ("n", "/v1/completions"),
           ("max_completion_tokens", "/v1/chat/completions"), ("top_logprobs", "/v1/chat/completions")]


def numeric_request(path: str, field: str, literal: str) -> str:
    base = '{"prompt": "hi"' if path == "/v1/completions" else '{"messages": [{"role": "user", "content": "hi"}]'
    extra = ', "logprobs": true' if field == "top_logprobs" else ""
    return f'{base}{extra}, "{field}": {literal}}}'


@pytest.mark.parametrize("field, path", NUMBERS)
@pytest.mark.parametrize("literal", ['"1"', "NaN", "Infinity", "-Infinity", "true"])
def test_numbers_as_strings_booleans_and_non_finite_values_are_400_naming_the_field(client, field, path, literal):
    response = client.post(path, headers=JSON, content=numeric_request(path, field, literal))
    assert_openai_error(response, 400, field)


@pytest.mark.parametrize("field, literal", [("stream", '"true"'), ("logprobs", "1"), ("echo", '"false"'),
                                            ("stop", "[1]"), ("model", "7")])
def test_other_fields_are_strictly_typed_too(client, field, literal):
    path = "/v1/completions" if field == "echo" else "/v1/chat/completions"
    response = client.post(path, headers=JSON, content=numeric_request(path, field, literal))
    error = assert_openai_error(response, 400, field if field != "stop" else "stop[0]")
    assert field in error["message"]


# -- the body limit, at the ASGI level (item 1) ------------------------------------------------


class BodyReadingApp:
    """Reads the whole body as FastAPI does, then answers 200."""

    def __init__(self) -> None:
        self.read = 0

    async def __call__(self, scope, receive, send) -> None:
        more = True
        while more:
            message = await receive()
            self.read += len(message.get("body", b""))
            more = message.get("more_body", False)
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})


async def run_asgi(app, headers: list[tuple[bytes, bytes]], chunks) -> tuple[int, bytes, int]:
    """Send one request whose body comes from `chunks`; (status, body, bytes the client was asked for)."""
    scope = {"type": "http", "method": "POST", "path": "/v1/completions", "headers": headers,
             "query_string": b"", "scheme": "http", "server": ("localhost", 8000), "client": ("127.0.0.1", 1),
             "root_path": "", "http_version": "1.1"}
    pulled, sent = 0, []

    async def receive():
        nonlocal pulled
        chunk = next(chunks)
        pulled += len(chunk)
        return {"type": "http.request", "body": chunk, "more_body": True}

    async def send(message):
        sent.append(message)

    from starlette.exceptions import HTTPException

    try:
        await app(scope, receive, send)
    except HTTPException as e:  # in the server, FastAPI's handler answers it (tests/test_server_api.py)
        return e.status_code, e.detail.encode(), pulled
    status = next(m["status"] for m in sent if m["type"] == "http.response.start")
    return status, b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body"), pulled


def endless(size: int = 2**16):
    while True:
        yield b"x" * size


def test_an_endless_chunked_body_is_refused_after_the_limit_not_read_whole():
    inner = BodyReadingApp()
    limit = 2**20
    status, body, pulled = asyncio.run(run_asgi(BodyLimitMiddleware(inner, limit),
                                          [(b"transfer-encoding", b"chunked")], endless()))
    assert status == 413 and b"--max-request-bytes" in body
    assert limit < pulled <= limit + 2**16  # it stopped at the first chunk past the limit


def test_a_declared_length_over_the_limit_is_refused_before_any_byte_is_read():
    inner = BodyReadingApp()
    status, body, pulled = asyncio.run(run_asgi(BodyLimitMiddleware(inner, 1000),
                                                [(b"content-length", b"5000")], endless()))
    assert status == 413 and pulled == 0 and inner.read == 0
    assert json.loads(body)["error"]["code"] == "request_too_large"


def test_an_oversize_chunked_body_is_413_in_openai_shape_through_the_app(client):
    def chunks():
        yield from (b"x" * 2**16 for _ in range(100))  # 6.4 MiB, no Content-Length

    response = client.post("/v1/completions", content=chunks(), headers=JSON)
    assert response.status_code == 413 and response.json()["error"]["code"] == "request_too_large"
    assert set(response.json()["error"]) == ERROR_KEYS


def test_the_server_still_answers_after_all_that(client):
    assert client.post("/v1/chat/completions", json={"messages": HI}).json()["choices"][0]["message"]["content"] == "ab"
