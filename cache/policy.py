"""Replacement policies for the expert cache.

The cache unit is one (layer, expert). A policy sees every routing decision
(`on_routing`), every use of a resident expert (`on_access`), every insertion and
eviction, and chooses the victim when the cache is full. It may also name experts
worth prefetching. The engine and the trace replay drive the *same* policy objects.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence

ExpertKey = tuple[int, int]  # (MoE layer index 0..L-1, expert id)
NO_LOOKAHEAD: tuple[int, frozenset[int]] = (-1, frozenset())


class Policy:
    """Base class: the hooks a policy may use; they do nothing by default, except that the
    engine's latest look-ahead guess is kept for `prefetch_priority`."""

    name = "base"

    def __init__(self, num_layers: int, num_experts: int) -> None:
        self.num_layers = num_layers
        self.num_experts = num_experts
        self._lookahead = NO_LOOKAHEAD  # (layer, experts) of the latest guess

    def on_request_start(self, request_id: str) -> None:
        pass

    def on_request_end(self, request_id: str) -> None:
        pass

    def on_routing(
        self, layer: int, expert_ids: Sequence[int], tokens: int, phase: str, counts: Sequence[int] | None = None
    ) -> None:
        """A router at `layer` picked `expert_ids` (union over `tokens` tokens) in `phase`.

        `counts[i]`: how many of those tokens went to `expert_ids[i]` (None: one each).
        """

    def on_lookahead(self, layer: int, expert_ids: Sequence[int]) -> None:
        """The engine's guess of `layer`'s experts (its router applied one layer early)."""
        self._lookahead = (layer, frozenset(expert_ids))

    def on_access(self, key: ExpertKey) -> None:
        pass

    def on_insert(self, key: ExpertKey) -> None:
        pass

    def on_evict(self, key: ExpertKey) -> None:
        pass

    def victim(self, resident: Iterable[ExpertKey], protected: set[ExpertKey]) -> ExpertKey:
        """The resident expert to evict; raises LookupError when all are protected."""
        raise NotImplementedError

    def prefetch_candidates(self, layer: int) -> list[ExpertKey]:
        """Experts worth loading ahead after `layer`'s router ran, most wanted first."""
        return []

    def prefetch_priority(self, key: ExpertKey) -> float:
        """How much the policy wants `key` now (higher keeps it); used to bound prefetch.

        By default all are alike, except the engine's latest look-ahead guess: about to be
        used, it may displace the policy's victim.
        """
        return 1.0 if self._guessed(key) else 0.0

    def next_use_chance(self, key: ExpertKey) -> float | None:
        """The chance that `key`'s layer uses it on its next run; None: this policy does not estimate it."""
        return None

    def _guessed(self, key: ExpertKey) -> bool:
        layer, guess = self._lookahead
        return key[0] == layer and key[1] in guess


class LRUPolicy(Policy):
    """Evict the expert whose last use is oldest."""

    name = "lru"

    def __init__(self, num_layers: int, num_experts: int) -> None:
        super().__init__(num_layers, num_experts)
        self._order: OrderedDict[ExpertKey, None] = OrderedDict()  # oldest first

    def on_access(self, key: ExpertKey) -> None:
        self._order[key] = None
        self._order.move_to_end(key)

    def on_insert(self, key: ExpertKey) -> None:
        self.on_access(key)

    def on_evict(self, key: ExpertKey) -> None:
        self._order.pop(key, None)

    def victim(self, resident: Iterable[ExpertKey], protected: set[ExpertKey]) -> ExpertKey:
        for key in self._order:
            if key not in protected:
                return key
        raise LookupError("every resident expert is protected")


class LFUPolicy(Policy):
    """Evict the expert used least often since start (ties: least recently used).

    A heap keyed by (uses, last touch) finds the victim in O(log n); entries made stale
    by a later touch or an eviction are dropped when they reach the top.
    """

    name = "lfu"

    def __init__(self, num_layers: int, num_experts: int) -> None:
        super().__init__(num_layers, num_experts)
        self._counts: dict[ExpertKey, int] = {}
        self._entry: dict[ExpertKey, tuple[int, int]] = {}  # resident key → its live (count, touch)
        self._heap: list[tuple[int, int, ExpertKey]] = []
        self._clock = 0

    def on_access(self, key: ExpertKey) -> None:
        self._counts[key] = self._counts.get(key, 0) + 1
        self._touch(key)

    def on_insert(self, key: ExpertKey) -> None:
        self._touch(key)

    def on_evict(self, key: ExpertKey) -> None:
        self._entry.pop(key, None)

    def victim(self, resident: Iterable[ExpertKey], protected: set[ExpertKey]) -> ExpertKey:
        return first_unprotected(self._heap, lambda e: self._entry.get(e[2]) == e[:2], protected)

    def _touch(self, key: ExpertKey) -> None:
        self._clock += 1
        entry = (self._counts.get(key, 0), self._clock)
        self._entry[key] = entry
        heapq.heappush(self._heap, (*entry, key))
        if len(self._heap) > 4 * len(self._entry) + 64:  # mostly stale: rebuild
            self._heap = [(*entry, key) for key, entry in self._entry.items()]
            heapq.heapify(self._heap)


def first_unprotected(heap: list[tuple], is_live: Callable[[tuple], bool], protected: set[ExpertKey]) -> ExpertKey:
    """The key of the smallest live entry of a lazily pruned heap of `(..., key)` entries.

    Stale entries (`is_live` false) are dropped; protected ones are kept for later.
    """
    skipped = []
    try:
        while heap:
            entry = heap[0]
            if not is_live(entry):
                heapq.heappop(heap)
            elif entry[-1] in protected:
                skipped.append(heapq.heappop(heap))
            else:
                return entry[-1]
        raise LookupError("every resident expert is protected")
    finally:
        for entry in skipped:
            heapq.heappush(heap, entry)


PolicyFactory = Callable[[int, int], Policy]
POLICIES: dict[str, PolicyFactory] = {"lru": LRUPolicy, "lfu": LFUPolicy}


def register_policy(name: str, factory: PolicyFactory) -> None:
    POLICIES[name] = factory


def make_policy(name: str, num_layers: int, num_experts: int) -> Policy:
    try:
        factory = POLICIES[name]
    except KeyError:
        raise ValueError(f"unknown policy {name!r}; choose one of {', '.join(sorted(POLICIES))}") from None
    return factory(num_layers, num_experts)
