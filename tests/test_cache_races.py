"""The host tier under a concurrent prefetch thread: a slot always holds the weights of the
expert it is registered for, whatever the interleaving of demand loads and prefetches.

Every expert is filled with one constant, so a slot that received another expert's bytes
(or a mix of two) shows it at once.
"""

import random
import threading
import time
from collections.abc import Callable
from contextlib import contextmanager

import pytest
import torch
from safetensors.torch import save_file

from cache.expert_cache import ExpertCache, InPlaceBackend, SlotBackend
from cache.host_store import ExpertLayout, HostStore, Segment
from cache.policy import LRUPolicy
from cache.prefetcher import Prefetcher
from cache.runtime import ExpertRuntime
from cache.safetensors_index import index_checkpoint
from cache.sparsity_aware import SparsityAwarePolicy
from cache.stats import CacheStats

H, INTER, E, L = 64, 96, 8, 2


def value_of(key: tuple[int, int]) -> float:
    return float(key[0] * 100 + key[1] + 1)


@pytest.fixture
def constant_experts(tmp_path):
    tensors = {}
    for layer in range(L):
        for e in range(E):
            v = value_of((layer, e))
            tensors[f"{layer}.{e}.gate"] = torch.full((INTER, H), v)
            tensors[f"{layer}.{e}.up"] = torch.full((INTER, H), v)
            tensors[f"{layer}.{e}.down"] = torch.full((H, INTER), v)
    save_file(tensors, str(tmp_path / "m.safetensors"))
    index = index_checkpoint(tmp_path)
    return {
        (layer, e): [Segment.slice_of(index[f"{layer}.{e}.{p}"]) for p in ("gate", "up", "down")]
        for layer in range(L)
        for e in range(E)
    }


def make_cache(sources, ram_experts: int, slots: int = 4, in_place: bool = False) -> tuple[ExpertCache, HostStore]:
    """`in_place`: the CPU engine's backend, whose slots are the RAM tier (the store then only reads disk)."""
    store = HostStore(sources, ExpertLayout.gated(H, INTER), torch.float32, capacity=ram_experts)
    policy = LRUPolicy(L, E)
    policy.on_lookahead(1, list(range(E)))  # layer-1 experts are guessed: prefetches displace layer-0 ones
    backend = InPlaceBackend(store, slots) if in_place else SlotBackend(store, slots, torch.device("cpu"))
    return ExpertCache(slots, policy, CacheStats(L), backend), store


def holds_only(view: torch.Tensor, key: tuple[int, int]) -> bool:
    values = torch.unique(view)
    return values.numel() == 1 and float(values[0]) == value_of(key)


def test_a_prefetch_cannot_recycle_the_buffer_a_demand_load_is_copying(constant_experts):
    cache, store = make_cache(constant_experts, ram_experts=1)
    for e in range(4):  # fill the four slots with layer-0 experts
        cache.acquire(0, [e])
        cache.release(0, [e])
    in_gap, go = threading.Event(), threading.Event()
    backend = cache.backend
    staged, fill = backend.staged, backend.fill

    def paused_staged(key):  # the prefetch thread, after its admission check, before its host read
        in_gap.set()
        assert go.wait(5)
        return staged(key)

    def slow_fill(slot, src, prefetch=False):  # the engine, after the host read, before the copy
        if not prefetch:
            go.set()
            time.sleep(0.2)  # the prefetch thread reads (1, 3) now, into whatever buffer is free
        return fill(slot, src, prefetch)

    backend.staged, backend.fill = paused_staged, slow_fill
    prefetch = threading.Thread(target=cache.prefetch, args=((1, 3),))
    prefetch.start()
    assert in_gap.wait(5)
    [view] = [cache.backend.view(slot) for slot in cache.acquire(0, [7])]
    cache.wait(0, 7)
    prefetch.join(5)
    assert cache.stats.totals()["prefetches"] == 1  # the race really ran
    assert holds_only(view, (0, 7))
    cache.release(0, [7])


class PausedRead:
    """Wraps a store's `read_into`: the read of `key` waits until the test lets it go."""

    def __init__(self, store: HostStore, key: tuple[int, int]) -> None:
        self.store, self.key, self.read = store, key, store.read_into
        self.reading, self.go = threading.Event(), threading.Event()
        self.reads: list[tuple[int, int]] = []
        store.read_into = self

    def __call__(self, key, buffer) -> None:
        self.reads.append(key)
        if key == self.key:
            self.reading.set()
            assert self.go.wait(5)
        self.read(key, buffer)


