"""Reading a Hugging Face MoE checkpoint: where it is, which family, which tensors are experts.

Checkpoint keys are mapped to the model's parameters with the family's own conversion rules
from transformers (`get_model_conversion_mapping`), so both expert layouts load for every
family: per-expert keys as checkpoints are published (`...experts.{e}.w1/w3/w2.weight` for
Mixtral, `...experts.{e}.gate_proj/up_proj/down_proj.weight` for Qwen/DeepSeek/OLMoE, ...)
and the fused keys transformers 5 holds in memory (`...experts.gate_up_proj [E, ...]`).

Checkpoints published quantized in a format moe-serve reads (FP8 block-scaled, MXFP4; see
`cache.quant_formats`) hold each quantized weight as two tensors, its data and its scales; they are
paired first (`PublishedLocation`) and then mapped like any weight.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn
from transformers.conversion_mapping import get_model_conversion_mapping
from transformers.core_model_loading import (
    Concatenate,
    MergeModulelist,
    Transpose,
    WeightConverter,
    apply_renamings,
    rename_source_key,
)

from cache.host_store import Segment
from cache.policy import ExpertKey
from cache.quant_formats import MXFP4_BLOCK, dequantize_published, fp8_scale_grid
from cache.quant_published import PUBLISHED_METHODS, ExpertParts, PublishedFormat, PublishedPart
from cache.safetensors_index import CheckpointError, TensorLocation, index_checkpoint
from engine import multimodal
from engine.gguf_checkpoint import gguf_folder
from engine.gguf_experts import gguf_identity
from engine.gguf_sources import fetch_hub_gguf, gguf_models, is_gguf, ollama_blob
from engine.moe_layers import MoELayer, interface_families, is_interface_experts


@dataclass(frozen=True)
class PublishedLocation:
    """A weight published quantized: its data and its scales; `shape` is the weight's, `[..., out, in]`."""

    data: TensorLocation
    scales: TensorLocation
    shape: tuple[int, ...]


Location = TensorLocation | PublishedLocation


@dataclass
class ConvertedDense:
    """Dense checkpoint tensors that the family's converter joins or splits into parameters
    (Kimi-Linear's q/k/v conv kernels into one, a fused `in_proj` into four), converted at load."""

    converter: WeightConverter
    target: str  # the key renamed to the converter's first target pattern
    sources: dict[str, Location] = field(default_factory=dict)  # by source pattern

    def convert(self, model: nn.Module, fmt: PublishedFormat | None) -> dict[str, torch.Tensor]:
        """The parameters it makes, by name, as transformers' loader makes them."""
        tensors = {pattern: [read_location(loc, fmt)] for pattern, loc in self.sources.items()}
        for op in self.converter.operations:
            tensors = op.convert(tensors, source_patterns=self.converter.source_patterns,
                                 target_patterns=self.converter.target_patterns, full_layer_name=self.target,
                                 model=model, config=model.config)
        prefix, _, suffix = next(self.target.partition(k) for k in tensors if k in self.target)
        return {prefix + k + suffix: v for k, v in tensors.items()}


@dataclass
class ExpertSources:
    """One experts module's tensors on disk, per parameter of its `ExpertLayout`."""

    fused: dict[str, Location] = field(default_factory=dict)  # param → [E, ...]
    # param → [(position among the converter's sources, [E, ...])]: fused tensors that the family joins on load
    # (Step 3.7 Flash's gate and up into gate_up_proj)
    joined: dict[str, list[tuple[int, Location]]] = field(default_factory=lambda: defaultdict(list))
    # param → expert → [(position among the converter's sources, per-expert tensor)]
    per_expert: dict[str, dict[int, list[tuple[int, Location]]]] = field(
        default_factory=lambda: defaultdict(lambda: defaultdict(list))
    )


