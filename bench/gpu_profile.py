"""Where a decode token's time goes on the device, for the rows of the GPU table no model explains.

    python -m bench.gpu_profile [--shape deepseek] [--fraction 0.25] [--tokens 16] [--out FILE]
    python -m bench.gpu_profile --dry-run      # on CPU with tiny shapes (a test of the script)

On the H200 (2026-12-04, two runs) `lru` + prefetch took 1.13-1.19x the time of `lru` alone on the
DeepSeek-V2-Lite shape at 96 of 384 experts while it moved the same bytes (its gate held every guess
back), and all resident the engine took 1.16x transformers' time. Neither the timed replay nor a CPU
profile shows where: the prefetcher's Python costs ~50 us per MoE layer on a CPU (0.3 ms a token).
This profiles one greedy request per variant with `torch.profiler`, from its first token to its last,
and reports per decode token: host syncs, host-device copies, kernel launches, aten ops, and the ops
with the most host time and the most device time. Variants, in one process, one after another:
transformers all on the device, moe-serve all resident, and at `--fraction` of the experts `lru`
without and with prefetch and `sparsity-aware` with prefetch (`--cpu-experts off`: every miss copied).

Prints a JSON line per variant, then a Markdown summary (`--out FILE` appends it to FILE).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from bench.engine_bench import PROMPT, TokenClock
from bench.gpu_scale import Variant, _prompt, capacity_of, dtype_name
from bench.scale_models import SHAPES, ModelShape, tiny, write_checkpoint
from engine.api import GenerationRequest, SamplingParams
from engine.config import EngineConfig
from engine.engine import Engine

SYNCS = {"cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "aten::_local_scalar_dense"}
COPIES = {"cudaMemcpyAsync", "cudaMemcpy"}
LAUNCHES = {"cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernelEx"}
TOP_OPS = 10


def variants(fraction: float) -> list[Variant]:
    """`bench.gpu_scale`'s rows of the same names (every miss copied: `--cpu-experts off`)."""
    cached = [("lru", False), ("lru", True), ("sparsity-aware", True)]
    return [Variant("transformers"), Variant("moe-serve", 1.0, cpu_experts="off"),
            *(Variant("moe-serve", fraction, policy, prefetch, cpu_experts="off") for policy, prefetch in cached)]  # fmt: skip


@dataclass
class Profiled:
    """One request's decode steps under the profiler."""

    prof: profile
    steps: int
    tpot_ms: float


def _activities(device: torch.device) -> list[ProfilerActivity]:
    return [ProfilerActivity.CPU, ProfilerActivity.CUDA] if device.type == "cuda" else [ProfilerActivity.CPU]


def profile_engine(folder: Path, shape: ModelShape, variant: Variant, device: torch.device, dtype: torch.dtype,
                   tokens: int, workdir: Path) -> Profiled:  # fmt: skip
    capacity = capacity_of(shape, variant)
    engine = Engine.load(EngineConfig(
        model=str(folder), device=str(device), dtype=dtype_name(dtype), policy=variant.policy,
        prefetch=variant.prefetch, expert_cache_experts=capacity, cpu_experts=variant.cpu_experts, prefix_cache=0,
        eamc_path=str(workdir / f"{variant.policy}-{capacity}.eamc"),
    ))  # fmt: skip
    try:
        prompt = engine.encode(PROMPT)
        params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
        for _ in engine.generate(GenerationRequest("warm-up", prompt, params)):
            pass
        prof = profile(activities=_activities(device))
        steps = -1
        for _ in engine.generate(GenerationRequest("profiled", prompt, params)):
            if steps < 0:
                prof.start()  # at the first token: the prefill is not profiled
            steps += 1
        prof.stop()
        times = engine.last_times
        return Profiled(prof, steps, 1000 * (times.end - times.first_token) / (times.tokens - 1))
    finally:
        engine.close()


class _ProfileFromFirstToken(TokenClock):
    """`TokenClock` (marks[0]: the prompt, then one per new token) that starts the profiler at the first token."""

    def __init__(self, prof: profile) -> None:
        super().__init__()
        self.prof = prof

    def put(self, value) -> None:
        super().put(value)
        if len(self.marks) == 2:
            self.prof.start()


def profile_transformers(folder: Path, device: torch.device, dtype: torch.dtype, tokens: int) -> Profiled:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).to(device).eval()
    ids = torch.tensor([_prompt(folder)], device=device)
    kwargs = dict(attention_mask=torch.ones_like(ids), do_sample=False, eos_token_id=None, pad_token_id=0)
    with torch.inference_mode():
        model.generate(ids, max_new_tokens=4, **kwargs)  # warm-up
        prof = profile(activities=_activities(device))
        streamer = _ProfileFromFirstToken(prof)
        model.generate(ids, max_new_tokens=tokens, streamer=streamer, **kwargs)
        prof.stop()
    first, last = streamer.marks[1], streamer.marks[-1]
    steps = len(streamer.marks) - 2  # decode steps after the first token
    return Profiled(prof, steps, 1000 * (last - first) / steps)


