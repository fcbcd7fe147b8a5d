"""GGUF files (llama.cpp's and Ollama's format) are served: converted once into a Hugging Face folder, token-
identical to the model they were written from, with the file's tokenizer and chat template; what cannot be
served is refused by name, and nothing half-converted is left behind."""

import hashlib
import json
import os
import shutil
from collections import namedtuple

import gguf
import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

import engine.gguf_checkpoint as gguf_checkpoint
import engine.gguf_sources as gguf_sources
from cache.quant import dequantize, quantize, unpack_expert
from cache.safetensors_index import CheckpointError
from engine.api import GenerationRequest, SamplingParams
from engine.checkpoint import checkpoint_digest, resolve_model_path
from engine.config import EngineConfig
from engine.demo_model import gguf_location
from engine.engine import Engine
from engine.moe_layers import find_moe_layers
from engine.paths import state_dir
from server.testing import RemoteServer
from tests.fixtures.gguf_files import (
    GGUF_ARCH,
    VOCAB,
    chat_template_of,
    quantize_q4_k,
    tiny_gguf_model,
    write_gguf,
    write_ollama_gpt_oss,
    write_ollama_llama4,
    write_ollama_nemotron_h,
    write_relabelled,
)
from tests.fixtures.models import make_config, random_model

NEW_TOKENS = 12
PROMPT = "The quick brown fox jumps over the lazy dog, then"


def greedy(engine: Engine, prompt_ids: list[int]) -> list[int]:
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
    return [t for e in engine.generate(GenerationRequest("gguf", prompt_ids, params)) for t in e.token_ids]


def transformers_greedy(model: torch.nn.Module, prompt_ids: list[int]) -> list[int]:
    input_ids = torch.tensor([prompt_ids])
    with torch.no_grad():
        out = model.generate(input_ids, attention_mask=torch.ones_like(input_ids), do_sample=False,
                             max_new_tokens=NEW_TOKENS, eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt_ids):].tolist()


def load(path, slots: int, expert_dtype: str = "auto") -> Engine:
    return Engine.load(EngineConfig(model=str(path), device="cpu", policy="lru", expert_cache_experts=slots,
                                    expert_dtype=expert_dtype))


def assert_serves_tokens_of(path, model: torch.nn.Module, expert_dtype: str = "auto") -> Engine:
    """The GGUF file `path`, served at 3 cache slots, gives `model`'s greedy tokens; the engine, for more checks."""
    engine = load(path, 3, expert_dtype)
    prompt_ids = engine.encode(PROMPT)
    assert greedy(engine, prompt_ids) == transformers_greedy(model, prompt_ids), path.name
    return engine


def converted_folders():
    return sorted((state_dir() / "gguf").glob("*")) if (state_dir() / "gguf").exists() else []


@pytest.fixture
def own_state_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("MOE_SERVE_STATE_DIR", str(tmp_path / "state"))
    return tmp_path / "state"


@pytest.mark.parametrize("family", sorted(GGUF_ARCH))
def test_a_gguf_file_gives_the_tokens_of_the_model_it_was_written_from(family, tmp_path):
    model = tiny_gguf_model(family)
    path = write_gguf(model, tmp_path / f"{family}.gguf")
    for slots in (1, 3, 2 * 8):  # one slot, a partial cache, every expert of both MoE layers
        engine = load(path, slots)
        prompt_ids = engine.encode(PROMPT)
        assert greedy(engine, prompt_ids) == transformers_greedy(model, prompt_ids), f"{slots} slots"
        assert engine.loaded.config.model_type == family


def file_experts(path, model: torch.nn.Module, per_expert: bool = False) -> torch.nn.Module:
    """A copy of `model` whose experts are the GGUF file's, as gguf-py decodes them (what serving it must compute)."""
    stored = {t.name: t for t in gguf.GGUFReader(path).tensors}

    def decoded(layer: int, weight: str) -> torch.Tensor:  # [E, rows, columns]
        names = ([f"blk.{layer}.ffn_{weight}.{e}.weight" for e in range(model.config.num_local_experts)]
                 if per_expert else [f"blk.{layer}.ffn_{weight}_exps.weight"])
        return torch.cat([torch.from_numpy(gguf.dequantize(stored[n].data, stored[n].tensor_type)).view(
            -1, *stored[n].data.shape[-2:-1], int(stored[n].shape[0])) for n in names])

    copy = type(model)(model.config)
    copy.load_state_dict(model.state_dict())
    copy.eval()
    for i, layer in enumerate(copy.model.layers):
        experts = getattr(getattr(layer, "mlp", None) or layer.feed_forward, "experts", None)  # Llama 4: feed_forward
        if experts is None:  # a dense layer (DeepSeek's first)
            continue
        gate, up, down = decoded(i, "gate"), decoded(i, "up"), decoded(i, "down")  # [E, I, H] × 2, [E, H, I]
        if model.config.model_type == "llama4_text":  # [E, H, 2I], gate's columns first; [E, I, H]
            experts.gate_up_proj.data.copy_(torch.cat([gate, up], dim=1).transpose(1, 2))
            experts.down_proj.data.copy_(down.transpose(1, 2))
        elif experts.is_transposed:  # GPT-OSS: [E, H, 2I], gate and up columns alternating; [E, I, H]
            experts.gate_up_proj.data.copy_(torch.stack([gate, up], dim=2).flatten(1, 2).transpose(1, 2))
            experts.down_proj.data.copy_(down.transpose(1, 2))
        else:
            experts.gate_up_proj.data.copy_(torch.cat([gate, up], dim=1))
            experts.down_proj.data.copy_(down)
    return copy


@pytest.mark.parametrize("expert_type", ["Q8_0", "Q4_1", "Q4_K"])
def test_quantized_experts_are_read_from_the_file_as_it_holds_them(expert_type, tmp_path):
    model = tiny_gguf_model("qwen3_moe", seed=1, width=256 if expert_type == "Q4_K" else None)
    path = write_gguf(model, tmp_path / "q.gguf", expert_type)
    folder = resolve_model_path(str(path))
    written = json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]
    assert written and not any(".experts." in name for name in written)  # the experts stay in the GGUF file
    as_file = file_experts(path, model)
    down = as_file.model.layers[1].mlp.experts.down_proj
    assert not torch.equal(down, model.model.layers[1].mlp.experts.down_proj)  # the file's values, not a float copy

    engine = load(path, 3, expert_dtype="bf16")  # decoded once into the compute dtype (float32 on the CPU)
    assert engine.loaded.quant is not None and engine.loaded.quant.expert_dtype == "float32"
    prompt_ids = engine.encode(PROMPT)
    assert greedy(engine, prompt_ids) == transformers_greedy(as_file, prompt_ids)


@pytest.mark.parametrize("expert_type, form", [("Q8_0", "int8"), ("Q4_K", "int4")])
def test_a_llama4_files_quantized_experts_are_served_as_the_file_holds_them(expert_type, form, tmp_path):
    """Llama 4's experts are held `[E, in, out]` by the model, `[E, out, in]` by the file (Scout's files are mostly
    4-bit K-quants): decoded, they give the tokens of the model holding the file's values; `auto` keeps them small."""
    model = tiny_gguf_model("llama4_text", seed=1, width=256 if expert_type == "Q4_K" else None)
    path = write_gguf(model, tmp_path / "llama4-q.gguf", expert_type)
    assert gguf_checkpoint.gguf_expert_dtype(resolve_model_path(str(path))) == form
    as_file = file_experts(path, model)
    down = as_file.model.layers[1].feed_forward.experts.down_proj
    assert not torch.equal(down, model.model.layers[1].feed_forward.experts.down_proj)
    engine = load(path, 3, expert_dtype="bf16")  # the file's values, decoded once into float32
    prompt_ids = engine.encode(PROMPT)
    assert greedy(engine, prompt_ids) == transformers_greedy(as_file, prompt_ids)
    engine = load(path, 3)  # `auto`: served in the file's size class
    assert engine.loaded.quant.expert_dtype == form and len(greedy(engine, prompt_ids)) == NEW_TOKENS


