"""The device expert cache: a fixed pool of slots, a residency map and a replacement policy.

`ExpertCache` holds the bookkeeping (which (layer, expert) sits in which slot, what the
current step protects, hits/misses/prefetches); a backend moves the bytes. The engine
uses `SlotBackend` (real tensors, async copies on CUDA); the trace replay uses
`DryRunBackend`, so both run the same residency and policy code.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager

import torch

from cache.host_store import HostStore
from cache.policy import ExpertKey, Policy
from cache.stats import CacheStats


class DryRunBackend:
    """Moves nothing: for trace replay and tests of the bookkeeping."""

    fills_in_place = False

    def __init__(self, bytes_per_expert: int = 0) -> None:
        self.bytes_per_expert = bytes_per_expert

    def load(self, key: ExpertKey, slot: int) -> None:
        pass

    @contextmanager
    def staged(self, key: ExpertKey) -> Iterator[None]:
        yield None

    def fill(self, slot: int, src: None, prefetch: bool = False) -> None:
        pass

    def view(self, slot: int) -> None:
        return None

    def link_busy(self) -> bool:
        return False

    def wait(self, slot: int) -> None:
        pass

    def release(self, slot: int) -> None:
        pass


class SlotBackend:
    """Preallocated device slots filled from the host store.

    On CUDA a copy runs on a side stream and records an event; compute waits only for
    the slot it is about to read, and a slot is refilled only after the compute that
    last read it (and any earlier copy into it) has finished. Demand loads and prefetches
    use separate streams, the demand one at high priority, so that a demand load never
    queues behind prefetches issued before it.
    """

    fills_in_place = False  # a prefetch stages the host buffer, then queues the copy

    def __init__(self, host: HostStore, num_slots: int, device: torch.device) -> None:
        self.host = host
        self.device = device
        self.bytes_per_expert = host.bytes_per_expert
        self.slots = torch.empty(num_slots, host.layout.numel, dtype=host.dtype, device=device)  # [S, numel]
        self.cuda = device.type == "cuda"
        if self.cuda:
            self._demand_stream = torch.cuda.Stream(device, priority=-1)
            self._prefetch_stream = torch.cuda.Stream(device)
        self._loaded: dict[int, torch.cuda.Event] = {}  # slot → copy done
        self._released: dict[int, torch.cuda.Event] = {}  # slot → last compute on it done
        self._prefetching: list[torch.cuda.Event] = []  # prefetch copies not yet seen done

    def load(self, key: ExpertKey, slot: int) -> None:
        with self.host.hold(key) as src:  # a prefetch thread must not recycle it mid-copy
            self.fill(slot, src)

    def staged(self, key: ExpertKey) -> AbstractContextManager[torch.Tensor]:
        """The expert's host buffer, read now (maybe from disk) and kept until the block ends."""
        return self.host.hold(key)

    def fill(self, slot: int, src: torch.Tensor, prefetch: bool = False) -> None:
        """Copy a host buffer into a slot (on CUDA: queued on a side stream)."""
        if not self.cuda:
            self.slots[slot].copy_(src)
            return
        stream = self._prefetch_stream if prefetch else self._demand_stream
        with torch.cuda.stream(stream):
            for before in (self._released.pop(slot, None), self._loaded.get(slot)):
                if before is not None:
                    stream.wait_event(before)
            self.slots[slot].copy_(src, non_blocking=True)
            done = torch.cuda.Event()
            done.record(stream)
        self._loaded[slot] = done
        if prefetch:
            self._prefetching = [*self._pending_prefetches(), done]
        self.host.record_copy(src, done)

    def view(self, slot: int) -> torch.Tensor:
        return self.slots[slot]

    def link_busy(self) -> bool:
        """Prefetch copies still on the link (a demand copy issued now would wait for the one in flight)."""
        self._prefetching = self._pending_prefetches()
        return bool(self._prefetching)

    def _pending_prefetches(self) -> list[torch.cuda.Event]:
        return [done for done in self._prefetching if not done.query()]

    def measure_copy_ms(self, key: ExpertKey, repeats: int = 3) -> float:
        """The time of one expert's host→device copy on this link (median of `repeats`), in ms.

        Copies into a scratch buffer of one expert, never into a slot (which may hold an expert).
        """
        scratch = torch.empty_like(self.slots[0])
        stream = torch.cuda.current_stream(self.device)  # where the copy runs (not device 0's, on cuda:N)
        with self.host.hold(key) as src:
            times = []
            for _ in range(repeats):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record(stream)
                scratch.copy_(src, non_blocking=True)
                end.record(stream)
                end.synchronize()
                times.append(start.elapsed_time(end))
        return sorted(times)[len(times) // 2]

    def wait(self, slot: int) -> None:
        done = self._loaded.pop(slot, None) if self.cuda else None
        if done is not None:
            torch.cuda.current_stream(self.device).wait_event(done)

    def release(self, slot: int) -> None:
        if self.cuda:
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(self.device))
            self._released[slot] = event


