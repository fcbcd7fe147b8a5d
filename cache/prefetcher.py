"""Loading experts of the next layer ahead of need.

After layer l's router runs, two signals name experts that layer l+1 will probably use:
- look-ahead (decode steps only): layer l+1's router applied to layer l's expert input.
  Consecutive hidden states are close, so this guesses l+1's top-k before l+1 runs;
  only the engine has this signal. Its hit rate is counted (`lookahead_*`).
- the policy's own prediction (`Policy.prefetch_candidates`), e.g. from the EAMC.
Loads go through `ExpertCache.prefetch`, which refuses to displace anything the policy
values more, so a prefetch never evicts an expert needed sooner. On CUDA the copy is
already asynchronous (side stream); on CPU a background thread does the copying. Newer
predictions replace older ones that have not started yet.

With a `PrefetchCost` a guess is issued only when it is likely enough to pay for its
bytes (`PrefetchCost.worth`): what it can hide inside the layer's compute window must
outweigh the delay its copy past that window may add and the chance that the expert it
evicts is missed soon after. The chance of a guess is its source's (look-ahead, policy)
recent accuracy at that layer, scored online on every guess, issued or not. Without a
cost every guess is issued.
"""

from __future__ import annotations

import logging
import statistics
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import ClassVar

import torch

from cache.expert_cache import ExpertCache
from cache.host_store import ReadTimes, thread_cpu_and_queue_ns
from cache.policy import ExpertKey

log = logging.getLogger(__name__)

PREFETCH_LIMIT_PER_TOP_K = 2  # most prefetches issued after one layer, in units of top_k
Router = Callable[[torch.Tensor], torch.Tensor]  # hidden [T, H] → top-k expert ids [T, k]


@dataclass
class PrefetchCost:
    """What one prefetched expert costs and can save, in ms.

    `copy_ms`: its copy over the link. `overlap_ms`: the compute of one layer, between the
    prefetch and the next layer's demand copies. Link time inside that window is free: a
    wrong guess there delays nothing. A copy reaching past it delays the next layer's
    demand copies by the part beyond if the guess is wrong, and if right saves only the
    part inside (past the window its bytes would have moved as a demand copy anyway).
    `stolen_ms`: compute time a prefetch takes from the step wherever it falls (0 on a link).
    """

    copy_ms: float
    overlap_ms: float
    measure_overlap: bool = False  # the engine: learn `overlap_ms` from the decode steps it times
    stolen_ms: float = 0.0

    times_prefetches: ClassVar[bool] = False  # whether `observe_prefetch` uses the prefetch thread's clocks

    def observe_layer(self, ms: float) -> None:
        """The measured compute of one decode layer (a running average)."""
        self.overlap_ms = ms if self.overlap_ms <= 0 else 0.9 * self.overlap_ms + 0.1 * ms

    def demand_ms(self) -> float:
        """What loading one expert on demand adds to a step."""
        return self.copy_ms + self.stolen_ms

    def worth(self, chance: float, spent_ms: float, regret: float = 0.0) -> bool:
        """Whether one more copy, queued behind `spent_ms` of this layer's prefetches, pays off.

        `regret`: the chance that the expert it evicts is missed soon after (a load more).
        A right guess takes `stolen_ms` too, but spares the demand load that would have taken it.
        """
        free = max(0.0, self.overlap_ms - spent_ms)
        beyond = max(0.0, spent_ms + self.copy_ms - self.overlap_ms)
        return chance * min(self.copy_ms, free) > (1.0 - chance) * (beyond + self.stolen_ms) + regret * self.demand_ms()

    def may_pay(self, regret: float) -> bool:
        """Whether guessing is worth its own cost (the look-ahead's router, the policy's ranking)."""
        return True

    def observe_prefetch(self, cpu_ms: float, queued_ms: float) -> None:
        """One prefetch's CPU time and wait for a core on the prefetch thread (a link's cost ignores them)."""

    def figures(self) -> dict:
        """What this cost measures besides the copy and the window (shown in /v1/expert-cache)."""
        return {}


