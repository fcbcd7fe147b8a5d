"""Per-token cost of grammar-constrained decoding (forced tool calls): `python -m bench.grammar_overhead`.

A tiny random Qwen3-MoE with the real Qwen vocabulary (151,936 tokens, the size that sets the
mask's cost), greedy, one thread, on this machine's CPU. For each round: the time per token of
a free generation and of one under the Hermes call grammar, and the grammar's own work per
token (the mask from llguidance, its torch form, advancing the matcher) with the constrained
tokens replayed. Prints one JSON object of medians over the rounds.
"""

from __future__ import annotations

import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from engine.api import GenerationRequest, SamplingParams
from engine.config import EngineConfig
from engine.constraint import GrammarConstraint
from engine.engine import Engine
from server.tool_parsers.hermes import HermesParser
from tests.fixtures.models import build_checkpoint

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 24},
                                     "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"], "additionalProperties": False}}}]


def grammar_ms_per_token(engine: Engine, grammar: str, tokens: list[int]) -> float:
    """The grammar's own work for `tokens` replayed: mask, its torch form, advancing the matcher."""
    constraint = GrammarConstraint(engine._grammar_tokenizer, grammar, engine.vocab_size, engine.device)
    start = time.perf_counter()
    for token in tokens:
        assert constraint.allowed()[token]
        constraint.advance(token)
    return 1000 * (time.perf_counter() - start) / len(tokens)


def per_token_ms(engine: Engine, prompt: list[int], params: SamplingParams) -> tuple[float, list[int]]:
    start = time.perf_counter()
    events = list(engine.generate(GenerationRequest("b", prompt, params)))
    tokens = [t for e in events for t in e.token_ids]
    return 1000 * (time.perf_counter() - start) / len(tokens), tokens


def main(rounds: int = 5) -> None:
    torch.set_num_threads(1)
    folder = build_checkpoint("qwen3_moe", Path(tempfile.mkdtemp()) / "m", num_layers=2)
    engine = Engine.load(EngineConfig(model=str(folder), device="cpu", policy="lru"))
    prompt = engine.apply_chat_template([{"role": "user", "content": "Weather in Paris?"}])
    grammar = HermesParser().call_grammar(TOOLS, None)
    engine.generate(GenerationRequest("warm", prompt, SamplingParams(max_tokens=2, grammar=grammar))).__next__()
    free, constrained, grammar_ms, tokens = [], [], [], []
    for _ in range(rounds):
        free.append(per_token_ms(engine, prompt, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))[0])
        ms, tokens = per_token_ms(engine, prompt, SamplingParams(temperature=0, max_tokens=80, grammar=grammar))
        constrained.append(ms)
        grammar_ms.append(grammar_ms_per_token(engine, grammar, tokens))
    print(json.dumps({
        "vocab": engine.vocab_size, "rounds": rounds, "constrained_tokens": len(tokens),
        "free_ms_per_token": round(statistics.median(free), 3),
        "constrained_ms_per_token": round(statistics.median(constrained), 3),
        "grammar_ms_per_token": round(statistics.median(grammar_ms), 3),
    }))


if __name__ == "__main__":
    main()
