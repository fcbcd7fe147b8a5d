"""Multimodal MoE checkpoints served as their text model.

Qwen3-VL, GLM-4.5V, Mistral Small 4, Kimi K2.5 and others are published as image-text-to-text models: their
config nests the language model's (`text_config`), their weights sit under the composite's names
(`model.language_model.layers...`), and transformers builds them only as the composite (no causal-LM class for
the text model alone). moe-serve is text-only (images are refused at the API), so the composite is built as
transformers builds it, which keeps its weight names and its text-only forward, and its vision and audio
towers are dropped before any weight is read: they take no memory, and their checkpoint tensors are ignored.

A language model published on its own that transformers builds only inside a composite (Step-3.5-Flash, the
language model of Step 3.7 Flash) is built the same way, its config set as the composite's text config: its
checkpoint names are the composite's language-model names as published.
"""

from __future__ import annotations

import functools

import torch
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText, PretrainedConfig

# model type of a language model published alone → the composite transformers builds it in
PUBLISHED_ALONE = {"step3p5": "step3p7"}  # Step-3.5-Flash: Step 3.7 Flash's language model


def build_text_model(config: PretrainedConfig, dtype: torch.dtype) -> nn.Module:
    """The causal LM of `config` (call under `init_empty_weights`): the family's causal-LM class, or for a
    family transformers builds only as an image-text-to-text model, that model; in both, a composite keeps
    only its language model and LM head."""
    config = in_composite(config)
    auto = AutoModelForCausalLM if config.model_type in causal_lm_types() else AutoModelForImageTextToText
    model = auto.from_config(config, dtype=dtype)
    drop_towers(model)
    return model


def in_composite(config: PretrainedConfig) -> PretrainedConfig:
    """`config`, or for a language model published alone (`PUBLISHED_ALONE`), its composite's config around it."""
    composite = PUBLISHED_ALONE.get(config.model_type)
    return config if composite is None else AutoConfig.for_model(composite, text_config=config)


def drop_towers(model: nn.Module) -> None:
    """Every module of a composite model that is neither its language model nor its LM head (the vision and
    audio encoders, their projectors) is removed; a plain causal LM is left as it is."""
    decoder, base = model.get_decoder(), model.base_model
    if decoder is base or decoder is model:
        return
    kept = {id(decoder), id(base), id(model.get_output_embeddings())}
    for owner in (model, base):
        for name, child in list(owner.named_children()):
            if id(child) not in kept:
                setattr(owner, name, None)


@functools.cache
def causal_lm_types() -> frozenset[str]:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return frozenset(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


@functools.cache
def image_text_types() -> frozenset[str]:
    """Model types transformers builds as image-text-to-text models but not as causal LMs; those that write text
    token by token (not a block-diffusion model's)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES

    return frozenset(
        model_type for model_type, name in MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES.items()
        if name.endswith(("ForConditionalGeneration", "ForCausalLM")) and model_type not in causal_lm_types()
    )


def text_model_type(config: dict) -> str | None:
    """The model type of a composite config's language model (`text_config`), None for a plain config."""
    text = config.get("text_config")
    return text.get("model_type") if isinstance(text, dict) else None