def test_a_gemma4_files_fused_quantized_experts_are_served_as_the_file_holds_them(tmp_path):
    """Gemma 4's gate and up come fused (`ffn_gate_up_exps`); a 4-bit file is served in 4 bits (`auto`); the
    dense weights, float32 in the file, are computed in float32 though the file's matrices are not all float32."""
    model = tiny_gguf_model("gemma4_text")
    path = write_gguf(model, tmp_path / "gemma4-q4.gguf", "Q4_1")
    assert gguf_checkpoint.gguf_expert_dtype(resolve_model_path(str(path))) == "int4"
    stored = {t.name: t for t in gguf.GGUFReader(path).tensors}
    as_file = type(model)(model.config)
    as_file.load_state_dict(model.state_dict())
    for i, layer in enumerate(as_file.eval().model.layers):
        for weight, param in (("gate_up", layer.experts.gate_up_proj), ("down", layer.experts.down_proj)):
            found = stored[f"blk.{i}.ffn_{weight}_exps.weight"]
            param.data.copy_(torch.from_numpy(gguf.dequantize(found.data, found.tensor_type)).view(param.shape))
    engine = load(path, 3, expert_dtype="bf16")  # the file's values, decoded once into float32
    prompt_ids = engine.encode(PROMPT)
    assert greedy(engine, prompt_ids) == transformers_greedy(as_file, prompt_ids)
    # buffers as transformers holds them in float32, though the config says bfloat16 (the file's quantized experts)
    reference = dict(AutoModelForCausalLM.from_pretrained(resolve_model_path(str(path)), dtype=torch.float32)
                     .named_buffers())
    served = {name: value for name, value in engine.loaded.model.named_buffers() if name in reference}
    assert {"model.embed_tokens.embed_scale", "model.layers.0.layer_scalar"} <= set(served)
    for name, value in served.items():
        assert value.dtype == reference[name].dtype and torch.equal(value, reference[name]), name


@pytest.mark.parametrize("family", ["qwen3_5_moe_text", "deepseek_v3", "glm4_moe", "glm_moe_dsa",
                                    "mimo_v2_flash", "step3p5"])
def test_a_file_with_a_multi_token_prediction_block_is_served_without_it(family, tmp_path, caplog):
    """Qwen3.5's, GLM's (GLM-4.7-Flash's in DeepSeek's layout), MiMo-V2-Flash's and Step-3.5-Flash's files
    may end with a multi-token-prediction block; GLM-5's always do."""
    model = tiny_gguf_model(family, seed=9)
    layers = model.config.get_text_config().num_hidden_layers  # Step's: inside its composite
    path = write_gguf(model, tmp_path / "mtp.gguf", "Q8_0", mtp_block=True)
    assert f"blk.{layers}.ffn_gate_exps.weight" in {t.name for t in gguf.GGUFReader(path).tensors}
    with caplog.at_level("WARNING", logger="engine.gguf_checkpoint"):
        engine = load(path, 3)
    assert f"not used by {family}" in caplog.text and engine.loaded.config.num_hidden_layers == layers
    assert engine.loaded.quant.expert_dtype == "int8" and len(engine.loaded.moe_layers) == len(find_moe_layers(model))
    prompt_ids = engine.encode(PROMPT)
    assert len(greedy(engine, prompt_ids)) == NEW_TOKENS


@pytest.mark.parametrize("expert_type", ["F32", "Q8_0"])
def test_a_mixtral_file_with_a_tensor_per_expert_is_served(expert_type, tmp_path):
    """llama.cpp wrote Mixtral's experts one tensor each (`ffn_gate.3`) until 2024; many published files still do."""
    model = tiny_gguf_model("mixtral", seed=7)
    path = write_gguf(model, tmp_path / "old-mixtral.gguf", expert_type, per_expert=True)
    assert "blk.0.ffn_gate.7.weight" in {t.name for t in gguf.GGUFReader(path).tensors}
    reference = model if expert_type == "F32" else file_experts(path, model, per_expert=True)
    for slots in (1, 2 * 8):
        engine = load(path, slots, expert_dtype="bf16")
        prompt_ids = engine.encode(PROMPT)
        assert greedy(engine, prompt_ids) == transformers_greedy(reference, prompt_ids), f"{slots} slots"


