"""Which model types moe-serve can load: every family transformers marks with its experts
interface, checked without weights (a small meta-device model of the family's own config).

    python -m bench.family_coverage            # a Markdown table, as in README.md

Per family: the MoE layers are found, one expert's layout read, top-k known, and the keys a
published checkpoint of the family holds (what `save_pretrained` writes) map onto the host
store's expert buffers. Families also tested for token equality with transformers are in
`tests/test_engine_equivalence.py`; this check says whether the loader takes the rest.
"""

from __future__ import annotations

import contextlib
import sys
import warnings
from dataclasses import dataclass

import torch
from accelerate import init_empty_weights
from transformers import AutoConfig
from transformers.core_model_loading import revert_weight_conversion

from engine.checkpoint import _KeyMapper, check_expert_converter
from engine.moe_layers import find_moe_layers, interface_families, top_k_of
from engine.multimodal import build_text_model

LAYERS = 4  # the family's default config, cut to a few layers (meta tensors: nothing is allocated)


@dataclass(frozen=True)
class Coverage:
    family: str
    loads: bool
    detail: str  # the layout when it loads, else why not


def check_family(family: str) -> Coverage:
    try:
        model = _meta_model(family)
        layers = find_moe_layers(model)
        if not layers:
            return Coverage(family, False, "no MoE layer found in the causal LM")
        layout, top_k = layers[0].layout, top_k_of(model, layers)
        if any(layer.layout != layout for layer in layers):
            return Coverage(family, False, "MoE layers of different expert shapes")
        missing = _unmapped_expert_params(model, layers)
        if missing:
            return Coverage(family, False, f"published keys do not map onto {missing[0]}")
        flags = [f for f in ("is_transposed", "has_bias") if getattr(layers[0].experts, f)]
        if not layers[0].experts.is_concatenated:
            flags.append("interleaved gate/up")
        parts = ", ".join(name for name, _ in layout.parts)
        return Coverage(family, True, f"{len(layers)} MoE layers, top-{top_k}, {parts}" + (f" ({', '.join(flags)})" if flags else ""))
    except Exception as e:  # a report: every failure is a finding, not a crash
        return Coverage(family, False, f"{type(e).__name__}: {str(e).splitlines()[0][:160]}")


def _meta_model(family: str) -> torch.nn.Module:
    config = AutoConfig.for_model(family)
    for sub in {id(config): config, id(config.get_text_config()): config.get_text_config()}.values():
        if getattr(sub, "num_hidden_layers", 0) > LAYERS:
            sub.num_hidden_layers = LAYERS
            with contextlib.suppress(AttributeError):  # some configs derive their layer types
                if isinstance(getattr(sub, "layer_types", None), list):
                    sub.layer_types = sub.layer_types[:LAYERS]
    try:
        with init_empty_weights(include_buffers=True), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return build_text_model(config, torch.float32)
    except Exception as e:
        raise DefaultConfigError(f"the default {family} config builds no model: {type(e).__name__}: {e}") from None


class DefaultConfigError(Exception):
    """transformers' default config of the family is incomplete (real checkpoints set the rest)."""


def _unmapped_expert_params(model: torch.nn.Module, layers) -> list[str]:
    """Expert parameters that no key of the family's published checkpoint fills."""
    state = {name: tensor for name, tensor in model.state_dict().items() if name.startswith(layers[0].path)}
    published = revert_weight_conversion(model, state)
    mapper = _KeyMapper(model)
    filled = set()
    for key in published:
        target, converter, _ = mapper.map(key)
        if converter is not None:
            check_expert_converter(converter, key)
        filled.add(target)
    return [f"{layers[0].path}.{name}" for name, _ in layers[0].layout.parts if f"{layers[0].path}.{name}" not in filled]


def main() -> None:
    rows = [check_family(family) for family in interface_families()]
    print("| model type | loads | what was found |")
    print("|---|---|---|")
    for row in rows:
        print(f"| `{row.family}` | {'yes' if row.loads else 'no'} | {row.detail} |")
    print(f"\n{sum(r.loads for r in rows)} of {len(rows)} load", file=sys.stderr)


if __name__ == "__main__":
    main()
