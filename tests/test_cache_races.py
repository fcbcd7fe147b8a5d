"""The host tier under a concurrent prefetch thread: a slot always holds the weights of the
expert it is registered for, whatever the interleaving of demand loads and prefetches.

Every expert is filled with one constant, so a slot that received another expert's bytes
(or a mix of two) shows it at once.
"""

import random
import threading
import time
from contextlib import contextmanager

import pytest
import torch
from safetensors.torch import save_file

from cache.expert_cache import ExpertCache, InPlaceBackend, SlotBackend
from cache.host_store import ExpertLayout, HostStore, Segment
from cache.policy import LRUPolicy
from cache.safetensors_index import index_checkpoint
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