@pytest.mark.parametrize("expert_type", ["Q4_0", "Q4_1", "Q4_K"])
def test_int4_takes_a_4_bit_files_grid_from_its_blocks(expert_type):
    from engine.gguf_experts import grid_steps

    weight = torch.randn(64, 512).numpy() * 0.02
    qtype = gguf.GGMLQuantizationType[expert_type]
    blocks = quantize_q4_k(weight) if expert_type == "Q4_K" else gguf.quants.quantize(weight, qtype)
    in_file = torch.from_numpy(gguf.dequantize(blocks, qtype))  # [64, 512]
    steps = grid_steps(blocks, expert_type)
    assert steps.shape == (64, 512 // 32)

    def error(scale_dtype: torch.dtype, given: torch.Tensor | None) -> float:
        again = dequantize(*quantize(in_file, "int4", 32, scale_dtype, given), torch.float32)
        return ((again - in_file).norm() / in_file.norm()).item()

    assert error(torch.float32, steps) < 1e-5  # the file's own values, but for float32 rounding
    assert error(torch.bfloat16, steps) < 0.005  # the kernels' bf16 scales and zero points
    if expert_type == "Q4_0":  # no step known: each group's min/max grid, not Q4_0's (symmetric about 0)
        assert error(torch.float32, torch.zeros_like(steps)) > 0.01


@pytest.mark.parametrize("family", ["gpt_oss", "qwen3_moe"])
def test_mxfp4_experts_are_kept_as_the_file_holds_them(family, tmp_path):
    """GPT-OSS files hold their experts in MXFP4, as llama.cpp's MXFP4_MOE files of any model do: served in those
    4-bit codes and scales, not rounded onto int4's grid; GPT-OSS's gate and up rows interleaved again and its
    weights `[in, out]`, as the model holds them."""
    model = tiny_gguf_model(family, seed=11)
    path = write_gguf(model, tmp_path / "mxfp4.gguf", "MXFP4")
    as_file = file_experts(path, model)
    for slots in (1, 2 * 8):
        engine = load(path, slots)
        assert engine.loaded.quant.expert_dtype == "mxfp4"
        prompt_ids = engine.encode(PROMPT)
        assert greedy(engine, prompt_ids) == transformers_greedy(as_file, prompt_ids), f"{slots} slots"
    assert engine.loaded.config.rope_parameters == model.config.rope_parameters  # GPT-OSS: YaRN, from the file
    with engine.loaded.host.hold((1, 5)) as buffer:
        gate_up = unpack_expert(engine.loaded.quant, buffer)["gate_up_proj"].dequantize(torch.float32)  # [2I, H]
    held = as_file.model.layers[1].mlp.experts.gate_up_proj[5].detach()
    assert torch.equal(gate_up, held.t() if family == "gpt_oss" else held)  # the file's values exactly
    as_float = load(path, 3, expert_dtype="bf16")  # float32 on the CPU
    assert engine.loaded.host.bytes_per_expert * 5 < as_float.loaded.host.bytes_per_expert


@pytest.mark.parametrize("family", ["deepseek_v2", "deepseek_v3", "mistral4", "glm_moe_dsa"])
def test_a_deepseek_file_in_mlas_absorbed_form_is_served(family, tmp_path, caplog):
    """llama.cpp writes DeepSeek's attention since 2025 (and GLM-5's always) for MLA's absorbed form: `kv_b_proj`
    split into `attn_k_b` (transposed per head) and `attn_v_b`, one KV head of kv_lora + rope dimensions; joined
    again here."""
    model = tiny_gguf_model(family, seed=13)
    path = write_gguf(model, tmp_path / "mla.gguf", "Q8_0", split_kv_b=True)
    assert "blk.0.attn_k_b.weight" in {t.name for t in gguf.GGUFReader(path).tensors}
    with caplog.at_level("WARNING", logger="engine.gguf_checkpoint"):
        engine = load(path, 3, expert_dtype="bf16")
    assert "not used" not in caplog.text
    assert engine.loaded.config.model_type == family
    prompt_ids = engine.encode(PROMPT)
    assert greedy(engine, prompt_ids) == transformers_greedy(file_experts(path, model), prompt_ids)


@pytest.mark.parametrize("types_written", [True, False])
def test_a_glm_5_2_file_reuses_the_indexers_top_k_where_it_says(types_written, tmp_path):
    """GLM-5.2 runs its indexer in the first three layers and every fourth after them, the others reusing the last
    top-k: as the file's `indexer.types` says, or, where it names none (as llama.cpp's converter wrote GLM-5.2 from a
    config.json that gives only the pattern's period), as llama.cpp reads a file of its context of 2^20 or more."""
    model = tiny_gguf_model("glm_moe_dsa", seed=3, num_layers=4, max_position_embeddings=2**20,
                            index_topk_freq=4, index_skip_topk_offset=3)
    assert model.config.indexer_types == ["full", "full", "full", "shared"]
    path = write_gguf(model, tmp_path / "glm-5.2.gguf")
    if not types_written:
        path = write_relabelled(path, tmp_path / "untyped.gguf", "glm-dsa", ("glm-dsa.attention.indexer.types",))
    engine = assert_serves_tokens_of(path, model)
    assert engine.loaded.config.indexer_types == model.config.indexer_types


@pytest.mark.parametrize("left_out, keys, says", [
    ("glm-dsa.attention.indexer.top_k", {}, r"lacks the keys glm-dsa\.attention\.indexer\.top_k, which GLM-5's"),
    ("glm-dsa.attention.indexer.types", {"attention.indexer.types": [False, True]}, "names 2 layers, the first shared"),
    ("blk.1.indexer.attn_k.weight", {}, r"no tensor for 1 parameters of glm_moe_dsa "
                                        r"\(model\.layers\.1\.self_attn\.indexer\.wk\.weight\)"),
])
def test_a_glm_dsa_file_lacking_what_glm_5_needs_is_refused_by_name(left_out, keys, says, tmp_path, own_state_dir):
    """A key GLM-5's config is read from, an indexer layout its model cannot run, or an indexer tensor missing."""
    model = tiny_gguf_model("glm_moe_dsa")
    if left_out.startswith("blk."):
        path = write_gguf(model, tmp_path / "glm.gguf", leave_out=left_out)
    else:
        path = write_relabelled(write_gguf(model, tmp_path / "glm.gguf"), tmp_path / "broken.gguf", "glm-dsa",
                                (left_out,), keys)
    with pytest.raises(CheckpointError, match=says):
        resolve_model_path(str(path))
    assert converted_folders() == []


@pytest.mark.parametrize("left_out, keys, renamed, says", [
    ("kimi-linear.kda.head_dim", {}, {}, r"lacks the keys kimi-linear\.kda\.head_dim, which Kimi-Linear's config"),
    ("kimi-linear.expert_gating_func", {"expert_gating_func": 1}, {},
     r"does not score by a sigmoid \(`kimi-linear\.expert_gating_func` 1\)"),
    ("blk.0.ssm_conv1d_k.weight", {}, {}, r"no tensor blk\.0\.ssm_conv1d_k\.weight, of which the short convolution"),
    (None, {}, {"blk.1.attn_q.weight": "blk.1.attn_gate.weight"},
     r"its tensors blk\.1\.attn_gate\.weight have no parameter in transformers' Kimi-Linear"),
])
def test_a_kimi_linear_file_lacking_what_its_model_needs_is_refused_by_name(left_out, keys, renamed, says, tmp_path,
                                                                           own_state_dir):
    """A key Kimi-Linear's config is read from, a router other than its sigmoid one, one of a linear layer's three
    conv kernels, or a tensor transformers' model has no place for (Kimi K3's output gate)."""
    tensor = left_out if left_out and left_out.startswith("blk.") else None
    path = write_gguf(tiny_gguf_model("kimi_linear"), tmp_path / "kimi.gguf", leave_out=tensor)
    if not tensor:
        path = write_relabelled(path, tmp_path / "broken.gguf", "kimi-linear", (left_out,) if left_out else (), keys,
                                renamed=renamed)
    with pytest.raises(CheckpointError, match=says):
        resolve_model_path(str(path))
    assert converted_folders() == []


def test_a_gpt_oss_files_4_bit_experts_are_stored_on_its_own_grid(tmp_path):
    """int4 of a Q4_0 GPT-OSS file: each group's step taken from the file's block, rows interleaved as the weights'."""
    model = tiny_gguf_model("gpt_oss", seed=12)
    path = write_gguf(model, tmp_path / "q4.gguf", "Q4_0")
    engine = load(path, 3)
    assert engine.loaded.quant.expert_dtype == "int4"
    assert len(greedy(engine, engine.encode(PROMPT))) == NEW_TOKENS
    with engine.loaded.host.hold((0, 2)) as buffer:
        gate_up = unpack_expert(engine.loaded.quant, buffer)["gate_up_proj"]
        stored = gate_up.linear(torch.eye(gate_up.shape[1])).t()  # [2I, H]
    in_file = file_experts(path, model).model.layers[0].mlp.experts.gate_up_proj[2].detach().t()
    assert ((stored - in_file).norm() / in_file.norm()).item() < 0.01


def test_the_tokenizer_and_chat_template_are_the_files(tmp_path):
    path = write_gguf(tiny_gguf_model("qwen3_moe"), tmp_path / "t.gguf")
    folder = resolve_model_path(str(path))
    converted = AutoTokenizer.from_pretrained(folder)
    direct = AutoTokenizer.from_pretrained(gguf_location()[0], gguf_file=gguf_location()[1])
    assert converted.chat_template == chat_template_of(path)
    text = "Hello there! 1234 naïve café\n\tdef f(x): return x ** 2"
    assert converted.encode(text) == direct.encode(text)
    assert converted.eos_token_id == direct.eos_token_id is not None
    engine = load(path, 16)
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    assert "What is the capital of France?" in converted.apply_chat_template(messages, tokenize=False)
    assert engine.loaded.config.eos_token_id == direct.eos_token_id


def test_generation_stops_at_each_id_the_file_says_ends_a_turn(tmp_path):
    direct = AutoTokenizer.from_pretrained(gguf_location()[0], gguf_file=gguf_location()[1])
    end_of_turn = direct.convert_tokens_to_ids("<|endoftext|>")
    assert end_of_turn != direct.eos_token_id
    path = write_gguf(tiny_gguf_model("qwen3_moe"), tmp_path / "eot.gguf", end_of_turn=end_of_turn)
    folder = resolve_model_path(str(path))
    assert json.loads((folder / "generation_config.json").read_text())["eos_token_id"] == [
        direct.eos_token_id, end_of_turn]
    assert {direct.eos_token_id, end_of_turn} <= load(path, 16).eos_ids


@pytest.mark.parametrize("family, turn_ends", [("gpt_oss", ["<|return|>", "<|call|>"]),
                                               ("gemma4_text", ["<turn|>", "<|tool_response>"]),
                                               ("llama4_text", ["<|eot|>", "<|eom|>"])])
def test_a_turn_ends_where_the_model_ends_it_though_the_file_does_not_say(family, turn_ends, tmp_path):
    """GPT-OSS's files name only `<|return|>` as their end, a tool call ends with `<|call|>`; Gemma 4's name
    `<eos>`, a turn ends with `<turn|>` and a tool call waits for its result at `<|tool_response>` (the models' own
    generation configs stop there; llama.cpp finds such tokens by their text)."""
    path = write_gguf(tiny_gguf_model(family), tmp_path / "turns.gguf")
    tokenizer = AutoTokenizer.from_pretrained(resolve_model_path(str(path)))
    ends = json.loads((resolve_model_path(str(path)) / "generation_config.json").read_text())["eos_token_id"]
    assert ends == [tokenizer.eos_token_id, *tokenizer.convert_tokens_to_ids(turn_ends)]


def test_a_gemma4_file_keeps_each_kind_of_layer_its_own_attention(tmp_path):
    """Gemma 4's sliding and full attention layers differ in head size, KV heads, rotary base and rotated part, and
    its full layers' keys are their values; its logits are soft-capped (which greedy tokens cannot show)."""
    model = tiny_gguf_model("gemma4_text")
    original = model.config
    converted = AutoConfig.from_pretrained(resolve_model_path(str(write_gguf(model, tmp_path / "gemma4.gguf"))))
    for attribute in ("layer_types", "rope_parameters", "attention_k_eq_v", "sliding_window", "final_logit_softcapping",
                      "num_experts", "top_k_experts", "moe_intermediate_size", "intermediate_size"):
        assert getattr(converted, attribute) == getattr(original, attribute), attribute
    assert [(layer.head_dim, layer.num_key_value_heads) for layer in converted.per_layer_config] == [
        (layer.head_dim, layer.num_key_value_heads) for layer in original.per_layer_config] == [(8, 4), (16, 2)]


def test_a_file_is_converted_once_and_again_when_it_changes(tmp_path, own_state_dir, monkeypatch):
    path = write_gguf(tiny_gguf_model("qwen3_moe"), tmp_path / "once.gguf")
    first = resolve_model_path(str(path))
    assert converted_folders() == [first]

    def no_second_conversion(*args):
        raise AssertionError("converted again")

    with monkeypatch.context() as patch:
        patch.setattr(gguf_checkpoint, "convert_gguf", no_second_conversion)
        assert resolve_model_path(str(path)) == first

    stat = path.stat()
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))  # the file was replaced
    second = resolve_model_path(str(path))
    assert second != first and sorted(converted_folders()) == sorted([first, second])


