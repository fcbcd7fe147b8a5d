"""Finding a model's MoE layers through transformers' experts interface, for any family.

transformers 5 marks each family's experts module with `use_experts_implementation`: the
module keeps every expert's weights fused (`gate_up_proj [E, ...]`, `down_proj [E, ...]`,
biases where the family has them) and records their layout (`is_transposed`,
`is_concatenated`, `has_bias`, `has_gate`). A family whose MoE blocks use that interface
loads here without family-specific code: its experts keep their own forward (activation,
biases, clamping), which computes on weights gathered from cache slots.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from cache.host_store import ExpertLayout
from cache.safetensors_index import CheckpointError

_LAYER_INDEX = re.compile(r"(?:^|\.)layers\.(\d+)\.")
_INTERFACE_ATTRS = ("is_transposed", "is_concatenated", "has_gate", "has_bias")


@dataclass(frozen=True)
class MoELayer:
    """One MoE block: where its experts module sits and how one expert's weights lie."""

    decoder_layer: int
    path: str  # module name of the experts module, e.g. "model.layers.3.mlp.experts"
    experts: nn.Module
    router: nn.Module | None  # the block's router, for look-ahead; None when not found
    layout: ExpertLayout
    num_experts: int


def find_moe_layers(model: nn.Module) -> list[MoELayer]:
    """Every experts module of `model` that follows the interface, in decoder-layer order."""
    found = []
    for path, module in model.named_modules():
        if not is_interface_experts(module):
            continue
        match = _LAYER_INDEX.search(path + ".")
        if match is None:
            raise CheckpointError(f"experts module {path} is not inside a decoder layer (`layers.N`)")
        num_experts = int(module.num_experts)
        parent = model.get_submodule(path.rpartition(".")[0])
        found.append(MoELayer(int(match.group(1)), path, module, _router_of(parent, module),
                              expert_layout(module, num_experts), num_experts))
    found.sort(key=lambda layer: layer.decoder_layer)
    return found


def is_interface_experts(module: nn.Module) -> bool:
    return all(hasattr(module, attr) for attr in _INTERFACE_ATTRS) and hasattr(module, "num_experts")


def expert_layout(experts: nn.Module, num_experts: int) -> ExpertLayout:
    """The per-expert parameters: every direct parameter with the expert dimension first."""
    parts = tuple(
        (name, tuple(param.shape[1:]))
        for name, param in experts.named_parameters(recurse=False)
        if param.dim() >= 2 and param.shape[0] == num_experts
    )
    if not parts:
        raise CheckpointError(f"{type(experts).__name__} holds no per-expert weights")
    return ExpertLayout(parts)


def top_k_of(model: nn.Module, layers: list[MoELayer]) -> int:
    """Experts chosen per token: the router's `top_k`, else the config's."""
    for layer in layers:
        k = getattr(layer.router, "top_k", None)
        if isinstance(k, int):
            return k
    config = getattr(model.config, "get_text_config", lambda: model.config)()
    for key in ("num_experts_per_tok", "moe_topk", "top_k", "num_experts_per_token"):
        k = getattr(config, key, None)
        if isinstance(k, int):
            return k
        if isinstance(k, (list, tuple)) and k:
            return int(k[0])
    raise CheckpointError(f"cannot tell how many experts {config.model_type} routes each token to")


def router_top_k(router: nn.Module):
    """A router as a function hidden [T, H] → top-k expert ids [T, k] (its integer output)."""

    def top_k(hidden: torch.Tensor) -> torch.Tensor:
        out = router(hidden)
        outputs = out if isinstance(out, tuple) else (out,)
        return next(t for t in outputs if isinstance(t, torch.Tensor) and not t.is_floating_point())

    return top_k


def _router_of(parent: nn.Module, experts: nn.Module) -> nn.Module | None:
    for name in ("gate", "router"):
        router = getattr(parent, name, None)
        if isinstance(router, nn.Module) and router is not experts:
            return router
    return None


@functools.cache
def interface_families() -> tuple[str, ...]:
    """Causal-LM model types whose modeling code marks an experts module with the interface
    (read from the installed transformers, so a new family shows up without a change here)."""
    import transformers
    from transformers.models.auto.configuration_auto import model_type_to_module_name
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    models = Path(transformers.__file__).parent / "models"
    marked = {
        path.parent.name
        for path in models.glob("*/modeling_*.py")
        if "@use_experts_implementation" in path.read_text(encoding="utf-8")
    }
    return tuple(sorted(t for t in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES if model_type_to_module_name(t) in marked))
