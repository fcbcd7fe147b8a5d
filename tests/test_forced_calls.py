"""Forced tool calls (`tool_choice` required or a named function) in every tool-call format but Hermes
(tested in test_constraint.py): a tiny random model with that family's tokenizer markers and a
template in its shape. Whatever the random model prefers, the output parses back as exactly one call
to an offered function, its arguments valid under the function's JSON schema, its markers written as
the tokenizer's added tokens where it has them."""

from __future__ import annotations

import json

import jsonschema
import pytest
from transformers import AutoTokenizer

from engine.api import GenerationRequest, SamplingParams
from engine.config import EngineConfig
from engine.constraint import added_token_ids
from engine.engine import Engine
from server import protocol as p
from server.tools import plan_tools
from tests.fixtures import tool_templates
from tests.fixtures.models import build_checkpoint

UNIT = {"type": "function", "function": {"name": "set_unit", "description": "Temperature unit", "parameters": {
    "type": "object", "additionalProperties": False, "required": ["unit", "days"],
    "properties": {"unit": {"enum": ["celsius", "fahrenheit"]}, "days": {"type": "integer", "minimum": 1, "maximum": 3},
                   "note": {"type": "string", "maxLength": 8}}}}}
COLOR = {"type": "function", "function": {"name": "pick_color", "parameters": {
    "type": "object", "additionalProperties": False, "required": ["color", "bright"],
    "properties": {"color": {"type": "string", "enum": ["red", "green"]}, "bright": {"type": "boolean"}}}}}
TOOLS = [UNIT, COLOR]
ASK = [{"role": "user", "content": "Set it up, please."}]

# format: (model family, tokenizer kind, template, a marker that must come out as its one added token)
FORMATS = {
    "mistral": ("mixtral", "mistral_v3", tool_templates.MISTRAL_TOOLS_TEMPLATE, "[TOOL_CALLS]"),
    "deepseek_v3": ("deepseek_v3", "deepseek", tool_templates.DEEPSEEK_V3_TOOLS_TEMPLATE, "<｜tool▁calls▁begin｜>"),
    "harmony": ("qwen3_moe", "harmony", tool_templates.HARMONY_TOOLS_TEMPLATE, "<|channel|>"),
    "glm45": ("qwen3_moe", "glm45", tool_templates.GLM45_TOOLS_TEMPLATE, "<tool_call>"),
    "qwen3_coder": ("qwen3_moe", "qwen3_coder", tool_templates.QWEN3_CODER_TOOLS_TEMPLATE, "<tool_call>"),
    "minimax_m2": ("qwen3_moe", "minimax_m2", tool_templates.MINIMAX_M2_TOOLS_TEMPLATE, "<minimax:tool_call>"),
    "kimi_k2": ("qwen3_moe", "kimi_k2", tool_templates.KIMI_K2_TOOLS_TEMPLATE, "<|tool_call_argument_begin|>"),
    "gemma4": ("qwen3_moe", "gemma4", tool_templates.GEMMA4_TOOLS_TEMPLATE, "<|tool_call>"),
    "llama4": ("qwen3_moe", "llama4", tool_templates.LLAMA4_TOOLS_TEMPLATE, None),  # plain JSON: no marker token
    "granite": ("qwen3_moe", "granite", tool_templates.GRANITE_TOOLS_TEMPLATE, "<|tool_call|>"),
    "lfm2": ("qwen3_moe", "lfm2", tool_templates.LFM2_TOOLS_TEMPLATE, "<|tool_call_start|>"),
    "hunyuan": ("qwen3_moe", "qwen", tool_templates.HUNYUAN_TOOLS_TEMPLATE, None),  # its tags as plain text here
}


@pytest.fixture(scope="module", params=list(FORMATS))
def model(request, tmp_path_factory):
    family, kind, template, marker = FORMATS[request.param]
    folder = build_checkpoint(family, tmp_path_factory.mktemp(f"tiny-{request.param}"), tokenizer=kind, num_layers=2)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    tokenizer.chat_template = template
    tokenizer.save_pretrained(folder)
    engine = Engine.load(EngineConfig(model=str(folder), device="cpu", policy="lru"))
    yield request.param, engine, marker
    engine.close()


def forced_call(engine: Engine, choice, seed: int, temperature: float = 1.0, tools: list[dict] = TOOLS):
    """Runs the request as the chat route does; returns the plan, the prompt, the output and the stream."""
    request = p.ChatCompletionRequest(messages=ASK, tools=tools, tool_choice=choice)
    plan = plan_tools(request, engine.chat_template_info, "auto", added_token_ids(engine.tokenizer))
    prompt = engine.apply_chat_template(plan.messages(request.engine_messages()), plan.tools)
    params = plan.sampling_params(SamplingParams(max_tokens=80, temperature=temperature, seed=seed))
    events = list(engine.generate(GenerationRequest("forced", prompt, params)))
    stream = plan.stream()
    content = "".join(piece for piece in stream.feed("".join(e.text for e in events)) + stream.finish()
                      if isinstance(piece, str))
    return plan, prompt, events, content, stream.calls


