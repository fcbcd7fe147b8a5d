"""Experts of a checkpoint published quantized (FP8 block-scaled, MXFP4) in the `QuantLayout` scheme.

Each expert weight arrives in parts: a DeepSeek expert's `gate_up_proj` is its `gate_proj` and
`up_proj` tensors, a fused GPT-OSS weight one slice; each part is a data tensor and its scales.
- `--expert-dtype auto`: the expert buffer holds those bytes as published, copied side by side
  (`plan_published_layout`, `pack_published_expert`); the host store, the device slots and the
  transfers carry them, and each use dequantizes into a scratch weight (`cache.quant`).
- any other expert dtype starts from the float weights, decoded once per expert (`dequantized_expert`);
  `plan_float_layout` keeps them in the compute dtype.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

import torch

from cache.host_store import Segment, read_segment
from cache.quant import ALIGN, PackedTensor, ParamSpec, QuantLayout, scale_dtype, scale_shape
from cache.quant_formats import MXFP4_BLOCK, dequantize_published
from cache.safetensors_index import CheckpointError

PUBLISHED_METHODS = ("fp8", "mxfp4")


@dataclass(frozen=True)
class PublishedFormat:
    """How a checkpoint's weights were quantized: `quantization_config` read and checked."""

    method: str  # "fp8" | "mxfp4"
    block: tuple[int, int]  # rows × columns per scale (mxfp4: 1 × 32)


@dataclass(frozen=True)
class PublishedPart:
    """One checkpoint tensor of an expert weight: its bytes, and its scales (None: kept unquantized)."""

    data: Segment
    scales: Segment | None = None


ExpertParts = Mapping[str, Sequence[PublishedPart]]  # parameter name → its parts, stacked along `out`
PublishedValue = torch.Tensor | tuple[torch.Tensor, torch.Tensor]  # a raw weight, or quantized bytes and scales


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def _raw(p: ParamSpec, compute_dtype: torch.dtype, offset: int) -> PackedTensor:
    nbytes = torch.Size(p.shape).numel() * compute_dtype.itemsize
    return PackedTensor(p.name, "raw", tuple(p.shape), 0, False, offset, nbytes)


def plan_float_layout(params: Sequence[ParamSpec], compute_dtype: torch.dtype) -> QuantLayout:
    """Every parameter in the compute dtype, as the model holds it (`--expert-dtype bf16` on such a checkpoint)."""
    tensors, offset = [], 0
    for p in params:
        tensors.append(_raw(p, compute_dtype, offset))
        offset = _aligned(offset + tensors[-1].nbytes)
    return QuantLayout(str(compute_dtype).removeprefix("torch."), compute_dtype, tuple(tensors), offset)


def quantized_parts(parts: ExpertParts) -> dict[str, int]:
    """Which weights of an expert are published quantized (as `parts` of one expert show), and in how many
    stacked parts each."""
    return {name: len(pieces) for name, pieces in parts.items() if pieces[0].scales is not None}


def plan_published_layout(
    params: Sequence[ParamSpec], fmt: PublishedFormat, quantized: Mapping[str, int], compute_dtype: torch.dtype
) -> QuantLayout:
    """The published bytes of each weight `[out, in]` and then its scales; unquantized tensors (biases, or
    weights the checkpoint left unquantized: those not in `quantized`, which maps each quantized weight to its
    stacked parts) in the compute dtype."""
    tensors, offset = [], 0
    for p in params:
        is_quantized = p.quantized and p.name in quantized
        tensors.append(_published(p, fmt, quantized[p.name], offset) if is_quantized
                       else _raw(p, compute_dtype, offset))
        end = tensors[-1].scale_offset + tensors[-1].scale_nbytes if is_quantized else offset + tensors[-1].nbytes
        offset = _aligned(end)
    return QuantLayout(fmt.method, compute_dtype, tuple(tensors), offset)


