"""Random-weight checkpoints with the expert sizes of real models, truncated to a few layers.

Written straight to safetensors, one shard per decoder layer, in the fused layout of
transformers 5 (`mlp.experts.gate_up_proj [E, 2I, H]`, `down_proj [E, H, I]`): the
transformers model is built on the meta device only to name the tensors and their
shapes, and each tensor is drawn on `device` (fast on a GPU) and written at once, so
no whole model is ever held in RAM. The tokenizer is byte level (259 tokens), built
from nothing but `tokenizers`: no tokenizer package and no network are needed.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from accelerate import init_empty_weights
from safetensors.torch import save_file
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    GenerationConfig,
    PretrainedConfig,
    PreTrainedTokenizerFast,
)
from transformers.convert_slow_tokenizer import bytes_to_unicode

MAX_POSITIONS = 1024
EMBED_STD = 1.0  # token identity dominates the residual stream, so routing depends on the token


@dataclass(frozen=True)
class ModelShape:
    """A real model's expert size and routing, with fewer layers."""

    name: str
    family: str  # transformers model_type
    hidden: int  # H
    expert_intermediate: int  # I of one routed expert
    num_layers: int  # decoder layers
    num_experts: int
    top_k: int
    heads: int
    kv_heads: int
    dense_layers: int = 0  # leading layers with a dense MLP (DeepSeek's first_k_dense_replace)
    dense_intermediate: int = 0
    shared_experts: int = 0

    @property
    def moe_layers(self) -> int:
        return self.num_layers - self.dense_layers

    @property
    def total_experts(self) -> int:
        return self.moe_layers * self.num_experts

    def expert_bytes(self, dtype: torch.dtype) -> int:
        return 3 * self.hidden * self.expert_intermediate * dtype.itemsize


MIXTRAL = ModelShape("Mixtral-8x7B experts, 4 of 32 layers", "mixtral", hidden=4096, expert_intermediate=14336,
                     num_layers=4, num_experts=8, top_k=2, heads=32, kv_heads=8)  # fmt: skip
DEEPSEEK = ModelShape("DeepSeek-V2-Lite experts, 1 dense + 6 MoE layers", "deepseek_v2", hidden=2048,
                      expert_intermediate=1408, num_layers=7, num_experts=64, top_k=6, heads=16, kv_heads=16,
                      dense_layers=1, dense_intermediate=10944, shared_experts=2)  # fmt: skip
SHAPES = {"mixtral": MIXTRAL, "deepseek": DEEPSEEK}


def tiny(shape: ModelShape) -> ModelShape:
    """The same routing (experts, top-k, shared, dense layers) at a size a CPU test runs in seconds."""
    return replace(shape, name=f"{shape.name} (tiny: H 64)", hidden=64, expert_intermediate=32, heads=4,
                   kv_heads=2 if shape.kv_heads < shape.heads else 4, num_layers=min(shape.num_layers, 3),
                   dense_intermediate=96 if shape.dense_layers else 0)  # fmt: skip


def model_config(shape: ModelShape, vocab_size: int, dtype: torch.dtype) -> PretrainedConfig:
    common = {
        "vocab_size": vocab_size, "hidden_size": shape.hidden, "num_hidden_layers": shape.num_layers,
        "num_attention_heads": shape.heads, "num_key_value_heads": shape.kv_heads,
        "num_experts_per_tok": shape.top_k, "max_position_embeddings": MAX_POSITIONS,
        "tie_word_embeddings": False, "dtype": dtype,
    }  # fmt: skip
    if shape.family == "mixtral":
        family = {"intermediate_size": shape.expert_intermediate, "num_local_experts": shape.num_experts}
    elif shape.family == "deepseek_v2":
        head = shape.hidden // shape.heads  # DeepSeek-V2-Lite: 2048 / 16 → nope 128 + rope 64, v 128
        family = {
            "intermediate_size": shape.dense_intermediate, "moe_intermediate_size": shape.expert_intermediate,
            "n_routed_experts": shape.num_experts, "n_shared_experts": shape.shared_experts,
            "first_k_dense_replace": shape.dense_layers, "kv_lora_rank": 4 * head, "q_lora_rank": None,
            "qk_nope_head_dim": head, "qk_rope_head_dim": head // 2, "v_head_dim": head, "topk_method": "greedy",
        }  # fmt: skip
    else:
        raise ValueError(f"no config for family {shape.family!r}")
    return AutoConfig.for_model(shape.family, **common, **family)


def write_checkpoint(shape: ModelShape, folder: Path, dtype: torch.dtype, device: torch.device, seed: int = 0) -> Path:
    """Config, tokenizer, generation config and random weights of `shape` in `folder`."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer = byte_tokenizer()
    tokenizer.save_pretrained(folder)
    config = model_config(shape, len(tokenizer), dtype)
    config.bos_token_id, config.eos_token_id = tokenizer.bos_token_id, tokenizer.eos_token_id
    config.save_pretrained(folder)
    GenerationConfig(bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id).save_pretrained(folder)
    with init_empty_weights(include_buffers=False):
        skeleton = AutoModelForCausalLM.from_config(config)
    shapes = {name: tuple(t.shape) for name, t in skeleton.state_dict().items()}
    generator = torch.Generator(device).manual_seed(seed)
    weight_map: dict[str, str] = {}
    for shard, names in enumerate(_shards(shapes)):
        file = f"model-{shard + 1:05d}-of-{shape.num_layers + 1:05d}.safetensors"
        tensors = {name: random_tensor(name, shapes[name], dtype, device, generator) for name in names}
        save_file(tensors, str(folder / file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(names, file))
    total = sum(math.prod(s) for s in shapes.values()) * dtype.itemsize
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))
    return folder


def _shards(shapes: dict[str, tuple[int, ...]]) -> list[list[str]]:
    """One shard per decoder layer, then one for the rest (embeddings, final norm, LM head)."""
    layers: dict[int, list[str]] = {}
    rest = []
    for name in shapes:
        parts = name.split(".")
        if parts[:2] == ["model", "layers"]:
            layers.setdefault(int(parts[2]), []).append(name)
        else:
            rest.append(name)
    return [layers[i] for i in sorted(layers)] + [rest]


def random_tensor(name: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device,
                  generator: torch.Generator) -> torch.Tensor:  # fmt: skip
    """Norm weights 1; matrices N(0, 1/fan_in) so activations keep unit scale through the layers."""
    if len(shape) == 1:
        return torch.ones(shape, dtype=dtype)
    std = EMBED_STD if "embed_tokens" in name else shape[-1] ** -0.5
    return torch.empty(shape, dtype=dtype, device=device).normal_(0.0, std, generator=generator).cpu()


def byte_tokenizer() -> PreTrainedTokenizerFast:
    """Byte-level BPE without merges: 256 byte tokens plus <s>, </s> and <pad>."""
    from tokenizers import Tokenizer, decoders, pre_tokenizers
    from tokenizers.models import BPE

    vocab = {char: i for i, char in enumerate(bytes_to_unicode().values())}
    backend = Tokenizer(BPE(vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>", pad_token="<pad>")
