"""`python -m bench.gpu_profile`: per-token profile of the GPU table's variants, run on CPU with tiny shapes."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from bench import gpu_profile
from bench.gpu_profile import per_token, variants

TOKENS = 4


def event(key: str, count: int, cpu_us: float = 0.0, device_us: float = 0.0) -> SimpleNamespace:
    return SimpleNamespace(key=key, count=count, self_cpu_time_total=cpu_us, self_device_time_total=device_us)


def test_counts_are_per_decode_token_and_the_top_ops_ranked_by_their_time():
    events = [event("cudaStreamSynchronize", 12), event("aten::_local_scalar_dense", 4, 40.0),
              event("cudaMemcpyAsync", 20, 100.0), event("cudaLaunchKernel", 400, 2000.0),
              event("aten::mm", 80, 800.0, 4000.0), event("aten::bmm", 8, 1600.0, 400.0)]  # fmt: skip
    counts = per_token(events, steps=4)
    assert counts["syncs_per_token"] == 4.0  # (12 + 4) / 4
    assert counts["copies_per_token"] == 5.0
    assert counts["launches_per_token"] == 100.0
    assert counts["aten_ops_per_token"] == 23.0  # (4 + 80 + 8) / 4
    assert [op for op, _, _ in counts["top_host"]] == ["cudaLaunchKernel", "aten::bmm", "aten::mm",
                                                       "cudaMemcpyAsync", "aten::_local_scalar_dense"]  # fmt: skip
    assert counts["top_host"][0] == ["cudaLaunchKernel", 0.5, 100.0]  # 2000 µs over 4 tokens: 0.5 ms each
    assert counts["top_device"] == [["aten::mm", 1.0, 20.0], ["aten::bmm", 0.1, 2.0]]


def test_dry_run_profiles_every_variant_and_appends_the_summary(tmp_path, capsys):
    out = tmp_path / "profile.md"
    assert gpu_profile.main(["--dry-run", "--tokens", str(TOKENS), "--out", str(out)]) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    rows = [line for line in lines if line["kind"] == "row"]
    assert [r["variant"] for r in rows] == [v.label() for v in variants(0.25)]
    for r in rows:
        assert "error" not in r, r
        assert r["steps"] == TOKENS - 1 and r["tpot_ms"] > 0
        assert r["aten_ops_per_token"] > 10  # a decoder layer's forward is tens of ops at least
        assert r["top_host"] and all(ms >= 0 and calls > 0 for _, ms, calls in r["top_host"])
        assert r["launches_per_token"] == 0 and r["top_device"] == []  # no device on a dry run
    text = out.read_text()
    assert "| variant | TPOT ms | syncs | copies | launches | aten ops |" in text
    for r in rows:
        assert f"| {r['variant']} | {r['tpot_ms']:.2f} |" in text


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_refuses_to_run_without_cuda(capsys):
    assert gpu_profile.main([]) == 2
    assert "needs a CUDA device" in capsys.readouterr().err
