"""Hostile model folders and names (issue 11, items 8-10): crafted safetensors headers, absurd
config.json sizes, chat templates that reach for Python internals or never end, and model ids
or served names that would lead a path out of its folder. Each is refused with a clear error."""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

import engine.engine as engine_module
import engine.model_loader as model_loader
from cache.safetensors_index import CheckpointError, index_checkpoint, read_header
from engine.api import InvalidRequestError
from engine.checkpoint import read_config_dict, resolve_model_path
from engine.config import EngineConfig
from engine.engine import Engine
from engine.paths import default_eamc_path, state_dir
from tests.fixtures.models import FAMILIES, MORE_FAMILIES, build_checkpoint

# -- safetensors headers (item 8) ------------------------------------------------------------


def write_safetensors(path: Path, header: dict, data: bytes, header_len: int | None = None) -> Path:
    head = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(head) if header_len is None else header_len) + head + data)
    return path


def entry(dtype: str, shape: list, begin: int, end: int) -> dict:
    return {"dtype": dtype, "shape": shape, "data_offsets": [begin, end]}


def test_a_well_formed_file_reads_back(tmp_path):
    path = tmp_path / "ok.safetensors"
    save_file({"a": torch.arange(6, dtype=torch.float32).reshape(2, 3), "b": torch.ones(4, dtype=torch.int8)},
              str(path))
    locations = read_header(path)
    assert torch.equal(locations["a"].read(), torch.arange(6, dtype=torch.float32).reshape(2, 3))
    assert torch.equal(locations["b"].read(), torch.ones(4, dtype=torch.int8))


CRAFTED = {
    # name: (header, data bytes, header length written, what the error says)
    "past-the-end": ({"a": entry("F32", [4], 0, 16)}, b"\0" * 8, None, "past the end"),
    "begin-after-end": ({"a": entry("F32", [0], 8, 4)}, b"\0" * 8, None, "past the end"),
    "negative-offset": ({"a": entry("F32", [2], -8, 0)}, b"\0" * 8, None, "non-negative integers"),
    "float-offset": ({"a": entry("F32", [2], 0.0, 8)}, b"\0" * 8, None, "non-negative integers"),
    "negative-dim": ({"a": entry("F32", [-2], 0, 8)}, b"\0" * 8, None, "non-negative integers"),
    "overlap": ({"a": entry("F32", [2], 0, 8), "b": entry("F32", [2], 4, 12)}, b"\0" * 12, None, "share bytes"),
    "dtype-shape-mismatch": ({"a": entry("F32", [4], 0, 8)}, b"\0" * 8, None, "needs 16"),
    "size-of-a-smaller-dtype": ({"a": entry("BF16", [4], 0, 16)}, b"\0" * 16, None, "needs 8"),
    "huge-header-length": ({"a": entry("F32", [2], 0, 8)}, b"\0" * 8, 2**63, "header length"),
    "header-past-the-end": ({"a": entry("F32", [2], 0, 8)}, b"\0" * 8, 10**6, "header length"),
    "header-not-an-object": ([1, 2], b"", None, "not a JSON object"),
    "entry-not-an-object": ({"a": [0, 8]}, b"\0" * 8, None, "malformed header entry"),
    "unknown-dtype": ({"a": entry("F8_WEIRD", [2], 0, 8)}, b"\0" * 8, None, "malformed header entry"),
}


@pytest.mark.parametrize("name", list(CRAFTED))
def test_a_crafted_header_is_refused_before_any_tensor_is_read(tmp_path, name):
    header, data, header_len, message = CRAFTED[name]
    path = write_safetensors(tmp_path / "bad.safetensors", header, data, header_len)
    with pytest.raises(CheckpointError, match=message):
        read_header(path)


def test_a_deeply_nested_header_is_a_clear_error(tmp_path):
    head = b"[" * 100_000 + b"]" * 100_000
    path = tmp_path / "deep.safetensors"
    path.write_bytes(struct.pack("<Q", len(head)) + head)
    with pytest.raises(CheckpointError, match="not a valid safetensors file"):
        read_header(path)


@pytest.fixture(scope="module")
def tiny_fused(tmp_path_factory) -> Path:
    return build_checkpoint("mixtral", tmp_path_factory.mktemp("fused"), layout="fused", num_layers=2)


def copy_of(folder: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(folder, tmp_path / "model"))


