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
    if not is_hub_id(model):  # its cache folder is named after it: it must stay inside the hub cache
        raise CheckpointError(f"{model!r} is neither a local folder nor a valid Hugging Face hub id (owner/name)")
    try:
        from huggingface_hub import snapshot_download

        patterns = ["*.json", "*.safetensors", "tokenizer*", "*.model", "*.tiktoken", "*.txt", "*.jinja"]
        return Path(snapshot_download(model, allow_patterns=patterns))
    except Exception as e:
        raise CheckpointError(
            f"{model!r} is not a local folder and could not be fetched from the Hugging Face hub "
            f"(offline and not in the local cache?): {type(e).__name__}: {e}"
        ) from None


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
    model_type = config.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise CheckpointError(
            f"unsupported architecture {model_type!r} ({', '.join(config.get('architectures') or [])}); "
            f"moe-serve supports: {', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    check_config_sizes(config, config_path)
    return config


# config.json sizes and their bounds, checked before anything is built from them; the bounds are
# far above any published model (hidden 16k, 384 experts, 262k vocabulary, 10M context)
_SIZE_BOUNDS = {
    "hidden_size": 1 << 16, "intermediate_size": 1 << 18, "moe_intermediate_size": 1 << 18,
    "shared_expert_intermediate_size": 1 << 18, "num_hidden_layers": 1024, "num_attention_heads": 1024,
    "num_key_value_heads": 1024, "head_dim": 1 << 14, "vocab_size": 1 << 22, "max_position_embeddings": 1 << 24,
    "num_local_experts": 4096, "num_experts": 4096, "n_routed_experts": 4096, "num_experts_per_tok": 4096,
    "kv_lora_rank": 1 << 16, "q_lora_rank": 1 << 16, "qk_rope_head_dim": 1 << 14, "qk_nope_head_dim": 1 << 14,
    "v_head_dim": 1 << 14,
}
_MAY_BE_ZERO = {"n_shared_experts": 64, "first_k_dense_replace": 1024, "n_group": 4096, "topk_group": 4096}


def check_config_sizes(config: dict, where: Path) -> None:
    """Every size the model is built from is a positive integer within its bound (None where optional)."""
    for key, bound, least in [*((k, b, 1) for k, b in _SIZE_BOUNDS.items()),
                              *((k, b, 0) for k, b in _MAY_BE_ZERO.items())]:
        value = config.get(key)
        if value is None:
            continue
        if not isinstance(value, int) or isinstance(value, bool) or not least <= value <= bound:
            raise CheckpointError(f"{where}: {key} is {value!r}; it must be an integer in [{least}, {bound}]")
    experts = next((config[k] for k in ("num_local_experts", "num_experts", "n_routed_experts") if config.get(k)), None)
    if experts is not None and config.get("num_experts_per_tok", 1) > experts:
        raise CheckpointError(f"{where}: num_experts_per_tok {config['num_experts_per_tok']} exceeds the "
                              f"{experts} experts")


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
            _check_fused(gate_up, down, moe_layer, num_experts)
            segments[(moe_layer, e)] = [
                Segment.slice_of(gate_up, e, part=0, parts=2),
                Segment.slice_of(gate_up, e, part=1, parts=2),
                Segment.slice_of(down, e),
            ]
        else:
            raise CheckpointError(f"MoE layer {moe_layer} has no weights for expert {e}")
    return segments


def _check_fused(gate_up: TensorLocation, down: TensorLocation, moe_layer: int, num_experts: int) -> None:
    """Fused tensors hold one row block per expert: fewer than the config's experts would send
    an expert's reads into the bytes of another tensor."""
    if len(gate_up.shape) != 3 or len(down.shape) != 3 or gate_up.shape[1] % 2:
        raise CheckpointError(f"MoE layer {moe_layer}: fused expert tensors of shapes {list(gate_up.shape)} and "
                              f"{list(down.shape)}; expected [E, 2I, H] and [E, H, I]")
    if gate_up.shape[0] != num_experts or down.shape[0] != num_experts:
        raise CheckpointError(f"MoE layer {moe_layer}: fused expert tensors hold {gate_up.shape[0]} and "
                              f"{down.shape[0]} experts, the config says {num_experts}")
