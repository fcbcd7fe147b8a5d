"""Grammar-constrained decoding on a tiny random Qwen3-MoE with the real Qwen vocabulary: whatever the
random model prefers, the output is exactly one valid call in Hermes format."""

from __future__ import annotations

import json

import pytest
import torch

from engine.api import GenerationRequest, InvalidRequestError, SamplingParams
from engine.config import EngineConfig
from engine.engine import Engine
from server.tool_parsers import ToolCallStream
from server.tool_parsers.hermes import HermesParser
from tests.fixtures.models import build_checkpoint

UNIT = {"type": "function", "function": {"name": "set_unit", "parameters": {
    "type": "object", "properties": {"unit": {"enum": ["celsius", "fahrenheit"]}}, "required": ["unit"],
    "additionalProperties": False}}}
COLOR = {"type": "function", "function": {"name": "pick_color", "parameters": {
    "type": "object", "properties": {"color": {"enum": ["red", "green"]}, "bright": {"type": "boolean"}},
    "required": ["color", "bright"], "additionalProperties": False}}}
TOOLS = [UNIT, COLOR]


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    folder = build_checkpoint("qwen3_moe", tmp_path_factory.mktemp("tiny-qwen"), num_layers=2)
    return Engine.load(EngineConfig(model=str(folder), device="cpu", policy="lru"))


def generate(engine: Engine, **params) -> tuple[str, str]:
    prompt = engine.apply_chat_template([{"role": "user", "content": "Set it up, please."}])
    events = list(engine.generate(GenerationRequest("g", prompt, SamplingParams(max_tokens=60, **params))))
    return "".join(e.text for e in events), events[-1].finish_reason


def calls(text: str) -> list[tuple[str, dict]]:
    stream = ToolCallStream(HermesParser(TOOLS), frozenset({"set_unit", "pick_color"}))
    content = "".join(p for p in stream.feed(text) + stream.finish() if isinstance(p, str))
    assert content == ""
    return [(c.name, json.loads(c.arguments)) for c in stream.calls]


@pytest.mark.parametrize("seed", range(4))
def test_any_tool_grammar_gives_one_valid_call_whatever_the_model_prefers(engine, seed):
    free, _ = generate(engine, temperature=1.0, seed=seed)
    text, finish = generate(engine, temperature=1.0, seed=seed, grammar=HermesParser().call_grammar(TOOLS, None))
    assert "<tool_call>" not in free  # the random model alone never calls
    assert finish == "stop"  # the grammar ended and only end-of-sequence was left
    ((name, arguments),) = calls(text)
    if name == "set_unit":
        assert arguments["unit"] in ("celsius", "fahrenheit") and len(arguments) == 1
    else:
        assert arguments["color"] in ("red", "green") and isinstance(arguments["bright"], bool)


def test_named_function_grammar_calls_that_function_greedy(engine):
    text, finish = generate(engine, temperature=0, grammar=HermesParser().call_grammar(TOOLS, "pick_color"))
    assert finish == "stop" and [name for name, _ in calls(text)] == ["pick_color"]


def test_a_grammar_that_does_not_compile_is_refused_before_it_runs(engine):
    prompt = engine.encode("hi")
    with pytest.raises(InvalidRequestError, match="grammar"):
        engine.validate(GenerationRequest("g", prompt, SamplingParams(grammar='start: "unclosed')))


def test_a_grammar_does_not_go_with_ignore_eos():
    with pytest.raises(InvalidRequestError, match="ignore_eos"):
        SamplingParams(grammar='start: "a"', ignore_eos=True)


def test_sampler_masks_what_the_grammar_forbids(engine):
    from engine.constraint import GrammarConstraint
    from engine.sampling import Sampler

    constraint = GrammarConstraint(engine._grammar_tokenizer, 'start: "yes" | "no"', engine.vocab_size, engine.device)
    sampler = Sampler(SamplingParams(temperature=0), [0], engine.vocab_size, engine.device, constraint)
    logits = torch.zeros(engine.vocab_size)
    logits[engine.encode("maybe")[0]] = 50.0  # the model's favourite is not allowed
    token = sampler.sample(logits)
    assert engine.decode([token]) in ("yes", "no", "y", "n")


def test_a_grammar_after_a_token_lets_the_model_write_freely_until_that_token(engine):
    marker = engine.encode(" Meanwhile")[0]  # stands for a thinking model's `</think>`
    favourite = {marker: 100.0}  # the model writes the marker first, whatever else it prefers
    text, finish = generate(engine, temperature=0, grammar='start: "yes" | "no"', grammar_after=marker,
                            logit_bias=favourite)
    assert finish == "stop" and text in (" Meanwhileyes", " Meanwhileno")  # free, then only the grammar
    text, _ = generate(engine, temperature=0, grammar='start: "yes" | "no"', logit_bias=favourite)
    assert text in ("yes", "no")  # from the first token the grammar forbids the marker


def test_a_grammar_that_may_wait_for_thinking_holds_unless_the_first_token_opens_it(engine):
    opener, closer = engine.encode(" Hmm")[0], engine.encode(" So")[0]  # stand for `<think>`, `</think>`
    gated = {"grammar": 'start: "yes" | "no"', "grammar_after": closer, "grammar_may_open": opener}
    text, finish = generate(engine, temperature=0, logit_bias={opener: 100.0}, **gated)
    assert text == " Hmm" * 60 and finish == "length"  # opened: free from then on (the grammar never allows it)
    other = engine.encode(" Meanwhile")[0]
    text, _ = generate(engine, temperature=0, logit_bias={other: 100.0}, **gated)
    assert text in ("yes", "no")  # not opened: the grammar from the first token
