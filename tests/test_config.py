"""The configuration layer: one flag table drives flags, MOE_SERVE_* variables and YAML presets."""

from __future__ import annotations

import logging
from dataclasses import fields
from pathlib import Path

import pytest

from engine.config import EngineConfig
from server.cli import warn_if_exposed
from server.config import FLAGS, ConfigError, ServerConfig, is_loopback_host, load_config

PRESETS = sorted((Path(__file__).resolve().parent.parent / "configs").glob("*.yaml"))


def write_yaml(tmp_path: Path, text: str) -> str:
    path = tmp_path / "settings.yaml"
    path.write_text(text)
    return str(path)


def test_flag_table_maps_one_to_one_onto_the_config_fields():
    table = {(flag.target, flag.field) for flag in FLAGS}
    dataclass_fields = {(cls, f.name) for cls in (ServerConfig, EngineConfig) for f in fields(cls)}
    assert table == dataclass_fields
    assert len(FLAGS) == len(table)


def test_defaults_bind_loopback_8000():
    server, engine = load_config([], environ={})
    assert (server.host, server.port, server.api_key) == ("127.0.0.1", 8000, None)
    assert engine == EngineConfig()
    assert server.is_loopback


# field, flag value, env value, yaml value, and what each parses to
PRECEDENCE = [
    ("port", ("--port", "9003"), "9002", "9001", (9003, 9002, 9001, 8000)),
    ("expert_cache_gb", ("--expert-cache-gb", "3.5"), "2.5", "1.5", (3.5, 2.5, 1.5, None)),
    ("policy", ("--policy", "lfu"), "lru", "lfu", ("lfu", "lru", "lfu", "sparsity-aware")),
    ("prefetch", ("--prefetch",), "false", "false", (True, False, False, True)),
    ("prefetch", ("--no-prefetch",), "true", "false", (False, True, False, True)),
    ("api_key", ("--api-key", "flag"), "env", "yaml", ("flag", "env", "yaml", None)),
    ("model", ("--model", "/m/flag"), "/m/env", "/m/yaml", ("/m/flag", "/m/env", "/m/yaml", None)),
    ("tool_call_parser", ("--tool-call-parser", "hermes"), "mistral", "glm45", ("hermes", "mistral", "glm45", "auto")),
    ("max_request_bytes", ("--max-request-bytes", "3000"), "2000", "1000", (3000, 2000, 1000, 4 * 2**20)),
    ("chat_template", ("--chat-template", "/t/flag.jinja"), "/t/env.jinja", "/t/yaml.jinja",
     ("/t/flag.jinja", "/t/env.jinja", "/t/yaml.jinja", None)),
]


@pytest.mark.parametrize("field, flag, env_value, yaml_value, expected", PRECEDENCE)
def test_precedence_flag_over_env_over_yaml_over_default(tmp_path, field, flag, env_value, yaml_value, expected):
    env_name = "MOE_SERVE_" + field.upper()
    yaml_file = write_yaml(tmp_path, f"{field}: {yaml_value}\n")

    def value(argv, environ):
        server, engine = load_config(argv, environ)
        return getattr(server if hasattr(server, field) else engine, field)

    want_flag, want_env, want_yaml, want_default = expected
    assert value(["--config", yaml_file, *flag], {env_name: env_value}) == want_flag
    assert value(["--config", yaml_file], {env_name: env_value}) == want_env
    assert value(["--config", yaml_file], {}) == want_yaml
    assert value([], {}) == want_default


def test_config_file_from_the_environment(tmp_path):
    server, _ = load_config([], {"MOE_SERVE_CONFIG": write_yaml(tmp_path, "max_queue: 3\n")})
    assert server.max_queue == 3


def test_empty_variable_counts_as_unset(tmp_path):
    server, _ = load_config(["--config", write_yaml(tmp_path, "port: 9100\n")], {"MOE_SERVE_PORT": ""})
    assert server.port == 9100


def test_cache_size_in_one_unit_replaces_the_other_from_a_lower_source(tmp_path):
    yaml_file = write_yaml(tmp_path, "expert_cache_gb: 18\n")
    _, engine = load_config(["--config", yaml_file, "--expert-cache-experts", "40"], {})
    assert (engine.expert_cache_experts, engine.expert_cache_gb) == (40, None)
    _, engine = load_config(["--config", yaml_file], {"MOE_SERVE_EXPERT_CACHE_EXPERTS": "7"})
    assert (engine.expert_cache_experts, engine.expert_cache_gb) == (7, None)


@pytest.mark.parametrize("preset", PRESETS, ids=lambda p: p.name)
def test_every_preset_loads(preset):
    server, engine = load_config(["--config", str(preset)], {})
    assert server.is_loopback  # presets never expose the server by themselves
    if engine.device != "cpu":  # on the CPU the cache is the RAM tier: all experts unless bounded
        assert engine.expert_cache_experts or engine.expert_cache_gb  # a GPU preset sizes the cache


def test_presets_cover_the_setups_the_readme_names():
    names = {p.stem for p in PRESETS}
    assert {"mixtral-8x7b-24gb", "deepseek-v2-lite-24gb", "qwen3-30b-a3b-16gb", "demo-cpu"} <= names


BAD = [
    ("yaml", "bogus_key: 1\n", {}, "bogus_key"),
    ("yaml", "port: eighty\n", {}, "port"),
    ("yaml", "port: 80.5\n", {}, "port"),
    ("yaml", "prefetch: maybe\n", {}, "prefetch"),
    ("yaml", "- a list\n", {}, "mapping"),
    ("yaml", "expert_cache_gb: 2\nexpert_cache_experts: 3\n", {}, "not both"),
    ("env", None, {"MOE_SERVE_PORT": "http"}, "MOE_SERVE_PORT"),
    ("env", None, {"MOE_SERVE_POLICY": "fifo"}, "MOE_SERVE_POLICY"),
    ("env", None, {"MOE_SERVE_MAX_QUEUE": "0"}, "max-queue"),
    ("env", None, {"MOE_SERVE_DEVICE": "tpu"}, "device"),
]


@pytest.mark.parametrize("source, yaml_text, environ, needle", BAD, ids=[b[3] for b in BAD])
def test_bad_values_name_their_source(tmp_path, source, yaml_text, environ, needle):
    argv = ["--config", write_yaml(tmp_path, yaml_text)] if yaml_text is not None else []
    with pytest.raises(ConfigError, match=needle):
        load_config(argv, environ)


def test_missing_config_file_is_an_error(tmp_path):
    with pytest.raises(ConfigError, match="cannot read"):
        load_config(["--config", str(tmp_path / "nope.yaml")], {})


@pytest.mark.parametrize("host, loopback", [
    ("127.0.0.1", True), ("127.5.0.1", True), ("localhost", True), ("::1", True), ("[::1]", True),
    ("app.localhost", True), ("0.0.0.0", False), ("::", False), ("192.168.1.5", False),
    ("example.com", False), ("localhost.example.com", False),
])
def test_loopback_names(host, loopback):
    assert is_loopback_host(host) is loopback


def test_exposed_without_key_warns_loudly(caplog):
    with caplog.at_level(logging.WARNING):
        warn_if_exposed(ServerConfig(host="0.0.0.0"))
    assert "no API key" in caplog.text and "0.0.0.0" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        warn_if_exposed(ServerConfig(host="0.0.0.0", api_key="k"))
        warn_if_exposed(ServerConfig())
    assert caplog.text == ""
