"""On CPU a prefetch is a read from disk into the RAM tier: it pays for the time it waits on the disk,
and without a core of its own its CPU time (copying out of the page cache) is taken from the step."""

from __future__ import annotations

import os
import time

import pytest
import torch

from cache.expert_cache import DryRunBackend, ExpertCache
from cache.host_store import ReadTimes, thread_cpu_and_queue_ns
from cache.policy import make_policy
from cache.prefetcher import HostReadCost, Prefetcher
from cache.stats import CacheStats
from engine.config import EngineConfig
from engine.engine import Engine
from tests.fixtures.models import build_checkpoint


def reads(wall_ms: float, cpu_ms: float, queued_ms: float = 0.0) -> ReadTimes:
    times = ReadTimes()
    times.observe(wall_ms, cpu_ms, queued_ms)
    return times


def test_read_times_split_a_read_into_cpu_queue_and_disk():
    times = ReadTimes()
    for wall, cpu, queued in ((10.0, 2.0, 1.0), (20.0, 4.0, 3.0)):
        times.observe(wall, cpu, queued)
    assert (times.wall_ms, times.cpu_ms, times.queued_ms, times.disk_ms) == (15.0, 3.0, 2.0, 10.0)
    for _ in range(100):
        times.observe(1.0, 1.0, 0.0)  # the page cache now: a running mean forgets the disk
    assert times.disk_ms < 0.01 and times.wall_ms == pytest.approx(1.0, abs=0.01)


def test_a_read_from_the_page_cache_with_no_core_to_spare_is_never_worth_prefetching():
    cost = HostReadCost(0.0, overlap_ms=20.0, reads=reads(3.0, 3.0), spare_core=False)
    assert not cost.worth(1.0, 0.0) and not cost.may_pay(regret=0.0)


def test_a_core_to_spare_makes_the_whole_read_free_inside_the_window():
    cost = HostReadCost(0.0, overlap_ms=20.0, reads=reads(3.0, 3.0), spare_core=True)
    assert cost.worth(0.9, 0.0, regret=0.25) and cost.may_pay(regret=0.25)
    assert not cost.worth(0.9, spent_ms=19.5, regret=0.25)  # mostly past the window: it saves little
    assert cost.copy_ms == 3.0 and cost.stolen_ms == 0.0


def test_a_core_the_prefetches_must_wait_for_is_not_spare_for_a_while():
    """Another job busy on the core the compute leaves: the prefetch reads wait for it (measured: 1.9 times
    their CPU time at the median), and their CPU time is then taken from the step as if no core were left."""
    now = [100.0]
    cost = HostReadCost(0.0, overlap_ms=20.0, reads=reads(3.0, 3.0), spare_core=True, clock=lambda: now[0])
    for _ in range(20):
        cost.observe_prefetch(cpu_ms=3.0, queued_ms=0.0)  # idle: they run at once
    assert cost.core_to_spare() and cost.may_pay(regret=0.25)
    for _ in range(HostReadCost.JUDGED_OVER):
        cost.observe_prefetch(cpu_ms=3.0, queued_ms=5.7)
    assert not cost.core_to_spare() and not cost.may_pay(regret=0.25)
    assert (cost.copy_ms, cost.stolen_ms) == (0.0, 3.0)
    now[0] += HostReadCost.CONTENDED_BACKOFF_S
    assert cost.core_to_spare()  # then it tries again


def test_a_few_prefetches_that_waited_on_a_passing_job_do_not_take_the_spare_core():
    """With the other core idle, wait ÷ CPU per prefetch measured 0 at the median and 0.29 at p99: a mean
    over a window tripped on single outliers and gave up the gain of prefetching there."""
    cost = HostReadCost(0.0, overlap_ms=20.0, reads=reads(3.0, 3.0), spare_core=True, clock=lambda: 100.0)
    outliers = HostReadCost.JUDGED_OVER // 2
    for index in range(10 * HostReadCost.JUDGED_OVER):
        waited = index % HostReadCost.JUDGED_OVER < outliers
        cost.observe_prefetch(cpu_ms=3.0, queued_ms=30.0 if waited else 0.0)
        assert cost.core_to_spare()
    for _ in range(outliers + 1):  # now most of the window waited
        cost.observe_prefetch(cpu_ms=3.0, queued_ms=30.0)
    assert not cost.core_to_spare()


