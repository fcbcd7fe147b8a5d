"""Qwen3-Next (e.g. Qwen3-Next-80B-A3B) from llama.cpp's `qwen3next` GGUF files, whose converter changes its
linear-attention layers and norms; each change is undone here:
- `in_proj_qkvz` (per key head: q, k, its value heads' v, their z) split into `attn_qkv` (all q, all k, all v)
  and `attn_gate` (all z);
- every norm but the gated one of the linear attention stored as 1 + w (the model's norms are zero-centred).
The rest maps by the common name map (`LegacyNames`), which also undoes what llama.cpp does to every state-space
layer (`A_log` stored as `ssm_a = -exp(A_log)`, `dt_bias` as `ssm_dt.bias`) and to a squeezed conv kernel.
"""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from transformers import Qwen3NextConfig

QKV_OR_GATE = re.compile(r"blk\.(?P<layer>\d+)\.attn_(?P<part>qkv|gate)\.weight")
PLUS_ONE_NORM = re.compile(r"(blk\.\d+\.(attn_norm|post_attention_norm|attn_q_norm|attn_k_norm)|output_norm)\.weight")


def qwen3next_config(reader, key: Callable[..., Any]) -> Qwen3NextConfig:
    """The config from the file's keys (`key`: `arch_keys` of `qwen3next`): linear-attention sizes in llama.cpp's
    SSM keys, a full attention layer every `full_attention_interval`, rotary on part of each head."""
    head_dim = int(key("attention.key_length"))
    value_heads = int(key("ssm.time_step_rank"))
    interval = int(key("full_attention_interval", 4))
    layers = int(key("block_count")) - int(key("nextn_predict_layers", 0))  # multi-token-prediction blocks come last
    return Qwen3NextConfig(
        vocab_size=len(reader.fields["tokenizer.ggml.tokens"].data), hidden_size=int(key("embedding_length")),
        intermediate_size=int(key("feed_forward_length")), num_hidden_layers=layers,
        num_attention_heads=int(key("attention.head_count")), num_key_value_heads=int(key("attention.head_count_kv")),
        head_dim=head_dim, rms_norm_eps=float(key("attention.layer_norm_rms_epsilon")),
        max_position_embeddings=int(key("context_length")),
        rope_parameters={"rope_type": "default", "rope_theta": float(key("rope.freq_base")),
                         "partial_rotary_factor": int(key("rope.dimension_count")) / head_dim},
        num_experts=int(key("expert_count")), num_experts_per_tok=int(key("expert_used_count")),
        moe_intermediate_size=int(key("expert_feed_forward_length")),
        shared_expert_intermediate_size=int(key("expert_shared_feed_forward_length")), norm_topk_prob=True,
        linear_conv_kernel_dim=int(key("ssm.conv_kernel")), linear_key_head_dim=int(key("ssm.state_size")),
        linear_num_key_heads=int(key("ssm.group_count")), linear_num_value_heads=value_heads,
        linear_value_head_dim=int(key("ssm.inner_size")) // value_heads,
        layer_types=["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(layers)])


class Qwen3NextNames:
    """GGUF tensor → Qwen3-Next parameter, with llama.cpp's changes undone (see the module); `base` maps the rest."""

    def __init__(self, config: Qwen3NextConfig, base) -> None:
        self.config, self.base = config, base
        self.pending: dict[str, dict[str, torch.Tensor]] = defaultdict(dict)  # a layer's qkv until its gate comes

    def target(self, name: str) -> str | None:
        if m := QKV_OR_GATE.fullmatch(name):
            return f"model.layers.{m['layer']}.linear_attn.in_proj_qkvz.weight"
        return self.base.target(name)

    def convert(self, name: str, weights: np.ndarray) -> torch.Tensor | None:
        tensor = torch.from_numpy(weights)
        if m := QKV_OR_GATE.fullmatch(name):
            parts = self.pending[m["layer"]]
            parts[m["part"]] = tensor
            if len(parts) < 2:
                return None
            del self.pending[m["layer"]]
            return self._qkvz(parts["qkv"], parts["gate"])
        if PLUS_ONE_NORM.fullmatch(name):
            return tensor - 1
        return self.base.convert(name, weights)

    def check_expert(self, name: str) -> None:
        self.base.check_expert(name)

    def _qkvz(self, qkv: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        """`in_proj_qkvz` `[key heads × (q + k + v + z), H]` from the two tensors llama.cpp splits it into."""
        config = self.config
        key_heads, key_dim = config.linear_num_key_heads, config.linear_key_head_dim
        value_rows = config.linear_num_value_heads // key_heads * config.linear_value_head_dim  # per key head
        hidden = qkv.shape[-1]
        q, k, v = qkv.split([key_heads * key_dim, key_heads * key_dim, key_heads * value_rows])
        per_head = [q.reshape(key_heads, key_dim, hidden), k.reshape(key_heads, key_dim, hidden),
                    v.reshape(key_heads, value_rows, hidden), gate.reshape(key_heads, value_rows, hidden)]
        return torch.cat(per_head, dim=1).reshape(-1, hidden)
