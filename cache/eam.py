"""Expert activation matrices (MoE-Infinity): which experts a forward pass / a request used.

An iteration-level EAM (iEAM) counts, for one forward pass, the tokens each (MoE layer,
expert) processed. A request-level EAM (rEAM) accumulates a request's iEAMs, keeping
the prompt (prefill) apart from the generated tokens (decode): the prompt is what a new
request is matched on, the decode part is what the cache must serve.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

PHASES = ("prefill", "decode")


class IterationEAM:
    """Token counts of one forward pass."""

    def __init__(self, num_layers: int, num_experts: int) -> None:
        self.counts = np.zeros((num_layers, num_experts), dtype=np.float32)  # [L, E]

    def add(self, layer: int, expert_ids: Sequence[int], counts: Sequence[int] | None = None) -> None:
        """Add one layer's routing: `counts[i]` tokens went to `expert_ids[i]` (1 each if None)."""
        ids = np.asarray(expert_ids, dtype=np.int64)
        np.add.at(self.counts[layer], ids, 1.0 if counts is None else np.asarray(counts, dtype=np.float32))

    @classmethod
    def from_top_k(cls, num_layers: int, num_experts: int, layer: int, top_k_index: np.ndarray) -> IterationEAM:
        """One layer's iEAM from the router's `[T, k]` choices."""
        eam = cls(num_layers, num_experts)
        eam.counts[layer] = np.bincount(np.asarray(top_k_index).ravel(), minlength=num_experts)
        return eam

    def clear(self) -> None:
        self.counts.fill(0.0)


class RequestEAM:
    """A request's accumulated activations, prefill and decode kept apart.

    Counts are tokens: the engine reports, with each layer's set of experts, how many of
    the step's tokens each one processed (a prompt's experts differ in weight even when
    a long prompt touches them all).
    """

    def __init__(self, num_layers: int, num_experts: int) -> None:
        self.num_layers = num_layers
        self.num_experts = num_experts
        self.prefill = np.zeros((num_layers, num_experts), dtype=np.float32)  # [L, E]
        self.decode = np.zeros((num_layers, num_experts), dtype=np.float32)  # [L, E]
        self.prefill_tokens = 0
        self.decode_tokens = 0  # decode passes (one generated token each)

    def add(
        self, layer: int, expert_ids: Sequence[int], phase: str, tokens: int = 1, counts: Sequence[int] | None = None
    ) -> None:
        """One layer's routing of one pass (`counts[i]` tokens to `expert_ids[i]`; one each if None).

        A pass is counted when its first layer reports.
        """
        row = (self.decode if phase == "decode" else self.prefill)[layer]
        for i, e in enumerate(expert_ids):
            row[e] += 1.0 if counts is None else float(counts[i])
        if layer == 0:
            if phase == "decode":
                self.decode_tokens += tokens
            else:
                self.prefill_tokens += tokens

    def add_iteration(self, eam: IterationEAM, phase: str, tokens: int) -> None:
        """Accumulate a whole pass's iEAM."""
        if phase == "decode":
            self.decode += eam.counts
            self.decode_tokens += tokens
        else:
            self.prefill += eam.counts
            self.prefill_tokens += tokens

    def decode_probability(self) -> np.ndarray:
        """Per (layer, expert): the share of generated tokens that used it."""  # [L, E]
        return self.decode / max(self.decode_tokens, 1)

    def is_empty(self) -> bool:
        return self.prefill_tokens == 0 and self.decode_tokens == 0

    def reset(self) -> None:
        self.prefill.fill(0.0)
        self.decode.fill(0.0)
        self.prefill_tokens = 0
        self.decode_tokens = 0
