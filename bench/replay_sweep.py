"""Replay sweep on the development traces: miss rate and transfers vs cache size, per policy.

    python -m bench.replay_sweep                      # the three synthetic shapes, 300 requests each
    python -m bench.replay_sweep --traces rec.jsonl   # add recorded traces (e.g. --record-trace output)
    python -m bench.replay_sweep --oracle few-large:0.25,many-small:0.5   # ceiling of request-level prediction

Writes, under --out (default bench/out/replay): the generated traces, one folder per trace
with sweep.json / sweep.md / sweep.png (`python -m cache.replay --sweep`), and summary.md,
the tables that go into bench/RESULTS.md.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np

from cache.replay import REPLAY_POLICIES, gap_closed, replay, sweep, sweep_table, write_sweep
from cache.sparsity_aware import SparsityAwarePolicy, buckets_of
from cache.trace import load_trace, write_trace
from cache.tracegen import SHAPES, generate, generate_with_truth, trace_stats

FRACS = (0.05, 0.10, 0.25, 0.50)
EXTRA_FRACS = {"few-large": (0.22,)}  # Mixtral-8x7B on a 24 GB GPU holds ~56 of 256 experts


def make_trace(shape: str, requests: int, seed: int, folder: Path) -> Path:
    path = folder / f"{shape}-r{requests}-s{seed}.jsonl"
    if not path.exists():
        folder.mkdir(parents=True, exist_ok=True)
        header, reqs = generate(SHAPES[shape], requests, seed, model=f"synthetic-{shape}")
        write_trace(path, header, reqs)
    return path


def run(path: Path, fracs: tuple[float, ...], jobs: int, out: Path) -> dict:
    started = time.perf_counter()
    data = sweep(str(path), list(REPLAY_POLICIES), fracs, jobs, prefetch=True)
    data["wall_seconds"] = round(time.perf_counter() - started, 1)
    header, requests = load_trace(path)
    data["stats"] = trace_stats(header, requests)
    write_sweep(data, out / path.stem)
    return data


def summary(results: list[dict]) -> str:
    lines = []
    for data in results:
        head, rows = sweep_table(data)
        stats = ", ".join(f"{k} {v:.3g}" for k, v in data["stats"].items())
        lines += [
            f"### `{Path(data['trace']).name}` — {data['shape']}",
            "",
            f"Decode statistics: {stats}.",
            "",
            "Decode miss rate (transfers per decode access); gap closed = share of the LRU→Belady miss-rate gap "
            "that sparsity-aware (no prefetch) closes.",
            "",
            "| " + " | ".join(head) + " |",
            "|" + "---|" * len(head),
            *("| " + " | ".join(row) + " |" for row in rows),
            "",
            "Seconds per replay (one process each): " + _timings(data) + ".",
            "",
        ]
    return "\n".join(lines)


def _timings(data: dict) -> str:
    worst: dict[str, float] = {}
    for r in data["results"]:
        worst[r["policy"]] = max(worst.get(r["policy"], 0.0), r["seconds"])
    return ", ".join(f"{name} ≤ {sec:.0f}" for name, sec in worst.items())


class OracleSharePolicy(SparsityAwarePolicy):
    """sparsity-aware told each request's true expert distribution (only a generator knows it)."""

    name = "oracle-share"

    def __init__(self, num_layers: int, num_experts: int, truth: np.ndarray, top_k: int) -> None:
        super().__init__(num_layers, num_experts)
        self.truth = truth  # [R, L, E]
        self.true_top_k = top_k
        self._index = 0

    def on_request_start(self, request_id: str) -> None:
        super().on_request_start(request_id)
        self._index = int(request_id.split("-")[1])  # generator ids: req-<index>-g<group>

    def _new_pass(self, phase: str) -> None:
        super()._new_pass(phase)
        if phase == "decode":
            self._buckets = buckets_of(self.truth[self._index] * self.true_top_k)


def oracle(spec: str, requests: int, seed: int) -> str:
    """How much of the LRU→Belady gap perfect request-level prediction would close."""
    lines = ["| trace | cache | lru | sparsity-aware | oracle-share | belady | gap closed: ours / oracle |",
             "|---|---|---|---|---|---|---|"]
    for item in spec.split(","):
        shape, frac = item.split(":")
        header, reqs, truth = generate_with_truth(SHAPES[shape], requests, seed)
        capacity = round(float(frac) * header.num_layers * header.num_experts)
        oracle_policy = OracleSharePolicy(header.num_layers, header.num_experts, truth, header.top_k)
        rate = {name: replay(header, reqs, name, capacity)["decode_miss_rate"]
                for name in ("lru", "sparsity-aware", "belady")}
        rate["oracle-share"] = replay(header, reqs, oracle_policy, capacity)["decode_miss_rate"]
        ours = gap_closed(rate["lru"], rate["sparsity-aware"], rate["belady"])
        best = gap_closed(rate["lru"], rate["oracle-share"], rate["belady"])
        lines.append(f"| {shape} ({requests} req.) | {float(frac):.0%} | {rate['lru']:.1%} | "
                     f"{rate['sparsity-aware']:.1%} | {rate['oracle-share']:.1%} | {rate['belady']:.1%} | "
                     f"{ours:.0%} / {best:.0%} |")
        print(lines[-1], flush=True)
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default=",".join(SHAPES), help="synthetic shapes to generate and sweep")
    parser.add_argument("--requests", type=int, default=300)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--traces", nargs="*", default=[], help="more moe-trace/1 files to sweep")
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--out", default="bench/out/replay")
    parser.add_argument("--oracle", metavar="SHAPE:FRAC,...", help="only the oracle-share ceiling (100 requests)")
    args = parser.parse_args()
    if args.oracle:
        print(oracle(args.oracle, 100, args.seed))
        return
    out = Path(args.out)
    todo = [(make_trace(s, args.requests, args.seed, out / "traces"), s) for s in args.shapes.split(",") if s]
    todo += [(Path(t), "") for t in args.traces]
    results = []
    for path, shape in todo:
        fracs = tuple(sorted(FRACS + EXTRA_FRACS.get(shape, ())))
        results.append(run(path, fracs, args.jobs, out))
        print(f"{path.name}: {results[-1]['wall_seconds']} s", flush=True)
    (out / "summary.md").write_text(summary(results))
    (out / "summary.json").write_text(json.dumps(results, indent=1) + "\n")
    print(summary(results))


if __name__ == "__main__":
    main()
