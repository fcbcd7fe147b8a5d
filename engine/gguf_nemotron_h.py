"""NVIDIA's Nemotron-H MoE models (Nemotron 3 Nano 30B-A3B, Nemotron 3 Super) from `nemotron_h_moe` GGUF files, as
llama.cpp's converter (`NemotronHModel`) and Ollama's (`convert_nemotron_h.go`) write them.

Each layer is one kind, which the file says layer by layer: attention where it gives KV heads, MoE where it gives a
feed-forward width, Mamba-2 elsewhere. The attention has no rotary. The tensor names are gguf-py's for the published
checkpoint, whose parameters lie under `backbone.` where transformers' lie under `model.`. What llama.cpp changes in
the Mamba-2 layers (`A_log`, `D`, the conv kernel, the grouped norm) the common reader undoes for every state-space
family (`LegacyNames`); its q/k row order for rotary, which this family does not use, too (Ollama's files keep the
checkpoint's order: un-permuting them reorders the rows of q and k alike within each head, which leaves every
attention score as it is).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import gguf
import torch
from transformers import NemotronHConfig

from cache.safetensors_index import CheckpointError

ARCH = "nemotron_h_moe"
PUBLISHED_PREFIX = "backbone."  # the checkpoint's prefix of what transformers holds under `model.`
# llama.cpp's names of the latent projections (Nemotron 3 Super) → Ollama's
OLLAMA_NAMES = {"ffn_latent_down": "ffn_latent_in", "ffn_latent_up": "ffn_latent_out"}


def nemotron_h_config(reader, key: Callable[..., Any], sizes: dict[str, Any], tensor_names: set[str]
                      ) -> NemotronHConfig:
    """The config from the file's keys (`key`: its `arch_keys`; `sizes`: the common ones): the layer kinds from the
    per-layer KV heads and widths, the Mamba-2 sizes in llama.cpp's SSM keys, DeepSeek-V3's router settings; a
    multi-token-prediction block after the last layer left out."""
    layers = int(key("block_count")) - int(key("nextn_predict_layers", 0))
    kv_heads, widths = per_layer(key("attention.head_count_kv"), layers), per_layer(key("feed_forward_length"), layers)
    kinds = ["full_attention" if kv_heads[i] else "moe" if widths[i] else "linear_attention" for i in range(layers)]
    inner, ssm_heads = int(key("ssm.inner_size")), int(key("ssm.time_step_rank"))
    first_mamba = kinds.index("linear_attention") if "linear_attention" in kinds else 0
    head_dim = int(key("attention.key_length", sizes["hidden_size"] // sizes["num_attention_heads"]))
    return NemotronHConfig(
        vocab_size=sizes["vocab_size"], hidden_size=sizes["hidden_size"], layers_block_type=kinds,
        num_attention_heads=sizes["num_attention_heads"], num_key_value_heads=sizes["num_key_value_heads"],
        head_dim=head_dim, max_position_embeddings=sizes["max_position_embeddings"],
        layer_norm_epsilon=sizes["rms_norm_eps"],
        mamba_num_heads=ssm_heads, mamba_head_dim=inner // ssm_heads, n_groups=int(key("ssm.group_count")),
        ssm_state_size=int(key("ssm.state_size")), conv_kernel=int(key("ssm.conv_kernel")),
        use_conv_bias=f"blk.{first_mamba}.ssm_conv1d.bias" in tensor_names,
        mamba_proj_bias=f"blk.{first_mamba}.ssm_in.bias" in tensor_names,
        n_routed_experts=int(key("expert_count")), num_experts_per_tok=int(key("expert_used_count")),
        moe_intermediate_size=int(key("expert_feed_forward_length", max(widths))),
        moe_shared_expert_intermediate_size=int(key("expert_shared_feed_forward_length", 0)),
        n_shared_experts=int(key("expert_shared_count", 1)), moe_latent_size=_latent_size(key, reader),
        norm_topk_prob=bool(key("expert_weights_norm", True)),
        routed_scaling_factor=float(key("expert_weights_scale", 1.0)),
        n_group=int(key("expert_group_count", 1)), topk_group=int(key("expert_group_used_count", 1)))


def _latent_size(key: Callable[..., Any], reader) -> int | None:
    """The width the experts compute in (Nemotron 3 Super's latent projections; None: the hidden size), from the
    file's key, or from the projection's shape where Ollama writes no key (`[H, latent]`: columns first)."""
    if (size := key("moe_latent_size")) is not None:
        return int(size)
    latent = next((t for t in reader.tensors if t.name.endswith(("ffn_latent_down.weight", "ffn_latent_in.weight"))),
                  None)
    return int(latent.shape[1]) if latent is not None else None


def per_layer(value: Any, layers: int, source: Path | None = None) -> list:
    """A key llama.cpp writes per layer (or once for all), for the first `layers` layers (a list may go on for the
    multi-token-prediction blocks after them); given the file's `source`, a list of fewer is refused."""
    values = list(value) if isinstance(value, list) else [value] * layers
    if source is not None and len(values) < layers:
        raise CheckpointError(f"{source}: a per-layer key names {len(values)} layers, the model has {layers}")
    return values[:layers]


def published_names(model: torch.nn.Module, num_layers: int) -> dict[str, str]:
    """GGUF tensor → our parameter, by gguf-py's names for the published checkpoint's (`backbone.layers.3.mixer
    .in_proj`): transformers' GGUF name map looks for ours (`model.layers.3...`), which gguf-py does not list."""
    arch = next(a for a, name in gguf.MODEL_ARCH_NAMES.items() if name == ARCH)
    name_map = gguf.get_tensor_name_map(arch, num_layers)
    found = {}
    for ours in model.state_dict():
        base, suffix = ours, ""
        if ours.endswith((".weight", ".bias")):
            base, _, suffix = ours.rpartition(".")
            suffix = "." + suffix
        published = PUBLISHED_PREFIX + base.removeprefix("model.")
        if (name := name_map.get_name(published)) is not None:
            found[name + suffix] = ours
    return found
