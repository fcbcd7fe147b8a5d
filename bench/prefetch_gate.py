"""Does prefetch ever cost? Timed replay, prefetch off vs on, with and without the cost gate.

    python -m bench.prefetch_gate [--requests 40] [--json]

Traces: uniform random routing (Mixtral-8x7B shape, 4 layers: nothing is predictable),
the demo model's recorded routing (bench/traces, first `--requests` requests) and the
synthetic `few-large` and `many-small-64` shapes (cache/tracegen.py). Links: Mixtral-size
experts (352 MB) on PCIe 4.0 x16 (24 GB/s) and on the H200's PCIe 5 (55.3 GB/s), and
DeepSeek-V2-Lite-size experts (17.3 MB) on PCIe 4.0. Look-ahead accuracy: 0.82 (measured
on the demo model, RESULTS.md) and 0.3 (the fit for random-weight routers). Policy:
sparsity-aware (the default). Prints TPOT per variant and the on/off ratios.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from bench.timed_calibration import MIXTRAL, random_trace
from cache.replay import replay
from cache.timed import MIXTRAL_EXPERT_BYTES, LinkSpec
from cache.trace import load_trace
from cache.tracegen import SHAPES, generate

DEMO_TRACE = Path(__file__).parent / "traces" / "demo-smollm2-moe.trace.jsonl"
LINKS = {
    "Mixtral expert, PCIe 4": LinkSpec(MIXTRAL_EXPERT_BYTES, link_gbps=24.0, compute_ms=1.6),
    "Mixtral expert, PCIe 5": LinkSpec(MIXTRAL_EXPERT_BYTES, link_gbps=55.3, compute_ms=1.6),
    "DeepSeek-V2-Lite expert, PCIe 4": LinkSpec(3 * 2048 * 1408 * 2, link_gbps=24.0, compute_ms=1.0),
}


def traces(requests: int) -> dict[str, tuple]:
    demo_header, demo_requests = load_trace(DEMO_TRACE)
    out = {
        "random (4 × 8, top-2)": random_trace(MIXTRAL, requests=3, tokens=96),
        "demo model": (demo_header, demo_requests[:requests]),
    }
    for shape in ("few-large", "many-small-64"):
        out[f"synthetic {shape}"] = generate(SHAPES[shape], requests, seed=0)
    return out


def tpot(trace: tuple, link: LinkSpec, capacity: int, accuracy: float, prefetch: bool, gate: bool = True) -> float:
    header, requests = trace
    result = replay(header, requests, "sparsity-aware", capacity, prefetch, link, accuracy if prefetch else None,
                    gate=gate)
    return result["tpot_ms"]


def run(requests: int, fracs: tuple[float, ...] = (0.1, 0.25, 0.5)) -> list[dict]:
    rows = []
    for trace_name, trace in traces(requests).items():
        header = trace[0]
        accuracy = 0.3 if trace_name.startswith("random") else 0.82
        for link_name, link in LINKS.items():
            for frac in fracs:
                capacity = max(header.top_k, round(frac * header.num_layers * header.num_experts))
                off = tpot(trace, link, capacity, accuracy, prefetch=False)
                on = tpot(trace, link, capacity, accuracy, prefetch=True)
                ungated = tpot(trace, link, capacity, accuracy, prefetch=True, gate=False)
                rows.append({"trace": trace_name, "link": link_name, "cache": frac, "lookahead_accuracy": accuracy,
                             "off_ms": off, "on_ms": on, "ungated_ms": ungated,
                             "on_over_off": round(on / off, 3), "ungated_over_off": round(ungated / off, 3)})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=40)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    rows = run(args.requests)
    if args.json:
        print(json.dumps(rows, indent=1))
        return
    print("| trace | link | cache | off ms | on ms | on/off | ungated ms | ungated/off |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['trace']} | {r['link']} | {r['cache']:.0%} | {r['off_ms']:.1f} | {r['on_ms']:.1f} | "
              f"{r['on_over_off']:.3f} | {r['ungated_ms']:.1f} | {r['ungated_over_off']:.3f} |")


if __name__ == "__main__":
    main()
