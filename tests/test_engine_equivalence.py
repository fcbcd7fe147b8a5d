"""The offloaded engine produces the same greedy tokens as the plain transformers model,
for every supported family, both checkpoint layouts, and cache sizes from one slot to all
experts; small caches really evict."""

import pytest

from engine.api import GenerationRequest, SamplingParams
from engine.config import EngineConfig
from engine.engine import Engine
from tests.fixtures.models import FAMILIES, LAYOUTS, build_checkpoint, reference_greedy

NEW_TOKENS = 12
PROMPT = "The quick brown fox jumps over the lazy dog, then"
NUM_LAYERS = 3
NUM_EXPERTS = 8


def moe_layers(family: str) -> int:
    return NUM_LAYERS - 1 if family.startswith("deepseek") else NUM_LAYERS  # first_k_dense_replace=1


def greedy(engine: Engine, prompt_ids: list[int]) -> list[int]:
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
    events = list(engine.generate(GenerationRequest("eq", prompt_ids, params)))
    assert events[-1].finish_reason == "length"
    return [t for e in events for t in e.token_ids]


@pytest.fixture(
    scope="module", params=[(f, lay) for f in FAMILIES for lay in LAYOUTS], ids=lambda p: f"{p[0]}-{p[1]}"
)
def checkpoint(request, tmp_path_factory):
    family, layout = request.param
    folder = build_checkpoint(
        family, tmp_path_factory.mktemp(f"{family}-{layout}"), layout=layout, num_layers=NUM_LAYERS
    )
    return family, folder


def test_greedy_tokens_equal_transformers_at_every_cache_size(checkpoint):
    family, folder = checkpoint
    total = moe_layers(family) * NUM_EXPERTS
    engines = {}
    for slots in (1, 2, total // 4, total):
        config = EngineConfig(model=str(folder), device="cpu", policy="lru", expert_cache_experts=slots)
        engines[slots] = Engine.load(config)
    prompt_ids = engines[total].encode(PROMPT)
    expected = reference_greedy(folder, prompt_ids, NEW_TOKENS)
    assert len(set(expected)) > 1  # a degenerate model would prove little
    for slots, engine in engines.items():
        assert greedy(engine, prompt_ids) == expected, f"cache of {slots} experts"
        totals = engine.cache_counters()
        assert totals["hits"] + totals["misses"] > 0
        if slots < total // 2:
            assert totals["evictions"] > 0 and totals["misses"] > total, f"cache of {slots} experts"
        if slots == total:
            assert totals["evictions"] == 0 and totals["misses"] <= total


@pytest.mark.parametrize("family", ["mixtral", "deepseek_v3"])
def test_policy_and_prefetch_change_speed_never_tokens(family, tmp_path):
    folder = build_checkpoint(family, tmp_path, num_layers=4)
    prompts = ["Hello there, how are", "The capital of France is", "def fib(n):", "Once upon a time"]
    outputs = {}
    for policy in ("lru", "lfu", "sparsity-aware"):
        for prefetch in (False, True):
            engine = Engine.load(
                EngineConfig(
                    model=str(folder),
                    device="cpu",
                    policy=policy,
                    prefetch=prefetch,
                    expert_cache_experts=6,
                    eamc_path=str(tmp_path / f"{policy}-{prefetch}.eamc"),  # each starts cold
                )
            )
            outputs[policy, prefetch] = [greedy(engine, engine.encode(p)) for p in prompts]
            counters = engine.cache_counters()
            engine.close()
            if policy == "sparsity-aware":
                assert counters["eamc_entries"] == len(prompts)
                assert (counters["prefetches"] > 0) == prefetch
    reference = outputs["lru", False]
    assert all(tokens == reference for tokens in outputs.values())
