"""The drop-in replacement for a MoE layer's `mlp.experts` module.

Same call as transformers 5's fused experts: `experts(hidden [T, H], top_k_index [T, k],
top_k_weights [T, k]) -> [T, H]`, computed exactly as their eager path does, but each
expert's weights come from a device cache slot instead of a resident parameter.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from cache.host_store import ExpertShape
from cache.quant import QuantLayout, unpack_expert
from cache.runtime import ExpertRuntime


class OffloadedExperts(nn.Module):
    def __init__(
        self,
        moe_layer: int,
        shape: ExpertShape,
        act_fn: Callable[[torch.Tensor], torch.Tensor],
        runtime: ExpertRuntime,
        quant: QuantLayout | None = None,
    ) -> None:
        super().__init__()
        self.quant = quant  # None: slots hold float weights; else quantized bytes in this layout
        self.moe_layer = moe_layer
        self.shape = shape
        self.act_fn = act_fn
        self.runtime = runtime

    def forward(
        self, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        needed, rows = self.runtime.on_routing(self.moe_layer, top_k_index)
        out = torch.zeros_like(hidden)  # [T, H]
        if len(rows) == 1:  # decode: each expert's top-k position is known on the host, no sync per expert
            position = {expert: k for k, expert in enumerate(rows[0])}

            def add(expert: int, flat: torch.Tensor) -> None:
                k = position[expert]
                out.add_((self._expert(flat, hidden) * top_k_weights[:, k, None]).to(out.dtype))
        else:

            def add(expert: int, flat: torch.Tensor) -> None:
                token_idx, k_pos = torch.where(top_k_index == expert)
                y = self._expert(flat, hidden[token_idx]) * top_k_weights[token_idx, k_pos, None]
                out.index_add_(0, token_idx, y.to(out.dtype))

        self.runtime.run_step(self.moe_layer, needed, hidden, add)
        return out

    def _expert(self, flat: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """One expert (`flat`: its slot, gate | up | down) on tokens `x` [t, H] → [t, H], as transformers' eager path."""
        if self.quant is not None:
            weights = unpack_expert(self.quant, flat)
            gate, up = weights["gate_up_proj"].linear(x).chunk(2, dim=-1)
            return weights["down_proj"].linear(self.act_fn(gate) * up)
        h, i = self.shape.hidden, self.shape.intermediate
        gate_up = flat[: 2 * i * h].view(2 * i, h)  # [2I, H]
        down = flat[2 * i * h :].view(h, i)  # [H, I]
        gate, up = F.linear(x, gate_up).chunk(2, dim=-1)
        return F.linear(self.act_fn(gate) * up, down)
