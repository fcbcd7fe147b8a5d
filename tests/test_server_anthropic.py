"""Anthropic's Messages API (`/v1/messages`, `/v1/messages/count_tokens`), driven by the anthropic SDK
and by raw httpx with a hand-written SSE parser that reads the `event:` names too.

- A real server (`--api-key`, sent as Anthropic's `x-api-key`) on a tiny random Qwen3-MoE with a
  tool template: greedy answers equal chat's, streamed equals whole, stop sequences, token counts,
  errors in Anthropic's shape around OpenAI's keys.
- The scripted engine of the tool tests (recorded output, real Qwen tokenizer): tool calls and
  thinking come back as blocks, and tool history reaches the template as chat's.
"""

from __future__ import annotations

import json

import anthropic
import httpx
import pytest

from server.testing import RemoteServer
from tests.test_server_faults import InProcessServer, ScriptedEngine, wait_for_health
from tests.test_server_tools import (
    ASK,
    HISTORY,
    TOOLS,
    TWO_CALLS,
    ThinkingRecordedEngine,
    qwen_tool_checkpoint,
)

MODEL = "tiny-qwen"
ALIAS = "claude-sonnet-4-5"  # a second --served-model-name, as Claude Code sends by default
KEY = "sk-ant-test"
ERROR_KEYS = {"message", "type", "param", "code"}
HELLO = [{"role": "user", "content": "Hello, who are you?"}]
BODY = {"model": MODEL, "messages": HELLO, "max_tokens": 10}
GREEDY = {**BODY, "temperature": 0}  # for raw requests and the openai SDK
SDK_GREEDY = {**BODY, "extra_body": {"temperature": 0}}  # the anthropic SDK (2.x) has no `temperature` argument
WEATHER = {"name": "get_weather", "description": "Current weather in a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
CLOCK = {"name": "get_time", "description": "The time now", "input_schema": {"type": "object", "properties": {}}}
ANTHROPIC_TOOLS = [WEATHER, CLOCK]


def named_events(lines) -> list[tuple[str | None, str]]:
    """(event name, data) of each event in a text/event-stream; comments (`: ping`) are skipped."""
    events, name, data = [], None, []
    for line in lines:
        if line == "":
            if data:
                events.append((name, "\n".join(data)))
            name, data = None, []
        elif not line.startswith(":"):
            field, _, value = line.partition(":")
            value = value[1:] if value.startswith(" ") else value
            if field == "event":
                name = value
            elif field == "data":
                data.append(value)
    return events


def stream_events(url: str, body: dict, headers: dict | None = None) -> list[dict]:
    """The stream's events, parsed, each checked to be named as its data's `type`."""
    with httpx.stream("POST", f"{url}/v1/messages", json={**body, "stream": True}, headers=headers or {},
                      timeout=60) as response:
        assert response.status_code == 200, response.read()
        assert response.headers["content-type"].startswith("text/event-stream")
        events = named_events(response.iter_lines())
    assert all(data != "[DONE]" for _, data in events)
    parsed = [json.loads(data) for _, data in events]
    assert [name for name, _ in events] == [event["type"] for event in parsed]
    return parsed


def blocks_of(events: list[dict]) -> list[dict]:
    """The content blocks a stream built: each start, with its deltas applied."""
    blocks: list[dict] = []
    for event in events:
        if event["type"] == "content_block_start":
            assert event["index"] == len(blocks)
            blocks.append({**event["content_block"], "partial_json": ""})
        elif event["type"] == "content_block_delta":
            delta, block = event["delta"], blocks[event["index"]]
            key = {"text_delta": "text", "thinking_delta": "thinking", "input_json_delta": "partial_json"}[
                delta["type"]]
            block[key] += delta[key]
    for block in blocks:
        if block["type"] == "tool_use":
            block["input"] = json.loads(block["partial_json"])
        del block["partial_json"]
    return blocks


def assert_error_shape(response: httpx.Response, status: int, error_type: str) -> dict:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"type", "error"} and body["type"] == "error"
    assert set(body["error"]) == ERROR_KEYS and body["error"]["type"] == error_type and body["error"]["message"]
    return body["error"]