class InPlaceBackend:
    """CPU: the slots are the RAM tier, and experts are computed where they lie.

    On a machine without a GPU there is no faster memory to copy into: a miss reads the
    expert from disk straight into its slot, and a hit costs nothing. With every expert
    in RAM (the default) nothing moves after start-up; a smaller `--host-cache-gb` makes
    the policy choose which experts stay in RAM and which are read from disk. A prefetch
    reads straight into the slot it reserved as well (`fills_in_place`): staging it in a
    buffer of its own first cost three times the read (allocation, read, copy).
    """

    fills_in_place = True

    def __init__(self, host: HostStore, num_slots: int) -> None:
        self.host = host
        self.bytes_per_expert = host.bytes_per_expert
        self.slots = torch.empty(num_slots, host.layout.numel, dtype=host.dtype)  # [S, numel]

    def load(self, key: ExpertKey, slot: int) -> None:
        self.host.read_into(key, self.slots[slot])

    def view(self, slot: int) -> torch.Tensor:
        return self.slots[slot]

    def link_busy(self) -> bool:
        return False

    def wait(self, slot: int) -> None:
        pass

    def release(self, slot: int) -> None:
        pass


class ExpertCache:
    def __init__(self, capacity: int, policy: Policy, stats: CacheStats, backend) -> None:
        if capacity < 1:
            raise ValueError("the expert cache needs at least one slot")
        self.capacity = capacity
        self.policy = policy
        self.stats = stats
        self.backend = backend
        self._slot_of: dict[ExpertKey, int] = {}
        self._free = list(range(capacity - 1, -1, -1))
        self._protected: set[ExpertKey] = set()
        self._prefetched_unused: set[ExpertKey] = set()
        # expert a prefetch evicted → the eviction count then; "soon after": within `capacity` evictions more
        self._prefetch_victims: OrderedDict[ExpertKey, int] = OrderedDict()
        self._evictions = 0
        self._filling: dict[ExpertKey, int] = {}  # in-place prefetches reading into their reserved slot
        self._demand_loading: ExpertKey | None = None  # the step's miss waiting in `_take_slot` for a slot
        self._lock = threading.RLock()
        self._filled = threading.Condition(self._lock)

    def preload(self, keys: Sequence[ExpertKey]) -> None:
        """Load `keys` in order into the free slots at start-up (not counted as traffic)."""
        with self._lock:
            for key in keys:
                if not self._free:
                    return
                if key not in self._slot_of:
                    slot = self._free.pop()
                    self.backend.load(key, slot)
                    self._slot_of[key] = slot
                    self.policy.on_insert(key)

    # -- demand path -------------------------------------------------------------------
    def acquire(self, layer: int, experts: Sequence[int]) -> list[int]:
        """Make `experts` of `layer` resident and protected; return their slots.

        At most `capacity` experts can be acquired at once (callers stream larger sets
        in turns). Call `wait` before reading a view and `release` after the step.
        """
        if len(experts) > self.capacity:
            raise ValueError(f"cannot hold {len(experts)} experts at once in {self.capacity} slots")
        keys = [(layer, e) for e in experts]
        with self._lock:
            self._protected.update(keys)
            slots = []
            for key in keys:
                while key in self._filling:  # a prefetch is reading it into its slot: it comes soon
                    self._filled.wait()
                slot = self._slot_of.get(key)
                if slot is None:
                    self.stats.add("misses", layer)
                    if key in self._recent_prefetch_victims():  # a prefetch evicted it lately
                        del self._prefetch_victims[key]
                        self.stats.add("prefetch_regrets", layer)
                    slot = self._load(key)
                else:
                    self.stats.add("hits", layer)
                    if key in self._prefetched_unused:
                        self._prefetched_unused.discard(key)
                        self.stats.add("prefetch_used", layer)
                self.policy.on_access(key)
                slots.append(slot)
            return slots

    def protect(self, layer: int, experts: Sequence[int]) -> None:
        """Keep `experts` of `layer` from being evicted (by a prefetch thread) until `unprotect`.

        The engine protects a step's experts as soon as its router has chosen them, before
        the policy hears of the step: a prefetch in between can then never evict them.
        """
        with self._lock:
            self._protected.update((layer, e) for e in experts)

    def unprotect(self, layer: int, experts: Sequence[int]) -> None:
        with self._lock:
            self._protected.difference_update((layer, e) for e in experts)

    def wait(self, layer: int, expert: int) -> None:
        self.backend.wait(self._slot_of[(layer, expert)])

    def release(self, layer: int, experts: Sequence[int]) -> None:
        with self._lock:
            for e in experts:
                key = (layer, e)
                self._protected.discard(key)
                self.backend.release(self._slot_of[key])

    # -- prefetch path -----------------------------------------------------------------
    def prefetch(self, key: ExpertKey) -> bool:
        """Load `key` ahead of need if that displaces nothing the policy values more.

        The host read (from disk when the RAM tier does not hold it) runs outside the
        cache lock: a step whose experts are resident never waits for it. On CUDA the read
        fills a host buffer and the copy into the slot is queued, not waited for; a demand
        read from disk may wait for the one host read in progress. In place (CPU) the read
        goes straight into a slot reserved under the lock; a step that needs `key` meanwhile
        waits for that read instead of reading it a second time.
        """
        with self._lock:
            if not self._admits(key):
                return False
            if self.backend.fills_in_place:
                slot = self._take_slot(for_prefetch=True)
                self._filling[key] = slot
        if self.backend.fills_in_place:
            return self._fill_reserved(key, slot)
        with self.backend.staged(key) as src:
            with self._lock:
                if not self._admits(key):  # the engine moved on while we read
                    return False
                slot = self._take_slot(for_prefetch=True)
                self.backend.fill(slot, src, prefetch=True)
                self._register_prefetch(key, slot)
                return True

    def _fill_reserved(self, key: ExpertKey, slot: int) -> bool:
        try:
            self.backend.load(key, slot)
        except BaseException:
            with self._filled:
                del self._filling[key]
                self._free.append(slot)
                self._filled.notify_all()
            raise
        with self._filled:
            del self._filling[key]
            self._register_prefetch(key, slot)
            self._filled.notify_all()
        return True

    def _register_prefetch(self, key: ExpertKey, slot: int) -> None:
        self._register(key, slot)
        self._prefetched_unused.add(key)
        self.stats.add("prefetches", key[0])

    def _admits(self, key: ExpertKey) -> bool:
        if key in self._slot_of or key in self._filling or key == self._demand_loading:
            return False
        if self._free:
            return True
        victim = self._victim()
        return victim is not None and self.policy.prefetch_priority(victim) < self.policy.prefetch_priority(key)

    # -- inspection --------------------------------------------------------------------
    def is_resident(self, key: ExpertKey) -> bool:
        return key in self._slot_of

    def resident(self) -> list[ExpertKey]:
        with self._lock:
            return sorted(self._slot_of)

    # -- internals ---------------------------------------------------------------------
    def _victim(self) -> ExpertKey | None:
        try:
            return self.policy.victim(self._slot_of.keys(), self._protected)
        except LookupError:  # every resident expert is protected
            return None

    def _load(self, key: ExpertKey) -> int:
        # `_take_slot` may wait for an in-place prefetch's read, releasing the lock: a prefetch of `key`
        # admitted meanwhile would make it resident and protected, leaving the step no victim for its slot
        self._demand_loading = key
        try:
            slot = self._take_slot()
        finally:
            self._demand_loading = None
        self.backend.load(key, slot)
        self._register(key, slot)
        return slot

    def _take_slot(self, for_prefetch: bool = False) -> int:
        """A free slot, else the policy's victim's (after a prefetch's read into a slot it reserved,
        when that slot is the only one left)."""
        if self._free:
            return self._free.pop()
        victim = self._victim()
        while victim is None and self._filling and not for_prefetch:
            self._filled.wait()
            if self._free:
                return self._free.pop()
            victim = self._victim()
        if victim is None:
            raise RuntimeError("expert cache full of protected experts")
        slot = self._slot_of.pop(victim)
        self._prefetched_unused.discard(victim)
        self.policy.on_evict(victim)
        self.stats.add("evictions", victim[0])
        self._evictions += 1
        if for_prefetch:  # if it is missed within `capacity` evictions more: a regret
            self._prefetch_victims[victim] = self._evictions
            self.stats.add("prefetch_evictions", victim[0])
        return slot

    def _recent_prefetch_victims(self) -> OrderedDict[ExpertKey, int]:
        """Victims of prefetches evicted no more than `capacity` evictions ago. Counted in evictions, not
        in prefetches: once the gate stops prefetching, old victims stop counting (they used to count
        whenever missed, however late, which held the regret near 1 and the gate shut for good)."""
        victims = self._prefetch_victims
        while victims and self._evictions - next(iter(victims.values())) >= self.capacity:
            victims.popitem(last=False)
        return victims

    def _register(self, key: ExpertKey, slot: int) -> None:
        self._slot_of[key] = slot
        self.policy.on_insert(key)
        self.stats.add("bytes_transferred", key[0], self.backend.bytes_per_expert)
