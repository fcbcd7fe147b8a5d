"""Quantized experts on disk: quantized once, reused by every later start.

The file is a plain safetensors file (so `safetensors_index.read_header` indexes it and the host
store reads an expert by offset like any checkpoint tensor): one uint8 tensor per expert, named
`"{layer}.{expert}"`, holding the expert's packed buffer (`cache.quant.QuantLayout`). Its
`__metadata__` carries the format version, the checkpoint's identity and the layout (expert
dtype, group sizes, compute dtype, packing per device); a file whose metadata differs from what
this start wants, or that is truncated or unreadable, is rebuilt with a warning. Written
atomically (temp file, fsync, rename), as the EAMC file is.
"""

from __future__ import annotations

import json
import logging
import shutil
import struct
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import BinaryIO

import torch

from cache.eamc_file import write_atomically
from cache.host_store import Segment
from cache.policy import ExpertKey
from cache.quant import QuantLayout
from cache.safetensors_index import CheckpointError, read_header

log = logging.getLogger(__name__)

FORMAT = "moe-quant/2"  # 2: int4 with a zero point per group


def tensor_name(key: ExpertKey) -> str:
    return f"{key[0]}.{key[1]}"


def open_quant_store(
    path: Path,
    checkpoint: str,
    layout: QuantLayout,
    keys: Sequence[ExpertKey],
    pack_one: Callable[[ExpertKey, torch.Tensor], None],
    threads: int = 1,
) -> dict[ExpertKey, list[Segment]]:
    """Each expert's place in the quantized file at `path`, building the file first unless a
    valid one for this `checkpoint` and `layout` is there. `pack_one(key, out)` fills `out`
    (uint8 [layout.nbytes]) with the expert's packed bytes; `threads` call it at once (on different keys)."""
    metadata = {"format": FORMAT, "checkpoint": checkpoint, "layout": layout.to_json()}
    segments = _valid_segments(path, metadata, layout, keys)
    if segments is not None:
        log.info("quantized experts: reusing %s", path)
        return segments
    path.parent.mkdir(parents=True, exist_ok=True)
    check_free_space(path.parent, len(keys) * layout.nbytes, "storing the experts in this form")
    start = time.perf_counter()
    write_atomically(path, lambda f: _write(f, metadata, layout, keys, pack_one, threads))
    log.info(
        "quantized %d experts to %s in %.1f s (%.1f MiB each)",
        len(keys), path, time.perf_counter() - start, layout.nbytes / 2**20,
    )
    segments = _valid_segments(path, metadata, layout, keys)
    if segments is None:
        raise CheckpointError(f"the quantized expert file {path} just written does not read back")
    return segments


def check_free_space(folder: Path, needed: int, what: str) -> None:
    """Refuse at once, saying why and what to do, where writing `needed` bytes into `folder` would fill its disk
    (the state folder: quantized experts, a GGUF model's conversion) after minutes of work."""
    free = shutil.disk_usage(folder).free
    if needed * 1.05 > free:
        raise CheckpointError(f"{what} needs {needed / 2**30:.1f} GiB in {folder}, which has {free / 2**30:.1f} GiB "
                              f"free; set MOE_SERVE_STATE_DIR to a folder on a larger disk")


def _valid_segments(
    path: Path, metadata: dict, layout: QuantLayout, keys: Sequence[ExpertKey]
) -> dict[ExpertKey, list[Segment]] | None:
    """The experts' segments if `path` is a complete file with this metadata; else None (with a warning)."""
    if not path.exists():
        return None
    try:
        stored = _read_metadata(path)
        if stored != metadata:
            differs = sorted(k for k in metadata if stored.get(k) != metadata[k])
            log.warning("quantized expert file %s was made for another %s; rebuilding it", path, ", ".join(differs))
            return None
        locations = read_header(path)
        segments = {}
        for key in keys:
            loc = locations[tensor_name(key)]
            if loc.dtype != torch.uint8 or loc.nbytes != layout.nbytes:
                raise CheckpointError(f"expert {key} has {loc.nbytes} bytes, expected {layout.nbytes}")
            segments[key] = [Segment(loc.path, loc.offset, loc.nbytes, torch.uint8)]
        return segments
    except (CheckpointError, KeyError, OSError, ValueError) as exc:
        log.warning("quantized expert file %s is unreadable or corrupt (%s); rebuilding it", path, exc)
        return None


def _read_metadata(path: Path) -> dict:
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) < 8:
            raise CheckpointError("too short")
        (length,) = struct.unpack("<Q", raw)
        if length > path.stat().st_size - 8:
            raise CheckpointError("bad header length")
        header = json.loads(f.read(length))
    return header.get("__metadata__") or {}


def _header(metadata: dict, layout: QuantLayout, keys: Sequence[ExpertKey]) -> bytes:
    """The safetensors header: experts back to back, padded so the data starts 64-byte aligned."""
    entries: dict = {"__metadata__": metadata}
    for n, key in enumerate(keys):
        begin = n * layout.nbytes
        entries[tensor_name(key)] = {"dtype": "U8", "shape": [layout.nbytes], "data_offsets": [begin, begin + layout.nbytes]}
    text = json.dumps(entries).encode()
    text += b" " * (-(8 + len(text)) % 64)
    return struct.pack("<Q", len(text)) + text


def _write(
    f: BinaryIO,
    metadata: dict,
    layout: QuantLayout,
    keys: Sequence[ExpertKey],
    pack_one: Callable[[ExpertKey, torch.Tensor], None],
    threads: int,
) -> None:
    f.write(_header(metadata, layout, keys))
    started = last_log = time.perf_counter()
    with ThreadPoolExecutor(max(1, threads)) as pool:
        for n, buffer in enumerate(_packed_in_order(pool, max(1, threads), layout, keys, pack_one), 1):
            f.write(buffer.numpy().data)
            if time.perf_counter() - last_log > 10:
                last_log = time.perf_counter()
                left = (last_log - started) / n * (len(keys) - n)
                log.info("storing the experts once: %d of %d, about %s left", n, len(keys),
                         f"{left:.0f} s" if left < 90 else f"{left / 60:.0f} min")


def _packed_in_order(
    pool: ThreadPoolExecutor,
    threads: int,
    layout: QuantLayout,
    keys: Sequence[ExpertKey],
    pack_one: Callable[[ExpertKey, torch.Tensor], None],
) -> Iterator[torch.Tensor]:
    """Each expert's packed buffer in the order of `keys`, at most two per thread packed ahead of the writer."""

    def packed(key: ExpertKey) -> torch.Tensor:
        buffer = torch.empty(layout.nbytes, dtype=torch.uint8)
        pack_one(key, buffer)
        return buffer

    pending: deque[Future] = deque()
    for key in keys:
        pending.append(pool.submit(packed, key))
        if len(pending) >= 2 * threads:
            yield pending.popleft().result()
    while pending:
        yield pending.popleft().result()
