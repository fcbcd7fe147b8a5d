"""Prompt logprobs (`SamplingParams.prompt_logprobs`, what `echo` with logprobs reads) against transformers'
own forward over the prompt."""

from __future__ import annotations

import pytest
import torch

from engine import prompt_logprobs as scoring
from engine.api import GenerationRequest, InvalidRequestError, SamplingParams
from engine.config import EngineConfig
from engine.engine import Engine
from tests.fixtures.models import build_checkpoint, load_reference

# both run the same float32 arithmetic on CPU over the same weights, in another order (our offloaded experts,
# the cache); logprobs near -10 carry ~1e-6 relative float32 rounding, so 1e-4 absolute leaves a wide margin
# yet catches any wrong position or token (those differ by whole units)
TOLERANCE = 1e-4
TOP = 3
TEXT = "The quick brown fox jumps over the lazy dog, and then it runs far away into the green forest."


@pytest.fixture(scope="module", params=["mixtral", "qwen3_moe"])
def family_engine(request, tmp_path_factory):
    folder = build_checkpoint(request.param, tmp_path_factory.mktemp(request.param), num_layers=2)
    engine = Engine.load(EngineConfig(model=str(folder), device="cpu", policy="lru", expert_cache_experts=4))
    return engine, load_reference(folder)


def generate(engine: Engine, prompt: list[int], **params):
    return list(engine.generate(GenerationRequest("t", prompt, SamplingParams(**params))))


def reference_logprobs(model, prompt: list[int]) -> torch.Tensor:
    """[T, V] log_softmax of transformers' logits over the prompt (row i predicts token i + 1)."""
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([prompt])).logits[0].float(), dim=-1)


def test_prompt_logprobs_match_transformers_with_top_alternatives(family_engine):
    engine, model = family_engine
    prompt = engine.encode(TEXT)
    events = generate(engine, prompt, max_tokens=2, temperature=0, prompt_logprobs=TOP, ignore_eos=True)
    assert_matches_reference(events[0].prompt_logprobs, model, prompt)
    assert all(e.prompt_logprobs is None for e in events[1:])  # only on the first event


def test_generated_tokens_are_unchanged_by_scoring_the_prompt(family_engine):
    engine, _ = family_engine
    prompt = engine.encode(TEXT)
    plain = generate(engine, prompt, max_tokens=6, temperature=0, ignore_eos=True)
    scored = generate(engine, prompt, max_tokens=6, temperature=0, ignore_eos=True, prompt_logprobs=0)
    assert [e.token_ids for e in scored] == [e.token_ids for e in plain]
    assert "".join(e.text for e in scored) == "".join(e.text for e in plain)


def test_max_tokens_one_and_zero(family_engine):
    engine, _ = family_engine
    prompt = engine.encode(TEXT)
    (one,) = generate(engine, prompt, max_tokens=1, temperature=0, ignore_eos=True, prompt_logprobs=1)
    assert one.finish_reason == "length" and len(one.token_ids) == 1
    assert len(one.prompt_logprobs) == len(prompt)
    (zero,) = generate(engine, prompt, max_tokens=0, prompt_logprobs=1)
    assert zero.finish_reason == "length" and zero.token_ids == () and zero.text == ""
    assert (zero.usage.prompt_tokens, zero.usage.completion_tokens) == (len(prompt), 0)
    assert zero.prompt_logprobs == one.prompt_logprobs  # the same prefill


def test_max_tokens_zero_needs_prompt_logprobs():
    with pytest.raises(InvalidRequestError) as e:
        SamplingParams(max_tokens=0)
    assert e.value.param == "max_tokens"
    with pytest.raises(InvalidRequestError):
        SamplingParams(prompt_logprobs=21)


def test_a_kept_prefix_is_not_reused_when_the_prompt_is_scored(family_engine):
    engine, model = family_engine
    prompt = engine.encode(TEXT + " Then it sleeps.")
    generate(engine, prompt[:-2], max_tokens=1, temperature=0)  # kept: a prefix of the prompt
    (again,) = generate(engine, prompt, max_tokens=1, temperature=0)
    assert again.usage.cached_tokens > 0  # a plain request reuses it ...
    (scored,) = generate(engine, prompt, max_tokens=1, temperature=0, prompt_logprobs=0)
    assert scored.usage.cached_tokens == 0  # ... a scored one computes it all, with every position's logprob
    expected = reference_logprobs(model, prompt)
    assert [lp.logprob for lp in scored.prompt_logprobs[1:]] == pytest.approx(
        [expected[i - 1, prompt[i]].item() for i in range(1, len(prompt))], abs=TOLERANCE)
    (after,) = generate(engine, prompt, max_tokens=1, temperature=0)
    assert after.usage.cached_tokens == len(prompt) - 1  # the scored request's KV cache was kept as usual


def test_positions_are_scored_in_chunks(family_engine, monkeypatch):
    engine, model = family_engine
    prompt = engine.encode(TEXT)
    monkeypatch.setattr(scoring, "POSITIONS_PER_CHUNK", 4)  # several chunks and a short last one
    (event,) = generate(engine, prompt, max_tokens=1, temperature=0, prompt_logprobs=2)
    expected = reference_logprobs(model, prompt)
    assert [lp.logprob for lp in event.prompt_logprobs[1:]] == pytest.approx(
        [expected[i - 1, prompt[i]].item() for i in range(1, len(prompt))], abs=TOLERANCE)


