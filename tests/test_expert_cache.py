"""Residency, protection, eviction order and counters of the device expert cache, and the
host store reading experts from safetensors by header offsets."""

import threading
from contextlib import contextmanager

import pytest
import torch
from safetensors.torch import save_file

from cache.expert_cache import DryRunBackend, ExpertCache, SlotBackend
from cache.host_store import ExpertLayout, HostStore, Segment
from cache.policy import LFUPolicy, LRUPolicy
from cache.safetensors_index import CheckpointError, index_checkpoint
from cache.stats import CacheStats


def dry_cache(capacity: int, policy_cls=LRUPolicy) -> ExpertCache:
    return ExpertCache(capacity, policy_cls(2, 8), CacheStats(2), DryRunBackend(bytes_per_expert=10))


def use(cache: ExpertCache, layer: int, experts: list[int]) -> None:
    cache.acquire(layer, experts)
    cache.release(layer, experts)


def test_lru_evicts_the_least_recently_used_expert():
    cache = dry_cache(2)
    use(cache, 0, [1])
    use(cache, 0, [2])
    use(cache, 0, [1])
    use(cache, 0, [3])  # 2 is the oldest
    assert cache.resident() == [(0, 1), (0, 3)]
    assert cache.stats.totals()["hits"] == 1
    assert cache.stats.totals()["misses"] == 3
    assert cache.stats.totals()["evictions"] == 1
    assert cache.stats.totals()["bytes_transferred"] == 30


def test_lfu_evicts_the_least_frequently_used_expert():
    cache = dry_cache(2, LFUPolicy)
    for _ in range(3):
        use(cache, 0, [1])
    use(cache, 0, [2])
    use(cache, 0, [3])  # 2 used once, 1 used three times
    assert cache.resident() == [(0, 1), (0, 3)]


def test_experts_of_the_current_step_are_never_evicted_for_each_other():
    cache = dry_cache(2)
    use(cache, 0, [5])
    cache.acquire(1, [1, 2])  # both protected until released
    assert cache.resident() == [(1, 1), (1, 2)]
    assert cache.prefetch((1, 3)) is False  # no unprotected slot to take
    with pytest.raises(ValueError):
        cache.acquire(1, [1, 2, 3])
    cache.release(1, [1, 2])
    use(cache, 1, [3])  # a demand load may evict once nothing is protected
    assert cache.resident() == [(1, 2), (1, 3)]


def test_a_prefetch_never_displaces_an_expert_the_policy_values_as_much():
    cache = dry_cache(2)
    use(cache, 0, [1])
    assert cache.prefetch((0, 2)) is True  # a free slot
    assert cache.prefetch((0, 3)) is False  # LRU gives no priorities: nothing is displaced
    assert cache.resident() == [(0, 1), (0, 2)]


def test_the_engines_lookahead_guess_displaces_the_lru_victim():
    cache = dry_cache(2)
    use(cache, 0, [1])
    use(cache, 0, [2])
    cache.policy.on_lookahead(1, [4])
    assert cache.prefetch((1, 5)) is False  # not guessed: LRU keeps what it has
    assert cache.prefetch((1, 4)) is True  # guessed: it displaces the least recently used
    assert cache.resident() == [(0, 2), (1, 4)]


def test_a_used_prefetch_counts_as_hit_and_as_prefetch_used():
    cache = dry_cache(4)
    assert cache.prefetch((0, 7)) is True
    assert cache.prefetch((0, 7)) is False  # already resident
    use(cache, 0, [7])
    totals = cache.stats.totals()
    assert (totals["prefetches"], totals["prefetch_used"], totals["hits"], totals["misses"]) == (1, 1, 1, 0)


def write_experts(path, num_experts=4, hidden=6, inter=5, fused=False, dtype=torch.float32):
    torch.manual_seed(0)
    gate_up = torch.randn(num_experts, 2 * inter, hidden).to(dtype)  # [E, 2I, H]
    down = torch.randn(num_experts, hidden, inter).to(dtype)  # [E, H, I]
    if fused:
        save_file({"gate_up_proj": gate_up, "down_proj": down}, str(path))
    else:
        tensors = {}
        for e in range(num_experts):
            tensors[f"{e}.gate"] = gate_up[e, :inter].contiguous()
            tensors[f"{e}.up"] = gate_up[e, inter:].contiguous()
            tensors[f"{e}.down"] = down[e].contiguous()
        save_file(tensors, str(path))
    return gate_up, down