def test_a_shard_with_an_overlapping_tensor_fails_the_load_with_the_file_named(tiny_fused, tmp_path):
    folder = copy_of(tiny_fused, tmp_path)
    shard = sorted(folder.glob("*.safetensors"))[0]
    raw = shard.read_bytes()
    (header_len,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8: 8 + header_len])
    names = [n for n in header if n != "__metadata__"]
    first, second = sorted(names, key=lambda n: header[n]["data_offsets"][0])[:2]
    begin = header[first]["data_offsets"][0]  # the second tensor now claims the first one's bytes
    size = header[second]["data_offsets"][1] - header[second]["data_offsets"][0]
    header[second]["data_offsets"] = [begin, begin + size]
    head = json.dumps(header, separators=(",", ":")).encode().ljust(header_len)  # the data stays put
    assert len(head) == header_len
    shard.write_bytes(struct.pack("<Q", header_len) + head + raw[8 + header_len:])
    with pytest.raises(CheckpointError, match=f"{shard.name} is corrupt: tensors .* share bytes"):
        Engine.load(EngineConfig(model=str(folder), device="cpu", policy="lru"))


def test_fused_experts_fewer_than_the_config_says_are_refused(tiny_fused, tmp_path):
    """Reading expert 7 of a 4-expert fused tensor would read the bytes of the next tensor."""
    folder = copy_of(tiny_fused, tmp_path)
    config = json.loads((folder / "config.json").read_text())
    config["num_local_experts"] = 16  # the fused tensors hold 8
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=r"fused gate_up_proj has shape \[8, .*the config implies \[16, "):
        Engine.load(EngineConfig(model=str(folder), device="cpu", policy="lru"))


def test_joined_fused_experts_fewer_than_the_config_says_are_refused(tmp_path):
    """Step 3.7 Flash publishes gate and up each fused over the experts; both are read per expert in place."""
    folder = build_checkpoint("step3p7", tmp_path / "step3p7")
    config = json.loads((folder / "config.json").read_text())
    config["text_config"]["n_routed_experts"] = 16  # the fused tensors hold 8
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=r"joined into gate_up_proj have shapes \[\[8, 16, 32\], \[8, 16, 32\]\], "
                                              r"the config implies \[16, 32, 32\]"):
        Engine.load(EngineConfig(model=str(folder), device="cpu", policy="lru"))


def test_the_fixture_checkpoints_pass_the_header_checks(tiny_fused):
    names = index_checkpoint(tiny_fused)
    assert {"model.layers.0.mlp.experts.gate_up_proj", "model.layers.1.mlp.experts.down_proj"} <= set(names)


# -- config.json (item 9) --------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return build_checkpoint("mixtral", tmp_path_factory.mktemp("tiny"), num_layers=2)


@pytest.mark.parametrize("key, value", [
    ("num_local_experts", 10**12), ("hidden_size", -32), ("num_hidden_layers", 0), ("vocab_size", 2**40),
    ("intermediate_size", "32"), ("max_position_embeddings", 10**15), ("num_attention_heads", True),
    ("num_experts_per_tok", 9), ("head_dim", 1.5),
])
def test_an_absurd_config_is_refused_before_anything_is_built(tiny, tmp_path, monkeypatch, key, value):
    folder = copy_of(tiny, tmp_path)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, key: value}))

    def must_not_run(*args, **kwargs):
        raise AssertionError("the config was used before it was checked")

    monkeypatch.setattr(model_loader, "AutoConfig", type("Guard", (), {"from_pretrained": must_not_run}))
    monkeypatch.setattr(model_loader, "split_checkpoint", must_not_run)
    with pytest.raises(CheckpointError, match=key):
        Engine.load(EngineConfig(model=str(folder), device="cpu", policy="lru"))


def test_the_fixture_configs_of_every_family_pass_the_size_checks(tmp_path):
    for family in FAMILIES + MORE_FAMILIES:
        folder = build_checkpoint(family, tmp_path / family, num_layers=2)
        assert read_config_dict(folder)["model_type"].startswith(family)  # qwen3_5_moe saves its text config


def test_a_config_that_is_not_an_object_is_refused(tmp_path):
    (tmp_path / "config.json").write_text("[1, 2]")
    with pytest.raises(CheckpointError, match="not a JSON object"):
        read_config_dict(tmp_path)


# -- chat templates (item 9) -----------------------------------------------------------------


@pytest.fixture(scope="module")
def engine(tiny):
    loaded = Engine.load(EngineConfig(model=str(tiny), device="cpu", policy="lru", prefetch=False))
    yield loaded
    loaded.close()


@pytest.fixture
def template(engine):
    """Set the engine's chat template for one test (both the tokenizer and the encoding copy)."""
    original = engine.tokenizer.chat_template

    def use(text: str) -> None:
        engine.tokenizer.chat_template = engine._encoder.chat_template = text

    yield use
    use(original)


HI = [{"role": "user", "content": "Hi"}]


