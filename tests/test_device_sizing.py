"""Sizing the device expert cache from free CUDA memory: the dense weights, loaded after the cache,
are left room (without it a real model's dense weights ran out of memory at load)."""

from __future__ import annotations

import pytest
import torch
from accelerate import init_empty_weights
from transformers import AutoConfig, AutoModelForCausalLM

from engine.kv_budget import MIN_DEFAULT_CONTEXT, ContextNeed
from engine.model_loader import GIB, CacheSizing, _dense_bytes, _device_capacity
from engine.moe_layers import find_moe_layers
from tests.fixtures.models import build_checkpoint


@pytest.mark.parametrize("family", ["mixtral", "deepseek_v3"])
def test_dense_bytes_are_the_parameters_and_buffers_outside_the_experts(tmp_path, family):
    folder = build_checkpoint(family, tmp_path / family)
    with init_empty_weights(include_buffers=False):
        meta = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder))
    layers = find_moe_layers(meta)
    real = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16)
    expert_paths = tuple(layer.path + "." for layer in layers)
    params = sum(p.numel() * p.element_size() for name, p in real.named_parameters()
                 if not name.startswith(expert_paths))
    buffers = sum(b.numel() * b.element_size() for name, b in real.named_buffers() if not name.startswith(expert_paths))
    assert _dense_bytes(meta, layers, torch.bfloat16) == params + buffers
    assert 0 < params < sum(p.numel() * p.element_size() for p in real.parameters())


class Host:
    bytes_per_expert = GIB // 4


def test_free_memory_is_shared_with_the_dense_weights_and_the_headroom(monkeypatch):
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (20 * GIB, 24 * GIB))
    device = torch.device("cuda")
    # 20 GiB free, 2 GiB headroom: 72 experts of 0.25 GiB; 5 GiB of dense weights leave 52
    assert _device_capacity(CacheSizing(), Host(), device, total=1000) == (72, None)
    assert _device_capacity(CacheSizing(), Host(), device, total=1000, dense_bytes=5 * GIB) == (52, None)
    assert _device_capacity(CacheSizing(), Host(), device, total=40, dense_bytes=5 * GIB) == (40, None)
    assert _device_capacity(CacheSizing(device_experts=9), Host(), device, total=1000, dense_bytes=5 * GIB) == (9, None)
    assert _device_capacity(CacheSizing(device_gb=1.0), Host(), device, total=1000, dense_bytes=5 * GIB) == (4, None)
    with pytest.raises(ValueError, match="at least one expert"):
        _device_capacity(CacheSizing(), Host(), device, total=1000, dense_bytes=18 * GIB)


# -- the KV cache's share of device memory ------------------------------------------------------------
KIB = 1024
MIXTRAL_LIKE = ContextNeed(bytes_per_token=128 * KIB, model_max=32768)  # a full context: 4 GiB of KV cache


def sized(context: ContextNeed, total: int, dense_gib: float = 5) -> tuple[int, int | None]:
    return _device_capacity(CacheSizing(), Host(), torch.device("cuda"), total, int(dense_gib * GIB), context)


@pytest.fixture
def free_20_gib(monkeypatch):
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (20 * GIB, 24 * GIB))


def test_by_default_the_kv_cache_gets_an_eighth_of_the_room_when_the_experts_do_not_all_fit(free_20_gib, caplog):
    caplog.set_level("INFO")
    # 13 GiB of room (20 free, 5 dense, 2 headroom): an eighth is 1.625 GiB = 13,312 tokens of 128 KiB
    experts, context = sized(MIXTRAL_LIKE, total=1000)
    assert context == 13 * 1024
    assert experts == int((13 - 1.625) / 0.25)  # 45, where a full 32k context would have left 36
    assert "1.6 GiB for the KV cache of a 13312-token context: 45 experts" in caplog.text


def test_the_model_s_whole_context_when_it_fits_in_the_share_or_beside_every_expert(free_20_gib):
    short = ContextNeed(bytes_per_token=128 * KIB, model_max=8192)  # 1 GiB: within the eighth
    assert sized(short, total=1000) == (48, 8192)
    # 40 experts (10 GiB) leave 3 GiB: 24,576 tokens; the KV cache takes it and every expert still fits
    assert sized(MIXTRAL_LIKE, total=40) == (40, 24576)
    assert sized(MIXTRAL_LIKE, total=30) == (30, 32768)


def test_a_small_room_still_reserves_the_minimum_context(free_20_gib):
    # 1 GiB of room: an eighth holds 1,024 tokens, the floor is 4,096 (0.5 GiB): 2 experts
    assert sized(MIXTRAL_LIKE, total=1000, dense_gib=17) == (2, MIN_DEFAULT_CONTEXT)


def test_an_asked_for_context_is_reserved_whole_or_refused_with_what_to_change(free_20_gib):
    asked = ContextNeed(bytes_per_token=128 * KIB, model_max=32768, requested=65536)  # 8 GiB
    assert sized(asked, total=1000) == (20, 65536)
    too_long = ContextNeed(bytes_per_token=128 * KIB, model_max=32768, requested=131072)  # 16 GiB > 13 GiB of room
    with pytest.raises(ValueError, match=r"16\.0 GiB for the KV cache of a 131072-token context \(lower --max-model-len"):
        sized(too_long, total=1000)


