"""Bad checkpoints and bad requests fail with a clear error, never a crash."""

import json
import shutil

import pytest

from cache.safetensors_index import CheckpointError
from engine.api import ContextLengthError, GenerationRequest, InvalidRequestError, SamplingParams
from engine.config import EngineConfig
from engine.engine import Engine
from tests.fixtures.models import build_checkpoint


@pytest.fixture(scope="module")
def good_checkpoint(tmp_path_factory):
    return build_checkpoint("mixtral", tmp_path_factory.mktemp("good"), num_layers=2)


@pytest.fixture(scope="module")
def engine(good_checkpoint):
    return Engine.load(EngineConfig(model=str(good_checkpoint), device="cpu", policy="lru", max_model_len=64))


def copy_of(folder, tmp_path):
    target = tmp_path / "ckpt"
    shutil.copytree(folder, target)
    return target


def load(folder):
    return Engine.load(EngineConfig(model=str(folder), device="cpu", policy="lru"))


def test_missing_folder(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        load(tmp_path / "nope")


def test_offline_hub_id_that_is_not_cached(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    with pytest.raises(CheckpointError, match="could not be fetched"):
        load("someone/no-such-model")


def test_corrupt_safetensors(good_checkpoint, tmp_path):
    folder = copy_of(good_checkpoint, tmp_path)
    shard = next(folder.glob("*.safetensors"))
    shard.write_bytes(shard.read_bytes()[:1000])
    with pytest.raises(CheckpointError, match="truncated|not a valid"):
        load(folder)


def test_pickle_only_checkpoint_is_refused(good_checkpoint, tmp_path):
    folder = copy_of(good_checkpoint, tmp_path)
    for shard in folder.glob("*.safetensors"):
        shard.rename(shard.with_suffix(".bin"))
    with pytest.raises(CheckpointError, match="safetensors only"):
        load(folder)


def test_unsupported_architecture_lists_the_supported_ones(good_checkpoint, tmp_path):
    folder = copy_of(good_checkpoint, tmp_path)
    config = json.loads((folder / "config.json").read_text())
    config["model_type"] = "llama"
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="unsupported architecture 'llama'") as refused:
        load(folder)
    for family in ("mixtral", "gpt_oss", "qwen3_next", "--list-families"):
        assert family in str(refused.value)


def test_prompt_over_the_context_length_is_refused_before_any_compute(engine):
    before = engine.cache_counters()["misses"]
    request = GenerationRequest("long", list(range(10, 70)), SamplingParams(max_tokens=10))
    with pytest.raises(ContextLengthError, match="maximum context length is 64"):
        list(engine.generate(request))
    assert engine.cache_counters()["misses"] == before


def test_logit_bias_outside_the_vocabulary_is_refused(engine):
    request = GenerationRequest("bias", [1, 2, 3], SamplingParams(max_tokens=2, logit_bias={10**7: 1.0}))
    with pytest.raises(InvalidRequestError, match="logit_bias"):
        engine.validate(request)
