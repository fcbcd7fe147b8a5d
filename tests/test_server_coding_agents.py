"""opencode, Qwen Code and Continue CLI, replayed: the body each sent to /v1/chat/completions with its shell
tool's call and result as history (recorded by `python -m bench.agent_clients --bodies DIR`, system prompts and
long texts shortened, the tool list cut to the shell tool), on a real server whose Qwen2.5-style template
takes tools (test_server_tools.py's).

What they send that other clients do not: opencode `tool_choice: "auto"` and `max_tokens: 32000`; Qwen Code
user and tool turns as lists of text parts and `max_tokens: 8000`; all three stream with
`stream_options.include_usage`. The prompt must be the template's rendering of the whole history, the tool's
output inside it."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

from engine.chat_messages import prepare_messages
from server.testing import sse_json
from tests import test_server_tools
from tests.test_server_tools import prompt_tokens

CLIENTS = Path(__file__).parent / "fixtures" / "clients"
MARK = "moe-serve-agent-ok"
TOKENS = 4
qwen = test_server_tools.qwen  # the same fixture: a tiny random Qwen3-MoE with a tool template


def recorded(name: str) -> dict:
    return json.loads((CLIENTS / f"{name}_tool_result.json").read_text())


@pytest.mark.parametrize("name", ["opencode", "qwen_code", "continue"])
def test_coding_agents_tool_result_turn_is_answered(qwen, name):
    client, tokenizer = qwen
    body = recorded(name)
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}  # as each sent it
    assert body["messages"][-1]["role"] == "tool" and body["messages"][-2]["tool_calls"]
    body.update(model="tiny-qwen", max_tokens=TOKENS)
    with httpx.stream("POST", f"{client.base_url}chat/completions", json=body, timeout=300) as stream:
        assert stream.status_code == 200, stream.read()
        *chunks, done = list(sse_json(stream.iter_lines()))
    assert done == "[DONE]"
    assert chunks[-1]["choices"] == [] and chunks[-2]["choices"][0]["finish_reason"] in ("stop", "length")
    assert chunks[-1]["usage"]["prompt_tokens"] == prompt_tokens(tokenizer, body["messages"], body["tools"])
    text = tokenizer.apply_chat_template(prepare_messages(body["messages"], tool_template=True),
                                         tools=body["tools"], add_generation_prompt=True, tokenize=False)
    assert f"<tool_response>\n{MARK}" in text or f"Output: {MARK}" in text  # the tool's output, as text


def test_the_recorded_bodies_are_the_clients_shapes():
    assert recorded("opencode")["tool_choice"] == "auto" and recorded("opencode")["max_tokens"] == 32000
    qwen_code = recorded("qwen_code")
    assert qwen_code["max_tokens"] == 8000
    assert isinstance(qwen_code["messages"][-1]["content"], list)  # the tool's result as text parts
    assert [t["function"]["name"] for name in ("opencode", "qwen_code", "continue")
            for t in recorded(name)["tools"]] == ["bash", "run_shell_command", "Bash"]
