"""`--expert-dtype int8|int4` through the engine: the offloaded model computes what transformers computes
with the same quantized weights (Mixtral's `[out, in]` experts, GPT-OSS's transposed ones with biases), the
quantized file is reused on restart, and the bytes per expert shrink."""

from __future__ import annotations

import json
import logging
import shutil

import pytest
import torch

import engine.model_loader as model_loader
from cache.expert_cache import ExpertCache, SlotBackend
from cache.miss_planner import MissCosts, MissPlanner
from cache.quant import dequantize, int_dtype_of, quantize, scale_dtype
from cache.safetensors_index import CheckpointError
from cache.stats import CacheStats
from engine.checkpoint import read_config_dict
from engine.config import EngineConfig
from engine.engine import Engine
from engine.moe_layers import find_moe_layers
from tests.fixtures.models import build_checkpoint, load_reference
from tests.test_engine_equivalence import greedy

PROMPT = "The quick brown fox jumps over the lazy dog, then it runs far away"
# What is left between the engine and transformers on the same dequantized weights: the kernels take and
# return bf16 activations, two roundings of at most 2^-9 relative per product, two products per expert,
# three MoE layers: to first order at most 12 * 2^-9 (2.3%) of the logits' scale.
BF16_ACTIVATIONS = 12 * 2**-9


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return build_checkpoint("mixtral", tmp_path_factory.mktemp("mixtral"))


@pytest.fixture(scope="module")
def gpt_oss_folder(tmp_path_factory):
    return build_checkpoint("gpt_oss", tmp_path_factory.mktemp("gpt_oss"))


def _engine(folder, **kw) -> Engine:
    return Engine.load(EngineConfig(model=str(folder), device="cpu", policy="lru", **kw))


def _fake_quantized_reference(folder, layout) -> torch.nn.Module:
    """Plain transformers with every expert weight replaced by its dequantized form (biases kept)."""
    model = load_reference(folder)
    with torch.no_grad():
        for layer in find_moe_layers(model):
            for t in (t for t in layout.tensors if t.packing != "raw"):
                weights = getattr(layer.experts, t.name)  # [E, out, in], or [E, in, out] transposed
                for e in range(weights.shape[0]):
                    w = weights[e].t() if t.transposed else weights[e]
                    q, s, z = quantize(w, int_dtype_of(t.packing), t.group_size, scale_dtype(t.packing, layout.compute_dtype))
                    w.copy_(dequantize(q, s, z, torch.float32))  # `w` is a view: writes the model's weight
    return model


@pytest.mark.parametrize(
    "family,expert_dtype,group_size",
    [("mixtral", "int8", None), ("mixtral", "int8", 16), ("mixtral", "int4", None), ("mixtral", "int4", 16),
     ("mixtral", "int4-mixed", None), ("gpt_oss", "int8", None), ("gpt_oss", "int4", None)],
    # gpt_oss int4-mixed is left out: its token 0 has two experts 0.0006 apart in the last router, and the
    # bf16 activations flip them (a near tie, not an error); tests/test_quant.py checks its transposed layout
)
def test_engine_computes_what_transformers_computes_with_the_quantized_weights(
    request, family, expert_dtype, group_size
):
    folder = request.getfixturevalue("folder" if family == "mixtral" else "gpt_oss_folder")
    engine = _engine(folder, expert_dtype=expert_dtype, expert_group_size=group_size)
    layout = engine.loaded.quant
    if expert_dtype == "int4-mixed":
        assert int_dtype_of(layout["gate_up_proj"].packing) == "int4" and int_dtype_of(layout["down_proj"].packing) == "int8"
    if family == "gpt_oss":  # what this family adds: weights stored [in, out], biases kept unquantized
        assert layout["gate_up_proj"].transposed and layout["down_proj"].transposed
        assert layout["gate_up_proj_bias"].packing == layout["down_proj_bias"].packing == "raw"
    fake, plain = _fake_quantized_reference(folder, layout), load_reference(folder)
    prompt = torch.tensor([engine.encode(PROMPT)])
    for ids in (prompt, prompt[:, :1]):  # many tokens (expert by expert), one token (the decode path)
        with torch.no_grad():
            ours, want, unquantized = (m(input_ids=ids).logits for m in (engine.model, fake, plain))
        assert (want - unquantized).abs().max() > 0  # the weights really changed
        assert (ours - want).abs().max() <= BF16_ACTIVATIONS * want.abs().max()
        assert torch.equal(ours.argmax(-1), want.argmax(-1))


def test_restart_reuses_the_quantized_file(folder, caplog):
    with caplog.at_level(logging.INFO, logger="cache.quant_store"):
        first = _engine(folder, expert_dtype="int4")
        path = next(p for p in first.loaded.host.sources[(0, 0)][0].path.parent.iterdir() if "int4-g32" in p.name)
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


def test_a_checkpoint_published_in_a_format_not_read_is_refused_naming_it(folder, tmp_path):
    """FP8 and MXFP4 load (tests/test_published_quant.py); GPTQ, AWQ, ... do not."""
    copy = shutil.copytree(folder, tmp_path / "gptq")
    config = json.loads((copy / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "gptq", "bits": 4, "group_size": 128}
    (copy / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="quantized checkpoint \\(gptq\\).*fp8 or mxfp4.*--expert-dtype int8 or int4"):
        read_config_dict(copy)


def test_quantized_experts_computed_on_the_host_give_the_tokens_of_the_slots(gpt_oss_folder, monkeypatch):
    """The host executor (`--cpu-experts`) reads the packed host buffers through the same kernels."""
    in_slots = _engine(gpt_oss_folder, expert_dtype="int4", prefetch=False)
    prompt_ids = in_slots.encode(PROMPT)
    want = greedy(in_slots, prompt_ids)

    def slots_as_if_on_a_device(host, sizing, device, policy, num_layers, dense_bytes=0, context=None):
        return ExpertCache(4, policy, CacheStats(num_layers), SlotBackend(host, 4, device)), None

    monkeypatch.setattr(model_loader, "_expert_cache", slots_as_if_on_a_device)
    on_host = _engine(gpt_oss_folder, expert_dtype="int4", prefetch=False)
    for experts in on_host.loaded.offloaded:
        assert experts.host_capable is False  # a CPU pool: the engine would not use it
        experts.host_capable = True  # what a CUDA pool with CPU-readable packings gets
    on_host.runtime.planner = MissPlanner(MissCosts(copy_ms=1.0, host_ms=1.0))  # two misses: one each
    assert greedy(on_host, prompt_ids) == want
    assert on_host.cache_counters()["cpu_computed"] > 0
