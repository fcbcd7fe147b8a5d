"""A later prompt that starts like an earlier request (a chat's next turn, a regenerated answer)
reuses that request's KV cache: the same greedy tokens as transformers, only the new part computed,
and the kept caches bounded by one context's worth of tokens."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

from engine.api import GenerationRequest, SamplingParams
from engine.config import EngineConfig
from engine.engine import Engine
from engine.prefix_cache import MIN_REUSE_TOKENS, HostTier, PrefixCache, kv_bytes
from tests.fixtures.models import FAMILIES, build_checkpoint, reference_greedy

NEW_TOKENS = 10


def kv_of(tokens: list[int], layers: int = 2, window: int | None = None) -> DynamicCache:
    """A cache whose keys at position t hold t, so a cut or a copy can be read back; `window`: its
    second layer keeps a sliding window of that many tokens."""
    kv = DynamicCache()
    if window is not None:
        kv.layers = [DynamicLayer(), DynamicSlidingWindowLayer(sliding_window=window)]
    positions = torch.tensor(tokens, dtype=torch.float32)[None, None, :, None].expand(1, 2, -1, 4)  # [B, heads, T, D]
    for layer in range(layers):
        kv.update(positions.clone(), -positions.clone(), layer)
    return kv


def held(kv: DynamicCache) -> list[int]:
    return kv.layers[0].keys[0, 0, :, 0].int().tolist()


CONVERSATION = list(range(100, 160))  # 60 tokens: a turn's prompt and answer


def test_a_next_turn_moves_the_entry_out_cut_to_the_shared_prefix():
    cache = PrefixCache(max_entries=4, budget_tokens=10_000)
    cache.put(CONVERSATION, kv_of(CONVERSATION))
    next_turn = CONVERSATION[:55] + [1, 2, 3]  # the answer re-tokenized differently from token 55
    kv, reused = cache.take(next_turn)
    assert reused == 55
    assert held(kv) == CONVERSATION[:55]
    assert len(cache) == 0  # the running request owns it now


def test_the_prompt_s_last_token_is_always_computed():
    cache = PrefixCache(max_entries=4, budget_tokens=10_000)
    cache.put(CONVERSATION, kv_of(CONVERSATION))
    kv, reused = cache.take(CONVERSATION)  # the same prompt again: its logits are still needed
    assert reused == len(CONVERSATION) - 1
    assert kv.get_seq_length() == reused


@pytest.mark.parametrize("rest", [list(range(1000, 1060)), [1, 2, 3]], ids=["long", "short"])
def test_a_short_shared_part_is_copied_and_the_conversation_stays(rest):
    """A chat UI's background request (a title) shares the system prompt: 20 of the conversation's 60
    tokens, however much of its own prompt that is."""
    cache = PrefixCache(max_entries=4, budget_tokens=10_000)
    cache.put(CONVERSATION, kv_of(CONVERSATION))
    kv, reused = cache.take(CONVERSATION[:20] + rest)
    assert reused == 20
    assert held(kv) == CONVERSATION[:20]
    kv.update(torch.zeros(1, 2, 3, 4), torch.zeros(1, 2, 3, 4), 0)  # the copy grows on its own
    assert len(cache) == 1
    kv_again, reused_again = cache.take(CONVERSATION + [7])
    assert reused_again == len(CONVERSATION)
    assert held(kv_again) == CONVERSATION


def test_too_short_a_match_is_not_reused():
    cache = PrefixCache(max_entries=4, budget_tokens=10_000)
    cache.put(CONVERSATION, kv_of(CONVERSATION))
    assert cache.take(CONVERSATION[: MIN_REUSE_TOKENS - 1] + [1, 2]) == (None, 0)
    assert cache.take([5] + CONVERSATION) == (None, 0)
    assert len(cache) == 1


def test_the_longest_match_wins_and_an_entry_inside_another_goes():
    cache = PrefixCache(max_entries=4, budget_tokens=10_000)
    other = list(range(500, 540))
    cache.put(other, kv_of(other))
    cache.put(CONVERSATION[:30], kv_of(CONVERSATION[:30]))
    cache.put(CONVERSATION, kv_of(CONVERSATION))  # holds the 30-token one: that one goes
    assert len(cache) == 2
    kv, reused = cache.take(CONVERSATION + [1])
    assert reused == len(CONVERSATION)


def test_an_entry_copied_from_counts_as_used():
    cache = PrefixCache(max_entries=2, budget_tokens=10_000)
    other = list(range(500, 540))
    cache.put(CONVERSATION, kv_of(CONVERSATION))
    cache.put(other, kv_of(other))
    cache.take(CONVERSATION[:20] + [1] * 30)  # a copy of the conversation's head: the conversation was used
    newest = list(range(900, 940))
    cache.put(newest, kv_of(newest))  # one entry must go: the one not used since it came
    assert cache.take(other + [1]) == (None, 0)
    assert cache.take(CONVERSATION + [1])[1] == len(CONVERSATION)


def test_entries_are_dropped_least_recently_used_first_by_count_and_by_budget():
    cache = PrefixCache(max_entries=2, budget_tokens=100)
    prompts = [list(range(1000 * i, 1000 * i + 40)) for i in range(1, 4)]
    for prompt in prompts:
        cache.put(prompt, kv_of(prompt))
    assert len(cache) == 2 and cache.take(prompts[0] + [1]) == (None, 0)  # the oldest went
    cache.make_room(running_tokens=50)  # 80 kept + 50 running > 100: the older of the two goes
    assert len(cache) == 1 and cache.take(prompts[1] + [1]) == (None, 0)
    assert cache.take(prompts[2] + [1])[1] == 40


def test_a_sliding_window_past_its_size_serves_only_its_whole_length():
    """Its oldest tokens are gone: a chat's next turn, which continues the whole kept conversation,
    reuses it; a prompt that shares only a part of it cannot."""
    cache = PrefixCache(max_entries=4, budget_tokens=10_000)
    cache.put(CONVERSATION, kv_of(CONVERSATION, window=8))
    assert cache.take(CONVERSATION[:50] + [1, 2, 3]) == (None, 0)
    kv, reused = cache.take(CONVERSATION + [1, 2, 3])
    assert reused == len(CONVERSATION)
    assert kv.get_seq_length() == len(CONVERSATION)


def test_a_sliding_window_within_its_size_is_cut_and_copied_like_full_attention():
    cache = PrefixCache(max_entries=4, budget_tokens=10_000)
    cache.put(CONVERSATION, kv_of(CONVERSATION, window=100))
    kv, reused = cache.take(CONVERSATION[:20] + list(range(1000, 1060)))  # copied
    assert reused == 20
    assert [layer.get_seq_length() for layer in kv.layers] == [20, 20]
    assert kv.layers[1].keys[0, 0, :, 0].int().tolist() == CONVERSATION[:20]
    kv, reused = cache.take(CONVERSATION[:50] + [1])  # cut
    assert reused == 50
    assert [layer.get_seq_length() for layer in kv.layers] == [50, 50]


def test_a_cache_that_does_not_hold_exactly_the_given_tokens_is_not_kept():
    cache = PrefixCache(max_entries=4, budget_tokens=10_000)
    kv = kv_of(CONVERSATION)
    cache.put(CONVERSATION[:-1], kv)  # does not say what the cache holds
    cache.put(CONVERSATION, None)
    assert len(cache) == 0


# -- the host tier ---------------------------------------------------------------------------------
class TaggingHostTier(HostTier):
    """Stands for another device: tensors "on the host" are float64, so a kept cache used while still
    there would show (the engine computes in float32); both directions are counted."""

    def __init__(self, capacity_bytes: int) -> None:
        super().__init__(capacity_bytes, torch.device("cpu"))
        self.moves = {"to_host": 0, "to_device": 0}

    def to_host(self, kv) -> None:
        self.moves["to_host"] += 1
        self._move(kv, lambda tensor: tensor.to(torch.float64))

    def to_device(self, kv) -> None:
        self.moves["to_device"] += 1
        self._move(kv, lambda tensor: tensor.to(torch.float32))


def on_device(kv: DynamicCache) -> bool:
    return all(layer.keys.dtype == torch.float32 and layer.values.dtype == torch.float32 for layer in kv.layers)


def test_an_entry_off_the_device_budget_moves_to_the_host_and_comes_back_for_its_next_turn():
    host = TaggingHostTier(capacity_bytes=10**6)
    cache = PrefixCache(max_entries=4, budget_tokens=100, host=host)
    cache.put(CONVERSATION, kv_of(CONVERSATION))
    cache.make_room(running_tokens=70)  # a background request: 60 kept + 70 running > 100
    assert cache.held_tokens == 0 and len(cache) == 1 and host.moves == {"to_host": 1, "to_device": 0}
    assert cache.summary() == {"entries_on_device": 0, "tokens_on_device": 0, "entries_in_host_ram": 1,
                               "host_ram_bytes": 2 * kv_bytes(kv_of(CONVERSATION)),  # float64: twice
                               "host_ram_capacity_bytes": 10**6}
    kv, reused = cache.take(CONVERSATION + [1, 2, 3])  # the chat's next turn
    assert reused == len(CONVERSATION) and held(kv) == CONVERSATION and on_device(kv)
    assert len(cache) == 0 and host.moves["to_device"] == 1


def test_a_part_of_a_host_entry_is_copied_to_the_device_and_the_entry_stays_on_the_host():
    host = TaggingHostTier(capacity_bytes=10**6)
    cache = PrefixCache(max_entries=4, budget_tokens=100, host=host)
    cache.put(CONVERSATION, kv_of(CONVERSATION))
    cache.make_room(running_tokens=70)
    kv, reused = cache.take(CONVERSATION[:20] + list(range(1000, 1060)))  # shares only the head: copied
    assert reused == 20 and held(kv) == CONVERSATION[:20] and on_device(kv)
    assert cache.summary()["entries_in_host_ram"] == 1  # still there for the conversation's next turn
    kv, reused = cache.take(CONVERSATION + [1])
    assert reused == len(CONVERSATION) and on_device(kv)


def test_the_host_tier_drops_its_least_recently_used_beyond_its_bytes_and_the_device_count_stays():
    one = kv_bytes(kv_of(CONVERSATION))
    host = HostTier(capacity_bytes=2 * one, device=torch.device("cpu"))  # on the CPU: nothing moves
    cache = PrefixCache(max_entries=1, budget_tokens=10_000, host=host)
    prompts = [list(range(1000 * i, 1000 * i + 60)) for i in range(1, 5)]
    for prompt in prompts:
        cache.put(prompt, kv_of(prompt))  # one on the device: each earlier one moves to the host
    summary = cache.summary()
    assert summary["entries_on_device"] == 1 and summary["entries_in_host_ram"] == 2
    assert summary["host_ram_bytes"] == 2 * one
    assert cache.take(prompts[0] + [1]) == (None, 0)  # the oldest went
    assert [cache.take(prompt + [1])[1] for prompt in prompts[1:]] == [60, 60, 60]


def test_what_the_host_tier_cannot_hold_is_dropped_as_without_it():
    cache = PrefixCache(max_entries=4, budget_tokens=100, host=HostTier(10, torch.device("cpu")))  # too small
    cache.put(CONVERSATION, kv_of(CONVERSATION))
    cache.make_room(running_tokens=70)
    assert len(cache) == 0


def chat_turns(engine: Engine, first_prompt: list[int], background: list[int]):
    """A chat's first turn, a background request long enough to push it off the device, then its next
    turn: the next turn's tokens and usage."""
    answer, _ = greedy(engine, first_prompt)
    greedy(engine, background)
    next_prompt = first_prompt + answer + list(range(50, 70))
    return next_prompt, *greedy(engine, next_prompt)


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
def test_a_chat_survives_a_background_request_the_device_budget_cannot_hold_beside_it(tmp_path, family):
    folder = build_checkpoint(family, tmp_path / family)
    first_prompt, background = list(range(5, 45)), list(range(300, 390))  # 50 + 100 tokens in a context of 128
    with_tier = Engine.load(EngineConfig(model=str(folder), device="cpu", policy="lru", max_model_len=128))
    next_prompt, tokens, usage = chat_turns(with_tier, first_prompt, background)
    assert usage.cached_tokens == len(first_prompt) + NEW_TOKENS - 1
    assert tokens == reference_greedy(folder, next_prompt, NEW_TOKENS)
    assert with_tier.cache_info()["prefix_cache"]["host_ram_capacity_bytes"] > 0
    with_tier.close()
    without = Engine.load(EngineConfig(model=str(folder), device="cpu", policy="lru", max_model_len=128,
                                       prefix_cache_host_gb=0))
    assert chat_turns(without, first_prompt, background)[2].cached_tokens == 0  # dropped: all computed again
    without.close()


