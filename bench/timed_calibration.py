"""The timed replay against what the H200 measured (../shared/measurements/gpu-h200-2026-11-30.md).

    python -m bench.timed_calibration [--tokens 96] [--lookahead-accuracy 0.67] [--json]

Each row is simulated twice: as the engine that was measured (prefetch before the step's
experts were protected, every guess issued; that is what calibrates the model) and as
the engine is now (today's order and the prefetch cost gate): the prediction for it.

Random routing, as the random-weight checkpoints of that run route (near-uniformly), with
the same shapes, expert sizes and cache sizes; the link at the measured 55.3 GB/s and the
per-layer compute taken from each shape's all-resident row. Prints simulated TPOT next to
the measured one and the error per row. The look-ahead accuracy of random routers was
measured at 0.67 on the device (bench/cuda_check.py); it only matters for prefetch rows.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass

import numpy as np

import cache.replay
from cache.replay import replay
from cache.runtime import ExpertRuntime
from cache.timed import MIXTRAL_EXPERT_BYTES, LinkSpec
from cache.trace import TraceHeader, TraceRequest

H200_LINK_GBPS = 55.3  # pinned, 1 GiB copies


@dataclass(frozen=True)
class Shape:
    name: str
    num_layers: int  # MoE layers
    num_experts: int
    top_k: int
    expert_bytes: int
    resident_tpot_ms: float  # measured, all experts resident


@dataclass(frozen=True)
class Row:
    shape: Shape
    policy: str
    prefetch: bool
    capacity: int
    measured_tpot_ms: float
    measured_gb_per_token: float


MIXTRAL = Shape("Mixtral-8x7B experts, 4 layers", 4, 8, 2, MIXTRAL_EXPERT_BYTES, 6.52)
DEEPSEEK = Shape("DeepSeek-V2-Lite experts, 6 MoE layers", 6, 64, 6, 3 * 2048 * 1408 * 2, 23.9)
ROWS = [
    Row(MIXTRAL, "lru", False, 8, 43.1, 2.20),
    Row(MIXTRAL, "lru", True, 8, 75.2, 3.74),
    Row(MIXTRAL, "sparsity-aware", True, 8, 88.9, 4.42),
    Row(MIXTRAL, "sparsity-aware", True, 16, 50.8, 2.36),
    Row(MIXTRAL, "lru", False, 2, 61.1, 3.07),
    Row(DEEPSEEK, "lru", False, 96, 27.7, 0.39),
    Row(DEEPSEEK, "sparsity-aware", True, 96, 26.6, 0.46),
    Row(DEEPSEEK, "sparsity-aware", True, 192, 26.2, 0.17),
]


def random_trace(shape: Shape, requests: int, tokens: int, seed: int = 0) -> tuple[TraceHeader, list]:
    """Uniform routing: each token picks `top_k` distinct experts per layer at random."""
    rng = np.random.default_rng(seed)
    L, E, K = shape.num_layers, shape.num_experts, shape.top_k

    def steps(n: int) -> np.ndarray:  # [n, L, K]
        return np.sort(np.argsort(rng.random((n, L, E)), axis=2)[:, :, :K], axis=2).astype(np.int32)

    header = TraceHeader("random", L, E, K)
    return header, [TraceRequest(f"r{i}", steps(8), steps(tokens)) for i in range(requests)]


class MeasuredOrderRuntime(ExpertRuntime):
    """The engine as the H200 measured it (4d67bcf): the prefetch for the next layer was
    issued before the step's own experts were protected, so it could evict them."""

    def note_routing(self, layer, needed, tokens, counts) -> None:
        self.policy.on_routing(layer, needed, tokens, self.phase, counts)

    def run_step(self, layer, needed, hidden, compute=None, compute_on_host=None) -> None:
        prefetcher, self.prefetcher = self.prefetcher, None
        if prefetcher is not None:
            prefetcher.after_routing(layer, hidden, needed, self.phase)
        try:
            super().run_step(layer, needed, hidden, compute, compute_on_host)
        finally:
            self.prefetcher = prefetcher


def simulate(row: Row, tokens: int, lookahead_accuracy: float, measured_order: bool) -> dict:
    """`measured_order`: the engine the H200 ran (its prefetch order, no cost gate); else today's."""
    shape = row.shape
    link = LinkSpec(expert_bytes=shape.expert_bytes, link_gbps=H200_LINK_GBPS,
                    compute_ms=shape.resident_tpot_ms / shape.num_layers)
    header, requests = random_trace(shape, requests=3, tokens=tokens)
    runtime_class = cache.replay.ExpertRuntime
    cache.replay.ExpertRuntime = MeasuredOrderRuntime if measured_order else ExpertRuntime
    try:
        result = replay(header, requests, row.policy, row.capacity, row.prefetch, link,
                        lookahead_accuracy if row.prefetch else None, gate=not measured_order)
    finally:
        cache.replay.ExpertRuntime = runtime_class
    return {"tpot_ms": result["tpot_ms"], "gb_per_token": result["link_gb_per_decode_token"],
            "hit_rate": round(1 - result["decode_miss_rate"], 3)}


def compare(row: Row, tokens: int, lookahead_accuracy: float) -> dict:
    then = simulate(row, tokens, lookahead_accuracy, measured_order=True)
    now = simulate(row, tokens, lookahead_accuracy, measured_order=False)
    return {
        "shape": row.shape.name,
        "variant": f"{row.policy}{' + prefetch' if row.prefetch else ''}",
        "cache": f"{row.capacity}/{row.shape.num_layers * row.shape.num_experts}",
        "measured_tpot_ms": row.measured_tpot_ms,
        "simulated_tpot_ms": then["tpot_ms"],
        "error": round(then["tpot_ms"] / row.measured_tpot_ms - 1, 4),
        "measured_gb_per_token": row.measured_gb_per_token,
        "simulated_gb_per_token": then["gb_per_token"],
        "simulated_hit_rate": then["hit_rate"],
        "today_tpot_ms": now["tpot_ms"],
        "today_gb_per_token": now["gb_per_token"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=96, help="decode tokens per request (3 requests)")
    parser.add_argument("--lookahead-accuracy", type=float, default=0.67)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    rows = [compare(row, args.tokens, args.lookahead_accuracy) for row in ROWS]
    if args.json:
        print(json.dumps(rows, indent=1))
        return
    print("| shape | variant | cache | measured TPOT ms | simulated | error | GB/token measured | simulated "
          "| today's order: TPOT ms | GB/token |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['shape']} | {r['variant']} | {r['cache']} | {r['measured_tpot_ms']} | {r['simulated_tpot_ms']:.1f} "
              f"| {r['error']:+.1%} | {r['measured_gb_per_token']} | {r['simulated_gb_per_token']:.2f} "
              f"| {r['today_tpot_ms']:.1f} | {r['today_gb_per_token']:.2f} |")


if __name__ == "__main__":
    main()
