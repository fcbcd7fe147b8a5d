"""The prepared GPU benchmark (issue 10 D): real expert sizes, every variant side by side in one run.

    python -m bench.gpu_scale [--out bench/RESULTS.md]      # the full table, under 6 minutes on an H200
    python -m bench.gpu_scale --quick                       # a 1-minute subset (DeepSeek-V2-Lite shape, 4 rows)
    python -m bench.gpu_scale --dry-run                     # the whole script on CPU with tiny shapes (a test)

1. builds random-weight checkpoints with Mixtral-8x7B and DeepSeek-V2-Lite expert sizes,
   truncated to a few layers, on local disk (`bench.scale_models`; no network, no tokenizer package);
2. measures the host→device copy rate, pinned, in 1 GiB copies and at each shape's expert size;
3. per shape, one row per variant: transformers with everything on the GPU; transformers +
   accelerate `device_map="auto"` with a GPU budget of the dense weights plus a quarter of the
   experts (the 1/4 cache rows' footprint); moe-serve with all experts resident, then at 1/16,
   1/4 and 1/2 of the experts with `lru` and `sparsity-aware`, prefetch off and on (each with
   the engine's default `--cpu-experts auto`: misses may be computed on the host cores); at 1/4
   also `lru` without prefetch and `--cpu-experts off` (every miss copied: issue 13's demand-only
   baseline), and the same with `--expert-dtype int8 | int4 | int4-mixed` (issue 14's ratios).
   TPOT and TTFT: medians over `--rounds` requests of `--tokens` greedy tokens after a warm-up.
   Hit rate and GB moved per token count the decode steps only (the prefill is excluded);
4. next to every moe-serve row, the timed replay's prediction (`cache.replay --timed`) for the
   routing that row recorded (`record_trace`), with the row's policy, cache size and prefetch,
   the measured copy rate, the row's bytes per expert, the host executor's measured rate when
   the engine turned it on (`--cpu-gbps`), per-layer compute from the all-resident row and
   the look-ahead accuracy the engine measured; the command that reproduces it is in the JSON.

Prints one JSON object per line (kinds: env, plan, link, build, row, skipped, failed), then the Markdown
table and the issues' targets judged from its rows (`bench.gpu_targets`); `--out FILE` appends both
to FILE. Rows that would end past `--budget-s` are skipped (and say so), so a run never overstays
its lease. The accelerate rows generate fewer tokens
(`--accelerate-tokens`): they take seconds per token.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import shlex
import statistics
import sys
import tempfile
import time
import traceback
from collections import Counter
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from bench.engine_bench import PROMPT, engine_run, transformers_tpot
from bench.gpu_targets import merge_repeats
from bench.gpu_targets import section as targets_section
from bench.scale_models import SHAPES, ModelShape, tiny, write_checkpoint
from cache.quant import QUANT_DTYPES
from cache.replay import replay
from cache.timed import LinkSpec
from cache.trace import load_trace
from engine.config import EngineConfig
from engine.engine import Engine

GIB = 1 << 30
FULL_BUDGET_S = 330.0  # under 6 minutes with the interpreter's start and the table
QUICK_BUDGET_S = 60.0
DEFAULT_LOOKAHEAD_ACCURACY = 0.67  # random routers on the H200 (bench/cuda_check.py), if the engine measured none
FRACTIONS = (1 / 4, 1 / 16, 1 / 2)  # the headline point first, in case the budget cuts the tail


@dataclass(frozen=True)
class Variant:
    kind: str  # "transformers" | "accelerate" | "moe-serve"
    fraction: float = 1.0  # moe-serve: share of all experts in the device cache
    policy: str = "lru"
    prefetch: bool = False
    cpu_experts: str = "auto"  # the engine's --cpu-experts ("off": every miss copied, the demand-only baseline)
    expert_dtype: str = "auto"  # the engine's --expert-dtype

    def label(self) -> str:
        if self.kind == "transformers":
            return "transformers, all on the GPU"
        if self.kind == "accelerate":
            return 'transformers + accelerate `device_map="auto"`'
        if self.fraction >= 1:
            return "moe-serve engine, all experts resident"
        default = self.policy == "sparsity-aware" and self.prefetch and self.cpu_experts == "auto"
        flags = "".join(f", --{flag} {value}" for flag, value, usual in (
            ("cpu-experts", self.cpu_experts, "auto"), ("expert-dtype", self.expert_dtype, "auto")) if value != usual)
        return (f"moe-serve, {self.policy}{' + prefetch' if self.prefetch else ', no prefetch'}{flags}"
                f"{' (the default)' if default and not flags else ''}")


@dataclass(frozen=True)
class Settings:
    device: torch.device
    dtype: torch.dtype
    rounds: int
    tokens: int
    warmup_tokens: int
    accelerate_tokens: int
    workdir: Path


def plan(quick: bool) -> list[Variant]:
    """The rows of one shape, in the order they run."""
    if quick:
        return [Variant("transformers"), Variant("moe-serve"), Variant("moe-serve", 1 / 4),
                Variant("moe-serve", 1 / 4, "sparsity-aware", True)]  # fmt: skip
    cached = []
    for f in FRACTIONS:
        cached += [Variant("moe-serve", f, policy, prefetch) for policy in ("lru", "sparsity-aware") for prefetch in (False, True)]
        if f == FRACTIONS[0]:
            cached += headline_comparisons(f)
    return [Variant("transformers"), Variant("moe-serve"), *cached, Variant("accelerate")]


def headline_comparisons(fraction: float) -> list[Variant]:
    """At the headline cache size, lru without prefetch, every miss copied (the demand-only baseline of
    issue 13's target), and the same with quantized experts (issue 14: TPOT against that baseline)."""
    baseline = Variant("moe-serve", fraction, "lru", False, cpu_experts="off")
    return [baseline, *(replace(baseline, expert_dtype=dtype) for dtype in QUANT_DTYPES)]


def capacity_of(shape: ModelShape, variant: Variant) -> int:
    return max(shape.top_k, round(variant.fraction * shape.total_experts))


# -- the link ---------------------------------------------------------------------------


def copy_gbps(num_bytes: int, device: torch.device, repeats: int = 5) -> float:
    """Host→device copy rate (pinned on CUDA): median over `repeats` timings of back-to-back copies."""
    cuda = device.type == "cuda"
    src = torch.empty(num_bytes, dtype=torch.uint8, pin_memory=cuda)
    dst = torch.empty(num_bytes, dtype=torch.uint8, device=device)
    copies = max(1, min(20, GIB // num_bytes))  # ~1 GiB per timing, so a sync's cost does not count
    dst.copy_(src, non_blocking=cuda)  # warm-up
    _sync(device)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(copies):
            dst.copy_(src, non_blocking=cuda)
        _sync(device)
        times.append((time.perf_counter() - start) / copies)
    return num_bytes / statistics.median(times) / 1e9


def measure_link(shapes: dict[str, ModelShape], settings: Settings, big_bytes: int) -> dict:
    """GB/s for `big_bytes` copies and for one expert of each shape."""
    rates = {"big": {"bytes": big_bytes, "gbps": copy_gbps(big_bytes, settings.device)}}
    for key, shape in shapes.items():
        size = shape.expert_bytes(settings.dtype)
        rates[key] = {"bytes": size, "gbps": copy_gbps(size, settings.device)}
    return rates


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# -- the rows ---------------------------------------------------------------------------


def run_transformers(folder: Path, variant: Variant, shape: ModelShape, settings: Settings) -> dict:
    """transformers `generate`, all on the device or offloaded by accelerate at a similar budget."""
    kwargs: dict = {"dtype": settings.dtype, "device_map": str(settings.device)}
    tokens, rounds, extra = settings.tokens, settings.rounds, {}
    if variant.kind == "accelerate":
        budget = accelerate_budget(folder, shape, settings.dtype)
        kwargs.update(device_map="auto", max_memory=_max_memory(settings.device, budget),
                      offload_folder=str(settings.workdir / "offload"))  # fmt: skip
        tokens, rounds = settings.accelerate_tokens, 1
        extra["gpu_budget_bytes"] = budget
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, **kwargs).eval()
    if variant.kind == "accelerate":
        extra["placement"] = placement(getattr(model, "hf_device_map", {}), shape.num_layers)
    prompt = _prompt(folder)
    transformers_tpot(model, prompt, 2, settings.device)  # warm-up
    samples = [transformers_tpot(model, prompt, tokens, settings.device) for _ in range(rounds)]
    del model
    return {**_medians(samples), "tokens": tokens, "rounds": rounds, **extra}


def accelerate_budget(folder: Path, shape: ModelShape, dtype: torch.dtype) -> int:
    """GPU bytes of the 1/4 cache rows: every dense weight plus a quarter of the experts."""
    checkpoint = checkpoint_bytes(folder)
    experts = shape.total_experts * shape.expert_bytes(dtype)
    return checkpoint - experts + experts // 4


def checkpoint_bytes(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.glob("*.safetensors"))


def _max_memory(device: torch.device, budget: int) -> dict:
    if device.type == "cuda":
        return {device.index or 0: budget, "cpu": 512 * GIB}
    return {"cpu": budget}  # dry run: what does not fit goes to disk (offload_folder)


def placement(device_map: dict, num_layers: int) -> dict[str, int]:
    """Decoder layers per place (a GPU index, "cpu", "disk") in accelerate's device map, whose keys
    name a layer, all layers (`model.layers`) or the whole model (``)."""
    counts: Counter[str] = Counter()
    for i in range(num_layers):
        layer = f"model.layers.{i}"
        owners = [key for key in device_map if key in ("", layer) or layer.startswith(key + ".")]
        if owners:
            counts[str(device_map[max(owners, key=len)])] += 1
    return dict(counts)


def run_engine(folder: Path, variant: Variant, shape: ModelShape, settings: Settings, slug: str) -> dict:
    capacity = capacity_of(shape, variant)
    trace = settings.workdir / f"{slug}.trace.jsonl"
    started = time.perf_counter()
    engine = Engine.load(EngineConfig(
        model=str(folder), device=str(settings.device), dtype=dtype_name(settings.dtype),
        policy=variant.policy, prefetch=variant.prefetch, expert_cache_experts=capacity,
        cpu_experts=variant.cpu_experts, expert_dtype=variant.expert_dtype,
        eamc_path=str(settings.workdir / f"{slug}.eamc"), record_trace=str(trace),
        prefix_cache=0,  # each round's prompt is the same: its prefill, and its experts, are measured every round
    ))  # fmt: skip
    load_s = time.perf_counter() - started
    try:
        prompt = engine.encode(PROMPT)
        engine_run(engine, prompt, settings.warmup_tokens)
        runs = [engine_run(engine, prompt, settings.tokens) for _ in range(settings.rounds)]
        info = engine.cache_info()
    finally:
        engine.close()
    del engine
    total = Counter()
    for run in runs:
        total.update(run.decode_counters)
    steps = sum(run.decode_steps for run in runs)
    accesses = total["hits"] + total["misses"]
    return {
        **_medians([(run.ttft_s, run.tpot_s) for run in runs]),
        "capacity": capacity, "cache": f"{capacity}/{shape.total_experts}", "load_s": round(load_s, 2),
        "hit_rate": round(total["hits"] / accesses, 4) if accesses else None,
        "gb_per_token": round(total["bytes_transferred"] / steps / 1e9, 4),
        "prefetches_per_token": round(total["prefetches"] / steps, 3),
        # what became of them (issue 10: on the H200 most of the default's prefetches went unused)
        "prefetch_used_per_token": round(total["prefetch_used"] / steps, 3),
        "prefetch_regrets_per_token": round(total["prefetch_regrets"] / steps, 3),
        "prefetch_gate": info["prefetch_gate"],
        "lookahead_accuracy": info["lookahead_accuracy"], "trace": str(trace), "tokens": settings.tokens,
        "rounds": settings.rounds, "expert_dtype": info["expert_dtype"], "bytes_per_expert": info["bytes_per_expert"],
        "cpu_experts": info["cpu_experts"],
    }  # fmt: skip


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _prompt(folder: Path) -> list[int]:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(folder)(PROMPT)["input_ids"]


def _medians(samples: list[tuple[float, float]]) -> dict:
    return {"ttft_ms": round(1000 * statistics.median(s[0] for s in samples), 3),
            "tpot_ms": round(1000 * statistics.median(s[1] for s in samples), 3)}  # fmt: skip


# -- the timed replay's prediction -------------------------------------------------------


def predict(row: dict, variant: Variant, shape: ModelShape, link_gbps: float, resident_tpot_ms: float,
            dtype: torch.dtype) -> dict:  # fmt: skip
    """The timed replay of the routing this row recorded, with this row's cache and the measured link."""
    cpu = row["cpu_experts"]
    expert_bytes = row["bytes_per_expert"]  # the row's own: quantized experts move fewer
    cpu_gbps = expert_bytes / (cpu["cpu_ms_per_expert"] * 1e6) if cpu["enabled"] else 0.0
    spec = LinkSpec(expert_bytes=expert_bytes, link_gbps=link_gbps, compute_ms=resident_tpot_ms / shape.moe_layers,
                    cpu_gbps=cpu_gbps, share_misses=bool(cpu["shares_misses"]))  # fmt: skip
    lookahead = None
    if variant.prefetch:
        lookahead = row["lookahead_accuracy"] if row["lookahead_accuracy"] is not None else DEFAULT_LOOKAHEAD_ACCURACY
    header, requests = load_trace(row["trace"])
    # with prefetch the gate learns a layer's compute from the clock, as the engine does on CUDA
    result = replay(header, requests, variant.policy, row["capacity"], variant.prefetch, spec, lookahead,
                    learn_overlap=variant.prefetch)
    command = ["python", "-m", "cache.replay", row["trace"], "--policy", variant.policy,
               "--capacity", str(row["capacity"]), "--timed", "--expert-mb", f"{spec.expert_bytes / 1e6:g}",
               "--link-gbps", f"{link_gbps:.2f}", "--compute-ms", f"{spec.compute_ms:.4f}"]  # fmt: skip
    if variant.prefetch:
        command += ["--prefetch", "--lookahead-accuracy", f"{lookahead:.3f}", "--learn-overlap"]
    if cpu_gbps:
        command += ["--cpu-gbps", f"{cpu_gbps:.2f}", *([] if spec.share_misses else ["--no-share-misses"])]
    return {
        "replay_tpot_ms": result["tpot_ms"],
        "replay_error": round(result["tpot_ms"] / row["tpot_ms"] - 1, 4),
        "replay_gb_per_token": result["link_gb_per_decode_token"],
        "replay_hit_rate": round(1 - result["decode_miss_rate"], 4),
        "replay_command": shlex.join(command),
    }


# -- the run ----------------------------------------------------------------------------


class Budget:
    """Skips a row when it would end past the deadline, judged by the last row of its kind."""

    FIRST_ROW_S = {"transformers": 15.0, "moe-serve": 10.0, "accelerate": 45.0}  # H200 guesses, before any row

    def __init__(self, seconds: float | None) -> None:
        self.start = time.perf_counter()
        self.seconds = seconds
        self.last: dict[tuple[str, str], float] = {}  # (shape, kind) → seconds the last such row took

    def allows(self, shape_key: str, kind: str) -> bool:
        if self.seconds is None:
            return True
        expected = self.last.get((shape_key, kind), self.FIRST_ROW_S[kind])
        return time.perf_counter() - self.start + expected <= self.seconds

    def record(self, shape_key: str, kind: str, seconds: float) -> None:
        self.last[(shape_key, kind)] = seconds


def emit(obj: dict) -> None:
    print(json.dumps(obj), flush=True)


def build(key: str, shape: ModelShape, settings: Settings) -> Path | None:
    """The shape's checkpoint on disk; None (said in a `failed` line) when it cannot be written."""
    started = time.perf_counter()
    try:
        folder = write_checkpoint(shape, settings.workdir / key, settings.dtype, settings.device)
    except Exception as e:  # its rows fail; the other shape's still run
        traceback.print_exc()
        emit({"kind": "failed", "shape": key, "step": "build", "reason": f"{type(e).__name__}: {e}"})
        return None
    emit({"kind": "build", "shape": key, "name": shape.name, "seconds": round(time.perf_counter() - started, 2),
          "checkpoint_gb": round(checkpoint_bytes(folder) / 1e9, 3),
          "expert_mb": shape.expert_bytes(settings.dtype) / 1e6})  # fmt: skip
    _free(settings.device)
    return folder


def schedule(shapes: dict[str, ModelShape], variants: list[Variant], repeats: int = 1) -> list[tuple[str, int, Variant]]:
    """Group by group in plan order (transformers, all-resident, each cache size, accelerate), both
    shapes in each group: when the budget cuts the tail, it cuts the least needed rows of both.
    `repeats`: each group's rows run that many times in turn (ABC ABC), so that the rows a target
    compares are measured side by side, and a slow spell of the machine falls on all of them."""
    groups = list(dict.fromkeys((v.kind, v.fraction) for v in variants))
    keys = list(shapes)
    jobs = [(key, n, v, r) for key in shapes for n, v in enumerate(variants) for r in range(repeats)]
    ordered = sorted(jobs, key=lambda job: (groups.index((job[2].kind, job[2].fraction)), job[3], keys.index(job[0]), job[1]))
    return [(key, n, v) for key, n, v, _ in ordered]


def run_all(shapes: dict[str, ModelShape], variants: list[Variant], settings: Settings, link: dict,
            budget: Budget, repeats: int = 1) -> list[dict]:  # fmt: skip
    """Every row's JSON line as it is measured; returned merged, one per variant (`merge_repeats`)."""
    folders = {key: build(key, shape, settings) for key, shape in shapes.items()}
    resident_tpot_ms: dict[str, list[float]] = {}  # per shape, its all-resident runs (they all run before the rest)
    rows = []
    runs_of = Counter()
    for key, n, variant in schedule(shapes, variants, repeats):
        runs_of[key, n] += 1
        shape = shapes[key]
        row = {"kind": "row", "shape": key, "runner": variant.kind, "variant": variant.label(), "policy": variant.policy,
               "prefetch": variant.prefetch, "fraction": variant.fraction if variant.kind == "moe-serve" else None}  # fmt: skip
        if variant.kind == "moe-serve":
            row["cache"] = f"{capacity_of(shape, variant)}/{shape.total_experts}"
            row["variant_cpu_experts"], row["variant_expert_dtype"] = variant.cpu_experts, variant.expert_dtype
        if folders[key] is None:
            row.update(kind="failed", reason="no checkpoint (its build failed)")
        elif not budget.allows(key, variant.kind):
            row.update(kind="skipped", reason=f"would end past the {budget.seconds:.0f} s budget")
        else:
            started = time.perf_counter()
            row.update(measure_row(folders[key], key, n, variant, shape, settings, f"{key}-{n}-{runs_of[key, n]}"))
            if row["kind"] == "row" and variant.kind == "moe-serve":
                if variant.fraction >= 1:
                    resident_tpot_ms.setdefault(key, []).append(row["tpot_ms"])
                if key in resident_tpot_ms:
                    resident = statistics.median_low(resident_tpot_ms[key])
                    row.update(predict_row(row, variant, shape, link[key]["gbps"], resident, settings.dtype))
            row["seconds"] = round(time.perf_counter() - started, 2)
            budget.record(key, variant.kind, row["seconds"])
            if settings.device.type == "cuda":
                row["gpu_allocated_gib_after"] = round(torch.cuda.memory_allocated(settings.device) / GIB, 3)
        emit(row)
        rows.append(row)
    return merge_repeats(rows)


def measure_row(folder: Path, key: str, n: int, variant: Variant, shape: ModelShape, settings: Settings,
                slug: str) -> dict:  # fmt: skip
    """The row's measurements, or why it failed: one broken row must not cost the others on a lent machine."""
    try:
        return run_row(folder, variant, shape, settings, slug)
    except Exception as e:
        traceback.print_exc()
        return {"kind": "failed", "reason": f"{type(e).__name__}: {e}"}
    finally:
        _free(settings.device)


def predict_row(row: dict, variant: Variant, shape: ModelShape, link_gbps: float, resident_tpot_ms: float,
                dtype: torch.dtype) -> dict:  # fmt: skip
    try:
        return predict(row, variant, shape, link_gbps, resident_tpot_ms, dtype)
    except Exception as e:  # the measurement stands without its prediction
        traceback.print_exc()
        return {"replay_failed": f"{type(e).__name__}: {e}"}


def run_row(folder: Path, variant: Variant, shape: ModelShape, settings: Settings, slug: str) -> dict:
    if variant.kind == "moe-serve":
        return run_engine(folder, variant, shape, settings, slug)
    return run_transformers(folder, variant, shape, settings)


def _free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


# -- the table --------------------------------------------------------------------------


def table(env: dict, link: dict, shapes: dict[str, ModelShape], rows: list[dict], dtype: torch.dtype) -> str:
    what = "CPU, tiny shapes: a test of the script, not a measurement" if env["dry_run"] else env["device_name"]
    lines = [f"### `{env['command']}` — {env['date']}, {what}", "",
             f"torch {env['torch']}, transformers {env['transformers']}, accelerate {env['accelerate']}; "
             f"{env['rounds']} × {env['tokens']} greedy tokens per row after a warm-up, medians; "
             + (f"each row run {env['repeats']} times in turn, its median TPOT (range); "
                if env.get("repeats", 1) > 1 else "") +
             "hit rate and GB per token over the decode steps; replay: `cache.replay --timed` on the row's "
             "own routing trace (error = replay / measured − 1).", "",
             "| copy | GB/s |", "|---|---|"]  # fmt: skip
    copy = "host → device, pinned" if env["device"] == "cuda" else "host → host (dry run)"
    lines.append(f"| {copy}, {_size(link['big']['bytes'])} | {link['big']['gbps']:.1f} |")
    for key in shapes:
        lines.append(f"| {copy}, one {key} expert ({_size(link[key]['bytes'])}) | {link[key]['gbps']:.1f} |")
    for key, shape in shapes.items():
        lines += ["", f"**{shape.name}**: {shape.num_experts} experts × {shape.moe_layers} MoE layers, "
                  f"top-{shape.top_k}, {_size(shape.expert_bytes(dtype))} per expert ({dtype_name(dtype)})", "",
                  "| variant | device cache | TPOT ms | TTFT ms | hit rate | GB moved per token "
                  "| replay TPOT ms | replay error |", "|---|---|---|---|---|---|---|---|"]  # fmt: skip
        lines += [_table_row(row) for row in sorted(rows, key=_table_order) if row["shape"] == key]
    return "\n".join(lines) + "\n"


def _table_order(row: dict) -> tuple:
    """transformers, accelerate, then moe-serve all-resident and by growing cache (rows run in another order)."""
    runner = ("transformers", "accelerate", "moe-serve").index(row["runner"])
    fraction = row["fraction"] or 0.0
    return runner, fraction < 1, fraction, row["policy"], row["prefetch"], row["variant"]


def _table_row(row: dict) -> str:
    variant = row["variant"]
    if "gpu_budget_bytes" in row:
        variant += f", {_size(row['gpu_budget_bytes'])} GPU budget (layers: {_placement_text(row['placement'])})"
    if row["kind"] != "row":  # skipped or failed
        return f"| {variant} | {row.get('cache', '—')} | {row['kind']}: {row['reason']} | | | | | |"
    tpot = f"{row['tpot_ms']:.2f}"
    if "tpot_ms_runs" in row:  # the median of the runs, and their range
        tpot += f" ({min(row['tpot_ms_runs']):.2f}-{max(row['tpot_ms_runs']):.2f})"
    cells = [variant, row.get("cache", "—"), tpot, f"{row['ttft_ms']:.1f}",
             _num(row.get("hit_rate"), ".2f"), _num(row.get("gb_per_token"), ".3f"),
             _num(row.get("replay_tpot_ms"), ".2f"), _num(row.get("replay_error"), "+.1%")]  # fmt: skip
    return "| " + " | ".join(cells) + " |"


def _placement_text(placement: dict) -> str:
    return ", ".join(f"{n} on {'GPU ' + where if where.isdigit() else where}" for where, n in placement.items())


def _num(value, fmt: str) -> str:
    return "—" if value is None else format(value, fmt)


def _size(num_bytes: int) -> str:
    if num_bytes >= GIB:
        return f"{num_bytes / GIB:.3g} GiB"
    return f"{num_bytes / 1e6:.3g} MB" if num_bytes >= 1e6 else f"{num_bytes / 1e3:.3g} kB"


# -- CLI --------------------------------------------------------------------------------


def environment(args: argparse.Namespace, argv: list[str], device: torch.device) -> dict:
    import accelerate
    import transformers

    return {
        "kind": "env", "date": datetime.date.today().isoformat(), "device": device.type,
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__, "transformers": transformers.__version__, "accelerate": accelerate.__version__,
        "dry_run": args.dry_run, "quick": args.quick, "rounds": args.rounds, "tokens": args.tokens, "repeats": args.repeats,
        "budget_s": args.budget_s, "command": shlex.join(["python", "-m", "bench.gpu_scale", *argv]),
    }  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = _parser()
    args = parser.parse_args(argv)
    unknown = set((args.shapes or "").split(",")) - set(SHAPES) - {""}
    if unknown:
        parser.error(f"--shapes: unknown {', '.join(sorted(unknown))}; choose from {', '.join(SHAPES)}")
    if not args.dry_run and not torch.cuda.is_available():
        print("error: bench.gpu_scale needs a CUDA device, and torch.cuda.is_available() is False "
              "(use --dry-run to run the script on CPU with tiny shapes)", file=sys.stderr)  # fmt: skip
        return 2
    _defaults(args)
    device = torch.device("cpu" if args.dry_run else "cuda")
    if args.dry_run:
        torch.set_num_threads(1)  # tiny matrices gain nothing from threads, and a busy CPU makes them wait
    dtype = torch.float32 if args.dry_run else torch.bfloat16
    shapes = {key: tiny(SHAPES[key]) if args.dry_run else SHAPES[key] for key in args.shapes.split(",")}
    variants = plan(args.quick)
    env = environment(args, argv, device)
    emit(env)
    emit({"kind": "plan", "shapes": list(shapes), "rows": [v.label() for v in variants]})
    budget = Budget(args.budget_s)
    with tempfile.TemporaryDirectory(dir=args.workdir) as tmp:
        os.environ["MOE_SERVE_STATE_DIR"] = str(Path(tmp) / "state")  # quantized experts: with the checkpoints
        settings = Settings(device, dtype, args.rounds, args.tokens, args.warmup_tokens, args.accelerate_tokens,
                            Path(tmp))  # fmt: skip
        link = measure_link(shapes, settings, GIB if device.type == "cuda" else 64 << 20)
        emit({"kind": "link", **link})
        rows = run_all(shapes, variants, settings, link, budget, args.repeats)
    text = table(env, link, shapes, rows, dtype) + targets_section(rows)
    print(text, end="")
    if args.out:
        with open(args.out, "a", encoding="utf-8") as f:
            f.write("\n" + text)
    return 0


def _defaults(args: argparse.Namespace) -> None:
    """Quick and dry runs are smaller; a flag given on the command line wins."""
    if args.shapes is None:
        args.shapes = "deepseek" if args.quick and not args.dry_run else ",".join(SHAPES)
    if args.rounds is None:
        args.rounds = 2 if args.dry_run else 1 if args.quick else 3
    if args.tokens is None:
        args.tokens = 4 if args.dry_run else 32
    if args.warmup_tokens is None:
        args.warmup_tokens = 2 if args.dry_run else 4
    if args.accelerate_tokens is None:
        args.accelerate_tokens = 3 if args.dry_run else 5
    if args.budget_s is None and not args.dry_run:
        args.budget_s = QUICK_BUDGET_S if args.quick else FULL_BUDGET_S


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dry-run", action="store_true", help="on CPU with tiny shapes (needs no GPU)")
    parser.add_argument("--quick", action="store_true", help="a 1-minute subset: 4 rows, one shape, one round")
    parser.add_argument("--shapes", help=f"comma list of {', '.join(SHAPES)} (default: all; --quick: deepseek)")
    parser.add_argument("--rounds", type=int, help="requests per row (default 3; --quick 1)")
    parser.add_argument("--tokens", type=int, help="greedy tokens per request (default 32)")
    parser.add_argument("--repeats", type=int, default=1, help="run each cache size's rows this many times in "
                        "turn; the table gives each row's median TPOT and range (default 1)")  # fmt: skip
    parser.add_argument("--warmup-tokens", type=int, help="tokens of the warm-up request per row (default 4)")
    parser.add_argument("--accelerate-tokens", type=int, help="tokens of the accelerate row's one request (default 5)")
    parser.add_argument("--budget-s", type=float, help=f"skip rows that would end later (default {FULL_BUDGET_S:.0f}; "
                        f"--quick {QUICK_BUDGET_S:.0f}; --dry-run none)")  # fmt: skip
    parser.add_argument("--workdir", help="where the checkpoints are written (default: the system's temp folder)")
    parser.add_argument("--out", help="append the Markdown table to this file")
    return parser


if __name__ == "__main__":
    sys.exit(main())
