"""Where every tensor of a safetensors checkpoint lives on disk, read from the file headers.

Reading a tensor by its header offsets (instead of through a framework loader) lets the
host store copy one expert straight into a preallocated buffer with `os.preadv`.
"""

from __future__ import annotations

import json
import math
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import torch

DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,  # FP8 checkpoints (DeepSeek-V3, Qwen3-FP8), with their scales
}

MAX_HEADER_BYTES = 100 * 1024 * 1024


class CheckpointError(ValueError):
    """A checkpoint folder or file that cannot be served; the message says why."""


@dataclass(frozen=True)
class TensorLocation:
    path: Path
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int  # absolute byte offset of the first element in the file
    nbytes: int

    def read(self) -> torch.Tensor:
        buffer = bytearray(self.nbytes)
        with open(self.path, "rb") as f:
            read_into(f.fileno(), memoryview(buffer), self.offset)
        if self.nbytes == 0:
            return torch.empty(self.shape, dtype=self.dtype)
        return torch.frombuffer(buffer, dtype=self.dtype).reshape(self.shape)


def read_into(fd: int, dst: memoryview, offset: int) -> None:
    """Fill `dst` from file `fd` at `offset`, looping over short reads."""
    done = 0
    while done < len(dst):
        n = os.preadv(fd, [dst[done:]], offset + done)
        if n <= 0:
            raise CheckpointError(f"unexpected end of file while reading at byte {offset + done}")
        done += n


def read_header(path: Path) -> dict[str, TensorLocation]:
    """Every tensor's location, checked against the file before any tensor is read: offsets in
    the data section, no two tensors sharing bytes, each size what its dtype and shape need."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) < 8:
            raise CheckpointError(f"{path} is not a safetensors file (too short)")
        (header_len,) = struct.unpack("<Q", raw)
        if header_len > min(MAX_HEADER_BYTES, size - 8):
            raise CheckpointError(f"{path} is not a valid safetensors file (header length {header_len} "
                                  f"in a file of {size} bytes; at most {MAX_HEADER_BYTES})")
        try:
            header = json.loads(f.read(header_len))
        except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
            raise CheckpointError(f"{path} is not a valid safetensors file (header: {e})") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path} is not a valid safetensors file (the header is not a JSON object)")
    data_start, data_size = 8 + header_len, size - 8 - header_len
    locations = {name: _location(path, name, info, data_start, data_size)
                 for name, info in header.items() if name != "__metadata__"}
    _check_no_overlap(path, locations)
    return locations


def _location(path: Path, name: str, info: object, data_start: int, data_size: int) -> TensorLocation:
    """One header entry as a location; `CheckpointError` unless it lies inside the data section
    and its byte count is what its dtype and shape need."""
    try:
        begin, end = info["data_offsets"]
        dtype = DTYPES[info["dtype"]]
        shape = tuple(info["shape"])
    except (KeyError, TypeError, ValueError):
        raise CheckpointError(f"{path}: malformed header entry for {name!r}") from None
    if not all(_is_count(v) for v in (begin, end, *shape)):
        raise CheckpointError(f"{path}: {name!r} has offsets or a shape that are not non-negative integers")
    if not begin <= end <= data_size:
        raise CheckpointError(f"{path} is truncated or corrupt ({name!r} lies past the end of the file: "
                              f"bytes [{begin}, {end}) of a {data_size}-byte data section)")
    needed = math.prod(shape) * dtype.itemsize
    if end - begin != needed:
        raise CheckpointError(f"{path}: {name!r} holds {end - begin} bytes, but {info['dtype']} of shape "
                              f"{list(shape)} needs {needed}")
    return TensorLocation(path, dtype, shape, data_start + begin, end - begin)


def _is_count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _check_no_overlap(path: Path, locations: dict[str, TensorLocation]) -> None:
    ordered = sorted(locations.items(), key=lambda item: item[1].offset)
    for (before, first), (after, second) in zip(ordered, ordered[1:]):
        if second.offset < first.offset + first.nbytes:
            raise CheckpointError(f"{path} is corrupt: tensors {before!r} and {after!r} share bytes")


def index_checkpoint(folder: Path) -> dict[str, TensorLocation]:
    """Tensor name → location over every safetensors shard of a checkpoint folder."""
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        pickles = [p.name for p in folder.glob("*.bin")] + [p.name for p in folder.glob("*.pt")]
        if pickles:
            raise CheckpointError(
                f"{folder} holds only pickle checkpoints ({', '.join(sorted(pickles)[:3])}); "
                "moe-serve loads safetensors only, because pickle files can run code when loaded. "
                "Convert the checkpoint to safetensors first."
            )
        raise CheckpointError(f"{folder} holds no *.safetensors files")
    index: dict[str, TensorLocation] = {}
    for path in files:
        index.update(read_header(path))
    return index
