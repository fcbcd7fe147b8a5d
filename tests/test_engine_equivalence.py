"""The offloaded engine produces the same greedy tokens as the plain transformers model,
for every supported family, both checkpoint layouts, and cache sizes from one slot to all
experts; small caches really evict."""

import pytest
import torch

import engine.offloaded_experts as offloaded_experts
from cache.trace import load_trace
from engine.api import GenerationRequest, SamplingParams
from engine.config import EngineConfig
from engine.engine import Engine
from engine.moe_layers import find_moe_layers
from tests.fixtures.models import (
    FAMILIES,
    LAYOUTS,
    MORE_FAMILIES,
    build_checkpoint,
    load_reference,
    reference_greedy,
)

NEW_TOKENS = 12
PROMPT = "The quick brown fox jumps over the lazy dog, then"
NUM_LAYERS = 3
NUM_EXPERTS = 8


def moe_layers(engine: Engine) -> int:
    return engine.runtime.num_layers  # fewer than NUM_LAYERS where leading layers are dense


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


def load_engines(folder, sizes) -> dict[int, Engine]:
    """One engine per cache size; `sizes` maps the number of MoE layers to the sizes."""
    first = Engine.load(EngineConfig(model=str(folder), device="cpu", policy="lru", expert_cache_experts=1))
    total = moe_layers(first) * NUM_EXPERTS
    engines = {1: first}
    for slots in sizes(total):
        config = EngineConfig(model=str(folder), device="cpu", policy="lru", expert_cache_experts=slots)
        engines[slots] = Engine.load(config)
    return engines


