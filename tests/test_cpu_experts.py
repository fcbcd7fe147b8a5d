"""The host executor (`--cpu-experts`, issue 13): on a GPU machine some missed experts are
computed on the host cores from their host buffers while the link copies others.

No GPU here: the engine runs with device slots that are plain host tensors (`SlotBackend` on
the CPU), which is the CUDA code path but for the device, and the planner is given costs."""

import pytest
import torch

import engine.model_loader as model_loader
from cache.expert_cache import ExpertCache, SlotBackend
from cache.miss_planner import MissCosts, MissPlan, MissPlanner
from cache.replay import replay
from cache.stats import CacheStats
from cache.timed import LinkSpec
from cache.trace import load_trace
from engine.config import EngineConfig
from engine.engine import Engine
from tests.fixtures.models import build_checkpoint, reference_greedy
from tests.test_engine_equivalence import NEW_TOKENS, PROMPT, greedy

DEMO_TRACE = "bench/traces/demo-smollm2-moe.trace.jsonl"


@pytest.mark.parametrize(
    ("costs", "misses", "on_host"),
    [
        (MissCosts(copy_ms=6.4, host_ms=7.0), [3, 5], [5]),  # H200 host: one each
        (MissCosts(copy_ms=6.4, host_ms=7.0), [3], []),  # a lone miss goes to the faster lane
        (MissCosts(copy_ms=14.1, host_ms=5.9), [1, 2, 3, 4], [1, 2, 4]),  # desktop PCIe 4: the host takes most
        (MissCosts(copy_ms=1.0, host_ms=10.0), [1, 2, 3, 4], []),  # a slow host is never used
    ],
)
def test_planner_sends_each_miss_to_the_lane_that_finishes_it_sooner(costs, misses, on_host):
    assert MissPlanner(costs).split(misses) == on_host


@pytest.mark.parametrize(
    ("costs", "misses", "plan"),
    [
        (MissCosts(copy_ms=6.4, host_ms=6.6), [3], MissPlan([], 3, 6.4 / 13.0)),  # H200 host: 6.4 → 3.25 ms
        (MissCosts(copy_ms=6.4, host_ms=6.6), [3, 5], MissPlan([5])),  # one each: balanced already
        (MissCosts(copy_ms=14.1, host_ms=5.9), [3, 5], MissPlan([3], 5, 8.2 / 20.0)),  # desktop: 11.8 → 8.3 ms
        (MissCosts(copy_ms=1.0, host_ms=10.0), [3], MissPlan([])),  # a host part under 10%: not worth it
    ],
)
def test_a_shared_miss_ends_both_lanes_together(costs, misses, plan):
    got = MissPlanner(costs, share=True).plan(misses)
    assert (got.on_host, got.shared) == (plan.on_host, plan.shared)
    assert sorted([*got.on_host, *got.copied, *([got.shared] if got.shared is not None else [])]) == sorted(misses)
    assert got.host_fraction == pytest.approx(plan.host_fraction)
    if got.shared is not None:  # both lanes end at the same time
        host_end = (len(got.on_host) + got.host_fraction) * costs.host_ms
        link_end = (len(misses) - len(got.on_host) - got.host_fraction) * costs.copy_ms
        assert host_end == pytest.approx(link_end)


def test_nothing_is_shared_while_the_link_is_busy_or_sharing_is_off():
    costs = MissCosts(copy_ms=6.4, host_ms=6.6)
    assert MissPlanner(costs, share=True).plan([3], link_busy=True) == MissPlan([], copied=[3])
    assert MissPlanner(costs).plan([3]) == MissPlan([], copied=[3])
    assert not MissPlanner(costs).plan([3]).link_idle  # a copy: host-computed experts are not cached then
    assert MissPlanner(MissCosts(copy_ms=14.1, host_ms=5.9)).plan([3, 5]).link_idle  # desktop: both on the host
    assert not MissPlanner(costs, share=True).plan([3]).link_idle  # the shared part crosses the link


def test_gain_needs_a_host_faster_than_two_copies():
    assert MissCosts(copy_ms=6.4, host_ms=7.0).gains()
    assert not MissCosts(copy_ms=1.0, host_ms=2.5).gains()
    # sharing a lone miss still pays with a host 2.5× slower than the link (0.71 of a copy), not 10×
    assert MissCosts(copy_ms=1.0, host_ms=2.5).gains(share=True)
    assert not MissCosts(copy_ms=1.0, host_ms=10.0).gains(share=True)


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_host_computed_experts_give_transformers_tokens(family, tmp_path, monkeypatch):
    folder = build_checkpoint(family, tmp_path / family, num_layers=3)

    def slots_as_if_on_a_device(host, sizing, device, policy, num_layers, dense_bytes=0, context=None):
        return ExpertCache(4, policy, CacheStats(num_layers), SlotBackend(host, 4, device)), None

    monkeypatch.setattr(model_loader, "_expert_cache", slots_as_if_on_a_device)
    engine = Engine.load(EngineConfig(model=str(folder), device="cpu", policy="lru", prefetch=False))
    for experts in engine.loaded.offloaded:
        experts.host_capable = True  # what a CUDA pool gets
    engine.runtime.planner = MissPlanner(MissCosts(copy_ms=1.0, host_ms=1.0))  # two misses: one each
    prompt_ids = engine.encode(PROMPT)
    before = engine.cache_counters()
    assert greedy(engine, prompt_ids) == reference_greedy(folder, prompt_ids, NEW_TOKENS)
    after = engine.cache_counters()
    computed = after["cpu_computed"] - before["cpu_computed"]
    assert computed > 0 and computed <= after["misses"] - before["misses"]
    info = engine.cache_info()["cpu_experts"]
    assert info["computed"] == after["cpu_computed"] and 0 < info["share_of_expert_uses"] < 1


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_a_miss_shared_by_host_and_device_gives_transformers_tokens(family, tmp_path, monkeypatch):
    """One lone miss per step, shared: the host computes part of its neurons and output rows, the
    "device" (host tensors here, the CUDA code path but for the streams) the rest."""
    folder = build_checkpoint(family, tmp_path / family, num_layers=3)

    def slots_as_if_on_a_device(host, sizing, device, policy, num_layers, dense_bytes=0, context=None):
        return ExpertCache(4, policy, CacheStats(num_layers), SlotBackend(host, 4, device)), None

    monkeypatch.setattr(model_loader, "_expert_cache", slots_as_if_on_a_device)
    engine = Engine.load(EngineConfig(model=str(folder), device="cpu", policy="lru", prefetch=False))
    shared = []
    for experts in engine.loaded.offloaded:
        experts.host_capable = True  # what a CUDA pool gets
        assert experts.can_share  # float, gate_up [2I, H] and down [H, I], no biases
        share = experts._shared
        monkeypatch.setattr(experts, "_shared", lambda *a, share=share: shared.append(a[-1]) or share(*a))
    engine.runtime.planner = MissPlanner(MissCosts(copy_ms=6.4, host_ms=6.6), share=True)  # the H200 host
    prompt_ids = engine.encode(PROMPT)
    assert greedy(engine, prompt_ids) == reference_greedy(folder, prompt_ids, NEW_TOKENS)
    assert shared and all(0.4 < f < 0.6 for f in shared)  # lone misses, about half on each side


