"""How long converting a GGUF file takes, at a real model's expert sizes.

    python -m bench.gguf_convert [--layers 1] [--experts 128] [--hidden 2048] [--expert-size 768] [--types Q8_0,Q4_1]

Writes a random Qwen3-MoE GGUF whose MoE layers have the given shapes (the defaults are Qwen3-30B-A3B's: 128
experts of 2048 → 768), its experts in each GGUF type, converts it as `moe-serve --model FILE.gguf` does, and
prints one JSON line per type: the conversion's seconds, GB of expert weights in the file and written, and the
expected time for all of the model's layers (`--model-layers`, 48).
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
    parser.add_argument("--layers", type=int, default=1)
    parser.add_argument("--experts", type=int, default=128)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--expert-size", type=int, default=768)
    parser.add_argument("--model-layers", type=int, default=48)
    parser.add_argument("--types", default="Q8_0,Q4_1")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        os.environ["MOE_SERVE_STATE_DIR"] = str(Path(tmp) / "state")
        from engine.gguf_checkpoint import gguf_folder
        from tests.fixtures.gguf_files import VOCAB, write_gguf
        from tests.fixtures.models import make_config, random_model

        config = make_config("qwen3_moe", VOCAB, args.experts, 8, args.layers, torch.float32)
        config.hidden_size, config.moe_intermediate_size, config.intermediate_size = (
            args.hidden, args.expert_size, args.expert_size)
        config.head_dim = args.hidden // config.num_attention_heads
        model = random_model(config, seed=0)
        expert_params = 3 * args.experts * args.hidden * args.expert_size * args.layers
        for kind in args.types.split(","):
            path = write_gguf(model, Path(tmp) / f"{kind}.gguf", kind)
            started = time.monotonic()
            folder = gguf_folder(path)
            seconds = time.monotonic() - started
            written = sum(p.stat().st_size for p in folder.glob("*.safetensors"))
            print(json.dumps({
                "type": kind, "layers": args.layers, "experts": args.experts, "hidden": args.hidden,
                "expert_size": args.expert_size, "seconds": round(seconds, 1),
                "file_gb": round(path.stat().st_size / 1e9, 2), "written_gb": round(written / 1e9, 2),
                "expert_params_per_s_millions": round(expert_params / seconds / 1e6, 1),
                f"estimate_{args.model_layers}_layers_min": round(seconds / args.layers * args.model_layers / 60, 1),
            }), flush=True)
            path.unlink()


if __name__ == "__main__":
    main()
