"""Where a GGUF model comes from: a file (an Ollama blob too, known by its magic bytes), the parts of a model split
by llama.cpp's gguf-split, a model Ollama pulled (by its Ollama name) or a quantization in a hub repository."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

from cache.safetensors_index import CheckpointError

GGUF_MAGIC = b"GGUF"
SPLIT_NAME = re.compile(r"(?P<stem>.+)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf")  # llama.cpp's gguf-split
OLLAMA_MODEL_LAYER = "application/vnd.ollama.image.model"


def is_gguf(path: Path) -> bool:
    try:
        with open(path, "rb") as f:
            return f.read(4) == GGUF_MAGIC
    except OSError:
        return False


def ollama_blob(name: str) -> Path:
    """The GGUF blob of the model Ollama pulled as `name` (`qwen3:30b`, `library/qwen3`, `hf.co/owner/repo:TAG`;
    tag `latest` when none), from its manifest under `$OLLAMA_MODELS` (default `~/.ollama/models`, or the Linux
    service's `/usr/share/ollama/.ollama/models`)."""
    repository, _, tag = name.partition(":")
    parts = repository.split("/")
    host = parts[0] if "." in parts[0] and len(parts) > 1 else "registry.ollama.ai"
    path = parts[1:] if host == parts[0] else parts
    if len(path) == 1:
        path = ["library", *path]
    tried = []
    for models in ollama_model_dirs():
        manifest = models / "manifests" / host / Path(*path) / (tag or "latest")
        tried.append(str(manifest))
        if manifest.is_file():
            layers = json.loads(manifest.read_text()).get("layers", [])
            digests = [layer["digest"] for layer in layers if layer.get("mediaType") == OLLAMA_MODEL_LAYER]
            if not digests:
                raise CheckpointError(f"Ollama's manifest {manifest} names no model layer")
            return models / "blobs" / digests[0].replace(":", "-")
    raise CheckpointError(f"Ollama has no model {name!r} on this machine (`ollama pull {name}` fetches it); "
                          f"looked for {', '.join(tried)}")


def ollama_model_dirs() -> list[Path]:
    explicit = os.environ.get("OLLAMA_MODELS")
    if explicit:
        return [Path(explicit).expanduser()]
    return [Path.home() / ".ollama" / "models", Path("/usr/share/ollama/.ollama/models")]


def fetch_hub_gguf(repo: str, quant: str) -> Path:
    """The GGUF file of quantization `quant` (a tag such as `Q4_K_M` in any case, or a file name) in the hub
    repository `repo`, downloaded into the local hub cache with all its parts; its first part."""
    from huggingface_hub import HfApi, hf_hub_download

    try:
        files = HfApi().list_repo_files(repo)
        chosen = pick_gguf_files(files, quant, repo)
        return [Path(hf_hub_download(repo, name)) for name in chosen][0]
    except CheckpointError:
        raise
    except Exception as e:
        raise CheckpointError(f"{repo}:{quant} could not be fetched from the Hugging Face hub (offline, or not a "
                              f"repository?): {type(e).__name__}: {e}") from None


def gguf_models(files: list[str]) -> list[str]:
    """The GGUF files among a repository's `files` that hold language models (not vision projectors)."""
    return sorted(f for f in files if f.endswith(".gguf") and not f.rsplit("/", 1)[-1].lower().startswith("mmproj"))


def pick_gguf_files(files: list[str], quant: str, repo: str) -> list[str]:
    """The files of one GGUF model in a repository's `files`: those whose name holds `quant` between separators
    (or is `quant`), all parts of it if split; a `CheckpointError` that lists the choices otherwise."""
    models = gguf_models(files)
    if quant.lower().endswith(".gguf"):
        matches = [f for f in models if quant in (f, f.rsplit("/", 1)[-1])]
    else:
        tag = re.compile(rf"(?:^|[-_./]){re.escape(quant)}(?:[-_./]|$)", re.IGNORECASE)
        matches = [f for f in models if tag.search(f)]
    whole = {model_name(f) for f in matches}
    if len(whole) == 1:
        return sorted(matches)
    if not whole:
        listed = sorted({model_name(f) for f in models})
        raise CheckpointError(f"{repo} has no GGUF file for {quant!r}; it has: {', '.join(listed) or 'none'}")
    raise CheckpointError(f"{repo}:{quant} matches {len(whole)} GGUF models ({', '.join(sorted(whole))}); "
                          f"name one: {repo}:FILE.gguf")


def model_name(file: str) -> str:
    """A split model's part named as the whole model (`X-00002-of-00003.gguf` → `X.gguf`); other files as they are."""
    m = SPLIT_NAME.fullmatch(file)
    return f"{m['stem']}.gguf" if m else file


def split_parts(source: Path) -> list[Path]:
    """Every file of the model `source` belongs to, in order: itself, or all parts of a split model."""
    m = SPLIT_NAME.fullmatch(source.name)
    if m is None:
        return [source]
    count = int(m["count"])
    parts = [source.with_name(f"{m['stem']}-{i:05d}-of-{count:05d}.gguf") for i in range(1, count + 1)]
    missing = [p.name for p in parts if not p.is_file()]
    if missing:
        raise CheckpointError(f"{source} is one of {count} parts of a split GGUF model; missing beside it: "
                              f"{', '.join(missing)}")
    return parts
