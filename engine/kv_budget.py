"""The KV cache a context needs on the device: the share of device memory set aside for it when the
expert cache is sized from free memory, and a warning at load when a full context would not fit in what
the model left free (the cache grows with each token; running out mid-request is a 503)."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from transformers import PretrainedConfig

log = logging.getLogger(__name__)
GIB = 2**30
# Without --max-model-len the KV cache gets at most this share of the device memory it shares with the
# expert cache: every slot it takes is an expert fewer for every token, and most chats are short (Ollama
# and LM Studio default to a few thousand tokens of context for the same reason).
DEFAULT_KV_SHARE = 1 / 8
MIN_DEFAULT_CONTEXT = 4096  # tokens: the default context is never cut below this
CONTEXT_STEP = 1024  # a cut default context is a multiple of this


def model_max_len(config: PretrainedConfig) -> int:
    return int(getattr(config.get_text_config(), "max_position_embeddings", None) or 4096)


@dataclass(frozen=True)
class ContextNeed:
    """What the KV cache of one context costs, and how long a context the user asked for."""

    bytes_per_token: int
    model_max: int  # the model's max_position_embeddings
    requested: int | None = None  # --max-model-len

    @classmethod
    def of(cls, config: PretrainedConfig, dtype: torch.dtype, requested: int | None) -> ContextNeed:
        return cls(kv_bytes_per_token(config, dtype), model_max_len(config), requested)

    def tokens_to_reserve(self, room: int, all_experts: int) -> int:
        """The context whose KV cache is set aside from `room` bytes of device memory (what the dense
        weights and the headroom leave; `all_experts`: the bytes of every expert): the one asked for, else
        as much of the model's as `DEFAULT_KV_SHARE` of the room holds, or all that every expert leaves."""
        if self.requested is not None:
            return self.requested
        kv_room = max(int(room * DEFAULT_KV_SHARE), room - all_experts)
        tokens = kv_room // self.bytes_per_token // CONTEXT_STEP * CONTEXT_STEP
        return min(self.model_max, max(MIN_DEFAULT_CONTEXT, tokens))


def kv_bytes_per_token(config: PretrainedConfig, dtype: torch.dtype) -> int:
    """Bytes one token adds to transformers' cache, over all layers, each with its own sizes where the config
    gives layers their own (Gemma 4's full attention layers: other head sizes and KV heads). Multi-head latent
    attention (DeepSeek-V2/V3) caches the compressed latent and the shared rotary key. Layers with a sliding
    window or linear attention are counted as full ones: an upper bound."""
    text = config.get_text_config()
    layers = getattr(text, "per_layer_config", None) or [text] * text.num_hidden_layers
    return sum(_kv_values_per_token(layer) for layer in layers) * dtype.itemsize


def _kv_values_per_token(layer: PretrainedConfig) -> int:
    """Values one token adds to the cache of a layer of config `layer`."""
    if getattr(layer, "kv_lora_rank", None) and getattr(layer, "qk_rope_head_dim", None):  # MLA
        return layer.kv_lora_rank + layer.qk_rope_head_dim
    heads = layer.num_attention_heads
    kv_heads = getattr(layer, "num_key_value_heads", None) or heads
    head_dim = getattr(layer, "head_dim", None) or layer.hidden_size // heads
    return 2 * kv_heads * head_dim


def warn_if_context_may_not_fit(config: PretrainedConfig, dtype: torch.dtype, max_model_len: int,
                                device: torch.device) -> None:
    if device.type != "cuda":
        return
    per_token = kv_bytes_per_token(config, dtype)
    free, _ = torch.cuda.mem_get_info(device)
    if per_token * max_model_len > free:
        log.warning("a full context of %d tokens needs up to %.1f GiB of KV cache, and %.1f GiB of device memory "
                    "are free after loading: a conversation past about %d tokens may run out of device memory "
                    "(a 503). Lower --max-model-len, or --expert-cache-gb to leave more room",
                    max_model_len, per_token * max_model_len / GIB, free / GIB, free // per_token)