@dataclass
class HostReadCost(PrefetchCost):
    """On CPU a prefetch reads an expert from disk into its RAM slot, on the prefetch thread.

    Its time waiting on the disk overlaps the engine's compute as a copy on a link does. Its CPU
    time (the kernel copying out of the page cache) does so only when the compute leaves a core
    free (`core_to_spare`); otherwise it is taken from the step, and every member of the compute's
    thread team waits for the one it pre-empted (bench.cpu_prefetch, 2 cores, every read from
    the page cache: prefetch on cost 9-18% more per token than off). Figures: `reads`, measured
    on every read, demand or prefetch; whether the spare core is free, on every prefetch.
    """

    reads: ReadTimes = field(default_factory=ReadTimes)
    spare_core: bool = False
    clock: Callable[[], float] = time.monotonic
    contended_until: float = 0.0  # `clock` time: till then the spare core is taken (`observe_prefetch`)
    prefetch_reads: ReadTimes = field(default_factory=ReadTimes)  # the prefetch thread's, since the last back-off
    # wait for a core ÷ CPU time of each of the prefetch thread's latest prefetches
    wait_shares: deque[float] = field(default_factory=lambda: deque(maxlen=HostReadCost.JUDGED_OVER))

    times_prefetches: ClassVar[bool] = True
    CONTENDED_BACKOFF_S: ClassVar[float] = 10.0  # how long the gate's CPU rule holds once the spare core was found taken
    CONTENDED_SHARE: ClassVar[float] = 0.5  # a prefetch's typical wait for a core, in its CPU time, that means it is taken
    JUDGED_OVER: ClassVar[int] = 9  # prefetches whose median wait judges the core (odd: a middle one)

    def core_to_spare(self) -> bool:
        """The compute leaves a core, and the prefetch reads have lately found it free."""
        return self.spare_core and self.clock() >= self.contended_until

    def observe_prefetch(self, cpu_ms: float, queued_ms: float) -> None:
        """One prefetch on the prefetch thread: its CPU time and its wait for a core. The median of the
        latest prefetches' wait ÷ CPU time judges whether another job holds the core the compute leaves.
        The median, not the mean: bench.cpu_prefetch's model (one compute thread on 2 cores) measured
        wait ÷ CPU per prefetch at median 0 and p99 0.29 with the other core idle, so one passing job
        tripped a mean, and at median 1.9 with a busy loop on that core. Once taken, the gate holds for
        `CONTENDED_BACKOFF_S` and then judges afresh."""
        self.prefetch_reads.observe(cpu_ms + queued_ms, cpu_ms, queued_ms)
        self.wait_shares.append(queued_ms / max(cpu_ms, 1e-3))
        if len(self.wait_shares) == self.JUDGED_OVER and statistics.median(self.wait_shares) > self.CONTENDED_SHARE:
            self.contended_until = self.clock() + self.CONTENDED_BACKOFF_S
            self.prefetch_reads = ReadTimes()
            self.wait_shares.clear()

    def refresh(self) -> None:
        if self.core_to_spare():
            self.copy_ms, self.stolen_ms = self.reads.wall_ms, 0.0
        else:
            self.copy_ms, self.stolen_ms = self.reads.disk_ms, self.reads.cpu_ms

    def demand_ms(self) -> float:
        return self.reads.wall_ms  # on the engine thread: every part of it

    def worth(self, chance: float, spent_ms: float, regret: float = 0.0) -> bool:
        self.refresh()
        return super().worth(chance, spent_ms, regret)

    def may_pay(self, regret: float) -> bool:
        """Whether even a sure guess would pay: with every read from the page cache and no core to
        spare, none does, and the look-ahead is not worth computing either (CPU, every expert
        resident: look-ahead alone cost 15% per token)."""
        return self.worth(1.0, 0.0, regret)

    def figures(self) -> dict:
        reads = self.reads
        return {"spare_core": self.core_to_spare(), "reads": reads.reads, "read_ms": round(reads.wall_ms, 3),
                "read_cpu_ms": round(reads.cpu_ms, 3), "read_queued_ms": round(reads.queued_ms, 3),
                "read_disk_ms": round(reads.disk_ms, 3), "prefetch_read_cpu_ms": round(self.prefetch_reads.cpu_ms, 3),
                "prefetch_read_queued_ms": round(self.prefetch_reads.queued_ms, 3),
                "prefetch_wait_share_median": round(statistics.median(self.wait_shares), 3) if self.wait_shares else None}


