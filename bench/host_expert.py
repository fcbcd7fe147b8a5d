"""One expert on one token on the host cores, as the engine measures it at start-up for `--cpu-experts auto`.

    python -m bench.host_expert [--shapes mixtral,deepseek] [--dtypes bfloat16,float32] [--threads N]

On a CUDA machine the engine times one expert from its host buffer (`measure_host_ms`) and compares it
with the expert's copy; this runs that same call on a one-layer checkpoint of a real expert size, on any
machine, next to `F.linear` on the same weights (what the cores can do). The engine's figure should be
close to the reference: on an H200 host on 2026-12-04 it was 190 ms and more for a Mixtral expert in
bfloat16 (305 ms at most) where `F.linear` took 7 ms, so the host executor was never used.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import torch
import torch.nn.functional as F

from bench.scale_models import SHAPES, write_checkpoint
from engine.config import EngineConfig
from engine.engine import Engine, host_compute_threads


def reference_ms(views: dict[str, torch.Tensor], repeats: int = 5) -> float:
    """`F.linear` through the expert's two products (gate+up [2I, H], down [H, I]) on the same views."""
    gate_up, down = views["gate_up_proj"], views["down_proj"]
    inter = down.shape[1]
    x = torch.randn(1, gate_up.shape[1], dtype=gate_up.dtype)
    times = []
    for _ in range(repeats + 1):  # the first warms up
        start = time.perf_counter()
        h = F.linear(x, gate_up)
        F.linear(F.silu(h[:, :inter]) * h[:, inter:], down)
        times.append((time.perf_counter() - start) * 1e3)
    return sorted(times[1:])[repeats // 2]


def measure(key: str, dtype: torch.dtype, workdir: Path) -> dict:
    shape = replace(SHAPES[key], num_layers=SHAPES[key].dense_layers + 1)  # one MoE layer
    folder = write_checkpoint(shape, workdir / f"{key}-{dtype}", dtype, torch.device("cpu"))
    engine = Engine.load(EngineConfig(model=str(folder), device="cpu", dtype=str(dtype).removeprefix("torch."),
                                      expert_cache_experts=1, prefetch=False))  # fmt: skip
    try:
        experts = engine.loaded.offloaded[0]
        with engine.loaded.host.hold(next(iter(engine.loaded.host.sources))) as buffer:
            engine_ms = experts.measure_host_ms(buffer)
            ref_ms = reference_ms(experts.layout.views(buffer))
    finally:
        engine.close()
    return {"shape": key, "dtype": str(dtype).removeprefix("torch."), "threads": torch.get_num_threads(),
            "expert_mb": shape.expert_bytes(dtype) / 1e6, "engine_ms": round(engine_ms, 2),
            "f_linear_ms": round(ref_ms, 2), "engine_over_f_linear": round(engine_ms / ref_ms, 2)}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default="mixtral,deepseek")
    parser.add_argument("--dtypes", default="bfloat16,float32")
    parser.add_argument("--threads", type=int, default=host_compute_threads(), help="intra-op threads "
                        "(default: the engine's choice for the host executor, all cores but one)")  # fmt: skip
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        for key in args.shapes.split(","):
            for name in args.dtypes.split(","):
                print(json.dumps(measure(key, getattr(torch, name), Path(tmp))), flush=True)


if __name__ == "__main__":
    main()
