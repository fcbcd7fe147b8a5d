"""Weight-only quantized experts: group-wise int8 (symmetric) and int4 (asymmetric), packed into one flat byte buffer.

A weight `[out, in]` is cut into groups of `group_size` along `in`; each group keeps a scale and a
zero point, and integers `q` such that `w ≈ q * scale + zero`, so every element's error is at most
`scale / 2` (plus the rounding of the zero point to the scale dtype):
- int8: symmetric, `scale = max |w| / 127`, zero 0, `q` in -127..127 (the int8 kernel has no zero point).
- int4: asymmetric, `scale = (max w - min w) / 15`, `zero = min w + 8 * scale`, `q` in -8..7: all 16
  levels span the group's own range; a group whose values already lie on 16 evenly spaced levels (a 4-bit
  GGUF file's, which need not reach the group's max) keeps that grid's step instead: the step the file's block
  states where the caller has it (`steps`), else the one `grid_step` finds. The int4 kernels take a zero point
  beside each scale at no cost, and a symmetric grid wastes a level and half the range on groups that are not
  centred (on the demo model, whose weights come from an asymmetric Q4_1 GGUF, the grids coincide:
  bench/RESULTS.md).

An expert is a list of named tensors (2-D weights are quantized, 1-D biases kept in the compute
dtype) laid out back to back in one uint8 buffer by a `QuantLayout`, so it lives in the host store
and in device slots like any other expert buffer.

How each weight is packed is fixed per device by measurement (`bench/quant_kernels.py` on the
CPU, the H200 figures in the shared measurements for CUDA), and the matmul follows from the packing:
- `int8-cpu`: int8 `[out, in]`, one bf16 scale per output channel, PyTorch's `_weight_int8pack_mm`
  (CPU: 2.8× faster than bf16 `F.linear` with bf16 activations, 4.6× slower with float32 ones,
  so the kernels always get bf16 activations).
- `int8`: int8 `[out, in]`, grouped, dequantized into a scratch weight for `F.linear`: grouped int8
  has no kernel, and on CUDA `_weight_int8pack_mm` is slower than the whole bf16 expert.
- `int4-cpu`: `_convert_weight_to_int4pack_for_cpu` layout for `_weight_int4pack_mm_for_cpu`.
- `int4-cuda`: tinygemm layout (`_convert_weight_to_int4pack`) for `_weight_int4pack_mm`.
- `int4-plain`: two values per byte (even index in the high nibble), dequantized; for shapes or
  group sizes the kernels do not take.
- `fp8`, `mxfp4`: the bytes of a checkpoint published quantized, as published (`cache.quant_formats`),
  dequantized; laid out by `cache.quant_published`.
The kernels compute in bf16 (their scales are bf16), the dequantize paths in the compute dtype.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F

from cache.quant_formats import dequantize_fp8, dequantize_mxfp4, fp8_scale_grid

MIXED = "int4-mixed"  # int4 gate/up, int8 per-channel down_proj (on the demo model all int4 loss is in down_proj)
QUANT_DTYPES = ("int8", "int4", MIXED)
QMAX = {"int8": 127, "int4": 7}
QMIN = {"int8": -127, "int4": -8}
INT4_KERNEL_GROUPS = (32, 64, 128, 256)  # what both int4 kernels accept
ALIGN = 64  # every tensor in a buffer starts on a 64-byte boundary (dtype views, vector loads)
PER_CHANNEL = 0  # group_size meaning "one group per output channel"
# int8: the CPU kernel's form; int4: the smallest group the kernels take, the best quality they reach
# (demo model: perplexity +9.7% at 32, +67% at 64, both 84% token agreement; bench/RESULTS.md "quality")
DEFAULT_GROUP_SIZE = {"int8": PER_CHANNEL, "int4": 32, MIXED: 32}  # MIXED: its int4 weights' group
KERNEL_INT4 = ("int4-cpu", "int4-cuda")
KERNELS = ("int8-cpu", *KERNEL_INT4)  # packings computed by a PyTorch kernel, in bf16
PUBLISHED_SCALE_DTYPES = {"fp8": torch.float32, "mxfp4": torch.uint8}  # as the checkpoints publish them


@dataclass(frozen=True)
class ParamSpec:
    """One expert parameter as it lies in the checkpoint.

    `transposed`: a 2-D weight stored `[in, out]` (computed as `x @ w`, GPT-OSS style) instead of
    `[out, in]` (`F.linear`); it is quantized in `[out, in]` form either way.
    """

    name: str
    shape: tuple[int, ...]
    transposed: bool = False

    @property
    def quantized(self) -> bool:
        return len(self.shape) == 2

    @property
    def out_in(self) -> tuple[int, int]:
        rows, cols = self.shape
        return (cols, rows) if self.transposed else (rows, cols)


@dataclass(frozen=True)
class PackedTensor:
    """Where one parameter lies in an expert buffer, and how it is stored."""

    name: str
    packing: str  # "raw" | "int8-cpu" | "int8" | "int4-cpu" | "int4-cuda" | "int4-plain" | "fp8" | "mxfp4"
    shape: tuple[int, ...]  # raw: its shape; quantized: [out, in]
    group_size: int  # quantized: elements per scale along `in`
    transposed: bool  # stored `[in, out]` in the checkpoint (see `ParamSpec`)
    offset: int
    nbytes: int
    scale_offset: int = 0
    scale_nbytes: int = 0
    block_rows: int = 1  # fp8: rows per scale (its block is block_rows × group_size)
    row_parts: int = 1  # fp8: weights stacked along `out` (gate, up), each with its own scale grid


@dataclass(frozen=True)
class QuantLayout:
    """The byte layout of one quantized expert: every parameter's place in a flat uint8 buffer."""

    expert_dtype: str  # "int8" | "int4" | "int4-mixed" | "fp8" | "mxfp4" | a float dtype (a published checkpoint dequantized)
    compute_dtype: torch.dtype  # biases and (except tinygemm's bf16) scales are stored in it
    tensors: tuple[PackedTensor, ...]
    nbytes: int

    @property
    def numel(self) -> int:
        """Elements of one expert buffer (uint8): what the host store and slots allocate."""
        return self.nbytes

    def __getitem__(self, name: str) -> PackedTensor:
        return next(t for t in self.tensors if t.name == name)

    def to_json(self) -> str:
        return json.dumps(
            {
                "expert_dtype": self.expert_dtype,
                "compute_dtype": str(self.compute_dtype).removeprefix("torch."),
                "tensors": [asdict(t) for t in self.tensors],
                "nbytes": self.nbytes,
            },
            sort_keys=True,
        )

    @classmethod
    def from_json(cls, text: str) -> QuantLayout:
        raw = json.loads(text)
        tensors = tuple(
            PackedTensor(**{**t, "shape": tuple(t["shape"])}) for t in raw["tensors"]
        )
        return cls(raw["expert_dtype"], getattr(torch, raw["compute_dtype"]), tensors, raw["nbytes"])


