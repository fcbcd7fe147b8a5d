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
from cache.miss_planner import MissPlan
from cache.policy import Policy
from cache.stats import CacheStats

CACHE_MIN_CHANCE = 0.5  # an even chance: one copy's delay now against one miss saved later

Phase = str  # "prefill" | "decode"


class ExpertRuntime:
    def __init__(self, cache: ExpertCache, num_layers: int, num_experts: int, top_k: int) -> None:
        self.cache = cache
        self.num_layers = num_layers
        self.num_experts = num_experts
        self.top_k = top_k
        self.phase: Phase = "prefill"
        self.live_tokens: torch.Tensor | None = None  # [T'] a padded batch's real positions (flattened); None: all
        self.recorder = None  # cache.trace.TraceWriter when --record-trace is set
        self.prefetcher = None  # cache.prefetcher.Prefetcher when prefetch is on
        self.planner = None  # cache.miss_planner.MissPlanner when misses may be computed on the host
        self._lookahead: tuple[int, list[int]] | None = None  # (layer, ids) read with that layer's routing

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

    def on_routing(
        self, layer: int, top_k_index: torch.Tensor, hidden: torch.Tensor | None = None
    ) -> tuple[list[int], list[list[int]]]:
        """Record one router decision (`top_k_index` [T, k]); return the sorted experts needed
        and the index rows, on the host. With prefetch, the next layer's look-ahead guess from
        `hidden` is read in the same device sync, the only one of the layer."""
        lookahead = self.prefetcher.lookahead(layer, hidden, self.phase) if self.prefetcher is not None else None
        if lookahead is None:
            index_rows = top_k_index.tolist()
        else:
            ids = torch.cat([top_k_index.flatten(), lookahead.flatten().to(top_k_index.dtype)]).tolist()
            tokens, k = top_k_index.shape
            index_rows = [ids[t * k : (t + 1) * k] for t in range(tokens)]
            self._lookahead = (layer, [e for e in ids[tokens * k :] if e >= 0])
        counts = Counter(e for row in index_rows for e in row if e >= 0)  # a negative id: a route to no expert
        needed = sorted(counts)
        self.note_routing(layer, needed, len(index_rows), [counts[e] for e in needed])
        if self.recorder is not None:
            self.recorder.record(self.phase, layer, [[e for e in row if e >= 0] for row in index_rows])
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
        compute_on_host: Callable[[int, object, float], None] | None = None,
    ) -> None:
        """Acquire `layer`'s experts in turns and `compute(experts, slots)` each turn.

        The prefetch for the next layer is issued once the last turn is acquired: the step's
        own experts are protected then, so a prefetch can never evict them, and its copies
        overlap this layer's compute. With a planner, some misses of a decode step are not
        copied but computed from their host buffers (`compute_on_host(expert, buffer, host_fraction)`;
        a fraction below 1: the device computes the rest), while the first turn's copies are on the
        link. The engine and the trace replay both run this.
        """
        plan = self._misses_for_host(layer, needed) if compute_on_host is not None else MissPlan()
        off_device = {*plan.on_host, plan.shared}
        turns = chunks([e for e in needed if e not in off_device], self.cache.capacity)
        try:
            for i, turn in enumerate(turns):
                slots = self.cache.acquire(layer, turn)
                try:
                    if i == len(turns) - 1 and self.prefetcher is not None:
                        self.prefetcher.after_routing(layer, hidden, needed, self.phase, self._lookahead_for(layer))
                    if i == 0:
                        self._compute_on_host(layer, plan, compute_on_host)
                    if compute is not None:
                        for expert in turn:
                            self.cache.wait(layer, expert)
                        compute(turn, slots)
                finally:
                    self.cache.release(layer, turn)
        finally:
            self.cache.unprotect(layer, needed)  # what `note_routing` protected, also on an error


    def _lookahead_for(self, layer: int) -> list[int] | None:
        if self._lookahead is None or self._lookahead[0] != layer:
            return None
        guess, self._lookahead = self._lookahead[1], None
        return guess

    def _misses_for_host(self, layer: int, needed: list[int]) -> MissPlan:
        if self.planner is None or self.phase != "decode":  # prefill: many tokens, the device wins
            return MissPlan()
        misses = [e for e in needed if not self.cache.is_resident((layer, e))]
        return self.planner.plan(misses, link_busy=self.cache.backend.link_busy())

    def _compute_on_host(self, layer: int, plan: MissPlan, compute_on_host) -> None:
        """The shared expert first: its device part waits for a partial copy, the host's whole ones do not.

        Afterwards each is copied in the background to be cached, if the policy values it over its
        victim, when the step leaves the link idle or when the policy gives it at least
        `CACHE_MIN_CHANCE` of use on its layer's next run: where the link carries misses, such a copy
        delays the next steps' demand copies by up to a whole copy and saves one miss only if the
        expert comes back before eviction (bench/RESULTS.md, issue 13)."""
        parts = [(e, 1.0) for e in plan.on_host]
        if plan.shared is not None:
            parts.insert(0, (plan.shared, plan.host_fraction))
        for expert, fraction in parts:
            self.stats.add("misses", layer)
            self.stats.add("cpu_computed", layer)  # a shared expert too: computed in part on the host
            with self.cache.backend.staged((layer, expert)) as buffer:  # held: no prefetch recycles it
                compute_on_host(expert, buffer, fraction)
            if plan.link_idle or (self.policy.next_use_chance((layer, expert)) or 0.0) >= CACHE_MIN_CHANCE:
                self.cache.prefetch((layer, expert))  # cached for later tokens if the policy values it (low priority)


def chunks(experts: Sequence[int], capacity: int) -> list[Sequence[int]]:
    """The turns of one step: all at once when they fit the cache, else runs of `capacity`."""
    if len(experts) <= capacity:
        return [experts]
    return [experts[i : i + capacity] for i in range(0, len(experts), capacity)]