# -- a real server ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def server(tmp_path_factory):
    folder = qwen_tool_checkpoint(tmp_path_factory.mktemp("tiny-qwen-anthropic"))
    srv = RemoteServer(["--model", str(folder), "--served-model-name", f"{MODEL},{ALIAS}", "--device", "cpu"],
                       env={"MOE_SERVE_API_KEY": KEY, "OMP_NUM_THREADS": "1"}, api_key=KEY)
    with srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return anthropic.Anthropic(base_url=server.url, api_key=KEY, max_retries=0, timeout=60)  # sends x-api-key


def prompt_tokens(usage) -> int:
    return usage.input_tokens + usage.cache_read_input_tokens


def test_greedy_message_equals_the_chat_completion_and_counts_the_same(server, client):
    message = client.messages.create(**SDK_GREEDY, metadata={"user_id": "someone"})  # accepted, unused
    chat = server.openai().chat.completions.create(**GREEDY)

    assert message.id.startswith("msg_") and message.type == "message" and message.role == "assistant"
    assert message.model == MODEL
    (block,) = message.content
    assert block.type == "text" and block.text == chat.choices[0].message.content
    assert message.stop_reason == "max_tokens" and chat.choices[0].finish_reason == "length"
    assert message.stop_sequence is None
    assert prompt_tokens(message.usage) == chat.usage.prompt_tokens
    assert message.usage.output_tokens == chat.usage.completion_tokens == GREEDY["max_tokens"]
    assert message.usage.cache_creation_input_tokens == 0
    again = client.messages.create(**SDK_GREEDY)  # the prompt's head is in the prefix cache now
    assert again.content == message.content and prompt_tokens(again.usage) == chat.usage.prompt_tokens
    assert again.usage.cache_read_input_tokens > 0  # Anthropic's input_tokens leave those out


def test_stream_events_in_order_and_their_deltas_make_the_whole_message(server, client):
    whole = client.messages.create(**SDK_GREEDY)
    events = stream_events(server.url, GREEDY, {"x-api-key": KEY})

    names = [e["type"] for e in events]
    assert names == ["message_start", "content_block_start", *["content_block_delta"] * (len(names) - 5),
                     "content_block_stop", "message_delta", "message_stop"] and len(names) > 5
    start = events[0]["message"]
    assert start["id"].startswith("msg_") and start["content"] == [] and start["stop_reason"] is None
    assert start["model"] == MODEL and start["usage"]["output_tokens"] == 0
    assert start["usage"]["input_tokens"] == prompt_tokens(whole.usage)
    assert blocks_of(events) == [{"type": "text", "text": whole.content[0].text}]
    delta = events[-2]
    assert delta["delta"] == {"stop_reason": "max_tokens", "stop_sequence": None}
    assert delta["usage"]["output_tokens"] == whole.usage.output_tokens
    assert delta["usage"]["input_tokens"] + delta["usage"]["cache_read_input_tokens"] == prompt_tokens(whole.usage)


def test_the_sdk_stream_helper_gives_the_same_final_message(client):
    whole = client.messages.create(**SDK_GREEDY)
    with client.messages.stream(**SDK_GREEDY) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == whole.content[0].text
    assert [(b.type, b.text) for b in final.content] == [(b.type, b.text) for b in whole.content]
    assert final.stop_reason == whole.stop_reason
    assert final.usage.output_tokens == whole.usage.output_tokens
    assert prompt_tokens(final.usage) == prompt_tokens(whole.usage)