def test_an_ollama_blob_without_an_extension_is_read_as_gguf(tmp_path):
    model = tiny_gguf_model("qwen2_moe", seed=2)
    blobs = tmp_path / "ollama" / "models" / "blobs"
    blobs.mkdir(parents=True)
    blob = write_gguf(model, blobs / ("sha256-" + "ab" * 32))
    engine = load(blob, 4)
    prompt_ids = engine.encode(PROMPT)
    assert greedy(engine, prompt_ids) == transformers_greedy(model, prompt_ids)


def test_a_llama4_file_keeps_its_layer_kinds_and_rotary_scaling(tmp_path):
    """Llama 4's MoE and dense layers alternate (Maverick) with widths of their own; its unrotated every-fourth layer,
    chunked attention and q/k norm are fixed by llama.cpp for the family; its rotary scaling is kept only as factors,
    which must rotate every pair as the model's own parameters do."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    model = tiny_gguf_model("llama4_text")
    original = model.config
    converted = AutoConfig.from_pretrained(resolve_model_path(str(write_gguf(model, tmp_path / "llama4.gguf"))))
    for attribute in ("moe_layers", "no_rope_layers", "layer_types", "attention_chunk_size", "use_qk_norm",
                      "intermediate_size", "intermediate_size_mlp", "num_local_experts", "num_experts_per_tok",
                      "head_dim", "attn_temperature_tuning", "floor_scale", "attn_scale"):
        assert getattr(converted, attribute) == getattr(original, attribute), attribute
    assert converted.moe_layers == [1, 3] and converted.no_rope_layers == [1, 1, 1, 0]
    assert converted.rope_parameters["rope_type"] == "llama3"
    rotations = [ROPE_INIT_FUNCTIONS["llama3"](config)[0] for config in (original, converted)]
    torch.testing.assert_close(rotations[1], rotations[0], rtol=1e-5, atol=0)


@pytest.mark.parametrize("head_dim, rope", [
    (128, {"factor": 16.0, "low_freq_factor": 1.0, "high_freq_factor": 1.0}),  # Llama 4 Scout: a step
    (128, {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}),  # Llama 3.1: a blend
    (8, {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}),  # one blended frequency
    (64, {"factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 32.0}),
])
def test_llama3_rotary_scaling_is_rebuilt_from_its_factors(head_dim, rope):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from tests.fixtures.gguf_files import llama3_rope_factors

    rope = {"rope_type": "llama3", "rope_theta": 500000.0, "original_max_position_embeddings": 8192, **rope}
    factors = llama3_rope_factors(head_dim, rope).astype(float)
    rebuilt = gguf_checkpoint.llama3_rope(tmp := gguf_checkpoint.Path("x.gguf"), 500000.0, head_dim, factors, 8192)
    assert rebuilt["factor"] == rope["factor"] and rebuilt["original_max_position_embeddings"] == 8192
    configs = [gguf_checkpoint.Llama4TextConfig(head_dim=head_dim, rope_parameters=r) for r in (rope, rebuilt)]
    want, got = (ROPE_INIT_FUNCTIONS["llama3"](config)[0] for config in configs)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=0)
    with pytest.raises(CheckpointError, match="not Llama 3's scaling"):  # factors of another kind
        gguf_checkpoint.llama3_rope(tmp, 500000.0, head_dim, factors[::-1].copy(), 8192)
    with pytest.raises(CheckpointError, match="factors, the model's heads rotate"):  # for another head size
        gguf_checkpoint.llama3_rope(tmp, 500000.0, head_dim, factors[1:], 8192)


def test_ollamas_own_llama4_file_is_served_as_llama_cpps(tmp_path):
    """What `ollama pull llama4` fetches: llama.cpp's tensors, the vision model's beside them, the widths under keys of
    Ollama's own, the split rule unnamed (its model splits as Llama 4's tokenizer does)."""
    model = tiny_gguf_model("llama4_text", seed=2)
    llama_cpp = write_gguf(model, tmp_path / "llama-cpp.gguf", "Q8_0")
    path = write_ollama_llama4(llama_cpp, tmp_path / "ollama.gguf", model.config)
    engine = load(path, 3, expert_dtype="bf16")
    prompt_ids = engine.encode(PROMPT)
    assert greedy(engine, prompt_ids) == transformers_greedy(file_experts(llama_cpp, model), prompt_ids)
    converted = AutoConfig.from_pretrained(resolve_model_path(str(path)))
    assert (converted.intermediate_size, converted.intermediate_size_mlp) == (64, 48)
    split = json.loads((resolve_model_path(str(path)) / "tokenizer.json").read_text())["pre_tokenizer"]
    assert r"\\p{N}{1,3}" in json.dumps(split)  # Llama 4's rule: digits in threes


@pytest.mark.parametrize("ollama", [False, True])
def test_a_qwen3_vl_moe_file_is_served_as_its_text_model(ollama, tmp_path):
    """Qwen3-VL-30B-A3B (`qwen3vlmoe`) is a Qwen3 MoE with rotary sections per position axis, which for text turn as
    Qwen3's; its router always renormalises. Ollama's file holds the vision model beside it, says the router does not
    renormalise (a setting Qwen3-VL's config lacks) and gives the experts' width only by their shape."""
    model = tiny_gguf_model("qwen3_moe", seed=7)
    assert model.config.norm_topk_prob
    qwen3 = write_gguf(model, tmp_path / "qwen3.gguf", "Q8_0")
    if ollama:
        path = write_relabelled(qwen3, tmp_path / "ollama.gguf", "qwen3vlmoe", ("qwen3moe.expert_feed_forward_length",),
                                {"norm_top_k_prob": False, "rope.mrope_section": [2, 1, 1]}, vision=True)
    else:
        path = write_relabelled(qwen3, tmp_path / "llama-cpp.gguf", "qwen3vlmoe", (),
                                {"rope.dimension_sections": [2, 1, 1, 0], "n_deepstack_layers": 3})
    engine = assert_serves_tokens_of(path, file_experts(qwen3, model), expert_dtype="bf16")
    assert engine.loaded.config.model_type == "qwen3_moe"


def test_ollamas_qwen3_next_file_is_told_from_a_qwen35_file(tmp_path):
    """Ollama writes Qwen3-Next under Qwen3.5's architecture (`qwen35moe`), in llama.cpp's Qwen3-Next layout (told by
    its fused `ssm_ba`, where Qwen3.5 has two projections), its multi-token-prediction block after the last layer."""
    model = tiny_gguf_model("qwen3_next", seed=4)
    llama_cpp = write_gguf(model, tmp_path / "llama-cpp.gguf", mtp_block=True)
    path = write_relabelled(llama_cpp, tmp_path / "ollama.gguf", "qwen35moe")
    engine = assert_serves_tokens_of(path, model)
    assert engine.loaded.config.model_type == "qwen3_next"


def test_ollamas_qwen35_file_is_served_as_llama_cpps(tmp_path):
    """Ollama's Qwen3.5 files: llama.cpp's layout, the value-head reordering marked, the vision model's tensors in the
    same file (whose names contain those of the text model's: `v.blk.0.attn_qkv`)."""
    model = tiny_gguf_model("qwen3_5_moe_text", seed=6)
    llama_cpp = write_gguf(model, tmp_path / "llama-cpp.gguf")
    path = write_relabelled(llama_cpp, tmp_path / "ollama.gguf", "qwen35moe", (), {"ssm.v_head_reordered": True},
                            vision=True)
    assert_serves_tokens_of(path, model)


@pytest.mark.parametrize("family, absorbed", [("deepseek_v2", False), ("deepseek_v3", False), ("deepseek_v3", True)])
def test_ollamas_own_deepseek_file_is_served_as_llama_cpps(family, absorbed, tmp_path):
    """Ollama's DeepSeek files (`convert_deepseek2.go`): llama.cpp's keys and tensors, but a query rank of 0 where the
    model projects its queries at once (V2-Lite), and the rotary scaling's keys written, empty, where it has none;
    its GLM-4.7-Flash files (`convert_glm4moelite.go`) hold the attention in MLA's absorbed form, as llama.cpp's do."""
    model = tiny_gguf_model(family, seed=9)
    llama_cpp = write_gguf(model, tmp_path / "llama-cpp.gguf", split_kv_b=absorbed)
    unscaled = model.config.rope_parameters["rope_type"] == "default"
    keys = ({} if model.config.q_lora_rank else {"attention.q_lora_rank": 0}) | (
        {"rope.scaling.type": "", "rope.scaling.factor": 0.0} if unscaled else {})
    path = write_relabelled(llama_cpp, tmp_path / "ollama.gguf", "deepseek2", (), keys)
    assert_serves_tokens_of(path, model)


def test_ollamas_own_lfm2_file_is_served_as_llama_cpps(tmp_path):
    """Ollama's LFM2 MoE files (`convert_lfm2.go`): llama.cpp's layout, but the final norm (`embedding_norm` in the
    checkpoint) as `output_norm`, where llama.cpp names it `token_embd_norm`; no routing keys beyond the sigmoid's."""
    model = tiny_gguf_model("lfm2_moe", seed=5)
    llama_cpp = write_gguf(model, tmp_path / "llama-cpp.gguf")
    path = write_relabelled(llama_cpp, tmp_path / "ollama.gguf", "lfm2moe", ("lfm2moe.expert_weights_norm",
                            "lfm2moe.expert_weights_scale"), renamed={"token_embd_norm.weight": "output_norm.weight"})
    assert_serves_tokens_of(path, model)


def test_an_ollama_qwen3_file_gives_its_experts_width_by_their_shape(tmp_path):
    """Ollama's Qwen3 MoE files (`ollama pull qwen3:30b`) have no `expert_feed_forward_length`, which transformers'
    GGUF reader would leave at the class default (768, Qwen3-30B-A3B's; Qwen3-235B-A22B's is 1536)."""
    model = tiny_gguf_model("qwen3_moe", seed=8)
    qwen3 = write_gguf(model, tmp_path / "qwen3.gguf")
    path = write_relabelled(qwen3, tmp_path / "ollama.gguf", "qwen3moe", ("qwen3moe.expert_feed_forward_length",))
    assert_serves_tokens_of(path, model)


def test_ollamas_own_nemotron_h_file_is_served_as_llama_cpps(tmp_path):
    """Ollama's own Nemotron-H files: llama.cpp's tensors with q/k rows in the checkpoint's order (no
    rotary: either order gives the same attention); Nemotron 3 Super's latent projections under Ollama's names; the
    split rule unnamed, where Ollama's model splits as Qwen2's rule does."""
    model = tiny_gguf_model("nemotron_h", seed=3, moe_latent_size=16)
    llama_cpp = write_gguf(model, tmp_path / "llama-cpp.gguf")
    path = write_ollama_nemotron_h(llama_cpp, tmp_path / "ollama.gguf", model.config)
    for source in (llama_cpp, path):
        assert_serves_tokens_of(source, model)
    split = json.loads((resolve_model_path(str(path)) / "tokenizer.json").read_text())["pre_tokenizer"]
    assert r"\\p{N}|" in json.dumps(split)  # Qwen2's rule: digits one by one


def test_a_granite4_file_says_whether_its_attention_rotates(tmp_path):
    """Granite 4's hybrid models have no rotary (llama.cpp marks it by `rope.scaling.finetuned` false); the Mamba-2
    layers are where the file gives no KV heads."""
    model = tiny_gguf_model("granitemoehybrid")
    for rotary, expected in ((True, "rope"), (False, "nope")):
        model.config.position_embedding_type = "rope" if rotary else None
        path = write_gguf(model, tmp_path / f"granite4-{expected}.gguf")
        converted = AutoConfig.from_pretrained(resolve_model_path(str(path)))
        assert converted.position_embedding_type == expected
        for attribute in ("layer_types", "mamba_n_heads", "mamba_d_head", "mamba_expand", "mamba_d_state",
                          "mamba_n_groups", "mamba_conv_bias", "shared_intermediate_size", "attention_multiplier"):
            assert getattr(converted, attribute) == getattr(model.config, attribute), attribute


def test_jambas_layer_pattern_is_read_from_where_the_file_has_attention_and_routers():
    """Jamba's config says which layers are attention and MoE only as an offset and a period; the file says it layer by
    layer (KV heads, routers), and a pattern no period gives is refused."""
    source = gguf_checkpoint.Path("jamba.gguf")
    assert gguf_checkpoint._every(source, "MoE", [1, 3, 5, 7], 8) == (1, 2)
    assert gguf_checkpoint._every(source, "attention", [4], 8) == (4, 8)  # Jamba Mini: one in eight
    with pytest.raises(CheckpointError, match=r"MoE layers \[1, 2, 5\] do not repeat"):
        gguf_checkpoint._every(source, "MoE", [1, 2, 5], 8)


def test_a_dense_gguf_is_refused_by_its_architecture(own_state_dir):
    folder, name = gguf_location()  # SmolLM2-135M: a dense llama model
    with pytest.raises(CheckpointError, match=r"'llama'.*not a Mixture-of-Experts family moe-serve serves"):
        resolve_model_path(str(folder / name))
    assert converted_folders() == []  # nothing half-written is left


def test_a_dense_gemma4_file_is_refused_as_dense(tmp_path, own_state_dir):
    """Gemma 4 comes dense too (E4B, 31B), under the same GGUF architecture as its MoE models."""
    config = make_config("gemma4_text", VOCAB, num_experts=None, top_k=None, num_layers=2, dtype=torch.float32,
                         enable_moe_block=False, moe_intermediate_size=None)
    path = write_gguf(random_model(config, 0), tmp_path / "dense.gguf")
    with pytest.raises(CheckpointError, match=r"a dense 'gemma4_text' model \('gemma4' in GGUF\), with no experts"):
        resolve_model_path(str(path))
    assert converted_folders() == []


@pytest.mark.parametrize("arch, says", [
    ("bailingmoe2", "GGUF architecture 'bailingmoe2' is not one moe-serve converts"),
])
def test_an_architecture_not_converted_is_refused_by_name(arch, says, tmp_path, own_state_dir):
    writer = gguf.GGUFWriter(tmp_path / "other.gguf", arch)
    writer.add_block_count(1)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(CheckpointError, match=says):
        resolve_model_path(str(tmp_path / "other.gguf"))
    assert converted_folders() == []


@pytest.mark.parametrize("fused_qkv", [False, True])
def test_ollamas_own_gpt_oss_file_is_served_as_llama_cpps(fused_qkv, tmp_path):
    """What `ollama pull gpt-oss` fetches (`gptoss`: MXFP4 under a type id of Ollama's own, 4, in another code order;
    gate and up fused; from OpenAI's checkpoint q, k and v fused too; other names and keys) serves the same tokens
    as the model in llama.cpp's file, its experts kept in MXFP4 with the same values, its text split by GPT-4o's
    rule, which the file does not name."""
    model = tiny_gguf_model("gpt_oss", seed=11)
    llama_cpp = write_gguf(model, tmp_path / "llama-cpp.gguf", "MXFP4")
    path = write_ollama_gpt_oss(llama_cpp, tmp_path / "ollama.gguf", fused_qkv)
    with pytest.raises(ValueError, match=r"\b4\)? is not a valid GGMLQuantizationType"):
        gguf.GGUFReader(path)
    as_file = file_experts(llama_cpp, model)
    engine = load(path, 3)
    assert engine.loaded.quant.expert_dtype == "mxfp4"
    prompt_ids = engine.encode(PROMPT)
    assert prompt_ids == load(llama_cpp, 3).encode(PROMPT)
    assert greedy(engine, prompt_ids) == transformers_greedy(as_file, prompt_ids)
    assert engine.loaded.config.rope_parameters == model.config.rope_parameters  # YaRN, though the file names none
    with engine.loaded.host.hold((1, 5)) as buffer:
        gate_up = unpack_expert(engine.loaded.quant, buffer)["gate_up_proj"].dequantize(torch.float32)  # [2I, H]
    assert torch.equal(gate_up, as_file.model.layers[1].mlp.experts.gate_up_proj[5].detach().t())
    pieces = engine.tokenizer.backend_tokenizer.pre_tokenizer.pre_tokenize_str("HelloWorld 12345")
    assert [piece for piece, _ in pieces] == ["Hello", "World", "Ġ", "123", "45"]
    as_float = load(path, 3, expert_dtype="bf16")  # the experts decoded from Ollama's code order
    assert greedy(as_float, prompt_ids) == transformers_greedy(as_file, prompt_ids)


def test_a_file_missing_a_tensor_is_refused_before_anything_is_written(tmp_path, own_state_dir, monkeypatch):
    path = write_gguf(tiny_gguf_model("qwen3_moe"), tmp_path / "hole.gguf", leave_out="blk.1.attn_k_norm.weight")
    monkeypatch.setattr(gguf_checkpoint.ShardWriter, "add", lambda *args: pytest.fail("wrote a tensor"))
    with pytest.raises(CheckpointError, match=r"has no tensor for 1 parameters of qwen3_moe "
                                              r"\(model.layers.1.self_attn.k_norm.weight\)"):
        resolve_model_path(str(path))
    assert converted_folders() == []


@pytest.mark.parametrize("key, tensor, says", [
    ("afmoe.expert_shared_count", None, r"has no `afmoe.expert_shared_count`, which its model needs"),
    ("afmoe.attention.sliding_window", None, r"without a sliding window \(`afmoe.attention.sliding_window`\)"),
    ("afmoe.expert_weights_norm", None, r"not renormalised \(`afmoe.expert_weights_norm` false or absent\)"),
    (None, "blk.1.attn_gate.weight", r"no tensor for 1 parameters of afmoe \(model.layers.1.self_attn.gate_proj"),
])
def test_an_afmoe_file_lacking_what_its_model_needs_is_refused_by_name(key, tensor, says, tmp_path, own_state_dir):
    """A Trinity file without a key its model needs (one llama.cpp requires, or one without which llama.cpp would run
    another model than transformers' AFMoE: no window, no renormalised routing) or without a tensor is refused,
    naming what it lacks."""
    path = write_gguf(tiny_gguf_model("afmoe"), tmp_path / "llama-cpp.gguf", leave_out=tensor)
    if key:
        path = write_relabelled(path, tmp_path / "hole.gguf", "afmoe", (key,))
    with pytest.raises(CheckpointError, match=says):
        resolve_model_path(str(path))
    assert converted_folders() == []


@pytest.mark.parametrize("left_out, keys, renamed, says", [
    ("mimo2.attention.sliding_window_pattern", {}, {},
     r"has no `mimo2.attention.sliding_window_pattern`, which its model needs"),
    ("mimo2.attention.head_count_kv", {"attention.head_count_kv": [2, 2, 2]}, {},
     r"\(`mimo2.attention.head_count_kv` \[2, 2, 2\]\) are not one count in full attention layers and twice it"),
    (None, {"expert_weights_scale": 2.5}, {}, r"`mimo2.expert_weights_scale` is 2.5, which llama.cpp's mimo2 ignores"),
    (None, {}, {"blk.1.attn_sinks.weight": "blk.0.attn_sinks.weight"},
     r"its full attention layer 0 has attention sinks \(`blk.0.attn_sinks`\)"),
    (None, {}, {"blk.1.attn_sinks.weight": "blk.1.attn_sink.weight"},
     r"no tensor for 1 parameters of mimo_v2_flash \(model.layers.1.self_attn.sinks\)"),
])
def test_a_mimo2_file_its_model_cannot_run_as_written_is_refused_by_name(left_out, keys, renamed, says, tmp_path,
                                                                        own_state_dir):
    """A MiMo-V2-Flash file without a key llama.cpp requires or a tensor the model needs, or one saying what
    transformers' MiMo-V2-Flash cannot describe (other KV heads than twice a full layer's in a sliding one, sinks in
    a full layer) or llama.cpp would not run as said (a routed scale), is refused, naming it."""
    path = write_gguf(tiny_gguf_model("mimo_v2_flash"), tmp_path / "llama-cpp.gguf")
    path = write_relabelled(path, tmp_path / "broken.gguf", "mimo2", (left_out,) if left_out else (), keys,
                            renamed=renamed)
    with pytest.raises(CheckpointError, match=says):
        resolve_model_path(str(path))
    assert converted_folders() == []


def test_a_mimo2_file_from_before_llama_cpp_wrote_the_value_scale_scales_by_mimo_v2_flashs(tmp_path, caplog):
    """llama.cpp's converter writes `attention.value_scale` since May 2026 and converted MiMo-V2-Flash alone before:
    a file without the key is served with that model's 0.707, as transformers runs it, and says so."""
    model = tiny_gguf_model("mimo_v2_flash", seed=5)
    path = write_relabelled(write_gguf(model, tmp_path / "llama-cpp.gguf"), tmp_path / "older.gguf", "mimo2",
                            ("mimo2.attention.value_scale",))
    with caplog.at_level("WARNING", logger="engine.gguf_checkpoint"):
        assert_serves_tokens_of(path, model)
    assert "no `mimo2.attention.value_scale`" in caplog.text


@pytest.mark.parametrize("left_out, keys, renamed, says", [
    ("step35.attention.sliding_window_pattern", {}, {},
     r"has no `step35.attention.sliding_window_pattern`, which its model needs"),
    ("step35.attention.head_count", {"attention.head_count": [2, 4, 4]}, {},
     r"\(`step35.attention.head_count` \[2, 4, 4\]\) are not one count in full attention layers and one in"),
    ("step35.attention.head_count_kv", {"attention.head_count_kv": [2, 4, 2]}, {},
     r"\(`step35.attention.head_count_kv` \[2, 4, 2\]\) differ between layers"),
    ("step35.attention.value_length", {"attention.value_length": 16}, {},
     r"`step35.attention.value_length` is 16"),
    ("step35.expert_weights_norm", {}, {},
     r"not renormalised \(`step35.expert_weights_norm` false or absent"),
    (None, {"expert_gating_func": 1}, {}, r"does not score by a sigmoid \(`step35.expert_gating_func` 1\)"),
    (None, {"rope.dimension_count": 6}, {},
     r"its full_attention layers would turn 3 of each head's 8 dimensions \(`step35.rope.dimension_count` 6"),
    (None, {}, {"blk.0.attn_q_norm.weight": "rope_freqs.weight"}, r"its rotary is scaled \(`rope_freqs`"),
    (None, {}, {"blk.1.attn_gate.weight": "blk.1.attn_gates.weight"},
     r"no tensor for 1 parameters of step3p5 \(model.language_model.layers.1.self_attn.g_proj.weight\)"),
])
def test_a_step35_file_its_model_cannot_run_as_written_is_refused_by_name(left_out, keys, renamed, says,
                                                                         tmp_path, own_state_dir):
    """A Step-3.5-Flash file without a key llama.cpp requires or a tensor the model needs, or one saying what
    transformers' Step 3.7 cannot describe (head counts varying within a kind of layer, KV heads varying at
    all, value heads of another size, a rotated width it cannot give a full layer, Llama 3's scaled rotary)
    or llama.cpp would run otherwise (top-k weights not renormalised, a softmax router), is refused, naming
    it."""
    path = write_gguf(tiny_gguf_model("step3p5"), tmp_path / "llama-cpp.gguf")
    path = write_relabelled(path, tmp_path / "broken.gguf", "step35", (left_out,) if left_out else (), keys,
                            renamed=renamed)
    with pytest.raises(CheckpointError, match=says):
        resolve_model_path(str(path))
    assert converted_folders() == []


def test_a_step35_files_rotated_width_is_halved_in_full_attention_layers(tmp_path):
    """llama.cpp rotates `rope.dimension_count` (each head's width where absent) in sliding layers and half of
    it in full ones, each kind at its own base: a file naming the count reads as one without it; one of half
    the count rotates half as much in both."""
    model = tiny_gguf_model("step3p5")
    path = write_gguf(model, tmp_path / "llama-cpp.gguf")

    def rope(keys: dict) -> dict:
        rotating = tmp_path / f"rotating-{keys.get('rope.dimension_count')}.gguf"
        relabelled = write_relabelled(path, rotating, "step35", (), keys)
        reader = gguf.GGUFReader(relabelled)
        config = gguf_checkpoint.step35_config(relabelled, reader, {t.name for t in reader.tensors})
        return config.rope_parameters

    assert rope({}) == rope({"rope.dimension_count": 8}) == model.config.get_text_config().rope_parameters | {
        "sliding_attention": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 1.0}}
    halved = rope({"rope.dimension_count": 4})
    shares = [halved[kind]["partial_rotary_factor"] for kind in ("full_attention", "sliding_attention")]
    assert shares == [0.25, 0.5]


def test_a_rotated_share_gives_back_the_dimensions_transformers_rotates():
    """transformers rotates `int(head_dim × partial_rotary_factor)` dimensions; 30 / 88 × 88 falls short of 30."""
    assert int(88 * (30 / 88)) == 29
    assert all(int(h * gguf_checkpoint.rotated_share(r, h)) == r for h in range(2, 513) for r in range(2, h + 1, 2))


def test_a_truncated_gguf_is_refused_and_leaves_nothing(tmp_path, own_state_dir):
    path = write_gguf(tiny_gguf_model("qwen3_moe"), tmp_path / "whole.gguf")
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    with pytest.raises(CheckpointError, match="not a readable GGUF file"):
        resolve_model_path(str(cut))
    assert converted_folders() == []


def test_a_file_that_is_not_gguf_is_refused(tmp_path):
    other = tmp_path / "weights.bin"
    other.write_bytes(b"\x80\x02 not a model")
    with pytest.raises(CheckpointError, match="neither a model folder nor a GGUF file"):
        resolve_model_path(str(other))


def test_too_little_disk_space_is_said_before_writing(tmp_path, own_state_dir, monkeypatch):
    path = write_gguf(tiny_gguf_model("qwen3_moe"), tmp_path / "big.gguf")
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda _: usage(10**9, 10**9 - 1000, 1000))
    with pytest.raises(CheckpointError, match=r"needs .* GiB .* MOE_SERVE_STATE_DIR"):
        resolve_model_path(str(path))
    assert converted_folders() == []


