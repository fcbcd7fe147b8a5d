"""`ExpertRuntime`: what the offloaded experts modules call into, one per engine.

It ties together the device cache, the replacement policy (which sees every routing
decision), the optional trace recorder and the prefetcher, and knows the phase of the
current step (prefill or decode).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

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

    def on_routing(self, layer: int, top_k_index: torch.Tensor, hidden: torch.Tensor) -> list[int]:
        """Record one router decision (`top_k_index` [T, k]); return the sorted experts needed."""
        index_rows = top_k_index.tolist()  # one device sync per layer: the loads depend on it
        counts = Counter(e for row in index_rows for e in row)
        needed = sorted(counts)
        self.policy.on_routing(layer, needed, len(index_rows), self.phase, [counts[e] for e in needed])
        if self.recorder is not None:
            self.recorder.record(self.phase, layer, index_rows)
        if self.prefetcher is not None:
            self.prefetcher.after_routing(layer, hidden, needed, self.phase)
        return needed

    def chunks(self, experts: Sequence[int]) -> list[Sequence[int]]:
        """Split a step's experts into turns that fit the cache together."""
        size = self.cache.capacity
        return [experts[i : i + size] for i in range(0, len(experts), size)]
