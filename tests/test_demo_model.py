"""The built-in demo model: a real, small Mixtral-format MoE built offline from SmolLM2-135M.

The slow tests build it once per module (~40 s on 2 cores) and load it with plain transformers.
The fast tests cover the cache folder logic with a stand-in builder.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from engine import demo_model as dm
from engine.engine import generation_defaults

FRANCE = [{"role": "user", "content": "What is the capital of France?"}]


# ------------------------------------------------------------------ the real build (slow)


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> Path:
    return dm.ensure_demo_model(tmp_path_factory.mktemp("moe-cache"))


@pytest.fixture(scope="module")
def loaded(built):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(built).eval()
    return model, AutoTokenizer.from_pretrained(built)


def _france_ids(tokenizer) -> dict:
    return tokenizer.apply_chat_template(FRANCE, add_generation_prompt=True, return_tensors="pt", return_dict=True)


def _routed_experts(model, input_ids: torch.Tensor) -> list[torch.Tensor]:
    """Per layer, the top-k expert ids [T, k] the router picked for each token."""
    picked: list[torch.Tensor] = []
    hooks = [layer.mlp.gate.register_forward_hook(lambda _m, _i, out: picked.append(out[2]))
             for layer in model.model.layers]
    try:
        with torch.no_grad():
            model(input_ids)
    finally:
        for hook in hooks:
            hook.remove()
    return picked


@pytest.mark.slow
def test_answers_capital_of_france(loaded):
    model, tokenizer = loaded
    inputs = _france_ids(tokenizer)
    out = model.generate(**inputs, max_new_tokens=20, do_sample=False)
    answer = tokenizer.decode(out[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True)
    assert "Paris" in answer, answer


@pytest.mark.slow
def test_is_a_mixtral_checkpoint_with_per_expert_keys(built):
    config = json.loads((built / "config.json").read_text())
    assert config["model_type"] == "mixtral"
    assert (config["num_local_experts"], config["num_experts_per_tok"]) == (dm.NUM_EXPERTS, dm.TOP_K)
    assert config["tie_word_embeddings"] is True and config["sliding_window"] is None
    with safe_open(built / "model.safetensors", "pt") as f:
        keys = set(f.keys())
    for layer in range(config["num_hidden_layers"]):
        prefix = f"model.layers.{layer}.block_sparse_moe."
        assert prefix + "gate.weight" in keys
        experts = {k.split(".")[5] for k in keys if k.startswith(prefix + "experts.")}
        assert experts == {str(e) for e in range(dm.NUM_EXPERTS)}
        assert all(f"{prefix}experts.{e}.{w}.weight" in keys for e in range(dm.NUM_EXPERTS) for w in ("w1", "w2", "w3"))


@pytest.mark.slow
def test_experts_differ(built):
    with safe_open(built / "model.safetensors", "pt") as f:
        for layer in (0, 14, 29):
            w1 = [f.get_tensor(f"model.layers.{layer}.block_sparse_moe.experts.{e}.w1.weight")
                  for e in range(dm.NUM_EXPERTS)]
            same = [(a, b) for a in range(len(w1)) for b in range(a) if torch.equal(w1[a], w1[b])]
            assert not same, f"layer {layer}: identical experts {same}"


@pytest.mark.slow
def test_router_spreads_one_prompt_over_experts(loaded):
    model, tokenizer = loaded
    picked = _routed_experts(model, _france_ids(tokenizer)["input_ids"])
    distinct = [idx.unique().numel() for idx in picked]
    spread = sum(d > dm.TOP_K for d in distinct)
    assert spread >= 0.8 * len(distinct), distinct


@pytest.mark.slow
def test_generation_config_stops_at_end_of_turn(built, loaded):
    _, tokenizer = loaded
    gen = json.loads((built / "generation_config.json").read_text())
    eos = gen["eos_token_id"] if isinstance(gen["eos_token_id"], list) else [gen["eos_token_id"]]
    assert tokenizer.convert_tokens_to_ids("<|im_end|>") in eos
    assert tokenizer.chat_template and "<|im_start|>" in tokenizer.chat_template
    # what a request that omits them gets: low-temperature sampling and a bounded answer
    assert generation_defaults(built) == {"temperature": 0.2, "top_p": 0.9, "max_tokens": 512}


@pytest.mark.slow
def test_second_call_reuses_the_build(built):
    before = {p.name: p.stat().st_mtime_ns for p in built.iterdir()}
    assert dm.ensure_demo_model(built.parent) == built
    assert {p.name: p.stat().st_mtime_ns for p in built.iterdir()} == before  # nothing rebuilt or rewritten


@pytest.mark.slow
def test_identical_experts_reproduce_the_llama_logits():
    dense, tokenizer = dm.load_dense()
    dense = dense.to(torch.float64)  # float32 rounding would hide a small mapping slip
    assert dm.check_upcycle_exact(dense, tokenizer) < 1e-4  # only the float32 router weights remain


# --------------------------------------------------------- the cache folder logic (fast)


@pytest.fixture
def fake_build(monkeypatch):
    """Replace the real build with a quick one that counts its calls."""
    calls: list[Path] = []

    def build(out_dir: Path) -> dict:
        calls.append(out_dir)
        time.sleep(0.2)
        (out_dir / "model.safetensors").write_bytes(b"weights")
        (out_dir / dm.MARKER_FILE).write_text(json.dumps({"name": dm.DEMO_MODEL_NAME, "recipe": dm.RECIPE_VERSION}))
        return {}

    monkeypatch.setattr(dm, "build_demo_model", build)
    return calls


def test_concurrent_callers_build_once(tmp_path, fake_build):
    results: list[Path] = []
    threads = [threading.Thread(target=lambda: results.append(dm.ensure_demo_model(tmp_path))) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(fake_build) == 1
    assert set(results) == {tmp_path / "smollm2-moe-demo"}
    assert dm.is_current(results[0])


def test_stale_recipe_is_rebuilt_in_place(tmp_path, fake_build):
    target = tmp_path / "smollm2-moe-demo"
    target.mkdir()
    (target / "junk").write_text("old")
    (target / dm.MARKER_FILE).write_text(json.dumps({"name": dm.DEMO_MODEL_NAME, "recipe": dm.RECIPE_VERSION - 1}))
    assert dm.ensure_demo_model(tmp_path) == target
    assert len(fake_build) == 1
    assert sorted(p.name for p in target.iterdir()) == sorted([dm.MARKER_FILE, "model.safetensors"])
    assert [p.name for p in tmp_path.iterdir() if p.is_dir()] == [target.name]  # no temp folders left


def test_failed_build_leaves_nothing_behind(tmp_path, monkeypatch):
    def broken(out_dir: Path) -> dict:
        (out_dir / "model.safetensors").write_bytes(b"half")
        raise RuntimeError("boom")

    monkeypatch.setattr(dm, "build_demo_model", broken)
    with pytest.raises(RuntimeError, match="boom"):
        dm.ensure_demo_model(tmp_path)
    assert not [p for p in tmp_path.iterdir() if p.is_dir()]


def test_default_cache_dir_precedence(monkeypatch, tmp_path):
    monkeypatch.setenv("MOE_SERVE_CACHE_DIR", str(tmp_path / "explicit"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert dm.default_cache_dir() == tmp_path / "explicit"
    monkeypatch.delenv("MOE_SERVE_CACHE_DIR")
    assert dm.default_cache_dir() == tmp_path / "xdg" / "moe-serve"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert dm.default_cache_dir() == tmp_path / "home" / ".cache" / "moe-serve"
