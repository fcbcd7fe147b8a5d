"""How long the first start on a GGUF file takes, at a real model's expert sizes.

    python -m bench.gguf_convert [--family qwen3_moe] [--layers 2] [--experts 128] [--hidden 2048]
                                 [--expert-size 768] [--types Q8_0,Q4_1,Q4_K,Q4_K/Q8_0] [--expert-dtype auto]
                                 [--ollama]

Writes random GGUF files of `--family` (qwen3_moe, gpt_oss) whose MoE layers have the given shapes (the defaults
are Qwen3-30B-A3B's: 128 experts of 2048 → 768), one of 1 layer and one of `--layers`, their experts in each GGUF
type (`A/B`: down_proj in B, as llama.cpp's Q4_K_M stores it wider), and starts the engine on each as `moe-serve
--model FILE.gguf` does (CPU, `--expert-dtype`): the conversion, then the load, which stores the experts in the
form asked for. One JSON line per type: the seconds of both steps for both files, the cost of one more layer and
of the rest (config, tokenizer, embeddings, warm-up), from them the time for all of the model's layers
(`--model-layers`, 48), the part of a layer's load that is the engine's warm-up (a short generation, timed again
after the load; on the CPU it computes every expert it meets), and how far one stored expert's gate/up weights
are from the file's values (relative Frobenius error; 0: the file's values exactly). `--ollama` (gpt_oss, MXFP4):
the files in Ollama's own GPT-OSS layout (`engine.gguf_ollama`) instead of llama.cpp's.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import time
from pathlib import Path

import torch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--family", default="qwen3_moe", choices=["qwen3_moe", "gpt_oss"])
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--experts", type=int, default=128)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--expert-size", type=int, default=768)
    parser.add_argument("--model-layers", type=int, default=48)
    parser.add_argument("--types", default="Q8_0,Q4_1,Q4_K,Q4_K/Q8_0")
    parser.add_argument("--expert-dtype", default="auto")
    parser.add_argument("--ollama", action="store_true", help="write the files as Ollama writes GPT-OSS")
    args = parser.parse_args()
    if args.ollama and (args.family != "gpt_oss" or args.types != "MXFP4"):
        parser.error("--ollama needs --family gpt_oss --types MXFP4: Ollama writes GPT-OSS alone, in MXFP4")
    if args.layers < 2:
        parser.error("--layers must be at least 2: the cost of a layer is the difference to a 1-layer file")

    with tempfile.TemporaryDirectory() as tmp:
        os.environ["MOE_SERVE_STATE_DIR"] = str(Path(tmp) / "state")
        for kind in args.types.split(","):
            seconds = {layers: first_start_seconds(args, layers, kind, Path(tmp)) for layers in (1, args.layers)}
            line = {"family": args.family, "layout": "ollama" if args.ollama else "llama.cpp", "type": kind, "experts": args.experts, "hidden": args.hidden,
                    "expert_size": args.expert_size}
            for step in ("convert", "load"):
                per_layer = (seconds[args.layers][step] - seconds[1][step]) / (args.layers - 1)
                fixed = seconds[1][step] - per_layer
                line |= {f"{step}_seconds_1_layer": round(seconds[1][step], 1),
                         f"{step}_seconds_{args.layers}_layers": round(seconds[args.layers][step], 1),
                         f"{step}_seconds_per_layer": round(per_layer, 1), f"{step}_seconds_fixed": round(fixed, 1),
                         f"{step}_estimate_{args.model_layers}_layers_min":
                             round((fixed + per_layer * args.model_layers) / 60, 1)}
            line["warm_up_seconds_per_layer"] = round((seconds[args.layers]["warm_up"] - seconds[1]["warm_up"])
                                                      / (args.layers - 1), 1)
            line["expert_form"] = seconds[1]["form"]
            line["stored_relative_error"] = seconds[1]["error"]
            line["state_folder_gib_per_layer"] = round(seconds[args.layers]["gib"] - seconds[1]["gib"], 2)
            print(json.dumps(line), flush=True)


def first_start_seconds(args: argparse.Namespace, layers: int, kind: str, tmp: Path) -> dict:
    """Write a `layers`-layer model's GGUF with `kind` experts, then time its conversion and the engine's load."""
    from engine.config import EngineConfig
    from engine.engine import Engine
    from engine.gguf_checkpoint import gguf_folder
    from tests.fixtures.gguf_files import VOCAB, write_gguf, write_ollama_gpt_oss
    from tests.fixtures.models import make_config, random_model

    config = make_config(args.family, VOCAB, args.experts, 8, layers, torch.float32)
    config.hidden_size, config.moe_intermediate_size, config.intermediate_size = (
        args.hidden, args.expert_size, args.expert_size)
    config.head_dim = args.hidden // config.num_attention_heads
    expert_type, _, down_type = kind.partition("/")
    name = kind.replace("/", "-")
    path = write_gguf(random_model(config, seed=0), tmp / f"{name}-{layers}.gguf", expert_type,
                      down_type=down_type or None)
    if args.ollama:
        llama_cpp, path = path, write_ollama_gpt_oss(path, tmp / f"ollama-{layers}.gguf")
        llama_cpp.unlink()
    started = time.monotonic()
    gguf_folder(path)
    converted = time.monotonic()
    engine = Engine.load(EngineConfig(model=str(path), device="cpu", expert_cache_experts=8,
                                      expert_dtype=args.expert_dtype))
    loaded = time.monotonic()
    engine.warm_up()  # once more: the load's own warm-up (a short generation) took about as long
    warm_up = time.monotonic() - loaded
    error = stored_error(engine)
    state = Path(os.environ["MOE_SERVE_STATE_DIR"])
    gib = sum(f.stat().st_size for f in state.rglob("*") if f.is_file()) / 2**30
    form = engine.loaded.quant.expert_dtype if engine.loaded.quant else "float"
    del engine
    path.unlink()
    shutil.rmtree(state)
    return {"convert": converted - started, "load": loaded - converted, "warm_up": warm_up, "form": form, "gib": gib,
            "error": error}


def stored_error(engine) -> float | None:
    """How far expert (0, 0)'s stored gate/up weight is from the file's values as gguf-py decodes them (relative
    Frobenius error); None where the experts are read from the file as they lie."""
    from cache.quant import unpack_expert
    from engine.gguf_experts import gguf_experts

    loaded = engine.loaded
    if loaded.quant is None:
        return None
    transposed = bool(loaded.moe_layers[0].experts.is_transposed)
    in_file = gguf_experts(loaded.folder, loaded.moe_layers).dequantized((0, 0))["gate_up_proj"]
    in_file = in_file.t() if transposed else in_file  # [out, in]
    with loaded.host.hold((0, 0)) as buffer:
        stored = unpack_expert(loaded.quant, buffer)["gate_up_proj"]
        if isinstance(stored, torch.Tensor):
            stored = stored.float().t() if transposed else stored.float()
        else:
            stored = stored.linear(torch.eye(in_file.shape[1])).t()
    return round(((stored - in_file).norm() / in_file.norm()).item(), 5)


if __name__ == "__main__":
    main()
