"""Tool calling through the server, driven by the openai SDK.

- A scripted engine (the real app and `EngineClient` in this process) answers with recorded model
  output, cut into the real Qwen tokenizer's pieces: the calls come back parsed, streamed and whole.
- A real server on a tiny random Qwen3-MoE with a Qwen2.5-style tool template: tools and tool
  history reach the template (the prompt is exactly the template's rendering).
- A real server on a tiny random Mixtral whose template cannot take tools (like the demo model):
  Open WebUI's request shape is answered as a plain chat with a warning header.
- `response_format` JSON, enforced by the same grammar machinery as forced calls.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Literal

import httpx
import jsonschema
import openai
import pydantic
import pytest
from transformers import AutoTokenizer

from engine.api import ChatTemplateInfo, GenerationEvent, GenerationRequest, TokenLogprob, Usage
from engine.chat_messages import prepare_messages
from engine.text_stream import IncrementalDetokenizer
from server.json_schemas import INTEGER_LIMIT
from server.testing import RemoteServer, sse_json
from server.tools import WARNING_HEADER
from tests.fixtures.models import build_checkpoint
from tests.fixtures.schemas import varied_schemas
from tests.fixtures.tokenizers import QWEN_TOOLS_TEMPLATE, build_tokenizer
from tests.test_server_faults import InProcessServer, wait_for_health

ONE_THREAD = {"OMP_NUM_THREADS": "1"}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "description": "The time now",
                                         "parameters": {"type": "object", "properties": {}}}}
TOOLS = [WEATHER, TIME]
ASK = [{"role": "user", "content": "What is the weather in Paris, and the time?"}]
HISTORY = ASK + [
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
        {"id": "call_2", "type": "function", "function": {"name": "get_time", "arguments": "{}"}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 21, "sky": "clear"}'},
    {"role": "tool", "tool_call_id": "call_2", "content": "14:05"},
]
TWO_CALLS = ('I will look both up.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
             '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>')


# -- recorded output through a scripted engine ------------------------------------------------
class RecordedEngine:
    """Answers every chat with `output`, one Qwen token's text at a time; records what it was given."""

    model_name, max_model_len, vocab_size = "recorded", 4096, 200_000

    model_names = (model_name,)
    chat_template_info = ChatTemplateInfo(supports_tools=True, source=QWEN_TOOLS_TEMPLATE, model_type="qwen3_moe")
    sampling_defaults: dict = {}

    def __init__(self) -> None:
        self.tokenizer = build_tokenizer("qwen")
        self.output = ""
        self.tools: list[dict] | None = None
        self.messages: list[dict] = []
        self.params = None

    def apply_chat_template(self, messages: list[dict], tools: list[dict] | None = None,
                            template_kwargs: dict | None = None, continue_final: bool = False) -> list[int]:
        self.messages, self.tools = messages, tools
        return [1, 2, 3]

    def validate(self, request: GenerationRequest) -> None:
        pass

    def generate(self, request: GenerationRequest, should_abort: Callable[[], bool]) -> Iterator[GenerationEvent]:
        self.params = request.params
        pieces = token_texts(self.output)
        for piece in pieces:
            logprobs = (TokenLogprob(1, piece, -0.5),) if request.params.top_logprobs is not None else ()
            yield GenerationEvent(piece, (1,), logprobs)
        yield GenerationEvent("", (2,), finish_reason="stop", usage=Usage(3, len(pieces) + 1))

    def cache_counters(self) -> dict[str, int]:
        return {}

    def close(self) -> None:
        pass


def token_texts(text: str) -> list[str]:
    """The text as the engine streams it: the Qwen tokenizer's ids, detokenized one at a time."""
    tokenizer = build_tokenizer("qwen")
    detokenizer = IncrementalDetokenizer(lambda ids: tokenizer.decode(ids, skip_special_tokens=True))
    return [detokenizer.push(i) for i in tokenizer.encode(text, add_special_tokens=False)]


