"""The prefetch gate's compute window, given or learned from the clock as the engine learns it on CUDA.

    python -m bench.gate_window [--tokens 64] [--json]

Timed replay of uniform random routing (`bench.timed_calibration.random_trace`, 3 requests) with the
H200 run's figures of 2026-12-04 (54.65 GB/s pinned; one layer's compute 2.466 ms on the Mixtral
shape, 2.869 ms on the DeepSeek-V2-Lite shape; the look-ahead accuracy the engine measured there,
0.79 and 0.66), a quarter of the experts cached. Per shape and policy: TPOT without prefetch, with
prefetch and the window given (`--compute-ms` known), and with the window learned (`--learn-overlap`,
the engine's way), with the window the gate ended on and its prefetches (issued / used).
"""

from __future__ import annotations

import argparse
import json

from bench.timed_calibration import DEEPSEEK, MIXTRAL, Shape, random_trace
from cache.replay import replay
from cache.timed import LinkSpec

H200_LINK_GBPS = 54.65
CASES = ((MIXTRAL, 2.466, 0.79), (DEEPSEEK, 2.869, 0.66))  # (shape, compute ms per layer, look-ahead accuracy)


def run_case(shape: Shape, compute_ms: float, accuracy: float, policy: str, tokens: int) -> dict:
    header, requests = random_trace(shape, requests=3, tokens=tokens)
    capacity = header.num_layers * header.num_experts // 4
    link = LinkSpec(expert_bytes=shape.expert_bytes, link_gbps=H200_LINK_GBPS, compute_ms=compute_ms)
    off = replay(header, requests, policy, capacity, False, link)
    row = {"shape": shape.name, "policy": policy, "cache": f"{capacity}/{header.num_layers * header.num_experts}",
           "compute_ms": compute_ms, "off_ms": off["tpot_ms"]}
    for name, learn in (("given", False), ("learned", True)):
        on = replay(header, requests, policy, capacity, True, link, accuracy, learn_overlap=learn)
        row[name] = {"tpot_ms": on["tpot_ms"], "on_over_off": round(on["tpot_ms"] / off["tpot_ms"], 3),
                     "window_ms": on["prefetch_window_ms"], "prefetches": on["prefetches"],
                     "prefetch_used": on["prefetch_used"]}
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=64, help="decode tokens per request")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    rows = [run_case(shape, compute, accuracy, policy, args.tokens)
            for shape, compute, accuracy in CASES for policy in ("lru", "sparsity-aware")]
    if args.json:
        print(json.dumps(rows, indent=1))
        return
    print("| shape, cache | policy | off ms | on, window given | on, window learned | window learned (true) |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        given, learned = r["given"], r["learned"]
        cells = [f"{c['tpot_ms']:.2f} ({c['on_over_off']:.3f}×, {c['prefetches']} prefetches, {c['prefetch_used']} used)"
                 for c in (given, learned)]
        print(f"| {r['shape']}, {r['cache']} | {r['policy']} | {r['off_ms']:.2f} | {cells[0]} | {cells[1]} "
              f"| {learned['window_ms']:.2f} ms ({r['compute_ms']}) |")


if __name__ == "__main__":
    main()