def test_the_server_answers_from_a_gguf_file(tmp_path):
    path = write_gguf(tiny_gguf_model("qwen3_moe"), tmp_path / "served.gguf")
    with RemoteServer(["--model", str(path), "--served-model-name", "tiny-gguf", "--device", "cpu"],
                      env={"OMP_NUM_THREADS": "1"}) as srv, srv.http() as http:
        assert [m["id"] for m in http.get("/v1/models").json()["data"]] == ["tiny-gguf"]
        reply = http.post("/v1/chat/completions", json={
            "model": "tiny-gguf", "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 5,
            "temperature": 0})
        assert reply.status_code == 200, reply.text
        body = reply.json()
        assert body["usage"]["completion_tokens"] >= 1 and body["choices"][0]["message"]["content"]


@pytest.mark.parametrize(("types", "form"), [
    ({"gate": ["Q4_K"], "up": ["Q4_K"], "down": ["Q4_K"]}, "int4"),
    ({"gate": ["Q4_K"], "up": ["Q4_K"], "down": ["Q4_K", "Q6_K"]}, "int4-mixed"),  # llama.cpp's Q4_K_M
    ({"gate": ["Q5_K"], "up": ["Q5_K"], "down": ["Q6_K"]}, "int8"),
    ({"gate": ["Q8_0"], "up": ["Q8_0"], "down": ["Q8_0"]}, "int8"),
    ({"gate": ["IQ2_XXS"], "up": ["IQ2_XXS"], "down": ["Q4_K"]}, "int4"),
    ({"gate": ["MXFP4"], "up": ["MXFP4"], "down": ["MXFP4"]}, "mxfp4"),
    ({"gate": ["MXFP4"], "up": ["MXFP4"], "down": ["Q8_0"]}, "int4-mixed"),
    ({"gate": ["F16"], "up": ["F16"], "down": ["F16"]}, None),
    ({"gate": ["BF16"], "up": ["BF16"], "down": ["Q8_0"]}, None),
])
def test_auto_keeps_a_gguf_files_experts_about_as_small_as_the_file_has_them(types, form, tmp_path):
    (tmp_path / gguf_checkpoint.DONE_MARKER).write_text(json.dumps({"expert_types": types}))
    assert gguf_checkpoint.gguf_expert_dtype(tmp_path) == form


