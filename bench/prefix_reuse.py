"""A multi-turn chat with and without reusing the last turn's KV cache (`--prefix-cache`).

    python -m bench.prefix_reuse [--conversations 3] [--turns 4] [--tokens 48] [--cache-experts N]
        [--title-task] [--max-model-len N] [--arms on,off]

Each conversation is run twice on one demo-model engine, reuse on and off alternated, with
greedy answers: the answers must match, and per turn the time to the first token (the prefill),
the prompt tokens reused and the expert misses of the prefill are reported (with `--cache-experts`
below the demo's 240; on CPU the default cache holds them all). `--title-task` puts an
Open WebUI-like background request (a title for the chat so far) between turns, as the chat UI
does with its task model, to show that the chat's own entry survives it. `--arms` picks what is
compared: `on` (reuse, with the host tier for entries that leave the device's context budget),
`off` (no reuse), `device-only` (reuse without the host tier: such entries are dropped); with a
small `--max-model-len` the title request and the chat no longer fit the budget side by side.
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch

from bench.prompts import TOPICS
from engine.api import GenerationRequest, SamplingParams
from engine.config import EngineConfig
from engine.engine import Engine
from engine.prefix_cache import PrefixCache

FOLLOW_UPS = ["Tell me more about that.", "Can you give an example?", "Why is that important?",
              "Summarise what you said in one sentence.", "What is a common misconception about it?"]
TITLE_TASK = "### Task:\nGenerate a concise, 3-5 word title for the chat below.\n### Chat History:\n{history}"


def run_turn(engine: Engine, messages: list[dict], tokens: int) -> dict:
    prompt = engine.apply_chat_template(messages)
    params = SamplingParams(max_tokens=tokens, temperature=0)
    before, prefill_misses = engine.cache_counters()["misses"], None
    ids, usage = [], None
    for event in engine.generate(GenerationRequest("turn", prompt, params)):
        prefill_misses = engine.cache_counters()["misses"] - before if prefill_misses is None else prefill_misses
        ids += event.token_ids
        usage = event.usage or usage
    times = engine.last_times
    return {"prompt_tokens": len(prompt), "cached_tokens": usage.cached_tokens,
            "ttft_ms": 1000 * (times.first_token - times.start), "answer": engine.decode(ids),
            "prefill_misses": prefill_misses,
            "decode_misses": engine.cache_counters()["misses"] - before - prefill_misses}  # fmt: skip


def conversation(engine: Engine, topic: str, turns: int, tokens: int, title_task: bool) -> list[dict]:
    messages, results = [], []
    for turn in range(turns):
        question = f"Explain {topic} briefly." if turn == 0 else FOLLOW_UPS[(turn - 1) % len(FOLLOW_UPS)]
        messages.append({"role": "user", "content": question})
        result = run_turn(engine, messages, tokens)
        messages.append({"role": "assistant", "content": result["answer"]})
        results.append(result)
        if title_task:
            history = "\n".join(f"{m['role'].upper()}: {m['content']}" for m in messages)
            run_turn(engine, [{"role": "user", "content": TITLE_TASK.format(history=history)}], 12)
    return results


def kept_caches(engine: Engine, arm: str, entries: int, host) -> PrefixCache | None:
    if arm == "off":
        return None
    return PrefixCache(entries, engine.max_model_len, host if arm == "on" else None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--conversations", type=int, default=3)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--cache-experts", type=int, default=None, help="expert cache size (default: all)")
    parser.add_argument("--title-task", action="store_true")
    parser.add_argument("--entries", type=int, default=4, help="--prefix-cache of the run with reuse")
    parser.add_argument("--max-model-len", type=int, default=None, help="the context (default: the model's)")
    parser.add_argument("--arms", default="on,off", help="two of on, off, device-only")
    args = parser.parse_args()
    arms = args.arms.split(",")
    torch.set_num_threads(max(1, torch.get_num_threads()))
    engine = Engine.load(EngineConfig(device="cpu", expert_cache_experts=args.cache_experts,
                                      prefix_cache=args.entries, max_model_len=args.max_model_len))
    reuse = engine.prefix_cache
    rows = {arm: [] for arm in arms}
    same = True
    for c in range(args.conversations):
        topic = TOPICS[c % len(TOPICS)]
        for arm in (arms if c % 2 == 0 else arms[::-1]):  # alternated against machine drift
            engine.prefix_cache = kept_caches(engine, arm, args.entries, reuse.host)
            rows[arm].append(conversation(engine, topic, args.turns, args.tokens, args.title_task))
        same &= len({tuple(t["answer"] for t in rows[arm][-1]) for arm in arms}) == 1
    engine.prefix_cache = reuse
    total = engine.runtime.num_layers * engine.runtime.num_experts
    summary = {"same_answers": same, "setup": vars(args) | {"cache_experts": engine.runtime.cache.capacity,
                                                           "total_experts": total}}
    for turn in range(args.turns):
        by_arm = {arm: [conv[turn] for conv in rows[arm]] for arm in arms}
        row = {"prompt_tokens": statistics.median(t["prompt_tokens"] for t in by_arm[arms[0]])}
        for key in ("cached_tokens", "ttft_ms", "prefill_misses", "decode_misses"):
            for arm in arms:
                row[f"{key}_{arm}"] = statistics.median(t[key] for t in by_arm[arm])
        summary[f"turn {turn + 1}"] = row
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
