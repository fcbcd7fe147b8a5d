"""Cache policies inside the real engine (issue 4), and routing traces recorded from it.

    python -m bench.engine_policies record  [--model DIR] [--prompts 200] [--tokens 48] [--out FILE]
    python -m bench.engine_policies compare [--model DIR] [--prompts 24] [--tokens 32] [--cache-frac 0.25]

`record` runs the varied prompt set of bench/prompts.py through the engine with
`--record-trace` (default model: the built-in demo model). `compare` runs the same
requests through `lru` and `sparsity-aware`, prefetch off and on, request by request in
turn (so machine noise hits all alike), and reports TPOT, hit rate, demand loads
(stalls) per token, prefetch accuracy and the look-ahead router's accuracy.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

from bench.prompts import prompts
from engine.api import GenerationRequest, SamplingParams
from engine.config import EngineConfig
from engine.engine import Engine


def chat_request(engine: Engine, index: int, text: str, tokens: int) -> GenerationRequest:
    ids = engine.apply_chat_template([{"role": "user", "content": text}])
    return GenerationRequest(f"req-{index}", ids, SamplingParams(max_tokens=tokens, temperature=0))


def record(args: argparse.Namespace) -> dict:
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.unlink(missing_ok=True)
    engine = Engine.load(
        EngineConfig(model=args.model, record_trace=str(out), expert_cache_experts=args.cache,
                     prefix_cache=0)  # every prompt's routing whole in the trace, the shared system prompt too
    )
    generated = 0
    for i, (_, text) in enumerate(prompts(args.prompts, seed=args.seed)):
        for event in engine.generate(chat_request(engine, i, text, args.tokens)):
            generated += len(event.token_ids)
    engine.close()
    return {"trace": str(out), "requests": args.prompts, "generated_tokens": generated}


def compare(args: argparse.Namespace) -> dict:
    variants = {
        f"{p}{'+prefetch' if f else ''}": (p, f) for p in ("lru", "sparsity-aware") for f in (False, True)
    }
    probe = Engine.load(EngineConfig(model=args.model, policy="lru", prefetch=False))
    capacity = max(1, int(probe.runtime.num_layers * probe.runtime.num_experts * args.cache_frac))
    probe.close()
    state = Path(tempfile.mkdtemp(prefix="moe-serve-bench-"))  # every variant starts cold, with its own EAMC
    engines = {
        name: Engine.load(
            EngineConfig(
                model=args.model, policy=p, prefetch=f, expert_cache_experts=capacity,
                eamc_path=str(state / f"{name}.eamc"), prefix_cache=0,  # as the earlier rows of RESULTS
            )
        )
        for name, (p, f) in variants.items()
    }
    tpot: dict[str, list[float]] = {name: [] for name in engines}
    tokens = dict.fromkeys(engines, 0)
    outputs: dict[str, list[list[int]]] = {name: [] for name in engines}
    for i, (_, text) in enumerate(prompts(args.prompts, seed=args.seed)):
        for name, engine in engines.items():
            ids = [
                t for e in engine.generate(chat_request(engine, i, text, args.tokens)) for t in e.token_ids
            ]
            outputs[name].append(ids)
            t = engine.last_times
            tokens[name] += t.tokens
            if t.tokens > 1:
                tpot[name].append((t.end - t.first_token) / (t.tokens - 1))
    results = {}
    for name, engine in engines.items():
        c = engine.cache_counters()
        prefetcher = engine.runtime.prefetcher
        results[name] = {
            "tpot_ms_median": 1000 * statistics.median(tpot[name]),
            "hit_rate": c["hits"] / max(1, c["hits"] + c["misses"]),
            "demand_loads_per_token": c["misses"] / max(1, tokens[name]),
            "transfers_per_token": (c["misses"] + c["prefetches"]) / max(1, tokens[name]),
            "prefetches": c["prefetches"],
            "prefetch_accuracy": c["prefetch_used"] / c["prefetches"] if c["prefetches"] else None,
            "lookahead_accuracy": prefetcher.lookahead_accuracy if prefetcher else None,
        }
        engine.close()
    reference = outputs["lru"]
    results["same_tokens_in_all_variants"] = all(o == reference for o in outputs.values())
    any_engine = next(iter(engines.values()))
    results["setup"] = {
        "model": args.model or "built-in demo",
        "cache_experts": any_engine.runtime.cache.capacity,
        "total_experts": any_engine.runtime.num_layers * any_engine.runtime.num_experts,
        "requests": args.prompts,
        "max_tokens": args.tokens,
    }
    return results


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("what", choices=["record", "compare"])
    parser.add_argument("--model", default=None, help="model folder (default: the built-in demo model)")
    parser.add_argument("--prompts", type=int, default=None)
    parser.add_argument("--tokens", type=int, default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--cache", type=int, default=None, help="record: device cache size in experts")
    parser.add_argument(
        "--cache-frac", type=float, default=0.25, help="compare: cache size as a share of all experts"
    )
    parser.add_argument("--out", default="bench/out/demo.trace.jsonl")
    args = parser.parse_args()
    if args.what == "record":
        args.prompts, args.tokens = args.prompts or 200, args.tokens or 48
        print(json.dumps(record(args), indent=2))
    else:
        args.prompts, args.tokens = args.prompts or 24, args.tokens or 32
        print(json.dumps(compare(args), indent=2))


if __name__ == "__main__":
    main()
