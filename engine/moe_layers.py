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
import inspect
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from cache.host_store import ExpertLayout
from cache.safetensors_index import CheckpointError
from engine import llama4_moe, multimodal

_LAYER_INDEX = re.compile(r"(?:^|\.)layers\.(\d+)\.")
_INTERFACE_ATTRS = ("is_transposed", "is_concatenated", "has_gate", "has_bias")
NO_EXPERT = -1  # a route that computes nothing: a zero expert (`has_zero_experts`)


@dataclass(frozen=True)
class MoELayer:
    """One MoE block: where its experts module sits and how one expert's weights lie."""

    decoder_layer: int
    path: str  # module name of the experts module, e.g. "model.layers.3.mlp.experts"
    experts: nn.Module
    router: nn.Module | None  # the block's router, for look-ahead; None when not found
    layout: ExpertLayout
    num_experts: int
    block: nn.Module  # the module holding the experts and the router


def find_moe_layers(model: nn.Module) -> list[MoELayer]:
    """Every experts module of `model` that follows the interface, in decoder-layer order (Llama 4's blocks,
    which predate it, are first rebuilt on it: `engine.llama4_moe`)."""
    llama4_moe.adapt(model)
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
                              expert_layout(module, num_experts), num_experts, parent))
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
    for key in ("num_experts_per_tok", "moe_topk", "top_k", "num_experts_per_token", "top_k_experts"):
        k = getattr(config, key, None)
        if isinstance(k, int):
            return k
        if isinstance(k, (list, tuple)) and k:
            return int(k[0])
    raise CheckpointError(f"cannot tell how many experts {config.model_type} routes each token to")


def router_top_k(layer: MoELayer) -> Callable[[torch.Tensor], torch.Tensor | None] | None:
    """The layer's router as a function hidden [T, H] → top-k expert ids [T, k] (its integer output), or None for
    a hidden state of another width (the previous layer's experts' input, where the experts compute in a latent
    width: Nemotron 3 Super); None without a router, or when the router cannot be called with inputs its block
    holds."""
    router = layer.router
    if router is None:
        return None
    names = _router_inputs_from_block(router, layer.block)
    if names is None:
        return None
    rank = _router_input_rank(router, {name: getattr(layer.block, name) for name in names})
    if rank is None:
        return None

    weight = getattr(router, "weight", None)
    width = weight.shape[-1] if isinstance(weight, torch.Tensor) and weight.dim() == 2 else None
    zero_experts = has_zero_experts(layer)

    def top_k(hidden: torch.Tensor) -> torch.Tensor | None:
        if width is not None and hidden.shape[-1] != width:  # the experts' input is not the router's (latent MoE)
            return None
        shaped = hidden if rank == 2 else hidden.unsqueeze(0)  # [1, T, H] for a router that unpacks it
        out = router(shaped, **{name: getattr(layer.block, name) for name in names})
        outputs = out if isinstance(out, tuple) else (out,)
        ids = next(t for t in outputs if isinstance(t, torch.Tensor) and not t.is_floating_point())
        ids = ids.reshape(hidden.shape[0], -1)
        return ids.masked_fill(ids >= layer.num_experts, NO_EXPERT) if zero_experts else ids

    return top_k


def has_zero_experts(layer: MoELayer) -> bool:
    """Whether the router scores more ids than there are experts: the others are "zero" experts (LongCat-Flash),
    which add the input, scaled, outside the experts module, and reach it as a real expert with weight 0."""
    if layer.router is None:
        return False
    weight = next((p for p in layer.router.parameters() if p.dim() == 2), None)
    return weight is not None and weight.shape[0] > layer.num_experts


def _router_inputs_from_block(router: nn.Module, block: nn.Module) -> list[str] | None:
    """The router's inputs after the hidden states that its block holds and passes (its correction bias:
    MiniMax-M2, Hunyuan-V3, AFMoE, LFM2); None when a required one is not there (DeepSeek-V4's token ids)."""
    names = []
    for param in list(inspect.signature(router.forward).parameters.values())[1:]:
        if param.kind not in (param.POSITIONAL_ONLY, param.POSITIONAL_OR_KEYWORD):
            break
        if hasattr(block, param.name):
            names.append(param.name)
        elif param.default is param.empty:
            return None
    return names


def _router_input_rank(router: nn.Module, inputs: dict) -> int | None:
    """2 when the router takes hidden states [T, H] (most flatten whatever comes), 3 when it unpacks
    [B, S, H] (AFMoE); None when it takes neither (no look-ahead for that layer)."""
    weight = next((p for p in router.parameters() if p.dim() == 2), None)
    if weight is None:
        return 2
    for rank in (2, 3):
        probe = weight.new_zeros((*(1,) * (rank - 1), weight.shape[-1]))
        try:
            with torch.inference_mode():
                router(probe, **inputs)
            return rank
        except Exception:  # any failure: it cannot be called this way
            continue
    return None


def _router_of(parent: nn.Module, experts: nn.Module) -> nn.Module | None:
    for name in ("gate", "router"):
        router = getattr(parent, name, None)
        if isinstance(router, nn.Module) and router is not experts:
            return router
    return None


@functools.cache
def interface_families() -> tuple[str, ...]:
    """Model types whose modeling code marks an experts module with the interface (read from the installed
    transformers, so a new family shows up without a change here): causal LMs, and those transformers builds
    only as image-text-to-text models, served as their text model (`engine.multimodal`), and language models
    published alone that it builds only inside one of those; and Llama 4's, whose blocks are rebuilt on it
    (`engine.llama4_moe`)."""
    import transformers
    from transformers.models.auto.configuration_auto import model_type_to_module_name
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    models = Path(transformers.__file__).parent / "models"
    marked = {
        path.parent.name
        for path in models.glob("*/modeling_*.py")
        if "@use_experts_implementation" in path.read_text(encoding="utf-8")
    }
    types = {*MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, *multimodal.image_text_types(), *multimodal.PUBLISHED_ALONE}
    return tuple(sorted(t for t in types if model_type_to_module_name(t) in marked or t in llama4_moe.FAMILIES))
