"""Issue 12: the share of the LRU→Belady decode-miss gap sparsity-aware closes, and its decision cost.

    python -m bench.policy_gap                       # the three presets (seed 0) and the demo trace
    python -m bench.policy_gap --seed 1 --requests 100   # another seed, first 100 requests (quick)
    python -m bench.policy_gap --cost                # µs per decode access, lru vs sparsity-aware
    python -m bench.policy_gap --stats               # the trace_stats row of each trace

Presets are generated with `cache.tracegen` at the request counts of the issue's real
traces (Mixtral: 100 instead of 4, the per-request statistics are the same) and replayed
at the issue's cache sizes; the demo trace at 5/10/25/50%.
"""

from __future__ import annotations

import argparse
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

from cache.replay import build_policy, capacity_of, gap_closed, replay
from cache.trace import TraceHeader, load_trace
from cache.trace_stats import table_row, trace_stats
from cache.tracegen import SHAPES, generate

DEMO_TRACE = Path(__file__).parent / "traces" / "demo-smollm2-moe.trace.jsonl"
POINTS = {  # preset → (requests, cache fractions of issue 12)
    "llama4-like": (387, (0.05, 0.10, 0.25)),
    "deepseek-v2-lite-like": (400, (0.10, 0.25, 0.50)),
    "mixtral-like": (100, (0.22, 0.50)),
}
DEMO_FRACS = (0.05, 0.10, 0.25, 0.50)
POLICIES = ("lru", "sparsity-aware", "belady")


def load(name: str, requests: int | None, seed: int) -> tuple[TraceHeader, list]:
    if name == "demo":
        header, reqs = load_trace(DEMO_TRACE)
    else:
        header, reqs = generate(SHAPES[name], requests or POINTS[name][0], seed, model=f"synthetic-{name}")
    return header, reqs[:requests] if requests else reqs


def _job(name: str, requests: int | None, seed: int, frac: float, policy: str) -> dict:
    header, reqs = load(name, requests, seed)
    result = replay(header, reqs, policy, capacity_of(header, None, frac))
    return {"trace": name, "frac": frac, **result}


def gap_table(results: list[dict]) -> list[str]:
    by = {(r["trace"], r["frac"], r["policy"]): r for r in results}
    lines = ["| trace | cache | LRU | sparsity-aware | Belady | gap closed |", "|---|---|---|---|---|---|"]
    for trace, frac in dict.fromkeys((r["trace"], r["frac"]) for r in results):
        rate = {p: by[(trace, frac, p)]["decode_miss_rate"] for p in POLICIES}
        closed = gap_closed(rate["lru"], rate["sparsity-aware"], rate["belady"])
        cells = [trace, f"{frac:.0%} ({by[(trace, frac, 'lru')]['capacity']})",
                 *(f"{rate[p]:.1%}" for p in POLICIES), "n/a" if closed is None else f"{closed:.0%}"]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def run_gap(names: list[str], requests: int | None, seed: int, jobs: int) -> list[str]:
    tasks = []
    for name in names:
        fracs = DEMO_FRACS if name == "demo" else POINTS[name][1]
        tasks += [(name, requests, seed, f, p) for f in fracs for p in POLICIES]
    with ProcessPoolExecutor(jobs) as pool:
        results = list(pool.map(_job, *zip(*tasks, strict=True)))
    return gap_table(results)


def decision_cost(name: str, frac: float, requests: int, seed: int) -> dict[str, float]:
    """Wall µs per decode access of a whole replay (policy hooks + cache bookkeeping), per policy."""
    header, reqs = load(name, requests, seed)
    capacity = capacity_of(header, None, frac)
    out = {}
    for policy in ("lru", "sparsity-aware"):
        built = build_policy(policy, header, reqs, capacity)
        started = time.perf_counter()
        result = replay(header, reqs, built, capacity)
        out[policy] = 1e6 * (time.perf_counter() - started) / max(result["decode_accesses"], 1)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--traces", default=",".join([*POINTS, "demo"]))
    parser.add_argument("--requests", type=int, default=None, help="only the first N requests (default: all)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--stats", action="store_true", help="only the trace_stats row of each trace")
    parser.add_argument("--cost", action="store_true", help="µs per decode access, lru vs sparsity-aware")
    args = parser.parse_args()
    names = args.traces.split(",")
    if args.stats:
        for name in names:
            print(table_row(name, trace_stats(*load(name, args.requests, args.seed))), flush=True)
        return
    if args.cost:
        for name in names:
            frac = DEMO_FRACS[1] if name == "demo" else POINTS[name][1][0]
            cost = decision_cost(name, frac, args.requests or 100, args.seed)
            print(f"{name} {frac:.0%}: " + ", ".join(f"{p} {us:.1f} µs" for p, us in cost.items()), flush=True)
        return
    print("\n".join(run_gap(names, args.requests, args.seed, args.jobs)))


if __name__ == "__main__":
    main()
