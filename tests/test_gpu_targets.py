"""`bench.gpu_targets`: the issues' GPU targets judged from `bench.gpu_scale` rows."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from bench.gpu_targets import judge, section

ROOT = Path(__file__).resolve().parents[1]


def engine_row(shape: str, fraction: float, policy: str, prefetch: bool, tpot: float, *, cpu: str = "auto",
               dtype: str = "auto", replay: float | None = None, cache: str = "8/32") -> dict:  # fmt: skip
    row = {"kind": "row", "runner": "moe-serve", "shape": shape, "fraction": fraction, "policy": policy,
           "prefetch": prefetch, "variant_cpu_experts": cpu, "variant_expert_dtype": dtype, "tpot_ms": tpot,
           "cache": cache, "variant": f"{policy} {prefetch} {cpu} {dtype}"}  # fmt: skip
    if replay is not None:
        row["replay_tpot_ms"], row["replay_error"] = replay, replay / tpot - 1
    return row


def plain_row(shape: str, runner: str, tpot: float) -> dict:
    return {"kind": "row", "runner": runner, "shape": shape, "fraction": None, "policy": "lru", "prefetch": False,
            "tpot_ms": tpot, "variant": runner}  # fmt: skip


def rows_of(**tpot: float) -> list[dict]:
    """A Mixtral-shaped run at 1/4 of the experts; keyword → that row's TPOT."""
    q = 1 / 4
    return [
        plain_row("mixtral", "transformers", 6.7),
        {**engine_row("mixtral", 1.0, "lru", False, tpot.get("resident", 6.5), cache="32/32"), "runner": "moe-serve"},
        engine_row("mixtral", q, "lru", False, tpot.get("lru", 30.0), replay=31.0),
        engine_row("mixtral", q, "lru", True, tpot.get("lru_prefetch", 30.5), replay=31.0),
        engine_row("mixtral", q, "sparsity-aware", False, tpot.get("sa", 29.0), replay=29.5),
        engine_row("mixtral", q, "sparsity-aware", True, tpot.get("default", 29.0), replay=29.5),
        engine_row("mixtral", q, "lru", False, tpot.get("demand_only", 43.0), cpu="off", replay=44.5),
        engine_row("mixtral", q, "lru", False, tpot.get("int8", 23.0), cpu="off", dtype="int8", replay=23.5),
        engine_row("mixtral", q, "lru", False, tpot.get("int4", 14.0), cpu="off", dtype="int4", replay=14.5),
    ]


def verdicts(lines: list[str]) -> dict[str, str]:
    """target cell → verdict cell."""
    out = {}
    for line in lines:
        cells = [c.strip() for c in line.strip("|").split("|")]
        out[cells[1]] = cells[4]
    return out


def test_every_target_is_met_by_a_run_that_meets_it():
    found = verdicts(judge(rows_of()))
    assert found["prefetch on ≤ 1.05 × off (lru)"] == "met"
    assert found["prefetch on ≤ 1.05 × off (sparsity-aware)"] == "met"
    assert found["the default ≤ lru without prefetch"] == "met"
    assert found["all resident vs transformers"] == "—"  # only the DeepSeek shape has a target
    assert found["timed replay within 15% of measured TPOT"] == "met"
    assert found["--cpu-experts auto ≤ 0.7 × off (lru, no prefetch)"] == "met"  # 30 / 43
    assert found["int8 ≤ 0.66 × bf16 (0.55 + 20%)"] == "met"  # 23 / 43
    assert found["int4 ≤ 0.42 × bf16 (0.35 + 20%)"] == "met"  # 14 / 43


def test_each_target_fails_when_its_rows_miss_it():
    assert verdicts(judge(rows_of(lru_prefetch=32.0)))["prefetch on ≤ 1.05 × off (lru)"] == "**not met**"
    assert verdicts(judge(rows_of(default=31.0)))["the default ≤ lru without prefetch"] == "**not met**"
    assert verdicts(judge(rows_of(lru=31.0)))["--cpu-experts auto ≤ 0.7 × off (lru, no prefetch)"] == "**not met**"
    assert verdicts(judge(rows_of(int8=29.0)))["int8 ≤ 0.66 × bf16 (0.55 + 20%)"] == "**not met**"
    assert verdicts(judge(rows_of(int4=19.0)))["int4 ≤ 0.42 × bf16 (0.35 + 20%)"] == "**not met**"
    off = verdicts(judge(rows_of(sa=24.0)))  # replay 29.5 against 24 measured: +23%
    assert off["timed replay within 15% of measured TPOT"] == "**not met**"


def test_the_deepseek_shape_judges_all_resident_against_transformers():
    rows = [plain_row("deepseek", "transformers", 10.5),
            engine_row("deepseek", 1.0, "lru", False, 23.9, cache="384/384")]  # fmt: skip
    assert verdicts(judge(rows))["all resident ≤ 1.1 × transformers"] == "**not met**"
    rows[1]["tpot_ms"] = 11.0
    assert verdicts(judge(rows))["all resident ≤ 1.1 × transformers"] == "met"


def test_rows_that_did_not_run_are_left_out_and_the_cli_reads_saved_json_lines(tmp_path):
    rows = rows_of()
    skipped = {**rows.pop(3), "kind": "skipped"}  # lru + prefetch past the budget
    lines = judge([*rows, skipped])
    assert not any("(lru)" in line and "prefetch on" in line for line in lines)
    saved = tmp_path / "run.jsonl"
    saved.write_text("".join(json.dumps(r) + "\n" for r in [{"kind": "env"}, *rows]) + "| a table line |\n")
    done = subprocess.run([sys.executable, "-m", "bench.gpu_targets", str(saved)], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout == section(rows)
    assert "| 13 | --cpu-experts auto ≤ 0.7 × off (lru, no prefetch) | mixtral, 8/32 | 0.698 × | met |" in done.stdout
