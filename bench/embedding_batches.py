"""Embedding requests with many inputs: one engine pass per input (before) against inputs of similar length
padded into one pass (`engine.api.embedding_batches`, what the server does now), on the built-in demo model.

    python -m bench.embedding_batches [--inputs 16] [--rounds 2] [--cache-experts 60]

Inputs are windows of 150-300 tokens of `bench/data/public_domain.txt`, as a RAG client's document chunks are.
The two arms alternate round by round in one process (the machine is shared: read the ratio). Each arm runs
once with every expert resident and once with a cache of `--cache-experts` of the 240 (misses read the expert
into its slot: the copy a GPU makes over its link). Prints, per cache size and arm, the median seconds, the
expert misses per request, and the largest difference between the two arms' vectors.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from engine.api import GenerationRequest, embedding_batches
from engine.config import EngineConfig
from engine.engine import Engine

TEXT = Path(__file__).parent / "data" / "public_domain.txt"


def chunks(engine: Engine, count: int) -> list[list[int]]:
    """`count` windows of the text, of lengths 150-300 tokens, at different offsets."""
    ids = engine.encode(TEXT.read_text())
    windows = []
    for i in range(count):
        length = 150 + (i * 37) % 151
        start = (i * 53) % (len(ids) - length)
        windows.append(ids[start : start + length])
    return windows


def one_by_one(engine: Engine, inputs: list[list[int]]) -> list[tuple[float, ...]]:
    return [next(iter(engine.generate(GenerationRequest(f"one{i}", ids, pooling="mean")))).embeddings[0]
            for i, ids in enumerate(inputs)]


def batched(engine: Engine, inputs: list[list[int]]) -> list[tuple[float, ...]]:
    vectors: list[tuple[float, ...]] = [()] * len(inputs)
    for first, *rest in embedding_batches([len(ids) for ids in inputs]):
        request = GenerationRequest("batch", inputs[first], pooling="mean", more_inputs=tuple(inputs[i] for i in rest))
        (event,) = engine.generate(request)
        for index, vector in zip([first, *rest], event.embeddings, strict=True):
            vectors[index] = vector
    return vectors


def measure(engine: Engine, inputs: list[list[int]], rounds: int) -> dict:
    arms = {"one_by_one": one_by_one, "batched": batched}
    seconds: dict[str, list[float]] = {name: [] for name in arms}
    misses: dict[str, list[int]] = {name: [] for name in arms}
    vectors = {}
    for _ in range(rounds):
        for name, arm in arms.items():
            before, start = engine.runtime.stats.totals()["misses"], time.perf_counter()
            vectors[name] = arm(engine, inputs)
            seconds[name].append(time.perf_counter() - start)
            misses[name].append(engine.runtime.stats.totals()["misses"] - before)
    result = {name: {"seconds": statistics.median(seconds[name]), "all_seconds": seconds[name],
                     "expert_misses": statistics.median(misses[name])} for name in arms}
    result["batched_over_one_by_one"] = result["batched"]["seconds"] / result["one_by_one"]["seconds"]
    difference = torch.tensor(vectors["batched"]) - torch.tensor(vectors["one_by_one"])
    result["max_abs_difference"] = difference.abs().max().item()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--inputs", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--cache-experts", type=int, default=60)
    args = parser.parse_args()
    report = {}
    for label, experts in (("all experts resident", None), (f"{args.cache_experts} experts cached", args.cache_experts)):
        engine = Engine.load(EngineConfig(device="cpu", expert_cache_experts=experts, ))
        inputs = chunks(engine, args.inputs)
        report[label] = measure(engine, inputs, args.rounds)
        report[label]["input_tokens"] = sum(map(len, inputs))
        del engine
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