@pytest.mark.parametrize("seed", range(3))
def test_required_gives_one_schema_valid_call_whatever_the_model_prefers(model, seed):
    name, engine, marker = model
    plan, _, events, content, calls = forced_call(engine, "required", seed)
    assert plan.parser.name == name  # detected from the template
    assert events[-1].finish_reason == "stop" and content.strip() == ""
    (call,) = calls
    function = {"set_unit": UNIT, "pick_color": COLOR}[call.name]["function"]
    jsonschema.validate(json.loads(call.arguments), function["parameters"])
    if marker is not None:  # written as its one token, as prompts show it to the model
        assert engine.tokenizer.convert_tokens_to_ids(marker) in [t for e in events for t in e.token_ids]


# As pydantic writes a model with nested models: definitions, and `$ref`s to them (no `additionalProperties`)
ITINERARY = {"type": "function", "function": {"name": "book", "parameters": {
    "type": "object", "required": ["first"],
    "$defs": {"Stop": {"type": "object", "required": ["city"], "properties": {
        "city": {"enum": ["Oslo", "Rome"]}, "nights": {"type": "integer", "minimum": 1, "maximum": 9}}}},
    "properties": {"first": {"$ref": "#/$defs/Stop"},
                   "more": {"type": "array", "items": {"$ref": "#/$defs/Stop"}, "maxItems": 2}}}}}


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "book"}}])
def test_a_call_whose_parameters_refer_to_definitions_is_schema_valid(model, choice):
    _, engine, _ = model
    _, _, events, content, calls = forced_call(engine, choice, 0, tools=[ITINERARY, COLOR])
    assert events[-1].finish_reason == "stop" and content.strip() == ""
    (call,) = calls
    function = {"book": ITINERARY, "pick_color": COLOR}[call.name]["function"]
    arguments = json.loads(call.arguments)
    jsonschema.validate(arguments, function["parameters"])
    stops = [arguments["first"], *arguments.get("more", [])] if call.name == "book" else []
    assert all(set(stop) <= {"city", "nights"} for stop in stops), arguments


def test_named_function_is_the_one_called_greedy(model):
    _, engine, _ = model
    _, _, events, _, calls = forced_call(engine, {"type": "function", "function": {"name": "pick_color"}}, 0, 0.0)
    (call,) = calls
    assert call.name == "pick_color" and events[-1].finish_reason == "stop"
    jsonschema.validate(json.loads(call.arguments), COLOR["function"]["parameters"])


def test_the_tool_list_reaches_the_prompt(model):
    name, engine, _ = model
    plan, prompt, _, _, _ = forced_call(engine, "required", 0)
    plain = engine.apply_chat_template(ASK)
    text = engine.decode(prompt, skip_special_tokens=False)
    assert len(prompt) > len(plain) + 40 and "pick_color" in text and '"maxLength": 8' in text
    assert (plan.system_text is not None) == (name == "deepseek_v3")  # the only template that leaves it out


NESTED = {"type": "function", "function": {"name": "plan_trip", "parameters": {
    "type": "object", "required": ["stops"],
    "properties": {"stops": {"type": "array", "items": {"type": "object", "required": ["city"], "properties": {
        "city": {"type": "string"}, "nights": {"type": "integer", "minimum": 1}}}},
        "budget": {"type": "number"}, "flexible": {"type": "boolean"}, "extra": {"type": "object"},
        "either": {"anyOf": [{"type": "string"}, {"type": "integer"}]}}}}}


@pytest.fixture(scope="module")
def gemma4_grammar():
    from llguidance.hf import from_tokenizer

    from server.tool_parsers import PARSERS
    from tests.fixtures.tokenizers import build_tokenizer

    tokenizer = build_tokenizer("gemma4")
    return tokenizer, from_tokenizer(tokenizer), PARSERS["gemma4"]([NESTED], added_token_ids(tokenizer))


@pytest.mark.parametrize("text, accepted", [
    ('stops:[{city:<|"|>Oslo, Norway<|"|>,nights:2},{city:<|"|>Rome<|"|>}],budget:1.5e3,flexible:true,'
     'extra:{k:[1,<|"|>v<|"|>,null]},either:7', True),
    ('stops:[],either:<|"|>any<|"|>', True),
    ("budget:3", False),  # `stops` is required
    ('stops:[{nights:2}]', False),  # so is each stop's `city`
    ('stops:[{city:<|"|>Oslo<|"|>,nights:0}]', False),  # below the minimum
    ('stops:[],flexible:<|"|>yes<|"|>', False),  # a boolean
    ('flexible:true,stops:[]', False),  # the schema's order
])
def test_gemma4_grammar_holds_nested_values_to_the_schema_and_the_parser_reads_them(gemma4_grammar, text,
                                                                                   accepted):
    from llguidance import LLMatcher

    tokenizer, llg_tokenizer, parser = gemma4_grammar
    matcher = LLMatcher(llg_tokenizer, LLMatcher.grammar_from_lark(parser.call_grammar([NESTED], None)))
    assert not matcher.is_error(), matcher.get_error()
    output = "<|tool_call>call:plan_trip{" + text + "}<tool_call|>"
    tokens = tokenizer.encode(output, add_special_tokens=False)
    assert (matcher.try_consume_tokens(tokens) == len(tokens) and matcher.is_accepting()) == accepted
    (call,) = parser.match(output, final=True).calls  # the parser reads it either way
    if accepted:
        jsonschema.validate(json.loads(call.arguments), NESTED["function"]["parameters"])
