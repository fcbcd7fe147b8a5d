"""Prefetch on a machine without a GPU: the RAM tier holds a quarter of the experts, the rest is read from disk.

    python -m bench.cpu_prefetch [--rounds 3] [--tokens 24] [--repeats 2] [--threads N] [--busy-cores 1]

On CPU the cache's slots are the RAM tier and a miss reads the expert from the checkpoint
(the page cache, once warm) straight into its slot; a prefetch does the same read on the
prefetch thread. A DeepSeek-V2-Lite-routed checkpoint (64 experts, top-6, shared experts) at
H 1024 in float32 (8.7 MB per expert) is written once; then, with `--expert-cache-experts` a
quarter of the 384 experts, `lru` and `sparsity-aware` each run with prefetch off and on,
`--repeats` times in turn. TPOT is the median over `--rounds` greedy requests after a warm-up;
hit rate and prefetches count the decode steps. `--threads` sets torch's intra-op threads (default:
torch's own); `--busy-cores` starts that many busy-looping processes beside it, as another job on
the machine would be. Prints one JSON object per row, then each policy's prefetch on ÷ off.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import statistics
import tempfile
from dataclasses import replace
from pathlib import Path

import torch

from bench.engine_bench import PROMPT, engine_run
from bench.scale_models import DEEPSEEK, ModelShape, tiny, write_checkpoint
from engine.config import EngineConfig
from engine.engine import Engine

SHAPE = replace(DEEPSEEK, name="DeepSeek-V2-Lite routing at H 1024", hidden=1024, expert_intermediate=704,
                heads=8, kv_heads=8, dense_intermediate=2048)  # fmt: skip
GATE_FIGURES = ("spare_core", "read_ms", "read_cpu_ms", "read_queued_ms", "read_disk_ms", "compute_window_ms",
                "prefetch_wait_share_median", "held_back")  # what the prefetch gate weighed (HostReadCost)
ROWS = (("lru", False), ("lru", True), ("sparsity-aware", False), ("sparsity-aware", True))


def run_row(folder: Path, workdir: Path, capacity: int, total: int, policy: str, prefetch: bool, rounds: int,
            tokens: int) -> dict:
    engine = Engine.load(EngineConfig(model=str(folder), device="cpu", dtype="float32", policy=policy,
                                      prefetch=prefetch, expert_cache_experts=capacity, prefix_cache=0,
                                      eamc_path=str(workdir / f"{policy}.eamc")))  # fmt: skip
    try:
        prompt = engine.encode(PROMPT)
        engine_run(engine, prompt, 4)
        runs = [engine_run(engine, prompt, tokens) for _ in range(rounds)]
        gate = engine.cache_info()["prefetch_gate"] or {}
    finally:
        engine.close()
    hits = sum(run.decode_counters["hits"] for run in runs)
    misses = sum(run.decode_counters["misses"] for run in runs)
    steps = sum(run.decode_steps for run in runs)
    return {
        "policy": policy, "prefetch": prefetch, "cache": f"{capacity}/{total}",
        "tpot_ms": round(1000 * statistics.median(run.tpot_s for run in runs), 2),
        "hit_rate": round(hits / (hits + misses), 3),
        "prefetches_per_token": round(sum(run.decode_counters["prefetches"] for run in runs) / steps, 2),
        **{key: gate[key] for key in GATE_FIGURES if key in gate},
    }  # fmt: skip


def ratios(rows: list[dict]) -> dict[str, list[float]]:
    """Per policy and repeat: TPOT with prefetch ÷ without, in run order."""
    off: dict[str, list[float]] = {}
    result: dict[str, list[float]] = {}
    for row in rows:
        if not row["prefetch"]:
            off.setdefault(row["policy"], []).append(row["tpot_ms"])
        else:
            n = len(result.setdefault(row["policy"], []))
            result[row["policy"]].append(round(row["tpot_ms"] / off[row["policy"]][n], 3))
    return result


def _busy_loop() -> None:
    while True:
        pass


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=24)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, help="torch intra-op threads (default: torch's own)")
    parser.add_argument("--busy-cores", type=int, default=0, help="busy-looping processes beside the run")
    parser.add_argument("--tiny", action="store_true", help="a tiny model of the same routing (a test)")
    parser.add_argument("--workdir", help="where the checkpoint is written (default: a temporary folder)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    shape: ModelShape = tiny(SHAPE) if args.tiny else SHAPE
    hogs = [multiprocessing.Process(target=_busy_loop, daemon=True) for _ in range(args.busy_cores)]
    for hog in hogs:
        hog.start()
    try:
        with tempfile.TemporaryDirectory(dir=args.workdir) as tmp:
            workdir = Path(tmp)
            folder = write_checkpoint(shape, workdir / "model", torch.float32, torch.device("cpu"))
            capacity = shape.total_experts // 4
            rows = []
            for repeat in range(args.repeats):
                for policy, prefetch in ROWS:
                    row = {"repeat": repeat, **run_row(folder, workdir, capacity, shape.total_experts, policy, prefetch,
                                                         args.rounds, args.tokens)}
                    print(json.dumps(row), flush=True)
                    rows.append(row)
    finally:
        for hog in hogs:
            hog.terminate()
    print(json.dumps({"kind": "ratios", "prefetch_on_over_off": ratios(rows), "threads": torch.get_num_threads(),
                      "busy_cores": args.busy_cores}))  # fmt: skip


if __name__ == "__main__":
    main()