def resolve_model_path(model: str) -> Path:
    """A local folder as is; a GGUF model (a file or a split model's part, `ollama:NAME[:TAG]`, a hub
    `owner/repo:QUANT`) converted once into a folder; otherwise a hub id fetched (or found in the local HF cache)."""
    path = Path(model).expanduser()
    if path.is_dir():
        return path
    if path.is_file():
        if is_gguf(path):
            return gguf_folder(path)
        raise CheckpointError(f"{model!r} is a file, neither a model folder nor a GGUF file")
    if model.startswith(OLLAMA_PREFIX) and not path.exists():
        return gguf_folder(ollama_blob(model.removeprefix(OLLAMA_PREFIX)))
    hub_gguf = HUB_GGUF.fullmatch(model)
    if hub_gguf and not path.exists() and is_hub_id(hub_gguf["repo"]):
        return gguf_folder(fetch_hub_gguf(hub_gguf["repo"], hub_gguf["quant"]))
    if path.exists() or model.startswith((".", "/", "~")) or model.count("/") != 1:
        raise CheckpointError(f"model folder {model!r} does not exist")
    if not is_hub_id(model):  # its cache folder is named after it: it must stay inside the hub cache
        raise CheckpointError(f"{model!r} is neither a local folder nor a valid Hugging Face hub id (owner/name)")
    try:
        from huggingface_hub import snapshot_download

        patterns = ["*.json", "*.safetensors", "tokenizer*", "*.model", "*.tiktoken", "*.txt", "*.jinja"]
        folder = Path(snapshot_download(model, allow_patterns=patterns))
    except Exception as e:
        raise CheckpointError(
            f"{model!r} is not a local folder and could not be fetched from the Hugging Face hub "
            f"(offline and not in the local cache?): {type(e).__name__}: {e}"
        ) from None
    if not (folder / "config.json").is_file() and (files := _hub_gguf_files(model)):
        more = f" and {len(files) - 8} more" if len(files) > 8 else ""
        raise CheckpointError(f"{model} holds GGUF files: name one of its quantizations, as in {model}:Q4_K_M "
                              f"({', '.join(files[:8])}{more})")
    return folder


def _hub_gguf_files(repo: str) -> list[str]:
    from huggingface_hub import HfApi

    try:
        return gguf_models(HfApi().list_repo_files(repo))
    except Exception:
        return []


OLLAMA_PREFIX = "ollama:"  # a model Ollama pulled: ollama:qwen3:30b
# a GGUF model on the hub, as llama.cpp's `-hf` and Ollama's `hf.co/` name one: owner/name:QUANT
HUB_GGUF = re.compile(r"(?:(?:https://)?(?:hf\.co|huggingface\.co)/)?(?P<repo>[^/:\s]+/[^/:\s]+):(?P<quant>[^/:\s]+)")
_HUB_ID = re.compile(r"^[A-Za-z0-9](?:[A-Za-z0-9._-]{0,94}[A-Za-z0-9])?/[A-Za-z0-9](?:[A-Za-z0-9._-]{0,94}[A-Za-z0-9])?$")


def is_hub_id(model: str) -> bool:
    """`owner/name` as the hub spells them: letters, digits, `.`, `_`, `-`, no `..` or `--`, at most 96 each."""
    return bool(_HUB_ID.fullmatch(model)) and ".." not in model and "--" not in model


