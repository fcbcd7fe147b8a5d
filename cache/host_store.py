"""The host tier: every expert's weights as one contiguous buffer in RAM, or read from disk.

An expert buffer holds the expert's parameters flat, in `ExpertLayout` order, in the
compute dtype (quantized experts: uint8, as a `cache.quant.QuantLayout` places them); on
CUDA it is pinned so that host→device copies run asynchronously.
With a RAM budget smaller than all experts, the store keeps a bounded LRU tier of
buffers and reads the rest from the safetensors files on demand.
"""

from __future__ import annotations

import logging
import math
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

from cache.policy import ExpertKey
from cache.quant import QuantLayout
from cache.safetensors_index import TensorLocation, read_into

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Segment:
    """A run of bytes on disk holding one part (gate, up or down) of one expert."""

    path: Path
    offset: int
    numel: int
    dtype: torch.dtype

    @classmethod
    def slice_of(
        cls, loc: TensorLocation, index: int | None = None, part: int = 0, parts: int = 1
    ) -> Segment:
        """The `part`-th of `parts` equal row blocks of `loc` (or of `loc[index]` for fused tensors)."""
        numel = 1
        for d in loc.shape:
            numel *= d
        offset = loc.offset
        if index is not None:
            numel //= loc.shape[0]
            offset += index * numel * loc.dtype.itemsize
        numel //= parts
        offset += part * numel * loc.dtype.itemsize
        return cls(loc.path, offset, numel, loc.dtype)


