"""Quantized experts (cache/quant.py): round trips, byte layouts, and every kernel against the float product.

The tolerance is derived, not tuned: each weight element is off by at most half its group's scale
(`|w - (q*s + z)| <= s/2`), so an output differs from the float product by at most
`sum_k |x_k| * s(n, group of k) / 2`, plus rounding: float32 paths a relative 1e-5 of
`sum_k |x_k * w_nk|`; the PyTorch kernels take bf16 activations and give bf16 outputs (relative
2^-8 each, so 2^-7 of that sum). The kernels must also agree with the product over the
dequantized weight up to that rounding alone.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from cache.quant import (
    ALIGN,
    KERNELS,
    PER_CHANNEL,
    ParamSpec,
    QuantizedWeight,
    QuantLayout,
    _nibbles,
    dequantize,
    dequantize_slots,
    grid_step,
    group_size_for,
    int_dtype_of,
    pack_expert,
    plan_layout,
    quantize,
    unpack_expert,
)

H, INTER = 64, 96  # hidden, expert intermediate: 2I = 192 and H = 64 are multiples of 16 (CPU int4 kernel)


def _error_bound(x: torch.Tensor, scales: torch.Tensor, in_features: int) -> torch.Tensor:
    """Per output: sum over the input of |x| times half the scale of its group → [t, out]."""
    group = in_features // scales.shape[1]
    abs_x_per_group = x.abs().reshape(x.shape[0], -1, group).sum(-1)  # [t, G]
    return abs_x_per_group @ scales.float().t() / 2


def _rounding(x: torch.Tensor, w: torch.Tensor, packing: str) -> torch.Tensor:
    relative = 2**-7 if packing in KERNELS else 1e-5
    return relative * (x.abs() @ w.abs().t()) + 1e-6


@pytest.mark.parametrize("expert_dtype", ["int8", "int4"])
@pytest.mark.parametrize("group_size", [PER_CHANNEL, 32, 64])
def test_quantize_round_trip_within_half_a_step(expert_dtype, group_size):
    torch.manual_seed(0)
    w = torch.randn(48, 128) * torch.logspace(-3, 1, 48)[:, None]  # rows of very different scale
    w[3, :32] = 0  # an all-zero group
    w[5, :] += 3.0 * w[5].abs().max()  # a row far from zero: only a zero point keeps its resolution
    q, scales, zeros = quantize(w, expert_dtype, group_size, torch.float32)
    group = group_size_for(128, group_size)
    assert q.dtype == torch.int8 and scales.shape == zeros.shape == (48, 128 // group)
    lo, hi = (-127, 127) if expert_dtype == "int8" else (-8, 7)
    assert int(q.min()) >= lo and int(q.max()) <= hi
    w_deq = dequantize(q, scales, zeros, torch.float32)
    err = (w_deq - w).abs()
    half_step = scales.repeat_interleave(group, dim=1) / 2
    assert bool((err <= half_step * (1 + 1e-5) + 1e-7 * w.abs()).all())
    if expert_dtype == "int8" or group == 32:  # zero is exact on a symmetric grid, or in an all-zero group
        assert bool((w_deq[3, :32] == 0).all())
    grouped_q = q.reshape(48, -1, group)
    if expert_dtype == "int8":  # symmetric: each group's largest |w| lands on the top code
        assert bool((zeros == 0).all()) and int(q.abs().amax()) == 127
    else:  # asymmetric: each non-constant group's minimum and maximum land on the end codes
        varying = scales.reshape(-1) != 1  # constant groups keep scale 1
        assert bool((grouped_q.amin(-1).reshape(-1)[varying] == -8).all())
        assert bool((grouped_q.amax(-1).reshape(-1)[varying] == 7).all())


def test_int4_zero_point_reproduces_an_asymmetric_16_level_grid():
    """Weights already on a 16-level grid per group (as a Q4_1 GGUF dequantizes) come back exactly."""
    torch.manual_seed(3)
    step, low = torch.rand(8, 2, 1) * 0.01 + 0.001, torch.randn(8, 2, 1) * 0.05 - 0.02  # [O, G, 1]
    levels = torch.randint(0, 16, (8, 2, 32)).float()
    levels[..., 0], levels[..., 1] = 0, 15  # each group spans its whole grid
    w = (levels * step + low).reshape(8, 64)
    q, scales, zeros = quantize(w, "int4", 32, torch.float32)
    assert torch.allclose(dequantize(q, scales, zeros, torch.float32), w, rtol=0, atol=1e-6)
    symmetric_error = (w - _symmetric_int4(w, 32)).abs().max()
    assert symmetric_error > 0.1 * float(step.min())  # the symmetric grid could not


def test_group_size_shrinks_to_a_divisor_and_per_channel_takes_the_row():
    assert group_size_for(576, 128) == 64  # the demo model's hidden size
    assert group_size_for(4096, 128) == 128
    assert group_size_for(16, 32) == 16
    assert group_size_for(96, PER_CHANNEL) == 96
    with pytest.raises(ValueError):
        group_size_for(96, -1)


def _expert_tensors(transposed: bool, bias: bool) -> tuple[list[ParamSpec], dict[str, torch.Tensor]]:
    """An expert in either orientation: `gate_up_proj [2I, H]`, `down_proj [H, I]` (F.linear form)
    or `[H, 2I]`, `[I, H]` (stored `[in, out]`, GPT-OSS form), with optional biases."""
    torch.manual_seed(1)
    shapes = {"gate_up_proj": (2 * INTER, H), "down_proj": (H, INTER)}
    specs, tensors = [], {}
    for name, (out_f, in_f) in shapes.items():
        shape = (in_f, out_f) if transposed else (out_f, in_f)
        specs.append(ParamSpec(name, shape, transposed))
        tensors[name] = torch.randn(shape) * 0.1
        if bias:
            specs.append(ParamSpec(f"{name}_bias", (out_f,)))
            tensors[f"{name}_bias"] = torch.randn(out_f)
    return specs, tensors


LAYOUT_CASES = [(False, False), (False, True), (True, True), (True, False)]
FORMS = [("int8", PER_CHANNEL), ("int8", 32), ("int4", 32), ("int4", 64), ("int4", PER_CHANNEL), ("int4-mixed", 32)]


@pytest.mark.parametrize("transposed,bias", LAYOUT_CASES, ids=["gate_up", "gate_up+bias", "transposed+bias", "transposed"])
@pytest.mark.parametrize("expert_dtype,group_size", FORMS)
def test_kernels_match_the_float_product_within_the_derived_bound(transposed, bias, expert_dtype, group_size):
    specs, tensors = _expert_tensors(transposed, bias)
    layout = plan_layout(specs, expert_dtype, group_size, torch.float32, "cpu")
    buffer = torch.empty(layout.nbytes, dtype=torch.uint8)
    pack_expert(layout, tensors, buffer)
    views = unpack_expert(layout, buffer)
    torch.manual_seed(2)
    for spec in specs:
        if not spec.quantized:
            assert torch.equal(views[spec.name], tensors[spec.name])  # biases kept exactly
            continue
        w = tensors[spec.name].t() if transposed else tensors[spec.name]  # [out, in]
        x = torch.randn(5, w.shape[1])
        got = views[spec.name].linear(x)  # [5, out]
        packed = layout[spec.name]
        q, scales, zeros = quantize(w, int_dtype_of(packed.packing), packed.group_size, views[spec.name].scales.dtype)
        w_deq = dequantize(q, scales, zeros, torch.float32)
        rounding = _rounding(x, w, layout[spec.name].packing)
        assert got.shape == (5, w.shape[0])
        assert bool(((got - F.linear(x, w_deq)).abs() <= rounding).all()), "kernel ≠ its dequantized weight"
        bound = _error_bound(x, scales, w.shape[1]) + rounding
        assert bool(((got - F.linear(x, w)).abs() <= bound).all()), "beyond the quantization bound"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("transposed", [False, True])
def test_int8_per_channel_as_cuda_packs_it_scales_the_product_as_the_weight_would(transposed, dtype):
    """CUDA's per-channel int8 (`int8` packing, one scale per row) multiplies the int8 values, exact in any
    float dtype, and scales the output: equal to the product with the dequantized weight up to rounding."""
    specs, tensors = _expert_tensors(transposed, bias=False)
    layout = plan_layout(specs, "int8", PER_CHANNEL, dtype, "cuda")
    assert {t.packing for t in layout.tensors} == {"int8"}
    buffer = torch.empty(layout.nbytes, dtype=torch.uint8)
    pack_expert(layout, tensors, buffer)
    torch.manual_seed(3)
    for name, view in unpack_expert(layout, buffer).items():
        assert view.scales.shape == (view.shape[0], 1)
        x = torch.randn(5, view.shape[1])
        got = view.linear(x.to(dtype)).float()
        want = F.linear(x, view.dequantize(torch.float32))
        w = view.dequantize(torch.float32)
        rounding = (2**-7 if dtype == torch.bfloat16 else 1e-5) * (x.abs() @ w.abs().t()) + 1e-6
        assert bool(((got - want).abs() <= 2 * rounding).all()), name


@pytest.mark.parametrize("transposed,bias", LAYOUT_CASES, ids=["gate_up", "gate_up+bias", "transposed+bias", "transposed"])
@pytest.mark.parametrize("expert_dtype,group_size,packing", [("int8", PER_CHANNEL, "int8-cpu"), ("int8", 32, "int8"),
                                                            ("int4", 16, "int4-plain")])  # fmt: skip
def test_experts_dequantized_together_equal_each_one_dequantized(transposed, bias, expert_dtype, group_size, packing):
    """The batched decode of small quantized experts (`dequantize_slots`) against one expert at a time."""
    specs, _ = _expert_tensors(transposed, bias)
    layout = plan_layout(specs, expert_dtype, group_size, torch.float32, "cpu")
    assert {t.packing for t in layout.tensors} <= {packing, "raw"}
    experts = []
    for seed in range(3):
        torch.manual_seed(10 + seed)
        _, tensors = _expert_tensors(transposed, bias)
        buffer = torch.empty(layout.nbytes, dtype=torch.uint8)
        pack_expert(layout, tensors, buffer)
        experts.append(buffer)
    rows = torch.stack([experts[2], experts[0]])  # [k, nbytes], in the order a step's slots come
    together = dequantize_slots(layout, rows, torch.float32)
    for i, buffer in enumerate([experts[2], experts[0]]):
        for name, view in unpack_expert(layout, buffer).items():
            alone = view.dequantize(torch.float32) if isinstance(view, QuantizedWeight) else view
            if isinstance(view, QuantizedWeight) and transposed:
                alone = alone.t()  # [in, out], as the family stores it
            assert torch.equal(together[name][i], alone), name


def test_the_cpu_picks_the_kernels_where_their_constraints_hold():
    specs = [ParamSpec("gate_up_proj", (2 * INTER, H)), ParamSpec("down_proj", (H, INTER)), ParamSpec("odd", (24, 64))]
    packings = {t.name: t.packing for t in plan_layout(specs, "int4", 32, torch.float32, "cpu").tensors}
    assert packings == {"gate_up_proj": "int4-cpu", "down_proj": "int4-cpu", "odd": "int4-plain"}  # out % 16
    per_channel = {t.name: t.packing for t in plan_layout(specs, "int4", PER_CHANNEL, torch.float32, "cpu").tensors}
    assert per_channel["down_proj"] == "int4-plain"  # a group of 96 is not one the kernel takes
    assert {t.packing for t in plan_layout(specs, "int8", 32, torch.float32, "cpu").tensors} == {"int8"}
    assert {t.packing for t in plan_layout(specs, "int8", PER_CHANNEL, torch.float32, "cpu").tensors} == {"int8-cpu"}
    assert {t.packing for t in plan_layout(specs, "int8", PER_CHANNEL, torch.float32, "cuda").tensors} == {"int8"}


def test_int4_mixed_keeps_down_proj_in_int8_per_channel():
    specs = [ParamSpec("gate_up_proj", (2 * INTER, H)), ParamSpec("down_proj", (H, INTER))]
    for device_type, int4, int8 in (("cpu", "int4-cpu", "int8-cpu"), ("cuda", "int4-cuda", "int8")):
        layout = plan_layout(specs, "int4-mixed", 32, torch.float32, device_type)
        forms = {t.name: (t.packing, t.group_size) for t in layout.tensors}
        assert forms == {"gate_up_proj": (int4, 32), "down_proj": (int8, INTER)}
    h, i = 4096, 14336  # a Mixtral expert: between int8 (÷ 2) and int4 g32 (÷ 3.2) of bf16
    specs = [ParamSpec("gate_up_proj", (2 * i, h)), ParamSpec("down_proj", (h, i))]
    ratio = 3 * h * i * 2 / plan_layout(specs, "int4-mixed", 32, torch.bfloat16, "cpu").nbytes
    assert 2.6 <= ratio <= 2.75, ratio


def test_plain_int4_round_trips_through_its_nibbles():
    spec = ParamSpec("odd", (24, 64))  # 24 rows: not the CPU kernel's
    layout = plan_layout([spec], "int4", 32, torch.float32, "cpu")
    w = torch.randn(24, 64)
    buffer = torch.empty(layout.nbytes, dtype=torch.uint8)
    pack_expert(layout, {"odd": w}, buffer)
    q, scales, zeros = quantize(w, "int4", 32, torch.float32)
    got = unpack_expert(layout, buffer)["odd"].dequantize(torch.float32)
    assert torch.equal(got, dequantize(q, scales, zeros, torch.float32))


def test_layout_is_aligned_compact_and_survives_json():
    specs, _ = _expert_tensors(transposed=False, bias=True)
    layout = plan_layout(specs, "int4", 32, torch.bfloat16, "cpu")
    assert QuantLayout.from_json(layout.to_json()) == layout
    assert layout.nbytes % ALIGN == 0
    ends = []
    for t in layout.tensors:
        assert t.offset % ALIGN == 0 and (t.scale_nbytes == 0 or t.scale_offset % ALIGN == 0)
        ends.append(max(t.offset + t.nbytes, t.scale_offset + t.scale_nbytes))
    assert layout.nbytes - max(ends) < ALIGN


@pytest.mark.parametrize(
    "expert_dtype,group_size,compute_dtype,low,high",
    [
        ("int8", PER_CHANNEL, torch.bfloat16, 1.99, 2.0),  # ÷ 2 against bf16
        ("int4", 128, torch.bfloat16, 3.7, 3.8),  # ÷ 3.76: nibbles plus a bf16 scale and zero per 128
        ("int4", 64, torch.bfloat16, 3.5, 3.6),
        ("int8", PER_CHANNEL, torch.float32, 3.99, 4.0),  # the CPU's float32 experts
    ],
)
def test_bytes_per_mixtral_expert(expert_dtype, group_size, compute_dtype, low, high):
    h, i = 4096, 14336
    specs = [ParamSpec("gate_up_proj", (2 * i, h)), ParamSpec("down_proj", (h, i))]
    layout = plan_layout(specs, expert_dtype, group_size, compute_dtype, "cpu")
    ratio = 3 * h * i * compute_dtype.itemsize / layout.nbytes
    assert low <= ratio <= high, ratio


def test_bfloat16_compute_stays_within_the_bound_plus_bf16_rounding():
    """bf16 activations: the kernels accumulate in float but round inputs and outputs to bf16
    (relative 2^-8 each), so the bound gains 2^-7 of sum |x w| on top of the quantization step."""
    specs, tensors = _expert_tensors(transposed=False, bias=False)
    for expert_dtype in ("int8", "int4"):
        layout = plan_layout(specs, expert_dtype, 32, torch.bfloat16, "cpu")
        buffer = torch.empty(layout.nbytes, dtype=torch.uint8)
        pack_expert(layout, tensors, buffer)
        views = unpack_expert(layout, buffer)
        w = tensors["gate_up_proj"]
        x = torch.randn(3, H)
        got = views["gate_up_proj"].linear(x.to(torch.bfloat16)).float()
        _, scales, _ = quantize(w, expert_dtype, 32, torch.bfloat16)
        bound = _error_bound(x, scales, H) + 2**-7 * (x.abs() @ w.abs().t()) + 1e-3
        assert bool(((got - F.linear(x, w)).abs() <= bound).all())


def test_nibbles_of_a_transposed_weight_come_out_contiguous():
    """GPT-OSS stores experts [in, out]: their `q` is a strided view, and the CUDA int4 packer
    (`torch._convert_weight_to_int4pack`) refused its nibbles on an H200 on 2026-12-04."""
    w = torch.randn(64, 24)  # [in, out]
    q, _, _ = quantize(w.t(), "int4", 32, torch.float32)
    nibbles = _nibbles(q)
    assert not q.is_contiguous() and nibbles.is_contiguous()
    assert torch.equal(nibbles, _nibbles(q.contiguous()))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (tinygemm int4 layout)")
@pytest.mark.parametrize("transposed", [False, True])
def test_cuda_tinygemm_matches_the_float_product(transposed):
    specs, tensors = _expert_tensors(transposed=transposed, bias=True)
    layout = plan_layout(specs, "int4", 32, torch.bfloat16, "cuda")
    assert layout["gate_up_proj"].packing == "int4-cuda"
    buffer = torch.empty(layout.nbytes, dtype=torch.uint8)
    pack_expert(layout, tensors, buffer)
    views = unpack_expert(layout, buffer.cuda())
    w = tensors["gate_up_proj"].t() if transposed else tensors["gate_up_proj"]  # [out, in]
    x = torch.randn(3, H)
    got = views["gate_up_proj"].linear(x.cuda().to(torch.bfloat16)).float().cpu()
    _, scales, _ = quantize(w, "int4", 32, torch.bfloat16)
    bound = _error_bound(x, scales, H) + 2**-7 * (x.abs() @ w.abs().t()) + 1e-3
    assert bool(((got - F.linear(x, w)).abs() <= bound).all())


def _symmetric_int4(w: torch.Tensor, group: int) -> torch.Tensor:
    """The former symmetric int4 (scale max |w| / 7, levels -8..7), dequantized: the comparison."""
    grouped = w.reshape(w.shape[0], -1, group)
    scale = grouped.abs().amax(-1, keepdim=True) / 7
    return (torch.round(grouped / scale).clamp(-8, 7) * scale).reshape(w.shape)


def _relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


def _int4_again(weight: torch.Tensor) -> torch.Tensor:
    return dequantize(*quantize(weight, "int4", 32, torch.bfloat16), torch.float32)


@pytest.mark.parametrize("gguf_type", ["Q4_0", "Q4_1"])
def test_int4_finds_a_4_bit_gguf_files_grid_again(gguf_type):
    import gguf

    weight = torch.randn(64, 256, generator=torch.Generator().manual_seed(0))
    kind = gguf.GGMLQuantizationType[gguf_type]
    from_file = torch.from_numpy(gguf.dequantize(gguf.quants.quantize(weight.numpy(), kind), kind)).half().float()
    # quantizing the file's values adds about what bf16 scales round (0.2%), not a second 4-bit rounding (8%)
    assert _relative_error(_int4_again(from_file), from_file) < 0.005
    assert _relative_error(_int4_again(weight), weight) > 0.05


def test_int4_finds_fitted_grids_that_miss_their_extreme_levels():
    # Q4_K-like groups: d * q - m with q bell-shaped in 0..15, so many groups lack level 0 or 15
    gen = torch.Generator().manual_seed(1)
    d, m = torch.rand(64, 8, 1, generator=gen) * 0.1 + 0.05, torch.rand(64, 8, 1, generator=gen)
    q = torch.clamp(torch.round(torch.randn(64, 8, 32, generator=gen) * 3 + 7.5), 0, 15)
    assert ((q.amin(-1) > 0) | (q.amax(-1) < 15)).float().mean() > 0.2
    fitted = (d * q - m).reshape(64, 256).half().float()
    assert _relative_error(_int4_again(fitted), fitted) < 0.005


def test_float_weights_are_never_taken_for_a_grid():
    weight = torch.randn(256, 256, generator=torch.Generator().manual_seed(2))
    grouped = weight.reshape(256, 8, 32)
    _, on_grid = grid_step(grouped, grouped.amin(dim=-1))
    assert not on_grid.any()