def test_a_folder_not_converted_from_gguf_has_no_gguf_form(tmp_path):
    assert gguf_checkpoint.gguf_expert_dtype(tmp_path) is None


@pytest.mark.parametrize("expert_type, down_type, form", [("Q4_1", None, "int4"), ("Q4_K", "Q8_0", "int4-mixed")])
def test_a_4_bit_files_experts_are_served_in_4_bits_on_the_files_own_grid(expert_type, down_type, form, tmp_path):
    model = tiny_gguf_model("qwen3_moe", seed=3, width=256)
    path = write_gguf(model, tmp_path / "q4.gguf", expert_type, down_type=down_type)
    engine = load(path, 3)
    assert engine.loaded.quant is not None and engine.loaded.quant.expert_dtype == form
    prompt_ids = engine.encode(PROMPT)
    assert len(greedy(engine, prompt_ids)) == NEW_TOKENS
    as_float = load(path, 3, expert_dtype="bf16")
    assert engine.loaded.host.bytes_per_expert * 3 < as_float.loaded.host.bytes_per_expert

    # the stored int4 weights are the file's (bf16 scales aside: the kernels'), where quantizing the original float
    # weights to int4 loses ~8% of them; read back through the kernel, by multiplying with the identity
    key = (0, 0)
    with engine.loaded.host.hold(key) as buffer:
        gate_up = unpack_expert(engine.loaded.quant, buffer)["gate_up_proj"]
        stored = gate_up.linear(torch.eye(gate_up.shape[1])).t()  # [2I, H]
    in_file = file_experts(path, model).model.layers[0].mlp.experts.gate_up_proj[0].detach()
    original = model.model.layers[0].mlp.experts.gate_up_proj[0].detach()
    assert ((stored - in_file).norm() / in_file.norm()).item() < 0.01
    assert ((in_file - original).norm() / original.norm()).item() > 0.05


