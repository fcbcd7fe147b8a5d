"""Build the offloaded model: a transformers skeleton with dense weights on the device and
every MoE layer's experts served through the expert cache from the host store.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from accelerate import init_empty_weights
from torch import nn
from transformers import AutoConfig, PretrainedConfig

import cache.sparsity_aware  # noqa: F401  (registers the sparsity-aware policy)
from cache.expert_cache import ExpertCache, InPlaceBackend, SlotBackend
from cache.host_store import ExpertLayout, HostStore, Segment
from cache.policy import ExpertKey, make_policy
from cache.quant import QUANT_DTYPES, ParamSpec, QuantLayout, pack_expert, plan_layout
from cache.quant_formats import MXFP4_BLOCK
from cache.quant_published import (
    ExpertParts,
    PublishedFormat,
    dequantized_expert,
    pack_published_expert,
    pack_published_values,
    plan_float_layout,
    plan_published_layout,
    quantized_parts,
)
from cache.quant_store import open_quant_store
from cache.runtime import ExpertRuntime
from cache.safetensors_index import CheckpointError
from cache.stats import CacheStats
from engine.checkpoint import (
    ConvertedDense,
    ExpertSources,
    Location,
    expert_parts,
    expert_segments,
    hold_experts_as_stored,
    published_format,
    read_config_dict,
    read_location,
    split_checkpoint,
)
from engine.gguf_experts import GGUFExperts, gguf_experts
from engine.host_memory import available_ram_bytes
from engine.kv_budget import ContextNeed
from engine.moe_layers import MoELayer, find_moe_layers, top_k_of
from engine.multimodal import build_text_model
from engine.offloaded_experts import OffloadedExperts

log = logging.getLogger(__name__)

GIB = 1 << 30
CUDA_HEADROOM_BYTES = 2 * GIB  # left free for activations and the allocator when sizing the cache
PACK_THREADS, PACK_COPIES = 4, 5  # threads storing experts at once; float32 copies of an expert each holds
HOST_HEADROOM_BYTES = 4 * GIB  # at most this (a quarter on a small machine) left to the system, Python, the KV cache on CPU


@dataclass(frozen=True)
class CacheSizing:
    device_experts: int | None = None
    device_gb: float | None = None
    host_gb: float | None = None


@dataclass(frozen=True)
class QuantRequest:
    """Quantize the experts (`--expert-dtype int8|int4`), or lay out those of a checkpoint published
    quantized (`auto`: its bytes; `bf16`: decoded into the compute dtype), keeping the result in `store_path`."""

    expert_dtype: str  # "int8" | "int4" | "auto" | "bf16"
    group_size: int  # 0: one scale per output channel
    store_path: Path
    checkpoint: str  # the checkpoint's digest: a file for other weights is rebuilt


@dataclass
class OffloadedModel:
    model: nn.Module
    config: PretrainedConfig
    runtime: ExpertRuntime
    host: HostStore
    folder: Path
    moe_layers: list[MoELayer]
    offloaded: list[OffloadedExperts]  # the forward installed on each MoE layer's experts module
    layout: ExpertLayout
    num_experts: int
    top_k: int
    quant: QuantLayout | None = None  # None: experts in the compute dtype, in `layout`
    max_context: int | None = None  # the context whose KV cache the device sizing set aside (None: none was)


def load_offloaded_model(
    folder: Path,
    device: torch.device,
    dtype: torch.dtype,
    sizing: CacheSizing = CacheSizing(),
    policy: str = "lru",
    quant: QuantRequest | None = None,
    max_model_len: int | None = None,
) -> OffloadedModel:
    """`max_model_len`: the context asked for (None: the model's); on CUDA without a cache size, its KV
    cache is set aside before the expert cache takes the free memory."""
    fmt = published_format(read_config_dict(folder), folder / "config.json")  # refuses what cannot be served
    config = AutoConfig.from_pretrained(folder)
    with init_empty_weights(include_buffers=False):  # buffers built at init (Gemma's embedding scale) in `dtype`
        model = build_text_model(config, dtype)
    model.eval()
    hold_experts_as_stored(folder, model)

    moe_layers = find_moe_layers(model)
    if not moe_layers:
        raise CheckpointError(f"{config.model_type}: the model has no MoE layers")
    layout, num_experts = moe_layers[0].layout, moe_layers[0].num_experts
    if any((layer.layout, layer.num_experts) != (layout, num_experts) for layer in moe_layers):
        raise CheckpointError(f"{config.model_type}: MoE layers of different shapes are not supported")
    top_k = top_k_of(model, moe_layers)
    dense, expert_sources = split_checkpoint(folder, model, moe_layers, fmt)

    quant_layout, sources = _expert_files(folder, expert_sources, moe_layers, dtype, device, quant, fmt)
    host = _build_host_store(sources, quant_layout or layout, torch.uint8 if quant_layout else dtype, device, sizing)
    cache, max_context = _expert_cache(host, sizing, device, make_policy(policy, len(moe_layers), num_experts),
                                       len(moe_layers), _dense_bytes(model, moe_layers, dtype),
                                       ContextNeed.of(config, dtype, max_model_len))
    runtime = ExpertRuntime(cache, len(moe_layers), num_experts, top_k)
    slots = cache.backend.slots
    offloaded = [OffloadedExperts(i, layer, runtime, slots, quant_layout) for i, layer in enumerate(moe_layers)]
    for experts in offloaded:
        experts.install()

    _load_dense(model, dense, device, dtype, fmt)
    model.to(device)  # the buffers (rotary tables) built on the host at init
    tiers = (
        f"{cache.capacity} experts in RAM, computed in place, the rest read from disk"
        if device.type == "cpu"
        else f"device cache {cache.capacity} experts, RAM tier {host.capacity}"
    )
    log.info(
        "loaded %s: %d MoE layers × %d experts (top-%d), %.1f MiB per expert (%s); %s",
        config.model_type, len(moe_layers), num_experts, top_k, host.bytes_per_expert / 2**20,
        quant_layout.expert_dtype if quant_layout else str(dtype).removeprefix("torch."), tiers,
    )
    return OffloadedModel(
        model, config, runtime, host, folder, moe_layers, offloaded, layout, num_experts, top_k, quant_layout,
        max_context,
    )


def _expert_cache(host: HostStore, sizing: CacheSizing, device: torch.device, policy, num_layers: int,
                  dense_bytes: int = 0, context: ContextNeed | None = None) -> tuple[ExpertCache, int | None]:
    """On CPU the cache's slots are the RAM tier (experts computed in place); else device slots.
    `dense_bytes`: what the dense weights will take on the device (RAM on CPU); they load after the cache.
    Also returns the context whose KV cache the device sizing set aside (None: none was)."""
    total, stats = len(host.sources), CacheStats(num_layers)
    if device.type != "cpu":
        capacity, max_context = _device_capacity(sizing, host, device, total, dense_bytes, context)
        return ExpertCache(capacity, policy, stats, SlotBackend(host, capacity, device)), max_context
    capacity = _cpu_capacity(sizing, host.bytes_per_expert, total, dense_bytes)
    cache = ExpertCache(capacity, policy, stats, InPlaceBackend(host, capacity))
    if capacity == total:  # all in RAM: read once now, never again
        cache.preload(list(host.sources))
    return cache, None


ReadFloat = Callable[[ExpertKey, torch.Tensor], None]  # fills a float32 `[layout.numel]` buffer with one expert


def _expert_files(
    folder: Path,
    expert_sources: dict[str, ExpertSources],
    moe_layers: list[MoELayer],
    dtype: torch.dtype,
    device: torch.device,
    quant: QuantRequest | None,
    fmt: PublishedFormat | None,
) -> tuple[QuantLayout | None, dict[ExpertKey, list[Segment]]]:
    """Where each expert buffer lies on disk, and its layout (None: floats in the layers' `ExpertLayout`,
    read from the checkpoint itself)."""
    layer = moe_layers[0]
    from_gguf = gguf_experts(folder, moe_layers)
    if from_gguf is not None:
        return _gguf_sources(from_gguf, layer, dtype, device, quant)
    if fmt is None:
        sources = _per_expert(folder, expert_sources, moe_layers, expert_segments)
        if quant is None:
            return None, sources
        return _quantized_sources(list(sources), layer, dtype, device, quant, _float_reader(sources, layer))
    if quant is None:
        raise ValueError(f"a checkpoint published in {fmt.method} needs a QuantRequest: where to lay out its experts")
    parts = _per_expert(folder, expert_sources, moe_layers, expert_parts)
    if quant.expert_dtype in QUANT_DTYPES:
        return _quantized_sources(list(parts), layer, dtype, device, quant, _dequantizing_reader(parts, layer, fmt))
    return _published_sources(parts, layer, dtype, quant, fmt)


def _per_expert(folder: Path, expert_sources: dict[str, ExpertSources], moe_layers: list[MoELayer], of_layer) -> dict:
    """`of_layer(layer, its sources, MoE layer number)` (segments or parts by expert) over every MoE layer."""
    found = {}
    for moe_index, layer in enumerate(moe_layers):
        if layer.path not in expert_sources:
            raise CheckpointError(f"{folder} has no expert weights for {layer.path}")
        found.update(of_layer(layer, expert_sources[layer.path], moe_index))
    return found


def _param_specs(layer: MoELayer) -> list[ParamSpec]:
    transposed = bool(layer.experts.is_transposed)  # GPT-OSS style `[in, out]` weights
    return [ParamSpec(name, shape, transposed and len(shape) == 2) for name, shape in layer.layout.parts]


def _float_reader(sources: dict[ExpertKey, list[Segment]], layer: MoELayer) -> ReadFloat:
    return HostStore(sources, layer.layout, torch.float32, capacity=0).read_into  # reads experts from disk only


def _dequantizing_reader(parts: dict[ExpertKey, ExpertParts], layer: MoELayer, fmt: PublishedFormat) -> ReadFloat:
    """Each expert of a published checkpoint decoded to float32 (once, to quantize it in another form)."""
    specs = _param_specs(layer)

    def read_into(key: ExpertKey, flat: torch.Tensor) -> None:
        views = layer.layout.views(flat)
        for name, weight in dequantized_expert(specs, fmt, parts[key]).items():
            views[name].copy_(weight)

    return read_into


def _gguf_sources(
    experts: GGUFExperts, layer: MoELayer, dtype: torch.dtype, device: torch.device, quant: QuantRequest | None
) -> tuple[QuantLayout | None, dict[ExpertKey, list[Segment]]]:
    """A GGUF model's experts, read from its file: float ones where they lie; else stored once in the form asked
    for (int8/int4 on the file's own 4-bit grids where it has them; mxfp4: MXFP4 experts as the file holds them;
    any other dtype: decoded into `dtype`)."""
    if quant is None:
        return None, experts.float_segments()
    if quant.expert_dtype in QUANT_DTYPES:
        return _quantized_sources(experts.keys, layer, dtype, device, quant, experts.read_float, experts.grid_steps)
    if quant.expert_dtype == "mxfp4":
        return _gguf_mxfp4_sources(experts, layer, dtype, quant)
    return _decoded_sources(experts.keys, layer, dtype, quant, experts.dequantized)


def _gguf_mxfp4_sources(
    experts: GGUFExperts, layer: MoELayer, dtype: torch.dtype, quant: QuantRequest
) -> tuple[QuantLayout, dict[ExpertKey, list[Segment]]]:
    """A GGUF file's MXFP4 experts stored once as a published MXFP4 checkpoint's are: the same 4-bit codes and
    scales, reordered (`GGUFExperts.mxfp4_values`); biases in the compute dtype."""
    first = experts.mxfp4_values(experts.keys[0])
    quantized = {name: 1 for name, value in first.items() if isinstance(value, tuple)}
    layout = plan_published_layout(_param_specs(layer), PublishedFormat("mxfp4", (1, MXFP4_BLOCK)), quantized, dtype)

    def pack_one(key: ExpertKey, out: torch.Tensor) -> None:
        pack_published_values(layout, experts.mxfp4_values(key), out)

    return layout, open_quant_store(quant.store_path, quant.checkpoint, layout, experts.keys, pack_one,
                                    _pack_threads(layer))


def _quantized_sources(
    keys: list[ExpertKey], layer: MoELayer, dtype: torch.dtype, device: torch.device, quant: QuantRequest,
    read_float: ReadFloat, grid_steps: Callable[[ExpertKey], dict[str, torch.Tensor]] | None = None,
) -> tuple[QuantLayout, dict[ExpertKey, list[Segment]]]:
    """The experts quantized (once: the file is reused by later starts) and where each lies in that file.
    `grid_steps(key)`: the steps of the 4-bit grids the source stores the expert on (see `cache.quant.quantize`)."""
    quant_layout = plan_layout(_param_specs(layer), quant.expert_dtype, quant.group_size, dtype, device.type)

    def pack_one(key: ExpertKey, out: torch.Tensor) -> None:
        flat = torch.empty(layer.layout.numel, dtype=torch.float32)
        read_float(key, flat)
        pack_expert(quant_layout, layer.layout.views(flat), out, grid_steps(key) if grid_steps else None)

    return quant_layout, open_quant_store(quant.store_path, quant.checkpoint, quant_layout, keys, pack_one,
                                          _pack_threads(layer))


def _published_sources(
    parts: dict[ExpertKey, ExpertParts], layer: MoELayer, dtype: torch.dtype, quant: QuantRequest, fmt: PublishedFormat
) -> tuple[QuantLayout, dict[ExpertKey, list[Segment]]]:
    """A published checkpoint's experts laid out once in the store: `auto` their published bytes,
    copied; `bf16` decoded into the compute dtype."""
    specs = _param_specs(layer)
    if quant.expert_dtype != "auto":
        return _decoded_sources(list(parts), layer, dtype, quant, lambda key: dequantized_expert(specs, fmt, parts[key]))
    layout = plan_published_layout(specs, fmt, quantized_parts(next(iter(parts.values()))), dtype)

    def pack_one(key: ExpertKey, out: torch.Tensor) -> None:
        pack_published_expert(layout, parts[key], out)

    return layout, open_quant_store(quant.store_path, quant.checkpoint, layout, list(parts), pack_one,
                                    _pack_threads(layer))


def _decoded_sources(
    keys: list[ExpertKey], layer: MoELayer, dtype: torch.dtype, quant: QuantRequest,
    decode: Callable[[ExpertKey], dict[str, torch.Tensor]],
) -> tuple[QuantLayout, dict[ExpertKey, list[Segment]]]:
    """Experts stored quantized in the checkpoint, asked for as floats: `decode(key)` (the expert's parameters in
    float32) once per expert, stored in the compute dtype."""
    layout = plan_float_layout(_param_specs(layer), dtype)

    def pack_one(key: ExpertKey, out: torch.Tensor) -> None:
        pack_expert(layout, decode(key), out)

    return layout, open_quant_store(quant.store_path, quant.checkpoint, layout, keys, pack_one, _pack_threads(layer))


def _pack_threads(layer: MoELayer) -> int:
    """Threads that store experts at once: one per core (2 on 2 cores: 0.041 s per Qwen3-30B-A3B expert from a
    Q4_K file, against 0.055 s for one), at most `PACK_THREADS`, and no more than a quarter of the available RAM
    holds (each holds its expert in float32 and a few copies of it while quantizing)."""
    available = available_ram_bytes()
    by_ram = PACK_THREADS if available is None else available // 4 // (PACK_COPIES * 4 * layer.layout.numel)
    return max(1, min(PACK_THREADS, os.cpu_count() or 1, by_ram))


def _build_host_store(
    sources: dict[ExpertKey, list[Segment]],
    layout: ExpertLayout | QuantLayout,
    dtype: torch.dtype,
    device: torch.device,
    sizing: CacheSizing,
) -> HostStore:
    if device.type == "cpu":
        return HostStore(sources, layout, dtype, capacity=0)  # the expert cache holds the RAM tier
    bytes_per_expert = layout.numel * dtype.itemsize
    host_capacity = (_ram_capacity(bytes_per_expert, len(sources)) if sizing.host_gb is None
                     else max(1, _experts_in(sizing.host_gb, bytes_per_expert)))
    host = HostStore(sources, layout, dtype, host_capacity, pin_memory=True)
    host.preload()
    return host


def _cpu_capacity(sizing: CacheSizing, bytes_per_expert: int, total: int, dense_bytes: int = 0) -> int:
    """Experts kept in RAM on CPU: the smallest size given (any cache flag names the same memory), else
    all that fit beside the dense weights."""
    given = [n for n in (sizing.device_experts, _experts_in(sizing.device_gb, bytes_per_expert),
                         _experts_in(sizing.host_gb, bytes_per_expert)) if n is not None]
    return min(max(1, min(given)), total) if given else _ram_capacity(bytes_per_expert, total, dense_bytes)


def _ram_capacity(bytes_per_expert: int, total: int, reserved: int = 0) -> int:
    """The RAM tier's default size: every expert when they fit in the available RAM (less `reserved`
    and the headroom), else as many as fit, the rest read from disk at each miss (a machine with too
    little RAM used to be killed while loading them all)."""
    available = available_ram_bytes()
    if available is None:
        return total
    headroom = min(HOST_HEADROOM_BYTES, available // 4)  # a small machine keeps a quarter free
    fit = int(max(0, available - reserved - headroom) // bytes_per_expert)
    if fit < total:
        log.warning("RAM: %.1f GiB available holds %d of the %d experts (%.0f MiB each, %.1f GiB kept free); the "
                    "rest are read from disk at each miss. --host-cache-gb sets this size; --expert-dtype int8 or "
                    "int4 fits 2-3.5x more", available / GIB, max(1, fit), total, bytes_per_expert / 2**20,
                    headroom / GIB)
    return max(1, min(fit, total))


def _experts_in(gib: float | None, bytes_per_expert: int) -> int | None:
    return None if gib is None else int(gib * GIB // bytes_per_expert)


def _device_capacity(sizing: CacheSizing, host: HostStore, device: torch.device, total: int,
                     dense_bytes: int = 0, context: ContextNeed | None = None) -> tuple[int, int | None]:
    """Device slots, and the context whose KV cache was set aside for them (None: a size was given, so
    nothing was; the load then warns if a full context may not fit)."""
    given = sizing.device_experts
    if given is None:
        given = _experts_in(sizing.device_gb, host.bytes_per_expert)
    if given is not None:
        _check_at_least_one(given, host)
        return min(given, total), None
    # the free memory, less the dense weights still to come, the headroom and a context's KV cache
    free, _ = torch.cuda.mem_get_info(device)
    room = max(0, free - dense_bytes - CUDA_HEADROOM_BYTES)
    tokens = kv_bytes = 0
    if context is not None:
        tokens = context.tokens_to_reserve(room, total * host.bytes_per_expert)
        kv_bytes = tokens * context.bytes_per_token
    wanted = int(max(0, room - kv_bytes) // host.bytes_per_expert)
    log.info("device expert cache: %.1f GiB free, %.1f GiB for the dense weights, %.1f GiB headroom, %.1f GiB for "
             "the KV cache of a %d-token context: %d experts", free / GIB, dense_bytes / GIB,
             CUDA_HEADROOM_BYTES / GIB, kv_bytes / GIB, tokens, min(wanted, total))
    why = (f": {free / GIB:.1f} GiB free, less {dense_bytes / GIB:.1f} GiB of dense weights, "
           f"{CUDA_HEADROOM_BYTES / GIB:.0f} GiB headroom and {kv_bytes / GIB:.1f} GiB for the KV cache of a "
           f"{tokens}-token context (lower --max-model-len, or set --expert-cache-gb)")
    _check_at_least_one(wanted, host, why)
    return min(wanted, total), (tokens if context is not None else None)


def _check_at_least_one(wanted: int, host: HostStore, why: str = "") -> None:
    if wanted < 1:
        raise ValueError(
            f"the device expert cache must hold at least one expert ({host.bytes_per_expert / GIB:.3f} GiB){why}"
        )


def _dense_bytes(model: nn.Module, moe_layers: list[MoELayer], dtype: torch.dtype) -> int:
    """Bytes of every parameter and buffer but the experts' once on the device (the model is still on meta)."""
    experts = {id(t) for layer in moe_layers for t in (*layer.experts.parameters(), *layer.experts.buffers())}
    params = sum(t.numel() * (4 if _keeps_fp32(model, name) else dtype.itemsize)
                 for name, t in model.named_parameters() if id(t) not in experts)
    return params + sum(t.numel() * t.element_size() for t in model.buffers() if id(t) not in experts)


