"""Llama 4 on the CPU: transformers' MoE block (every expert on every token) against the engine's rebuilt one (the
routed expert only), all experts resident, side by side in one process.

    python -m bench.llama4_tpot [--rounds 3] [--tokens 32]

A Scout-like random model, shrunk: 16 experts, one per token, hidden 1024, experts of 2048, dense MLP of 4096,
4 layers. TPOT is (time of N + 1 tokens − time of 1 token) / N for the same prompt length; the engine gets a new
prompt each time, so that no kept prefix shortens its prefill.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from engine.api import GenerationRequest, SamplingParams
from engine.config import EngineConfig
from engine.engine import Engine
from tests.fixtures.models import make_config, random_model
from tests.fixtures.tokenizers import write_tokenizer

PROMPT_TOKENS = 40
EXPERTS, LAYERS = 16, 4


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=32)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        tokenizer = write_tokenizer("qwen", folder)
        vocab = max(len(tokenizer), max(tokenizer.get_vocab().values()) + 1)
        config = make_config("llama4_text", vocab, EXPERTS, 1, LAYERS, torch.float32, hidden_size=1024,
                             intermediate_size=2048, intermediate_size_mlp=4096, num_attention_heads=8,
                             num_key_value_heads=2, head_dim=128)
        random_model(config, 0).save_pretrained(folder)
        reference = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
        engine = Engine.load(EngineConfig(model=str(folder), device="cpu", policy="lru",
                                          expert_cache_experts=EXPERTS * LAYERS))
        rows = []
        for r in range(args.rounds):
            rows.append((transformers_tpot(reference, args.tokens), engine_tpot(engine, args.tokens, r)))
            print(f"round {r}: transformers {rows[-1][0]:.1f} ms/token, engine {rows[-1][1]:.1f} ms/token", flush=True)
        ours, theirs = statistics.median(b for _, b in rows), statistics.median(a for a, _ in rows)
        print(f"median: transformers {theirs:.1f} ms/token, engine {ours:.1f} ms/token ({theirs / ours:.2f}x)")


def transformers_tpot(model: torch.nn.Module, tokens: int) -> float:
    def run(new: int) -> float:
        started = time.perf_counter()
        with torch.no_grad():
            model.generate(torch.tensor([list(range(100, 100 + PROMPT_TOKENS))]), do_sample=False,
                           max_new_tokens=new, eos_token_id=None, pad_token_id=0)
        return time.perf_counter() - started

    return (run(tokens + 1) - run(1)) / tokens * 1e3


def engine_tpot(engine: Engine, tokens: int, round_: int) -> float:
    def run(new: int, offset: int) -> float:
        prompt = list(range(offset, offset + PROMPT_TOKENS))
        params = SamplingParams(max_tokens=new, temperature=0, ignore_eos=True)
        started = time.perf_counter()
        list(engine.generate(GenerationRequest(f"{offset}", prompt, params)))
        return time.perf_counter() - started

    return (run(tokens + 1, 1000 + 100 * round_) - run(1, 2000 + 100 * round_)) / tokens * 1e3


if __name__ == "__main__":
    main()
