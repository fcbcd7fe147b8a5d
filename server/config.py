"""Configuration: one table of flags drives argparse, `MOE_SERVE_*` variables and YAML.

Precedence: command-line flag > environment variable > YAML file (`--config`) > the
dataclass default. Every flag `--some-name` is the field `some_name` of `ServerConfig` or
`EngineConfig`, the variable `MOE_SERVE_SOME_NAME` and the YAML key `some_name`.
"""

from __future__ import annotations

import argparse
import ipaddress
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import MISSING, dataclass, fields
from pathlib import Path
from typing import Any

import yaml

from engine.api import DEFAULT_MAX_QUEUE, POOLINGS
from engine.config import CPU_EXPERTS, DTYPES, EXPERT_DTYPES, POLICY_NAMES, EngineConfig
from server import VERSION
from server.reasoning import REASONING_PARSERS
from server.tool_parsers import PARSER_NAMES

ENV_PREFIX = "MOE_SERVE_"
CONFIG_ENV = ENV_PREFIX + "CONFIG"
LOOPBACK_NAMES = ("localhost", "localhost.localdomain", "ip6-localhost", "ip6-loopback")


class ConfigError(ValueError):
    """A value that cannot be used; the message names where it came from."""


@dataclass(frozen=True)
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None  # None: no authentication
    allowed_origins: str | None = None  # comma-separated origin patterns; None: local pages and apps only
    max_queue: int = DEFAULT_MAX_QUEUE  # requests waiting or running; beyond it, 503
    tool_call_parser: str = "auto"  # auto: from the chat template, else the model type
    reasoning_parser: str = "auto"  # auto: from the chat template, else the model type
    reasoning_budget: int = -1  # thinking tokens per answer, then the block is closed; -1: unlimited
    max_request_bytes: int = 4 * 2**20  # larger request bodies get 413 before they are read whole
    drain_timeout: float = 20.0  # on shutdown, seconds running requests get to finish before they are aborted
    pooling: str = "mean"  # how an embedding request's last hidden states become one vector (engine.api.POOLINGS)

    def __post_init__(self) -> None:
        if not self.host:
            raise ValueError("host must not be empty")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in [0, 65535], not {self.port}")
        if self.max_queue < 1:
            raise ValueError(f"max-queue must be at least 1, not {self.max_queue}")
        if not 0 <= self.drain_timeout < float("inf"):
            raise ValueError(f"drain-timeout must be a number of seconds >= 0, not {self.drain_timeout}")
        if self.max_request_bytes < 1:
            raise ValueError(f"max-request-bytes must be at least 1, not {self.max_request_bytes}")
        if self.api_key is not None and not self.api_key.strip():
            raise ValueError("api-key must not be blank")
        if self.allowed_origins is not None:
            _check_origin_patterns(self.allowed_origins)
        if self.tool_call_parser not in PARSER_NAMES:
            raise ValueError(f"tool-call-parser must be one of {', '.join(PARSER_NAMES)}, not {self.tool_call_parser!r}")
        if self.reasoning_budget < -1:
            raise ValueError(f"reasoning-budget must be -1 (unlimited), 0 (no thinking) or more, "
                             f"not {self.reasoning_budget}")
        if self.reasoning_parser not in REASONING_PARSERS:
            raise ValueError(f"reasoning-parser must be one of {', '.join(REASONING_PARSERS)}, "
                             f"not {self.reasoning_parser!r}")
        if self.pooling not in POOLINGS:
            raise ValueError(f"pooling must be one of {', '.join(POOLINGS)}, not {self.pooling!r}")

    @property
    def is_loopback(self) -> bool:
        return is_loopback_host(self.host)


def _check_origin_patterns(setting: str) -> None:
    patterns = [pattern.strip() for pattern in setting.split(",")]
    for pattern in patterns:
        if pattern != "*" and "://" not in pattern:
            raise ValueError(f"allowed-origins: {pattern!r} is not an origin: write scheme://host[:port] "
                             "(e.g. http://localhost:3000, * for any part), or * for every origin")


def is_loopback_host(host: str) -> bool:
    name = host.strip("[]").lower()
    if name in LOOPBACK_NAMES or name.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


def parse_bool(text: str) -> bool:
    value = text.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"expected true or false, not {text!r}")


