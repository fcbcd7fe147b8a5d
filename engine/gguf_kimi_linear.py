"""Kimi-Linear (Moonshot's Kimi-Linear-48B-A3B) from llama.cpp's `kimi-linear` GGUF files, read as transformers'
`kimi_linear`: Kimi Delta Attention layers where the file gives a layer no KV heads (`attention.head_count_kv`, per
layer), MLA without rotary elsewhere, both of `attention.head_count` heads; DeepSeek-V3's MoE after the dense first
layers. What llama.cpp's converter (`KimiLinearModel`) changes is undone:
- the short convolutions' kernels, `ssm_conv1d_q/k/v` `[1, C, 1, K]`, joined into the model's one depthwise conv
  `[3C, 1, K]`, as transformers joins a checkpoint's three on load;
- the forget gate's projections and `A` renamed (`ssm_f_a`, `ssm_f_b`, `ssm_a`): mapped here to `forget_gate`;
- `A_log` stored as `-exp(A_log)`, `dt_bias` as `ssm_dt.bias`, MLA's `kv_b_proj` split into `attn_k_b`/`attn_v_b`:
  undone by the common reader (`LegacyNames`), like every other name.
"""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch
from transformers import KimiLinearConfig

from cache.safetensors_index import CheckpointError
from engine.gguf_nemotron_h import per_layer

ARCH = "kimi-linear"
# the keys its config is read from, all of which llama.cpp's converter writes and its loader requires
KEYS = ("block_count", "context_length", "embedding_length", "feed_forward_length", "attention.head_count",
        "attention.head_count_kv", "attention.layer_norm_rms_epsilon", "attention.kv_lora_rank",
        "attention.key_length_mla", "attention.value_length_mla", "rope.dimension_count", "ssm.conv_kernel",
        "kda.head_dim", "expert_count", "expert_used_count", "expert_feed_forward_length", "expert_shared_count",
        "expert_gating_func", "expert_weights_scale")
CONV = re.compile(r"blk\.(?P<layer>\d+)\.ssm_conv1d_(?P<part>[qkv])\.weight")
FORGET_GATE = re.compile(r"blk\.(?P<layer>\d+)\.(?P<leaf>ssm_f_a\.weight|ssm_f_b\.weight|ssm_a)")
FORGET_GATE_PARAMETERS = {"ssm_f_a.weight": "f_a_proj.weight", "ssm_f_b.weight": "f_b_proj.weight", "ssm_a": "A_log"}


def kimi_linear_config(source: Path, key: Callable[..., Any], mla: dict[str, Any]) -> KimiLinearConfig:
    """The config from the file's keys (`key`: its `arch_keys`, every one of `KEYS` there; `mla`: its MLA and MoE
    settings as DeepSeek's layout gives them). The router as llama.cpp's graph runs it whatever the keys say: over all
    experts in one group, its top-k weights renormalised."""
    if int(key("expert_gating_func")) != gguf.ExpertGatingFuncType.SIGMOID:
        raise CheckpointError(f"{source}: its router does not score by a sigmoid (`{ARCH}.expert_gating_func` "
                              f"{key('expert_gating_func')}), the only way transformers' Kimi-Linear scores")
    layers = mla["num_hidden_layers"]
    dense = mla["first_k_dense_replace"]
    kv_heads = per_layer(key("attention.head_count_kv"), layers)
    settings = {name: value for name, value in mla.items()  # MLA without rotary: no rotary settings
                if name not in ("rope_parameters", "head_dim", "n_routed_experts", "first_k_dense_replace")}
    return KimiLinearConfig(**(settings | dict(
        num_local_experts=mla["n_routed_experts"], norm_topk_prob=True, n_group=1, topk_group=1,
        linear_num_heads=mla["num_attention_heads"], linear_head_dim=int(key("kda.head_dim")),
        linear_conv_kernel_dim=int(key("ssm.conv_kernel")),
        layer_types=["full_attention" if heads else "linear_attention" for heads in kv_heads],
        mlp_layer_types=["dense" if i < dense else "sparse" for i in range(layers)],
        pad_token_id=None, bos_token_id=None, eos_token_id=None)))  # the file's vocabulary's, not Kimi's defaults


class KimiLinearNames:
    """GGUF tensor → Kimi-Linear parameter, with llama.cpp's changes undone (see the module); `base` maps the rest.
    A file with a tensor of no parameter (Kimi K3's output gate, latent experts, attention residuals, which llama.cpp
    reads under the same architecture) or without one of a joined kernel's parts is refused by its name."""

    def __init__(self, source: Path, config: KimiLinearConfig, base, tensor_names: list[str]) -> None:
        self.config, self.base = config, base
        self.pending: dict[str, dict[str, torch.Tensor]] = defaultdict(dict)  # a layer's conv kernels until all came
        unknown = [name for name in tensor_names if self.target(name) is None]
        if unknown:
            raise CheckpointError(f"{source}: its tensors {', '.join(unknown[:4])} have no parameter in transformers' "
                                  f"Kimi-Linear, which cannot run the model they belong to")
        names = set(tensor_names)
        missing = [f"blk.{i}.ssm_conv1d_{part}.weight" for i, kind in enumerate(config.layer_types)
                   if kind == "linear_attention" for part in "qkv" if f"blk.{i}.ssm_conv1d_{part}.weight" not in names]
        if missing:
            raise CheckpointError(f"{source}: the GGUF file has no tensor {', '.join(missing[:4])}, of which the "
                                  f"short convolution's kernel is joined")

    def target(self, name: str) -> str | None:
        if m := CONV.fullmatch(name):
            return f"model.layers.{m['layer']}.self_attn.conv1d.weight"
        if m := FORGET_GATE.fullmatch(name):
            return f"model.layers.{m['layer']}.self_attn.forget_gate.{FORGET_GATE_PARAMETERS[m['leaf']]}"
        return self.base.target(name)

    def convert(self, name: str, weights: np.ndarray) -> torch.Tensor | None:
        if m := CONV.fullmatch(name):
            parts = self.pending[m["layer"]]
            parts[m["part"]] = torch.from_numpy(weights).reshape(-1, 1, self.config.linear_conv_kernel_dim)
            if len(parts) < 3:
                return None
            del self.pending[m["layer"]]
            return torch.cat([parts["q"], parts["k"], parts["v"]])
        return self.base.convert(name, weights)  # `ssm_a`: A_log back from -exp(A_log)

    def check_expert(self, name: str) -> None:
        self.base.check_expert(name)