def test_a_stop_sequence_is_reported_with_the_one_that_matched(server, client):
    text = client.messages.create(**{**SDK_GREEDY, "max_tokens": 12}).content[0].text
    cut = next(i for i in range(2, len(text) - 2) if text.find(text[i: i + 2]) == i)
    stop = text[cut: cut + 2]
    body = {**GREEDY, "max_tokens": 12, "stop_sequences": ["never-appears", stop]}
    message = client.messages.create(**{**SDK_GREEDY, "max_tokens": 12, "stop_sequences": body["stop_sequences"]})
    assert (message.stop_reason, message.stop_sequence) == ("stop_sequence", stop)
    assert message.content[0].text == text[:cut]
    events = stream_events(server.url, body, {"x-api-key": KEY})
    assert events[-2]["delta"] == {"stop_reason": "stop_sequence", "stop_sequence": stop}


def test_count_tokens_is_the_prompt_a_request_reads_tools_included(client):
    system = [{"type": "text", "text": "You are terse.", "cache_control": {"type": "ephemeral"}}]
    kwargs = {"model": MODEL, "messages": HELLO, "system": system, "tools": ANTHROPIC_TOOLS}
    counted = client.messages.count_tokens(**kwargs).input_tokens
    message = client.messages.create(**kwargs, max_tokens=1)
    assert counted == prompt_tokens(message.usage)
    without_tools = client.messages.count_tokens(model=MODEL, messages=HELLO, system=system).input_tokens
    assert counted > without_tools + 50  # the tool list is in the prompt


ANTHROPIC_HISTORY = ASK + [  # the tool tests' chat HISTORY, as Anthropic's blocks
    {"role": "assistant", "content": [
        {"type": "tool_use", "id": "call_1", "name": "get_weather", "input": {"city": "Paris"}},
        {"type": "tool_use", "id": "call_2", "name": "get_time", "input": {}}]},
    {"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "call_1", "content": '{"temperature": 21, "sky": "clear"}'},
        {"type": "tool_result", "tool_use_id": "call_2", "content": [{"type": "text", "text": "14:05"}]}]},
]


def test_a_last_assistant_turn_is_a_prefill_the_answer_continues(server, client):
    """Anthropic's prefill: the prompt ends inside the assistant's started text (no end of its turn), as chat's
    `continue_final_message`; the answer holds only what follows it."""
    started = [*HELLO, {"role": "assistant", "content": "I am a"}]
    counted = client.messages.count_tokens(model=MODEL, messages=started).input_tokens
    chat = server.openai().chat.completions.create(model=MODEL, messages=started, max_tokens=1,
                                                   extra_body={"continue_final_message": True})
    new_turn = server.openai().chat.completions.create(model=MODEL, messages=started, max_tokens=1,
                                                       extra_body={"continue_final_message": False})
    assert counted == chat.usage.prompt_tokens < new_turn.usage.prompt_tokens
    message = client.messages.create(**{**SDK_GREEDY, "messages": started})
    continued = server.openai().chat.completions.create(**{**GREEDY, "messages": started})
    assert message.content[0].text == continued.choices[0].message.content
    assert prompt_tokens(message.usage) == counted


def test_tool_history_renders_the_same_prompt_as_the_chat_history_it_means(server, client):
    counted = client.messages.count_tokens(model=MODEL, messages=ANTHROPIC_HISTORY, tools=ANTHROPIC_TOOLS)
    chat = server.openai().chat.completions.create(model=MODEL, messages=HISTORY, tools=TOOLS, max_tokens=1)
    assert counted.input_tokens == chat.usage.prompt_tokens


