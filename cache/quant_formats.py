"""The number formats of checkpoints published quantized, decoded from their bytes.

- FP8 block-scaled (DeepSeek-V3/R1, Qwen3-*-FP8): float8 e4m3 weights `[out, in]`, and one float32
  `weight_scale_inv` per block of `block_rows × block_cols` weights (the last blocks of a row or
  column may be short: the scale grid is `[ceil(out / block_rows), ceil(in / block_cols)]`);
  the weight is `fp8 × scale` (the name says "inverse": the inverse of the quantizer's scale).
- MXFP4 (GPT-OSS experts): OCP microscaling, 32 weights per scale. Each byte holds two e2m1
  values, the even element in the low nibble; a scale byte is an e8m0 exponent, `2^(byte - 127)`.

Decoding is exact in float32 (e4m3 and e2m1 values and power-of-two scales are float32 numbers;
an fp8 × float32 product rounds once) and rounded once to the compute dtype at the end (MXFP4 into
bfloat16 decodes in bfloat16 directly: its products are exact there too).
"""

from __future__ import annotations

import functools

import torch

MXFP4_BLOCK = 32  # weights per e8m0 scale
E8M0_BIAS = 127
# e2m1 by nibble: bit 3 the sign, bits 2-1 the exponent (bias 1), bit 0 the mantissa
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def fp8_scale_grid(out_in: tuple[int, int], block: tuple[int, int], row_parts: int = 1) -> tuple[int, int]:
    """The shape of the scales of an fp8 weight `[out, in]` made of `row_parts` weights stacked along
    `out` (gate rows, then up rows), each with its own grid of `block` blocks."""
    out_f, in_f = out_in
    return row_parts * ceil_div(out_f // row_parts, block[0]), ceil_div(in_f, block[1])


def dequantize_fp8(
    data: torch.Tensor, scales: torch.Tensor, block: tuple[int, int], row_parts: int, dtype: torch.dtype
) -> torch.Tensor:
    """`data` float8 `[out, in]`, `scales` float32 `fp8_scale_grid(...)` → the weight `[out, in]` in `dtype`."""
    out_f, in_f = data.shape
    rows = out_f // row_parts  # rows of one stacked weight
    grid = scales.float().view(row_parts, -1, scales.shape[-1])  # [P, ceil(rows/b0), ceil(in/b1)]
    per_row = grid.repeat_interleave(block[0], dim=1)[:, :rows]  # [P, rows, ceil(in/b1)]: small
    w = data.float().view(row_parts, rows, in_f)  # a new tensor: scaled in place
    whole = in_f // block[1]  # whole blocks along a row; then perhaps a short one
    w[..., : whole * block[1]].unflatten(-1, (whole, block[1])).mul_(per_row[..., :whole, None])
    if whole * block[1] < in_f:
        w[..., whole * block[1] :].mul_(per_row[..., whole:])
    return w.view(out_f, in_f).to(dtype)


@functools.cache
def _e2m1_pairs(device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """Every byte's two e2m1 values, low nibble first: `[256, 2]` in `dtype` (one gather decodes a byte)."""
    values = torch.tensor(E2M1_VALUES, dtype=torch.float32)
    byte = torch.arange(256)
    return torch.stack([values[byte & 0x0F], values[byte >> 4]], dim=-1).to(device, dtype)


@functools.cache
def _e8m0_powers(device: torch.device) -> torch.Tensor:
    """Every e8m0 byte's scale `2^(byte - 127)`, exact in float32 (byte 0 a subnormal; 255 is NaN by the spec)."""
    powers = [2.0 ** (e - E8M0_BIAS) for e in range(255)] + [float("nan")]
    return torch.tensor(powers, dtype=torch.float64).float().to(device)


def decode_e2m1(packed: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """uint8 `[..., n]` → `[..., 2n]` in `dtype`: each byte's low nibble, then its high nibble."""
    # index_select with int32 indices: 2-3× faster on the CPU than indexing with the bytes as int64
    pairs = torch.index_select(_e2m1_pairs(packed.device, dtype), 0, packed.reshape(-1).int())  # [numel, 2]
    return pairs.view(*packed.shape[:-1], 2 * packed.shape[-1])


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`blocks` uint8 `[out, in/2]`, `scales` uint8 `[out, in/32]` → the weight `[out, in]` in `dtype`."""
    out_f, half = blocks.shape
    # An e2m1 value times a power of two is exact in bfloat16 as in float32 (same exponent range), so those
    # decode in place; float16's narrower range is reached through float32, rounded once at the end.
    work = dtype if dtype in (torch.bfloat16, torch.float32) else torch.float32
    values = decode_e2m1(blocks, work).view(out_f, -1, MXFP4_BLOCK)  # [out, in/32, 32]
    powers = _e8m0_powers(scales.device)[scales.long()].to(work)  # [out, in/32]
    return values.mul_(powers[..., None]).view(out_f, 2 * half).to(dtype)


def dequantize_published(
    method: str, data: torch.Tensor, scales: torch.Tensor, block: tuple[int, int], dtype: torch.dtype
) -> torch.Tensor:
    """One published weight `[out, in]` from its bytes (fp8: data float8 `[out, in]`; mxfp4: uint8
    `[out, in/2]`) and its scales, flat or shaped; `block` is the fp8 block (rows × columns)."""
    out_f = data.shape[0]
    if method == "fp8":
        return dequantize_fp8(data, scales.view(fp8_scale_grid(tuple(data.shape), block)), block, 1, dtype)
    if method == "mxfp4":
        return dequantize_mxfp4(data, scales.view(out_f, -1), dtype)
    raise ValueError(f"unknown published quantization {method!r}")