@dataclass(frozen=True)
class Flag:
    name: str  # "--expert-cache-gb"
    target: type  # ServerConfig or EngineConfig
    kind: Callable[[str], Any]  # int | float | str | parse_bool
    help: str
    metavar: str | None = None
    choices: tuple[str, ...] | None = None
    default_text: str | None = None  # the default in words, where the field's default is None

    @property
    def field(self) -> str:
        return self.name[2:].replace("-", "_")

    @property
    def env(self) -> str:
        return ENV_PREFIX + self.field.upper()

    @property
    def default(self) -> Any:
        return next(f.default for f in fields(self.target) if f.name == self.field)

    def parse(self, text: str) -> Any:
        value = self.kind(text)
        if self.choices is not None and value not in self.choices:
            raise ValueError(f"expected one of {', '.join(self.choices)}, not {text!r}")
        return value


FLAGS: tuple[Flag, ...] = (
    Flag("--model", EngineConfig, str, "local Hugging Face folder, GGUF file (llama.cpp, Ollama; converted once) or "
         "hub id", "PATH|ID",
         default_text="the built-in demo model, built locally on first use"),
    Flag("--served-model-name", EngineConfig, str, "the model id clients send and /v1/models lists; several, "
         "separated by commas, are all accepted", "NAME[,NAME...]",
         default_text="the --model value, or the demo model's name"),
    Flag("--host", ServerConfig, str, "address to bind; anything but loopback exposes the server to "
         "the network (set --api-key)", "ADDR"),
    Flag("--port", ServerConfig, int, "TCP port to listen on", "PORT"),
    Flag("--device", EngineConfig, str, "auto, cpu, cuda or cuda:N", "DEVICE"),
    Flag("--dtype", EngineConfig, str, "weight dtype (auto: the checkpoint's on CUDA, float32 on CPU)",
         choices=DTYPES),
    Flag("--expert-dtype", EngineConfig, str, "how experts are stored, moved and computed: auto or bf16 keep "
         "the checkpoint's weights (in --dtype); int8 halves the bytes per expert of bf16, int4 divides them "
         "by about 3.2 at group 32, 3.6 at 64, int4-mixed (int4 gate/up, int8 down_proj: much closer to bf16) by 2.7 "
         "(weight-only, group-wise: int8 symmetric, int4 with a zero point; quantized once at load and kept on disk beside "
         "the EAMC). On an FP8 or MXFP4 checkpoint auto keeps the experts' published bytes (decoded per use) and the "
         "others start from the decoded weights. The startup log and /v1/expert-cache show the bytes per expert",
         choices=EXPERT_DTYPES),
    Flag("--expert-group-size", EngineConfig, int, "weights per quantization scale along a row; 0: one "
         "scale per output channel; a size that does not divide a row shrinks to a divisor", "N",
         default_text="int8: per channel (the CPU kernel's form), int4: 32; int4-mixed: 32 for its int4 weights, down_proj per channel"),
    Flag("--expert-cache-experts", EngineConfig, int, "device expert cache size in experts, over all layers", "N",
         default_text="on CUDA the free device memory less the dense weights and 2 GiB; on CPU every expert that fits in the available RAM less 4 GiB (a quarter of it when that is less), computed where it lies (the smallest of this, --expert-cache-gb and --host-cache-gb)"),
    Flag("--expert-cache-gb", EngineConfig, float, "device expert cache size in GiB (instead of "
         "--expert-cache-experts)", "GB"),
    Flag("--host-cache-gb", EngineConfig, float, "host-RAM tier for experts in GiB; experts beyond it "
         "are read from disk on demand", "GB", default_text="every expert that fits in the available RAM (a container's limit included) less 4 GiB (a quarter of it when that is less)"),
    Flag("--policy", EngineConfig, str, "expert cache policy; only sparsity-aware learns from past requests "
         "(the EAMC): with lru or lfu the EAMC and its file are off", choices=POLICY_NAMES),
    Flag("--cpu-experts", EngineConfig, str, "on CUDA, compute some missed experts on the host cores where their "
         "weights lie, while the link copies others: auto (when measured faster at start-up) or off",
         choices=CPU_EXPERTS),
    Flag("--prefetch", EngineConfig, parse_bool, "prefetch the experts the predictor expects next "
         "(--no-prefetch: load on demand only)"),
    Flag("--eamc-path", EngineConfig, str, "file that keeps the learned expert activation matrices "
         "across restarts (sparsity-aware only)", "FILE",
         default_text="one file per model under the per-user state folder"),
    Flag("--eamc-capacity", EngineConfig, int, "how many expert activation matrices the EAMC keeps (sparsity-aware only)", "N"),
    Flag("--prefix-cache", EngineConfig, int, "KV caches of finished requests kept for reuse: a prompt that starts "
         "like one of them (a chat's next turn, a regenerated answer) skips the prefill of that part; they share "
         "one context's KV memory with the running request; 0 turns reuse off", "N"),
    Flag("--prefix-cache-host-gb", EngineConfig, float, "host RAM for kept KV caches that no longer fit the "
         "device's context budget (a chat's earlier turns while a chat client's background requests run): they "
         "move there instead of being dropped, and are copied back when a prompt reuses them; 0: off", "GB",
         default_text="1 GiB, or an eighth of the RAM available after the experts load when that is less"),
    Flag("--record-trace", EngineConfig, str, "append every request's expert routing to FILE "
         "(moe-trace/1 JSON Lines, for `python -m cache.replay`)", "FILE", default_text="off"),
    Flag("--api-key", ServerConfig, str, "require `Authorization: Bearer KEY` (or `x-api-key: KEY`) on every "
         "endpoint but /health", "KEY", default_text="none: no authentication"),
    Flag("--allowed-origins", ServerConfig, str, "web pages that may call the server from a browser (CORS), "
         "comma-separated; * in a pattern stands for any part (https://*.example.com), * alone allows every "
         "site; a page of another origin gets 403", "ORIGIN[,ORIGIN...]",
         default_text="local pages and apps only: http(s)://localhost, 127.0.0.1, [::1] and 0.0.0.0 on any port, "
         "app://, file://, tauri://, vscode-webview:// and vscode-file://"),
    Flag("--max-queue", ServerConfig, int, "requests waiting or running at once; beyond it the "
         "server answers 503 with Retry-After", "N"),
    Flag("--max-request-bytes", ServerConfig, int, "largest request body in bytes; a larger one gets 413 "
         "before it is read whole", "N"),
    Flag("--drain-timeout", ServerConfig, float, "on SIGTERM the server stops accepting and gives running "
         "requests this many seconds to finish; then they are aborted (a stream ends with an error event "
         "and [DONE])", "S"),
    Flag("--max-model-len", EngineConfig, int, "context length: prompt plus completion tokens; on CUDA "
         "without a cache size its whole KV cache is set aside before the expert cache takes the free memory",
         "N", default_text="the model's max_position_embeddings; on CUDA without a cache size, cut to what "
         "1/8 of the device memory left for the experts holds, at least 4096"),
    Flag("--chat-template", EngineConfig, str, "Jinja chat template used instead of the model's own (for one that "
         "is missing, broken or cannot take tools): a file, or the template text itself; read and checked at "
         "start-up", "FILE|TEXT", default_text="the model's own"),
    Flag("--tool-call-parser", ServerConfig, str, "how tool calls are read out of the model's output: "
         "auto picks by the chat template, else the model type", choices=PARSER_NAMES),
    Flag("--reasoning-parser", ServerConfig, str, "how a reasoning model's thinking is read out of its output "
         "into `reasoning_content`: think (<think>...</think>), harmony (GPT-OSS channels), gemma4 "
         "(<|channel>thought...<channel|>), hunyuan, mistral ([THINK]...[/THINK]), none (left in the "
         "content); auto picks by the chat template, else the model type", choices=REASONING_PARSERS),
    Flag("--reasoning-budget", ServerConfig, int, "the most tokens a thinking model may write in its "
         "<think>...</think> block; then the server closes the block and the model answers. -1: unlimited, "
         "0: no thinking. A request's thinking_token_budget (chat) or thinking.budget_tokens (Anthropic) wins; "
         "ignored for models without such a block (GPT-OSS)", "N"),
    Flag("--pooling", ServerConfig, str, "how /v1/embeddings and Ollama's /api/embed make one vector of an input: "
         "mean (the average of the model's last hidden states over its tokens) or last (the last token's, for "
         "models trained to embed that way); the vector is L2-normalized", choices=POOLINGS),
)
FLAGS_BY_FIELD = {flag.field: flag for flag in FLAGS}
# one size in two units: `--expert-cache-experts 40` overrides a preset's `expert_cache_gb: 18`
ALTERNATIVES = (("expert_cache_experts", "expert_cache_gb"),)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="moe-serve",
        description="OpenAI-compatible server for Mixture-of-Experts LLMs with an offloaded, "
        "sparsity-aware device expert cache.",
        epilog=f"Every flag can also be set as {ENV_PREFIX}<FLAG> (e.g. {ENV_PREFIX}EXPERT_CACHE_GB=4) "
        "or as a key of the --config YAML file (e.g. expert_cache_gb: 4). "
        "Precedence: flag > environment > YAML > default.",
        argument_default=argparse.SUPPRESS,  # only flags actually given reach the namespace
    )
    parser.add_argument("--version", action="version", version=f"moe-serve {VERSION}")
    parser.add_argument("--list-families", action=_ListFamilies, nargs=0,
                        help="print the model types (config.json `model_type`) moe-serve can load, and exit")
    parser.add_argument("--config", metavar="FILE", help=f"YAML file of settings, keys as the flag names "
                        f"with underscores (see configs/) (env {CONFIG_ENV})")
    for flag in FLAGS:
        help_text = f"{flag.help} (default: {flag.default_text or _describe(flag.default)}; env {flag.env})"
        if flag.kind is parse_bool:
            parser.add_argument(flag.name, action=argparse.BooleanOptionalAction, help=help_text)
        else:
            parser.add_argument(flag.name, type=flag.kind, choices=flag.choices, metavar=flag.metavar,
                                help=help_text)
    return parser