def _device_us(event) -> float:
    """An averaged event's own time on the device, in µs (the attribute's name moved across torch versions)."""
    for name in ("self_device_time_total", "self_cuda_time_total"):
        if hasattr(event, name):
            return float(getattr(event, name))
    return 0.0


def summarize(profiled: Profiled) -> dict:
    return {"tpot_ms": round(profiled.tpot_ms, 3), "steps": profiled.steps,
            **per_token(profiled.prof.key_averages(), profiled.steps)}  # fmt: skip


def per_token(events, steps: int) -> dict:
    """Per decode token, from the profiler's averaged events: counts of syncs, copies, launches and aten
    ops, and the ops with the most host and device time ([op, ms per token, calls per token])."""
    steps = max(1, steps)

    def count(names: set[str]) -> float:
        return round(sum(e.count for e in events if e.key in names) / steps, 2)

    def top(cost) -> list[list]:
        ranked = sorted((e for e in events if cost(e) > 0), key=cost, reverse=True)[:TOP_OPS]
        return [[e.key, round(cost(e) / 1000 / steps, 4), round(e.count / steps, 2)] for e in ranked]

    return {
        "syncs_per_token": count(SYNCS), "copies_per_token": count(COPIES), "launches_per_token": count(LAUNCHES),
        "aten_ops_per_token": round(sum(e.count for e in events if e.key.startswith("aten::")) / steps, 1),
        "top_host": top(lambda e: e.self_cpu_time_total), "top_device": top(_device_us),
    }  # fmt: skip


def markdown(env: dict, rows: list[dict]) -> str:
    lines = [f"#### `python -m bench.gpu_profile {' '.join(env['argv'])}` — {env['date']}, {env['device_name']}", "",
             f"{env['shape']}; cache rows at {env['fraction']:g} of the experts; per decode token, one request of "
             f"{env['tokens']} greedy tokens under `torch.profiler` (which slows the host side: compare rows).", "",
             "| variant | TPOT ms | syncs | copies | launches | aten ops |", "|---|---|---|---|---|---|"]  # fmt: skip
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['variant']} | failed: {r['error']} | | | | |")
            continue
        lines.append(f"| {r['variant']} | {r['tpot_ms']:.2f} | {r['syncs_per_token']:g} | {r['copies_per_token']:g} "
                     f"| {r['launches_per_token']:g} | {r['aten_ops_per_token']:g} |")
    for r in rows:
        for side in ("top_host", "top_device"):
            if r.get(side):
                ops = "; ".join(f"`{name}` {ms:.3f} ms ({calls:g}×)" for name, ms, calls in r[side])
                lines += ["", f"- {r['variant']}, most {side.removeprefix('top_')} time per token: {ops}"]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dry-run", action="store_true", help="on CPU with tiny shapes (needs no GPU)")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="deepseek")
    parser.add_argument("--fraction", type=float, default=0.25, help="share of the experts in the cache rows' cache")
    parser.add_argument("--tokens", type=int, default=16, help="greedy tokens of the profiled request")
    parser.add_argument("--workdir", help="where the checkpoint is written (default: the system's temp folder)")
    parser.add_argument("--out", help="append the Markdown summary to this file")
    args = parser.parse_args(argv)
    if not args.dry_run and not torch.cuda.is_available():
        print("error: bench.gpu_profile needs a CUDA device (use --dry-run to run it on CPU)", file=sys.stderr)
        return 2
    device = torch.device("cpu" if args.dry_run else "cuda")
    threads = torch.get_num_threads()
    if args.dry_run:
        torch.set_num_threads(1)  # tiny matrices gain nothing from threads, and a busy CPU makes them wait
    try:
        return run(args, argv, device)
    finally:
        torch.set_num_threads(threads)


def run(args: argparse.Namespace, argv: list[str], device: torch.device) -> int:
    dtype = torch.float32 if args.dry_run else torch.bfloat16
    shape = tiny(SHAPES[args.shape]) if args.dry_run else SHAPES[args.shape]
    env = {"kind": "env", "argv": argv, "date": time.strftime("%Y-%m-%d"), "shape": shape.name,
           "fraction": args.fraction, "tokens": args.tokens, "torch": torch.__version__,
           "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU (dry run)"}  # fmt: skip
    print(json.dumps(env), flush=True)
    rows = []
    with tempfile.TemporaryDirectory(dir=args.workdir) as tmp:
        folder = write_checkpoint(shape, Path(tmp) / args.shape, dtype, device)
        for variant in variants(args.fraction):
            row = {"kind": "row", "variant": variant.label()}
            try:
                if variant.kind == "transformers":
                    profiled = profile_transformers(folder, device, dtype, args.tokens)
                else:
                    profiled = profile_engine(folder, shape, variant, device, dtype, args.tokens, Path(tmp))
                row.update(summarize(profiled))
            except Exception as e:  # one broken variant must not cost the others on a lent machine
                traceback.print_exc()
                row["error"] = f"{type(e).__name__}: {e}"
            print(json.dumps(row), flush=True)
            rows.append(row)
            if device.type == "cuda":
                torch.cuda.empty_cache()
    text = markdown(env, rows)
    print(text, end="")
    if args.out:
        with open(args.out, "a", encoding="utf-8") as f:
            f.write("\n" + text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
