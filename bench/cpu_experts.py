"""The host executor (`--cpu-experts`) in the timed replay: TPOT with misses split between the
link and the host cores (whole experts only, and with one expert per step shared by both lanes),
against every miss copied.

    python -m bench.cpu_experts [--requests 60] [--json]

Mixtral-8x7B-size experts (352 MB bf16) at 25% of the experts cached, `sparsity-aware` and `lru`,
prefetch on and off, on the recorded demo trace (its routing, with Mixtral-size experts) and on
uniform random routing (Mixtral shape: 32 layers × 8 experts, top-2). Two machines:

- desktop: PCIe 4.0 x16 (25 GB/s pinned) and a host that reads expert weights at 60 GB/s
  (dual-channel DDR5; the issue's target row);
- H200 host: PCIe 5 (55.3 GB/s) and its 16 cores (53 GB/s: one Mixtral expert, one token,
  bf16, 6.6 ms), 8 of 32 experts cached on 4 layers, as the GPU table measured (43.1 ms demand-only LRU).
"""

from __future__ import annotations

import argparse
import json

from bench.timed_calibration import MIXTRAL, Shape, random_trace
from cache.replay import replay
from cache.timed import MIXTRAL_EXPERT_BYTES, LinkSpec
from cache.trace import load_trace

DEMO_TRACE = "bench/traces/demo-smollm2-moe.trace.jsonl"
MIXTRAL_32 = Shape("Mixtral-8x7B, 32 layers", 32, 8, 2, MIXTRAL.expert_bytes, MIXTRAL.resident_tpot_ms * 8)
DESKTOP = LinkSpec(MIXTRAL_EXPERT_BYTES, link_gbps=25.0, compute_ms=1.6, cpu_gbps=60.0)
H200_HOST = LinkSpec(MIXTRAL_EXPERT_BYTES, link_gbps=55.3, compute_ms=MIXTRAL.resident_tpot_ms / 4, cpu_gbps=53.0)


def cases(requests: int) -> list[tuple[str, tuple, LinkSpec, float]]:
    demo_header, demo_requests = load_trace(DEMO_TRACE)
    return [
        ("demo trace, desktop", (demo_header, demo_requests[:requests]), DESKTOP, 0.25),
        ("random 32 × 8, desktop", random_trace(MIXTRAL_32, requests=3, tokens=64), DESKTOP, 0.25),
        ("random 4 × 8, H200 host", random_trace(MIXTRAL, requests=3, tokens=96), H200_HOST, 0.25),
    ]


def run(requests: int) -> list[dict]:
    rows = []
    for name, (header, reqs), link, frac in cases(requests):
        capacity = max(header.top_k, round(frac * header.num_layers * header.num_experts))
        for policy in ("lru", "sparsity-aware"):
            for prefetch in (False, True):
                accuracy = (0.3 if name.startswith("random") else 0.82) if prefetch else None
                copy_only = LinkSpec(**{**link.__dict__, "cpu_gbps": 0.0})
                off = replay(header, reqs, policy, capacity, prefetch, copy_only, accuracy)
                whole = replay(header, reqs, policy, capacity, prefetch, LinkSpec(**{**link.__dict__, "share_misses": False}),
                               accuracy)
                on = replay(header, reqs, policy, capacity, prefetch, link, accuracy)
                rows.append({
                    "case": name, "policy": policy, "prefetch": prefetch, "cache": f"{capacity}/{header.num_layers * header.num_experts}",
                    "copy_only_ms": off["tpot_ms"], "whole_experts_ms": whole["tpot_ms"], "cpu_experts_ms": on["tpot_ms"],
                    "ratio_whole": round(whole["tpot_ms"] / off["tpot_ms"], 3),
                    "ratio": round(on["tpot_ms"] / off["tpot_ms"], 3),
                    "cpu_share_of_misses": round(on["decode_cpu_computed"] / max(1, on["decode_misses"]), 3),
                    "gb_per_token": [off["link_gb_per_decode_token"], on["link_gb_per_decode_token"]],
                })
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=60, help="demo-trace requests to replay")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    rows = run(args.requests)
    if args.json:
        print(json.dumps(rows, indent=1))
        return
    print("| case | policy | prefetch | cache | all copied ms | whole experts on host ms | ratio | with one shared ms | "
          "ratio | misses on host (in part) | GB/token (copied → with) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['case']} | {r['policy']} | {'on' if r['prefetch'] else 'off'} | {r['cache']} | {r['copy_only_ms']:.1f} | "
              f"{r['whole_experts_ms']:.1f} | {r['ratio_whole']:.2f} | "
              f"{r['cpu_experts_ms']:.1f} | **{r['ratio']:.2f}** | {r['cpu_share_of_misses']:.0%} | "
              f"{r['gb_per_token'][0]:.2f} → {r['gb_per_token'][1]:.2f} |")


if __name__ == "__main__":
    main()
