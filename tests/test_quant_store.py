"""The quantized expert file (cache/quant_store.py): built once, reused, rebuilt when wrong, never half-written."""

from __future__ import annotations

import logging
import os
import shutil
from collections import namedtuple

import pytest
import torch

from cache.host_store import Segment
from cache.quant import ParamSpec, pack_expert, plan_layout
from cache.quant_store import open_quant_store
from cache.safetensors_index import CheckpointError, TensorLocation

KEYS = [(layer, expert) for layer in range(2) for expert in range(3)]
SPECS = [ParamSpec("gate_up_proj", (64, 64)), ParamSpec("down_proj", (64, 32))]


def _weights(key):
    gen = torch.Generator().manual_seed(100 * key[0] + key[1])
    return {s.name: torch.randn(s.shape, generator=gen) for s in SPECS}


class Packer:
    """`pack_one` for the store, counting the experts it was asked to quantize."""

    def __init__(self, layout, fail_at: int | None = None):
        self.layout, self.fail_at, self.calls = layout, fail_at, 0

    def __call__(self, key, out):
        self.calls += 1
        if self.calls == self.fail_at:
            raise OSError("disk full")
        pack_expert(self.layout, _weights(key), out)


def _read(seg: Segment) -> torch.Tensor:
    return TensorLocation(seg.path, seg.dtype, (seg.numel,), seg.offset, seg.numel).read()


def _expected(layout, key) -> torch.Tensor:
    out = torch.empty(layout.nbytes, dtype=torch.uint8)
    pack_expert(layout, _weights(key), out)
    return out


@pytest.fixture
def layout():
    return plan_layout(SPECS, "int4", 32, torch.float32, "cpu")


def test_built_once_then_reused_with_the_same_bytes(tmp_path, layout):
    path = tmp_path / "experts" / "m.moeq"
    first = Packer(layout)
    segments = open_quant_store(path, "digest-a", layout, KEYS, first)
    assert first.calls == len(KEYS)
    again = Packer(layout)
    reused = open_quant_store(path, "digest-a", layout, KEYS, again)
    assert again.calls == 0 and reused == segments
    for key in KEYS:
        (seg,) = reused[key]
        assert seg.offset % 64 == 0
        assert torch.equal(_read(seg), _expected(layout, key))


@pytest.mark.parametrize("change", ["checkpoint", "group size", "expert dtype"])
def test_a_file_for_another_checkpoint_or_form_is_rebuilt_with_a_warning(tmp_path, layout, change, caplog):
    path = tmp_path / "m.moeq"
    open_quant_store(path, "digest-a", layout, KEYS, Packer(layout))
    digest, other = "digest-a", layout
    if change == "checkpoint":
        digest = "digest-b"
    elif change == "group size":
        other = plan_layout(SPECS, "int4", 64, torch.float32, "cpu")
    else:
        other = plan_layout(SPECS, "int8", 32, torch.float32, "cpu")
    packer = Packer(other)
    with caplog.at_level(logging.WARNING):
        segments = open_quant_store(path, digest, other, KEYS, packer)
    assert packer.calls == len(KEYS)
    assert "made for another" in caplog.text
    assert torch.equal(_read(segments[KEYS[-1]][0]), _expected(other, KEYS[-1]))


@pytest.mark.parametrize("damage", ["truncated", "garbage header", "empty"])
def test_a_corrupt_file_is_rebuilt_with_a_warning(tmp_path, layout, damage, caplog):
    path = tmp_path / "m.moeq"
    open_quant_store(path, "digest-a", layout, KEYS, Packer(layout))
    data = path.read_bytes()
    if damage == "truncated":
        path.write_bytes(data[: len(data) - layout.nbytes // 2])
    elif damage == "garbage header":
        path.write_bytes(data[:8] + b"\xff" * 64 + data[72:])
    else:
        path.write_bytes(b"")
    packer = Packer(layout)
    with caplog.at_level(logging.WARNING):
        segments = open_quant_store(path, "digest-a", layout, KEYS, packer)
    assert packer.calls == len(KEYS) and "corrupt" in caplog.text
    assert path.stat().st_size == len(data)
    assert torch.equal(_read(segments[KEYS[0]][0]), _expected(layout, KEYS[0]))


def test_a_build_that_fails_midway_leaves_the_old_file_and_no_temp(tmp_path, layout):
    path = tmp_path / "m.moeq"
    open_quant_store(path, "digest-a", layout, KEYS, Packer(layout))
    before = path.read_bytes()
    with pytest.raises(OSError, match="disk full"):
        open_quant_store(path, "digest-b", layout, KEYS, Packer(layout, fail_at=3))
    assert path.read_bytes() == before
    assert os.listdir(tmp_path) == ["m.moeq"]


def test_experts_stored_by_several_threads_land_in_order(tmp_path, layout):
    one = open_quant_store(tmp_path / "one.moeq", "digest-a", layout, KEYS, Packer(layout))
    three = open_quant_store(tmp_path / "three.moeq", "digest-a", layout, KEYS, Packer(layout), threads=3)
    assert (tmp_path / "one.moeq").read_bytes() == (tmp_path / "three.moeq").read_bytes()
    assert [seg.offset for (seg,) in one.values()] == [seg.offset for (seg,) in three.values()]


def test_too_little_disk_space_is_said_before_any_expert_is_stored(tmp_path, layout, monkeypatch):
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda _: usage(10**9, 10**9 - 1000, 1000))
    packer = Packer(layout)
    with pytest.raises(CheckpointError, match=r"storing the experts .* needs .* GiB .* MOE_SERVE_STATE_DIR"):
        open_quant_store(tmp_path / "m.moeq", "digest-a", layout, KEYS, packer)
    assert packer.calls == 0 and os.listdir(tmp_path) == []