def _published(p: ParamSpec, fmt: PublishedFormat, row_parts: int, offset: int) -> PackedTensor:
    out_f, in_f = p.out_in
    if fmt.method == "mxfp4" and in_f % MXFP4_BLOCK:
        raise CheckpointError(f"{p.name}: MXFP4 needs rows of a multiple of {MXFP4_BLOCK} weights, not {in_f}")
    nbytes = out_f * in_f // (2 if fmt.method == "mxfp4" else 1)
    block_rows, group = fmt.block if fmt.method == "fp8" else (1, MXFP4_BLOCK)
    t = PackedTensor(p.name, fmt.method, (out_f, in_f), group, p.transposed, offset, nbytes, _aligned(offset + nbytes),
                     0, block_rows, row_parts if fmt.method == "fp8" else 1)
    scale_nbytes = torch.Size(scale_shape(t)).numel() * scale_dtype(fmt.method, torch.float32).itemsize
    return replace(t, scale_nbytes=scale_nbytes)


def pack_published_expert(layout: QuantLayout, parts: ExpertParts, out: torch.Tensor) -> None:
    """Copy an expert's published bytes into `out` (uint8 [layout.nbytes]): data and scales as
    published (scales widened to float32 where a checkpoint stores them narrower: exact)."""
    values = {}
    for t in layout.tensors:
        pieces = parts[t.name]
        if t.packing == "raw":
            values[t.name] = torch.cat([read_segment(p.data) for p in pieces])
            continue
        if any(p.scales is None for p in pieces):
            raise CheckpointError(f"{t.name}: quantized in one expert and not in another")
        values[t.name] = (torch.cat([read_segment(p.data).view(torch.uint8) for p in pieces]),
                          torch.cat([read_segment(p.scales) for p in pieces]))
    pack_published_values(layout, values, out)


def pack_published_values(layout: QuantLayout, values: Mapping[str, PublishedValue], out: torch.Tensor) -> None:
    """Lay an expert's weights into `out` (uint8 [layout.nbytes]): a raw one from its value, a quantized one from
    its bytes and scales as published."""
    out.zero_()  # padding bytes too: a buffer's bytes depend only on the weights
    for t in layout.tensors:
        if t.packing == "raw":
            _fill(out, t.offset, t.nbytes, values[t.name].to(layout.compute_dtype), t.name)
            continue
        data, scales = values[t.name]
        _fill(out, t.offset, t.nbytes, data, t.name)
        _fill(out, t.scale_offset, t.scale_nbytes, scales.to(scale_dtype(t.packing, layout.compute_dtype)),
              f"{t.name} scales")


def _fill(out: torch.Tensor, offset: int, nbytes: int, value: torch.Tensor, what: str) -> None:
    raw = value.reshape(-1).view(torch.uint8)
    if raw.numel() != nbytes:
        raise CheckpointError(f"{what} has {raw.numel()} bytes on disk, the layout expects {nbytes}")
    out[offset : offset + nbytes].copy_(raw)


def dequantized_expert(params: Sequence[ParamSpec], fmt: PublishedFormat, parts: ExpertParts) -> dict[str, torch.Tensor]:
    """An expert's parameters in float32 and in the model's shapes (transposed where the family is)."""
    weights = {}
    for p in params:
        pieces = parts[p.name]
        if pieces[0].scales is None:  # stored as the model holds it (a bias, a weight left unquantized)
            weights[p.name] = torch.cat([read_segment(x.data) for x in pieces]).float().view(p.shape)
            continue
        w = torch.cat([_dequantized_part(x, fmt, p.out_in[1]) for x in pieces])  # [out, in]
        weights[p.name] = w.t() if p.transposed else w
    return weights


def _dequantized_part(piece: PublishedPart, fmt: PublishedFormat, in_features: int) -> torch.Tensor:
    if piece.scales is None:
        raise CheckpointError("a weight quantized in one expert part and not in another")
    columns = in_features // 2 if fmt.method == "mxfp4" else in_features  # bytes per row
    data = read_segment(piece.data).view(-1, columns)
    return dequantize_published(fmt.method, data, read_segment(piece.scales), fmt.block, torch.float32)
