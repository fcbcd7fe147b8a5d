"""Embedding requests (`GenerationRequest.pooling`): the pooled last hidden states against transformers' own
base model over the same input, for every family, whole, fed in chunks, and several inputs in one padded pass."""

from __future__ import annotations

import pytest
import torch

from engine import prompt_logprobs as scoring
from engine.api import (
    EMBEDDING_BATCH_TOKENS,
    ContextLengthError,
    GenerationRequest,
    InvalidRequestError,
    SamplingParams,
    embedding_batches,
)
from engine.config import EngineConfig
from engine.engine import Engine
from tests.fixtures.models import FAMILIES, build_checkpoint, load_reference

# the same float32 arithmetic over the same weights in another order (offloaded experts, a quarter of them
# cached): hidden states of magnitude ~1 agree to ~1e-6; a wrong position or pooling is off by whole units
TOLERANCE = 1e-4
TEXT = "The quick brown fox jumps over the lazy dog, and then it runs far away into the green forest."


# and two whose experts the engine reaches otherwise: Ergo's through its class's own forward (a row per route),
# LongCat-Flash's with routes to no expert
@pytest.fixture(scope="module", params=[*FAMILIES, "ergo", "longcat_flash"])
def family_engine(request, tmp_path_factory):
    folder = build_checkpoint(request.param, tmp_path_factory.mktemp(request.param), num_layers=2)
    engine = Engine.load(EngineConfig(model=str(folder), device="cpu", policy="lru", expert_cache_experts=4))
    return engine, load_reference(folder)


def embed(engine: Engine, prompt: list[int], pooling: str = "mean"):
    (event,) = engine.generate(GenerationRequest("e", prompt, pooling=pooling))
    return event


def reference_states(model, prompt: list[int]) -> torch.Tensor:
    """[T, H]: transformers' last hidden states (after the final norm) over the whole prompt."""
    with torch.no_grad():
        return model.base_model(input_ids=torch.tensor([prompt])).last_hidden_state[0].float()


def test_mean_and_last_pooling_match_transformers(family_engine):
    engine, model = family_engine
    prompt = engine.encode(TEXT)
    states = reference_states(model, prompt)
    mean, last = embed(engine, prompt, "mean"), embed(engine, prompt, "last")
    assert len(mean.embeddings[0]) == engine.hidden_size == states.shape[1]
    torch.testing.assert_close(torch.tensor(mean.embeddings[0]), states.mean(0), atol=TOLERANCE, rtol=0)
    torch.testing.assert_close(torch.tensor(last.embeddings[0]), states[-1], atol=TOLERANCE, rtol=0)
    assert not torch.allclose(states.mean(0), states[-1], atol=TOLERANCE)  # the two poolings differ here
    assert mean.finish_reason == "stop" and mean.token_ids == () and mean.text == ""
    assert (mean.usage.prompt_tokens, mean.usage.completion_tokens) == (len(prompt), 0)


def test_a_prompt_fed_in_chunks_pools_the_same(family_engine, monkeypatch):
    engine, model = family_engine
    prompt = engine.encode(TEXT * 2)
    states = reference_states(model, prompt)
    monkeypatch.setattr(scoring, "SCORING_CHUNK", 7)  # several chunks and a short last one
    assert len(prompt) % 7 != 0 and len(prompt) > 14
    torch.testing.assert_close(torch.tensor(embed(engine, prompt, "mean").embeddings[0]), states.mean(0),
                               atol=TOLERANCE, rtol=0)
    torch.testing.assert_close(torch.tensor(embed(engine, prompt, "last").embeddings[0]), states[-1],
                               atol=TOLERANCE, rtol=0)


def test_generation_after_an_embedding_is_unchanged(family_engine):
    """An embedding keeps no prefix and leaves no state: the next completion is the same as before it."""
    engine, _ = family_engine
    prompt = engine.encode(TEXT)
    greedy = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
    before = [e.token_ids for e in engine.generate(GenerationRequest("a", prompt, greedy))]
    embed(engine, prompt)
    after = [e.token_ids for e in engine.generate(GenerationRequest("b", prompt, greedy))]
    assert after == before