@dataclass(frozen=True)
class LayerMark:
    """The clock and the cache's counts at one layer's prefetch point."""

    time: float  # seconds
    misses: int
    prefetches: int
    phase: str
    link_free: bool  # no prefetch copy on the link then
    own_misses: int | None  # demand copies since the mark before: this layer's own


class SourceAccuracy:
    """The recent share of right guesses of one source, per target layer (decayed counts)."""

    def __init__(self, num_layers: int, prior: float = 0.5, prior_weight: float = 4.0, decay: float = 0.98) -> None:
        self.right = [prior * prior_weight] * num_layers
        self.total = [prior_weight] * num_layers
        self.decay = decay

    def score(self, layer: int, guessed: set[int], needed: list[int]) -> None:
        if not guessed:
            return  # nothing guessed tells nothing (and must not age what was learned)
        self.right[layer] = self.decay * self.right[layer] + len(guessed.intersection(needed))
        self.total[layer] = self.decay * self.total[layer] + len(guessed)

    def of(self, layer: int) -> float:
        return self.right[layer] / self.total[layer]


class Prefetcher:
    def __init__(
        self,
        cache: ExpertCache,
        routers: list[Router | None],
        background: bool,
        limit: int,
        cost: PrefetchCost | None = None,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.cache = cache
        self.clock = clock  # seconds; the timed replay passes its simulated clock
        self.routers = routers  # routers[l]: MoE layer l's router, for look-ahead from layer l-1
        self.limit = limit  # most prefetches issued after one layer
        self.cost = cost  # None: issue every guess
        self.lookahead_predicted = 0
        self.lookahead_correct = 0
        self.held_back = 0  # guesses not issued: not worth their cost
        self.failures = 0  # prefetches that raised (e.g. a failed disk read); the engine carries on
        # per source, the recent share of right guesses ("lookahead_absent": of those not resident when made)
        self.accuracy = {source: SourceAccuracy(len(routers)) for source in ("lookahead", "lookahead_absent", "policy")}
        self._guesses: dict[str, tuple[int, set[int]]] = {}  # source → (layer, experts) guessed for that layer
        self._last_mark: LayerMark | None = None  # at the last layer's prefetch point
        self._queue = GuessQueue()
        self._thread = None
        if background:
            # the thread holds the prefetcher only weakly: one that its owner drops without close() is
            # collected, and its finalizer ends the thread
            self._thread = threading.Thread(target=_work, args=(weakref.ref(self), self._queue),
                                            name="expert-prefetch", daemon=True)
            weakref.finalize(self, self._queue.close)
            self._thread.start()

    def lookahead(self, layer: int, hidden: torch.Tensor | None, phase: str) -> torch.Tensor | None:
        """Layer `layer + 1`'s router applied to `layer`'s input (decode only): the expert ids it
        would pick, still on the device (the caller reads them with its own routing, one sync)."""
        if phase != "decode" or layer + 1 >= len(self.routers) or self.routers[layer + 1] is None:
            return None
        if not self._guessing_pays():
            return None
        return self.routers[layer + 1](hidden)

    def after_routing(
        self, layer: int, hidden: torch.Tensor | None, needed: list[int], phase: str, guess: list[int] | None = None
    ) -> None:
        """`guess`: the look-ahead's expert ids for `layer + 1` if the caller already read them."""
        self._score_guesses(layer, needed)
        if self.cost is not None and self.cost.measure_overlap:
            self._time_layer(phase)
        if not self._guessing_pays():
            return
        guesses: dict[ExpertKey, float] = {}  # key → its source's recent accuracy at that layer
        if guess is None and (ids := self.lookahead(layer, hidden, phase)) is not None:
            guess = ids.flatten().tolist()
        if guess is not None:
            guess = sorted(set(guess))
            self._guesses["lookahead"] = (layer + 1, set(guess))
            # the chance a copy pays is that of the guesses not resident: only they are copied, and they
            # are the harder ones (engine, Mixtral shape: right 0.60 of the time against 0.78 resident)
            self._guesses["lookahead_absent"] = (layer + 1, {e for e in guess if not self.cache.is_resident((layer + 1, e))})
            self.cache.policy.on_lookahead(layer + 1, guess)  # so the cache admits them
            chance = self.accuracy["lookahead_absent"].of(layer + 1)
            guesses.update({(layer + 1, e): chance for e in guess})
        candidates = self.cache.policy.prefetch_candidates(layer)
        nearest = [k for k in candidates if k[0] == (layer + 1) % len(self.routers)]
        if nearest:
            self._guesses["policy"] = (nearest[0][0], {e for _, e in nearest})
        for key in candidates:
            guesses.setdefault(key, self.accuracy["policy"].of(key[0]))
        ranked = sorted(guesses.items(), key=lambda item: -item[1])  # most likely first (stable)
        self._submit(ranked[: self.limit])

    def _guessing_pays(self) -> bool:
        return self.cost is None or self.cost.may_pay(self._regret())

    def _regret(self) -> float:
        """How often an expert a prefetch evicted was missed soon after (a prior of 1 in 4 at first)."""
        totals = self.cache.stats.totals()
        return (totals["prefetch_regrets"] + 1) / (totals["prefetch_evictions"] + 4)

    def _time_layer(self, phase: str) -> None:
        """Time from one decode layer's prefetch point to the next one's, less the link time of the
        layer's own demand copies (issued just before its prefetch point; its compute waits for them):
        one layer's compute.

        Only intervals without prefetch copies count: a step waiting for a prefetch still in flight, or
        a demand copy queued behind one, stalls compute without a miss to subtract. Timed so, the window
        grew with every prefetch issued, which made the gate issue more (timed replay, Mixtral-size
        experts at 8 of 32 on random routing: 6.4 ms learned for 2.5 ms of compute)."""
        totals = self.cache.stats.totals()
        last = self._last_mark
        mark = LayerMark(self.clock(), totals["misses"], totals["prefetches"], phase,
                         not self.cache.backend.link_busy(),
                         totals["misses"] - last.misses if last is not None and last.phase == phase else None)
        self._last_mark = mark
        if last is None or last.own_misses is None or not (phase == last.phase == "decode"):
            return
        if not last.link_free or mark.prefetches != last.prefetches:
            return
        compute_ms = 1000 * (mark.time - last.time) - last.own_misses * self.cost.demand_ms()
        if compute_ms > 0:
            self.cost.observe_layer(compute_ms)

    def close(self) -> None:
        self._queue.close()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def gate_info(self) -> dict | None:
        """What the gate weighs (None without one: every guess is issued)."""
        if self.cost is None:
            return None
        return {
            "copy_ms": round(self.cost.copy_ms, 3),
            "stolen_ms": round(self.cost.stolen_ms, 3),
            "compute_window_ms": round(self.cost.overlap_ms, 3),
            "held_back": self.held_back,
            **self.cost.figures(),
            "regret": round(self._regret(), 3),
            "accuracy_by_layer": {source: [round(acc.of(layer), 3) for layer in range(len(self.routers))]
                                  for source, acc in self.accuracy.items()},
        }

    @property
    def lookahead_accuracy(self) -> float | None:
        return self.lookahead_correct / self.lookahead_predicted if self.lookahead_predicted else None

    def _score_guesses(self, layer: int, needed: list[int]) -> None:
        for source, (target, guessed) in list(self._guesses.items()):
            if target != layer:
                continue
            self.accuracy[source].score(layer, guessed, needed)
            if source == "lookahead":
                self.lookahead_predicted += len(guessed)
                self.lookahead_correct += len(guessed.intersection(needed))
            del self._guesses[source]

    def _submit(self, guesses: list[tuple[ExpertKey, float]]) -> None:
        if self._thread is None:
            spent = 0.0
            for key, chance in guesses:
                spent = self._prefetch(key, chance, spent)
            return
        self._queue.replace(guesses)

    def _prefetch(self, key: ExpertKey, chance: float, spent_ms: float) -> float:
        """One prefetch, if it pays (see `PrefetchCost`); the link time spent on this layer's
        prefetches after it. A failure is counted and logged, never fatal: it was only a guess."""
        if self.cost is not None and not self.cost.worth(chance, spent_ms, self._regret()):
            self.held_back += 1
            return spent_ms
        timed = self.cost is not None and self.cost.times_prefetches
        try:
            cpu_ns, queued_ns = thread_cpu_and_queue_ns() if timed else (0, 0)
            if self.cache.prefetch(key) and self.cost is not None:
                spent_ms += self.cost.copy_ms
                if timed:  # a read happened: what it cost this thread
                    cpu_end_ns, queued_end_ns = thread_cpu_and_queue_ns()
                    self.cost.observe_prefetch((cpu_end_ns - cpu_ns) / 1e6, (queued_end_ns - queued_ns) / 1e6)
        except Exception as exc:
            self.failures += 1
            if self.failures == 1:
                log.warning("prefetching expert %s failed; counting further failures quietly", key, exc_info=True)
            else:
                log.debug("prefetching expert %s failed: %s", key, exc)
        return spent_ms


class GuessQueue:
    """The guesses the prefetch thread has still to issue, most likely first."""

    def __init__(self) -> None:
        self._wake = threading.Condition()
        self._pending: list[tuple[ExpertKey, float]] = []  # (key, chance)
        self._spent = 0.0  # link ms of the pending batch's prefetches issued so far
        self._closed = False

    def replace(self, guesses: list[tuple[ExpertKey, float]]) -> None:
        """A layer's guesses supersede what the last layer asked for."""
        with self._wake:
            self._pending = list(guesses)
            self._spent = 0.0
            self._wake.notify()

    def next(self) -> tuple[ExpertKey, float, float] | None:
        """Waits for the next guess: (key, chance, link ms spent so far), or None once closed."""
        with self._wake:
            while not self._pending and not self._closed:
                self._wake.wait()
            if self._closed:
                return None
            key, chance = self._pending.pop(0)
            return key, chance, self._spent

    def record_spent(self, spent_ms: float) -> None:
        with self._wake:
            self._spent = spent_ms

    def close(self) -> None:
        with self._wake:
            self._closed = True
            self._wake.notify()


def _work(prefetcher_ref: weakref.ref[Prefetcher], queue: GuessQueue) -> None:
    """The prefetch thread. It holds the prefetcher only while it issues a guess."""
    # One intra-op thread here: a torch op this thread runs in parallel gives it an OpenMP team of its
    # own, whose workers then contend with the engine thread's for every core (on 2 cores the engine's
    # compute ran 2x slower from the first prefetch on, for the rest of the process)
    torch.set_num_threads(1)
    while (guess := queue.next()) is not None:
        prefetcher = prefetcher_ref()
        if prefetcher is None:
            return
        key, chance, spent = guess
        queue.record_spent(prefetcher._prefetch(key, chance, spent))
        del prefetcher  # waiting must not keep it alive
