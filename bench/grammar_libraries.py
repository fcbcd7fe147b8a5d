"""llguidance, xgrammar and outlines-core side by side on CPU (issue 16).

`OMP_NUM_THREADS=1 RAYON_NUM_THREADS=1 python -m bench.grammar_libraries`

The real Qwen vocabulary the tests use (151,646 tokens), three JSON schemas (any object, a tool call
with nested object/array/enum, a strict answer with bounded strings), one fixed valid answer per
schema tokenized once and forced on every library. Per library and schema: the compile time
(tokenizer set up once beforehand, not counted), then per token the library's own next-token
bitmask (an int32 [1, ceil(V/32)] tensor) plus advancing its matcher by that token; median and p90
over all tokens of 3 rounds. Every forced token must be in the mask (the grammars agree), and the
matcher must be finished after the answer and EOS. xgrammar and outlines-core are not project
dependencies: `pip install xgrammar outlines-core` first (see bench/RESULTS.md).
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable

import torch
from transformers.convert_slow_tokenizer import bytes_to_unicode

from tests.fixtures.tokenizers import build_tokenizer

ROUNDS = 3

TOOL_CALL_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"enum": ["search_notes", "get_current_timestamp", "search_memories"]},
        "arguments": {
            "type": "object",
            "properties": {
                "query": {"type": "string"},
                "filters": {
                    "type": "object",
                    "properties": {
                        "tags": {"type": "array", "items": {"type": "string"}},
                        "sort": {"enum": ["newest", "oldest", "relevance"]},
                    },
                    "required": ["tags", "sort"], "additionalProperties": False,
                },
                "limit": {"type": "integer"},
            },
            "required": ["query", "filters", "limit"], "additionalProperties": False,
        },
    },
    "required": ["name", "arguments"], "additionalProperties": False,
}

STRICT_SCHEMA = {
    "type": "object",
    "properties": {
        "title": {"type": "string", "minLength": 1, "maxLength": 40},
        "summary": {"type": "string", "maxLength": 160},
        "language": {"enum": ["en", "fr", "de"]},
        "keywords": {"type": "array", "items": {"type": "string", "maxLength": 16}},
        "confident": {"type": "boolean"},
    },
    "required": ["title", "summary", "language", "keywords", "confident"], "additionalProperties": False,
}

# (name, schema, a valid answer); answers are compact JSON (every library's whitespace rules allow it)
CASES = [
    ("JSON object", {"type": "object"}, {
        "city": "Paris", "country": "France", "population": 2102650, "capital": True,
        "location": {"lat": 48.8566, "lon": 2.3522}, "arrondissements": [1, 2, 3, 4], "mayor": None}),
    ("tool call (nested object/array/enum)", TOOL_CALL_SCHEMA, {
        "name": "search_notes", "arguments": {
            "query": "meeting notes about the Q3 roadmap",
            "filters": {"tags": ["work", "roadmap", "planning"], "sort": "newest"}, "limit": 5}}),
    ("strict json_schema (bounded strings)", STRICT_SCHEMA, {
        "title": "The capital of France",
        "summary": "Paris is the capital and the largest city of France, on the Seine.",
        "language": "en", "keywords": ["Paris", "France", "capital"], "confident": True}),
]


class LLGuidance:
    name = "llguidance"

    def __init__(self, hf_tokenizer, vocab_size: int) -> None:
        import llguidance.hf
        import llguidance.torch

        self._torch = llguidance.torch
        self.tokenizer = llguidance.hf.from_tokenizer(hf_tokenizer, n_vocab=vocab_size)

    def compile(self, schema: dict):
        from llguidance import LLMatcher

        matcher = LLMatcher(self.tokenizer, LLMatcher.grammar_from_json_schema(json.dumps(schema)))
        assert not matcher.is_error(), matcher.get_error()
        return matcher

    def fill_mask(self, matcher, bitmask: torch.Tensor) -> None:
        self._torch.fill_next_token_bitmask(matcher, bitmask, 0)

    def advance(self, matcher, token: int) -> None:
        assert matcher.consume_token(token), matcher.get_error()

    def is_done(self, matcher) -> bool:
        return matcher.is_stopped()


class XGrammar:
    name = "xgrammar"

    def __init__(self, hf_tokenizer, vocab_size: int) -> None:
        import xgrammar

        self._xgr = xgrammar
        self.tokenizer = xgrammar.TokenizerInfo.from_huggingface(hf_tokenizer, vocab_size=vocab_size)

    def compile(self, schema: dict):
        # a fresh compiler each time: its cache would otherwise make later rounds free
        compiler = self._xgr.GrammarCompiler(self.tokenizer, max_threads=1, cache_enabled=False)
        return self._xgr.GrammarMatcher(compiler.compile_json_schema(json.dumps(schema)))

    def fill_mask(self, matcher, bitmask: torch.Tensor) -> None:
        matcher.fill_next_token_bitmask(bitmask)

    def advance(self, matcher, token: int) -> None:
        assert matcher.accept_token(token)

    def is_done(self, matcher) -> bool:
        return matcher.is_terminated()


class OutlinesCore:
    name = "outlines-core"

    def __init__(self, hf_tokenizer, vocab_size: int) -> None:
        from outlines_core import Vocabulary

        self.eos = hf_tokenizer.eos_token_id
        self.vocabulary = Vocabulary(self.eos, byte_level_vocabulary(hf_tokenizer))

    def compile(self, schema: dict):
        from outlines_core import Guide, Index
        from outlines_core.json_schema import build_regex_from_schema

        return Guide(Index(build_regex_from_schema(json.dumps(schema)), self.vocabulary))

    def fill_mask(self, guide, bitmask: torch.Tensor) -> None:
        guide.write_mask_into(bitmask.data_ptr(), bitmask.numel(), bitmask.element_size())

    def advance(self, guide, token: int) -> None:
        if token != self.eos:  # its index has no EOS transition: a final state's mask allows EOS, and decoding stops
            guide.advance(token, return_tokens=False)

    def is_done(self, guide) -> bool:
        return guide.is_finished()


def byte_level_vocabulary(hf_tokenizer) -> dict[bytes, list[int]]:
    """Token bytes -> ids for a byte-level BPE vocabulary, without added tokens (outlines-core's input)."""
    to_byte = {char: byte for byte, char in bytes_to_unicode().items()}
    added = set(hf_tokenizer.added_tokens_decoder)
    vocabulary: dict[bytes, list[int]] = {}
    for text, token_id in hf_tokenizer.get_vocab().items():
        if token_id not in added:
            vocabulary.setdefault(bytes(to_byte[c] for c in text), []).append(token_id)
    return vocabulary


def is_set(bitmask: torch.Tensor, token: int) -> bool:
    return bool((int(bitmask[0, token // 32]) >> (token % 32)) & 1)


def timed(step: Callable[..., object], *args: object) -> tuple[float, object]:
    """Milliseconds one call of `step(*args)` took, and what it returned."""
    start = time.perf_counter()
    result = step(*args)
    return 1000 * (time.perf_counter() - start), result


def one_round(library, schema: dict, tokens: list[int], eos: int, bitmask: torch.Tensor) -> tuple[float, list[float]]:
    """Compile ms, then mask + advance ms for each forced token and the final EOS."""
    compile_ms, matcher = timed(library.compile, schema)
    per_token = []
    for position, token in enumerate([*tokens, eos]):
        mask_ms, _ = timed(library.fill_mask, matcher, bitmask)
        assert is_set(bitmask, token), f"{library.name} rejects token {position} ({token}) of the answer"
        per_token.append(mask_ms + timed(library.advance, matcher, token)[0])
    assert library.is_done(matcher), f"{library.name}: not finished after the answer and EOS"
    return compile_ms, per_token


def p90(values: list[float]) -> float:
    return statistics.quantiles(values, n=10)[-1]


def measure(library, schema: dict, tokens: list[int], eos: int, vocab_size: int) -> dict:
    bitmask = torch.zeros(1, (vocab_size + 31) // 32, dtype=torch.int32)
    compile_ms, per_token = [], []
    for _ in range(ROUNDS):
        ms, steps = one_round(library, schema, tokens, eos, bitmask)
        compile_ms.append(ms)
        per_token.extend(steps)
    return {"compile_ms": statistics.median(compile_ms), "median_ms": statistics.median(per_token),
            "p90_ms": p90(per_token), "max_ms": max(per_token)}


def main() -> None:
    torch.set_num_threads(1)
    hf_tokenizer = build_tokenizer("qwen")
    vocab_size, eos = len(hf_tokenizer), hf_tokenizer.eos_token_id
    libraries, setup_ms = [], {}
    for kind in (LLGuidance, XGrammar, OutlinesCore):
        start = time.perf_counter()
        libraries.append(kind(hf_tokenizer, vocab_size))
        setup_ms[kind.name] = 1000 * (time.perf_counter() - start)
    print(f"vocabulary {vocab_size} tokens; tokenizer set-up ms: "
          + ", ".join(f"{name} {ms:.0f}" for name, ms in setup_ms.items()))
    print("\n| grammar | tokens | library | compile ms | mask+advance ms/token median | p90 | max |")
    print("|---|---|---|---|---|---|---|")
    for case, schema, answer in CASES:
        tokens = hf_tokenizer.encode(json.dumps(answer, separators=(",", ":")), add_special_tokens=False)
        for library in libraries:
            row = measure(library, schema, tokens, eos, vocab_size)
            print(f"| {case} | {len(tokens)} + EOS | {library.name} | {row['compile_ms']:.1f} "
                  f"| {row['median_ms']:.3f} | {row['p90_ms']:.3f} | {row['max_ms']:.2f} |", flush=True)


if __name__ == "__main__":
    main()
