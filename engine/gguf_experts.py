"""A GGUF model's experts, read from the GGUF file itself: its conversion writes only the dense weights.

llama.cpp stores each MoE layer's experts as merged tensors, `ffn_{gate,up,down}_exps` of `[experts, rows,
columns]` (numpy order; files from before 2024 hold one tensor per expert, `ffn_gate.{e}`), each row a run of
quantization blocks, so one expert's part of a tensor is one run of bytes in the file. The conversion records where
each tensor lies (`ExpertTensor`, in the folder's marker); at load every expert is read from there:
- float experts (F32, F16, BF16) as disk segments, like a safetensors checkpoint's (`float_segments`);
- quantized ones (Q4_K, Q6_K, Q8_0, ...) decoded by gguf-py into float32 once, when the expert store is built in
  the form `--expert-dtype` asks for. A 4-bit block's scale is the step of its grid (`grid_steps`), so int4 takes
  the file's own grid instead of searching the decoded values for it (`cache.quant.grid_step`, ~10× slower).
This keeps a converted model's disk use to its dense weights, where float16 experts took 2 bytes per weight
(61 GB for Qwen3-30B-A3B), and the first start from writing and reading them again.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

from cache.host_store import Segment, read_segment
from cache.policy import ExpertKey
from cache.quant_formats import MXFP4_BLOCK, dequantize_mxfp4
from cache.quant_published import PublishedValue
from cache.safetensors_index import CheckpointError
from engine.moe_layers import MoELayer

MARKER = "moe-serve-gguf.json"  # the conversion's marker (`engine.gguf_checkpoint`): where the experts lie
FLOAT_TYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
GRID_BLOCK = 32  # Q4_0, Q4_1: one scale per 32 weights; Q4_K: one per sub-block of 32
Q4_K_SCALES = slice(4, 16)  # a Q4_K block: d, dmin (fp16 each), then 12 bytes of 6-bit scales and mins


@dataclass(frozen=True)
class ExpertTensor:
    """A GGUF tensor holding one weight (gate, up or down) of `shape[0]` consecutive experts: `shape` `[experts,
    rows, columns]` of GGML type `type`, its data at byte `offset` of `file`. A merged `ffn_*_exps` tensor holds every
    expert of its layer; a per-expert one (`ffn_gate.{e}`), one. `paired`: MXFP4 codes in a published checkpoint's
    order (Ollama's GPT-OSS files, `engine.gguf_ollama`), not llama.cpp's."""

    file: str
    offset: int
    type: str
    shape: tuple[int, int, int]
    paired: bool = False

    @property
    def row_bytes(self) -> int:
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

        block, size = GGML_QUANT_SIZES[GGMLQuantizationType[self.type]]
        return self.shape[2] // block * size

    def raw(self, expert: int) -> np.ndarray:
        """One expert's rows as stored: uint8 `[rows, row_bytes]`."""
        rows = self.shape[1]
        segment = Segment(Path(self.file), self.offset + expert * rows * self.row_bytes, rows * self.row_bytes,
                          torch.uint8)
        return read_segment(segment).numpy().reshape(rows, self.row_bytes)

    def dequantized(self, expert: int) -> torch.Tensor:
        """One expert's rows in float32 `[rows, columns]`, as gguf-py decodes them (MXFP4 as `cache.quant_formats`
        does: the same values, in either code order)."""
        from gguf import GGMLQuantizationType, dequantize

        if self.type == "MXFP4":
            return dequantize_mxfp4(*self.mxfp4(expert), torch.float32)
        return torch.from_numpy(dequantize(self.raw(expert), GGMLQuantizationType[self.type]))

    def mxfp4(self, expert: int) -> tuple[torch.Tensor, torch.Tensor]:
        """One MXFP4 expert's rows as a published MXFP4 checkpoint holds them (`cache.quant_formats`): the 4-bit
        codes uint8 `[rows, columns / 2]`, element 2k in byte k's low nibble and 2k + 1 in its high one, and
        the E8M0 scale of each 32, uint8 `[rows, columns / 32]`. A GGML block is that scale then 16 bytes with
        elements 0-15 in the low nibbles and 16-31 in the high ones; both read an element as `e2m1 × 2^(scale -
        127)` (GGML's table holds twice e2m1, its scale half the power)."""
        blocks = self.raw(expert).reshape(self.shape[1], -1, 1 + MXFP4_BLOCK // 2)  # [rows, blocks, 17]
        scales, codes = blocks[..., 0], blocks[..., 1:]
        if self.paired:
            packed = codes
        else:
            elements = np.concatenate([codes & 0x0F, codes >> 4], axis=-1)  # [rows, blocks, 32] in order
            packed = elements[..., 0::2] | (elements[..., 1::2] << 4)
        return (torch.from_numpy(np.ascontiguousarray(packed).reshape(self.shape[1], -1)),
                torch.from_numpy(np.ascontiguousarray(scales)))

    def float_segment(self, expert: int) -> Segment:
        dtype = FLOAT_TYPES[self.type]
        numel = self.shape[1] * self.shape[2]
        return Segment(Path(self.file), self.offset + expert * numel * dtype.itemsize, numel, dtype)


def expert_tensor(tensor, file: Path, paired: bool = False) -> ExpertTensor:
    """The place of a gguf-py `ReaderTensor` read from `file` (GGUF lists shapes columns first; a per-expert
    tensor has no expert axis; a bias, `[experts, rows]`, is held as one column of rows); `paired`: MXFP4 codes in
    a published checkpoint's order."""
    shape = tuple(int(n) for n in reversed(tensor.shape))
    if tensor.name.endswith(".bias"):
        shape = (*shape, 1)
    return ExpertTensor(str(file), int(tensor.data_offset), tensor.tensor_type.name,
                        shape if len(shape) == 3 else (1, *shape), paired)


Runs = list[ExpertTensor]  # tensors of one weight, consecutive along the expert axis: together every expert


def _holding(runs: Runs, expert: int) -> tuple[ExpertTensor, int]:
    """The tensor among `runs` that holds `expert`, and the expert's index in it."""
    for run in runs:
        if expert < run.shape[0]:
            return run, expert
        expert -= run.shape[0]
    raise IndexError(f"no GGUF tensor holds expert {expert}")


def grid_steps(raw: np.ndarray, type_name: str) -> torch.Tensor | None:
    """The step of each group of 32 weights' 4-bit grid, `[rows, columns / 32]`, from a Q4_0, Q4_1 or Q4_K tensor's
    blocks (`raw`: uint8 `[rows, row bytes]`); None for other types. Q4_0: `d (q - 8)`; Q4_1: `d q + m`; Q4_K:
    `d sc_j q - dmin m_j` per sub-block j: the step is `d`, or `d sc_j`."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
    from gguf.quants import Q4_K

    if type_name not in ("Q4_0", "Q4_1", "Q4_K"):
        return None
    blocks = raw.reshape(-1, GGML_QUANT_SIZES[GGMLQuantizationType[type_name]][1])
    d = blocks[:, :2].view(np.float16).astype(np.float32)  # [blocks, 1]
    if type_name == "Q4_K":
        sub_scales, _ = Q4_K.get_scale_min(np.ascontiguousarray(blocks[:, Q4_K_SCALES]))
        d = d * sub_scales.astype(np.float32)  # [blocks, 8]
    return torch.from_numpy(np.abs(d).reshape(raw.shape[0], -1))  # Q4_0's d is negative where its extreme is


class GGUFExperts:
    """Every expert of a converted GGUF model, read from the GGUF file: `tensors[(MoE layer, parameter)]` lists the
    weights that make the parameter, each as the file's tensors of it. The file holds every weight `[out, in]`
    and a parameter's weights stacked by rows (gate's, then up's); a family may hold them otherwise, as its
    experts module says: `is_transposed` (`[in, out]`), or not `is_concatenated` (gate and up rows alternating:
    GPT-OSS)."""

    def __init__(self, tensors: dict[tuple[int, str], list[Runs]], layer: MoELayer, num_layers: int) -> None:
        self.tensors = tensors
        self.layout = layer.layout
        self.transposed, self.interleaved = held_as(layer.experts)
        self.keys: list[ExpertKey] = [(i, e) for i in range(num_layers) for e in range(layer.num_experts)]

    @property
    def in_place(self) -> bool:
        """Whether the family holds each expert as the file does, so float experts can be read where they lie."""
        return not (self.transposed or self.interleaved)

    def _parts(self, key: ExpertKey, name: str) -> list[tuple[ExpertTensor, int]]:
        """The tensors holding one expert's parameter `name`, in row order, with the expert's index in each."""
        layer, expert = key
        return [_holding(runs, expert) for runs in self.tensors[(layer, name)]]

    def _stacked(self, pieces: list[torch.Tensor]) -> torch.Tensor:
        """One parameter's weights (`[rows, ...]` each: gate, up) stacked by rows as the family stacks them."""
        if self.interleaved and len(pieces) > 1:
            return torch.stack(pieces, dim=1).flatten(0, 1)  # gate row 0, up row 0, gate row 1, ...
        return torch.cat(pieces)

    def float_segments(self) -> dict[ExpertKey, list[Segment]]:
        """Each expert's parts on disk, in its `ExpertLayout`'s order (float experts of a family that holds them
        as the file does only)."""
        assert self.in_place, "this family's experts are laid out again, not read in place"
        return {key: [t.float_segment(e) for name, _ in self.layout.parts for t, e in self._parts(key, name)]
                for key in self.keys}

    def dequantized(self, key: ExpertKey) -> dict[str, torch.Tensor]:
        """One expert's parameters in float32, in the model's shapes."""
        return {name: self._dequantized(key, name, shape) for name, shape in self.layout.parts}

    def _dequantized(self, key: ExpertKey, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        weight = self._stacked([t.dequantized(e) for t, e in self._parts(key, name)])  # [out, in]; a bias [out, 1]
        return (weight.t() if self.transposed and len(shape) == 2 else weight).reshape(shape)

    def read_float(self, key: ExpertKey, flat: torch.Tensor) -> None:
        """Fill `flat` (float32 `[layout.numel]`) with one expert."""
        views = self.layout.views(flat)
        for name, value in self.dequantized(key).items():
            views[name].copy_(value)

    def grid_steps(self, key: ExpertKey) -> dict[str, torch.Tensor]:
        """The 4-bit grid step of each group of 32 of the expert's weights that are stored on one (`grid_steps`),
        `[out, in / 32]`."""
        steps = {}
        for name, _ in self.layout.parts:
            found = [grid_steps(t.raw(e), t.type) for t, e in self._parts(key, name)]
            if found and all(s is not None for s in found):
                steps[name] = self._stacked(found)
        return steps

    def mxfp4_values(self, key: ExpertKey) -> dict[str, PublishedValue]:
        """One expert as a published MXFP4 checkpoint holds it: each MXFP4 weight's codes and scales (`[out,
        in / 2]`, `[out, in / 32]`, `ExpertTensor.mxfp4`), every other parameter (biases) in float32."""
        values = {}
        for name, shape in self.layout.parts:
            parts = self._parts(key, name)
            if all(t.type == "MXFP4" for t, _ in parts):
                codes, scales = zip(*(t.mxfp4(e) for t, e in parts))
                values[name] = (self._stacked(list(codes)), self._stacked(list(scales)))
            else:
                values[name] = self._dequantized(key, name, shape)
        return values


def read_marker(folder: Path) -> dict:
    """The GGUF conversion's marker in `folder`: {} for a folder that is no finished conversion."""
    try:
        return json.loads((folder / MARKER).read_text())
    except (OSError, ValueError):
        return {}


def gguf_experts(folder: Path, moe_layers: list[MoELayer]) -> GGUFExperts | None:
    """The experts of a GGUF model converted into `folder`, read from its GGUF file; None for any other folder
    (including one converted before experts were left in the file: it holds them as safetensors)."""
    recorded = read_marker(folder).get("experts")
    if recorded is None:
        return None
    tensors = {}
    for i, layer in enumerate(moe_layers):
        for name, shape in layer.layout.parts:
            weights = [[_from_record(t) for t in runs] for runs in recorded.get(f"{layer.path}.{name}", [])]
            if not _make(weights, layer.num_experts, out_in(shape, held_as(layer.experts)[0])):
                raise CheckpointError(f"{folder}: the GGUF experts recorded for {layer.path}.{name} do not make "
                                      f"{layer.num_experts} × {list(shape)}; delete the folder to convert again")
            for t in (t for runs in weights for t in runs):
                _check_file(folder, t)
            tensors[(i, name)] = weights
    return GGUFExperts(tensors, moe_layers[0], len(moe_layers))


def _from_record(record: dict) -> ExpertTensor:
    return ExpertTensor(**{**record, "shape": tuple(record["shape"])})


def held_as(experts: torch.nn.Module) -> tuple[bool, bool]:
    """How a family's experts module holds its weights, where the GGUF file holds each `[out, in]`, gate's rows
    then up's: (transposed: `[in, out]`; interleaved: gate and up rows alternating, GPT-OSS)."""
    return bool(getattr(experts, "is_transposed", False)), not getattr(experts, "is_concatenated", True)


def out_in(shape: tuple[int, ...], transposed: bool) -> tuple[int, int]:
    """One expert parameter of the model's `shape` as the GGUF file holds it, `[out, in]`; a bias `[out, 1]`."""
    if len(shape) == 1:
        return shape[0], 1
    return (shape[1], shape[0]) if transposed else (shape[0], shape[1])


def _make(weights: list[Runs], experts: int, shape: tuple[int, int]) -> bool:
    """Whether `weights`, stacked along rows, each its tensors along the experts, make `experts` × `shape`
    (`[out, in]`)."""
    rows = [{t.shape[1] for t in runs} for runs in weights]
    return (bool(weights) and all(len(r) == 1 for r in rows) and sum(r.pop() for r in rows) == shape[0]
            and all(sum(t.shape[0] for t in runs) == experts and all(t.shape[2] == shape[1] for t in runs)
                    for runs in weights))


def _check_file(folder: Path, t: ExpertTensor) -> None:
    end = t.offset + t.shape[0] * t.shape[1] * t.row_bytes
    try:
        size = Path(t.file).stat().st_size
    except OSError:
        size = -1
    if size < end:
        raise CheckpointError(f"the GGUF file {t.file}, which the model converted into {folder} reads its experts "
                              f"from, is gone or shorter than it was; serve the GGUF file again")


def recorded_experts(tensors: dict[str, list[Runs]]) -> dict[str, list[list[dict]]]:
    """The marker's record of where each expert parameter lies (`gguf_experts` reads it)."""
    return {name: [[asdict(t) for t in runs] for runs in weights] for name, weights in tensors.items()}


def experts_stored_once(folder: Path) -> bool:
    """Whether `folder` is a GGUF conversion whose experts are stored once in the expert store rather than read
    where they lie: those of a quantized GGML type (then even float experts are stored, decoded), or of a family
    that holds its experts otherwise than the file (`GGUFExperts.in_place`)."""
    marker = read_marker(folder)
    recorded = marker.get("experts", {})
    quantized = any(t["type"] not in FLOAT_TYPES for weights in recorded.values() for runs in weights for t in runs)
    return quantized or not marker.get("in_place", True)


def gguf_identity(folder: Path) -> bytes:
    """The GGUF file's identity for a folder whose experts are read from it (paths, sizes, mtimes); b"" else."""
    marker = read_marker(folder)
    return json.dumps([marker.get("source"), marker.get("identity")]).encode() if "experts" in marker else b""
