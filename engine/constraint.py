"""Grammar-constrained decoding: a token mask per step from a Lark grammar (llguidance).

The grammar says what the whole completion may be; each step only tokens that keep the text
inside the grammar are allowed, and once it is complete only end-of-sequence is. The sampler
applies the mask after its own processing and before greedy or random choice.
"""

from __future__ import annotations

import threading

import numpy as np
import torch

from engine.api import InvalidRequestError

_ADDED_TOKENS: dict[int, tuple[object, dict[str, int]]] = {}  # id(tokenizer) -> (tokenizer, its added tokens)


def added_token_ids(hf_tokenizer) -> dict[str, int]:
    """The tokenizer's added tokens by text (read once per tokenizer). A grammar names a marker that
    is one of them by id: prompts show it to the model as that one token, and llguidance does not
    match an added token (special or not, e.g. DeepSeek's `<｜tool▁calls▁begin｜>`) to its text."""
    cached = _ADDED_TOKENS.get(id(hf_tokenizer))
    if cached is None or cached[0] is not hf_tokenizer:
        tokens = {t.content: i for i, t in hf_tokenizer.added_tokens_decoder.items()}
        cached = _ADDED_TOKENS[id(hf_tokenizer)] = (hf_tokenizer, tokens)
    return cached[1]


def check_grammar(grammar: str) -> None:
    """Raises InvalidRequestError for a grammar llguidance cannot compile (no tokenizer needed)."""
    from llguidance import LLMatcher

    error = LLMatcher.validate_grammar(LLMatcher.grammar_from_lark(grammar))
    if error:
        raise InvalidRequestError(f"the output grammar cannot be compiled: {error}", param="grammar")


class GrammarTokenizer:
    """The tokenizer as llguidance sees it; built once per engine on first use (about a second)."""

    def __init__(self, hf_tokenizer, vocab_size: int, eos_ids: set[int]) -> None:
        self._args = (hf_tokenizer, vocab_size, sorted(eos_ids))
        self._built = None
        self._lock = threading.Lock()

    def get(self):
        with self._lock:
            if self._built is None:
                import llguidance.hf

                hf_tokenizer, vocab_size, eos = self._args
                self._built = llguidance.hf.from_tokenizer(hf_tokenizer, n_vocab=vocab_size, eos_token=eos)
            return self._built


class GrammarConstraint:
    """One request's grammar state: the allowed tokens now, advanced by each chosen token.

    With `after_token` (a thinking model's `</think>`) the grammar holds only after that token: the
    model thinks freely first. With `open_token` too (`<think>`), the thinking is the model's choice:
    its first token is that one (then it thinks until `after_token`) or one the grammar allows."""

    def __init__(self, tokenizer: GrammarTokenizer, grammar: str, vocab_size: int, device: torch.device,
                 after_token: int | None = None, open_token: int | None = None) -> None:
        from llguidance import LLMatcher

        self.matcher = LLMatcher(tokenizer.get(), LLMatcher.grammar_from_lark(grammar))
        if self.matcher.is_error():
            raise InvalidRequestError(f"the output grammar cannot be used: {self.matcher.get_error()}",
                                      param="grammar")
        self.vocab_size, self.device = vocab_size, device
        self.after_token, self.open_token = after_token, open_token
        self.state = "grammar" if after_token is None else ("start" if open_token is not None else "thinking")

    def allowed(self) -> torch.Tensor | None:
        """[V] bool: the tokens allowed next; None while the model thinks (any token)."""
        if self.state == "thinking":
            return None
        bits = np.frombuffer(self.matcher.compute_bitmask(), dtype=np.uint8)  # one bit per token, little-endian
        allowed = np.unpackbits(bits, count=self.vocab_size, bitorder="little")
        if self.state == "start":
            allowed[self.open_token] = 1
        return torch.from_numpy(allowed).to(self.device, torch.bool)

    def advance(self, token_id: int) -> None:
        if self.state == "start":
            self.state = "thinking" if token_id == self.open_token else "grammar"
        if self.state == "thinking":
            if token_id == self.after_token:
                self.state = "grammar"
            return
        if not self.matcher.consume_token(token_id):
            raise RuntimeError(f"token {token_id} broke the grammar: {self.matcher.get_error()}")
