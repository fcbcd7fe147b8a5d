"""Reading a Hugging Face MoE checkpoint: where it is, which family, which tensors are experts.

Both expert layouts load: per-expert keys as checkpoints are published
(`...experts.{e}.w1/w3/w2.weight` for Mixtral, `...experts.{e}.gate_proj/up_proj/down_proj.weight`
for Qwen/DeepSeek/OLMoE) and the fused keys transformers 5 uses in memory
(`...experts.gate_up_proj [E, 2I, H]`, `...experts.down_proj [E, H, I]`).
"""

from __future__ import annotations

import hashlib
import json
import re
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

from cache.host_store import Segment
from cache.policy import ExpertKey
from cache.safetensors_index import CheckpointError, TensorLocation, index_checkpoint

SUPPORTED_MODEL_TYPES = ("mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v2", "deepseek_v3", "olmoe")

# checkpoint name → module name for the parts transformers renames on load
_RENAMES = ((".block_sparse_moe.", ".mlp."),)

_EXPERT_KEY = re.compile(
    r"^model\.layers\.(\d+)\.(?:mlp|block_sparse_moe)\.experts\."
    r"(?:(\d+)\.(w1|w2|w3|gate_proj|up_proj|down_proj)\.weight|(gate_up_proj|down_proj))$"
)
_PART = {"w1": "gate", "gate_proj": "gate", "w3": "up", "up_proj": "up", "w2": "down", "down_proj": "down"}


@dataclass(frozen=True)
class ExpertTensors:
    """Per decoder layer: the per-expert or fused tensors of its experts."""

    per_expert: dict[int, dict[str, TensorLocation]]  # expert → {"gate"|"up"|"down": loc}
    fused: dict[str, TensorLocation]  # "gate_up_proj" | "down_proj" → loc


def resolve_model_path(model: str) -> Path:
    """A local folder as is; otherwise a hub id fetched (or found in the local HF cache)."""
    path = Path(model).expanduser()
    if path.is_dir():
        return path
    if path.exists() or model.startswith((".", "/", "~")) or model.count("/") != 1:
        raise CheckpointError(f"model folder {model!r} does not exist")
    try:
        from huggingface_hub import snapshot_download

        patterns = ["*.json", "*.safetensors", "tokenizer*", "*.model", "*.tiktoken", "*.txt", "*.jinja"]
        return Path(snapshot_download(model, allow_patterns=patterns))
    except Exception as e:
        raise CheckpointError(
            f"{model!r} is not a local folder and could not be fetched from the Hugging Face hub "
            f"(offline and not in the local cache?): {type(e).__name__}: {e}"
        ) from None


def read_config_dict(folder: Path) -> dict:
    config_path = folder / "config.json"
    if not config_path.is_file():
        raise CheckpointError(f"{folder} has no config.json; is it a Hugging Face model folder?")
    try:
        config = json.loads(config_path.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{config_path} is not valid JSON: {e}") from None
    model_type = config.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise CheckpointError(
            f"unsupported architecture {model_type!r} ({', '.join(config.get('architectures') or [])}); "
            f"moe-serve supports: {', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    quantized = config.get("quantization_config")
    if quantized:
        method = quantized.get("quant_method", "unknown") if isinstance(quantized, dict) else quantized
        raise CheckpointError(
            f"the checkpoint is published quantized ({method!r}: {json.dumps(quantized)[:120]}); moe-serve does "
            "not load quantized checkpoints yet. Use the bf16 release with --expert-dtype int8 or int4."
        )
    return config


def checkpoint_digest(folder: Path) -> str:
    """A short identity of the weights: file names, sizes and the first bytes of each shard."""
    digest = hashlib.sha256()
    for path in sorted(folder.glob("*.safetensors")):
        digest.update(f"{path.name}:{path.stat().st_size}:".encode())
        with open(path, "rb") as f:
            digest.update(f.read(1 << 16))
    return digest.hexdigest()[:16]


def module_name(checkpoint_name: str) -> str:
    for old, new in _RENAMES:
        checkpoint_name = checkpoint_name.replace(old, new)
    return checkpoint_name


def split_checkpoint(folder: Path) -> tuple[dict[str, TensorLocation], dict[int, ExpertTensors]]:
    """(dense tensors by module name, expert tensors by decoder layer)."""
    dense: dict[str, TensorLocation] = {}
    per_expert: dict[int, dict[int, dict[str, TensorLocation]]] = defaultdict(lambda: defaultdict(dict))
    fused: dict[int, dict[str, TensorLocation]] = defaultdict(dict)
    for name, loc in index_checkpoint(folder).items():
        match = _EXPERT_KEY.match(name)
        if match is None:
            dense[module_name(name)] = loc
            continue
        layer, expert, part, fused_name = match.groups()
        if fused_name:
            fused[int(layer)][fused_name] = loc
        else:
            per_expert[int(layer)][int(expert)][_PART[part]] = loc
    layers = set(per_expert) | set(fused)
    experts = {
        layer: ExpertTensors({e: dict(p) for e, p in per_expert[layer].items()}, dict(fused[layer]))
        for layer in layers
    }
    return dense, experts


def expert_segments(
    tensors: ExpertTensors, moe_layer: int, num_experts: int
) -> dict[ExpertKey, list[Segment]]:
    """Disk segments of each expert in host-buffer order: gate [I,H], up [I,H], down [H,I]."""
    segments = {}
    for e in range(num_experts):
        if e in tensors.per_expert:
            parts = tensors.per_expert[e]
            missing = {"gate", "up", "down"} - set(parts)
            if missing:
                raise CheckpointError(
                    f"MoE layer {moe_layer} expert {e} lacks its {', '.join(sorted(missing))} weight"
                )
            segments[(moe_layer, e)] = [Segment.slice_of(parts[p]) for p in ("gate", "up", "down")]
        elif {"gate_up_proj", "down_proj"} <= set(tensors.fused):
            gate_up, down = tensors.fused["gate_up_proj"], tensors.fused["down_proj"]
            segments[(moe_layer, e)] = [
                Segment.slice_of(gate_up, e, part=0, parts=2),
                Segment.slice_of(gate_up, e, part=1, parts=2),
                Segment.slice_of(down, e),
            ]
        else:
            raise CheckpointError(f"MoE layer {moe_layer} has no weights for expert {e}")
    return segments
