"""`python -m bench.cuda_check` without a GPU: the choice of checks is validated before CUDA is asked for."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from bench.cuda_check import SECTIONS

ROOT = Path(__file__).resolve().parents[1]


def run_check(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "bench.cuda_check", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)  # fmt: skip


def test_the_checks_run_cheapest_first_and_the_76_family_equivalence_last():
    assert SECTIONS[0] == "streams" and SECTIONS[-1] == "equivalence"
    assert {"quantized", "host_executor", "embeddings", "tpot"} <= set(SECTIONS)


def test_an_unknown_check_is_refused_by_name():
    done = run_check("--sections", "quantized,bogus")
    assert done.returncode == 2 and "--sections: unknown bogus" in done.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_a_known_check_needs_cuda():
    done = run_check("--sections", "quantized")
    assert done.returncode != 0 and "no CUDA device" in done.stderr