def test_a_disk_read_pays_for_a_likely_guess_and_not_for_an_unlikely_one():
    cost = HostReadCost(0.0, overlap_ms=20.0, reads=reads(10.0, 1.0, 0.5), spare_core=False)
    assert cost.worth(0.9, 0.0, regret=0.25)
    assert not cost.worth(0.2, 0.0, regret=0.25)
    assert (cost.copy_ms, cost.stolen_ms, cost.demand_ms()) == (8.5, 1.0, 10.0)


def test_the_look_ahead_is_not_computed_when_no_guess_can_pay():
    """With nothing to gain the look-ahead's router would only cost (CPU, all resident: +15% a token)."""
    calls = []
    routers = [None, lambda hidden: (calls.append(1), torch.tensor([[1, 2]]))[1]]
    cache = ExpertCache(4, make_policy("lru", 2, 8), CacheStats(2), DryRunBackend(1))
    times = reads(3.0, 3.0)
    cost = HostReadCost(0.0, overlap_ms=40.0, reads=times, spare_core=False)
    prefetcher = Prefetcher(cache, routers, background=False, limit=4, cost=cost)
    prefetcher.after_routing(0, torch.zeros(1, 4), [0, 1], "decode")
    assert calls == [] and cache.stats.totals()["prefetches"] == 0
    for _ in range(20):
        times.observe(30.0, 1.0, 0.0)  # the reads now wait on a disk
    prefetcher.after_routing(0, torch.zeros(1, 4), [0, 1], "decode")
    # at the prior accuracy (0.5) the first ~28 ms of disk wait pays inside the 40 ms window, a second does not
    assert calls == [1] and cache.stats.totals()["prefetches"] == 1 and prefetcher.held_back == 1


def test_a_thread_sees_its_own_cpu_time_and_none_of_a_sleep():
    cpu, _ = thread_cpu_and_queue_ns()
    time.sleep(0.05)
    slept, _ = thread_cpu_and_queue_ns()
    start = time.perf_counter()
    while time.perf_counter() - start < 0.05:  # as long busy as asleep (a fixed sum once took 19 ms, under a 20 ms bar)
        pass
    busy, _ = thread_cpu_and_queue_ns()
    assert slept - cpu < 20e6  # asleep: next to no CPU time
    assert busy - slept > 2 * (slept - cpu)  # busy: CPU time, however many others share the cores


def test_the_cpu_engine_times_its_reads_and_gates_prefetch_by_them(tmp_path):
    folder = build_checkpoint("mixtral", tmp_path / "m", num_layers=2)
    engine = Engine.load(EngineConfig(model=str(folder), device="cpu", expert_cache_experts=3, prefetch=True,
                                      eamc_path=str(tmp_path / "m.eamc")))
    try:
        engine.runtime.prefetcher.close()  # its thread may still read a guess: figures settle first
        cost = engine.runtime.prefetcher.cost
        assert isinstance(cost, HostReadCost) and cost.reads is engine.loaded.host.read_times
        assert cost.spare_core == ((os.cpu_count() or 1) > torch.get_num_threads())
        assert cost.reads.reads == engine.loaded.host.disk_reads > 0  # the warm-up's misses were timed
        assert 0 < cost.reads.cpu_ms <= cost.reads.wall_ms
        gate = engine.cache_info()["prefetch_gate"]  # /v1/expert-cache shows what the gate weighs
        assert gate["reads"] == cost.reads.reads and gate["spare_core"] == cost.core_to_spare()
    finally:
        engine.close()
