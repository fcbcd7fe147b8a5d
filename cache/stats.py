"""Counters of the expert cache, per MoE layer and in total."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field


@dataclass
class CacheStats:
    num_layers: int
    hits: list[int] = field(init=False)
    misses: list[int] = field(init=False)
    prefetches: list[int] = field(init=False)
    prefetch_used: list[int] = field(init=False)
    bytes_transferred: list[int] = field(init=False)
    evictions: list[int] = field(init=False)
    prefetch_evictions: list[int] = field(init=False)  # experts a prefetch evicted
    prefetch_regrets: list[int] = field(init=False)  # ... that were then missed soon after
    cpu_computed: list[int] = field(init=False)  # misses computed on the host instead of copied
    lock: threading.Lock = field(init=False, repr=False, compare=False)
    _totals: dict[str, int] = field(init=False, repr=False, compare=False)  # kept as counts are added

    COUNTERS = ("hits", "misses", "prefetches", "prefetch_used", "bytes_transferred", "evictions",
                "prefetch_evictions", "prefetch_regrets", "cpu_computed")

    def __post_init__(self) -> None:
        for name in self.COUNTERS:
            setattr(self, name, [0] * self.num_layers)
        self.lock = threading.Lock()
        self._totals = dict.fromkeys(self.COUNTERS, 0)

    def add(self, counter: str, layer: int, amount: int = 1) -> None:
        with self.lock:
            getattr(self, counter)[layer] += amount
            self._totals[counter] += amount

    def totals(self) -> dict[str, int]:
        """The counts over all layers (cheap: the prefetcher reads them every layer)."""
        with self.lock:
            return dict(self._totals)

    def per_layer(self) -> dict[str, list[int]]:
        with self.lock:
            return {name: list(getattr(self, name)) for name in self.COUNTERS}

    def hit_rate(self) -> float:
        t = self.totals()
        accesses = t["hits"] + t["misses"]
        return t["hits"] / accesses if accesses else 0.0