# -- through the engine ----------------------------------------------------------------------------
def greedy(engine: Engine, prompt: list[int]):
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
    events = list(engine.generate(GenerationRequest("turn", prompt, params)))
    return [t for e in events for t in e.token_ids], events[-1].usage


WHOLE_ONLY = ("gpt_oss", "qwen3_next")  # a sliding window past its size; a linear-attention state


@pytest.mark.parametrize("family", [*FAMILIES, *WHOLE_ONLY])
def test_a_next_turn_reuses_the_last_one_and_writes_the_tokens_transformers_writes(tmp_path, family):
    folder = build_checkpoint(family, tmp_path / family)
    trace = tmp_path / "trace.jsonl"
    engine = Engine.load(EngineConfig(model=str(folder), device="cpu", policy="lru", record_trace=str(trace)))
    first_prompt = list(range(5, 45))
    answer, usage = greedy(engine, first_prompt)
    assert usage.cached_tokens == 0
    next_prompt = first_prompt + answer + list(range(50, 70))
    tokens, usage = greedy(engine, next_prompt)
    assert tokens == reference_greedy(folder, next_prompt, NEW_TOKENS)
    assert usage.cached_tokens == len(first_prompt) + NEW_TOKENS - 1  # the last answer token was not fed back
    assert engine.cache_counters()["prompt_tokens_cached"] == usage.cached_tokens
    # a prompt sharing only the conversation's head: a copy of it where every position is kept, else nothing
    shared_head = first_prompt[:20] + list(range(200, 240))
    tokens, usage = greedy(engine, shared_head)
    assert tokens == reference_greedy(folder, shared_head, NEW_TOKENS)
    assert usage.cached_tokens == (0 if family in WHOLE_ONLY else 20)
    engine.close()
    second = json.loads(trace.read_text().splitlines()[2])
    assert len(second["prefill"]) == len(next_prompt) - (len(first_prompt) + NEW_TOKENS - 1)  # what was computed


def test_reuse_off_computes_every_prompt_token(tmp_path):
    folder = build_checkpoint("mixtral", tmp_path / "m")
    engine = Engine.load(EngineConfig(model=str(folder), device="cpu", policy="lru", prefix_cache=0))
    prompt = list(range(5, 45))
    greedy(engine, prompt)
    assert greedy(engine, prompt)[1].cached_tokens == 0
    assert engine.prefix_cache is None


def test_an_aborted_request_leaves_what_it_computed_for_the_retry(tmp_path):
    folder = build_checkpoint("qwen3_moe", tmp_path / "q")
    engine = Engine.load(EngineConfig(model=str(folder), device="cpu", policy="lru"))
    prompt = list(range(5, 45))
    steps = iter(range(100))
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
    events = list(engine.generate(GenerationRequest("a", prompt, params), should_abort=lambda: next(steps) >= 3))
    assert events[-1].finish_reason == "abort"
    tokens, usage = greedy(engine, prompt)  # the client retries
    assert usage.cached_tokens == len(prompt) - 1
    assert tokens == reference_greedy(folder, prompt, NEW_TOKENS)
