"""The timed replay: the link model's arithmetic and ordering rules, and `--timed` on a short trace."""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from cache.prefetcher import PrefetchCost
from cache.replay import replay
from cache.timed import Link, LinkSpec
from cache.trace import TraceHeader, TraceRequest, write_trace

ROOT = Path(__file__).resolve().parents[1]
MB = 10**6


def ten_ms_copies(chunk_bytes: int = 0) -> LinkSpec:
    return LinkSpec(expert_bytes=100 * MB, link_gbps=10.0, compute_ms=1.0, chunk_bytes=chunk_bytes)  # 10 ms a copy


def test_a_demand_copy_waits_for_the_copy_on_the_link_then_goes_before_queued_prefetches():
    link = Link(ten_ms_copies())
    link.copy(0, prefetch=True)  # starts at once
    link.copy(1, prefetch=True)  # queued
    link.compute(1.0)
    link.copy(2, prefetch=False)  # a demand, at 1 ms
    link.wait(2)
    assert link.now == pytest.approx(20.0)  # after prefetch 0 (0-10), before prefetch 1
    link.wait(1)
    assert link.now == pytest.approx(30.0)


def test_chunked_copies_let_a_demand_overtake_a_prefetch_in_flight():
    link = Link(ten_ms_copies(chunk_bytes=10 * MB))  # 1 ms chunks
    link.copy(0, prefetch=True)
    link.compute(1.0)
    link.copy(2, prefetch=False)
    link.wait(2)
    assert link.now == pytest.approx(11.0)  # one chunk of the prefetch, then the whole demand copy
    link.wait(0)
    assert link.now == pytest.approx(20.0)


def test_a_refill_of_a_slot_waits_for_its_earlier_copy_even_a_queued_prefetch():
    link = Link(ten_ms_copies())
    link.copy(0, prefetch=True)
    link.copy(1, prefetch=True)  # queued behind slot 0's copy
    link.copy(1, prefetch=False)  # slot 1 refilled on demand: its prefetch copy must land first
    link.wait(1)
    assert link.now == pytest.approx(30.0)
    assert link.bytes_moved == 300 * MB


def one_request(decode: list[list[list[int]]], num_experts: int, top_k: int) -> tuple[TraceHeader, list]:
    steps = np.array(decode, dtype=np.int32)  # [T, L, K]
    header = TraceHeader("toy", steps.shape[1], num_experts, top_k)
    return header, [TraceRequest("r", steps[:1], steps)]


def test_every_decode_miss_costs_one_copy_and_compute_follows_it():
    rng = np.random.default_rng(0)
    # two layers, one expert each, never the same twice in a row at a layer: a one-slot cache misses every time
    decode = [[[int(rng.integers(0, 4)) + 4 * (t % 2)] for _ in range(2)] for t in range(20)]
    header, requests = one_request(decode, num_experts=8, top_k=1)
    spec = LinkSpec(expert_bytes=100 * MB, link_gbps=10.0, compute_ms=1.0, token_ms=0.5)
    result = replay(header, requests, "lru", capacity=1, link=spec)
    assert result["decode_miss_rate"] == 1.0
    assert result["tpot_ms"] == pytest.approx(2 * (10.0 + 1.0) + 0.5)


def random_routing(tokens: int, layers: int = 4, experts: int = 8, top_k: int = 2) -> tuple[TraceHeader, list]:
    rng = np.random.default_rng(1)
    decode = [[sorted(rng.choice(experts, top_k, replace=False).tolist()) for _ in range(layers)] for _ in range(tokens)]
    return one_request(decode, experts, top_k)


def test_right_guesses_hide_copies_behind_compute_and_wrong_ones_cost_link_time():
    header, requests = random_routing(200)
    slow_compute = LinkSpec(expert_bytes=10 * MB, link_gbps=10.0, compute_ms=3.0)  # 1 ms copies, 3 ms layers
    off = replay(header, requests, "lru", 8, link=slow_compute)
    right = replay(header, requests, "lru", 8, prefetch=True, link=slow_compute, lookahead_accuracy=1.0)
    assert right["tpot_ms"] < 0.8 * off["tpot_ms"]
    slow_link = LinkSpec(expert_bytes=100 * MB, link_gbps=10.0, compute_ms=1.0)  # 10 ms copies, 1 ms layers
    off = replay(header, requests, "lru", 8, link=slow_link)
    wrong = replay(header, requests, "lru", 8, prefetch=True, link=slow_link, lookahead_accuracy=0.0, gate=False)
    assert wrong["link_gb_per_decode_token"] > off["link_gb_per_decode_token"]
    assert wrong["tpot_ms"] > off["tpot_ms"]


def test_the_timed_replay_cli_on_a_short_trace(tmp_path):
    header, requests = random_routing(40)
    write_trace(tmp_path / "t.jsonl", header, requests)
    out = subprocess.run(
        [sys.executable, "-m", "cache.replay", str(tmp_path / "t.jsonl"), "--policy", "sparsity-aware",
         "--capacity-frac", "0.25", "--timed", "--prefetch", "--lookahead-accuracy", "0.7", "--expert-mb", "17.3",
         "--json"],
        cwd=ROOT, capture_output=True, text=True, check=True,
    ).stdout
    result = json.loads(out)
    assert result["tpot_ms"] > 4 * LinkSpec().compute_ms  # at least the compute of 4 layers
    assert result["link"]["expert_bytes"] == 17_300_000 and result["prefetches"] > 0