def test_the_key_as_x_api_key_or_bearer_and_a_wrong_one_is_401_in_both_shapes(server):
    url = f"{server.url}/v1/messages"
    body = {**GREEDY, "max_tokens": 1}
    assert httpx.post(url, json=body, headers={"x-api-key": KEY}, timeout=60).status_code == 200
    assert httpx.post(url, json=body, headers={"Authorization": f"Bearer {KEY}"}, timeout=60).status_code == 200
    for headers in ({"x-api-key": "wrong"}, {}, {"Authorization": "Bearer wrong"}):
        error = assert_error_shape(httpx.post(url, json=body, headers=headers), 401, "authentication_error")
        assert error["code"] == "invalid_api_key"
    chat = httpx.post(f"{server.url}/v1/chat/completions", json=body, headers={"x-api-key": "wrong"})
    assert chat.status_code == 401 and set(chat.json()) == {"error"}  # OpenAI's paths keep OpenAI's shape
    wrong = anthropic.Anthropic(base_url=server.url, api_key="wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError):
        wrong.messages.create(**BODY)


def test_max_tokens_beyond_the_context_is_cut_to_it(server, client):
    """Claude Code asks for 32,000 tokens whatever the model: the answer ends where the context does."""
    context = server.openai().models.list().data[0].max_model_len
    message = client.messages.create(**{**SDK_GREEDY, "max_tokens": 32_000})
    used = prompt_tokens(message.usage) + message.usage.output_tokens
    assert context < 32_000 and used <= context
    assert message.stop_reason == ("max_tokens" if used == context else "end_turn"), (used, context)


IMAGE = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}}


@pytest.mark.parametrize("change, param, needle", [
    ({"max_tokens": None}, "max_tokens", "required"),
    ({"messages": []}, "messages", ""),
    ({"messages": [{"role": "system", "content": "hi"}]}, "messages", "user turn"),
    ({"messages": [*HELLO, {"role": "system", "content": [{"type": "tool_result", "tool_use_id": "t"}]}]},
     "messages[1].content[0]", "system turn"),
    ({"messages": [{"role": "user", "content": [IMAGE]}]}, "messages[0].content[0]", "'image'"),
    ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools", "web_search_20250305"),
    ({"tools": [{"type": "bash_20250124", "name": "bash"}]}, "tools", "bash_20250124"),
    ({"tool_choice": {"type": "tool"}, "tools": [WEATHER]}, "tool_choice.name", ""),
    ({"tool_choice": {"type": "tool", "name": "nope"}, "tools": [WEATHER]}, "tool_choice", "not among the tools"),
    ({"messages": [*HELLO, {"role": "assistant", "content": " "}]}, "messages[1].content", "prefill"),
    ({"messages": [*HELLO, {"role": "assistant", "content": [
        {"type": "tool_use", "id": "t", "name": "get_weather", "input": {}}]}]}, "messages[1].content", "prefill"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_use", "id": "t", "name": "x", "input": {}}]}]},
     "messages[0].content[0]", "user turn"),
    ({"stop_sequences": ["x" * 300]}, "stop_sequences", "stop_sequences"),
])
def test_bad_requests_are_400_in_the_anthropic_shape(server, change, param, needle):
    body = {k: v for k, v in {**GREEDY, **change}.items() if v is not None}
    response = httpx.post(f"{server.url}/v1/messages", json=body, headers={"x-api-key": KEY})
    error = assert_error_shape(response, 400, "invalid_request_error")
    assert error["param"] == param and needle in error["message"], error


def test_a_second_served_name_is_answered_under_that_name(server, client):
    message = client.messages.create(**{**SDK_GREEDY, "model": ALIAS})
    assert message.model == ALIAS and message.content == client.messages.create(**SDK_GREEDY).content
    assert [card.id for card in server.openai().models.list()] == [MODEL, ALIAS]
    assert server.openai().models.retrieve(ALIAS).id == ALIAS


def test_an_unknown_model_is_404_not_found_error(server, client):
    response = httpx.post(f"{server.url}/v1/messages", json={**GREEDY, "model": "claude-x"}, headers={"x-api-key": KEY})
    assert assert_error_shape(response, 404, "not_found_error")["code"] == "model_not_found"
    with pytest.raises(anthropic.NotFoundError):
        client.messages.count_tokens(model="claude-x", messages=HELLO)


# -- scripted output: tool calls and thinking -----------------------------------------------------
@pytest.fixture(scope="module")
def recorded():
    engine = ThinkingRecordedEngine()
    with InProcessServer(lambda: engine) as srv:
        wait_for_health(srv.url, 200)
        yield engine, anthropic.Anthropic(base_url=srv.url, api_key="x", max_retries=0), srv.url


