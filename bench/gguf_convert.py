"""How long converting a GGUF file takes, at a real model's expert sizes.

    python -m bench.gguf_convert [--layers 2] [--experts 128] [--hidden 2048] [--expert-size 768] [--types Q8_0,Q4_1]

Writes random Qwen3-MoE GGUF files whose MoE layers have the given shapes (the defaults are Qwen3-30B-A3B's: 128
experts of 2048 → 768), one of 1 layer and one of `--layers`, their experts in each GGUF type, converts each as
`moe-serve --model FILE.gguf` does, and prints one JSON line per type: the seconds of both, the cost of one more
layer and of the rest (config, tokenizer, embeddings), and from them the time for all of the model's layers
(`--model-layers`, 48).
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

import torch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--experts", type=int, default=128)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--expert-size", type=int, default=768)
    parser.add_argument("--model-layers", type=int, default=48)
    parser.add_argument("--types", default="Q8_0,Q4_1")
    args = parser.parse_args()
    if args.layers < 2:
        parser.error("--layers must be at least 2: the cost of a layer is the difference to a 1-layer file")

    with tempfile.TemporaryDirectory() as tmp:
        os.environ["MOE_SERVE_STATE_DIR"] = str(Path(tmp) / "state")
        for kind in args.types.split(","):
            seconds = {layers: convert_seconds(args, layers, kind, Path(tmp)) for layers in (1, args.layers)}
            per_layer = (seconds[args.layers] - seconds[1]) / (args.layers - 1)
            fixed = seconds[1] - per_layer
            print(json.dumps({
                "type": kind, "experts": args.experts, "hidden": args.hidden, "expert_size": args.expert_size,
                "seconds_1_layer": round(seconds[1], 1), f"seconds_{args.layers}_layers": round(seconds[args.layers], 1),
                "seconds_per_layer": round(per_layer, 1), "seconds_fixed": round(fixed, 1),
                "expert_params_per_s_millions": round(3 * args.experts * args.hidden * args.expert_size / per_layer / 1e6, 1),
                f"estimate_{args.model_layers}_layers_min": round((fixed + per_layer * args.model_layers) / 60, 1),
            }), flush=True)


def convert_seconds(args: argparse.Namespace, layers: int, kind: str, tmp: Path) -> float:
    """Write a `layers`-layer model's GGUF with `kind` experts and time its conversion."""
    from engine.gguf_checkpoint import gguf_folder
    from tests.fixtures.gguf_files import VOCAB, write_gguf
    from tests.fixtures.models import make_config, random_model

    config = make_config("qwen3_moe", VOCAB, args.experts, 8, layers, torch.float32)
    config.hidden_size, config.moe_intermediate_size, config.intermediate_size = (
        args.hidden, args.expert_size, args.expert_size)
    config.head_dim = args.hidden // config.num_attention_heads
    path = write_gguf(random_model(config, seed=0), tmp / f"{kind}-{layers}.gguf", kind)
    started = time.monotonic()
    gguf_folder(path)
    elapsed = time.monotonic() - started
    path.unlink()
    return elapsed


if __name__ == "__main__":
    main()
