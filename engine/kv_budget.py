"""The KV cache a context needs on the device, and a warning at load when a full context would not
fit in what the model left free (the cache grows with each token; running out mid-request is a 503)."""

from __future__ import annotations

import logging

import torch
from transformers import PretrainedConfig

log = logging.getLogger(__name__)
GIB = 2**30


def kv_bytes_per_token(config: PretrainedConfig, dtype: torch.dtype) -> int:
    """Bytes one token adds to transformers' cache, over all layers. Multi-head latent attention
    (DeepSeek-V2/V3) caches the compressed latent and the shared rotary key. Layers with a sliding
    window or linear attention are counted as full ones: an upper bound."""
    text = config.get_text_config()
    heads = text.num_attention_heads
    if getattr(text, "kv_lora_rank", None) and getattr(text, "qk_rope_head_dim", None):  # MLA
        per_layer = text.kv_lora_rank + text.qk_rope_head_dim
    else:
        kv_heads = getattr(text, "num_key_value_heads", None) or heads
        head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
        per_layer = 2 * kv_heads * head_dim
    return text.num_hidden_layers * per_layer * dtype.itemsize


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