def read_config_dict(folder: Path) -> dict:
    config_path = folder / "config.json"
    if not config_path.is_file():
        raise CheckpointError(f"{folder} has no config.json; is it a Hugging Face model folder?")
    try:
        config = json.loads(config_path.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{config_path} is not valid JSON: {e}") from None
    if not isinstance(config, dict):
        raise CheckpointError(f"{config_path} is not a JSON object")
    model_type, text_type = config.get("model_type"), multimodal.text_model_type(config)
    families = interface_families()
    if model_type not in families and not (model_type in multimodal.image_text_types() and text_type in families):
        language = f", language model {text_type!r}" if text_type else ""
        raise CheckpointError(
            f"unsupported architecture {model_type!r} ({', '.join(config.get('architectures') or [])}{language}): "
            f"its experts do not use transformers' fused experts interface; moe-serve supports: "
            f"{', '.join(families)} (`moe-serve --list-families`), and multimodal models whose language model is "
            f"one of them"
        )
    published_format(config, config_path)  # refuses the quantization formats moe-serve cannot read
    check_config_sizes(config, config_path)
    if text_type:
        check_config_sizes(config["text_config"], config_path)
    return config


def published_format(config: dict, where: Path) -> PublishedFormat | None:
    """The checkpoint's `quantization_config` if it is one moe-serve reads (FP8 block-scaled, MXFP4);
    None for an unquantized checkpoint; `CheckpointError` naming any other method."""
    quantization = config.get("quantization_config")
    if not quantization:
        return None
    method = quantization.get("quant_method", "unknown") if isinstance(quantization, dict) else quantization
    if method not in PUBLISHED_METHODS:
        raise CheckpointError(
            f"{where.parent} holds a quantized checkpoint ({method}); moe-serve loads unquantized "
            f"(bf16/fp16/fp32) checkpoints and those published in {' or '.join(PUBLISHED_METHODS)}: use the "
            f"unquantized release with --expert-dtype int8 or int4"
        )
    if method == "mxfp4":
        return PublishedFormat("mxfp4", (1, MXFP4_BLOCK))
    block = quantization.get("weight_block_size")
    if not (isinstance(block, list) and len(block) == 2 and all(_is_positive(b) for b in block)):
        raise CheckpointError(f"{where}: an fp8 checkpoint needs weight_block_size [rows, columns] (block-scaled "
                              f"FP8; per-tensor scales are not supported), not {block!r}")
    if quantization.get("fmt", "e4m3") != "e4m3":
        raise CheckpointError(f"{where}: fp8 format {quantization['fmt']!r} is not supported (e4m3 only)")
    return PublishedFormat("fp8", (block[0], block[1]))


def _is_positive(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


# config.json sizes and their bounds, checked before anything is built from them; the bounds are
# far above any published model (hidden 16k, 384 experts, 262k vocabulary, 10M context)
_SIZE_BOUNDS = {
    "hidden_size": 1 << 16, "intermediate_size": 1 << 18, "moe_intermediate_size": 1 << 18,
    "shared_expert_intermediate_size": 1 << 18, "num_hidden_layers": 1024, "num_attention_heads": 1024,
    "num_key_value_heads": 1024, "vocab_size": 1 << 22, "max_position_embeddings": 1 << 24,
    "num_local_experts": 4096, "num_experts": 4096, "n_routed_experts": 4096, "num_experts_per_tok": 4096,
    "kv_lora_rank": 1 << 16, "q_lora_rank": 1 << 16, "qk_nope_head_dim": 1 << 14, "v_head_dim": 1 << 14,
}
_MAY_BE_ZERO = {"n_shared_experts": 64, "first_k_dense_replace": 1024, "n_group": 4096, "topk_group": 4096,
                "head_dim": 1 << 14, "qk_rope_head_dim": 1 << 14}  # both 0 in a rotary-less MLA model's (GLM-5-Next)


def check_config_sizes(config: dict, where: Path) -> None:
    """Every size the model is built from is a positive integer within its bound (None where optional)."""
    for key, bound, least in [*((k, b, 1) for k, b in _SIZE_BOUNDS.items()),
                              *((k, b, 0) for k, b in _MAY_BE_ZERO.items())]:
        value = config.get(key)
        if value is None:
            continue
        values = value if isinstance(value, list) and value else [value]  # one per expert kind: ERNIE-4.5-VL's
        if not all(isinstance(v, int) and not isinstance(v, bool) and least <= v <= bound for v in values):
            raise CheckpointError(f"{where}: {key} is {value!r}; it must be an integer in [{least}, {bound}]")
    experts = next((config[k] for k in ("num_local_experts", "num_experts", "n_routed_experts") if config.get(k)), None)
    if experts is not None and config.get("num_experts_per_tok", 1) > experts:
        raise CheckpointError(f"{where}: num_experts_per_tok {config['num_experts_per_tok']} exceeds the "
                              f"{experts} experts")


def checkpoint_digest(folder: Path) -> str:
    """A short identity of the weights: file names, sizes and the first bytes of each shard."""
    digest = hashlib.sha256(gguf_identity(folder))  # experts read from a GGUF file: that file's identity too
    for path in sorted(folder.glob("*.safetensors")):
        digest.update(f"{path.name}:{path.stat().st_size}:".encode())
        with open(path, "rb") as f:
            digest.update(f.read(1 << 16))
    return digest.hexdigest()[:16]


def split_checkpoint(
    folder: Path, model: nn.Module, moe_layers: list[MoELayer], fmt: PublishedFormat | None = None
) -> tuple[dict[str, Location | ConvertedDense], dict[str, ExpertSources]]:
    """(dense tensors by parameter name, expert tensors by experts module path)."""
    mapper = _KeyMapper(model)
    params = {(layer.path, name) for layer in moe_layers for name, _ in layer.layout.parts}
    dense: dict[str, Location | ConvertedDense] = {}
    experts: dict[str, ExpertSources] = defaultdict(ExpertSources)
    for key, loc in pair_published(index_checkpoint(folder), fmt).items():
        target, converter, pattern = mapper.map(key)
        owner, _, param = target.rpartition(".")
        if (owner, param) not in params:
            if converter is None:
                dense[target] = loc
            else:
                dense.setdefault(target, ConvertedDense(converter, target)).sources[pattern] = loc
        elif converter is None:
            experts[owner].fused[param] = loc
        else:
            check_expert_converter(converter, key)
            position = list(converter.source_patterns).index(pattern)
            if _joins_fused(converter):
                experts[owner].joined[param].append((position, loc))
                continue
            expert = _expert_number(apply_renamings(key, mapper.renamings), pattern)
            experts[owner].per_expert[param][expert].append((position, loc))
    return dense, experts


def expert_segments(layer: MoELayer, sources: ExpertSources, moe_layer: int) -> dict[ExpertKey, list[Segment]]:
    """Disk segments of each expert of `layer` (an unquantized checkpoint), in the order of its `ExpertLayout`."""
    return {
        key: [part.data for parts in expert.values() for part in parts]
        for key, expert in expert_parts(layer, sources, moe_layer).items()
    }


def expert_parts(layer: MoELayer, sources: ExpertSources, moe_layer: int) -> dict[ExpertKey, ExpertParts]:
    """Each expert of `layer`: its parameters' tensors on disk (data and scales where published
    quantized), per parameter of its `ExpertLayout`, stacked parts in the converter's order."""
    experts: dict[ExpertKey, ExpertParts] = {}
    for e in range(layer.num_experts):
        expert = {}
        for param, shape in layer.layout.parts:
            if param in sources.fused:
                loc = sources.fused[param]
                _check_fused(loc, param, _stored_shape(loc, shape, layer), layer.num_experts, moe_layer)
                expert[param] = [_part_of(loc, e)]
                continue
            if param in sources.joined:
                locs = [loc for _, loc in sorted(sources.joined[param], key=lambda p: p[0])]
                _check_joined(locs, param, _stored_shape(locs[0], shape, layer), layer.num_experts, moe_layer)
                expert[param] = [_part_of(loc, e) for loc in locs]
                continue
            parts = sorted(sources.per_expert.get(param, {}).get(e, []), key=lambda p: p[0])
            if not parts:
                raise CheckpointError(f"MoE layer {moe_layer} expert {e} lacks its {param} weight")
            numel = sum(math.prod(loc.shape) for _, loc in parts)
            if numel != math.prod(shape):
                raise CheckpointError(
                    f"MoE layer {moe_layer} expert {e}: {param} has {numel} elements on disk, "
                    f"the config implies {list(shape)}"
                )
            expert[param] = [_part_of(loc) for _, loc in parts]
        experts[(moe_layer, e)] = expert
    return experts


def _part_of(loc: Location, index: int | None = None) -> PublishedPart:
    if isinstance(loc, PublishedLocation):
        return PublishedPart(Segment.slice_of(loc.data, index), Segment.slice_of(loc.scales, index))
    return PublishedPart(Segment.slice_of(loc, index))


def _stored_shape(loc: Location, shape: tuple[int, ...], layer: MoELayer) -> tuple[int, ...]:
    """A published weight is stored `[out, in]` even where the family holds it `[in, out]` (GPT-OSS)."""
    return shape[::-1] if isinstance(loc, PublishedLocation) and layer.experts.is_transposed else shape


# -- published quantized weights: pairing data and scales -----------------------------------------


def pair_published(index: dict[str, TensorLocation], fmt: PublishedFormat | None) -> dict[str, Location]:
    """`index` with each published weight's data and scale tensors paired under the weight's key
    (fp8: `X.weight` + `X.weight_scale_inv` → `X.weight`; mxfp4: `X_blocks` + `X_scales` → `X`)."""
    data_suffix, scale_suffix = {"fp8": (".weight", ".weight_scale_inv"), "mxfp4": ("_blocks", "_scales")}.get(
        fmt.method if fmt else "", ("", "")
    )
    paired: dict[str, Location] = {}
    for key, loc in index.items():
        if scale_suffix and key.endswith(scale_suffix):
            data_key = key.removesuffix(scale_suffix) + data_suffix
            if data_key not in index or not _is_published_data(index[data_key], fmt):
                raise CheckpointError(f"{key}: scales without a {fmt.method} weight {data_key}")
        elif scale_suffix and key.endswith(data_suffix) and _is_published_data(loc, fmt):
            scale_key = key.removesuffix(data_suffix) + scale_suffix
            if scale_key not in index:
                raise CheckpointError(f"{key} is published quantized ({fmt.method}) but its scales {scale_key} "
                                      f"are missing; the checkpoint is incomplete")
            name = key if fmt.method == "fp8" else key.removesuffix(data_suffix)
            paired[name] = _published_location(key, loc, index[scale_key], fmt)
        elif loc.dtype == torch.float8_e4m3fn:
            raise CheckpointError(f"{key} is float8 without scales (config.json quantization_config: "
                                  f"{fmt.method if fmt else 'none'}); the checkpoint is inconsistent")
        else:
            paired[key] = loc
    return paired


def _is_published_data(loc: TensorLocation, fmt: PublishedFormat) -> bool:
    """fp8: only float8 `.weight`s carry scales (norms, the router, embeddings stay as they are)."""
    return fmt.method == "mxfp4" or loc.dtype == torch.float8_e4m3fn


def _published_location(key: str, data: TensorLocation, scales: TensorLocation, fmt: PublishedFormat) -> PublishedLocation:
    """The pair, its shapes and dtypes checked against the format."""
    shape, grid, scale_dtypes = (_fp8_shapes if fmt.method == "fp8" else _mxfp4_shapes)(key, data, fmt)
    if scales.dtype not in scale_dtypes or scales.shape != grid:
        raise CheckpointError(f"{key}: its scales are {scales.dtype} {list(scales.shape)}; {fmt.method} with blocks "
                              f"{list(fmt.block)} needs {scale_dtypes[0]} {list(grid)}")
    return PublishedLocation(data, scales, shape)


def _fp8_shapes(key: str, data: TensorLocation, fmt: PublishedFormat):
    """(weight shape, scale grid, scale dtypes) of a float8 weight `[..., out, in]`."""
    if len(data.shape) < 2:
        raise CheckpointError(f"{key}: a float8 weight of shape {list(data.shape)}; a matrix was expected")
    grid = (*data.shape[:-2], *fp8_scale_grid(data.shape[-2:], fmt.block))
    return data.shape, grid, (torch.float32, torch.bfloat16)


def _mxfp4_shapes(key: str, data: TensorLocation, fmt: PublishedFormat):
    """(weight shape, scale grid, scale dtypes) of MXFP4 blocks uint8 `[..., out, in/32, 16]`."""
    if data.dtype != torch.uint8 or len(data.shape) < 3 or data.shape[-1] * 2 != MXFP4_BLOCK:
        raise CheckpointError(f"{key}: {data.dtype} {list(data.shape)} is not MXFP4 blocks "
                              f"(uint8 [..., out, in/{MXFP4_BLOCK}, {MXFP4_BLOCK // 2}])")
    *lead, out_f, groups, _ = data.shape
    return (*lead, out_f, groups * MXFP4_BLOCK), data.shape[:-1], (torch.uint8,)


def read_location(loc: Location, fmt: PublishedFormat | None) -> torch.Tensor:
    """A tensor as stored, or a published quantized weight decoded to float32."""
    return read_dequantized(loc, fmt) if isinstance(loc, PublishedLocation) else loc.read()


def read_dequantized(loc: PublishedLocation, fmt: PublishedFormat) -> torch.Tensor:
    """A published weight decoded to float32, in its shape `[..., out, in]`."""
    data, scales = loc.data.read(), loc.scales.read()
    out_f, in_f = loc.shape[-2:]
    rows = data.reshape(-1, out_f, in_f // 2 if fmt.method == "mxfp4" else in_f)  # [n, out, bytes per row]
    grids = scales.reshape(rows.shape[0], -1)
    weights = [dequantize_published(fmt.method, d, s, fmt.block, torch.float32) for d, s in zip(rows, grids)]
    return torch.stack(weights).view(loc.shape)


def hold_experts_as_stored(folder: Path, model: nn.Module) -> None:
    """Fused experts that a family's checkpoints store transposed (`[E, in, out]`: Qwen3-VL's), which transformers
    transposes on load, are held as stored: their module is marked `is_transposed`, which its math (and
    moe-serve's) follows, so their bytes are read in place like any family's. A module with some weights
    transposed on disk and others not is refused."""
    mapper = _KeyMapper(model)
    stored: dict[str, dict[str, tuple[int, ...]]] = defaultdict(dict)  # experts module → parameter → stored shape
    for key, loc in index_checkpoint(folder).items():
        target = mapper.map(key)[0]
        if mapper.is_held_as_stored(target):
            owner, _, name = target.rpartition(".")
            stored[owner][name] = tuple(loc.shape)
    for owner, shapes in stored.items():
        module = model.get_submodule(owner)
        weights = {name: p for name, p in module.named_parameters(recurse=False) if p.dim() == 3}
        flipped = {name for name, shape in shapes.items()
                   if name in weights and shape != weights[name].shape and shape == _transposed(weights[name].shape)}
        if not flipped:
            continue
        if flipped != set(weights):
            raise CheckpointError(f"{owner}: only {sorted(flipped)} of its weights {sorted(weights)} are stored "
                                  f"transposed; moe-serve reads all of an experts module's weights one way")
        for name, param in weights.items():
            module._parameters[name] = nn.Parameter(param.new_empty(_transposed(param.shape)), requires_grad=False)
        module.is_transposed = not module.is_transposed


def _transposed(shape: tuple[int, ...] | torch.Size) -> tuple[int, ...]:
    return (shape[0], shape[2], shape[1])


def _is_expert_transpose(converter: WeightConverter) -> bool:
    """A converter that only swaps a fused expert tensor's two matrix axes `[E, a, b] → [E, b, a]`."""
    ops = list(converter.operations)
    return (len(ops) == 1 and isinstance(ops[0], Transpose) and {ops[0].dim0, ops[0].dim1} in ({1, 2}, {-1, -2})
            and len(converter.source_patterns) == len(converter.target_patterns) == 1)


class _KeyMapper:
    """Checkpoint key → (parameter name, the converter that merges it, its matched source pattern). A fused
    experts tensor that the family transposes on load has no converter here: it is read as stored (see
    `hold_experts_as_stored`)."""

    def __init__(self, model: nn.Module) -> None:
        transforms = get_model_conversion_mapping(model)
        self.renamings = [t for t in transforms if not isinstance(t, WeightConverter)]
        self.converters = [t for t in transforms if isinstance(t, WeightConverter)]
        self.prefix = getattr(model, "base_model_prefix", None)
        # name → tensor (not None: transformers adds or strips the base model's prefix only for names it finds
        # with a value, e.g. Llama 4's `language_model.` of a multimodal checkpoint read as its text model)
        self.names = {**dict(model.named_parameters()), **dict(model.named_buffers())}
        self.modules = dict(model.named_modules())

    def map(self, key: str) -> tuple[str, WeightConverter | None, str | None]:
        target, pattern = rename_source_key(key, self.renamings, self.converters, self.prefix, self.names)
        if target not in self.names and key in self.names:  # a rule meant for other keys (as transformers reads it)
            target, pattern = rename_source_key(key, [], [], self.prefix, self.names)
        if pattern is None:
            return target, None, None
        converter = next(c for c in self.converters if pattern in c.source_patterns)
        if _is_expert_transpose(converter) and self.is_held_as_stored(target):
            return target, None, None
        return target, converter, pattern

    def is_held_as_stored(self, target: str) -> bool:
        """Whether `target` is a parameter of an experts module (which reads its fused tensors as stored)."""
        owner, _, name = target.rpartition(".")
        module = self.modules.get(owner)
        return module is not None and is_interface_experts(module) and name in module._parameters


def check_expert_converter(converter: WeightConverter, key: str) -> None:
    """Expert tensors are read straight into the expert's buffer: only merges that stack per-expert tensors
    and join whole row blocks (gate rows, then up rows), or join fused tensors so, keep the bytes in order."""
    ops = list(converter.operations)
    stacks = bool(ops) and isinstance(ops[0], MergeModulelist) and ops[0].dim == 0
    joins = all(isinstance(op, Concatenate) and op.dim == 1 for op in ops[1:])
    if not (stacks and joins) and not _joins_fused(converter):
        raise CheckpointError(
            f"{key}: the family merges per-expert tensors with {ops}, which moe-serve cannot read in "
            f"place; save the checkpoint with fused experts (transformers' in-memory layout)"
        )


def _joins_fused(converter: WeightConverter) -> bool:
    """A converter that only joins fused tensors `[E, a, H]`, `[E, b, H]` into one `[E, a + b, H]`."""
    ops = list(converter.operations)
    return bool(ops) and all(isinstance(op, Concatenate) and op.dim == 1 for op in ops)


def _expert_number(key: str, pattern: str) -> int:
    # transformers reads a source pattern as a regex whose `*.` stands for a module number
    regex = pattern.replace("*.", r"(\d+)\.")
    match = re.search(regex, key)
    if match is None:
        raise CheckpointError(f"cannot find the expert number in {key} (pattern {pattern})")
    return int(match.group(1))


def _check_fused(loc: Location, param: str, shape: tuple[int, ...], num_experts: int, moe_layer: int) -> None:
    """A fused tensor holds one block per expert: fewer experts than the config's would send
    an expert's reads into the bytes of another tensor."""
    if loc.shape != (num_experts, *shape):
        raise CheckpointError(f"MoE layer {moe_layer}: the fused {param} has shape {list(loc.shape)}, the config "
                              f"implies {[num_experts, *shape]}")


def _check_joined(locs: list[Location], param: str, shape: tuple[int, ...], num_experts: int, moe_layer: int) -> None:
    """Fused tensors joined row-wise into `param`: each holds one block per expert, and their rows add up."""
    shapes = [tuple(loc.shape) for loc in locs]
    rows = sum(s[1] for s in shapes if len(s) == len(shape) + 1)
    if any(s[0] != num_experts or s[2:] != shape[1:] for s in shapes) or rows != shape[0]:
        raise CheckpointError(f"MoE layer {moe_layer}: the fused tensors joined into {param} have shapes "
                              f"{[list(s) for s in shapes]}, the config implies {[num_experts, *shape]} joined on "
                              f"its second axis")