class ThinkingRecordedEngine(RecordedEngine):
    """The tool tests' scripted engine with a template that thinks in `<think>` blocks; it also records
    the template's variables."""

    chat_template_info = ChatTemplateInfo(supports_tools=True, source=QWEN_TOOLS_TEMPLATE + "{# <think> #}",
                                          model_type="qwen3_moe")

    def __init__(self) -> None:
        super().__init__()
        self.template_kwargs: dict | None = None

    def apply_chat_template(self, messages, tools=None, template_kwargs=None, continue_final=False) -> list[int]:
        self.template_kwargs = template_kwargs
        return super().apply_chat_template(messages, tools, template_kwargs)

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)


@pytest.fixture(scope="module")
def recorded():
    engine = RecordedEngine()
    with InProcessServer(lambda: engine) as srv:
        wait_for_health(srv.url, 200)
        yield engine, openai.OpenAI(base_url=f"{srv.url}/v1", api_key="x", max_retries=0), srv.url


def test_recorded_output_is_streamed_in_many_pieces():
    assert len(token_texts(TWO_CALLS)) > 30


def test_calls_come_back_whole_and_the_sdk_stream_helper_accumulates_the_same(recorded):
    engine, client, _ = recorded
    engine.output = TWO_CALLS
    full = client.chat.completions.create(model="recorded", messages=ASK, tools=TOOLS)
    with client.chat.completions.stream(model="recorded", messages=ASK, tools=TOOLS) as stream:
        streamed = stream.get_final_completion()

    assert engine.tools == TOOLS  # offered to the template as given
    for completion in (full, streamed):
        choice = completion.choices[0]
        assert choice.finish_reason == "tool_calls"
        assert choice.message.content == "I will look both up."
        calls = choice.message.tool_calls
        assert [(c.type, c.function.name, json.loads(c.function.arguments)) for c in calls] == [
            ("function", "get_weather", {"city": "Paris"}), ("function", "get_time", {})]
        assert len({c.id for c in calls}) == 2 and all(c.id.startswith("call_") for c in calls)


def test_stream_shows_no_markup_and_sends_each_call_as_openai_does(recorded):
    engine, _, url = recorded
    engine.output = TWO_CALLS
    with httpx.stream("POST", f"{url}/v1/chat/completions",
                      json={"messages": ASK, "tools": TOOLS, "stream": True}) as response:
        events = list(sse_json(response.iter_lines()))
    deltas = [e["choices"][0]["delta"] for e in events[:-1]]
    content = "".join(d.get("content") or "" for d in deltas)
    assert content == "I will look both up." and "<" not in content
    calls = [d["tool_calls"][0] for d in deltas if "tool_calls" in d]
    assert calls[0] == {"index": 0, "id": calls[0]["id"], "type": "function",
                        "function": {"name": "get_weather", "arguments": ""}}
    assert calls[1] == {"index": 0, "function": {"arguments": '{"city": "Paris"}'}}
    assert [c["index"] for c in calls] == [0, 0, 1, 1]
    assert events[-2]["choices"][0]["finish_reason"] == "tool_calls" and events[-1] == "[DONE]"


def test_every_tokens_logprob_is_streamed_also_while_text_is_held_back(recorded):
    engine, client, _ = recorded
    engine.output = TWO_CALLS
    chunks = list(client.chat.completions.create(model="recorded", messages=ASK, tools=TOOLS, logprobs=True,
                                                 stream=True))
    streamed = [lp.token for c in chunks if c.choices[0].logprobs for lp in c.choices[0].logprobs.content]
    assert streamed == token_texts(TWO_CALLS)


def test_parallel_tool_calls_false_returns_one_call(recorded):
    engine, client, _ = recorded
    engine.output = TWO_CALLS
    full = client.chat.completions.create(model="recorded", messages=ASK, tools=TOOLS, parallel_tool_calls=False)
    assert [c.function.name for c in full.choices[0].message.tool_calls] == ["get_weather"]


@pytest.mark.parametrize("output", [
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": Paris}}\n</tool_call>',  # not JSON
    '<tool_call>\n{"name": "delete_everything", "arguments": {}}\n</tool_call>',  # not offered
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa',  # cut short
])
def test_malformed_or_partial_calls_come_back_as_content(recorded, output):
    engine, client, _ = recorded
    engine.output = output
    full = client.chat.completions.create(model="recorded", messages=ASK, tools=TOOLS)
    streamed = list(client.chat.completions.create(model="recorded", messages=ASK, tools=TOOLS, stream=True))
    assert full.choices[0].message.content == output and full.choices[0].message.tool_calls is None
    assert full.choices[0].finish_reason == "stop"
    assert "".join(c.choices[0].delta.content or "" for c in streamed) == output
    assert not any(c.choices[0].delta.tool_calls for c in streamed)