class _ListFamilies(argparse.Action):
    def __call__(self, parser, namespace, values, option_string=None) -> None:
        from engine.api import supported_families

        print("\n".join(supported_families()))
        parser.exit()


def load_config(
    argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None
) -> tuple[ServerConfig, EngineConfig]:
    """Parse flags, environment and YAML into the two config objects (argparse exits on bad flags)."""
    environ = os.environ if environ is None else environ
    given = vars(build_parser().parse_args(argv))
    config_file = given.pop("config", None) or environ.get(CONFIG_ENV) or None
    values = merge(read_yaml(config_file) if config_file else {}, read_env(environ), given)
    return make(ServerConfig, values), make(EngineConfig, values)


def merge(*sources: Mapping[str, Any]) -> dict[str, Any]:
    """Later sources win; setting one of a group of alternatives drops the others set earlier."""
    values: dict[str, Any] = {}
    for source in sources:
        for group in ALTERNATIVES:
            if any(key in source for key in group):
                for key in group:
                    values.pop(key, None)
        values.update(source)
    return values


def read_env(environ: Mapping[str, str]) -> dict[str, Any]:
    values = {}
    for flag in FLAGS:
        text = environ.get(flag.env, "")
        if text != "":  # an empty variable counts as unset (compose files pass ${X:-})
            values[flag.field] = _convert(flag, text, flag.env)
    return values


