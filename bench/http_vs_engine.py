"""The demo model through HTTP vs the engine called directly (issue 3).

    python -m bench.http_vs_engine [--prompts 6] [--tokens 32] [--cache 96]

A real `moe-serve` process (streaming chat completions over SSE, parsed by hand) and an
in-process `Engine` with the same settings answer the same chat prompts at temperature 0,
request by request in turn. Reports median time to first token and decode tokens/s.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from bench.prompts import SIMPLE_QA
from engine.api import GenerationRequest, SamplingParams
from engine.config import EngineConfig
from engine.engine import Engine
from server.testing import RemoteServer, sse_data


def over_http(server: RemoteServer, model: str, question: str, tokens: int) -> tuple[float, float, int]:
    body = {"model": model, "messages": [{"role": "user", "content": question}], "max_tokens": tokens,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}  # fmt: skip
    start = time.perf_counter()
    first = last = None
    completion_tokens = 0
    with server.http() as http, http.stream("POST", "/v1/chat/completions", json=body, timeout=600) as response:
        for event in sse_data(response.iter_lines()):
            if event == "[DONE]":
                break
            chunk = json.loads(event)
            if chunk.get("usage"):
                completion_tokens = chunk["usage"]["completion_tokens"]
            if chunk["choices"] and chunk["choices"][0]["delta"].get("content"):
                first = first or time.perf_counter()
                last = time.perf_counter()
    return first - start, last - first, completion_tokens


def direct(engine: Engine, question: str, tokens: int) -> tuple[float, float, int]:
    ids = engine.apply_chat_template([{"role": "user", "content": question}])
    for _ in engine.generate(GenerationRequest("direct", ids, SamplingParams(max_tokens=tokens, temperature=0))):
        pass
    t = engine.last_times
    return t.first_token - t.start, t.end - t.first_token, t.tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=6)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--cache", type=int, default=96, help="device cache size in experts (demo: 240 in all)")
    args = parser.parse_args()
    flags = ["--config", "configs/demo-cpu.yaml", "--expert-cache-experts", str(args.cache), "--no-prefetch"]
    engine = Engine.load(EngineConfig(device="cpu", dtype="float32", expert_cache_experts=args.cache, prefetch=False))
    samples: dict[str, list[tuple[float, float, int]]] = {"http": [], "direct": []}
    with RemoteServer(flags, ready_timeout=1200) as server:
        model = server.openai().models.list().data[0].id
        for question in SIMPLE_QA[: args.prompts]:
            samples["http"].append(over_http(server, model, question, args.tokens))
            samples["direct"].append(direct(engine, question, args.tokens))
    result = {}
    for name, runs in samples.items():
        result[name] = {
            "ttft_s_median": statistics.median(r[0] for r in runs),
            "decode_tokens_per_s_median": statistics.median((r[2] - 1) / r[1] for r in runs if r[2] > 1 and r[1] > 0),
        }
    result["setup"] = {"model": "built-in demo", "cache_experts": args.cache, "prompts": args.prompts,
                       "max_tokens": args.tokens, "prefetch": False}  # fmt: skip
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