def test_tool_choice_none_offers_no_tools_and_reads_no_calls(recorded):
    engine, client, _ = recorded
    engine.output = TWO_CALLS
    full = client.chat.completions.create(model="recorded", messages=ASK, tools=TOOLS, tool_choice="none")
    assert engine.tools is None
    assert full.choices[0].message.content == TWO_CALLS and full.choices[0].finish_reason == "stop"


def test_history_with_tool_calls_reaches_the_engine(recorded):
    engine, client, _ = recorded
    engine.output = "It is 21 degrees and clear; the time is 14:05."
    full = client.chat.completions.create(model="recorded", messages=HISTORY, tools=TOOLS)
    assert full.choices[0].message.content == engine.output and full.choices[0].finish_reason == "stop"
    assert engine.messages[1]["tool_calls"][0]["function"] == {"name": "get_weather",
                                                               "arguments": '{"city": "Paris"}'}
    assert engine.messages[2] == {"role": "tool", "content": HISTORY[2]["content"], "tool_call_id": "call_1",
                                  "name": None}


@pytest.mark.parametrize("body, code, needle", [
    ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, None, "not among the tools"),
    ({"tool_choice": "sometimes"}, None, ""),
    ({"tools": [{"type": "retrieval"}]}, None, ""),
    ({"tools": [{"type": "function", "function": {"description": "no name"}}]}, None, ""),
])
def test_bad_or_unmet_tool_requests_are_400(recorded, body, code, needle):
    _, _, url = recorded
    response = httpx.post(f"{url}/v1/chat/completions", json={"messages": ASK, "tools": TOOLS, **body})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["code"] == code and needle in error["message"]
    assert error["param"].startswith(next(iter(body)))


@pytest.mark.parametrize("choice, names", [
    ("required", {"get_weather", "get_time"}),
    ({"type": "function", "function": {"name": "get_time"}}, {"get_time"}),
])
def test_a_forced_call_decodes_under_a_grammar_of_the_offered_calls(recorded, choice, names):
    engine, client, _ = recorded
    engine.output = TWO_CALLS
    full = client.chat.completions.create(model="recorded", messages=ASK, tools=TOOLS, tool_choice=choice)
    assert engine.tools == TOOLS and engine.params.grammar.startswith('start: "<tool_call>')
    assert {n for n in ("get_weather", "get_time") if f'"const": "{n}"' in engine.params.grammar} == names
    assert len(full.choices[0].message.tool_calls) == 1  # the grammar makes one call


def test_no_grammar_without_a_forced_call(recorded):
    engine, client, _ = recorded
    client.chat.completions.create(model="recorded", messages=ASK, tools=TOOLS)
    assert engine.params.grammar is None and engine.params.skip_special_tokens  # Hermes tags are plain text


# -- a real model with a tool template ------------------------------------------------------
def qwen_tool_checkpoint(folder: Path) -> Path:
    """A tiny random Qwen3-MoE whose chat template takes tools (Qwen2.5's, Hermes-style calls)."""
    build_checkpoint("qwen3_moe", folder)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    tokenizer.chat_template = QWEN_TOOLS_TEMPLATE
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    folder = qwen_tool_checkpoint(tmp_path_factory.mktemp("tiny-qwen-tools"))
    srv = RemoteServer(["--model", str(folder), "--served-model-name", "tiny-qwen", "--device", "cpu"],
                       env=ONE_THREAD)
    with srv:
        yield srv.openai(), AutoTokenizer.from_pretrained(folder)


def prompt_tokens(tokenizer, messages: list[dict], tools: list[dict] | None = None) -> int:
    text = tokenizer.apply_chat_template(prepare_messages(messages, tool_template=True), tools=tools,
                                         add_generation_prompt=True, tokenize=False)
    return len(tokenizer(text, add_special_tokens=False)["input_ids"])