def read_yaml(path: str | os.PathLike) -> dict[str, Any]:
    try:
        data = yaml.safe_load(Path(path).read_text(encoding="utf-8"))
    except (OSError, yaml.YAMLError) as e:
        raise ConfigError(f"cannot read config file {path}: {e}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping of settings, not {type(data).__name__}")
    unknown = sorted(str(k) for k in data if k not in FLAGS_BY_FIELD)
    if unknown:
        raise ConfigError(f"{path}: unknown setting(s) {', '.join(unknown)}; known: {', '.join(FLAGS_BY_FIELD)}")
    return {
        key: _convert(FLAGS_BY_FIELD[key], value, f"{path}: {key}")
        for key, value in data.items()
        if value is not None  # `key: null` leaves the default
    }


def make(target: type, values: Mapping[str, Any]):
    own = {f.name for f in fields(target)}
    try:
        return target(**{k: v for k, v in values.items() if k in own})
    except ValueError as e:
        raise ConfigError(str(e)) from None


def _convert(flag: Flag, value: Any, source: str) -> Any:
    """A YAML or environment value as the flag's type; strings go through the flag's parser."""
    try:
        if isinstance(value, str):
            return flag.parse(value)
        if flag.kind is parse_bool and isinstance(value, bool):
            return value
        if flag.kind is float and isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if flag.kind is int and isinstance(value, int) and not isinstance(value, bool):
            return value
        if flag.kind is str and isinstance(value, (int, float)) and not isinstance(value, bool):
            return flag.parse(str(value))
        raise ValueError(f"expected {_kind_name(flag)}, not {value!r}")
    except ValueError as e:
        raise ConfigError(f"{source}: {e}") from None


def _kind_name(flag: Flag) -> str:
    return {int: "an integer", float: "a number", str: "a string", parse_bool: "true or false"}[flag.kind]


def _describe(default: Any) -> str:
    if default is MISSING or default is None:
        return "unset"
    if isinstance(default, bool):
        return "on" if default else "off"
    return str(default)
