"""Per-user folders: where state that must survive restarts (the EAMC, quantized experts) lives."""

from __future__ import annotations

import hashlib
import os
import re
from pathlib import Path


def state_dir() -> Path:
    """`$MOE_SERVE_STATE_DIR`, else `$XDG_STATE_HOME/moe-serve`, else `~/.local/state/moe-serve`."""
    explicit = os.environ.get("MOE_SERVE_STATE_DIR")
    if explicit:
        return Path(explicit).expanduser()
    xdg = os.environ.get("XDG_STATE_HOME")
    return (Path(xdg).expanduser() if xdg else Path.home() / ".local" / "state") / "moe-serve"


def default_eamc_path(model_identity: str) -> Path:
    """One EAMC file per model: a readable name plus a short hash of the full identity."""
    return state_dir() / "eamc" / f"{_file_stem(model_identity)}.eamc"


def default_quant_path(model_identity: str, form: str) -> Path:
    """The quantized experts of a model in one form (e.g. `int4-g32-cpu`), beside the EAMC files."""
    return state_dir() / "experts" / f"{_file_stem(model_identity)}-{form}.moeq"


def default_gguf_folder(source: Path, version: str) -> Path:
    """The Hugging Face folder converted from a GGUF file: one per file and `version` (size, time, dtype)."""
    return state_dir() / "gguf" / _file_stem(f"{source}|{version}", readable=source.name)


def _file_stem(model_identity: str, readable: str | None = None) -> str:
    readable = readable or model_identity.rstrip("/").split("/")[-1]
    readable = re.sub(r"[^A-Za-z0-9._-]+", "_", readable)[:60] or "model"
    digest = hashlib.sha256(model_identity.encode()).hexdigest()[:12]
    return f"{readable}-{digest}"