# -- quantization -------------------------------------------------------------------------------


def group_size_for(in_features: int, group_size: int) -> int:
    """The group size used for a weight with `in_features` columns: `PER_CHANNEL` (0) means all of
    them; a size that does not divide them shrinks to the largest common divisor (H 576 at 128 → 64)."""
    if group_size < 0:
        raise ValueError(f"group size must be positive or 0 (per channel), not {group_size}")
    return in_features if group_size == PER_CHANNEL else math.gcd(in_features, group_size)


def quantize(weight: torch.Tensor, expert_dtype: str, group_size: int, scale_dtype: torch.dtype,
             steps: torch.Tensor | None = None):
    """Group-wise quantization of `weight [out, in]` → (q int8 [out, in], scales, zeros [out, in/group]).

    Scales and zero points are rounded to `scale_dtype` first and `q` is computed from the rounded
    values, so `q * scale + zero` is exactly what a kernel reconstructs. int8 zeros are all 0.
    `steps [out, in/group]` (int4): each group's grid step where the source knows it (a 4-bit GGUF file's block
    scales; 0 for none), instead of searching the values for a grid (`grid_step`).
    """
    out_f, in_f = weight.shape
    group = group_size_for(in_f, group_size)
    grouped = weight.float().reshape(out_f, in_f // group, group)  # [O, G, g]
    if expert_dtype == "int8":
        scales = grouped.abs().amax(dim=-1) / QMAX["int8"]  # [O, G]
        zeros = torch.zeros_like(scales)
    else:
        low, high = grouped.amin(dim=-1), grouped.amax(dim=-1)  # [O, G]
        scales = (high - low) / (QMAX["int4"] - QMIN["int4"])
        if steps is not None:
            scales = torch.where(steps > 0, steps.float(), scales)
        elif lies_on_grids(grouped, low):  # a 4-bit GGUF file's groups keep their own grid
            step, on_grid = grid_step(grouped, low)
            scales = torch.where(on_grid, step, scales)
        zeros = torch.where(scales > 0, low - QMIN["int4"] * scales, low)  # a constant group: q = 0 gives it
    scales = scales.to(scale_dtype)
    scales = torch.where(scales > 0, scales, torch.ones_like(scales))  # a constant group: any scale
    zeros = zeros.to(scale_dtype)
    q = torch.round((grouped - zeros.float()[..., None]) / scales.float()[..., None])
    q = q.clamp(QMIN[expert_dtype], QMAX[expert_dtype])
    return q.to(torch.int8).reshape(out_f, in_f), scales, zeros


def lies_on_grids(grouped: torch.Tensor, low: torch.Tensor, sample: int = 256) -> bool:
    """Whether any of the first `sample` groups lies on a grid: the full search (a sort per group, ~15× the rest
    of quantizing) runs only on weights that come from a 4-bit file, never on float weights."""
    width = grouped.shape[-1]
    return bool(grid_step(grouped.reshape(-1, width)[:sample], low.reshape(-1)[:sample])[1].any())


def grid_step(grouped: torch.Tensor, low: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Groups `[O, G, g]` whose values already lie on 16 evenly spaced levels from their lowest, `low [O, G]`
    (a 4-bit GGUF file's, dequantized): their step and which groups those are.

    Such a grid need not reach 15 steps above `low` (Q4_K's levels are fitted, not the group's min and max; Q4_0's
    are symmetric about 0), and then the min/max grid would round every value a second time. The step is the
    smallest gap between distinct values, refitted by least squares; a group qualifies when every value lies
    within 5% of a step of a level and the highest level is at most 15. Float weights never do.
    """
    offsets = grouped - low[..., None]
    gaps = offsets.sort(dim=-1).values.diff(dim=-1)
    same_level = offsets.amax(dim=-1, keepdim=True) * 1e-3  # fp16 rounding of equal values
    smallest = torch.where(gaps > same_level, gaps, torch.inf).amin(dim=-1)  # [O, G]
    levels = torch.round(offsets / smallest[..., None])
    step = (levels * offsets).sum(dim=-1) / (levels * levels).sum(dim=-1).clamp_min(1)
    residual = (offsets - levels * step[..., None]).abs().amax(dim=-1)
    on_grid = torch.isfinite(smallest) & (levels.amax(dim=-1) <= QMAX["int4"] - QMIN["int4"]) & (residual <= 0.05 * step)
    return step, on_grid


def dequantize(q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """`q [..., out, in]` (int8 values) times its group's scale `[..., out, G]` plus its zero point (None:
    symmetric, none to add) → `[..., out, in]` in `dtype`. In place after the conversion: on a GPU this runs
    for every use of an expert in int8, and each pass over a Mixtral-size weight costs about 0.1 ms."""
    *lead, out_f, in_f = q.shape
    groups = scales.shape[-1]
    w = q.reshape(*lead, out_f, groups, in_f // groups).to(dtype, copy=True)
    w.mul_(scales.to(dtype)[..., None])
    if zeros is not None:
        w.add_(zeros.to(dtype)[..., None])
    return w.reshape(*lead, out_f, in_f)


def _from_nibbles(data: torch.Tensor) -> torch.Tensor:
    """Plain int4's bytes `[..., out, in/2]` (two values each, even index high) → int8 values `[..., out, in]`."""
    high, low = (data >> 4).to(torch.int8) - 8, (data & 15).to(torch.int8) - 8
    return torch.stack([high, low], dim=-1).reshape(*data.shape[:-1], 2 * data.shape[-1])


BATCH_DEQUANTIZED = ("raw", "int8", "int8-cpu", "int4-plain")  # packings `dequantize_slots` reads


def dequantize_slots(layout: QuantLayout, rows: torch.Tensor, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """k experts at once from their buffers `rows` (uint8 [k, nbytes], any device), in `dtype`: each weight
    `[k, out, in]`, or a `[k, in, out]` view when the family stores it so (as its float experts are), and
    raw tensors (biases) `[k, *shape]`. Every packing of `layout` must be in `BATCH_DEQUANTIZED`."""
    k = rows.shape[0]
    params = {}
    for t in layout.tensors:
        data = rows[:, t.offset : t.offset + t.nbytes]
        if t.packing == "raw":
            params[t.name] = data.view(layout.compute_dtype).view(k, *t.shape)
            continue
        out_f, in_f = t.shape
        scales = rows[:, t.scale_offset : t.scale_offset + t.scale_nbytes]
        scales = scales.view(scale_dtype(t.packing, layout.compute_dtype)).view(k, *scale_shape(t))
        if t.packing == "int4-plain":  # scale and zero point [k, G, out, 2]
            q = _from_nibbles(data.view(k, out_f, in_f // 2))
            w = dequantize(q, scales[..., 0].transpose(1, 2), scales[..., 1].transpose(1, 2), dtype)
        else:
            w = dequantize(data.view(torch.int8).view(k, out_f, in_f), scales, None, dtype)
        params[t.name] = w.transpose(1, 2) if t.transposed else w
    return params


# -- packing: which form each weight takes on a device --------------------------------------------


def choose_packing(expert_dtype: str, out_in: tuple[int, int], group: int, device_type: str) -> str:
    """The storage form of one weight on `device_type`; the kernel follows from it (see module doc)."""
    out_f, in_f = out_in
    if expert_dtype == "int8":
        return "int8-cpu" if device_type == "cpu" and group == in_f else "int8"
    if group in INT4_KERNEL_GROUPS:
        if device_type == "cpu" and out_f % 16 == 0:
            return "int4-cpu"
        if device_type == "cuda" and out_f % 8 == 0 and in_f % 32 == 0:
            return "int4-cuda"
    return "int4-plain"


def _inner_k_tiles(in_features: int) -> int:
    """tinygemm's inner K tiles: the largest of 8, 4, 2 with `in % (tiles * 16) == 0`."""
    return next(t for t in (8, 4, 2) if in_features % (t * 16) == 0)


def scale_dtype(packing: str, compute_dtype: torch.dtype) -> torch.dtype:
    if packing in PUBLISHED_SCALE_DTYPES:
        return PUBLISHED_SCALE_DTYPES[packing]
    return torch.bfloat16 if packing in KERNELS else compute_dtype


def scale_shape(t: PackedTensor) -> tuple[int, ...]:
    """The scales of a packed weight: int4 (every packing) scale and zero point `[in/group, out, 2]`,
    else one row per `block_rows` rows of each stacked part and one column per `group_size` columns
    (rounded up)."""
    out_f, in_f = t.shape
    if t.packing.startswith("int4"):
        return (in_f // t.group_size, out_f, 2)
    return fp8_scale_grid((out_f, in_f), (t.block_rows, t.group_size), t.row_parts)


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def plan_layout(
    params: Sequence[ParamSpec],
    expert_dtype: str,
    group_size: int,
    compute_dtype: torch.dtype,
    device_type: str,
) -> QuantLayout:
    """Place every parameter of an expert in a flat buffer, in order, each on an aligned offset."""
    if expert_dtype not in QUANT_DTYPES:
        raise ValueError(f"expert dtype must be one of {', '.join(QUANT_DTYPES)}, not {expert_dtype!r}")
    tensors, offset = [], 0
    for p in params:
        if not p.quantized:
            nbytes = _numel(p.shape) * compute_dtype.itemsize
            tensors.append(PackedTensor(p.name, "raw", tuple(p.shape), 0, False, offset, nbytes))
            offset = _aligned(offset + nbytes)
            continue
        out_f, in_f = p.out_in
        weight_dtype, weight_group = weight_form(expert_dtype, p.name, group_size)
        group = group_size_for(in_f, weight_group)
        packing = choose_packing(weight_dtype, (out_f, in_f), group, device_type)
        nbytes = out_f * in_f // (1 if weight_dtype == "int8" else 2)
        scale_offset = _aligned(offset + nbytes)
        scale_nbytes = out_f * (in_f // group) * scale_dtype(packing, compute_dtype).itemsize
        scale_nbytes *= 2 if weight_dtype == "int4" else 1  # a zero point beside each scale
        tensors.append(PackedTensor(
            p.name, packing, (out_f, in_f), group, p.transposed, offset, nbytes, scale_offset, scale_nbytes
        ))
        offset = _aligned(scale_offset + scale_nbytes)
    return QuantLayout(expert_dtype, compute_dtype, tuple(tensors), offset)


def weight_form(expert_dtype: str, name: str, group_size: int) -> tuple[str, int]:
    """(int8 | int4, group size) of one expert weight: `int4-mixed` keeps `down_proj` in int8 per channel
    (the output projection carries most of int4's error: bench/RESULTS.md, quality; llama.cpp's Q4_K_M
    also stores ffn_down wider)."""
    if expert_dtype == MIXED:
        return ("int8", PER_CHANNEL) if name == "down_proj" else ("int4", group_size)
    return expert_dtype, group_size


def int_dtype_of(packing: str) -> str:
    """The integer form (int8 | int4) a packing holds."""
    return "int8" if packing.startswith("int8") else "int4"


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def pack_expert(layout: QuantLayout, params: Mapping[str, torch.Tensor], out: torch.Tensor,
                steps: Mapping[str, torch.Tensor] | None = None) -> None:
    """Quantize and pack an expert's tensors (as in the checkpoint) into `out` (uint8 [layout.nbytes]).

    `steps`: by parameter, the grid step of each group of its weights where the source knows it (`[out, in/g]`:
    used by int4 weights quantized in groups of that `g`). `int4-cuda` packing runs on the GPU (tinygemm's converter
    exists only there); the bytes come back.
    """
    out.zero_()  # padding bytes too: a buffer's bytes depend only on the weights
    for t in layout.tensors:
        value = params[t.name]
        if t.packing == "raw":
            _bytes_of(out, t.offset, t.nbytes).copy_(value.to(layout.compute_dtype).reshape(-1).view(torch.uint8))
            continue
        weight = value.t() if t.transposed else value  # [out, in]
        int_dtype = int_dtype_of(t.packing)
        known = (steps or {}).get(t.name)
        if known is not None and (int_dtype != "int4" or known.shape != (t.shape[0], t.shape[1] // t.group_size)):
            known = None  # another grid than this weight's groups
        q, scales, zeros = quantize(weight, int_dtype, t.group_size, scale_dtype(t.packing, layout.compute_dtype),
                                    known)
        _bytes_of(out, t.offset, t.nbytes).copy_(_pack_weight(q, t.packing).reshape(-1).view(torch.uint8).cpu())
        scale_bytes = _pack_scales(scales, zeros, int_dtype).reshape(-1).view(torch.uint8)
        _bytes_of(out, t.scale_offset, t.scale_nbytes).copy_(scale_bytes)


def _bytes_of(buffer: torch.Tensor, offset: int, nbytes: int) -> torch.Tensor:
    return buffer[offset : offset + nbytes]


def _nibbles(q: torch.Tensor) -> torch.Tensor:
    """int4 values (-8..7) → unsigned nibbles two per byte, even index high: uint8 [out, in/2], contiguous
    (a transposed weight's `q` is strided, and the CUDA int4 packer refuses strided input)."""
    u = (q.to(torch.int32) + 8).to(torch.uint8)
    return ((u[:, ::2] << 4) | u[:, 1::2]).contiguous()


def _pack_weight(q: torch.Tensor, packing: str) -> torch.Tensor:
    if packing in ("int8", "int8-cpu"):
        return q
    if packing == "int4-cpu":
        return torch._convert_weight_to_int4pack_for_cpu(q.to(torch.int32) + 8, 2)  # uint8 [out, in/2]
    if packing == "int4-cuda":
        packed = torch._convert_weight_to_int4pack(_nibbles(q).cuda(), _inner_k_tiles(q.shape[1]))
        return packed.contiguous()  # int32 [out/8, in/(tiles*16), 32, tiles/2]: out*in/2 bytes
    return _nibbles(q)


def _pack_scales(scales: torch.Tensor, zeros: torch.Tensor, expert_dtype: str) -> torch.Tensor:
    """int8: scales [out, G]; int4 (every packing, as the kernels take them): scale and zero as [G, out, 2]."""
    if expert_dtype == "int8":
        return scales.contiguous()
    return torch.stack([scales.t(), zeros.t()], dim=-1).contiguous()


# -- reading a packed buffer: views and the matmul ----------------------------------------------


@dataclass(frozen=True)
class QuantizedWeight:
    """Views into an expert buffer (host or device) for one weight; `linear` computes with it."""

    packing: str
    shape: tuple[int, int]  # [out, in]
    group_size: int
    data: torch.Tensor
    scales: torch.Tensor  # int8: [out, G]; int4: scale and zero point, [G, out, 2]; fp8, mxfp4: `scale_shape`
    block_rows: int = 1  # fp8 (see `PackedTensor`)
    row_parts: int = 1

    def linear(self, x: torch.Tensor) -> torch.Tensor:
        """`x [..., in] @ w.T → [..., out]` with the kernel of this packing (see module doc)."""
        if self.packing not in KERNELS:
            return self.linear_dequantized(x)
        rows = x.reshape(-1, x.shape[-1])  # [t, in]: the kernels take 2-D inputs
        return self._kernel_linear(rows).view(*x.shape[:-1], self.shape[0])

    def _kernel_linear(self, x: torch.Tensor) -> torch.Tensor:
        x16 = x.to(torch.bfloat16).contiguous()
        if self.packing == "int8-cpu":
            y = torch._weight_int8pack_mm(x16, self.data, self.scales.reshape(-1))
        elif self.packing == "int4-cpu":
            y = torch._weight_int4pack_mm_for_cpu(x16, self.data, self.group_size, self.scales)
        else:
            y = torch._weight_int4pack_mm(x16, self.data, self.group_size, self.scales)
        return y.to(x.dtype)

    def linear_dequantized(self, x: torch.Tensor) -> torch.Tensor:
        """The fallback: the whole weight dequantized into a scratch tensor, then `F.linear`.

        int8 with one scale per output channel (CUDA's int8 default) scales the product instead of the
        weight: the int8 values convert exactly, and the pass that would scale the whole weight, every
        use, becomes one over the output (`[..., out]`)."""
        if self.packing == "int8" and self.scales.shape[-1] == 1:
            return F.linear(x, self.data.to(x.dtype)) * self.scales.reshape(-1).to(x.dtype)
        return F.linear(x, self.dequantize(x.dtype))

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        """The weight `[out, in]` as the kernels see it (int8, plain int4 and the published forms only;
        the kernel layouts are opaque, tests reach them through `linear`)."""
        if self.packing == "fp8":
            return dequantize_fp8(self.data, self.scales, (self.block_rows, self.group_size), self.row_parts, dtype)
        if self.packing == "mxfp4":
            return dequantize_mxfp4(self.data, self.scales, dtype)
        if self.packing in ("int8", "int8-cpu"):
            return dequantize(self.data, self.scales, None, dtype)
        if self.packing == "int4-plain":
            return dequantize(_from_nibbles(self.data), self.scales[..., 0].t(), self.scales[..., 1].t(), dtype)
        raise ValueError(f"{self.packing} weights are read by their kernel only")


def runs_on_cpu(layout: QuantLayout) -> bool:
    """Whether the host cores can compute experts in `layout` (tinygemm's int4 layout is CUDA's only)."""
    return all(t.packing != "int4-cuda" for t in layout.tensors)


def unpack_expert(layout: QuantLayout, buffer: torch.Tensor) -> dict[str, torch.Tensor | QuantizedWeight]:
    """Views into `buffer` (uint8 [layout.nbytes], any device): raw tensors, or `QuantizedWeight`s."""
    views: dict[str, torch.Tensor | QuantizedWeight] = {}
    for t in layout.tensors:
        data = _bytes_of(buffer, t.offset, t.nbytes)
        if t.packing == "raw":
            views[t.name] = data.view(layout.compute_dtype).view(t.shape)
            continue
        scales = _bytes_of(buffer, t.scale_offset, t.scale_nbytes).view(scale_dtype(t.packing, layout.compute_dtype))
        views[t.name] = QuantizedWeight(
            t.packing, t.shape, t.group_size, _weight_view(data, t), scales.view(scale_shape(t)), t.block_rows, t.row_parts
        )
    return views


def _weight_view(data: torch.Tensor, t: PackedTensor) -> torch.Tensor:
    out_f, in_f = t.shape
    if t.packing in ("int8", "int8-cpu"):
        return data.view(torch.int8).view(out_f, in_f)
    if t.packing == "fp8":
        return data.view(torch.float8_e4m3fn).view(out_f, in_f)
    if t.packing == "int4-cuda":
        tiles = _inner_k_tiles(in_f)
        return data.view(torch.int32).view(out_f // 8, in_f // (tiles * 16), 32, tiles // 2)
    return data.view(out_f, in_f // 2)  # int4-cpu, int4-plain, mxfp4