def test_echoed_prompt_offsets_point_into_its_text(family_engine):
    engine, _ = family_engine
    prompt = engine.encode(TEXT)
    echo = engine.echoed_prompt(prompt)
    assert echo.text == engine.decode(prompt) and len(echo.tokens) == len(echo.offsets) == len(prompt)
    assert list(echo.offsets) == sorted(echo.offsets) and echo.offsets[-1] < len(echo.text)
    # from the second word on (a BOS is not in the text; SentencePiece drops the first word's space)
    assert all(echo.text.startswith(echo.tokens[i], echo.offsets[i]) for i in range(2, len(prompt)))


CHUNK = 3  # SCORING_CHUNK lowered so that a test prompt spans several chunks


def record_forwards(engine: Engine, monkeypatch) -> list[tuple[int, int]]:
    """(positions fed, logits rows returned) of each model forward from now on."""
    calls: list[tuple[int, int]] = []
    model = engine.model

    def recording(*args, **kwargs):
        out = model(*args, **kwargs)
        calls.append((kwargs["input_ids"].shape[1], out.logits.shape[1]))
        return out

    monkeypatch.setattr(engine, "model", recording)
    return calls


def assert_matches_reference(scored, model, prompt: list[int]) -> None:
    expected = reference_logprobs(model, prompt)
    assert len(scored) == len(prompt) and scored[0] is None
    for i in range(1, len(prompt)):
        assert scored[i].token_id == prompt[i]
        assert scored[i].logprob == pytest.approx(expected[i - 1, prompt[i]].item(), abs=TOLERANCE)
        values, ids = torch.topk(expected[i - 1], TOP)
        assert [t.token_id for t in scored[i].top] == ids.tolist()
        assert [t.logprob for t in scored[i].top] == pytest.approx(values.tolist(), abs=TOLERANCE)


@pytest.mark.parametrize("extra", [0, 1, 2], ids=["multiple", "one-token last chunk", "two-token last chunk"])
def test_prompt_scored_in_chunks_of_positions_matches_transformers(family_engine, monkeypatch, extra):
    engine, model = family_engine
    prompt = engine.encode(TEXT)
    prompt = prompt[: (len(prompt) - 2) // CHUNK * CHUNK + extra]  # a multiple of the chunk, or past it
    assert len(prompt) > 3 * CHUNK and len(prompt) % CHUNK == extra
    plain = generate(engine, prompt, max_tokens=4, temperature=0, ignore_eos=True)
    monkeypatch.setattr(scoring, "SCORING_CHUNK", CHUNK)
    calls = record_forwards(engine, monkeypatch)
    events = generate(engine, prompt, max_tokens=4, temperature=0, ignore_eos=True, prompt_logprobs=TOP)
    chunks = -(-len(prompt) // CHUNK)
    assert [n for n, _ in calls[:chunks]] == [CHUNK] * (len(prompt) // CHUNK) + [extra] * (extra > 0)
    assert_matches_reference(events[0].prompt_logprobs, model, prompt)
    assert [e.token_ids for e in events] == [e.token_ids for e in plain]  # the last chunk's last row, the KV cache


def test_scoring_never_holds_more_than_a_chunk_of_logits(family_engine, monkeypatch):
    engine, _ = family_engine
    prompt = engine.encode(TEXT)
    monkeypatch.setattr(scoring, "SCORING_CHUNK", CHUNK)
    calls = record_forwards(engine, monkeypatch)
    (event,) = generate(engine, prompt, max_tokens=0, prompt_logprobs=1)
    assert len(event.prompt_logprobs) == len(prompt)
    assert len(calls) == -(-len(prompt) // CHUNK)  # every forward a scoring one (max_tokens=0)
    assert sum(n for n, _ in calls) == len(prompt)
    assert all(n <= CHUNK and rows == n for n, rows in calls)  # never the [T, V] logits


@pytest.mark.parametrize("family, forwards", [("qwen3_next", "chunks"), ("minimax", "one after the first")])
def test_scoring_chunks_after_a_linear_attention_prefix_and_not_after_a_family_cache(
    family, forwards, tmp_path, monkeypatch
):
    """Linear-attention layers in transformers' own cache take a multi-token forward after a prefix (a
    chat's next turn does it); MiniMax's own cache class is not known to, so the rest of its prompt goes
    in one forward after the first chunk."""
    folder = build_checkpoint(family, tmp_path / family, num_layers=2)
    engine = Engine.load(EngineConfig(model=str(folder), device="cpu", policy="lru"))
    prompt = engine.encode(TEXT)
    plain = generate(engine, prompt, max_tokens=3, temperature=0, ignore_eos=True)
    monkeypatch.setattr(scoring, "SCORING_CHUNK", CHUNK)
    calls = record_forwards(engine, monkeypatch)
    events = generate(engine, prompt, max_tokens=3, temperature=0, ignore_eos=True, prompt_logprobs=TOP)
    scoring_calls = [n for n, _ in calls[: len(calls) - 2]]  # the last two forwards decode
    if forwards == "chunks":
        assert scoring_calls == [CHUNK] * (len(prompt) // CHUNK) + [len(prompt) % CHUNK] * (len(prompt) % CHUNK > 0)
    else:
        assert scoring_calls == [CHUNK, len(prompt) - CHUNK]
    assert_matches_reference(events[0].prompt_logprobs, load_reference(folder), prompt)
    assert [e.token_ids for e in events] == [e.token_ids for e in plain]