def test_the_engine_serves_the_context_the_sizing_set_aside(tmp_path, monkeypatch):
    """On CUDA the sizing's context becomes the engine's limit (here a CPU load told it had set one
    aside); --max-model-len still wins."""
    import dataclasses

    from engine import engine as engine_module
    from engine.api import ContextLengthError, GenerationRequest, SamplingParams
    from engine.config import EngineConfig

    load = engine_module.load_offloaded_model

    def load_with_context(*args, **kwargs):
        return dataclasses.replace(load(*args, **kwargs), max_context=48)

    monkeypatch.setattr(engine_module, "load_offloaded_model", load_with_context)
    folder = build_checkpoint("mixtral", tmp_path / "m")
    engine = engine_module.Engine.load(EngineConfig(model=str(folder), device="cpu"))
    assert engine.max_model_len == 48
    with pytest.raises(ContextLengthError, match="maximum context length is 48"):
        list(engine.generate(GenerationRequest("long", list(range(10, 50)), SamplingParams(max_tokens=10))))
    asked = engine_module.Engine.load(EngineConfig(model=str(folder), device="cpu", max_model_len=64))
    assert asked.max_model_len == 64


# -- the RAM tier's default size ------------------------------------------------------------------
def test_available_ram_is_mem_available_within_a_container_limit(tmp_path):
    from engine.host_memory import available_ram_bytes

    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       65536000 kB\nMemFree:         1000000 kB\nMemAvailable:   50000000 kB\n")
    cgroup = tmp_path / "cgroup"
    cgroup.mkdir()
    assert available_ram_bytes(meminfo, cgroup) == 50000000 * 1024  # no cgroup files: the kernel's figure
    (cgroup / "memory.max").write_text("max\n")
    (cgroup / "memory.current").write_text("123\n")
    assert available_ram_bytes(meminfo, cgroup) == 50000000 * 1024  # v2 without a limit
    (cgroup / "memory.max").write_text(str(8 * GIB))
    (cgroup / "memory.current").write_text(str(3 * GIB))
    assert available_ram_bytes(meminfo, cgroup) == 5 * GIB  # `docker run --memory 8g`, 3 GiB used
    v1 = tmp_path / "v1"
    (v1 / "memory").mkdir(parents=True)
    (v1 / "memory" / "memory.limit_in_bytes").write_text(str(2**63 - 4096))
    (v1 / "memory" / "memory.usage_in_bytes").write_text("5")
    assert available_ram_bytes(meminfo, v1) == 50000000 * 1024  # v1 "unlimited"
    assert available_ram_bytes(tmp_path / "none", tmp_path / "none") is None


def test_without_a_size_the_ram_tier_holds_what_fits_and_reads_the_rest_from_disk(tmp_path, monkeypatch, caplog):
    from engine import model_loader
    from engine.api import GenerationRequest, SamplingParams
    from engine.config import EngineConfig
    from engine.engine import Engine

    folder = build_checkpoint("mixtral", tmp_path / "mixtral")
    config = EngineConfig(model=str(folder), device="cpu", policy="lru")
    roomy = Engine.load(config)
    total, per_expert = roomy.runtime.cache.capacity, roomy.loaded.host.bytes_per_expert
    assert total == 3 * 8  # every expert fits on this machine
    ids = roomy.encode("The capital of France is")
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    want = [t for e in roomy.generate(GenerationRequest("a", ids, params)) for t in e.token_ids]
    roomy.close()

    with init_empty_weights(include_buffers=False):
        meta = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder))
    dense = _dense_bytes(meta, find_moe_layers(meta), torch.float32)  # on CPU the dense weights are in RAM too
    available = int((dense + 5.5 * per_expert) * 4 / 3)  # a small machine keeps a quarter free
    monkeypatch.setattr(model_loader, "available_ram_bytes", lambda: available)
    tight = Engine.load(config)
    assert tight.runtime.cache.capacity == 5
    assert "read from disk at each miss" in caplog.text
    got = [t for e in tight.generate(GenerationRequest("b", ids, params)) for t in e.token_ids]
    assert got == want and tight.loaded.host.disk_reads > 0
    tight.close()


def test_a_large_machine_keeps_4_gib_free_a_small_one_a_quarter(monkeypatch):
    from engine import model_loader

    monkeypatch.setattr(model_loader, "available_ram_bytes", lambda: 64 * GIB)
    assert model_loader._ram_capacity(GIB, total=1000, reserved=10 * GIB) == 50  # 64 - 10 - 4
    monkeypatch.setattr(model_loader, "available_ram_bytes", lambda: 8 * GIB)
    assert model_loader._ram_capacity(GIB // 4, total=1000) == 24  # 8 - 2 GiB: 24 quarter-GiB experts
    assert model_loader._ram_capacity(GIB // 4, total=10) == 10
    monkeypatch.setattr(model_loader, "available_ram_bytes", lambda: None)
    assert model_loader._ram_capacity(GIB, total=1000) == 1000  # unknown (not Linux): every expert, as before