def test_tools_are_rendered_into_the_prompt(qwen):
    client, tokenizer = qwen
    plain = client.chat.completions.create(model="tiny-qwen", messages=ASK, max_tokens=2)
    offered = client.chat.completions.create(model="tiny-qwen", messages=ASK, tools=TOOLS, max_tokens=2)
    assert plain.usage.prompt_tokens == prompt_tokens(tokenizer, ASK)
    assert offered.usage.prompt_tokens == prompt_tokens(tokenizer, ASK, TOOLS) > plain.usage.prompt_tokens + 50
    text = tokenizer.apply_chat_template(ASK, tools=TOOLS, add_generation_prompt=True, tokenize=False)
    assert '"name": "get_weather"' in text  # what those extra tokens are


def test_tool_history_round_trip_streamed_and_not(qwen):
    client, tokenizer = qwen
    kwargs = {"model": "tiny-qwen", "messages": HISTORY, "tools": TOOLS, "max_tokens": 6, "temperature": 0}
    full = client.chat.completions.create(**kwargs)
    chunks = list(client.chat.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}))
    assert full.usage.prompt_tokens == chunks[-1].usage.prompt_tokens == prompt_tokens(tokenizer, HISTORY, TOOLS)
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == (full.choices[0].message.content or "")
    assert full.choices[0].finish_reason == chunks[-2].choices[0].finish_reason


UNIT = {"type": "function", "function": {"name": "set_unit", "description": "Temperature unit", "parameters": {
    "type": "object", "properties": {"unit": {"enum": ["celsius", "fahrenheit"]}}, "required": ["unit"],
    "additionalProperties": False}}}
CLOCK = {"type": "function", "function": {"name": "get_time", "parameters": {  # closed: nothing to invent
    "type": "object", "properties": {}, "additionalProperties": False}}}


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "set_unit"}}])
def test_forced_call_on_a_random_model_is_a_valid_call(qwen, choice):
    client, _ = qwen
    kwargs = {"model": "tiny-qwen", "messages": ASK, "tools": [UNIT, CLOCK], "tool_choice": choice, "max_tokens": 60}
    with client.chat.completions.stream(**kwargs, temperature=0) as stream:
        final = stream.get_final_completion()
    full = client.chat.completions.create(**kwargs, temperature=1.0, seed=3)
    for completion in (final, full):
        choice_ = completion.choices[0]
        assert choice_.finish_reason == "tool_calls" and not choice_.message.content
        (call,) = choice_.message.tool_calls
        arguments = json.loads(call.function.arguments)
        assert (call.function.name, arguments) in (("set_unit", {"unit": "celsius"}),
                                                   ("set_unit", {"unit": "fahrenheit"}), ("get_time", {}))
        if isinstance(choice, dict):
            assert call.function.name == "set_unit"


PLAN = {"type": "object", "properties": {"unit": {"enum": ["celsius", "fahrenheit"]}, "days": {"enum": [1, 2, 3]}},
        "required": ["unit", "days"], "additionalProperties": False}


def sampled_under(client: openai.OpenAI, schema: dict, seeds: int, max_tokens: int) -> Iterator:
    """Completions of the random model under `schema` as `response_format`, one per seed at temperature 1."""
    response_format = {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}}
    for seed in range(seeds):
        yield client.chat.completions.create(model="tiny-qwen", messages=ASK, response_format=response_format,
                                             max_tokens=max_tokens, temperature=1.0, seed=seed)


def test_response_format_json_schema_on_a_random_model_is_valid_json(qwen):
    client, _ = qwen
    for response in sampled_under(client, PLAN, seeds=3, max_tokens=40):
        answer = json.loads(response.choices[0].message.content)
        assert answer["unit"] in ("celsius", "fahrenheit") and answer["days"] in (1, 2, 3) and len(answer) == 2
        assert response.choices[0].finish_reason == "stop"


# As pydantic's model_json_schema() writes a model: no `additionalProperties`, so JSON Schema alone admits any key
OPEN_PLAN = {"type": "object", "properties": {"unit": {"enum": ["celsius", "fahrenheit"]}, "days": {"enum": [1, 2, 3]},
                                              "where": {"type": "object", "properties": {"city": {"enum": ["Paris"]}}}},
             "required": ["unit"]}
OPEN_UNIT = {"type": "function", "function": {"name": "set_plan", "parameters": OPEN_PLAN}}


