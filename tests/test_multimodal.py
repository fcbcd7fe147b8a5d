"""Multimodal MoE checkpoints (Qwen3-VL, GLM-4.5V, Mistral Small 4, Kimi K2.5, ...) served as their text model:
the vision tower is neither built nor read, Qwen3-VL's experts stored transposed are read as they lie, and a
chat template kept with the processor is the model's. Their greedy tokens equal transformers' (the composite
model run on text) in `tests/test_engine_equivalence.py`, as every family's."""

import json

import pytest
from safetensors.torch import load_file, save_file

from cache.safetensors_index import CheckpointError, index_checkpoint
from engine.api import GenerationRequest, SamplingParams
from engine.checkpoint import ConvertedDense, read_config_dict
from engine.config import EngineConfig
from engine.engine import Engine
from tests.fixtures.models import build_checkpoint, reference_greedy

TEMPLATE = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}<|im_start|>assistant\n"


def load(folder, **settings) -> Engine:
    return Engine.load(EngineConfig(model=str(folder), device="cpu", policy="lru", **settings))


@pytest.fixture(scope="module")
def qwen3_vl(tmp_path_factory):
    return build_checkpoint("qwen3_vl_moe", tmp_path_factory.mktemp("qwen3-vl") / "model")


def test_the_vision_tower_is_neither_built_nor_read(qwen3_vl):
    stored = index_checkpoint(qwen3_vl)
    assert any(key.startswith("model.visual.") for key in stored)  # the checkpoint holds one, as published
    engine = load(qwen3_vl)
    names = [name for name, _ in engine.model.named_parameters()]
    assert names and not any("visual" in name for name in names)
    assert all(name.startswith(("model.language_model.", "lm_head.")) for name in names)


def test_experts_stored_transposed_are_read_as_they_lie(qwen3_vl):
    """Qwen3-VL's checkpoints hold `gate_up_proj [E, H, 2I]`, which transformers transposes on load: here the
    experts module holds them that way instead, and its math reads them so."""
    stored = index_checkpoint(qwen3_vl)["model.language_model.layers.0.mlp.experts.gate_up_proj"]
    engine = load(qwen3_vl, expert_cache_experts=2)
    layers = engine.loaded.moe_layers
    assert all(layer.experts.is_transposed for layer in layers)
    assert dict(layers[0].layout.parts)["gate_up_proj"] == tuple(stored.shape[1:])  # [H, 2I]
    prompt = engine.encode("The quick brown fox")
    tokens = greedy(engine, prompt, 8)
    assert tokens == reference_greedy(qwen3_vl, prompt, 8)


def greedy(engine: Engine, prompt: list[int], n: int) -> list[int]:
    params = SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)
    return [t for event in engine.generate(GenerationRequest("mm", prompt, params)) for t in event.token_ids]


def test_a_chat_template_kept_with_the_processor_is_the_models(tmp_path):
    folder = build_checkpoint("qwen3_vl_moe", tmp_path / "model", num_layers=2)
    (folder / "chat_template.jinja").unlink(missing_ok=True)
    settings = json.loads((folder / "tokenizer_config.json").read_text())
    settings.pop("chat_template", None)
    (folder / "tokenizer_config.json").write_text(json.dumps(settings))
    (folder / "chat_template.json").write_text(json.dumps({"chat_template": TEMPLATE}))
    engine = load(folder)
    assert engine.tokenizer.chat_template == TEMPLATE
    prompt = engine.apply_chat_template([{"role": "user", "content": "Hi"}])
    assert engine.tokenizer.decode(prompt) == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant"


def test_a_multimodal_model_around_a_dense_language_model_is_refused_by_name(tmp_path):
    """Mistral Small 3.1's composite holds a dense `mistral`; Small 4's a `mistral4` with experts."""
    config = {"model_type": "mistral3", "architectures": ["Mistral3ForConditionalGeneration"],
              "text_config": {"model_type": "mistral", "hidden_size": 64}}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="language model 'mistral'"):
        read_config_dict(tmp_path)
    config["text_config"]["model_type"] = "mistral4"
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert read_config_dict(tmp_path)["text_config"]["model_type"] == "mistral4"


def test_the_language_models_sizes_are_checked_too(tmp_path):
    config = {"model_type": "qwen3_vl_moe", "text_config": {"model_type": "qwen3_vl_moe_text", "num_experts": -1}}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="num_experts"):
        read_config_dict(tmp_path)


def test_a_module_with_only_some_experts_stored_transposed_is_refused(qwen3_vl, tmp_path):
    """Its math reads all of a module's weights one way: one tensor transposed and the other not cannot be read."""
    folder = tmp_path / "model"
    folder.mkdir()
    for path in qwen3_vl.iterdir():
        if path.suffix != ".safetensors":
            (folder / path.name).write_bytes(path.read_bytes())
    tensors = {}
    for path in qwen3_vl.glob("*.safetensors"):
        tensors.update(load_file(path))
    key = "model.language_model.layers.0.mlp.experts.down_proj"
    tensors[key] = tensors[key].transpose(1, 2).contiguous()  # as transformers holds it
    index = {"metadata": {}, "weight_map": dict.fromkeys(tensors, "model.safetensors")}
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="stored transposed"):
        load(folder)


def test_a_language_model_published_alone_is_served_in_its_composite_without_its_mtp_layer(tmp_path, monkeypatch):
    """Step-3.5-Flash: Step 3.7 Flash's language model, published with a config of its own modeling code's names
    and multi-token-prediction layers past the last, which transformers does not build: their experts, joined on
    load like the others', are not read."""
    folder = build_checkpoint("step3p5", tmp_path / "step3p5")
    assert read_config_dict(folder)["model_type"] == "step3p5"
    assert any(key.startswith("model.layers.3.moe.") for key in index_checkpoint(folder))  # the MTP layer's
    converted = []
    original = ConvertedDense.convert
    monkeypatch.setattr(ConvertedDense, "convert", lambda self, *a: converted.append(self.target) or original(self, *a))
    engine = load(folder)
    try:
        names = [name for name, _ in engine.model.named_parameters()]
        assert all(name.startswith(("model.language_model.", "lm_head.")) for name in names)
        assert not any(".layers.3." in target for target in converted), converted
        prompt = engine.encode("The quick brown fox")
        assert greedy(engine, prompt, 8) == reference_greedy(folder, prompt, 8)
    finally:
        engine.close()
