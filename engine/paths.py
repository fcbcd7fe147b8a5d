"""Per-user folders: where state that must survive restarts (the EAMC) lives."""

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
    readable = re.sub(r"[^A-Za-z0-9._-]+", "_", model_identity.rstrip("/").split("/")[-1])[:60] or "model"
    digest = hashlib.sha256(model_identity.encode()).hexdigest()[:12]
    return state_dir() / "eamc" / f"{readable}-{digest}.eamc"