def keys_are_declared(value: object, schema: dict) -> bool:
    """Whether every object in `value` has only the keys its schema lists (OPEN_PLAN's shape)."""
    if not isinstance(value, dict):
        return True
    properties = schema.get("properties", {})
    return set(value) <= set(properties) and all(keys_are_declared(v, properties[k]) for k, v in value.items())


def test_response_format_schema_without_additional_properties_gets_only_its_keys(qwen):
    client, _ = qwen
    for response in sampled_under(client, OPEN_PLAN, seeds=4, max_tokens=80):
        answer = json.loads(response.choices[0].message.content)
        jsonschema.validate(answer, OPEN_PLAN)
        assert keys_are_declared(answer, OPEN_PLAN), answer
        assert response.choices[0].finish_reason == "stop"


def test_response_format_integers_end_within_sixteen_digits(qwen):
    client, _ = qwen
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    for response in sampled_under(client, schema, seeds=6, max_tokens=30):
        assert response.choices[0].finish_reason == "stop", response.choices[0].message.content
        assert abs(json.loads(response.choices[0].message.content)["n"]) <= INTEGER_LIMIT


class Cat(pydantic.BaseModel):
    kind: Literal["cat"]
    lives: int = pydantic.Field(ge=1, le=9)


class Dog(pydantic.BaseModel):
    kind: Literal["dog"]
    good: bool


# Keywords pydantic writes that the grammar library does not enforce: `oneOf` (a discriminated union),
# `uniqueItems` (a set) and an unknown string `format` (a SecretStr's "password"). No docstring: it would be
# the schema's description, and the tool list must fit the tiny model's context.
class Pet(pydantic.BaseModel):
    pet: Cat | Dog = pydantic.Field(discriminator="kind")
    tags: set[Literal["small", "old"]] = pydantic.Field(max_length=2)
    secret: pydantic.SecretStr = pydantic.Field(max_length=4)


def test_response_format_of_a_pydantic_model_with_sets_unions_and_secrets_parses_back(qwen):
    client, _ = qwen
    schema = Pet.model_json_schema()
    for response in sampled_under(client, schema, seeds=3, max_tokens=120):
        assert response.choices[0].finish_reason == "stop", response.choices[0].message.content
        Pet.model_validate_json(response.choices[0].message.content)


def test_forced_call_with_a_pydantic_models_parameters_parses_back(qwen):
    client, _ = qwen
    tool = {"type": "function", "function": {"name": "adopt", "parameters": Pet.model_json_schema()}}
    response = client.chat.completions.create(model="tiny-qwen", messages=ASK, tools=[tool], tool_choice="required",
                                              max_tokens=56, temperature=1.0, seed=0)  # as much as the context leaves
    (call,) = response.choices[0].message.tool_calls
    Pet.model_validate_json(call.function.arguments)


def test_forced_call_arguments_without_additional_properties_get_only_their_keys(qwen):
    client, _ = qwen
    for seed in range(4):
        response = client.chat.completions.create(model="tiny-qwen", messages=ASK, tools=[OPEN_UNIT], tool_choice="required",
                                                  max_tokens=80, temperature=1.0, seed=seed)
        (call,) = response.choices[0].message.tool_calls
        arguments = json.loads(call.function.arguments)
        jsonschema.validate(arguments, OPEN_PLAN)
        assert keys_are_declared(arguments, OPEN_PLAN), arguments


@pytest.mark.parametrize("seed, name, schema", [(i, *named) for i, named in enumerate(varied_schemas(8))])
def test_response_format_strict_schemas_of_every_shape_give_valid_json(qwen, seed, name, schema):
    client, _ = qwen
    response_format = {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}}
    response = client.chat.completions.create(model="tiny-qwen", messages=ASK, response_format=response_format,
                                              max_tokens=300, temperature=1.0, seed=seed)
    assert response.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(response.choices[0].message.content), schema)