@pytest.mark.parametrize("fraction", [0.1, 0.5, 0.9])
def test_a_shared_expert_computes_what_the_whole_expert_computes(tmp_path, fraction):
    folder = build_checkpoint("mixtral", tmp_path / "m", num_layers=2)
    engine = Engine.load(EngineConfig(model=str(folder), device="cpu", policy="lru", prefetch=False))
    experts = engine.loaded.offloaded[0]
    torch.manual_seed(0)
    with engine.loaded.host.hold((0, 1)) as buffer:
        x = torch.randn(1, engine.loaded.config.hidden_size)  # [1, H]
        whole = experts._experts(x.unsqueeze(0), experts._expert_params(buffer))[0]  # [1, H]
        shared = experts._shared(x, x.clone(), buffer, fraction)  # [1, H]
    assert shared.shape == whole.shape
    torch.testing.assert_close(shared, whole, rtol=1e-5, atol=1e-6)  # the same sums, split by rows and neurons


def test_only_float_gated_untransposed_experts_are_shared(tmp_path):
    folder = build_checkpoint("gpt_oss", tmp_path / "gpt_oss", num_layers=2)  # [in, out] weights with biases
    engine = Engine.load(EngineConfig(model=str(folder), device="cpu", policy="lru", prefetch=False))
    for experts in engine.loaded.offloaded:
        experts.host_capable = True
        assert not experts.can_share


def test_cpu_experts_flag_is_validated():
    with pytest.raises(ValueError, match="cpu_experts"):
        EngineConfig(cpu_experts="always")
    assert EngineConfig().cpu_experts == "auto"


def test_timed_replay_with_the_host_executor_is_faster_and_moves_fewer_bytes():
    header, requests = load_trace(DEMO_TRACE)
    requests = requests[:8]
    copy_only = LinkSpec(link_gbps=25.0, compute_ms=1.6)
    with_host = LinkSpec(link_gbps=25.0, compute_ms=1.6, cpu_gbps=60.0)
    capacity = header.num_layers * header.num_experts // 4
    off = replay(header, requests, "sparsity-aware", capacity, False, copy_only)
    on = replay(header, requests, "sparsity-aware", capacity, False, with_host)
    assert off["decode_cpu_computed"] == 0 < on["decode_cpu_computed"] <= on["decode_misses"]
    assert on["tpot_ms"] < off["tpot_ms"]
    assert on["link_gb_per_decode_token"] < off["link_gb_per_decode_token"]


def test_timed_replay_sharing_a_miss_beats_whole_experts_with_lru():
    header, requests = load_trace(DEMO_TRACE)
    capacity = header.num_layers * header.num_experts // 4
    whole = LinkSpec(link_gbps=25.0, compute_ms=1.6, cpu_gbps=60.0, share_misses=False)
    shared = LinkSpec(link_gbps=25.0, compute_ms=1.6, cpu_gbps=60.0)
    results = [replay(header, requests[:8], "lru", capacity, False, spec) for spec in (whole, shared)]
    assert results[1]["tpot_ms"] < results[0]["tpot_ms"]
    assert results[1]["link_gb_per_decode_token"] > 0 == results[0]["link_gb_per_decode_token"]  # the shared parts


def test_timed_replay_keeps_copying_when_the_host_is_slow():
    header, requests = load_trace(DEMO_TRACE)
    capacity = header.num_layers * header.num_experts // 4
    # 70 ms an expert against a 14 ms copy: whole experts never gain; a shared lone miss still does (11.8 ms)
    whole_only = LinkSpec(link_gbps=25.0, compute_ms=1.6, cpu_gbps=5.0, share_misses=False)
    assert replay(header, requests[:4], "lru", capacity, False, whole_only)["decode_cpu_computed"] == 0
    very_slow = LinkSpec(link_gbps=25.0, compute_ms=1.6, cpu_gbps=2.0)  # 176 ms: 12× a copy, no gain at all
    assert replay(header, requests[:4], "lru", capacity, False, very_slow)["decode_cpu_computed"] == 0