@pytest.mark.parametrize("payload", [
    "{{ cycler.__init__.__globals__.os.system('touch ' ~ marker) }}",
    "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "{{ self._TemplateReference__context.cycler.__init__.__globals__.os.popen('touch ' ~ marker).read() }}",
    "{% set x = namespace() %}{{ x.__init__.__globals__ }}",
])
def test_a_template_that_reaches_for_python_internals_is_refused(engine, template, tmp_path, payload):
    marker = tmp_path / "pwned"
    template("{% set marker = '" + str(marker) + "' %}" + payload + "{{ messages[0]['content'] }}")
    with pytest.raises(InvalidRequestError, match="chat template rejected the messages") as error:
        engine.apply_chat_template(HI)
    assert error.value.param == "messages"
    assert not marker.exists()


def test_a_template_that_never_ends_is_stopped_and_reported(engine, template, monkeypatch):
    monkeypatch.setattr(engine_module, "CHAT_TEMPLATE_TIME_LIMIT_S", 0.5)
    template("{% for a in range(100000) %}{% for b in range(100000) %}{{ '' }}{% endfor %}{% endfor %}")
    with pytest.raises(InvalidRequestError, match="did not finish within 0.5 s") as error:
        engine.apply_chat_template(HI)
    assert error.value.code == "chat_template_timeout" and error.value.param == "messages"
    template("{{ messages[0]['content'] }}")  # the engine, its lock and its thread go on working
    assert engine.apply_chat_template(HI) == engine.tokenizer("Hi", add_special_tokens=False)["input_ids"]


def test_a_looping_template_fails_the_load_with_the_reason(tiny, tmp_path, monkeypatch):
    folder = copy_of(tiny, tmp_path)
    config_path = folder / "tokenizer_config.json"
    tokenizer_config = json.loads(config_path.read_text())
    tokenizer_config["chat_template"] = "{% for a in range(100000) %}{% for b in range(100000) %}{% endfor %}{% endfor %}"
    config_path.write_text(json.dumps(tokenizer_config))
    for other in folder.glob("chat_template.*"):
        other.unlink()
    monkeypatch.setattr(engine_module, "CHAT_TEMPLATE_TIME_LIMIT_S", 0.5)
    with pytest.raises(InvalidRequestError, match="did not finish"):  # the warm-up renders it once
        Engine.load(EngineConfig(model=str(folder), device="cpu", policy="lru"))


# -- paths from names (item 10) --------------------------------------------------------------


@pytest.mark.parametrize("model", ["a/..", "../etc", "a/../../b", "a/b/../../../c", "owner/na--me",
                                   "owner/na..me", "-owner/name", "owner/name\n", "owner/\u0000x", "owner/nåme",
                                   "C:\\x/y", "owner/" + "n" * 200])
def test_a_model_id_that_is_not_a_folder_or_a_hub_id_never_reaches_the_hub(model, monkeypatch):
    import huggingface_hub

    asked = []
    monkeypatch.setattr(huggingface_hub, "snapshot_download", lambda repo, **kw: asked.append(repo) or "/")
    with pytest.raises(CheckpointError, match="does not exist|nor a valid Hugging Face hub id"):
        resolve_model_path(model)
    assert asked == []


def test_a_valid_hub_id_is_still_asked_for(monkeypatch, tmp_path):
    import huggingface_hub

    asked = []
    monkeypatch.setattr(huggingface_hub, "snapshot_download", lambda repo, **kw: asked.append(repo) or str(tmp_path))
    assert resolve_model_path("mistralai/Mixtral-8x7B-Instruct-v0.1") == tmp_path
    assert asked == ["mistralai/Mixtral-8x7B-Instruct-v0.1"]


@pytest.mark.parametrize("identity", ["../../../../etc/passwd", "..", "a/../..", "/abs/olute", "x\x00y/..",
                                      "..\\..\\win", "名前/../..", "." * 300, "~/.ssh/id_rsa"])
def test_the_default_eamc_path_stays_in_the_state_folder(identity):
    root = (state_dir() / "eamc").resolve()
    path = default_eamc_path(identity)
    assert path.resolve().parent == root
    assert path.name.endswith(".eamc") and "/" not in path.name


@pytest.mark.parametrize("name", ["", " padded", "line\nbreak", "nul\x00", "\ud800", "x" * 257, "a,,b", "a,", "a, b"])
def test_a_served_model_name_must_be_printable(name):
    with pytest.raises(ValueError, match="served-model-name"):
        EngineConfig(served_model_name=name)


def test_a_served_model_name_with_a_slash_is_fine():
    assert EngineConfig(served_model_name="org/model-v1.5").served_names == ("org/model-v1.5",)


def test_served_model_names_are_separated_by_commas():
    assert EngineConfig(served_model_name="qwen3,claude-sonnet-4-5").served_names == ("qwen3", "claude-sonnet-4-5")
    assert EngineConfig().served_names == ()
