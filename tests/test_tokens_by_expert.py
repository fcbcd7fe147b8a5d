"""Prefill's per-expert token lists come from the host rows in one pass: the same indices, in the same
order, as `torch.where(top_k_index == expert)` (which costs a device sync per expert on CUDA)."""

from __future__ import annotations

import pytest
import torch

from engine.offloaded_experts import tokens_by_expert


@pytest.mark.parametrize("tokens, k, experts", [(5, 2, 8), (37, 6, 64), (200, 1, 128), (3, 8, 8)])
def test_the_same_tokens_and_positions_as_torch_where(tokens, k, experts):
    g = torch.Generator().manual_seed(tokens)
    top_k_index = torch.stack([torch.randperm(experts, generator=g)[:k] for _ in range(tokens)])  # [T, k]
    by_expert = tokens_by_expert(top_k_index.tolist(), torch.device("cpu"))
    routed = set(top_k_index.flatten().tolist())
    assert set(by_expert) == routed
    for expert in routed:
        token_idx, k_pos = torch.where(top_k_index == expert)
        assert torch.equal(by_expert[expert][0], token_idx) and torch.equal(by_expert[expert][1], k_pos)
