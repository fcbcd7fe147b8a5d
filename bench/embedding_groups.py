"""Many one-chunk embedding requests at once, as Open WebUI sends a document's chunks by default
(`RAG_EMBEDDING_BATCH_SIZE` 1: one request per chunk, all at once), through the server on the built-in demo model.

    python -m bench.embedding_groups [--chunks 32] [--rounds 2] [--cache-experts 60]

Chunks are 1,000 characters of `bench/data/public_domain.txt` overlapping by 100 (Open WebUI's default splitter
sizes). Each round sends them all at once and times until the last vector arrives; the engine's passes are counted
from the server's log. Run it from two checkouts to compare (the machine is shared: read the ratio of rounds run
one after the other). Prints JSON: per cache size, the seconds of each round, the passes and the statuses.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from collections import Counter
from pathlib import Path

import httpx

from server.testing import RemoteServer

TEXT = Path(__file__).parent / "data" / "public_domain.txt"
MODEL = "moe-serve/smollm2-moe-demo"
CHUNK_CHARS, OVERLAP_CHARS = 1000, 100
PASS_LOG = "the embeddings of"  # the engine's log line for each embedding pass


def chunks(count: int) -> list[str]:
    """`count` chunks of the text read round and round (it is 2,867 characters): each starts at another offset."""
    text = TEXT.read_text()
    looped, step = text * (1 + CHUNK_CHARS // len(text) + 1), CHUNK_CHARS - OVERLAP_CHARS
    return [looped[start : start + CHUNK_CHARS] for start in (i * step % len(text) for i in range(count))]


async def all_at_once(url: str, texts: list[str]) -> tuple[float, Counter]:
    limits = httpx.Limits(max_connections=len(texts))
    async with httpx.AsyncClient(base_url=url, timeout=1800, limits=limits) as client:
        start = time.perf_counter()
        answers = await asyncio.gather(*(client.post("/v1/embeddings", json={"model": MODEL, "input": text})
                                         for text in texts))
        seconds = time.perf_counter() - start
    return seconds, Counter(answer.status_code for answer in answers)


def measure(cache_experts: int | None, texts: list[str], rounds: int) -> dict:
    args = [] if cache_experts is None else ["--expert-cache-experts", str(cache_experts)]
    with RemoteServer(args, ready_timeout=600) as server:
        asyncio.run(all_at_once(server.url, texts[:2]))  # warm-up
        seconds, statuses, passes = [], Counter(), []
        for _ in range(rounds):
            before = server.log().count(PASS_LOG)
            took, codes = asyncio.run(all_at_once(server.url, texts))
            seconds.append(took)
            statuses.update(codes)
            passes.append(server.log().count(PASS_LOG) - before)
    return {"seconds": statistics.median(seconds), "all_seconds": seconds, "engine_passes": passes,
            "statuses": dict(statuses)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--chunks", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--cache-experts", type=int, default=60)
    args = parser.parse_args()
    texts = chunks(args.chunks)
    report = {"requests": len(texts)}
    for label, experts in (("all experts resident", None), (f"{args.cache_experts} experts cached", args.cache_experts)):
        report[label] = measure(experts, texts, args.rounds)
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