def sources_for(folder, num_experts, fused):
    index = index_checkpoint(folder)
    if fused:
        gu, d = index["gate_up_proj"], index["down_proj"]
        return {
            (0, e): [Segment.slice_of(gu, e, 0, 2), Segment.slice_of(gu, e, 1, 2), Segment.slice_of(d, e)]
            for e in range(num_experts)
        }
    return {
        (0, e): [Segment.slice_of(index[f"{e}.{p}"]) for p in ("gate", "up", "down")]
        for e in range(num_experts)
    }


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("capacity", [1, None])
def test_host_store_returns_each_expert_as_one_contiguous_buffer(tmp_path, fused, capacity):
    gate_up, down = write_experts(tmp_path / "m.safetensors", fused=fused, dtype=torch.bfloat16)
    shape = ExpertLayout.gated(6, 5)
    store = HostStore(sources_for(tmp_path, 4, fused), shape, torch.float32, capacity=capacity)
    store.preload()
    for e in [0, 3, 1, 3]:
        flat = store.get((0, e))
        assert torch.equal(flat[: 2 * 5 * 6].view(10, 6), gate_up[e].float())
        assert torch.equal(flat[2 * 5 * 6 :].view(6, 5), down[e].float())
    # all in RAM: 4 preloaded reads; one slot: preload 0, then 0 hits, 3, 1 and 3 again are read
    assert store.disk_reads == 4
    assert len(store._resident) == (4 if capacity is None else 1)


def test_slot_backend_copies_host_buffers_into_slots(tmp_path):
    write_experts(tmp_path / "m.safetensors")
    store = HostStore(sources_for(tmp_path, 4, False), ExpertLayout.gated(6, 5), torch.float32)
    cache = ExpertCache(2, LRUPolicy(1, 4), CacheStats(1), SlotBackend(store, 2, torch.device("cpu")))
    views = [cache.backend.view(slot) for slot in cache.acquire(0, [2, 3])]
    assert torch.equal(views[0], store.get((0, 2)))
    assert torch.equal(views[1], store.get((0, 3)))


def test_a_held_host_buffer_is_not_recycled_until_released(tmp_path):
    write_experts(tmp_path / "m.safetensors")
    store = HostStore(sources_for(tmp_path, 4, False), ExpertLayout.gated(6, 5), torch.float32, capacity=1)
    with store.hold((0, 1)) as held:
        expected = held.clone()
        other = store.get((0, 2))  # the budget of one is taken by the held buffer: a second one
        assert other.data_ptr() != held.data_ptr()
        assert torch.equal(held, expected)
    store.get((0, 3))  # back within the budget once nothing is held
    assert len(store._resident) == 1


class BlockingStage(DryRunBackend):
    """A host read that takes until the test says so."""

    def __init__(self) -> None:
        super().__init__(bytes_per_expert=10)
        self.reading, self.finish = threading.Event(), threading.Event()

    @contextmanager
    def staged(self, key):
        self.reading.set()
        assert self.finish.wait(timeout=10)
        yield None


def test_a_prefetch_reads_from_the_host_without_holding_up_the_engine():
    backend = BlockingStage()
    cache = ExpertCache(3, LRUPolicy(2, 8), CacheStats(2), backend)
    use(cache, 0, [1])
    prefetch = threading.Thread(target=cache.prefetch, args=((1, 5),))
    prefetch.start()
    assert backend.reading.wait(timeout=10)
    use(cache, 0, [1])  # the prefetch is mid-read: a step on resident experts goes ahead
    use(cache, 1, [2])  # and so does a demand load
    backend.finish.set()
    prefetch.join(timeout=10)
    assert cache.is_resident((1, 5)) and cache.stats.totals()["prefetches"] == 1


def test_truncated_and_garbage_safetensors_are_refused(tmp_path):
    write_experts(tmp_path / "m.safetensors")
    data = (tmp_path / "m.safetensors").read_bytes()
    (tmp_path / "m.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="truncated"):
        index_checkpoint(tmp_path)
    (tmp_path / "m.safetensors").write_bytes(b"\xff" * 64)
    with pytest.raises(CheckpointError, match="not a valid safetensors"):
        index_checkpoint(tmp_path)


def test_an_expert_a_prefetch_evicted_and_then_missed_counts_as_a_regret():
    cache = dry_cache(2)
    use(cache, 0, [1])
    use(cache, 0, [2])
    cache.policy.on_lookahead(1, [4])
    assert cache.prefetch((1, 4))  # evicts (0, 1), the least recently used
    use(cache, 0, [2])
    use(cache, 0, [1])  # missed: the prefetch's victim
    use(cache, 0, [3])
    totals = cache.stats.totals()
    assert (totals["prefetch_evictions"], totals["prefetch_regrets"]) == (1, 1)


def test_a_prefetch_victim_missed_long_after_is_no_regret():
    """Missed after `capacity` evictions more, the victim would have been evicted by then anyway. Counted
    so, the regret of a gate that stopped prefetching climbed to 0.94 and shut it for good (LRU, CPU)."""
    cache = dry_cache(2)
    use(cache, 0, [1])
    use(cache, 0, [2])
    cache.policy.on_lookahead(1, [4])
    assert cache.prefetch((1, 4))  # evicts (0, 1)
    for expert in (5, 6):
        use(cache, 0, [expert])  # two demand evictions: (0, 1) is no longer recent
    use(cache, 0, [1])
    totals = cache.stats.totals()
    assert (totals["prefetch_evictions"], totals["prefetch_regrets"]) == (1, 0)
