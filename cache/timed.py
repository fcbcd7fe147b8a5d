"""A timing model of one host→device link and the decode loop, for the timed trace replay.

The replay's cache and policy decide *which* experts move; this decides *when* they
arrive and so how long a token takes, without a GPU:

- one link of `link_gbps` (GB/s) carries copies one chunk at a time; a chunk that has
  started runs to its end (a copy in flight cannot be pre-empted), then demand copies go
  before queued prefetch copies (the engine's high-priority demand stream). `chunk_mb=0`
  copies each expert whole, as the engine does today;
- each of the two streams copies in the order it was given; a copy into a slot never
  starts before the slot's previous copy has finished (the engine waits for it), even
  when that lets queued prefetches go ahead of a demand copy;
- a MoE layer's compute (`compute_ms`, attention and the rest included) starts when all
  of its experts have arrived; the link keeps copying meanwhile. A token adds
  `token_ms` once (embedding, LM head, sampling);
- with `cpu_gbps`, a missed expert may instead be computed on the host cores, reading its
  weights at that rate, side by side with the link (`cache.miss_planner` decides which);
  the layer's compute starts once the host's results are in too. A shared miss puts its host
  part on the host cores and the rest on the link as a demand copy into no slot, which the
  layer's compute also waits for (the exchange of its intermediate activations is not timed).

Time is simulated in milliseconds. `TimedBackend` is the replay's transfer backend; it
tells the link about every demand load and prefetch the cache issues.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from cache.policy import ExpertKey

MIXTRAL_EXPERT_BYTES = 3 * 4096 * 14336 * 2  # bf16 gate, up and down of Mixtral-8x7B: 352 MB


@dataclass(frozen=True)
class LinkSpec:
    """Defaults: Mixtral-8x7B bf16 experts on a 24 GB consumer card over PCIe 4.0 x16."""

    expert_bytes: int = MIXTRAL_EXPERT_BYTES
    link_gbps: float = 24.0  # pinned host→device, measured rate (PCIe 4.0 x16 gives ~24 of its 32)
    compute_ms: float = 1.6  # one MoE layer of one decode token, all experts resident
    token_ms: float = 0.0  # per token, outside the MoE layers
    chunk_bytes: int = 0  # copy granularity; 0: whole experts
    cpu_gbps: float = 0.0  # host cores' read rate of expert weights; 0: no host executor
    share_misses: bool = True  # with cpu_gbps: one miss per step may be shared by both lanes (`cache.miss_planner`)

    def copy_ms(self, num_bytes: int) -> float:
        return num_bytes / (self.link_gbps * 1e6)

    def host_ms(self, num_bytes: int) -> float:
        return num_bytes / (self.cpu_gbps * 1e6)


class Transfer:
    __slots__ = ("slot", "left", "prefetch", "after", "done_at", "queued_at")

    def __init__(self, slot: int, size: int, prefetch: bool, after: Transfer | None, queued_at: float) -> None:
        self.slot, self.left, self.prefetch, self.after = slot, size, prefetch, after
        self.done_at: float | None = None
        self.queued_at = queued_at


class Link:
    """The copy queue of one link; `now` is the engine's clock, `busy_until` the link's."""

    def __init__(self, spec: LinkSpec) -> None:
        self.spec = spec
        self.now = 0.0
        self.busy_until = 0.0
        self.host_until = 0.0  # when the host cores finish the experts given to them
        self.bytes_moved = 0
        self._running_prefetch = False  # the chunk that ends at `busy_until` is a prefetch's
        self._demand: deque[Transfer] = deque()
        self._prefetch: deque[Transfer] = deque()
        self._last: dict[int, Transfer] = {}  # slot → its latest copy
        self._parts: list[Transfer] = []  # copies of shared experts' device parts, into no slot
        self.part_bytes = 0  # bytes of those parts (decode only: prefill shares nothing)

    def copy(self, slot: int, prefetch: bool) -> None:
        """Queue a copy of one expert into `slot`, issued at `now`."""
        self._commit_started()
        before = self._last.get(slot)
        transfer = Transfer(slot, self.spec.expert_bytes, prefetch, before if before and before.done_at is None else None,
                            self.now)
        self._last[slot] = transfer
        (self._prefetch if prefetch else self._demand).append(transfer)

    def wait(self, slot: int) -> None:
        """Advance the engine's clock until the latest copy into `slot` has arrived."""
        transfer = self._last.get(slot)
        if transfer is None:
            return
        while transfer.done_at is None:
            self._run_chunk()
        self.now = max(self.now, transfer.done_at)

    def prefetching(self) -> bool:
        """Prefetch copies in flight or queued at `now`."""
        self._commit_started()
        return bool(self._prefetch) or (self._running_prefetch and self.busy_until > self.now)

    def copy_part(self, num_bytes: int) -> None:
        """Queue a demand copy of part of an expert, for this step only (no slot), issued at `now`."""
        self._commit_started()
        transfer = Transfer(-1, num_bytes, False, None, self.now)
        self.part_bytes += num_bytes
        self._parts.append(transfer)
        self._demand.append(transfer)

    def compute(self, ms: float) -> None:
        for part in self._parts:
            while part.done_at is None:
                self._run_chunk()
            self.now = max(self.now, part.done_at)
        self._parts.clear()
        self.now = max(self.now, self.host_until) + ms

    def compute_on_host(self, ms: float) -> None:
        """An expert computed on the host cores from `now` (or when they are free)."""
        self.host_until = max(self.now, self.host_until) + ms

    def _commit_started(self) -> None:
        """Chunks that started before `now` were chosen without what is issued now."""
        while self.busy_until < self.now and (self._demand or self._prefetch):
            self._run_chunk()

    def _run_chunk(self) -> None:
        transfer = self._next()
        size = transfer.left if self.spec.chunk_bytes <= 0 else min(transfer.left, self.spec.chunk_bytes)
        start = max(self.busy_until, transfer.queued_at)
        self.busy_until = start + self.spec.copy_ms(size)
        self._running_prefetch = transfer.prefetch
        transfer.left -= size
        self.bytes_moved += size
        if transfer.left == 0:
            transfer.done_at = self.busy_until
            (self._prefetch if transfer.prefetch else self._demand).remove(transfer)

    def _next(self) -> Transfer:
        """Demand first. A copy waiting for its slot's earlier copy lets that one's stream go
        first; each stream (demand, prefetch) copies in the order it was given."""
        queue = self._demand or self._prefetch
        if not queue:
            raise RuntimeError("waiting for a copy that was never issued")
        blocker = queue[0]
        while blocker.after is not None and blocker.after.done_at is None:
            blocker = blocker.after
        return (self._prefetch if blocker.prefetch else self._demand)[0]


class TimedBackend:
    """The replay's transfer backend with a `Link`: loads and prefetches become timed copies."""

    fills_in_place = False

    def __init__(self, link: Link) -> None:
        self.link = link
        self.bytes_per_expert = link.spec.expert_bytes

    def load(self, key: ExpertKey, slot: int) -> None:
        self.link.copy(slot, prefetch=False)

    @contextmanager
    def staged(self, key: ExpertKey) -> Iterator[None]:
        yield None

    def fill(self, slot: int, src: None, prefetch: bool = False) -> None:
        self.link.copy(slot, prefetch=prefetch)

    def view(self, slot: int) -> None:
        return None

    def link_busy(self) -> bool:
        """Prefetch copies still on the link, as `SlotBackend.link_busy`."""
        return self.link.prefetching()

    def wait(self, slot: int) -> None:
        self.link.wait(slot)

    def release(self, slot: int) -> None:
        pass