def test_a_converted_model_whose_gguf_file_is_gone_says_so(tmp_path):
    path = write_gguf(tiny_gguf_model("qwen3_moe", seed=5), tmp_path / "gone.gguf", "Q8_0")
    folder = resolve_model_path(str(path))
    path.rename(tmp_path / "moved.gguf")
    with pytest.raises(CheckpointError, match="gone.gguf.*is gone"):
        load(folder, 3)


def test_a_conversion_holding_float16_experts_says_how_to_reclaim_the_space(tmp_path, own_state_dir, caplog):
    path = write_gguf(tiny_gguf_model("qwen3_moe", seed=8), tmp_path / "older.gguf", "Q8_0")
    folder = resolve_model_path(str(path))
    marker = json.loads((folder / gguf_checkpoint.DONE_MARKER).read_text())
    del marker["experts"]  # as conversions before the experts stayed in the file wrote it
    (folder / gguf_checkpoint.DONE_MARKER).write_text(json.dumps(marker))
    with caplog.at_level("WARNING", logger="engine.gguf_checkpoint"):
        assert resolve_model_path(str(path)) == folder  # still served as it is
    assert "float16 copy of the experts" in caplog.text and str(folder) in caplog.text


def test_two_files_with_the_same_dense_weights_are_two_checkpoints(tmp_path):
    model = tiny_gguf_model("qwen3_moe", seed=6)
    folders = [resolve_model_path(str(write_gguf(model, tmp_path / f"{kind}.gguf", kind))) for kind in ("Q8_0", "Q4_1")]
    dense = [(folder / "model-00001.safetensors").read_bytes() for folder in folders]
    assert dense[0] == dense[1]  # only the experts differ, and they are in the GGUF files
    assert checkpoint_digest(folders[0]) != checkpoint_digest(folders[1])  # so the expert stores are not shared


