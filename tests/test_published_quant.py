"""Checkpoints published quantized (FP8 block-scaled, MXFP4) load without a round trip through bf16:
the decoding matches the formats' definitions bit for bit, the engine on the published checkpoint
generates what transformers generates on the decoded weights at every cache size, the expert bytes
travel as published, other expert dtypes start from the decoded weights, and corrupt files are refused."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from cache.quant import ParamSpec, unpack_expert
from cache.quant_formats import dequantize_fp8, dequantize_mxfp4
from cache.quant_published import PublishedFormat, plan_published_layout
from cache.safetensors_index import CheckpointError
from engine.checkpoint import read_config_dict
from engine.config import EngineConfig
from engine.engine import Engine
from tests.fixtures.models import reference_greedy
from tests.fixtures.published import (
    build_fp8_checkpoint,
    build_mxfp4_checkpoint,
    fp8_quantize,
    fp8_reference,
    mxfp4_quantize,
    mxfp4_reference,
)
from tests.test_engine_equivalence import greedy

PROMPT = "The quick brown fox jumps over the lazy dog, then"
NUM_EXPERTS = 8


@pytest.fixture(scope="module")
def fp8_folders(tmp_path_factory):
    """DeepSeek-V3 in FP8 with blocks of 12 × 20: no shape of the tiny model is a whole number of blocks."""
    return build_fp8_checkpoint("deepseek_v3", tmp_path_factory.mktemp("fp8"), (12, 20))


@pytest.fixture(scope="module")
def mxfp4_folders(tmp_path_factory):
    return build_mxfp4_checkpoint(tmp_path_factory.mktemp("mxfp4"))


def _engine(folder, **kw) -> Engine:
    return Engine.load(EngineConfig(model=str(folder), device="cpu", policy="lru", **kw))


# -- decoding, against the formats' definitions --------------------------------------------------------


@pytest.mark.parametrize("shape,block", [((64, 96), (16, 32)), ((24, 32), (16, 16)), ((36, 50), (12, 20))])
def test_fp8_decoding_is_the_definition_bit_for_bit(shape, block):
    weight = torch.randn(shape, generator=torch.Generator().manual_seed(0))
    q, scales = fp8_quantize(weight, block)
    for dtype in (torch.float32, torch.bfloat16):  # one rounding, from the exact float32 product
        want = fp8_reference(q, scales, block).to(dtype)
        assert torch.equal(dequantize_fp8(q, scales, block, 1, dtype), want)


def test_fp8_stacked_weights_keep_each_ones_scale_grid():
    """gate and up as published (two tensors, each with its grid of short last blocks) stacked into gate_up."""
    gen = torch.Generator().manual_seed(1)
    block = (12, 20)
    gate, up = (fp8_quantize(torch.randn(16, 32, generator=gen), block) for _ in range(2))
    stacked = dequantize_fp8(torch.cat([gate[0], up[0]]), torch.cat([gate[1], up[1]]), block, 2, torch.float32)
    assert torch.equal(stacked, torch.cat([fp8_reference(*gate, block), fp8_reference(*up, block)]))


def test_mxfp4_decoding_is_the_definition_bit_for_bit():
    weight = torch.randn(8, 96, generator=torch.Generator().manual_seed(2)) * torch.logspace(-3, 2, 8)[:, None]
    blocks, scales = mxfp4_quantize(weight)
    want = mxfp4_reference(blocks, scales)
    assert torch.equal(dequantize_mxfp4(blocks.reshape(8, -1), scales, torch.float32), want)
    assert torch.equal(dequantize_mxfp4(blocks.reshape(8, -1), scales, torch.bfloat16), want.bfloat16())
    assert (want - weight).abs().max() < 0.25 * weight.abs().amax()  # the encoder is sane: e2m1 steps ≤ 1/4 of 2^2


def test_mxfp4_decoding_covers_every_byte_and_scale():
    """All 256 bytes of values under all 255 finite e8m0 scales (2^-127 .. 2^127; large ones overflow to inf alike)."""
    blocks = torch.arange(256, dtype=torch.uint8).repeat(255, 1).reshape(255, 16, 16)  # 16 rows of 32 per scale
    scales = torch.arange(255, dtype=torch.uint8)[:, None].repeat(1, 16)  # [255, 16]
    want = mxfp4_reference(blocks, scales)
    assert torch.equal(dequantize_mxfp4(blocks.reshape(255, -1), scales, torch.float32), want)
    # bfloat16 decodes in bfloat16 (float32's exponent range: the same numbers, subnormals and inf included)
    assert torch.equal(dequantize_mxfp4(blocks.reshape(255, -1), scales, torch.bfloat16), want.bfloat16())
    assert torch.equal(dequantize_mxfp4(blocks.reshape(255, -1), scales, torch.float16), want.half())


# -- the engine against transformers on the decoded weights ---------------------------------------------


def _same_tokens_at_every_cache_size(published, reference):
    first = _engine(published, expert_cache_experts=1)
    total = first.runtime.num_layers * NUM_EXPERTS
    prompt_ids = first.encode(PROMPT)
    expected = reference_greedy(reference, prompt_ids, 12)
    assert len(set(expected)) > 1
    for slots in (1, total // 4, total):
        engine = first if slots == 1 else _engine(published, expert_cache_experts=slots)
        assert greedy(engine, prompt_ids) == expected, f"cache of {slots} experts"
        if slots == 1:
            assert engine.cache_counters()["evictions"] > 0


def test_fp8_deepseek_v3_generates_the_reference_tokens(fp8_folders):
    _same_tokens_at_every_cache_size(*fp8_folders)


def test_fp8_with_whole_blocks_generates_the_reference_tokens(tmp_path):
    _same_tokens_at_every_cache_size(*build_fp8_checkpoint("qwen3_moe", tmp_path, (16, 16)))


def test_mxfp4_gpt_oss_generates_the_reference_tokens(mxfp4_folders):
    _same_tokens_at_every_cache_size(*mxfp4_folders)


# -- the bytes as published ---------------------------------------------------------------------------


def test_fp8_expert_bytes_are_the_published_bytes(fp8_folders):
    published, _ = fp8_folders
    engine = _engine(published)
    info = engine.cache_info()
    assert info["expert_dtype"] == "fp8"
    state = load_file(published / "model.safetensors")
    prefix = "model.layers.1.mlp.experts.3."  # MoE layer 0 (layer 0 is dense)
    views = unpack_expert(engine.loaded.quant, engine.loaded.host.get((0, 3)))
    gate_up = views["gate_up_proj"]
    assert gate_up.packing == "fp8" and gate_up.row_parts == 2 and gate_up.block_rows == 12
    want = torch.cat([state[prefix + "gate_proj.weight"], state[prefix + "up_proj.weight"]])
    assert torch.equal(gate_up.data.view(torch.uint8), want.view(torch.uint8))
    want_scales = torch.cat([state[prefix + "gate_proj.weight_scale_inv"], state[prefix + "up_proj.weight_scale_inv"]])
    assert torch.equal(gate_up.scales, want_scales)
    float_bytes = sum(v.numel() for k, v in state.items() if k.startswith(prefix) and "scale" not in k) * 4
    assert info["bytes_per_expert"] == engine.loaded.quant.nbytes < float_bytes / 3  # float32 → 1 byte + scales


def test_mxfp4_expert_bytes_are_the_published_bytes(mxfp4_folders):
    published, _ = mxfp4_folders
    engine = _engine(published)
    assert engine.cache_info()["expert_dtype"] == "mxfp4"
    state = load_file(published / "model.safetensors")
    views = unpack_expert(engine.loaded.quant, engine.loaded.host.get((1, 5)))
    key = "model.layers.1.mlp.experts.down_proj"
    assert torch.equal(views["down_proj"].data, state[key + "_blocks"][5].reshape(views["down_proj"].data.shape))
    assert torch.equal(views["down_proj"].scales, state[key + "_scales"][5])
    assert torch.equal(views["down_proj_bias"], state[key + "_bias"][5].float())  # bf16 → float32: exact


def test_published_layout_bytes_per_expert():
    """DeepSeek-V3 (H 7168, I 2048, FP8 128 × 128) and GPT-OSS-120B (H = I = 2880, MXFP4) experts."""
    deepseek = [ParamSpec("gate_up_proj", (4096, 7168)), ParamSpec("down_proj", (7168, 2048))]
    layout = plan_published_layout(deepseek, PublishedFormat("fp8", (128, 128)), {"gate_up_proj": 2, "down_proj": 1},
                                   torch.bfloat16)
    weights = 3 * 2048 * 7168
    assert layout.nbytes == weights + 4 * (2 * 16 * 56 + 56 * 16)  # one byte each, a float32 per 128 × 128
    gpt_oss = [ParamSpec("gate_up_proj", (2880, 5760), True), ParamSpec("gate_up_proj_bias", (5760,)),
               ParamSpec("down_proj", (2880, 2880), True), ParamSpec("down_proj_bias", (2880,))]
    layout = plan_published_layout(gpt_oss, PublishedFormat("mxfp4", (1, 32)), {"gate_up_proj": 1, "down_proj": 1},
                                   torch.bfloat16)
    weights = 3 * 2880 * 2880
    biases = 2 * (5760 + 2880)
    assert weights // 2 + weights // 32 + biases <= layout.nbytes < weights // 2 + weights // 32 + biases + 4 * 64


# -- other expert dtypes start from the decoded weights -----------------------------------------------


@pytest.mark.parametrize("which,expert_dtype", [("fp8", "int8"), ("fp8", "int4"), ("mxfp4", "int4")])
def test_quantizing_a_published_checkpoint_quantizes_its_decoded_weights(request, which, expert_dtype):
    """Same bytes as quantizing the float reference: the logits are the same to the bit."""
    published, reference = request.getfixturevalue(f"{which}_folders")
    ours, theirs = (_engine(f, expert_dtype=expert_dtype) for f in (published, reference))
    assert ours.loaded.quant.to_json() == theirs.loaded.quant.to_json()
    ids = torch.tensor([ours.encode(PROMPT)])
    with torch.no_grad():
        assert torch.equal(ours.model(input_ids=ids).logits, theirs.model(input_ids=ids).logits)


@pytest.mark.parametrize("which", ["fp8", "mxfp4"])
def test_bf16_experts_of_a_published_checkpoint_are_its_decoded_weights(request, which):
    published, reference = request.getfixturevalue(f"{which}_folders")
    engine = _engine(published, expert_dtype="bf16", expert_cache_experts=4)
    assert engine.cache_info()["expert_dtype"] == "float32"  # kept in --dtype (float32 on CPU)
    prompt_ids = engine.encode(PROMPT)
    assert greedy(engine, prompt_ids) == reference_greedy(reference, prompt_ids, 12)


# -- what is refused ------------------------------------------------------------------------------------


def _rewrite(folder, tmp_path, change):
    """A copy of `folder` with its weights changed by `change(state)`."""
    copy = shutil.copytree(folder, tmp_path / "corrupt")
    state = load_file(copy / "model.safetensors")
    change(state)
    save_file(state, str(copy / "model.safetensors"), metadata={"format": "pt"})
    return copy


SCALE = "model.layers.1.mlp.experts.2.up_proj.weight_scale_inv"
BLOCKS = "model.layers.2.mlp.experts.gate_up_proj_blocks"


@pytest.mark.parametrize(
    "which,change,message",
    [
        ("fp8", lambda s: s.pop(SCALE), "up_proj.weight is published quantized \\(fp8\\) but its scales .* missing"),
        ("fp8", lambda s: s.update({SCALE: s[SCALE][:1]}), "its scales are torch.float32 \\[1, 2\\].* needs"),
        ("fp8", lambda s: s.update({SCALE: s[SCALE].half()}), "its scales are torch.float16"),
        ("fp8", lambda s: s.pop(SCALE.replace("_scale_inv", "")), "scales without a fp8 weight"),
        ("mxfp4", lambda s: s.pop(BLOCKS.replace("blocks", "scales")), "gate_up_proj_scales are missing"),
        ("mxfp4", lambda s: s.update({BLOCKS: s[BLOCKS][..., :8].contiguous()}), "is not MXFP4 blocks"),
        ("mxfp4", lambda s: s.update({BLOCKS: s[BLOCKS][:4].contiguous(),
                                      BLOCKS.replace("blocks", "scales"): s[BLOCKS.replace("blocks", "scales")][:4]}),
         "fused gate_up_proj has shape \\[4, 64, 32\\]"),
    ],
)
def test_a_corrupt_published_checkpoint_is_refused(request, tmp_path, which, change, message):
    published, _ = request.getfixturevalue(f"{which}_folders")
    with pytest.raises(CheckpointError, match=message):
        _engine(_rewrite(published, tmp_path, change))


def test_float8_weights_without_a_quantization_config_are_refused(fp8_folders, tmp_path):
    copy = shutil.copytree(fp8_folders[0], tmp_path / "noconfig")
    config = json.loads((copy / "config.json").read_text())
    del config["quantization_config"]
    (copy / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="float8 without scales"):
        _engine(copy)


@pytest.mark.parametrize("quantization,accepted", [
    ({"quant_method": "fp8", "weight_block_size": [128, 128]}, True),
    ({"quant_method": "fp8", "weight_block_size": [64, 32], "fmt": "e4m3", "activation_scheme": "dynamic"}, True),
    ({"quant_method": "mxfp4"}, True),
    ({"quant_method": "fp8"}, "needs weight_block_size"),
    ({"quant_method": "fp8", "weight_block_size": [0, 128]}, "needs weight_block_size"),
    ({"quant_method": "fp8", "weight_block_size": [128, 128], "fmt": "e5m2"}, "e4m3 only"),
    ({"quant_method": "gptq", "bits": 4}, "quantized checkpoint \\(gptq\\)"),
    ({"quant_method": "awq"}, "quantized checkpoint \\(awq\\)"),
    ({"quant_method": "bitsandbytes", "load_in_4bit": True}, "quantized checkpoint \\(bitsandbytes\\)"),
    ({"quant_method": "compressed-tensors"}, "quantized checkpoint \\(compressed-tensors\\)"),
])
def test_which_quantization_configs_are_read(fp8_folders, tmp_path, quantization, accepted):
    copy = tmp_path / "config"
    copy.mkdir()
    config = json.loads((fp8_folders[0] / "config.json").read_text())
    (copy / "config.json").write_text(json.dumps({**config, "quantization_config": quantization}))
    if accepted is True:
        assert read_config_dict(copy)["quantization_config"] == quantization
    else:
        with pytest.raises(CheckpointError, match=accepted):
            read_config_dict(copy)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_decoding_on_cuda_is_the_cpu_decoding():
    gen = torch.Generator().manual_seed(3)
    q, scales = fp8_quantize(torch.randn(36, 50, generator=gen), (12, 20))
    blocks, e8m0 = mxfp4_quantize(torch.randn(16, 64, generator=gen))
    for dtype in (torch.float32, torch.bfloat16):
        fp8 = dequantize_fp8(q.cuda(), scales.cuda(), (12, 20), 1, dtype)
        assert torch.equal(fp8.cpu(), dequantize_fp8(q, scales, (12, 20), 1, dtype))
        mx = dequantize_mxfp4(blocks.reshape(16, -1).cuda(), e8m0.cuda(), dtype)
        assert torch.equal(mx.cpu(), dequantize_mxfp4(blocks.reshape(16, -1), e8m0, dtype))