def test_response_format_json_object_and_forced_call_do_not_mix(recorded):
    engine, client, url = recorded
    engine.output = '{"a": 1}'
    client.chat.completions.create(model="recorded", messages=ASK, response_format={"type": "json_object"})
    assert engine.params.grammar.startswith('start: %json {"type": "object"')
    response = httpx.post(f"{url}/v1/chat/completions", json={
        "messages": ASK, "tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}})
    assert response.status_code == 400 and response.json()["error"]["param"] == "response_format"


def test_tool_choice_none_leaves_the_tools_out(qwen):
    client, tokenizer = qwen
    response = client.chat.completions.create(model="tiny-qwen", messages=ASK, tools=TOOLS, tool_choice="none",
                                              max_tokens=2)
    assert response.usage.prompt_tokens == prompt_tokens(tokenizer, ASK)


# -- a model whose template cannot take tools (like the demo model) ----------------------------
def open_webui_tools(n: int = 30) -> list[dict]:
    """Tools as Open WebUI sends them: a function per installed tool, JSON-schema parameters."""
    return [{"type": "function", "function": {
        "name": f"tool_{i}", "description": f"Tool number {i} of the workspace",
        "parameters": {"type": "object", "properties": {"query": {"type": "string", "description": "what to do"},
                                                        "limit": {"type": "integer"}}, "required": ["query"]}}}
        for i in range(n)]


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    folder = build_checkpoint("mixtral", tmp_path_factory.mktemp("tiny-mixtral-plain"))
    srv = RemoteServer(["--model", str(folder), "--served-model-name", "tiny-plain", "--device", "cpu"],
                       env=ONE_THREAD)
    with srv:
        yield srv, AutoTokenizer.from_pretrained(folder)


def test_open_webui_request_with_30_tools_streams_a_plain_answer_with_a_warning(plain):
    srv, tokenizer = plain
    body = {"model": "tiny-plain", "messages": ASK, "tools": open_webui_tools(), "stream": True, "max_tokens": 8,
            "stream_options": {"include_usage": True}}
    with srv.http() as http, http.stream("POST", "/v1/chat/completions", json=body) as response:
        assert response.status_code == 200
        warning = response.headers[WARNING_HEADER]
        events = list(sse_json(response.iter_lines()))
    assert "cannot take tools" in warning and "30 tools" in warning
    assert events[-1] == "[DONE]" and not any("error" in e for e in events[:-1])
    text = "".join(e["choices"][0]["delta"].get("content") or "" for e in events[:-1] if e["choices"])
    assert text and events[-3]["choices"][0]["finish_reason"] == "length"
    ids = tokenizer(tokenizer.apply_chat_template(ASK, add_generation_prompt=True, tokenize=False),
                    add_special_tokens=False)["input_ids"]
    assert events[-2]["usage"]["prompt_tokens"] == len(ids)  # tools not rendered
    assert srv.log().count(warning) == 1  # logged once for the request


def test_plain_template_warns_also_with_tool_choice_none(plain):
    srv, _ = plain
    response = srv.openai().chat.completions.with_raw_response.create(model="tiny-plain", messages=ASK, tools=TOOLS,
                                                                      tool_choice="none", max_tokens=1)
    assert "cannot take tools" in response.headers[WARNING_HEADER]


def test_plain_template_renders_tool_history_as_text(plain):
    srv, tokenizer = plain
    response = srv.openai().chat.completions.with_raw_response.create(model="tiny-plain", messages=HISTORY,
                                                                      tools=TOOLS, max_tokens=2)
    assert WARNING_HEADER in response.headers
    text = tokenizer.apply_chat_template(prepare_messages(HISTORY, tool_template=False), add_generation_prompt=True,
                                         tokenize=False)
    assert "Tool call get_weather" in text and "Result of tool call call_2:\n14:05" in text
    assert response.parse().usage.prompt_tokens == len(tokenizer(text, add_special_tokens=False)["input_ids"])


def test_plain_template_without_tools_has_no_warning(plain):
    srv, _ = plain
    response = srv.openai().chat.completions.with_raw_response.create(model="tiny-plain", messages=ASK, max_tokens=1)
    assert WARNING_HEADER not in response.headers


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_time"}}])
def test_plain_template_refuses_a_forced_call(plain, choice):
    srv, _ = plain
    with pytest.raises(openai.BadRequestError, match="cannot call tools") as e:
        srv.openai().chat.completions.create(model="tiny-plain", messages=ASK, tools=TOOLS, tool_choice=choice)
    assert e.value.body["param"] == "tool_choice"
