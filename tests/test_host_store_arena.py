"""Expert buffers cut out of power-of-two slabs: torch's pinned allocator rounds each allocation up to
a power of two (+52% for a Mixtral expert); slabs of 2^k bytes waste less than a buffer each."""

from __future__ import annotations

import torch

from cache.host_store import BufferArena


def test_buffers_are_disjoint_aligned_views_of_few_power_of_two_slabs():
    arena = BufferArena(numel=1000, dtype=torch.float32, pin_memory=False)
    buffers = [arena.new() for _ in range(300)]
    assert all(b.shape == (1000,) and b.dtype == torch.float32 for b in buffers)
    assert arena.stride == 4032 and arena.slab_bytes == arena.MIN_SLAB_BYTES and len(arena.slabs) == 1
    for i, b in enumerate(buffers):
        b.fill_(i)
    assert all(b[0].item() == b[-1].item() == i for i, b in enumerate(buffers))  # no overlap
    assert all(b.data_ptr() % arena.ALIGN == 0 for b in buffers)


def test_a_mixtral_expert_costs_its_own_bytes_not_the_next_power_of_two():
    numel = 3 * 4096 * 14336  # bf16: 352,321,536 bytes; one pinned allocation each would take 512 MiB
    arena = BufferArena(numel, torch.bfloat16, pin_memory=False)
    assert arena.slab_bytes == 2**31 and arena.per_slab == 6
    slabs_for_all = -(-256 // arena.per_slab)
    assert slabs_for_all * arena.slab_bytes / (256 * numel * 2) < 1.03  # 256 experts: +2.4% (one by one: +52%)


def test_released_buffers_are_reused_before_the_slab_grows():
    arena = BufferArena(numel=10, dtype=torch.float32, pin_memory=False, expected_buffers=3)
    assert arena.slab_bytes == 256  # a small store gets a small slab: 3 × 64 bytes, rounded up
    first = [arena.new() for _ in range(4)]
    assert len(arena.slabs) == 1 and arena.per_slab == 4
    arena.release(first[1])
    assert arena.new() is first[1] and len(arena.slabs) == 1
    arena.new()
    assert len(arena.slabs) == 2
