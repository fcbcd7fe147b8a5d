"""Replacement policies driven through ExpertCache: hand-worked eviction orders and regimes."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import cache.sparsity_aware  # noqa: F401  (registers the policy)
from cache.eamc import EAMC
from cache.eamc_file import ModelFingerprint, load_eamc, save_eamc
from cache.expert_cache import DryRunBackend, ExpertCache
from cache.policy import POLICIES, make_policy
from cache.replay import replay
from cache.sparsity_aware import ReuseModel, SparsityAwarePolicy, buckets_of, proximity_weights
from cache.stats import CacheStats
from cache.trace import TraceHeader, TraceRequest, load_trace
from cache.tracegen import SHAPES, generate

DEMO_TRACE = Path(__file__).parents[1] / "bench" / "traces" / "demo-smollm2-moe.trace.jsonl"  # recorded


def make_cache(policy, capacity: int) -> ExpertCache:
    return ExpertCache(capacity, policy, CacheStats(policy.num_layers), DryRunBackend())


def use(cache: ExpertCache, layer: int, experts: list[int], phase: str = "decode") -> None:
    cache.policy.on_routing(layer, experts, 1, phase)
    cache.acquire(layer, experts)
    cache.release(layer, experts)


def test_lru_evicts_the_least_recently_used():
    cache = make_cache(make_policy("lru", 1, 8), 3)
    for e in (0, 1, 2, 0):
        use(cache, 0, [e])
    use(cache, 0, [3])
    assert cache.resident() == [(0, 0), (0, 2), (0, 3)]


def test_lfu_evicts_the_least_used_then_the_oldest():
    cache = make_cache(make_policy("lfu", 1, 8), 3)
    for e in (0, 0, 0, 1, 2, 2):
        use(cache, 0, [e])
    use(cache, 0, [3])  # 1 was used once
    assert cache.resident() == [(0, 0), (0, 2), (0, 3)]
    use(cache, 0, [4])  # 3 and... 3 has one use, 2 has two: 3 goes
    assert cache.resident() == [(0, 0), (0, 2), (0, 4)]


def test_sparsity_aware_is_registered():
    assert "sparsity-aware" in POLICIES
    policy = make_policy("sparsity-aware", 4, 8)
    assert isinstance(policy, SparsityAwarePolicy) and policy.name == "sparsity-aware"
    assert len(policy.eamc) == 0


def test_eamc_can_be_swapped_for_persistence():
    policy = SparsityAwarePolicy(2, 4)
    loaded = EAMC(2, 4, capacity=10)
    policy.eamc = loaded
    assert policy.eamc is loaded
    with pytest.raises(ValueError):
        policy.eamc = EAMC(3, 4)


def test_proximity_weights_by_hand():
    assert proximity_weights(2, 8, 3) == [(3, 1.0), (4, 0.875), (5, 0.75)]
    assert proximity_weights(7, 8, 2) == [(0, 1.0), (1, 0.875)]  # wraps into the next pass


def test_buckets_are_log_spaced_shares():
    # two buckets per octave, bucket = floor(2 × -log2 share): 0.8 → 0 (0.64), 0.6 → 1 (1.47),
    # 0.3 → 3 (3.47), 1/128 → 14, and tiny shares land in the last bucket
    assert buckets_of(np.array([0.8, 0.6, 0.3, 1 / 128, 1e-12])).tolist() == [0, 1, 3, 14, 23]


def test_reuse_model_by_hand():
    model = ReuseModel(prior_weight=0.0)
    # bucket 0: 4 passes spent at age 1 with 2 reuses, 2 passes at age 2 with 1 reuse
    model.expose(np.array([0, 0, 0, 0, 0, 0]), np.array([1, 1, 1, 1, 2, 2]))
    for gap in (1, 1, 2):
        model.record(0, gap)
    model.refresh(horizon=2)
    assert model.hazard[0, 0] == pytest.approx(0.5) and model.hazard[0, 1] == pytest.approx(0.5)
    # unused at ages 1 and 2: P(unused after 1 chance) + P(unused after 2) = 0.5 + 0.25
    assert model.table[0, 0] == pytest.approx(0.75)
    model.refresh(horizon=1)
    assert model.table[0, 0] == pytest.approx(0.5) and model.table[0, 1] == pytest.approx(0.5)


def test_sparsity_aware_evicts_the_layer_that_just_ran():
    # 4 layers, one pass using expert 0 everywhere fills the 4 slots. In the next pass,
    # layer 0 needs expert 1: (0,0) cannot be needed for a whole pass, (1..3, 0) within it.
    policy = SparsityAwarePolicy(4, 2)
    cache = make_cache(policy, 4)
    policy.on_request_start("r")
    for layer in range(4):
        use(cache, layer, [0])
    use(cache, 0, [1])
    assert (0, 0) not in cache.resident()
    # then layer 1 needs expert 1: the experts of layers 2 and 3 come back within this pass
    use(cache, 1, [1])
    assert (2, 0) in cache.resident() and (3, 0) in cache.resident()


def cyclic_trace(num_layers: int, tokens: int) -> tuple[TraceHeader, list]:
    """Every token uses expert 0 at every layer: a cycle longer than the cache."""
    decode = np.zeros((tokens, num_layers, 1), dtype=np.int32)
    return TraceHeader("cycle", num_layers, 2, 1), [TraceRequest("r", np.zeros((0, num_layers, 1), np.int32), decode)]


def test_belady_on_a_cycle_by_hand():
    # layers 0,1,2 × 4 tokens, 2 slots: MIN misses at accesses 1 2 3 5 7 9 11 (each miss evicts
    # the expert whose next use is farther), hits at 4 6 8 10 12; LRU misses all 12
    header, requests = cyclic_trace(3, 4)
    assert replay(header, requests, "belady", 2)["decode_misses"] == 7
    assert replay(header, requests, "lru", 2)["decode_misses"] == 12


def test_no_thrashing_when_a_token_does_not_fit():
    # 8 layers, 6 slots: LRU misses every access; keeping most layers resident avoids it
    header, requests = cyclic_trace(8, 60)
    lru = replay(header, requests, "lru", 6)
    belady = replay(header, requests, "belady", 6)
    ours = replay(header, requests, "sparsity-aware", 6)
    assert lru["decode_miss_rate"] == 1.0
    assert belady["decode_misses"] <= ours["decode_misses"]
    assert ours["decode_miss_rate"] < 0.4


def test_first_layer_bonus_keeps_the_first_layers():
    header, requests = cyclic_trace(8, 40)
    policy = SparsityAwarePolicy(8, 2, first_layer_bonus=0.5)
    replay(header, requests, policy, 6)
    assert policy._resident[:2, 0].all()  # layers 0 and 1 stay


def test_prefetch_candidates_name_the_next_layers_likely_experts():
    policy = SparsityAwarePolicy(2, 4)
    cache = make_cache(policy, 3)
    policy.on_request_start("r")
    for _ in range(80):  # layer 1 always uses expert 3; the learned chance of reuse is high
        use(cache, 0, [0])
        use(cache, 1, [3])
    policy.reuse.refresh()
    cache._slot_of.pop((1, 3))  # as if evicted
    policy.on_evict((1, 3))
    policy.on_routing(0, [0], 1, "decode")
    assert policy.prefetch_candidates(0) == [(1, 3)]
    assert policy.prefetch_priority((1, 3)) > policy.prefetch_priority((0, 1))
    policy.on_lookahead(1, [2])  # the engine's guess of layer 1 comes first
    assert policy.prefetch_candidates(0)[0] == (1, 2)


def test_prefetch_through_the_cache_displaces_only_later_needs():
    policy = SparsityAwarePolicy(2, 4)
    cache = make_cache(policy, 2)
    policy.on_request_start("r")
    for _ in range(80):
        use(cache, 0, [0])
        use(cache, 1, [3])
    policy.on_routing(0, [0], 1, "decode")
    cache.acquire(0, [0])
    cache.release(0, [0])
    assert not cache.prefetch((1, 1))  # never used: not worth displacing anything
    assert cache.stats.totals()["prefetches"] == 0


@pytest.mark.parametrize(
    "shape, fracs",
    [("many-small", (0.05, 0.25)), ("many-small-64", (0.1,)), ("few-large", (0.1, 0.22, 0.5)),
     ("llama4-like", (0.1,)), ("deepseek-v2-lite-like", (0.1,)), ("mixtral-like", (0.5,))],
)
def test_sparsity_aware_never_worse_than_lru_on_synthetic_traces(shape, fracs):
    header, requests = generate(SHAPES[shape], 40, seed=7)
    total = header.num_layers * header.num_experts
    for frac in fracs:
        capacity = round(frac * total)
        lru = replay(header, requests, "lru", capacity)
        ours = replay(header, requests, "sparsity-aware", capacity)
        assert ours["decode_misses"] <= lru["decode_misses"], (shape, frac)


def test_sparsity_aware_never_worse_than_lru_on_the_recorded_demo_trace():
    header, requests = load_trace(DEMO_TRACE)
    requests = list(requests)[:60]
    total = header.num_layers * header.num_experts
    for frac in (0.05, 0.25, 0.5):
        capacity = round(frac * total)
        lru = replay(header, requests, "lru", capacity)
        ours = replay(header, requests, "sparsity-aware", capacity)
        assert ours["decode_misses"] <= lru["decode_misses"], frac


def test_restart_with_a_saved_eamc_starts_warm(tmp_path):
    # learn on 60 requests, save; then replay the next 16 with the loaded EAMC vs an empty one
    header, requests = generate(SHAPES["many-small"], 76, seed=3)
    fp = ModelFingerprint("synthetic", header.num_layers, header.num_experts, "seed3")
    capacity = round(0.1 * header.num_layers * header.num_experts)
    trained = SparsityAwarePolicy(header.num_layers, header.num_experts)
    replay(header, requests[:60], trained, capacity)
    save_eamc(tmp_path / "m.eamc", trained.eamc, fp)
    warm = SparsityAwarePolicy(header.num_layers, header.num_experts)
    warm.eamc = load_eamc(tmp_path / "m.eamc", fp)
    cold = SparsityAwarePolicy(header.num_layers, header.num_experts)
    later = requests[60:]
    assert replay(header, later, warm, capacity)["decode_misses"] < replay(header, later, cold, capacity)["decode_misses"]
