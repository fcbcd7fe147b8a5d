"""The forward that replaces a family experts module's own when its experts are offloaded.

transformers 5's experts modules are called as `experts(hidden [T, H], top_k_index [T, k],
top_k_weights [T, k]) -> [T, H]`. Here the weights come from expert cache slots instead of
resident parameters, and the math is the family's own: its layout flags (`is_transposed`,
`has_gate`, biases), its gate (`_apply_gate`, e.g. GPT-OSS's clamped SwiGLU) and activation,
as transformers' batched implementation applies them.

At decode (one token) there is no host sync per expert: the step's experts are known on the
host, small experts are stacked and computed in one batched product, large ones one after
another on views of their slots (stacking would copy their weights).

Quantized experts (`--expert-dtype int8|int4`) are computed one by one through the same math:
their weights are `cache.quant.QuantizedWeight`s, which `_linear` multiplies with their kernel.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch

from cache.quant import QuantizedWeight, QuantLayout, runs_on_cpu, unpack_expert
from cache.runtime import ExpertRuntime
from engine.moe_layers import MoELayer

# Experts up to this size are stacked (copied) to compute a decode step in one batched
# product; larger ones are computed on views of their slots, where the copy would cost
# more than the separate kernels it saves.
STACK_MAX_BYTES = {"cuda": 32 << 20, "cpu": 256 << 10}


class OffloadedExperts:
    def __init__(
        self, moe_layer: int, layer: MoELayer, runtime: ExpertRuntime, pool: torch.Tensor, quant: QuantLayout | None = None
    ) -> None:
        self.moe_layer = moe_layer
        self.module = layer.experts
        self.runtime = runtime
        self.pool = pool  # [S, numel]: float weights in `layer.layout`, or uint8 bytes in `quant`'s
        self.quant = quant
        self.slot_params = layer.layout.views(pool) if quant is None else {}  # name → [S, *per-expert shape]
        self.layout = layer.layout
        self.up = "gate_up_proj" if self.module.has_gate else "up_proj"
        small = layer.layout.numel * pool.element_size() <= STACK_MAX_BYTES.get(pool.device.type, 0)
        self.stack = quant is None and small  # quantized weights have no batched kernel
        # the host executor (`--cpu-experts`): the module's own parameters (a post-expert norm) live on the device,
        # and tinygemm's int4 layout has no CPU kernel
        self.host_capable = (
            pool.device.type != "cpu" and not self.module.has_post_expert_norm and (quant is None or runs_on_cpu(quant))
        )

    def install(self) -> None:
        """Drop the module's (empty) per-expert parameters and route its calls here."""
        for name, _ in self.layout.parts:
            del self.module._parameters[name]
        self.module.forward = self.forward

    def forward(self, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        needed, rows = self.runtime.on_routing(self.moe_layer, top_k_index, hidden)
        out = torch.zeros_like(hidden)  # [T, H]

        def compute(turn: Sequence[int], slots: Sequence[int]) -> None:
            if len(rows) == 1:
                self._decode(hidden, rows[0], top_k_weights, dict(zip(turn, slots)), out)
            else:
                self._prefill(hidden, top_k_index, top_k_weights, turn, slots, out)

        on_host = self._on_host(hidden, rows[0], top_k_weights, out) if len(rows) == 1 and self.host_capable else None
        self.runtime.run_step(self.moe_layer, needed, hidden, compute, on_host)
        return out

    def _on_host(self, hidden: torch.Tensor, row: list[int], weights: torch.Tensor, out: torch.Tensor):
        """`compute_on_host(expert, host buffer)` for one decode token: the expert runs on the host
        cores where its weights lie; only the token's hidden state and the output cross the link."""
        x = []

        def compute_on_host(expert: int, buffer: torch.Tensor) -> None:
            if not x:
                x.append(hidden.to("cpu").unsqueeze(0))  # [1, 1, H]; routing already synced the stream
            y = self._experts(x[0], self._expert_params(buffer))[0]  # [1, H] on the host
            k = row.index(expert)
            out.add_((y.to(out.device, non_blocking=True) * weights[:, k, None]).to(out.dtype))

        return compute_on_host

    def measure_host_ms(self, buffer: torch.Tensor, repeats: int = 5) -> float:
        """The time of one expert on one token on the host cores (median of `repeats`), in ms."""
        params = self._expert_params(buffer)
        down = dict(self.layout.parts)["down_proj"]  # [H, I], or [I, H] when transposed
        dtype = buffer.dtype if self.quant is None else self.quant.compute_dtype
        x = torch.randn(1, 1, down[1] if self.module.is_transposed else down[0], dtype=dtype)
        times = []
        for _ in range(repeats + 1):  # the first warms up
            start = time.perf_counter()
            self._experts(x, params)
            times.append((time.perf_counter() - start) * 1e3)
        return sorted(times[1:])[repeats // 2]

    def _decode(
        self, hidden: torch.Tensor, row: list[int], weights: torch.Tensor, slot_of: dict[int, int], out: torch.Tensor
    ) -> None:
        """One token: `row` its k experts (host), `weights` [1, k], `slot_of` the turn's slots."""
        positions = [k for k, expert in enumerate(row) if expert in slot_of]
        if self.stack and len(positions) == len(row):
            slots = [slot_of[e] for e in row]
            params = {name: torch.stack([p[s] for s in slots]) for name, p in self.slot_params.items()}  # [k, ...]
            y = self._experts(hidden.expand(len(row), 1, -1), params)[:, 0]  # [k, H]
            out.add_((y * weights[0, :, None]).sum(0, keepdim=True).to(out.dtype))
            return
        for k in positions:
            y = self._experts(hidden.unsqueeze(0), self._slot_params(slot_of[row[k]]))[0]  # [1, H]
            out.add_((y * weights[:, k, None]).to(out.dtype))

    def _prefill(
        self,
        hidden: torch.Tensor,
        top_k_index: torch.Tensor,
        weights: torch.Tensor,
        turn: Sequence[int],
        slots: Sequence[int],
        out: torch.Tensor,
    ) -> None:
        """Many tokens: expert by expert in ascending order, as transformers' eager path adds them."""
        for expert, slot in zip(turn, slots):
            token_idx, k_pos = torch.where(top_k_index == expert)
            y = self._experts(hidden[token_idx].unsqueeze(0), self._slot_params(slot))[0]  # [t, H]
            out.index_add_(0, token_idx, (y * weights[token_idx, k_pos, None]).to(out.dtype))

    def _slot_params(self, slot: int) -> dict[str, torch.Tensor | QuantizedWeight]:
        """One slot's expert as `_experts` takes it (float: `[1, ...]` views of the slot pool)."""
        if self.quant is None:
            return {name: p[slot : slot + 1] for name, p in self.slot_params.items()}
        return self._expert_params(self.pool[slot])

    def _expert_params(self, buffer: torch.Tensor) -> dict[str, torch.Tensor | QuantizedWeight]:
        """One expert's buffer (a slot or a host buffer) as `_experts` takes it for n = 1: float views
        `[1, ...]`, or quantized weights (with their biases `[1, ...]`)."""
        if self.quant is None:
            return {name: p.unsqueeze(0) for name, p in self.layout.views(buffer).items()}
        views = unpack_expert(self.quant, buffer)
        return {name: v if isinstance(v, QuantizedWeight) else v.unsqueeze(0) for name, v in views.items()}

    def _experts(self, x: torch.Tensor, params: dict[str, torch.Tensor]) -> torch.Tensor:
        """n experts on their tokens: `x` [n, t, H], `params` name → [n, ...] → [n, t, H]."""
        module = self.module
        h = _linear(x, params[self.up], params.get(f"{self.up}_bias"), module.is_transposed)
        h = module._apply_gate(h) if module.has_gate else module.act_fn(h)
        y = _linear(h, params["down_proj"], params.get("down_proj_bias"), module.is_transposed)
        return module.post_expert_norm(y) if module.has_post_expert_norm else y


def _linear(
    x: torch.Tensor, weight: torch.Tensor | QuantizedWeight, bias: torch.Tensor | None, transposed: bool
) -> torch.Tensor:
    """x [n, t, in] by each expert's weight ([n, out, in], or [n, in, out] when `transposed`), or by one
    quantized expert's weight (n = 1; quantized as [out, in] whatever the family stores)."""
    if isinstance(weight, QuantizedWeight):
        y = weight.linear(x)
    else:
        y = torch.matmul(x, weight if transposed else weight.transpose(-1, -2))
    return y if bias is None else y + bias.unsqueeze(-2)

