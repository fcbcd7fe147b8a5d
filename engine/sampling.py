"""Turning one step's logits into the next token.

Order: logit bias → repetition penalty (prompt and output, multiplicative, as in
transformers) → presence/frequency penalties (output only, as OpenAI defines them) →
greedy argmax, or temperature → top-k → top-p → min-p → a draw from a seeded generator.
Last, a grammar constraint (engine/constraint.py) masks the tokens its grammar does not allow.
Logprobs are reported from the model's own distribution (before any of this).

A thinking budget (`ThinkingBudget`) overrides all of it: once a `<think>` block has had its tokens,
the tokens that close it are the next ones, whatever the logits say. They are then observed as
any chosen token (penalties, grammar), and their logprobs are the model's for them.
"""

from __future__ import annotations

import random

import torch

from engine.api import SamplingParams, TokenLogprob, TopLogprob
from engine.constraint import GrammarConstraint

FLOAT_MAX = torch.finfo(torch.float32).max


class Sampler:
    def __init__(
        self,
        params: SamplingParams,
        prompt_ids: list[int],
        vocab_size: int,
        device: torch.device,
        constraint: GrammarConstraint | None = None,
    ) -> None:
        self.params = params
        self.constraint = constraint
        self.vocab_size = vocab_size
        self.device = device
        seed = params.seed if params.seed is not None else random.getrandbits(63)
        self.generator = torch.Generator(device=device).manual_seed(seed)
        self.output_counts = torch.zeros(vocab_size, dtype=torch.float32, device=device)  # [V]
        self.seen = torch.zeros(vocab_size, dtype=torch.bool, device=device)  # [V] prompt or output
        self.seen[torch.tensor(prompt_ids, dtype=torch.long, device=device)] = True
        self.thinking = ThinkingBudget(params) if params.thinking_budget is not None else None
        self.bias = None
        if params.logit_bias:
            self.bias = torch.zeros(vocab_size, dtype=torch.float32, device=device)
            ids = torch.tensor(list(params.logit_bias), dtype=torch.long, device=device)
            self.bias[ids] = torch.tensor(
                list(params.logit_bias.values()), dtype=torch.float32, device=device
            )

    def observe(self, token_id: int) -> None:
        if self.thinking is not None:
            self.thinking.observe(token_id)
        self.output_counts[token_id] += 1
        self.seen[token_id] = True
        if self.constraint is not None:
            self.constraint.advance(token_id)

    def sample(self, logits: torch.Tensor) -> int:
        """`logits` [V] of the last position → the chosen token id."""
        if self.thinking is not None and (forced := self.thinking.forced_token()) is not None:
            return forced
        scores = self._processed(logits[: self.vocab_size].float()).clamp(-FLOAT_MAX, FLOAT_MAX)  # no inf
        if self.params.greedy:
            return int(torch.argmax(scores))
        # the best at 0 first: a tiny temperature then sends the rest to -inf, never inf/inf = nan
        scores = (scores - scores.max()) / self.params.temperature
        scores = self._filter(scores)
        probs = torch.softmax(scores, dim=-1)
        return int(torch.multinomial(probs, 1, generator=self.generator))

    def _processed(self, scores: torch.Tensor) -> torch.Tensor:
        p = self.params
        if self.bias is not None:
            scores = scores + self.bias
        if p.repetition_penalty != 1.0:
            penalised = torch.where(scores > 0, scores / p.repetition_penalty, scores * p.repetition_penalty)
            scores = torch.where(self.seen, penalised, scores)
        if p.frequency_penalty or p.presence_penalty:
            scores = scores - p.frequency_penalty * self.output_counts
            scores = scores - p.presence_penalty * (self.output_counts > 0).float()
        allowed = self.constraint.allowed() if self.constraint is not None else None
        if allowed is not None:
            scores = scores.masked_fill(~allowed, float("-inf"))
        return scores

    def _filter(self, scores: torch.Tensor) -> torch.Tensor:
        p = self.params
        if p.top_k > 0 and p.top_k < scores.numel():
            kth = torch.topk(scores, p.top_k).values[-1]
            scores = scores.masked_fill(scores < kth, float("-inf"))
        if p.top_p < 1.0:
            sorted_scores, order = torch.sort(scores, descending=True)
            cumulative = torch.softmax(sorted_scores, dim=-1).cumsum(dim=-1)
            drop_sorted = cumulative - torch.softmax(sorted_scores, dim=-1) >= p.top_p
            drop_sorted[0] = False  # the most likely token always stays, however small top_p is
            scores = scores.masked_fill(
                torch.zeros_like(drop_sorted).scatter(0, order, drop_sorted), float("-inf")
            )
        if p.min_p > 0.0:
            probs = torch.softmax(scores, dim=-1)
            scores = scores.masked_fill(probs < p.min_p * probs.max(), float("-inf"))
        return scores


class ThinkingBudget:
    """Counts the tokens the model writes inside its `<think>` block; once `thinking_budget` of them are
    written without the model closing the block, `forced_token` is each of `thinking_end_ids` in turn.

    States: "before" the block opens (the model may open it with `<think>`), "inside" it (counting),
    "closing" it (the end ids being written), "after" it (nothing more to do)."""

    def __init__(self, params: SamplingParams) -> None:
        self.budget = params.thinking_budget
        self.open_token, self.close_token = params.thinking_open, params.thinking_close
        self.end_ids = params.thinking_end_ids
        self.written = 0  # inside: tokens counted; closing: end ids written
        self.state = "before"
        if params.thinking_open_at_start:
            self._enter_block()

    def forced_token(self) -> int | None:
        """The token the next step must be, else None (the sampler chooses)."""
        return self.end_ids[self.written] if self.state == "closing" else None

    def observe(self, token_id: int) -> None:
        if self.state == "before":
            if token_id == self.open_token:
                self._enter_block()
        elif self.state == "inside":
            if token_id == self.close_token:
                self.state = "after"
                return
            self.written += 1
            if self.written >= self.budget:
                self.state, self.written = "closing", 0
        elif self.state == "closing":
            self.written += 1
            if self.written == len(self.end_ids):
                self.state = "after"

    def _enter_block(self) -> None:
        self.state, self.written = ("closing" if self.budget == 0 else "inside"), 0


def token_logprob(logits: torch.Tensor, token_id: int, top: int, decode) -> TokenLogprob:
    """The chosen token's logprob and the `top` most likely alternatives, from raw logits."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    alternatives = ()
    if top > 0:
        values, ids = torch.topk(logprobs, top)
        alternatives = tuple(
            TopLogprob(int(i), decode(int(i)), float(v)) for v, i in zip(values.tolist(), ids.tolist())
        )
    return TokenLogprob(token_id, decode(token_id), float(logprobs[token_id]), alternatives)
