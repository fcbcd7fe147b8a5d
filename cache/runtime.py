"""`ExpertRuntime`: what the offloaded experts modules call into, one per engine.

It ties together the device cache, the replacement policy (which sees every routing
decision), the optional trace recorder and the prefetcher, and knows the phase of the
current step (prefill or decode).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence

import torch

from cache.expert_cache import ExpertCache
from cache.policy import Policy
from cache.stats import CacheStats

Phase = str  # "prefill" | "decode"


class ExpertRuntime:
    def __init__(self, cache: ExpertCache, num_layers: int, num_experts: int, top_k: int) -> None:
        self.cache = cache
        self.num_layers = num_layers
        self.num_experts = num_experts
        self.top_k = top_k
        self.phase: Phase = "prefill"
        self.recorder = None  # cache.trace.TraceWriter when --record-trace is set
        self.prefetcher = None  # cache.prefetcher.Prefetcher when prefetch is on

    @property
    def policy(self) -> Policy:
        return self.cache.policy

    @property
    def stats(self) -> CacheStats:
        return self.cache.stats

    def begin_request(self, request_id: str) -> None:
        self.phase = "prefill"
        self.policy.on_request_start(request_id)
        if self.recorder is not None:
            self.recorder.begin_request(request_id)

    def end_request(self, request_id: str) -> None:
        self.policy.on_request_end(request_id)
        if self.recorder is not None:
            self.recorder.end_request()

    def on_routing(self, layer: int, top_k_index: torch.Tensor) -> tuple[list[int], list[list[int]]]:
        """Record one router decision (`top_k_index` [T, k]); return the sorted experts needed
        and the index rows, on the host."""
        index_rows = top_k_index.tolist()  # one device sync per layer: the loads depend on it
        counts = Counter(e for row in index_rows for e in row)
        needed = sorted(counts)
        self.note_routing(layer, needed, len(index_rows), [counts[e] for e in needed])
        if self.recorder is not None:
            self.recorder.record(self.phase, layer, index_rows)
        return needed, index_rows

    def note_routing(self, layer: int, needed: list[int], tokens: int, counts: Sequence[int] | None) -> None:
        """Protect the step's experts, then tell the policy what `layer`'s router picked
        (`counts`: tokens per expert, None: one each). `run_step` must follow."""
        if len(needed) <= self.cache.capacity:  # a larger step is protected turn by turn
            self.cache.protect(layer, needed)
        self.policy.on_routing(layer, needed, tokens, self.phase, counts)

    def run_step(
        self,
        layer: int,
        needed: list[int],
        hidden: torch.Tensor | None,
        compute: Callable[[Sequence[int], list[int]], None] | None = None,
    ) -> None:
        """Acquire `layer`'s experts in turns and `compute(experts, slots)` each turn.

        The prefetch for the next layer is issued once the last turn is acquired: the step's
        own experts are protected then, so a prefetch can never evict them, and its copies
        overlap this layer's compute. The engine and the trace replay both run this.
        """
        turns = chunks(needed, self.cache.capacity)
        try:
            for i, turn in enumerate(turns):
                slots = self.cache.acquire(layer, turn)
                try:
                    if i == len(turns) - 1 and self.prefetcher is not None:
                        self.prefetcher.after_routing(layer, hidden, needed, self.phase)
                    if compute is not None:
                        for expert in turn:
                            self.cache.wait(layer, expert)
                        compute(turn, slots)
                finally:
                    self.cache.release(layer, turn)
        finally:
            self.cache.unprotect(layer, needed)  # what `note_routing` protected, also on an error


def chunks(experts: Sequence[int], capacity: int) -> list[Sequence[int]]:
    """The turns of one step: all at once when they fit the cache, else runs of `capacity`."""
    if len(experts) <= capacity:
        return [experts]
    return [experts[i : i + capacity] for i in range(0, len(experts), capacity)]
