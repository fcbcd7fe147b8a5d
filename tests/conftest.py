"""Test-wide settings: learned state goes to a temporary folder, never the user's; with pytest-xdist's
workers (`-n`), each worker's torch gets its share of the cores."""

import os

import pytest
import torch


def pytest_configure(config):
    workers = os.environ.get("PYTEST_XDIST_WORKER_COUNT")
    if workers:  # torch's default team, one per core in every worker, would make each wait on the others
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(workers)))


@pytest.fixture(autouse=True, scope="session")
def isolated_state_dir(tmp_path_factory):
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("MOE_SERVE_STATE_DIR", str(tmp_path_factory.mktemp("state")))
        yield


QWEN_CODER_MODEL = "tiny-qwen-coder"


@pytest.fixture(scope="session")
def qwen_coder_checkpoint(tmp_path_factory):
    """A tiny random Qwen3-MoE with Qwen2.5-Coder's tokenizer (its fill-in-the-middle tokens)."""
    from tests.fixtures.models import build_checkpoint

    return build_checkpoint("qwen3_moe", tmp_path_factory.mktemp("tiny-qwen-coder"), tokenizer="qwen_coder")


@pytest.fixture(scope="session")
def qwen_coder_server(qwen_coder_checkpoint):
    """A real server over `qwen_coder_checkpoint` on the CPU, shared by the fill-in-the-middle tests."""
    from server.testing import RemoteServer

    with RemoteServer(["--model", str(qwen_coder_checkpoint), "--served-model-name", QWEN_CODER_MODEL,
                       "--device", "cpu"], env={"OMP_NUM_THREADS": "1"}) as srv:
        yield srv