def test_in_place_a_step_needing_an_expert_being_prefetched_waits_for_that_read(constant_experts):
    cache, store = make_cache(constant_experts, ram_experts=0, in_place=True)
    paused = PausedRead(store, (1, 3))
    prefetch = threading.Thread(target=cache.prefetch, args=((1, 3),))
    prefetch.start()
    assert paused.reading.wait(5)
    use_resident = threading.Thread(target=lambda: (cache.acquire(0, [1]), cache.release(0, [1])))
    use_resident.start()
    use_resident.join(5)
    assert not use_resident.is_alive()  # another expert's step does not wait for the read
    wanted: list = []
    step = threading.Thread(target=lambda: wanted.extend(cache.acquire(1, [3])))
    step.start()
    step.join(0.2)
    assert step.is_alive()  # it waits for the prefetch's read, not for a read of its own
    paused.go.set()
    step.join(5)
    prefetch.join(5)
    assert holds_only(cache.backend.view(wanted[0]), (1, 3))
    assert paused.reads.count((1, 3)) == 1
    totals = cache.stats.totals()
    assert (totals["prefetches"], totals["prefetch_used"], totals["misses"]) == (1, 1, 1)  # the miss: (0, 1)
    cache.release(1, [3])


def test_in_place_a_step_needing_every_slot_waits_for_the_one_a_prefetch_reserved(constant_experts):
    cache, store = make_cache(constant_experts, ram_experts=0, slots=2, in_place=True)
    paused = PausedRead(store, (1, 5))
    prefetch = threading.Thread(target=cache.prefetch, args=((1, 5),))
    prefetch.start()
    assert paused.reading.wait(5)  # one of the two slots is reserved
    slots: list = []
    step = threading.Thread(target=lambda: slots.extend(cache.acquire(0, [1, 2])))
    step.start()
    step.join(0.2)
    assert step.is_alive()
    paused.go.set()
    step.join(5)
    prefetch.join(5)
    assert not step.is_alive() and len(slots) == 2
    for e, slot in zip([1, 2], slots):
        assert holds_only(cache.backend.view(slot), (0, e))
    cache.release(0, [1, 2])


class PrefetchesOnInsert(LRUPolicy):
    """The prefetch thread's next guess, admitted the moment its last read is registered (under the
    cache lock, before any waiting step can take the lock back)."""

    def __init__(self, cache_of: Callable[[], ExpertCache], after: tuple[int, int], guess: tuple[int, int]) -> None:
        super().__init__(L, E)
        self.cache_of, self.after, self.guess = cache_of, after, guess
        self.on_lookahead(guess[0], [guess[1]])  # the guess outranks what is resident: it may evict
        self.admitted: list[bool] = []

    def on_insert(self, key: tuple[int, int]) -> None:
        super().on_insert(key)
        if key == self.after:
            self.admitted.append(self.cache_of().prefetch(self.guess))


def test_in_place_no_prefetch_brings_in_the_expert_a_waiting_step_is_loading(constant_experts):
    """The step's miss waits for a slot that a prefetch's read holds. Had the prefetch thread then
    brought in that very expert, the step's load would find every slot resident and protected (its
    own expert among them) and fail: "expert cache full of protected experts" (CI, a 3-slot engine)."""
    store = HostStore(constant_experts, ExpertLayout.gated(H, INTER), torch.float32, capacity=0)
    policy = PrefetchesOnInsert(lambda: cache, after=(1, 5), guess=(0, 2))
    cache = ExpertCache(2, policy, CacheStats(L), InPlaceBackend(store, 2))
    paused = PausedRead(store, (1, 5))
    prefetch = threading.Thread(target=cache.prefetch, args=((1, 5),))
    prefetch.start()
    assert paused.reading.wait(5)  # one of the two slots is reserved
    slots: list = []
    errors: list[BaseException] = []

    def step() -> None:
        try:
            slots.extend(cache.acquire(0, [1, 2]))  # (0, 1) takes the free slot; (0, 2) waits for the other
        except BaseException as e:
            errors.append(e)

    stepping = threading.Thread(target=step)
    stepping.start()
    stepping.join(0.2)
    assert stepping.is_alive()
    paused.go.set()
    stepping.join(5)
    prefetch.join(5)
    assert errors == [] and len(slots) == 2
    assert policy.admitted == [False]  # the guess came while the step was loading it: refused
    for e, slot in zip([1, 2], slots):
        assert holds_only(cache.backend.view(slot), (0, e))
    cache.release(0, [1, 2])


def test_in_place_a_failed_prefetch_read_gives_its_slot_back(constant_experts):
    cache, store = make_cache(constant_experts, ram_experts=0, slots=2, in_place=True)
    read = store.read_into

    def failing(key, buffer):
        if key == (1, 4):
            raise OSError("disk gone")
        read(key, buffer)

    store.read_into = failing
    with pytest.raises(OSError):
        cache.prefetch((1, 4))
    assert not cache.is_resident((1, 4))
    slots = cache.acquire(0, [1, 2])  # both slots usable again
    assert sorted(slots) == [0, 1]
    cache.release(0, [1, 2])