def _dense_dtype(model: nn.Module, name: str, dtype: torch.dtype) -> torch.dtype:
    """The dtype a float dense weight is held in: `dtype`, or float32 where the model keeps it so."""
    return torch.float32 if _keeps_fp32(model, name) else dtype


def _keeps_fp32(model: nn.Module, name: str) -> bool:
    patterns = getattr(model, "_keep_in_fp32_modules_strict", None) or []
    return any(re.search(rf"(^|\.){re.escape(p)}($|\.)", name) for p in patterns)


def _load_dense(
    model: nn.Module, dense: dict[str, Location | ConvertedDense], device: torch.device, dtype: torch.dtype,
    fmt: PublishedFormat | None = None,
) -> None:
    """The dense weights onto the device in `dtype`; published quantized ones decoded once (they are small)."""
    names = {*dict(model.named_parameters()), *dict(model.named_buffers())}
    unused = []  # tensors to join that no parameter takes
    for name, entry in list(dense.items()):
        if isinstance(entry, ConvertedDense):
            del dense[name]
            if name in names:  # else not read: a layer the model does not build (Step-3.5-Flash's MTP experts)
                dense.update(entry.convert(model, fmt))
            else:
                unused.append(name)
    missing = []
    for name, param in list(model.named_parameters()):
        loc = dense.pop(name, None)
        if loc is None:
            missing.append(name)
            continue
        _check_shape(name, loc, tuple(param.shape))
        value = _read_dense(loc, fmt).to(device=device, dtype=_dense_dtype(model, name, dtype))
        _set_tensor(model, name, nn.Parameter(value, requires_grad=False))
    for name, buffer in list(model.named_buffers()):
        loc = dense.pop(name, None)
        if loc is not None:  # a float one computes in `dtype` too (Gemma 4's layer_scalar), not in the config's
            _check_shape(name, loc, tuple(buffer.shape))
            target = _dense_dtype(model, name, dtype) if buffer.is_floating_point() else buffer.dtype
            _set_tensor(model, name, _read_dense(loc, fmt).to(device=device, dtype=target))
    if getattr(model.config, "tie_word_embeddings", False):
        missing = [name for name in missing if name != "lm_head.weight"]
        if model.lm_head.weight.is_meta:
            model.lm_head.weight = model.get_input_embeddings().weight
    if missing:
        raise CheckpointError(f"the checkpoint lacks {len(missing)} weights, e.g. {', '.join(missing[:3])}")
    if dense or unused:
        ignored = [*dense, *unused]
        log.info("ignoring %d checkpoint tensors the model does not use, e.g. %s", len(ignored), ignored[0])


def _read_dense(loc: Location | torch.Tensor, fmt: PublishedFormat | None) -> torch.Tensor:
    return loc if isinstance(loc, torch.Tensor) else read_location(loc, fmt)


def _check_shape(name: str, loc: Location, expected: tuple[int, ...]) -> None:
    if loc.shape != expected:
        raise CheckpointError(
            f"{name} has shape {list(loc.shape)} in the checkpoint, the config implies {list(expected)}"
        )


def _set_tensor(model: nn.Module, name: str, value: torch.Tensor) -> None:
    owner_name, _, attr = name.rpartition(".")
    owner = model.get_submodule(owner_name)
    if isinstance(value, nn.Parameter):
        owner._parameters[attr] = value
    else:
        owner._buffers[attr] = value
