"""Wire requests to SamplingParams: the model's defaults fill only what a request leaves out."""

import json
from dataclasses import replace

import pytest

from engine.api import GenerationRequest, InvalidRequestError, SamplingParams
from server import protocol as p
from server.protocol import MAX_N, ChatCompletionRequest, CompletionRequest
from server.serving import batch_requests, choice_requests, event_data

CHAT = [{"role": "user", "content": "hi"}]
MODEL_DEFAULTS = {"temperature": 0.2, "top_p": 0.5, "repetition_penalty": 1.1}


def test_model_defaults_fill_omitted_fields_and_the_request_wins():
    params = ChatCompletionRequest(messages=CHAT, top_p=0.9).to_sampling_params(MODEL_DEFAULTS)
    assert (params.temperature, params.top_p, params.repetition_penalty) == (0.2, 0.9, 1.1)
    assert params.max_tokens is None  # the engine caps it by the model's max_new_tokens and the context


def test_without_model_defaults_the_openai_defaults_hold():
    params = ChatCompletionRequest(messages=CHAT).to_sampling_params()
    assert (params.temperature, params.top_p) == (1.0, 1.0)
    assert CompletionRequest(prompt="hi").to_sampling_params(MODEL_DEFAULTS).max_tokens == 16  # OpenAI's default


@pytest.mark.parametrize("n, ok", [(None, True), (1, True), (MAX_N, True), (0, False), (MAX_N + 1, False)])
def test_n_is_between_1_and_the_cap(n, ok):
    request = ChatCompletionRequest(messages=CHAT, n=n)
    if ok:
        request.to_sampling_params()
        assert request.num_choices == (n or 1)
    else:
        with pytest.raises(InvalidRequestError) as e:
            request.to_sampling_params()
        assert e.value.param == "n"


def test_choice_i_samples_with_seed_plus_i_wrapped_into_the_seed_range():
    request = GenerationRequest("cmpl-1", [1, 2], SamplingParams(seed=2**64 - 2, temperature=1.0))
    choices = choice_requests(request, 3)
    assert choices[0] is request  # n=1 is the request as sent
    assert [c.params.seed for c in choices] == [2**64 - 2, 2**64 - 1, 0]  # torch reads seeds modulo 2**64
    assert len({c.request_id for c in choices}) == 3
    assert all(c.params.temperature == 1.0 and c.prompt_token_ids == [1, 2] for c in choices)
    assert [c.params.seed for c in choice_requests(replace(request, params=SamplingParams()), 2)] == [None, None]


def test_a_batch_s_choices_are_each_prompt_s_in_turn_with_ids_of_their_own():
    params = SamplingParams(seed=5, temperature=1.0)
    prompts = [GenerationRequest("cmpl-1", [1], params), GenerationRequest("cmpl-1", [2], params)]
    choices = batch_requests(prompts, 2)
    assert choices[0] is prompts[0]  # a lone prompt is unchanged
    assert [(c.prompt_token_ids, c.params.seed) for c in choices] == [([1], 5), ([1], 6), ([2], 5), ([2], 6)]
    assert len({c.request_id for c in choices}) == 4


def test_a_stream_event_s_data_is_one_line_for_any_line_splitter():
    """U+2028, U+2029 and U+0085 are raw in JSON, but `str.splitlines` (httpx's `iter_lines`) breaks
    lines there: a token holding one would cut its `data:` line in two."""
    text = "a\u2028b\u2029c\x85d\x0be\x1cf\r\ng"
    chunk = p.ChatCompletionStreamResponse(id="x", model="m", choices=[
        p.ChatCompletionStreamChoice(index=0, delta=p.DeltaMessage(content=text))])
    data = event_data(chunk)
    assert len(data.splitlines()) == 1
    assert json.loads(data)["choices"][0]["delta"]["content"] == text
