"""Where every tensor of a safetensors checkpoint lives on disk, read from the file headers.

Reading a tensor by its header offsets (instead of through a framework loader) lets the
host store copy one expert straight into a preallocated buffer with `os.preadv`.
"""

from __future__ import annotations

import json
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
    size = path.stat().st_size
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) < 8:
            raise CheckpointError(f"{path} is not a safetensors file (too short)")
        (header_len,) = struct.unpack("<Q", raw)
        if header_len > min(MAX_HEADER_BYTES, size - 8):
            raise CheckpointError(f"{path} is not a valid safetensors file (bad header length)")
        try:
            header = json.loads(f.read(header_len))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise CheckpointError(f"{path} is not a valid safetensors file (header: {e})") from None
    data_start = 8 + header_len
    locations = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            begin, end = info["data_offsets"]
            dtype = DTYPES[info["dtype"]]
            shape = tuple(int(d) for d in info["shape"])
        except (KeyError, TypeError, ValueError):
            raise CheckpointError(f"{path}: malformed header entry for {name!r}") from None
        if data_start + end > size or begin > end:
            raise CheckpointError(f"{path} is truncated or corrupt ({name!r} lies past the end of the file)")
        locations[name] = TensorLocation(path, dtype, shape, data_start + begin, end - begin)
    return locations


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
