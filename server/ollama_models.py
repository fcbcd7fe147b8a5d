"""What Ollama's model endpoints (`/api/tags`, `/api/show`, `/api/ps`) say about the served model,
from what the engine knows. Unknowns are empty strings.

The model is loaded once at start and never unloaded: `/api/ps` lists it with an expiry far off.
`size` is the checkpoint's safetensors files; `size_vram` the device memory torch has allocated
(0 on CPU); `parameter_size` counts the elements of every tensor in the checkpoint's safetensors
headers, experts included, written as Ollama writes it ("46.7B", "134.52M"); a checkpoint published
quantized counts its stored elements (packed 4-bit pairs as one).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

from engine.api import EngineUnavailableError
from server import ollama_protocol as o
from server.errors import APIError
from server.reasoning import detect_reasoning

OLLAMA_API_VERSION = "0.12.0"  # the Ollama release whose API (docs/api.md) this server follows
LATEST = ":latest"  # Ollama's tag for a name sent without one
NEVER_EXPIRES = "9999-12-31T23:59:59Z"


def served_name(engine, requested: str) -> str:
    """`requested` as one of the served names: as it is, or without `:latest`; else a 404 in Ollama's words."""
    for name in (requested, requested.removesuffix(LATEST)):
        if name in engine.model_names:
            return name
    raise APIError(404, f"model '{requested}' not found", "not_found_error", param="model", code="model_not_found")


def rfc3339(epoch_s: float) -> str:
    return datetime.fromtimestamp(epoch_s, timezone.utc).isoformat().replace("+00:00", "Z")


@dataclass(frozen=True)
class ModelFacts:
    """What the Ollama endpoints report of the served model."""

    family: str
    quantization: str
    parameter_size: str
    size: int
    digest: str
    modified_at: str
    context_length: int
    template: str
    capabilities: list[str]

    def details(self) -> o.Details:
        return o.Details(family=self.family, families=[self.family] if self.family else [],
                         parameter_size=self.parameter_size, quantization_level=self.quantization)

    def entry(self, name: str, **running) -> o.ModelEntry:
        """A model list's entry; `running`: `/api/ps`'s `expires_at`, `size_vram` and `context_length`."""
        return o.ModelEntry(name=name, model=name, modified_at=self.modified_at, size=self.size,
                            digest=self.digest, details=self.details(), **running)


def model_facts(engine, reasoning_parser: str, started: float) -> ModelFacts:
    """`reasoning_parser`: the server's (`--reasoning-parser`); `started`: when the model was loaded (epoch s)."""
    info = engine.chat_template_info
    reasoning = detect_reasoning(info) if reasoning_parser == "auto" else reasoning_parser
    capabilities = ["completion"] + (["tools"] if info.supports_tools else []) + (
        ["insert"] if getattr(engine, "fim_format", None) else []) + (  # a stand-in engine (tests) may not say
        ["thinking"] if reasoning not in (None, "none") else [])
    folder = getattr(getattr(engine, "loaded", None), "folder", None)
    return ModelFacts(family=info.model_type, quantization=_expert_dtype(engine),
                      parameter_size=human_count(_parameter_count(folder)) if folder is not None else "",
                      size=_checkpoint_bytes(folder),
                      digest=_digest(folder), modified_at=rfc3339(started), context_length=engine.max_model_len,
                      template=info.source, capabilities=capabilities)


def show(facts: ModelFacts, name: str) -> o.ShowResponse:
    arch = facts.family or "unknown"
    info = {"general.architecture": arch, "general.basename": name, f"{arch}.context_length": facts.context_length}
    return o.ShowResponse(template=facts.template, details=facts.details(), modified_at=facts.modified_at,
                          model_info=info, capabilities=facts.capabilities)


def device_bytes(engine) -> int:
    device = getattr(engine, "device", None)
    if device is None or device.type != "cuda":
        return 0
    import torch  # loaded already with the engine

    return int(torch.cuda.memory_allocated(device))


def _expert_dtype(engine) -> str:
    try:
        return str(engine.cache_info().get("expert_dtype") or "")
    except (AttributeError, EngineUnavailableError):  # a stand-in engine (tests) may not say
        return ""


def human_count(count: int) -> str:
    """A parameter count as Ollama shows it: billions with one decimal, else millions with two."""
    if count >= 1e9:
        return f"{count / 1e9:.1f}B"
    if count >= 1e6:
        return f"{count / 1e6:.2f}M"
    return f"{count / 1e3:.2f}K" if count >= 1e3 else str(count)


@functools.lru_cache(maxsize=4)  # headers only, but a large checkpoint has dozens of shards
def _parameter_count(folder: Path) -> int:
    from cache.safetensors_index import index_checkpoint  # imports torch: loaded already with the engine

    return sum(math.prod(location.shape) for location in index_checkpoint(folder).values())


def _checkpoint_bytes(folder) -> int:
    return sum(path.stat().st_size for path in folder.glob("*.safetensors")) if folder is not None else 0


def _digest(folder) -> str:
    if folder is None:
        return ""
    from engine.checkpoint import checkpoint_digest  # imports torch: loaded already with the engine

    return checkpoint_digest(folder)