def test_greedy_tokens_equal_transformers_at_every_cache_size(checkpoint):
    family, folder = checkpoint
    engines = load_engines(folder, lambda total: (2, total // 4, total))
    total = max(engines)
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
            if prefetch:  # every guess issued: on 2 busy cores with reads from the page cache the gate issues none
                engine.runtime.prefetcher.cost = None
            outputs[policy, prefetch] = [greedy(engine, engine.encode(p)) for p in prompts]
            counters = engine.cache_counters()
            engine.close()
            if policy == "sparsity-aware":
                assert counters["eamc_entries"] == len(prompts)
                assert (counters["prefetches"] > 0) == prefetch
    reference = outputs["lru", False]
    assert all(tokens == reference for tokens in outputs.values())


@pytest.mark.parametrize("family", MORE_FAMILIES)
def test_more_families_through_the_experts_interface(family, tmp_path):
    """Families the six-family code never named: biases, transposed and interleaved weights
    (gpt_oss), linear attention and its cache (qwen3_next, qwen3_5_moe, minimax), mamba (jamba),
    dense leading layers and shared experts, other routers and checkpoint key names."""
    folder = build_checkpoint(family, tmp_path / family, num_layers=NUM_LAYERS)
    engines = load_engines(folder, lambda total: (total // 4, total))
    prompt_ids = engines[1].encode(PROMPT)
    expected = reference_greedy(folder, prompt_ids, NEW_TOKENS)
    assert len(set(expected)) > 1
    for slots, engine in engines.items():
        assert greedy(engine, prompt_ids) == expected, f"{family}, cache of {slots} experts"


def test_experts_in_a_latent_width_as_nemotron_3_super_has_them(tmp_path):
    """Nemotron 3 Super's experts compute in a width of their own, between two projections of the hidden state: the
    prefetcher's look-ahead, which gives the next router the experts' input, has nothing to give it there."""
    kinds = ["linear_attention", "moe", "full_attention", "moe"]  # two MoE layers: the second is looked ahead to
    folder = build_checkpoint("nemotron_h", tmp_path / "super", layers_block_type=kinds, moe_latent_size=16)
    engines = load_engines(folder, lambda total: (total // 4, total))
    prompt_ids = engines[1].encode(PROMPT)
    expected = reference_greedy(folder, prompt_ids, NEW_TOKENS)
    for slots, engine in engines.items():
        assert (engine.runtime.prefetcher is not None) == (slots < max(engines))  # none where every expert fits
        assert greedy(engine, prompt_ids) == expected, f"cache of {slots} experts"


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_decode_computes_experts_stacked_or_one_by_one_alike(family, tmp_path, monkeypatch):
    """Small experts are stacked into one batched product at decode, large ones computed on
    views of their slots; both give transformers' tokens (here forced both ways)."""
    folder = build_checkpoint(family, tmp_path / family, num_layers=NUM_LAYERS)
    calls = []
    original = offloaded_experts.OffloadedExperts._experts

    def counting(self, x, params):
        calls.append(x.shape[0])  # experts computed together
        return original(self, x, params)

    monkeypatch.setattr(offloaded_experts.OffloadedExperts, "_experts", counting)
    tokens = {}
    for name, limit in (("stacked", 1 << 30), ("one by one", 0)):
        monkeypatch.setitem(offloaded_experts.STACK_MAX_BYTES, "cpu", limit)
        engine = Engine.load(EngineConfig(model=str(folder), device="cpu", policy="lru"))
        prompt_ids = engine.encode(PROMPT)
        calls.clear()
        tokens[name] = greedy(engine, prompt_ids)
        decode_calls = calls[-engine.runtime.num_layers :]  # the last decode step
        assert set(decode_calls) == ({engine.runtime.top_k} if name == "stacked" else {1}), name
    assert tokens["stacked"] == tokens["one by one"] == reference_greedy(folder, prompt_ids, NEW_TOKENS)


def test_one_host_sync_per_moe_layer_at_decode(tmp_path, monkeypatch):
    """A decode step reads the routing once per MoE layer and never per expert: no `tolist`,
    `item` or `nonzero` in the expert computation; the prefetcher's look-ahead guess for the
    next layer is read in the same sync."""
    folder = build_checkpoint("qwen3_moe", tmp_path / "m", num_layers=NUM_LAYERS)
    engine = Engine.load(
        EngineConfig(model=str(folder), device="cpu", policy="lru", prefetch=True, expert_cache_experts=4)
    )  # a cache that holds every expert has no prefetcher
    prompt_ids = engine.encode(PROMPT)
    engine.runtime.prefetcher.close()  # its thread reads nothing from the device, but keep the count exact
    engine.runtime.prefetcher.cost = None  # guess whatever reads cost on this machine
    syncs = []
    for name in ("tolist", "item", "nonzero"):
        original = getattr(torch.Tensor, name)
        monkeypatch.setattr(torch.Tensor, name, lambda self, *a, _o=original, _n=name, **k: (syncs.append(_n), _o(self, *a, **k))[1])
    first, second = engine.loaded.offloaded[:2]
    hidden = torch.randn(1, 32)
    top_k_index = torch.tensor([[3, 5]])
    syncs.clear()
    engine.runtime.phase = "decode"
    predicted_before = engine.runtime.prefetcher.lookahead_predicted
    with torch.inference_mode():
        first.forward(hidden, top_k_index, torch.tensor([[0.6, 0.4]]))
        second.forward(hidden, top_k_index, torch.tensor([[0.6, 0.4]]))  # scores the look-ahead guess
    assert syncs == ["tolist", "tolist"]
    assert engine.runtime.prefetcher.lookahead_predicted > predicted_before
    assert prompt_ids  # the engine was usable before the patch


def test_zero_experts_are_neither_loaded_nor_recorded(tmp_path):
    """LongCat-Flash's router may pick "zero" experts, which add the token's input outside the experts and
    reach the experts module as a real expert with weight 0: the engine leaves those routes out, so the
    prompt's recorded routing is the block's real experts only, and fewer than k per token."""
    folder = build_checkpoint("longcat_flash", tmp_path / "longcat", num_layers=NUM_LAYERS, top_k=4)
    trace = tmp_path / "trace.jsonl"
    engine = Engine.load(EngineConfig(model=str(folder), device="cpu", policy="lru", expert_cache_experts=2,
                                      record_trace=str(trace)))
    prompt_ids = engine.encode(PROMPT)
    assert greedy(engine, prompt_ids) == reference_greedy(folder, prompt_ids, NEW_TOKENS)
    engine.close()

    model = load_reference(folder)
    real: list[list[list[int]]] = []  # [layer][token] the experts with a weight
    hooks = [layer.experts.register_forward_pre_hook(
        lambda _m, args, r=real: r.append([[e for e, w in zip(ids, ws) if w != 0]
                                           for ids, ws in zip(args[1].tolist(), args[2].tolist())]))
        for layer in find_moe_layers(model)]
    with torch.no_grad():
        model(torch.tensor([prompt_ids]))
    for hook in hooks:
        hook.remove()
    _, (request,) = load_trace(trace)
    recorded = [[[int(e) for e in ids if e >= 0] for ids in token] for token in request.prefill]  # [token][layer]
    assert recorded == [list(by_token) for by_token in zip(*real)]
    routes = sum(len(ids) for token in recorded for ids in token)
    assert 0 < routes < len(prompt_ids) * len(real) * 4  # some routes went to zero experts
