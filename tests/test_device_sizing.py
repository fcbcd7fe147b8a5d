"""Sizing the device expert cache from free CUDA memory: the dense weights, loaded after the cache,
are left room (without it a real model's dense weights ran out of memory at load)."""

from __future__ import annotations

import pytest
import torch
from accelerate import init_empty_weights
from transformers import AutoConfig, AutoModelForCausalLM

from engine.model_loader import GIB, CacheSizing, _dense_bytes, _device_capacity
from engine.moe_layers import find_moe_layers
from tests.fixtures.models import build_checkpoint


@pytest.mark.parametrize("family", ["mixtral", "deepseek_v3"])
def test_dense_bytes_are_the_parameters_and_buffers_outside_the_experts(tmp_path, family):
    folder = build_checkpoint(family, tmp_path / family)
    with init_empty_weights(include_buffers=False):
        meta = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder))
    layers = find_moe_layers(meta)
    real = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16)
    expert_paths = tuple(layer.path + "." for layer in layers)
    params = sum(p.numel() * p.element_size() for name, p in real.named_parameters()
                 if not name.startswith(expert_paths))
    buffers = sum(b.numel() * b.element_size() for name, b in real.named_buffers() if not name.startswith(expert_paths))
    assert _dense_bytes(meta, layers, torch.bfloat16) == params + buffers
    assert 0 < params < sum(p.numel() * p.element_size() for p in real.parameters())


class Host:
    bytes_per_expert = GIB // 4


def test_free_memory_is_shared_with_the_dense_weights_and_the_headroom(monkeypatch):
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (20 * GIB, 24 * GIB))
    device = torch.device("cuda")
    # 20 GiB free, 2 GiB headroom: 72 experts of 0.25 GiB; 5 GiB of dense weights leave 52
    assert _device_capacity(CacheSizing(), Host(), device, total=1000) == 72
    assert _device_capacity(CacheSizing(), Host(), device, total=1000, dense_bytes=5 * GIB) == 52
    assert _device_capacity(CacheSizing(), Host(), device, total=40, dense_bytes=5 * GIB) == 40
    assert _device_capacity(CacheSizing(device_experts=9), Host(), device, total=1000, dense_bytes=5 * GIB) == 9
    with pytest.raises(ValueError, match="at least one expert"):
        _device_capacity(CacheSizing(), Host(), device, total=1000, dense_bytes=18 * GIB)