CALLS = [("get_weather", {"city": "Paris"}), ("get_time", {})]


def test_tool_calls_come_back_as_tool_use_blocks_whole_and_streamed(recorded):
    engine, client, url = recorded
    engine.output = TWO_CALLS
    body = {"model": "recorded", "messages": ASK, "max_tokens": 100, "tools": ANTHROPIC_TOOLS}
    message = client.messages.create(**body)
    assert engine.tools == TOOLS  # offered to the template as chat offers them
    assert message.stop_reason == "tool_use" and message.stop_sequence is None
    text, *calls = message.content
    assert (text.type, text.text) == ("text", "I will look both up.")
    assert [(c.type, c.name, c.input) for c in calls] == [("tool_use", *call) for call in CALLS]
    assert len({c.id for c in calls}) == 2 and all(c.id.startswith("toolu_") for c in calls)

    events = stream_events(url, body)
    streamed = blocks_of(events)
    assert [(b["type"], b.get("text") or b.get("name"), b.get("input")) for b in streamed] == [
        ("text", "I will look both up.", None), *[("tool_use", *call) for call in CALLS]]
    starts = [e["content_block"] for e in events if e["type"] == "content_block_start"]
    assert starts[1] == {"type": "tool_use", "id": starts[1]["id"], "name": "get_weather", "input": {}}
    assert events[-2]["delta"]["stop_reason"] == "tool_use"
    with client.messages.stream(**body) as stream:
        final = stream.get_final_message()
    assert [(c.type, c.name, c.input) for c in final.content[1:]] == [("tool_use", *call) for call in CALLS]


def test_tool_choice_maps_to_chats(recorded):
    engine, client, _ = recorded
    engine.output = TWO_CALLS
    body = {"model": "recorded", "messages": ASK, "max_tokens": 100, "tools": ANTHROPIC_TOOLS}
    one = client.messages.create(**body, tool_choice={"type": "auto", "disable_parallel_tool_use": True})
    assert [c.name for c in one.content if c.type == "tool_use"] == ["get_weather"]
    client.messages.create(**body, tool_choice={"type": "tool", "name": "get_time"})
    assert '"const": "get_time"' in engine.params.grammar and '"const": "get_weather"' not in engine.params.grammar
    client.messages.create(**body, tool_choice={"type": "any"})
    assert engine.params.grammar.startswith('start: "<tool_call>')
    none = client.messages.create(**body, tool_choice={"type": "none"})
    assert engine.tools is None and none.stop_reason == "end_turn" and none.content[0].text == TWO_CALLS


def test_tool_use_and_tool_result_history_reaches_the_template_as_chat_turns(recorded):
    engine, client, _ = recorded
    engine.output = "It is 21 degrees and clear; the time is 14:05."
    history = [*ASK, {"role": "assistant", "content": [
        {"type": "thinking", "thinking": "Two lookups.", "signature": ""},
        {"type": "text", "text": "I will look both up."},
        {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}},
        {"type": "tool_use", "id": "toolu_2", "name": "get_time", "input": {}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "21, clear"}]},
            {"type": "tool_result", "tool_use_id": "toolu_2", "content": "no clock", "is_error": True},
            {"type": "text", "text": "Thanks."}]}]
    message = client.messages.create(model="recorded", messages=history, max_tokens=100, tools=ANTHROPIC_TOOLS,
                                     system="Be brief.")
    assert message.content[0].text == engine.output and message.stop_reason == "end_turn"
    system, user, assistant, weather, clock, thanks = engine.messages
    assert system == {"role": "system", "content": "Be brief."} and user == ASK[0]
    assert assistant["content"] == "I will look both up." and assistant["reasoning_content"] == "Two lookups."
    assert [c["id"] for c in assistant["tool_calls"]] == ["toolu_1", "toolu_2"]
    assert [json.loads(c["function"]["arguments"]) for c in assistant["tool_calls"]] == [{"city": "Paris"}, {}]
    assert weather == {"role": "tool", "content": "21, clear", "tool_call_id": "toolu_1", "name": None}
    assert clock["content"] == "Error: no clock" and clock["tool_call_id"] == "toolu_2"
    assert thanks == {"role": "user", "content": "Thanks."}


