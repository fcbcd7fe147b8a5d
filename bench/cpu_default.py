"""The demo model on the CPU with the default cache settings: tokens/s, RAM and bytes copied.

    python -m bench.cpu_default [--prompts 8] [--tokens 32]

Loads the engine as `moe-serve --device cpu` does (no cache flags), runs greedy chat
requests from bench/prompts.py and prints one JSON object: decode tokens/s (median over
requests), peak and current RSS, and expert bytes copied per generated token. To compare
two versions of the code, run this file from each checkout with `PYTHONPATH` set to it.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
from pathlib import Path

from bench.prompts import prompts
from engine.api import GenerationRequest, SamplingParams
from engine.config import EngineConfig
from engine.engine import Engine


def rss_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def run(num_prompts: int, tokens: int) -> dict:
    engine = Engine.load(EngineConfig(device="cpu"))
    loaded_rss = rss_mib()
    rates, generated = [], 0
    for i, (_, text) in enumerate(prompts(num_prompts, seed=1)):
        ids = engine.apply_chat_template([{"role": "user", "content": text}])
        params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
        for _ in engine.generate(GenerationRequest(f"r{i}", ids, params)):
            pass
        t = engine.last_times
        generated += t.tokens
        rates.append((t.tokens - 1) / (t.end - t.first_token))
    counters = engine.cache_counters()
    engine.close()
    return {
        "decode_tokens_per_s_median": round(statistics.median(rates), 2),
        "rss_mib_after_load": round(loaded_rss),
        "rss_mib_end": round(rss_mib()),
        "peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024),
        "cache_capacity_experts": engine.runtime.cache.capacity,
        "hit_rate": round(counters["hits"] / max(1, counters["hits"] + counters["misses"]), 4),
        "expert_mib_copied_per_token": round(counters["bytes_transferred"] / 2**20 / max(1, generated), 2),
        "requests": num_prompts,
        "tokens_per_request": tokens,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=32)
    args = parser.parse_args()
    print(json.dumps(run(args.prompts, args.tokens), indent=2))


if __name__ == "__main__":
    main()
