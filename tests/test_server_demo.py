"""The built-in demo model through HTTP: no `--model`, a cache smaller than all experts, a real answer.

Slow the first time on a machine (the demo model is built once into the per-user cache folder).
"""

from __future__ import annotations

import pytest

from server.testing import RemoteServer, sse_json

pytestmark = pytest.mark.slow

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def server():
    srv = RemoteServer(["--config", "configs/demo-cpu.yaml", "--expert-cache-experts", "96"], ready_timeout=1200)
    with srv:
        yield srv


def test_demo_model_is_listed(server):
    (model,) = server.openai().models.list().data
    assert model.id


def test_demo_answers_the_capital_of_france(server):
    client = server.openai(timeout=300)
    model = client.models.list().data[0].id
    answer = client.chat.completions.create(model=model, messages=QUESTION, max_tokens=24, temperature=0)
    assert "Paris" in answer.choices[0].message.content
    streamed = client.chat.completions.create(model=model, messages=QUESTION, max_tokens=24, temperature=0,
                                              stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in streamed) == answer.choices[0].message.content


def test_demo_runs_the_offloaded_path(server):
    with server.http() as http:
        view = http.get("/v1/expert-cache").json()
    assert view["capacity_experts"] == 96 < view["total_experts"]
    assert view["misses"] > 0  # experts were loaded on demand


def test_demo_answers_open_webuis_request_with_tools_as_a_plain_chat(server):
    from server.tools import WARNING_HEADER
    from tests.test_server_tools import open_webui_tools

    model = server.openai().models.list().data[0].id
    body = {"model": model, "messages": QUESTION, "tools": open_webui_tools(30), "stream": True, "max_tokens": 24,
            "temperature": 0}
    with server.http(timeout=300) as http, http.stream("POST", "/v1/chat/completions", json=body) as response:
        assert response.status_code == 200
        assert "cannot take tools" in response.headers[WARNING_HEADER]
        events = list(sse_json(response.iter_lines()))
    assert events[-1] == "[DONE]"
    assert "Paris" in "".join(e["choices"][0]["delta"].get("content") or "" for e in events[:-1])
