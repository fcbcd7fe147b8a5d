"""The KV bytes per token the load-time warning counts, against what transformers' cache really holds
after a prefill, for plain, grouped-query and latent (MLA) attention."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from engine.kv_budget import kv_bytes_per_token
from tests.fixtures.models import build_checkpoint, make_config, random_model


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe", "deepseek_v2", "deepseek_v3", "olmoe"])
def test_bytes_per_token_are_what_the_cache_holds(tmp_path, family):
    folder = build_checkpoint(family, tmp_path / family)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    tokens = 7
    with torch.no_grad():
        cache = model(input_ids=torch.arange(1, tokens + 1)[None], use_cache=True).past_key_values
    held = sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values))
    assert kv_bytes_per_token(model.config, torch.float32) * tokens == held


def test_layers_of_their_own_sizes_are_counted_each_by_its_own():
    """Gemma 4's full attention layers have other head sizes and KV heads than its sliding ones."""
    config = make_config("gemma4_text", 1000, 8, 2, 2, torch.float32, attention_k_eq_v=True, global_head_dim=16,
                         num_global_key_value_heads=2)
    model = random_model(config, 0)
    tokens = 3  # within the sliding window: every layer holds them all
    with torch.no_grad():
        cache = model(input_ids=torch.arange(1, tokens + 1)[None], use_cache=True).past_key_values
    held = sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values))
    assert kv_bytes_per_token(config, torch.float32) * tokens == held == tokens * 4 * (2 * 4 * 8 + 2 * 2 * 16)


def test_the_load_warns_when_a_full_context_would_not_fit_in_what_is_free(monkeypatch, caplog):
    from engine.kv_budget import warn_if_context_may_not_fit

    config = make_config("mixtral", 1000, 8, 2, 3, torch.float32)
    per_token = kv_bytes_per_token(config, torch.bfloat16)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (1000 * per_token, 10**12))
    warn_if_context_may_not_fit(config, torch.bfloat16, 1000, torch.device("cuda"))
    warn_if_context_may_not_fit(config, torch.bfloat16, 5000, torch.device("cpu"))  # the CPU's KV is in RAM
    assert caplog.text == ""
    warn_if_context_may_not_fit(config, torch.bfloat16, 4000, torch.device("cuda"))
    assert "a conversation past about 1000 tokens may run out of device memory" in caplog.text
