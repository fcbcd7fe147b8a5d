"""`python -m bench.gpu_scale`: the whole GPU benchmark run on CPU with tiny shapes (`--dry-run`),
its time budget, and its refusal to run without CUDA."""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch

import bench.gpu_scale as gpu_scale
from bench.gpu_scale import (
    Budget,
    Settings,
    Variant,
    merge_repeats,
    placement,
    plan,
    run_all,
    schedule,
    table,
)
from bench.scale_models import SHAPES, tiny
from cache.quant import QUANT_DTYPES

ROOT = Path(__file__).resolve().parents[1]
SHAPE_KEYS = ("mixtral", "deepseek")
TINY_LAYERS = 3  # bench.scale_models.tiny


def run_script(*args: str, timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "bench.gpu_scale", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout)  # fmt: skip


def split_output(stdout: str) -> tuple[list[dict], str]:
    """(the JSON lines, the Markdown table after them)."""
    lines = stdout.splitlines()
    records = [json.loads(line) for line in lines if line.startswith("{")]
    return records, "\n".join(line for line in lines if not line.startswith("{"))


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("gpu_scale")
    out = tmp / "results.md"
    out.write_text("# earlier results\n")
    done = run_script("--dry-run", "--out", str(out), "--workdir", str(tmp), timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    records, table = split_output(done.stdout)
    return records, table, out


@pytest.mark.slow
def test_dry_run_runs_every_variant_of_both_shapes(dry_run):
    records, _, _ = dry_run
    kinds = Counter(r["kind"] for r in records)
    assert (kinds["env"], kinds["plan"], kinds["link"], kinds["build"]) == (1, 1, 1, 2)
    variants = next(r for r in records if r["kind"] == "plan")["rows"]
    assert variants == [v.label() for v in plan(quick=False)]
    rows = [r for r in records if r["kind"] in ("row", "skipped", "failed")]
    assert [r for r in rows if r["kind"] != "row"] == []  # nothing failed, nothing skipped (no budget)
    for shape in SHAPE_KEYS:
        assert sorted(r["variant"] for r in rows if r["shape"] == shape) == sorted(variants)
    link = next(r for r in records if r["kind"] == "link")
    assert all(link[key]["gbps"] > 0 for key in ("big", *SHAPE_KEYS))


@pytest.mark.slow
def test_dry_run_rows_carry_measurements_and_the_replay_prediction(dry_run):
    records, _, _ = dry_run
    rows = [r for r in records if r["kind"] == "row"]
    assert all(r["tpot_ms"] > 0 and r["ttft_ms"] > 0 for r in rows)
    engine_rows = [r for r in rows if r["runner"] == "moe-serve"]
    assert len(engine_rows) == 2 * 17
    for r in engine_rows:
        assert 0 <= r["hit_rate"] <= 1 and r["gb_per_token"] >= 0
        assert r["replay_tpot_ms"] > 0 and 0 <= r["replay_hit_rate"] <= 1
        assert r["replay_error"] == pytest.approx(r["replay_tpot_ms"] / r["tpot_ms"] - 1, abs=1e-3)
        assert r["replay_command"].startswith(f"python -m cache.replay {r['trace']} --policy {r['policy']} ")
        assert ("--prefetch" in r["replay_command"]) == r["prefetch"]
        if not r["prefetch"]:
            assert r["prefetches_per_token"] == 0
    for shape in SHAPE_KEYS:
        resident = next(r for r in engine_rows if r["shape"] == shape and r["fraction"] == 1)
        assert resident["hit_rate"] == 1 and resident["gb_per_token"] == 0  # warmed up: nothing moves
        smallest = [r for r in engine_rows if r["shape"] == shape and r["fraction"] == 1 / 16]
        assert len(smallest) == 4 and all(r["hit_rate"] < 1 and r["gb_per_token"] > 0 for r in smallest)
    accelerate = [r for r in rows if r["runner"] == "accelerate"]
    assert len(accelerate) == 2
    assert all(sum(r["placement"].values()) == TINY_LAYERS and r["gpu_budget_bytes"] > 0 for r in accelerate)


@pytest.mark.slow
def test_dry_run_compares_quantized_experts_with_the_demand_only_baseline(dry_run):
    records, _, _ = dry_run
    rows = [r for r in records if r["kind"] == "row" and r["runner"] == "moe-serve" and r["fraction"] == 1 / 4]
    for shape in SHAPE_KEYS:
        ours = {r["variant"]: r for r in rows if r["shape"] == shape}
        baseline = ours["moe-serve, lru, no prefetch, --cpu-experts off"]
        assert baseline["expert_dtype"] == "float32" and baseline["cpu_experts"]["enabled"] is False
        for dtype in QUANT_DTYPES:
            row = ours[f"moe-serve, lru, no prefetch, --cpu-experts off, --expert-dtype {dtype}"]
            assert row["expert_dtype"] == dtype and row["cpu_experts"]["enabled"] is False
            assert row["bytes_per_expert"] < baseline["bytes_per_expert"] / 2  # float32 in the dry run
            assert f"--expert-mb {row['bytes_per_expert'] / 1e6:g} " in row["replay_command"]
            assert row["hit_rate"] < 1 and row["tpot_ms"] > 0


@pytest.mark.slow
def test_dry_run_prints_the_table_and_appends_it_to_out(dry_run):
    records, table, out = dry_run
    assert table.count("| variant | device cache | TPOT ms | TTFT ms | hit rate | GB moved per token "
                       "| replay TPOT ms | replay error |") == 2  # fmt: skip
    body = [line for line in table.splitlines() if line.startswith("| ") and "TPOT ms" not in line]
    rows = [r for r in records if r["kind"] == "row"]
    for r in rows:
        assert any(line.startswith(f"| {r['variant']}") for line in body), r["variant"]
    assert len([line for line in body if line.startswith(("| transformers", "| moe-serve"))]) == len(rows)
    assert "not a measurement" in table
    targets = table[table.index("**Targets**"):]  # bench.gpu_targets, after both shapes' tables
    for shape in SHAPE_KEYS:
        assert f"| 10 | the default ≤ lru without prefetch | {shape}, " in targets
        assert any(line.startswith("| 13 | --cpu-experts auto ≤ ") and f"| {shape}, " in line
                   for line in targets.splitlines())  # fmt: skip
    assert targets.count("| 14 | int8 ") == 2 and "timed replay within 15%" in targets
    assert out.read_text() == "# earlier results\n\n" + table.strip("\n") + "\n"


def test_rows_past_the_budget_are_skipped_and_said_so(tmp_path):
    done = run_script("--dry-run", "--budget-s", "0", "--workdir", str(tmp_path), timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    records, table = split_output(done.stdout)
    rows = [r for r in records if r.get("shape") and r["kind"] != "build"]
    assert len(rows) == 2 * len(plan(quick=False))
    assert all(r["kind"] == "skipped" and "budget" in r["reason"] for r in rows)
    assert table.count("| skipped: would end past the 0 s budget |") == len(rows)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_refuses_to_run_without_cuda():
    done = run_script("--quick", timeout=300)
    assert done.returncode == 2
    assert "needs a CUDA device" in done.stderr and "--dry-run" in done.stderr
    assert done.stdout == ""


def test_placement_counts_decoder_layers_per_place():
    assert placement({"": "disk"}, 3) == {"disk": 3}
    assert placement({"model.embed_tokens": "cpu", "model.layers": "disk", "lm_head": "disk"}, 3) == {"disk": 3}
    per_layer = {"model.embed_tokens": 0, "model.layers.0": 0, "model.layers.1": "cpu", "model.layers.10": "cpu",
                 "model.layers.2": "cpu", "model.norm": "cpu"}  # fmt: skip
    assert placement(per_layer, 3) == {"0": 1, "cpu": 2}  # model.layers.10 is not layer 1


def test_schedule_runs_each_group_for_both_shapes_and_accelerate_last():
    jobs = schedule({"a": SHAPES["mixtral"], "b": SHAPES["deepseek"]}, plan(quick=False))
    assert len(jobs) == 2 * len(plan(quick=False))
    assert [(key, v.kind) for key, _, v in jobs[:4]] == [("a", "transformers"), ("b", "transformers"),
                                                         ("a", "moe-serve"), ("b", "moe-serve")]  # fmt: skip
    assert [v.fraction for _, _, v in jobs[2:]][:18] == [1, 1, *[1 / 4] * 16]
    assert [(key, v.kind) for key, _, v in jobs[-2:]] == [("a", "accelerate"), ("b", "accelerate")]


def test_repeats_run_each_groups_rows_in_turn():
    variants = [Variant("moe-serve"), Variant("moe-serve", 1 / 4), Variant("moe-serve", 1 / 4, prefetch=True)]
    jobs = schedule({"a": SHAPES["mixtral"]}, variants, repeats=2)
    assert [(n, v.fraction) for _, n, v in jobs] == [(0, 1), (0, 1), (1, 1 / 4), (2, 1 / 4), (1, 1 / 4), (2, 1 / 4)]


def test_merged_repeats_keep_the_median_run_and_every_runs_tpot():
    def row(tpot: float, kind: str = "row", variant: str = "v") -> dict:
        if kind != "row":
            return {"kind": kind, "shape": "a", "variant": variant, "cache": "8/32", "reason": "r"}
        return {"kind": kind, "shape": "a", "variant": variant, "cache": "8/32", "tpot_ms": tpot, "hit_rate": tpot / 100}

    merged = merge_repeats([row(15.8), row(12.6), row(13.1), row(0, "skipped", "w"), row(0, "skipped", "w"),
                            row(0, "failed", "x"), row(20.0, variant="x")])  # fmt: skip
    by_variant = {r["variant"]: r for r in merged}
    assert by_variant["v"]["tpot_ms"] == 13.1 and by_variant["v"]["hit_rate"] == 0.131  # the median run, whole
    assert by_variant["v"]["tpot_ms_runs"] == [12.6, 13.1, 15.8]
    assert by_variant["w"]["kind"] == "skipped"
    assert by_variant["x"]["tpot_ms"] == 20.0 and "tpot_ms_runs" not in by_variant["x"]  # its one measured run
    env = {"dry_run": True, "device": "cpu", "device_name": "cpu", "command": "x", "date": "d", "torch": "t",
           "transformers": "t", "accelerate": "a", "rounds": 1, "tokens": 3, "repeats": 3}  # fmt: skip
    link = {"big": {"bytes": 1 << 20, "gbps": 10.0}, "a": {"bytes": 1 << 10, "gbps": 10.0}}
    merged = [dict(r, runner="moe-serve", fraction=0.25, policy="lru", prefetch=False, ttft_ms=1.0) for r in merged]
    text = table(env, link, {"a": SHAPES["mixtral"]}, merged, torch.bfloat16)
    assert "| v | 8/32 | 13.10 (12.60-15.80) |" in text and "run 3 times in turn" in text


def test_a_failing_row_is_reported_and_the_others_still_run(tmp_path, monkeypatch):
    def broken(*args):
        raise RuntimeError("boom")

    monkeypatch.setattr(gpu_scale, "run_transformers", broken)
    settings = Settings(torch.device("cpu"), torch.float32, rounds=1, tokens=3, warmup_tokens=2,
                        accelerate_tokens=3, workdir=tmp_path)  # fmt: skip
    shapes = {"mixtral": tiny(SHAPES["mixtral"])}
    link = {"big": {"bytes": 1 << 20, "gbps": 10.0}, "mixtral": {"bytes": 1 << 10, "gbps": 10.0}}
    variants = [Variant("transformers"), Variant("moe-serve"), Variant("moe-serve", 1 / 4, "sparsity-aware", True)]
    rows = run_all(shapes, variants, settings, link, Budget(None))
    assert [r["kind"] for r in rows] == ["failed", "row", "row"]
    assert rows[0]["reason"] == "RuntimeError: boom"
    assert rows[2]["replay_tpot_ms"] > 0 and rows[2]["cache"] == "6/24"
    env = {"dry_run": True, "device": "cpu", "device_name": "cpu", "command": "x", "date": "d", "torch": "t",
           "transformers": "t", "accelerate": "a", "rounds": 1, "tokens": 3}  # fmt: skip
    assert "| transformers, all on the GPU | — | failed: RuntimeError: boom |" in table(env, link, shapes, rows, torch.float32)