def test_a_system_turn_mid_conversation_reaches_the_template_in_its_place(recorded):
    engine, client, _ = recorded
    engine.output = "Hello."
    reminder = [{"type": "text", "text": "Agent types: Explore."}, {"type": "text", "text": "Skills: none."}]
    turns = [{"role": "user", "content": "Say hello"}, {"role": "system", "content": reminder}]
    message = client.messages.create(model="recorded", messages=turns, max_tokens=20, system="You are an agent.")
    assert message.content[0].text == "Hello."
    assert engine.messages == [{"role": "system", "content": "You are an agent."}, {"role": "user", "content": "Say hello"},
                               {"role": "system", "content": "Agent types: Explore.\n\nSkills: none."}]


THOUGHT = "<think>\nThe user wants the weather.\n</think>\n\nIt is sunny."


def test_thinking_comes_back_as_a_thinking_block_first(recorded):
    engine, client, url = recorded
    engine.output = THOUGHT
    body = {"model": "recorded", "messages": ASK, "max_tokens": 2048,  # more than the budget, as Anthropic requires
            "thinking": {"type": "enabled", "budget_tokens": 1024}}
    message = client.messages.create(**body)
    assert engine.template_kwargs == {"enable_thinking": True}
    assert [b.model_dump() for b in message.content] == [
        {"type": "thinking", "thinking": "The user wants the weather.", "signature": ""},
        {"type": "text", "text": "It is sunny.", "citations": None}]
    streamed = blocks_of(stream_events(url, body))
    assert streamed == [{"type": "thinking", "thinking": "The user wants the weather.", "signature": ""},
                        {"type": "text", "text": "It is sunny."}]
    client.messages.create(**{**body, "thinking": {"type": "disabled"}})
    assert engine.template_kwargs == {"enable_thinking": False}


def test_output_config_is_a_json_schema_grammar_and_a_reasoning_effort(recorded):
    engine, client, _ = recorded
    engine.output = '{"unit": "celsius"}'
    schema = {"type": "object", "properties": {"unit": {"enum": ["celsius", "fahrenheit"]}}, "required": ["unit"]}
    message = client.messages.create(model="recorded", messages=ASK, max_tokens=100,
                                      output_config={"format": {"type": "json_schema", "schema": schema},
                                                     "effort": "max"})
    assert engine.params.grammar.startswith("start: %json") and '"celsius"' in engine.params.grammar
    assert engine.template_kwargs == {"reasoning_effort": "high"}
    assert json.loads(message.content[0].text) == {"unit": "celsius"}


# -- an engine that fails mid-generation --------------------------------------------------------------
def test_an_error_after_the_stream_started_is_an_error_event_and_before_it_a_500_in_anthropic_shape():
    with InProcessServer(lambda: ScriptedEngine(fail=True)) as srv:
        wait_for_health(srv.url, 200)
        body = {"model": "scripted", "messages": HELLO, "max_tokens": 10}
        with httpx.stream("POST", f"{srv.url}/v1/messages", json={**body, "stream": True}) as response:
            events = named_events(response.iter_lines())
        assert [name for name, _ in events] == ["message_start", "content_block_start", "content_block_delta",
                                                "content_block_delta", "error"]
        error = json.loads(events[-1][1])
        assert error["type"] == "error" and set(error["error"]) == ERROR_KEYS
        assert error["error"]["type"] == "api_error" and "fell off the bus" in error["error"]["message"]
        whole = httpx.post(f"{srv.url}/v1/messages", json=body)
        assert assert_error_shape(whole, 500, "api_error")["code"] == "internal_error"
