"""The `moe-serve` command line: `--help`, bad settings, the entry points."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from server.config import FLAGS, parse_bool

ROOT = Path(__file__).resolve().parent.parent


def run_cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "server", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=60, env=env)


def test_help_documents_every_flag_and_its_variable():
    result = run_cli("--help")
    assert result.returncode == 0, result.stderr
    text = " ".join(result.stdout.split())  # argparse wraps lines
    assert "--config" in text and "MOE_SERVE_CONFIG" in text
    for flag in FLAGS:
        assert flag.name in text
        assert flag.env in text
        if flag.kind is parse_bool:
            assert f"--no-{flag.name[2:]}" in text
    assert "flag > environment > YAML > default" in text


def test_version():
    result = run_cli("--version")
    assert result.returncode == 0 and result.stdout.startswith("moe-serve ")
    assert "with lru or lfu the EAMC and its file are off" in " ".join(run_cli("--help").stdout.split())


def test_list_families_prints_what_the_installed_transformers_marks():
    result = run_cli("--list-families")
    assert result.returncode == 0, result.stderr
    families = result.stdout.split()
    assert families == sorted(families) and len(families) > 20
    tested = {"mixtral", "deepseek_v3", "gpt_oss", "qwen3_next", "glm4_moe", "phimoe", "jamba"}
    assert tested <= set(families)
    assert "llama" not in families and "qwen3_moe_vision" not in families  # dense, and not a causal LM


def test_help_does_not_load_the_engine():
    code = "import sys; from server.cli import main\ntry:\n    main(['--help'])\nexcept SystemExit:\n    pass\n" \
           "assert 'torch' not in sys.modules, 'torch imported'"
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr


@pytest.mark.parametrize("args, env, needle", [
    (["--port", "http"], {}, "--port: invalid int value"),
    (["--policy", "fifo"], {}, "invalid choice"),
    (["--expert-cache-gb", "2", "--expert-cache-experts", "3"], {}, "not both"),
    ([], {"MOE_SERVE_MAX_QUEUE": "zero"}, "MOE_SERVE_MAX_QUEUE"),
    (["--max-request-bytes", "0"], {}, "max-request-bytes must be at least 1"),
])
def test_bad_settings_exit_2_with_a_message(args, env, needle):
    result = run_cli(*args, env={**os.environ, **env})
    assert result.returncode == 2
    assert needle in result.stderr
    assert "usage: moe-serve" in result.stderr


@pytest.mark.parametrize("case", ["missing-folder", "no-such-device"])
def test_a_model_that_cannot_load_exits_non_zero_with_the_reason(tmp_path, case):
    if case == "missing-folder":
        args, reason = ["--model", str(tmp_path / "nonexistent")], "does not exist"
    else:
        from tests.fixtures.models import build_checkpoint

        folder = build_checkpoint("mixtral", tmp_path / "model", num_layers=1)
        import torch

        # no GPU here ("CUDA is not available"), or no 100th one (torch's own wording)
        args, reason = ["--model", str(folder), "--device", "cuda:99"], "" if torch.cuda.is_available() else "cuda"
    start = time.monotonic()
    result = run_cli(*args, "--port", "0", env={**os.environ, "MOE_SERVE_STATE_DIR": str(tmp_path)})
    assert result.returncode == 1, result.stderr[-2000:]
    assert time.monotonic() - start < 60  # run_cli's timeout: before, it served 503 forever
    last = result.stderr.strip().splitlines()[-1]
    assert "could not load the model" in last and reason in last.lower()


def test_a_port_in_use_ends_the_start_before_the_model_loads(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        # a model that cannot load: had the load started, the exit would be 1 with its reason
        result = run_cli("--model", str(tmp_path / "nonexistent"), "--port", str(port),
                         env={**os.environ, "MOE_SERVE_STATE_DIR": str(tmp_path)})  # fmt: skip
    assert result.returncode == 3, result.stderr[-2000:]
    assert f"cannot listen on 127.0.0.1:{port}" in result.stderr and "--port" in result.stderr
    assert "could not load the model" not in result.stderr and "Application startup" not in result.stderr


def test_installed_console_script_answers_help():
    script = shutil.which("moe-serve", path=str(Path(sys.executable).parent))
    if script is None:
        pytest.skip("moe-serve is not installed in this environment (pip install -e .)")
    result = subprocess.run([script, "--help"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0 and "usage: moe-serve" in result.stdout


def test_console_script_points_at_main():
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["scripts"]["moe-serve"] == "server.cli:main"
    from server.cli import main

    assert callable(main)
