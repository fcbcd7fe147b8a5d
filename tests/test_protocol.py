"""Wire requests to SamplingParams: the model's defaults fill only what a request leaves out."""

from server.protocol import ChatCompletionRequest, CompletionRequest

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