@dataclass(frozen=True)
class ExpertLayout:
    """One expert's parameters as they lie, flat and in this order, in a host buffer or a cache slot.

    `parts` are the family's per-expert tensors (its fused parameter `[E, ...]` without the
    expert dimension), e.g. `gate_up_proj [2I, H]`, `down_proj [H, I]`, and biases where the
    family has them.
    """

    parts: tuple[tuple[str, tuple[int, ...]], ...]  # (parameter name, per-expert shape)

    @classmethod
    def gated(cls, hidden: int, intermediate: int) -> ExpertLayout:
        """The common layout: `gate_up_proj [2I, H]` (gate rows, then up rows), `down_proj [H, I]`."""
        return cls((("gate_up_proj", (2 * intermediate, hidden)), ("down_proj", (hidden, intermediate))))

    @property
    def numel(self) -> int:
        return sum(math.prod(shape) for _, shape in self.parts)

    def views(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        """Each parameter as a view into `flat` (`[numel]`, or `[n, numel]` for n experts → `[n, *shape]`)."""
        views, start = {}, 0
        for name, shape in self.parts:
            size = math.prod(shape)
            views[name] = flat[..., start : start + size].unflatten(-1, shape)
            start += size
        return views


class BufferArena:
    """Equal expert buffers cut out of large slabs of `2^k` bytes, and reused once released.

    torch's pinned allocator rounds every allocation up to a power of two, so one pinned buffer per
    expert costs +52% for a Mixtral expert (352 MB → 512 MiB) and +94% for a DeepSeek-V2-Lite one.
    A slab of `2^k` bytes is not rounded; the waste is its tail, less than one buffer.
    """

    MIN_SLAB_BYTES = 256 * 2**20
    BUFFERS_PER_SLAB = 4  # at least
    ALIGN = 64  # bytes between buffers: what vector loads of the host kernels want

    def __init__(self, numel: int, dtype: torch.dtype, pin_memory: bool, expected_buffers: int | None = None) -> None:
        """`expected_buffers`: how many the owner keeps at most (a small store gets a small slab)."""
        self.numel, self.dtype, self.pin_memory = numel, dtype, pin_memory
        self.stride = -(-numel * dtype.itemsize // self.ALIGN) * self.ALIGN
        wanted = max(self.MIN_SLAB_BYTES, self.BUFFERS_PER_SLAB * self.stride)
        if expected_buffers is not None:
            wanted = min(wanted, max(1, expected_buffers) * self.stride)
        self.slab_bytes = 1 << (wanted - 1).bit_length()
        self.per_slab = self.slab_bytes // self.stride
        self.slabs: list[torch.Tensor] = []
        self._next = self.per_slab  # the next unused buffer of the last slab
        self._released: list[torch.Tensor] = []

    def new(self) -> torch.Tensor:
        """A buffer of `[numel]` elements: a released one, else the next one of the last slab."""
        if self._released:
            return self._released.pop()
        if self._next == self.per_slab:
            self.slabs.append(torch.empty(self.slab_bytes, dtype=torch.uint8, pin_memory=self.pin_memory))
            self._next = 0
        start = self._next * self.stride
        self._next += 1
        return self.slabs[-1][start: start + self.numel * self.dtype.itemsize].view(self.dtype)

    def release(self, buffer: torch.Tensor) -> None:
        self._released.append(buffer)


def thread_cpu_and_queue_ns() -> tuple[int, int]:
    """This thread's CPU time and its time spent waiting for a core, in ns.

    The CPU time is the precise clock (schedstat's lags by up to a tick); the wait for a core
    is Linux's schedstat, and reads as 0 elsewhere (counted as disk wait then)."""
    try:
        with open("/proc/thread-self/schedstat") as f:
            queued_ns = int(f.read().split()[1])
    except (OSError, ValueError, IndexError):
        queued_ns = 0
    return time.thread_time_ns(), queued_ns


@dataclass
class ReadTimes:
    """Running means of one expert's read from disk, in ms: wall time, the reading thread's CPU
    time, and its wait for a core.

    What a read costs the engine depends on where its time goes: waiting on the disk leaves the
    cores to the compute, copying out of the page cache is CPU work (see `HostReadCost`)."""

    wall_ms: float = 0.0
    cpu_ms: float = 0.0
    queued_ms: float = 0.0
    reads: int = 0

    def observe(self, wall_ms: float, cpu_ms: float, queued_ms: float) -> None:
        weight = max(0.1, 1.0 / (self.reads + 1))  # the plain mean of the first ten, then a running one
        self.wall_ms += weight * (wall_ms - self.wall_ms)
        self.cpu_ms += weight * (min(cpu_ms, wall_ms) - self.cpu_ms)
        self.queued_ms += weight * (min(queued_ms, wall_ms) - self.queued_ms)
        self.reads += 1

    @property
    def disk_ms(self) -> float:
        """The part of a read spent waiting on the disk: neither on a core nor waiting for one."""
        return max(0.0, self.wall_ms - self.cpu_ms - self.queued_ms)


class HostStore:
    """(layer, expert) → flat host buffer, with at most `capacity` buffers in RAM.

    On CUDA this is the RAM tier the device slots are filled from. On CPU it holds no
    buffers (`capacity=0`): the expert cache's slots are the RAM tier, read into directly.
    """

    def __init__(
        self,
        sources: dict[ExpertKey, list[Segment]],
        layout: ExpertLayout | QuantLayout,  # `numel`: the elements of one expert buffer
        dtype: torch.dtype,
        capacity: int | None = None,
        pin_memory: bool = False,
    ) -> None:
        self.sources = sources
        self.layout = layout
        self.dtype = dtype
        # 0: no RAM tier here; the caller reads experts into buffers of its own (`read_into`)
        self.capacity = len(sources) if capacity is None else max(0, min(capacity, len(sources)))
        self.pin_memory = pin_memory
        self.bytes_per_expert = layout.numel * dtype.itemsize
        self.disk_reads = 0
        self.read_times = ReadTimes()
        self._resident: OrderedDict[ExpertKey, torch.Tensor] = OrderedDict()  # least recent first
        self._in_flight: dict[int, object] = {}  # id(buffer) → event of the last copy out of it
        self._held: dict[int, int] = {}  # id(buffer) → holders (see `hold`)
        self._lock = threading.RLock()
        self._arena = BufferArena(layout.numel, dtype, pin_memory, self.capacity) if pin_memory else None

    @property
    def fully_resident(self) -> bool:
        return self.capacity >= len(self.sources)

    def preload(self) -> None:
        """Read experts into RAM up to the budget (all of them when they fit)."""
        for key in list(self.sources)[: self.capacity]:
            self.get(key)

    def get(self, key: ExpertKey) -> torch.Tensor:
        """The expert's buffer, for reading now: another thread may recycle it at any time
        after this returns, so a copy out of it must use `hold` instead."""
        with self._lock:
            buffer = self._resident.get(key)
            if buffer is not None:
                self._resident.move_to_end(key)
                return buffer
            buffer = self._free_buffer()
            self.read_into(key, buffer)
            self._resident[key] = buffer
            self._trim(keep=key)
            return buffer

    @contextmanager
    def hold(self, key: ExpertKey) -> Iterator[torch.Tensor]:
        """`get(key)`, with the buffer kept out of recycling until the block ends.

        Every copy out of a host buffer runs inside such a block (and records its device
        event there with `record_copy`), so no other reader can overwrite it meanwhile.
        """
        with self._lock:
            buffer = self.get(key)
            self._held[id(buffer)] = self._held.get(id(buffer), 0) + 1
        try:
            yield buffer
        finally:
            with self._lock:
                left = self._held.pop(id(buffer)) - 1
                if left:
                    self._held[id(buffer)] = left

    def record_copy(self, buffer: torch.Tensor, event: object) -> None:
        """A device copy out of `buffer` (held by the caller) is in flight until `event` completes."""
        if self.fully_resident:
            return  # buffers are never recycled
        with self._lock:
            if id(buffer) not in self._held:
                raise RuntimeError("a copy out of a host buffer that is not held")
            self._in_flight[id(buffer)] = event

    def _free_buffer(self) -> torch.Tensor:
        """A buffer to read into: a new one under the budget, else the least recent one not held.

        When every buffer is held (a prefetch holds the only one of a budget of one), a new
        one exceeds the budget until `_trim` can drop a buffer again.
        """
        victim = self._recyclable()
        if len(self._resident) < self.capacity or victim is None:
            return self._arena.new() if self._arena else torch.empty(self.layout.numel, dtype=self.dtype)
        return self._take(victim)

    def _trim(self, keep: ExpertKey) -> None:
        """Back to the budget, dropping neither held buffers nor `keep` (just read, about to be used)."""
        while len(self._resident) > self.capacity and (victim := self._recyclable(keep)) is not None:
            buffer = self._take(victim)
            if self._arena:
                self._arena.release(buffer)

    def _recyclable(self, keep: ExpertKey | None = None) -> ExpertKey | None:
        return next(
            (key for key, buf in self._resident.items() if key != keep and id(buf) not in self._held), None
        )

    def _take(self, key: ExpertKey) -> torch.Tensor:
        buffer = self._resident.pop(key)
        event = self._in_flight.pop(id(buffer), None)
        if event is not None:
            event.synchronize()  # never overwrite a buffer a copy is still reading
        return buffer

    def read_into(self, key: ExpertKey, buffer: torch.Tensor) -> None:
        """Read the expert from disk into `buffer` (`[numel]`, this store's dtype)."""
        self.disk_reads += 1
        started, (cpu_ns, queued_ns) = time.perf_counter(), thread_cpu_and_queue_ns()
        start = 0
        for seg in self.sources[key]:
            dst = buffer[start : start + seg.numel]
            if seg.dtype == self.dtype:
                _read_segment(seg, dst)
            else:
                dst.copy_(read_segment(seg))
            start += seg.numel
        if start != self.layout.numel:
            raise ValueError(f"expert {key} has {start} elements on disk, expected {self.layout.numel}")
        cpu_end_ns, queued_end_ns = thread_cpu_and_queue_ns()
        self.read_times.observe(1000 * (time.perf_counter() - started), (cpu_end_ns - cpu_ns) / 1e6,
                                (queued_end_ns - queued_ns) / 1e6)


def read_segment(seg: Segment) -> torch.Tensor:
    """One segment from disk as a new tensor of its own dtype (`[numel]`)."""
    out = torch.empty(seg.numel, dtype=seg.dtype)
    _read_segment(seg, out)
    return out


def _read_segment(seg: Segment, dst: torch.Tensor) -> None:
    raw = dst.view(torch.uint8).numpy()
    fd = os.open(seg.path, os.O_RDONLY)
    try:
        read_into(fd, memoryview(raw), seg.offset)
    finally:
        os.close(fd)
