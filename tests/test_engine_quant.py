"""`--expert-dtype int8|int4` through the engine: the offloaded model computes what transformers computes
with the same quantized weights, the quantized file is reused on restart, and the bytes per expert shrink."""

from __future__ import annotations

import json
import logging
import shutil

import pytest
import torch

from cache.quant import dequantize, quantize, scale_dtype
from cache.safetensors_index import CheckpointError
from engine.checkpoint import read_config_dict
from engine.config import EngineConfig
from engine.engine import Engine
from tests.fixtures.models import build_checkpoint, load_reference

PROMPT = "The quick brown fox jumps over the lazy dog, then it runs far away"


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return build_checkpoint("mixtral", tmp_path_factory.mktemp("mixtral"))


def _engine(folder, **kw) -> Engine:
    return Engine.load(EngineConfig(model=str(folder), device="cpu", policy="lru", **kw))


def _fake_quantized_reference(folder, layout) -> torch.nn.Module:
    """Plain transformers with every expert weight replaced by its dequantized form."""
    model = load_reference(folder)
    with torch.no_grad():
        for layer in model.model.layers:
            for name in ("gate_up_proj", "down_proj"):
                t, weights = layout[name], getattr(layer.mlp.experts, name)  # [E, out, in]
                for e in range(weights.shape[0]):
                    q, s = quantize(weights[e], layout.expert_dtype, t.group_size, scale_dtype(t.packing, layout.compute_dtype))
                    weights[e] = dequantize(q, s, torch.float32)
    return model


@pytest.mark.parametrize("expert_dtype,group_size", [("int8", None), ("int8", 16), ("int4", None), ("int4", 16)])
def test_engine_computes_what_transformers_computes_with_the_quantized_weights(folder, expert_dtype, group_size):
    engine = _engine(folder, expert_dtype=expert_dtype, expert_group_size=group_size)
    ids = torch.tensor([engine.encode(PROMPT)])
    with torch.no_grad():
        ours = engine.model(input_ids=ids).logits
        fake = _fake_quantized_reference(folder, engine.loaded.quant)(input_ids=ids).logits
        plain = load_reference(folder)(input_ids=ids).logits
    quantization_effect = (fake - plain).abs().max()
    assert quantization_effect > 0  # the weights really changed
    # what is left is the kernels' bf16 activations: a small part of what quantizing moved
    assert (ours - fake).abs().max() <= 0.1 * quantization_effect
    assert torch.equal(ours.argmax(-1), fake.argmax(-1))


def test_restart_reuses_the_quantized_file(folder, caplog):
    with caplog.at_level(logging.INFO, logger="cache.quant_store"):
        first = _engine(folder, expert_dtype="int4")
        path = next(p for p in first.loaded.host.sources[(0, 0)][0].path.parent.iterdir() if "int4-g64" in p.name)
        built_at = path.stat().st_mtime_ns
        second = _engine(folder, expert_dtype="int4")
    assert "reusing" in caplog.text
    assert path.stat().st_mtime_ns == built_at
    ids = [second.encode(PROMPT)]
    with torch.no_grad():
        assert torch.equal(first.model(input_ids=torch.tensor(ids)).logits, second.model(input_ids=torch.tensor(ids)).logits)


def test_expert_cache_view_shows_dtype_and_fewer_bytes_and_the_ram_tier_holds_more(folder):
    infos = {}
    for dtype in ("auto", "int8", "int4"):
        infos[dtype] = _engine(folder, expert_dtype=dtype, host_cache_gb=4e-5).cache_info()  # ~42 kB of RAM
    assert infos["auto"]["expert_dtype"] == "float32" and infos["auto"]["expert_group_sizes"] is None
    assert infos["int8"]["expert_dtype"] == "int8" and infos["int4"]["expert_dtype"] == "int4"
    assert infos["int8"]["expert_group_sizes"] == {"gate_up_proj": 32, "down_proj": 32}  # per channel
    float_bytes = infos["auto"]["bytes_per_expert"]  # float32 on CPU: int8 ~ 1/4, int4 ~ 1/8 (+ scales, padding)
    assert infos["int8"]["bytes_per_expert"] < float_bytes / 3.5
    assert infos["int4"]["bytes_per_expert"] < float_bytes / 6
    capacity = {d: info["capacity_experts"] for d, info in infos.items()}
    assert capacity["auto"] * 3.5 <= capacity["int8"] and capacity["int8"] < capacity["int4"]


def test_unknown_expert_dtype_or_negative_group_is_refused():
    with pytest.raises(ValueError, match="expert-dtype"):
        EngineConfig(expert_dtype="fp8")
    with pytest.raises(ValueError, match="expert-group-size"):
        EngineConfig(expert_group_size=-1)


def test_a_checkpoint_published_quantized_is_refused_naming_its_format(folder, tmp_path):
    copy = shutil.copytree(folder, tmp_path / "fp8")
    config = json.loads((copy / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [128, 128]}
    (copy / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="published quantized \\('fp8'"):
        read_config_dict(copy)