def test_a_prefetch_inside_the_compute_window_is_free_and_one_reaching_past_it_must_be_likely():
    cost = PrefetchCost(copy_ms=6.4, overlap_ms=1.6)  # Mixtral-size experts on PCIe 5
    assert not cost.worth(0.7, spent_ms=0.0)  # 0.7 × 1.6 < 0.3 × 4.8
    assert cost.worth(0.8, spent_ms=0.0)
    assert not cost.worth(0.99, spent_ms=6.4)  # past the window a right guess saves nothing
    small = PrefetchCost(copy_ms=0.5, overlap_ms=1.6)  # DeepSeek-V2-Lite-size experts
    assert small.worth(0.1, spent_ms=1.0)  # still inside the window: costs no link time even if wrong
    assert not small.worth(0.3, spent_ms=1.4)
    assert not small.worth(0.5, spent_ms=0.0, regret=0.6)  # but what it evicts may cost a copy later


def test_the_gate_holds_back_poor_guesses_and_lets_good_ones_through():
    header, requests = random_routing(200)
    slow_link = LinkSpec(expert_bytes=100 * MB, link_gbps=10.0, compute_ms=1.0)  # 10 ms copies, 1 ms layers
    off = replay(header, requests, "lru", 8, link=slow_link)
    wrong = replay(header, requests, "lru", 8, prefetch=True, link=slow_link, lookahead_accuracy=0.3)
    assert wrong["prefetches"] == 0 and wrong["tpot_ms"] == off["tpot_ms"]
    fast_link = LinkSpec(expert_bytes=10 * MB, link_gbps=10.0, compute_ms=3.0)  # 1 ms copies, 3 ms layers
    off = replay(header, requests, "lru", 8, link=fast_link)
    right = replay(header, requests, "lru", 8, prefetch=True, link=fast_link, lookahead_accuracy=0.9)
    assert right["prefetches"] > 0 and right["tpot_ms"] < off["tpot_ms"]


def test_the_engine_learns_the_compute_window_from_decode_layers_net_of_demand_copies():
    cost = PrefetchCost(copy_ms=2.0, overlap_ms=0.0, measure_overlap=True)
    assert not cost.worth(0.99, spent_ms=0.0)  # nothing measured yet: no prefetch
    for ms in (5.0, 5.0, 5.0):
        cost.observe_layer(ms)
    assert cost.overlap_ms == pytest.approx(5.0)
    assert cost.worth(0.1, spent_ms=0.0)


def test_the_replay_gate_can_learn_the_compute_window_from_its_clock_as_the_engine_does():
    header, requests = random_routing(200)
    fast_link = LinkSpec(expert_bytes=10 * MB, link_gbps=10.0, compute_ms=3.0)  # 1 ms copies, 3 ms layers
    off = replay(header, requests, "lru", 8, link=fast_link)
    learned = replay(header, requests, "lru", 8, prefetch=True, link=fast_link, lookahead_accuracy=0.9, learn_overlap=True)
    assert learned["prefetches"] > 0 and learned["tpot_ms"] < off["tpot_ms"]
    slow_link = LinkSpec(expert_bytes=100 * MB, link_gbps=10.0, compute_ms=1.0)  # 10 ms copies, 1 ms layers
    off = replay(header, requests, "lru", 8, link=slow_link)
    wrong = replay(header, requests, "lru", 8, prefetch=True, link=slow_link, lookahead_accuracy=0.3, learn_overlap=True)
    assert wrong["prefetches"] == 0 and wrong["tpot_ms"] == off["tpot_ms"]


def test_the_learned_compute_window_is_the_layers_compute_even_when_prefetches_stall_it():
    """A step that waits for a prefetch still in flight is not compute: before the gate timed only
    prefetch-free layers, such waits grew the window it learned (6.4 ms for 2.5 ms of compute on
    Mixtral-size experts at 8 of 32), and a larger window made it issue more."""
    header, requests = random_routing(200)
    fast_link = LinkSpec(expert_bytes=10 * MB, link_gbps=10.0, compute_ms=3.0)  # 1 ms copies, 3 ms layers
    learned = replay(header, requests, "lru", 8, prefetch=True, link=fast_link, lookahead_accuracy=0.9, learn_overlap=True)
    assert learned["prefetches"] > 0
    assert learned["prefetch_window_ms"] == pytest.approx(3.0, rel=1e-3)
    h200 = LinkSpec(expert_bytes=352_321_536, link_gbps=54.65, compute_ms=2.466)  # a Mixtral expert: 6.4 ms
    for policy in ("lru", "sparsity-aware"):
        given = replay(header, requests, policy, 8, prefetch=True, link=h200, lookahead_accuracy=0.79)
        learned = replay(header, requests, policy, 8, prefetch=True, link=h200, lookahead_accuracy=0.79,
                         learn_overlap=True)
        assert learned["prefetch_window_ms"] == pytest.approx(2.466, rel=1e-3)
        assert learned["tpot_ms"] <= 1.01 * given["tpot_ms"]
