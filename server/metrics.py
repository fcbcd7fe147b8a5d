"""Prometheus metrics (names fixed in DESIGN.md).

Request metrics are recorded as requests run; the expert-cache counters are read from
`engine.cache_counters()` at scrape time by a custom collector, so they never drift.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from engine.api import GenerationEvent

# engine.cache_counters() key -> (metric name, help); counters unless listed in GAUGES
CACHE_METRICS = {
    "hits": ("moe_expert_cache_hits", "Expert lookups served from the device cache"),
    "misses": ("moe_expert_cache_misses", "Expert lookups that had to load the expert"),
    "prefetches": ("moe_expert_prefetches", "Experts loaded ahead of use by the prefetcher"),
    "prefetch_used": ("moe_expert_prefetch_used", "Prefetched experts that were used before eviction"),
    "bytes_transferred": ("moe_expert_bytes_transferred", "Expert bytes copied host to device"),
    "cpu_computed": ("moe_expert_cpu_computed", "Missed experts computed on the host cores instead of copied "
                     "(--cpu-experts; also counted as misses)"),
    "prefetch_failures": ("moe_expert_prefetch_failures", "Prefetches that failed (e.g. a disk read); serving went on"),
    "trace_write_failures": ("moe_trace_write_failures", "Requests whose --record-trace line could not be written"),
    "eamc_entries": ("moe_eamc_entries", "Expert activation matrices held in the EAMC"),
    "prompt_tokens": ("moe_prompt_tokens", "Prompt tokens of the requests run"),
    "prompt_tokens_cached": ("moe_prompt_tokens_cached", "Prompt tokens read from a kept KV cache (--prefix-cache), "
                             "not computed"),
}
GAUGES = {"eamc_entries"}

disable_created_metrics()  # no `*_created` series: they double the output and nobody here reads them

TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80)
TPOT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)

# values of moe_requests_total{status}
OK, ABORTED, INVALID, REJECTED, ERROR = "ok", "aborted", "invalid", "rejected", "error"


def status_of(http_status: int) -> str:
    if http_status == 503:
        return REJECTED  # queue full or engine unavailable
    return INVALID if http_status < 500 else ERROR


class CacheCollector(Collector):
    def __init__(self, counters: Callable[[], dict[str, int] | None]) -> None:
        self.counters = counters  # None while the engine is loading

    def collect(self) -> Iterator[Metric]:
        return self._families(self.counters() or {})

    def describe(self) -> Iterator[Metric]:  # the names, without asking the engine
        return self._families({})

    def _families(self, values: dict[str, int]) -> Iterator[Metric]:
        for key, (name, help_text) in CACHE_METRICS.items():
            family = GaugeMetricFamily if key in GAUGES else CounterMetricFamily
            yield family(name, help_text, value=values.get(key, 0))


class ServerMetrics:
    def __init__(self, queue_depth: Callable[[], int], cache_counters: Callable[[], dict[str, int] | None]) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.requests = Counter("moe_requests", "Generation requests by outcome", ["status"], registry=self.registry)
        self.queue_depth = Gauge("moe_queue_depth", "Requests waiting or running", registry=self.registry)
        self.queue_depth.set_function(queue_depth)
        self.ttft = Histogram("moe_time_to_first_token_seconds", "Request arrival to first generated token",
                              buckets=TTFT_BUCKETS, registry=self.registry)
        self.tpot = Histogram("moe_time_per_output_token_seconds", "Mean time per token after the first",
                              buckets=TPOT_BUCKETS, registry=self.registry)
        self.generated = Counter("moe_generated_tokens", "Tokens generated", registry=self.registry)
        self.registry.register(CacheCollector(cache_counters))
        for status in (OK, ABORTED, INVALID, REJECTED, ERROR):
            self.requests.labels(status)  # every series exists from the start

    def track(self) -> RequestTimer:
        return RequestTimer(self)

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


@dataclass
class RequestTimer:
    """Times one generation request; `done(status)` records it exactly once."""

    metrics: ServerMetrics
    start: float = field(default_factory=time.perf_counter)
    first: float | None = None
    last: float | None = None
    tokens: int = 0
    finished: bool = False

    def observe(self, event: GenerationEvent) -> None:
        if not event.token_ids:
            return
        self.last = time.perf_counter()
        if self.first is None:
            self.first = self.last
            self.metrics.ttft.observe(self.first - self.start)
        self.tokens += len(event.token_ids)
        self.metrics.generated.inc(len(event.token_ids))

    def done(self, status: str) -> None:
        if self.finished:
            return
        self.finished = True
        self.metrics.requests.labels(status).inc()
        if self.first is not None and self.last is not None and self.tokens > 1:
            self.metrics.tpot.observe((self.last - self.first) / (self.tokens - 1))