def test_an_input_as_long_as_the_context_fits_and_a_longer_one_is_refused(family_engine):
    engine, _ = family_engine
    prompt = (engine.encode(TEXT) * 1000)[: engine.max_model_len]
    engine.validate(GenerationRequest("ok", prompt, pooling="mean"))  # no room for a sampled token needed
    with pytest.raises(ContextLengthError):
        engine.validate(GenerationRequest("long", prompt + prompt[:1], pooling="mean"))


def test_an_unknown_pooling_is_refused(family_engine):
    engine, _ = family_engine
    with pytest.raises(InvalidRequestError) as e:
        engine.validate(GenerationRequest("x", engine.encode(TEXT), pooling="max"))
    assert e.value.param == "pooling"


@pytest.mark.parametrize("pooling", ["mean", "last"])
def test_several_inputs_in_one_pass_pool_each_as_alone(family_engine, pooling):
    """Inputs of different lengths padded into one batch: each vector is its input's own, in order."""
    engine, model = family_engine
    texts = [TEXT, "Hello.", TEXT[:40], "A short one, then " + TEXT]
    inputs = [engine.encode(text) for text in texts]
    assert len({len(ids) for ids in inputs}) == len(inputs)  # every row but the longest is padded
    (event,) = engine.generate(GenerationRequest("b", inputs[0], pooling=pooling, more_inputs=tuple(inputs[1:])))
    assert len(event.embeddings) == len(inputs)
    for ids, vector in zip(inputs, event.embeddings, strict=True):
        states = reference_states(model, ids)
        expected = states.mean(0) if pooling == "mean" else states[-1]
        torch.testing.assert_close(torch.tensor(vector), expected, atol=TOLERANCE, rtol=0)
    assert event.usage.prompt_tokens == sum(map(len, inputs))


def test_the_pads_of_a_batch_are_not_routed(family_engine, monkeypatch):
    """A pad's output is dropped: the offloaded experts neither load, compute nor record it."""
    engine, _ = family_engine
    inputs = [engine.encode(TEXT), engine.encode("Hello.")]
    routed_tokens = []
    on_routing = engine.runtime.on_routing

    def counting(layer, top_k_index, hidden=None):
        routed_tokens.append(top_k_index.shape[0])
        return on_routing(layer, top_k_index, hidden)

    monkeypatch.setattr(engine.runtime, "on_routing", counting)
    list(engine.generate(GenerationRequest("b", inputs[0], pooling="mean", more_inputs=(inputs[1],))))
    assert len(routed_tokens) == engine.runtime.num_layers
    assert set(routed_tokens) == {sum(map(len, inputs))}  # not 2 × the longer input
    assert engine.runtime.live_tokens is None


def test_each_input_of_a_batch_is_validated(family_engine):
    engine, _ = family_engine
    ids = engine.encode(TEXT)
    with pytest.raises(InvalidRequestError) as e:
        engine.validate(GenerationRequest("x", ids, pooling="mean", more_inputs=([engine.vocab_size],)))
    assert e.value.param == "prompt"
    with pytest.raises(InvalidRequestError):
        engine.validate(GenerationRequest("x", ids, pooling="mean", more_inputs=([],)))
    with pytest.raises(ContextLengthError):
        engine.validate(GenerationRequest("x", ids, pooling="mean", more_inputs=(ids * engine.max_model_len,)))


def test_embedding_batches_group_by_length_within_the_budget():
    lengths = [300, 5, EMBEDDING_BATCH_TOKENS + 1, 7, 290, 6, 1000]
    batches = embedding_batches(lengths)
    assert sorted(i for batch in batches for i in batch) == list(range(len(lengths)))  # each input once
    for batch in batches:
        longest = max(lengths[i] for i in batch)
        assert len(batch) == 1 or len(batch) * longest <= EMBEDDING_BATCH_TOKENS
    assert batches == [[1, 5, 3, 4, 0], [6], [2]]  # by length; 1000 × 2 is over the budget; the longest alone
    assert embedding_batches([10] * 1000) == [list(range(i, i + 204)) for i in range(0, 816, 204)] + [
        list(range(816, 1000))]
