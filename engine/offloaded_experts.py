"""The forward that replaces a family experts module's own when its experts are offloaded.

transformers 5's experts modules are called as `experts(hidden [T, H], top_k_index [T, k],
top_k_weights [T, k]) -> [T, H]`. Here the weights come from expert cache slots instead of
resident parameters, and the math is the family's own: its layout flags (`is_transposed`,
`has_gate`, biases), its gate (`_apply_gate`, e.g. GPT-OSS's clamped SwiGLU) and activation,
as transformers' batched implementation applies them.

At decode (one token) there is no host sync per expert: the step's experts are known on the
host, small experts are stacked and computed in one batched product, large ones one after
another on views of their slots (stacking would copy their weights).

Quantized experts (`--expert-dtype int8|int4|int4-mixed`) are computed one by one through the same
math: their weights are `cache.quant.QuantizedWeight`s, which `_linear` multiplies with their kernel.

On CUDA with `--cpu-experts`, a decode step's missed experts may be computed on the host from their
host buffers (`_on_host`), one of them shared: part on the host, part on the device (`_shared`).

A family whose experts class computes around the interface's forward (Ergo: it gives each route a row of
its own, calls the interface's forward with unit weights, then normalizes each route's output with its
expert's own norm and sums them) keeps its forward: this one takes the interface's place below it
(`_below_class_forward`) and returns each route's output (`_forward_routes`).
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch
import torch.nn.functional as F

from cache.quant import (
    BATCH_DEQUANTIZED,
    QuantizedWeight,
    QuantLayout,
    dequantize_slots,
    runs_on_cpu,
    unpack_expert,
)
from cache.runtime import ExpertRuntime
from engine.moe_layers import NO_EXPERT, MoELayer, has_zero_experts

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
        self._slot_views: dict[int, dict[str, torch.Tensor | QuantizedWeight]] = {}  # see `_slot_params`
        self.layout = layer.layout
        self.up = "gate_up_proj" if self.module.has_gate else "up_proj"
        itemsize = pool.element_size() if quant is None else quant.compute_dtype.itemsize
        small = layer.layout.numel * itemsize <= STACK_MAX_BYTES.get(pool.device.type, 0)
        # a decode step's experts in one batched product: float ones, and quantized ones that dequantize (the
        # kernels' layouts, tinygemm's int4 and the CPU's, compute one expert at a time)
        self.stack = small and (quant is None or all(t.packing in BATCH_DEQUANTIZED for t in quant.tensors))
        # the host executor (`--cpu-experts`): the module's own parameters (a post-expert norm) live on the device,
        # and tinygemm's int4 layout has no CPU kernel
        self.host_capable = (
            pool.device.type != "cpu" and not self.module.has_post_expert_norm and (quant is None or runs_on_cpu(quant))
        )
        # a miss shared by host and device splits gate/up by neuron and down by output row: float weights
        # `gate_up_proj [2I, H]` (gate rows, then up rows) and `down_proj [H, I]`, no biases
        self.shareable = (
            quant is None and self.module.has_gate and not self.module.is_transposed
            and [name for name, _ in layer.layout.parts] == ["gate_up_proj", "down_proj"]
        )
        self._share_stream = torch.cuda.Stream(pool.device) if self.shareable and pool.device.type == "cuda" else None
        self.per_route = overrides_interface_forward(type(self.module))
        self.zero_experts = has_zero_experts(layer)

    @property
    def can_share(self) -> bool:
        """Whether a miss can be shared by the host and the device (`cache.miss_planner`)."""
        return self.host_capable and self.shareable

    def install(self) -> None:
        """Drop the module's (empty) per-expert parameters and route its calls here."""
        for name, _ in self.layout.parts:
            del self.module._parameters[name]
        if self.per_route:
            _below_class_forward(self.module, self.forward)
        else:
            self.module.forward = self.forward

    def forward(self, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        live = self.runtime.live_tokens
        if live is not None and self.per_route:  # k rows per token
            k = self.runtime.top_k
            live = (live[:, None] * k + torch.arange(k, device=live.device)).flatten()
        if self.zero_experts:  # routed to a real expert with weight 0: not loaded, computed or recorded
            top_k_index = top_k_index.masked_fill(top_k_weights == 0, NO_EXPERT)
        forward = self._forward_routes if self.per_route else self._forward
        if live is None or len(live) == len(hidden):
            return forward(hidden, top_k_index, top_k_weights)
        # the pads of a batch: their outputs are dropped, so their experts are neither loaded, computed nor recorded
        out = torch.zeros_like(hidden)  # [T, H]
        return out.index_copy_(0, live, forward(hidden[live], top_k_index[live], top_k_weights[live]))

    def _forward(self, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        needed, rows = self.runtime.on_routing(self.moe_layer, top_k_index, hidden)
        out = torch.zeros_like(hidden)  # [T, H]
        by_expert = tokens_by_expert(rows, hidden.device) if len(rows) > 1 else {}

        def compute(turn: Sequence[int], slots: Sequence[int]) -> None:
            if len(rows) == 1:
                self._decode(hidden, rows[0], top_k_weights, dict(zip(turn, slots)), out)
            else:
                self._prefill(hidden, by_expert, top_k_weights, turn, slots, out)

        on_host = self._on_host(hidden, rows[0], top_k_weights, out) if len(rows) == 1 and self.host_capable else None
        self.runtime.run_step(self.moe_layer, needed, hidden, compute, on_host)
        return out

    def _forward_routes(self, hidden: torch.Tensor, route_index: torch.Tensor, route_weights: torch.Tensor) -> torch.Tensor:
        """Each route's output, for a class that computes around the interface: `hidden` [T * k, H] (each token's
        row k times), `route_index` [T * k, 1] and `route_weights` [T * k, 1] (ones) → [T * k, H]. The router's
        decision is recorded per token, as for any family."""
        k = self.runtime.top_k
        tokens = hidden[::k]  # [T, H]
        needed, rows = self.runtime.on_routing(self.moe_layer, route_index.view(-1, k), tokens)
        by_route = tokens_by_expert([[expert] for row in rows for expert in row], hidden.device)
        out = torch.zeros_like(hidden)  # [T * k, H]

        def compute(turn: Sequence[int], slots: Sequence[int]) -> None:
            self._prefill(hidden, by_route, route_weights, turn, slots, out)

        self.runtime.run_step(self.moe_layer, needed, tokens, compute)
        return out

    def _on_host(self, hidden: torch.Tensor, row: list[int], weights: torch.Tensor, out: torch.Tensor):
        """`compute_on_host(expert, host buffer, host fraction)` for one decode token: the expert runs on
        the host cores where its weights lie; only the token's hidden state and the output cross the link.
        A fraction below 1: the expert is shared with the device (`_shared`)."""
        x = []

        def compute_on_host(expert: int, buffer: torch.Tensor, fraction: float = 1.0) -> None:
            if not x:
                x.append(hidden.to("cpu").unsqueeze(0))  # [1, 1, H]; routing already synced the stream
            if fraction < 1:
                y = self._shared(x[0][0], hidden, buffer, fraction)  # [1, H] on the device
            else:
                y = self._experts(x[0], self._expert_params(buffer))[0].to(out.device, non_blocking=True)  # [1, H]
            k = row.index(expert)
            out.add_((y * weights[:, k, None]).to(out.dtype))

        return compute_on_host

    def _shared(self, x_host: torch.Tensor, x_dev: torch.Tensor, buffer: torch.Tensor, fraction: float) -> torch.Tensor:
        """One token through one expert, the host computing `fraction` of its intermediate neurons and
        output rows from its host buffer, the device the rest from a partial copy: `x` [1, H] → [1, H].

        Both sides need every neuron's activation for their output rows, so the two parts of it cross
        the link once (a few kB); the device's weights are copied on a side stream, gate/up first."""
        views = self.layout.views(buffer)
        gate_up, down = views["gate_up_proj"], views["down_proj"]  # [2I, H], [H, I] on the host
        rows, inter = down.shape
        k, r = round(fraction * inter), round(fraction * rows)
        device = x_dev.device
        (gate_d, up_d), gate_up_done = self._copy_to_device([gate_up[k:inter], gate_up[inter + k :]])
        (down_d,), down_done = self._copy_to_device([down[r:]])
        act_host = self._gated(x_host, gate_up[:k], gate_up[inter : inter + k])  # [1, k]
        self._wait(gate_up_done)
        act_dev = self._gated(x_dev, gate_d, up_d)  # [1, I - k]
        act = torch.cat([act_host, act_dev.to("cpu")], dim=-1)  # [1, I]; waits for the device's part
        self._wait(down_done)
        y_dev = F.linear(act.to(device, non_blocking=True), down_d)  # [1, H - r]
        y_host = F.linear(act, down[:r])  # [1, r]
        if down_done is not None:
            down_done.synchronize()  # the host buffer may be recycled once this returns
        return torch.cat([y_host.to(device, non_blocking=True), y_dev], dim=-1)

    def _gated(self, x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        """The gated activation of some neurons: `x` [1, H], `gate`, `up` [n, H] → [1, n]."""
        return self.module._apply_gate(torch.cat([F.linear(x, gate), F.linear(x, up)], dim=-1))

    def _copy_to_device(self, parts: list[torch.Tensor]) -> tuple[list[torch.Tensor], torch.cuda.Event | None]:
        """Host views → device tensors, on the side stream on CUDA; the event marks the copies done."""
        device = self.pool.device
        if self._share_stream is None:
            return [p.to(device) for p in parts], None
        with torch.cuda.stream(self._share_stream):
            copies = [p.to(device, non_blocking=True) for p in parts]
            done = torch.cuda.Event()
            done.record(self._share_stream)
        for c in copies:
            c.record_stream(torch.cuda.current_stream(device))  # used on the compute stream too
        return copies, done

    def _wait(self, done: torch.cuda.Event | None) -> None:
        if done is not None:
            torch.cuda.current_stream(self.pool.device).wait_event(done)

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
            params = self._stacked_params([slot_of[e] for e in row])
            y = self._experts(hidden.expand(len(row), 1, -1), params)[:, 0]  # [k, H]
            out.add_((y * weights[0, :, None]).sum(0, keepdim=True).to(out.dtype))
            return
        for k in positions:
            y = self._experts(hidden.unsqueeze(0), self._slot_params(slot_of[row[k]]))[0]  # [1, H]
            out.add_((y * weights[:, k, None]).to(out.dtype))

    def _prefill(
        self,
        hidden: torch.Tensor,
        by_expert: dict[int, tuple[torch.Tensor, torch.Tensor]],
        weights: torch.Tensor,
        turn: Sequence[int],
        slots: Sequence[int],
        out: torch.Tensor,
    ) -> None:
        """Many tokens: expert by expert in ascending order, as transformers' eager path adds them."""
        for expert, slot in zip(turn, slots):
            token_idx, k_pos = by_expert[expert]
            y = self._experts(hidden[token_idx].unsqueeze(0), self._slot_params(slot))[0]  # [t, H]
            out.index_add_(0, token_idx, (y * weights[token_idx, k_pos, None]).to(out.dtype))

    def _stacked_params(self, slots: list[int]) -> dict[str, torch.Tensor]:
        """The experts in `slots` as `_experts` takes them for n = k: `[k, ...]` copies out of the pool, or
        quantized ones dequantized together (a few kernels per weight for the k, not per expert)."""
        if self.quant is None:
            return {name: torch.stack([p[s] for s in slots]) for name, p in self.slot_params.items()}
        rows = torch.stack([self.pool[s] for s in slots])  # [k, nbytes]
        return dequantize_slots(self.quant, rows, self.quant.compute_dtype)

    def _slot_params(self, slot: int) -> dict[str, torch.Tensor | QuantizedWeight]:
        """One slot's expert as `_experts` takes it (float: `[1, ...]` views of the slot pool). Views, made
        once per slot (unpacking a quantized expert's views takes ~20 µs of Python): a refill of the slot
        writes the bytes they see."""
        params = self._slot_views.get(slot)
        if params is None:
            if self.quant is None:
                params = {name: p[slot : slot + 1] for name, p in self.slot_params.items()}
            else:
                params = self._expert_params(self.pool[slot])
            self._slot_views[slot] = params
        return params

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


def overrides_interface_forward(cls: type) -> bool:
    """Whether `cls` computes around its experts interface's forward (its own forward calls it) rather than
    being called through it: the interface's forward is the one `use_experts_implementation` wraps."""
    return not hasattr(cls.forward, "__wrapped__") and any(hasattr(c.__dict__.get("forward"), "__wrapped__")
                                                           for c in cls.__mro__)


def _below_class_forward(module: torch.nn.Module, forward) -> None:
    """Give `module` a class of its own in which `forward` takes the interface's place: the class's own forward
    still runs, and its call to the interface's (`super().forward`) reaches `forward`."""
    cls = type(module)
    interface = next(c for c in cls.__mro__ if hasattr(c.__dict__.get("forward"), "__wrapped__"))
    offloaded = type(f"Offloaded{interface.__name__}", (interface,), {"forward": lambda _, *args: forward(*args)})
    module.__class__ = type(cls.__name__, (cls, offloaded), {})


def _linear(
    x: torch.Tensor, weight: torch.Tensor | QuantizedWeight, bias: torch.Tensor | None, transposed: bool
) -> torch.Tensor:
    """x [n, t, in] by each expert's weight ([n, out, in], or [n, in, out] when `transposed`), or by one
    quantized expert's weight (n = 1; quantized as [out, in] whatever the family stores)."""
    if isinstance(weight, QuantizedWeight):
        y = weight.linear(x)
    else:
        # bmm, not matmul: with one expert (n = 1) matmul folds the batch away and, in bfloat16 on the CPU, takes
        # a path ~40× slower for the transposed view (a Mixtral expert: ~250 ms instead of ~7 ms on 16 cores)
        y = torch.bmm(x, weight if transposed else weight.transpose(-1, -2))
    return y if bias is None else y + bias.unsqueeze(-2)


def tokens_by_expert(rows: list[list[int]], device: torch.device) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """Each routed expert's (token indices, k positions) on `device`, tokens ascending: what
    `torch.where(top_k_index == expert)` gives, from the host rows, with one copy to the device
    for the layer instead of a device sync per expert."""
    flat = torch.tensor(rows, dtype=torch.int64).flatten()  # [T * k]
    order = torch.argsort(flat, stable=True)  # positions grouped by expert, ascending within each
    counts = torch.bincount(flat[flat >= 0]).tolist()
    order = order.to(device, non_blocking=True)
    k, start, out = len(rows[0]), int((flat < 0).sum()), {}  # the routes to no expert (NO_EXPERT) come first
    for expert, n in enumerate(counts):
        if n:
            positions = order[start : start + n]
            out[expert] = (positions // k, positions % k)
        start += n
    return out