@pytest.mark.parametrize("in_place", [False, True], ids=["slot-backend", "in-place"])
def test_no_slot_ever_holds_another_experts_weights_under_injected_delays(constant_experts, in_place):
    cache, store = make_cache(constant_experts, ram_experts=1, in_place=in_place)
    backend, rng = cache.backend, random.Random(0)
    read = store.read_into

    def jitter() -> None:
        time.sleep(rng.random() * 0.001)

    @contextmanager
    def delayed_staged(key):
        jitter()  # between the admission check and the host read
        with staged(key) as src:
            jitter()  # between the host read and taking the cache lock
            yield src

    def delayed_fill(slot, src, prefetch=False):
        jitter()  # between the host read and the copy
        fill(slot, src, prefetch)

    def delayed_read(key, buffer):
        jitter()
        read(key, buffer)

    store.read_into = delayed_read
    if not in_place:  # in place, a prefetch reads straight into the slot it reserved: no staging, no fill
        staged, fill = backend.staged, backend.fill
        backend.staged, backend.fill = delayed_staged, delayed_fill
    start = time.monotonic()
    wrong: list[tuple] = []
    done = threading.Event()

    def running() -> bool:
        """At least 2 s and enough of both sides' work (a loaded machine needs longer), at most 30 s."""
        elapsed, totals = time.monotonic() - start, cache.stats.totals()
        enough = steps > 50 and totals["prefetches"] > 10 and totals["misses"] > 10
        return not done.is_set() and elapsed < 30 and (elapsed < 2 or not enough)

    def prefetch_loop() -> None:
        prng = random.Random(1)
        while not done.is_set():
            cache.prefetch((prng.randrange(L), prng.randrange(E)))

    thread = threading.Thread(target=prefetch_loop)
    thread.start()
    steps = 0
    while running():
        layer = rng.randrange(L)
        experts = sorted(rng.sample(range(E), 2))
        views = [cache.backend.view(slot) for slot in cache.acquire(layer, experts)]
        for e, view in zip(experts, views):
            cache.wait(layer, e)
            if not holds_only(view, (layer, e)):
                wrong.append((steps, (layer, e), torch.unique(view)[:4].tolist()))
        cache.release(layer, experts)
        steps += 1
    done.set()
    thread.join(5)
    totals = cache.stats.totals()
    assert steps > 50 and totals["prefetches"] > 10 and totals["misses"] > 10
    assert wrong == []
    assert len(store._in_flight) == 0  # CPU copies are synchronous: nothing is in flight


def test_the_engine_runtime_with_its_prefetch_thread_serves_every_step_with_the_right_weights(constant_experts):
    """The engine's own path on CPU (runtime, sparsity-aware policy, background prefetcher, a 3-slot RAM
    tier read from disk) through prefills larger than the cache (streamed in turns) and top-2 decode
    steps, with delays injected into the reads. Every step finds its slots, and each holds its expert."""
    store = HostStore(constant_experts, ExpertLayout.gated(H, INTER), torch.float32, capacity=0)
    delays = random.Random(0)  # of the reads, on both threads
    read = store.read_into

    def delayed_read(key, buffer) -> None:
        time.sleep(delays.random() * 0.0005)
        read(key, buffer)

    store.read_into = delayed_read
    wrong: list[tuple] = []
    failures = 0
    for trial in range(30):
        rng = random.Random(trial)  # the routing
        cache = ExpertCache(3, SparsityAwarePolicy(L, E), CacheStats(L), InPlaceBackend(store, 3))
        runtime = ExpertRuntime(cache, L, E, top_k=2)
        runtime.prefetcher = Prefetcher(cache, [None] * L, background=True, limit=4)
        try:
            for request in range(4):
                runtime.begin_request(f"{trial}-{request}")
                for step in range(rng.randint(2, 8)):
                    runtime.phase = "prefill" if step == 0 else "decode"
                    for layer in range(L):
                        size = rng.randint(2, E) if step == 0 else 2
                        needed = sorted(rng.sample(range(E), size))
                        runtime.note_routing(layer, needed, tokens=size, counts=None)

                        def check(turn, slots, layer=layer, view=cache.backend.view) -> None:
                            wrong.extend((layer, e) for e, s in zip(turn, slots) if not holds_only(view(s), (layer, e)))

                        runtime.run_step(layer, needed, None, check)
                runtime.end_request(f"{trial}-{request}")
        finally:
            runtime.prefetcher.close()
        failures += runtime.prefetcher.failures
    assert wrong == [] and failures == 0


class DoneEvent:
    def synchronize(self) -> None:
        pass


def test_a_buffer_read_while_every_other_is_held_is_kept_and_leaves_no_in_flight_entry(constant_experts):
    store = HostStore(constant_experts, ExpertLayout.gated(H, INTER), torch.float32, capacity=1)
    with store.hold((0, 1)):
        with store.hold((0, 2)) as second:  # over the budget of one: the held one cannot go
            assert holds_only(second, (0, 2))
            assert (0, 2) in store._resident  # kept: not dropped right after being read
            store.record_copy(second, DoneEvent())
    for e in (3, 4, 5):
        with store.hold((0, e)) as buffer:
            store.record_copy(buffer, DoneEvent())
    assert len(store._resident) == 1
    live = {id(buffer) for buffer in store._resident.values()}
    assert set(store._in_flight) <= live  # no entry outlives its buffer


def test_a_copy_out_of_a_buffer_that_is_not_held_is_refused(constant_experts):
    store = HostStore(constant_experts, ExpertLayout.gated(H, INTER), torch.float32, capacity=2)
    with pytest.raises(RuntimeError, match="not held"):
        store.record_copy(store.get((0, 1)), DoneEvent())