def test_a_split_model_is_served_from_any_of_its_parts(tmp_path, own_state_dir):
    model = tiny_gguf_model("qwen3_moe", seed=4)
    first = write_gguf(model, tmp_path / "split.gguf", split_max_tensors=8)
    parts = sorted(tmp_path.glob("split-*-of-*.gguf"))
    assert len(parts) >= 3 and first == parts[0]
    assert "output.weight" not in {t.name for t in gguf.GGUFReader(first).tensors}  # only metadata in part 1
    engine = load(parts[2], 3)
    prompt_ids = engine.encode(PROMPT)
    assert greedy(engine, prompt_ids) == transformers_greedy(model, prompt_ids)
    assert resolve_model_path(str(first)) == engine.loaded.folder and len(converted_folders()) == 1


def test_a_missing_part_of_a_split_model_is_named(tmp_path, own_state_dir):
    first = write_gguf(tiny_gguf_model("qwen3_moe"), tmp_path / "gap.gguf", split_max_tensors=8)
    gone = sorted(tmp_path.glob("gap-*-of-*.gguf"))[-1]
    gone.unlink()
    with pytest.raises(CheckpointError, match=f"missing beside it: {gone.name}"):
        resolve_model_path(str(first))
    assert converted_folders() == []


@pytest.fixture
def fake_hub(tmp_path, monkeypatch):
    """The hub repository `owner/Tiny-GGUF`, on local disk: listing and downloads read it (no network)."""
    import huggingface_hub

    snapshot = tmp_path / "hub" / "owner--Tiny-GGUF"
    snapshot.mkdir(parents=True)
    downloads = []

    def list_repo_files(self, repo_id, **kwargs):
        assert repo_id == "owner/Tiny-GGUF"
        return sorted(str(p.relative_to(snapshot)) for p in snapshot.rglob("*") if p.is_file())

    def hf_hub_download(repo_id, filename, **kwargs):
        downloads.append(filename)
        return str(snapshot / filename)

    monkeypatch.setattr(huggingface_hub.HfApi, "list_repo_files", list_repo_files)
    monkeypatch.setattr(huggingface_hub, "hf_hub_download", hf_hub_download)
    (snapshot / "README.md").write_text("a GGUF repository")
    (snapshot / "mmproj-Tiny-F16.gguf").write_bytes(b"GGUF not a language model")
    return snapshot, downloads


def test_a_hub_gguf_is_named_as_llama_cpp_and_ollama_name_it(fake_hub, own_state_dir):
    snapshot, downloads = fake_hub
    model = tiny_gguf_model("qwen3_moe", seed=5)
    write_gguf(model, snapshot / "Tiny-Q8_0.gguf", "Q8_0")
    write_gguf(model, snapshot / "Tiny-Q4_1.gguf", "Q4_1")
    (snapshot / "F32").mkdir()
    write_gguf(model, snapshot / "F32" / "Tiny-F32.gguf", split_max_tensors=10)
    folder = resolve_model_path("owner/Tiny-GGUF:q8_0")
    assert downloads == ["Tiny-Q8_0.gguf"]
    assert resolve_model_path("hf.co/owner/Tiny-GGUF:Q8_0") == folder
    downloads.clear()
    engine = load("owner/Tiny-GGUF:F32", 3)  # a split model in a folder of the repository: every part fetched
    assert downloads == sorted(f"F32/{p.name}" for p in (snapshot / "F32").glob("*.gguf")) and len(downloads) > 1
    prompt_ids = engine.encode(PROMPT)
    assert greedy(engine, prompt_ids) == transformers_greedy(model, prompt_ids)


def test_a_quantization_the_hub_repo_lacks_is_refused_with_what_it_has(fake_hub):
    snapshot, downloads = fake_hub
    (snapshot / "Tiny-Q8_0.gguf").write_bytes(b"GGUF")
    with pytest.raises(CheckpointError, match=r"owner/Tiny-GGUF has no GGUF file for 'Q5_K_M'; it has: Tiny-Q8_0.gguf$"):
        resolve_model_path("owner/Tiny-GGUF:Q5_K_M")
    assert downloads == []


def test_two_models_of_one_quantization_are_told_apart_by_file_name():
    files = ["X-Q4_K_M.gguf", "X-UD-Q4_K_M.gguf", "X-Q8_0.gguf", "README.md"]
    with pytest.raises(CheckpointError, match=r"matches 2 GGUF models .* name one: o/r:FILE.gguf"):
        gguf_sources.pick_gguf_files(files, "Q4_K_M", "o/r")
    assert gguf_sources.pick_gguf_files(files, "X-UD-Q4_K_M.gguf", "o/r") == ["X-UD-Q4_K_M.gguf"]


def test_a_hub_gguf_repository_without_a_quantization_says_how_to_name_one(fake_hub, monkeypatch):
    import huggingface_hub

    snapshot, _ = fake_hub
    (snapshot / "Tiny-Q8_0.gguf").write_bytes(b"GGUF")
    monkeypatch.setattr(huggingface_hub, "snapshot_download", lambda repo, **kwargs: str(snapshot))
    with pytest.raises(CheckpointError, match=r"owner/Tiny-GGUF holds GGUF files: name one of its quantizations, "
                                              r"as in owner/Tiny-GGUF:Q4_K_M \(Tiny-Q8_0.gguf\)$"):
        resolve_model_path("owner/Tiny-GGUF")


def _pull_into_fake_ollama(models_dir, manifest_path: str, gguf_path) -> None:
    """What `ollama pull` leaves: the GGUF as a blob named by its digest, a manifest listing it."""
    blobs = models_dir / "blobs"
    blobs.mkdir(parents=True, exist_ok=True)
    digest = hashlib.sha256(gguf_path.read_bytes()).hexdigest()
    shutil.move(gguf_path, blobs / f"sha256-{digest}")
    manifest = models_dir / "manifests" / manifest_path
    manifest.parent.mkdir(parents=True)
    manifest.write_text(json.dumps({"schemaVersion": 2, "layers": [
        {"mediaType": "application/vnd.ollama.image.model", "digest": f"sha256:{digest}"},
        {"mediaType": "application/vnd.ollama.image.template", "digest": "sha256:" + "0" * 64},
    ]}))


def test_a_model_ollama_pulled_is_served_by_its_ollama_name(tmp_path, monkeypatch):
    models_dir = tmp_path / "ollama-models"
    monkeypatch.setenv("OLLAMA_MODELS", str(models_dir))
    model = tiny_gguf_model("qwen3_moe", seed=6)
    _pull_into_fake_ollama(models_dir, "registry.ollama.ai/library/tiny-moe/latest", write_gguf(model, tmp_path / "a"))
    _pull_into_fake_ollama(models_dir, "hf.co/owner/Tiny-GGUF/Q8_0", write_gguf(model, tmp_path / "b", "Q8_0"))
    engine = load("ollama:tiny-moe", 3)
    prompt_ids = engine.encode(PROMPT)
    assert greedy(engine, prompt_ids) == transformers_greedy(model, prompt_ids)
    assert resolve_model_path("ollama:tiny-moe:latest") == engine.loaded.folder
    assert gguf_checkpoint.gguf_expert_dtype(resolve_model_path("ollama:hf.co/owner/Tiny-GGUF:Q8_0")) == "int8"
    with pytest.raises(CheckpointError, match=r"Ollama has no model 'tiny-moe:7b' on this machine \(`ollama pull tiny-moe:7b`"):
        resolve_model_path("ollama:tiny-moe:7b")
