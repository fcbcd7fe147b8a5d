"""End to end: a real `python -m server` process on a tiny random Mixtral, driven by the openai SDK
and by raw httpx with a hand-written SSE parser."""

from __future__ import annotations

import json
import re
import socket
import threading
import time

import httpx
import openai
import pytest
import torch

from server.testing import RemoteServer, sse_json

MODEL = "tiny-mixtral"
CHAT = [{"role": "user", "content": "Hello, who are you?"}]
ERROR_KEYS = {"message", "type", "param", "code"}
ONE_THREAD = {"OMP_NUM_THREADS": "1"}  # a tiny model on a busy 2-core box: 10x faster than 2 threads
LONG = 490  # tokens: the fixture's context is 512
ACCESSES_PER_TOKEN = 3 * 2  # the fixture: 3 MoE layers, top-2


MODEL_DEFAULTS = {"temperature": 0.0, "max_new_tokens": 40}  # in generation_config.json, as real models set them


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from tests.fixtures.models import build_checkpoint

    folder = build_checkpoint("mixtral", tmp_path_factory.mktemp("tiny-mixtral"))
    config = json.loads((folder / "generation_config.json").read_text())
    (folder / "generation_config.json").write_text(json.dumps({**config, **MODEL_DEFAULTS}))
    return folder


@pytest.fixture(scope="module")
def server(checkpoint, tmp_path_factory):
    state = tmp_path_factory.mktemp("state")
    srv = RemoteServer(["--model", str(checkpoint), "--served-model-name", MODEL, "--device", "cpu",
                        "--eamc-path", str(state / "eamc.json")], env=ONE_THREAD)  # the default policy
    srv.start()
    yield srv
    assert srv.stop() in (0, -15), srv.log()[-3000:]  # SIGTERM: a graceful shutdown (uvicorn re-raises it) ...
    assert "engine shut down" in srv.log()  # ... that closed the engine (which saves its state)


@pytest.fixture(scope="module")
def client(server):
    return server.openai()


@pytest.fixture(scope="module")
def http(server):
    with server.http() as c:
        yield c


@pytest.fixture(scope="module")
def tokenizer(checkpoint):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(checkpoint)


def stream_events(http: httpx.Client, path: str, body: dict) -> list[dict | str]:
    with http.stream("POST", path, json={**body, "stream": True}) as response:
        assert response.status_code == 200, response.read()
        assert response.headers["content-type"].startswith("text/event-stream")
        return list(sse_json(response.iter_lines()))


def metric(http: httpx.Client, name: str) -> float:
    text = http.get("/metrics").text
    match = re.search(rf"^{re.escape(name)} (\S+)$", text, re.MULTILINE)
    assert match, f"{name} not in /metrics"
    return float(match.group(1))


# -- listing and health ---------------------------------------------------------------------
def test_health(http):
    response = http.get("/health")
    assert response.status_code == 200 and response.json() == {"status": "ok"}


def test_models_list_in_openai_shape(client, http):
    assert [m.id for m in client.models.list()] == [MODEL]
    body = http.get("/v1/models").json()
    assert body["object"] == "list"
    (card,) = body["data"]
    assert card["id"] == MODEL and card["object"] == "model" and card["owned_by"] == "moe-serve"
    assert isinstance(card["created"], int)
    assert client.models.retrieve(MODEL).id == MODEL


# -- chat completions -----------------------------------------------------------------------
def test_chat_streamed_text_equals_non_streamed_at_temperature_0(client):
    kwargs = {"model": MODEL, "messages": CHAT, "max_tokens": 12, "temperature": 0}
    full = client.chat.completions.create(**kwargs)
    chunks = list(client.chat.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}))

    assert full.object == "chat.completion" and full.id.startswith("chatcmpl-")
    assert full.system_fingerprint.startswith("fp_moe-serve-") and full.model == MODEL
    assert full.choices[0].message.role == "assistant"
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == full.choices[0].message.content
    assert len({c.id for c in chunks}) == 1 and chunks[0].id.startswith("chatcmpl-")
    assert chunks[0].choices[0].delta.role == "assistant"
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finish == [full.choices[0].finish_reason] == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage == full.usage


def test_omitted_parameters_take_the_model_generation_config(client):
    kwargs = {"model": MODEL, "messages": CHAT, "extra_body": {"ignore_eos": True}}
    a, b = (client.chat.completions.create(**kwargs) for _ in range(2))
    assert a.choices[0].message.content == b.choices[0].message.content  # temperature 0: greedy
    assert a.usage.completion_tokens == MODEL_DEFAULTS["max_new_tokens"]  # not the rest of the context
    assert a.choices[0].finish_reason == "length"
    sampled = client.chat.completions.create(**kwargs, temperature=1.0, seed=1, max_tokens=5)
    assert sampled.usage.completion_tokens == 5  # what the request sets wins


def test_chat_usage_counts(client, tokenizer):
    response = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=5, temperature=0)
    text = tokenizer.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False)
    prompt_tokens = len(tokenizer(text, add_special_tokens=False)["input_ids"])
    assert response.usage.prompt_tokens == prompt_tokens
    assert response.usage.completion_tokens == 5
    assert response.usage.total_tokens == prompt_tokens + 5


def test_stop_string_ends_with_finish_reason_stop(client):
    kwargs = {"model": MODEL, "messages": CHAT, "temperature": 0}
    text = client.chat.completions.create(**kwargs, max_tokens=12).choices[0].message.content
    cut = next(i for i in range(2, len(text) - 2) if text.find(text[i: i + 2]) == i)
    stop = text[cut: cut + 2]
    response = client.chat.completions.create(**kwargs, max_tokens=12, stop=[stop, "never-appears"])
    assert response.choices[0].finish_reason == "stop"
    assert response.choices[0].message.content == text[:cut]
    streamed = list(client.chat.completions.create(**kwargs, max_tokens=12, stop=stop, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in streamed) == text[:cut]
    assert streamed[-1].choices[0].finish_reason == "stop"


def test_eos_ends_with_finish_reason_stop(client, checkpoint):
    eos = json.loads((checkpoint / "generation_config.json").read_text())["eos_token_id"]
    eos = eos[0] if isinstance(eos, list) else eos
    response = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=8, temperature=0,
                                              logit_bias={str(eos): 100})
    assert response.choices[0].finish_reason == "stop"
    assert response.choices[0].message.content == ""
    assert response.usage.completion_tokens == 1


def test_content_parts_mean_the_same_as_a_string(client):
    parts = [{"role": "user", "content": [{"type": "text", "text": "Hello, "}, {"type": "text", "text": "who are you?"}]}]
    kwargs = {"model": MODEL, "max_tokens": 6, "temperature": 0}
    a = client.chat.completions.create(messages=CHAT, **kwargs)
    b = client.chat.completions.create(messages=parts, **kwargs)
    assert a.choices[0].message.content == b.choices[0].message.content


def test_chat_logprobs(client):
    response = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=4, temperature=0,
                                              logprobs=True, top_logprobs=3)
    content = response.choices[0].logprobs.content
    assert len(content) == 4
    # the engine decodes each token alone, so a SentencePiece token loses its leading space
    assert "".join(t.token for t in content).replace(" ", "") == response.choices[0].message.content.replace(" ", "")
    for token in content:
        assert len(token.top_logprobs) == 3 and token.logprob <= 0
        assert token.top_logprobs[0].logprob >= token.top_logprobs[-1].logprob
        assert token.bytes == list(token.token.encode())


def test_seeded_sampling_repeats(client):
    kwargs = {"model": MODEL, "messages": CHAT, "max_tokens": 8, "temperature": 1.0, "top_p": 0.9, "seed": 1234,
              "extra_body": {"top_k": 50, "min_p": 0.01, "repetition_penalty": 1.1}}
    a = client.chat.completions.create(**kwargs).choices[0].message.content
    b = client.chat.completions.create(**kwargs).choices[0].message.content
    assert a == b


# -- completions ----------------------------------------------------------------------------
def test_completion_streamed_text_equals_non_streamed_raw_sse(http):
    body = {"model": MODEL, "prompt": "The capital of France is", "max_tokens": 8, "temperature": 0}
    full = http.post("/v1/completions", json=body).json()
    events = stream_events(http, "/v1/completions", {**body, "stream_options": {"include_usage": True}})

    assert full["object"] == "text_completion" and full["id"].startswith("cmpl-")
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert all(c["object"] == "text_completion" and c["id"] == chunks[0]["id"] for c in chunks)
    text = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
    assert text == full["choices"][0]["text"]
    assert chunks[-2]["choices"][0]["finish_reason"] == full["choices"][0]["finish_reason"] == "length"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == full["usage"]
    assert all("usage" not in c for c in chunks[:-1])


def test_completion_usage_counts(client, tokenizer):
    prompt = "The capital of France is"
    response = client.completions.create(model=MODEL, prompt=prompt, max_tokens=3, temperature=0)
    assert response.usage.prompt_tokens == len(tokenizer(prompt)["input_ids"])
    assert response.usage.completion_tokens == 3
    assert response.choices[0].finish_reason == "length"
    ids = [5, 6, 7, 8, 9]
    assert client.completions.create(model=MODEL, prompt=ids, max_tokens=2).usage.prompt_tokens == len(ids)


def test_completion_default_max_tokens_is_16(client):
    response = client.completions.create(model=MODEL, prompt="Once upon a time", temperature=0,
                                         extra_body={"ignore_eos": True})
    assert response.usage.completion_tokens == 16


def test_completion_logprobs_shape(client):
    response = client.completions.create(model=MODEL, prompt="Hello", max_tokens=3, temperature=0, logprobs=2)
    logprobs = response.choices[0].logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == len(logprobs.top_logprobs) == 3
    assert all(len(top) == 2 for top in logprobs.top_logprobs)
    assert logprobs.text_offset == [0, len(logprobs.tokens[0]), len(logprobs.tokens[0]) + len(logprobs.tokens[1])]


def test_chat_stream_raw_shape(http):
    events = stream_events(http, "/v1/chat/completions", {"model": MODEL, "messages": CHAT, "max_tokens": 3,
                                                          "temperature": 0})
    assert events[-1] == "[DONE]"
    first, *middle, last = events[:-1]
    assert first["object"] == "chat.completion.chunk"
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert all(set(c["choices"][0]["delta"]) == {"content"} for c in middle)
    assert last["choices"][0]["delta"] == {} and last["choices"][0]["finish_reason"] == "length"
    assert all("usage" not in c for c in events[:-1])  # no usage chunk unless asked


# -- n choices ------------------------------------------------------------------------------
SAMPLED = {"max_tokens": 8, "temperature": 1.0, "seed": 7, "ignore_eos": True}


def by_index(chunks: list[dict], text) -> dict[int, str]:
    """Each choice's streamed text, by its index."""
    out: dict[int, str] = {}
    for chunk in chunks:
        for choice in chunk["choices"]:
            out[choice["index"]] = out.get(choice["index"], "") + (text(choice) or "")
    return out


def test_n_seeded_choices_repeat_differ_and_each_is_its_own_seed(http):
    body = {"model": MODEL, "messages": CHAT, "n": 3, **SAMPLED}
    a, b = (http.post("/v1/chat/completions", json=body).json() for _ in range(2))
    texts = [c["message"]["content"] for c in a["choices"]]
    assert [c["index"] for c in a["choices"]] == [0, 1, 2]
    assert texts == [c["message"]["content"] for c in b["choices"]]  # the same request, the same choices
    assert len(set(texts)) > 1  # seed + i: the choices do not share their draws
    for i in (0, 2):  # choice i is what n=1 gives with seed + i (the README's rule)
        single = http.post("/v1/chat/completions", json={**body, "n": 1, "seed": 7 + i}).json()
        assert single["choices"][0]["message"]["content"] == texts[i]
    assert all(c["finish_reason"] == "length" for c in a["choices"])
    usage, one = a["usage"], single["usage"]
    assert usage["prompt_tokens"] == one["prompt_tokens"]  # the prompt counted once, as OpenAI does
    assert usage["completion_tokens"] == 3 * SAMPLED["max_tokens"]
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    assert "completion_tokens_details" not in usage  # no reasoning parser on this model


def test_n_unseeded_choices_are_independent_draws(http):
    body = {"model": MODEL, "messages": CHAT, "n": 3, "max_tokens": 8, "temperature": 1.0, "ignore_eos": True}
    texts = [c["message"]["content"] for c in http.post("/v1/chat/completions", json=body).json()["choices"]]
    assert len(set(texts)) > 1


def test_n_greedy_choices_all_equal_the_n1_answer(client):
    kwargs = {"model": MODEL, "messages": CHAT, "max_tokens": 6, "temperature": 0}
    one = client.chat.completions.create(**kwargs).choices[0].message.content
    both = client.chat.completions.create(**kwargs, n=2)  # the openai SDK parses n choices
    assert [c.index for c in both.choices] == [0, 1]
    assert [c.message.content for c in both.choices] == [one, one]
    assert both.usage.completion_tokens == 2 * 6


def test_n_chat_streamed_per_index_equals_non_streamed(http):
    body = {"model": MODEL, "messages": CHAT, "n": 3, **SAMPLED}
    full = http.post("/v1/chat/completions", json=body).json()
    events = stream_events(http, "/v1/chat/completions", {**body, "stream_options": {"include_usage": True}})
    assert events[-1] == "[DONE]" and events.count("[DONE]") == 1
    chunks = events[:-1]
    assert len({c["id"] for c in chunks}) == 1
    texts = by_index(chunks, lambda choice: choice["delta"].get("content"))
    assert texts == {c["index"]: c["message"]["content"] for c in full["choices"]}
    for index in range(3):
        mine = [c["choices"][0] for c in chunks if c["choices"] and c["choices"][0]["index"] == index]
        assert mine[0]["delta"] == {"role": "assistant", "content": ""}  # each choice opens with its role
        assert sum("role" in c["delta"] for c in mine) == 1
        assert [c["finish_reason"] for c in mine if c["finish_reason"]] == ["length"]  # ... and ends on its own
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == full["usage"]
    assert all("usage" not in c for c in chunks[:-1])


def test_n_completions_streamed_and_not_with_logprobs(http):
    body = {"model": MODEL, "prompt": "The capital of France is", "n": 2, "logprobs": 1, **SAMPLED}
    full = http.post("/v1/completions", json=body).json()
    assert [c["index"] for c in full["choices"]] == [0, 1]
    assert all(len(c["logprobs"]["tokens"]) == SAMPLED["max_tokens"] for c in full["choices"])
    assert full["usage"]["completion_tokens"] == 2 * SAMPLED["max_tokens"]
    events = stream_events(http, "/v1/completions", {**body, "stream_options": {"include_usage": True}})
    assert events[-1] == "[DONE]"
    texts = by_index(events[:-1], lambda choice: choice["text"])
    assert texts == {c["index"]: c["text"] for c in full["choices"]}
    assert events[-2]["usage"] == full["usage"]


def test_n_completions_through_the_openai_sdk(client):
    response = client.completions.create(model=MODEL, prompt="Hello", n=2, max_tokens=3, temperature=0)
    assert [c.index for c in response.choices] == [0, 1]
    assert response.choices[0].text == response.choices[1].text and response.usage.completion_tokens == 6


# -- a batch of prompts on /v1/completions: prompt j's choice i at index j*n + i ---------------
BATCH = ["The capital of France is", "Once upon a time", "def fibonacci(n):"]
GREEDY_BATCH = {"model": MODEL, "max_tokens": 6, "temperature": 0}


def test_a_greedy_batch_equals_its_prompts_sent_one_by_one(http):
    full = http.post("/v1/completions", json={**GREEDY_BATCH, "prompt": BATCH}).json()
    singles = [http.post("/v1/completions", json={**GREEDY_BATCH, "prompt": prompt}).json()["choices"][0]
               for prompt in BATCH]
    assert [c["index"] for c in full["choices"]] == [0, 1, 2]
    assert [(c["text"], c["finish_reason"]) for c in full["choices"]] == [
        (c["text"], c["finish_reason"]) for c in singles]


def test_a_batch_with_n_orders_its_choices_by_prompt_then_choice(http):
    full = http.post("/v1/completions", json={**GREEDY_BATCH, "prompt": BATCH[:2], "n": 2, "seed": 3,
                                              "temperature": 1.0, "ignore_eos": True}).json()
    assert [c["index"] for c in full["choices"]] == list(range(4))
    for j, prompt in enumerate(BATCH[:2]):  # prompt j's choice i is prompt j alone with n=2
        alone = http.post("/v1/completions", json={**GREEDY_BATCH, "prompt": prompt, "n": 2, "seed": 3,
                                                   "temperature": 1.0, "ignore_eos": True}).json()
        assert [c["text"] for c in full["choices"][2 * j:2 * j + 2]] == [c["text"] for c in alone["choices"]]


def test_a_token_id_batch_counts_each_prompt_once(http, tokenizer):
    ids = [tokenizer(prompt)["input_ids"] for prompt in BATCH[:2]]
    body = {**GREEDY_BATCH, "prompt": ids, "n": 3, "ignore_eos": True}
    full = http.post("/v1/completions", json=body).json()
    by_text = http.post("/v1/completions", json={**body, "prompt": BATCH[:2]}).json()
    assert [c["text"] for c in full["choices"]] == [c["text"] for c in by_text["choices"]]
    assert len(full["choices"]) == 6
    usage = full["usage"]
    assert usage["prompt_tokens"] == sum(len(prompt) for prompt in ids)
    assert usage["completion_tokens"] == 6 * GREEDY_BATCH["max_tokens"]
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]


def test_a_streamed_batch_sends_each_choice_with_its_index(http):
    body = {**GREEDY_BATCH, "prompt": BATCH, "n": 2, "stream_options": {"include_usage": True}}
    full = http.post("/v1/completions", json=body).json()
    events = stream_events(http, "/v1/completions", body)
    assert events[-1] == "[DONE]" and events[-2]["usage"] == full["usage"]
    indexes = [c["index"] for chunk in events[:-2] for c in chunk["choices"]]
    assert indexes == sorted(indexes) and set(indexes) == set(range(6))  # in turn, each once
    assert by_index(events[:-2], lambda choice: choice["text"]) == {c["index"]: c["text"] for c in full["choices"]}


def test_a_batch_echoes_each_choice_s_own_prompt(http):
    body = {**GREEDY_BATCH, "prompt": BATCH[:2], "n": 2, "echo": True, "logprobs": 1, "max_tokens": 2}
    choices = http.post("/v1/completions", json=body).json()["choices"]
    assert [c["text"].startswith(BATCH[c["index"] // 2]) for c in choices] == [True] * 4
    streamed = by_index(stream_events(http, "/v1/completions", body)[:-1], lambda choice: choice["text"])
    assert streamed == {c["index"]: c["text"] for c in choices}


def test_a_batch_names_the_prompt_too_long_for_the_context(http):
    response = http.post("/v1/completions", json={**GREEDY_BATCH, "prompt": [[7] * 4, [7] * 600]})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["code"] == "context_length_exceeded" and error["param"] == "prompt"
    assert "prompt[1]" in error["message"]


# -- errors ---------------------------------------------------------------------------------
ERRORS = [
    # name, path, body, status, code, param
    ("messages-not-a-list", "/v1/chat/completions", {"messages": "hi"}, 400, None, "messages"),
    ("messages-missing", "/v1/chat/completions", {"model": MODEL}, 400, None, "messages"),
    ("bad-type", "/v1/chat/completions", {"messages": CHAT, "max_tokens": "many"}, 400, None, "max_tokens"),
    ("bad-content", "/v1/chat/completions", {"messages": [{"role": "user", "content": 5}]}, 400, None,
     "messages[0].content"),
    ("temperature", "/v1/chat/completions", {"messages": CHAT, "temperature": -1}, 400, None, "temperature"),
    ("top-logprobs", "/v1/chat/completions", {"messages": CHAT, "logprobs": True, "top_logprobs": 21}, 400, None,
     "top_logprobs"),
    ("top-logprobs-alone", "/v1/chat/completions", {"messages": CHAT, "top_logprobs": 2}, 400, None, "top_logprobs"),
    ("n=17", "/v1/chat/completions", {"messages": CHAT, "n": 17}, 400, None, "n"),  # MAX_N is 16
    ("n=0", "/v1/chat/completions", {"messages": CHAT, "n": 0, "stream": True}, 400, None, "n"),
    ("n=-1", "/v1/completions", {"prompt": "a", "n": -1}, 400, None, "n"),
    ("best-of", "/v1/completions", {"prompt": "a", "n": 2, "best_of": 3}, 400, None, "best_of"),
    ("tool-choice-required", "/v1/chat/completions",  # the fixture's template cannot take tools
     {"messages": CHAT, "tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "required"},
     400, None, "tool_choice"),
    ("legacy-functions", "/v1/chat/completions", {"messages": CHAT, "functions": [{"name": "f"}]}, 400, None,
     "functions"),
    ("response-format", "/v1/chat/completions", {"messages": CHAT, "response_format": {"type": "xml"}}, 400,
     None, "response_format"),
    ("response-format-no-schema", "/v1/chat/completions",
     {"messages": CHAT, "response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, 400, None,
     "response_format.json_schema.schema"),
    ("chat-template", "/v1/chat/completions", {"messages": CHAT, "chat_template": "{{ x }}"}, 400, None,
     "chat_template"),
    ("image-part", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, 400, None,
     "messages[0].content"),
    ("logit-bias-vocab", "/v1/chat/completions", {"messages": CHAT, "logit_bias": {"99999999": 5}}, 400, None,
     "logit_bias"),
    ("unknown-model", "/v1/chat/completions", {"model": "gpt-4", "messages": CHAT}, 404, "model_not_found", "model"),
    ("context-overflow", "/v1/chat/completions", {"messages": CHAT, "max_tokens": 100000}, 400,
     "context_length_exceeded", "messages"),
    ("prompt-overflow", "/v1/completions", {"prompt": [7] * 600, "max_tokens": 1}, 400, "context_length_exceeded",
     "prompt"),
    ("empty-batch", "/v1/completions", {"prompt": []}, 400, None, "prompt"),
    ("batch-of-65", "/v1/completions", {"prompt": ["a"] * 65}, 400, None, "prompt"),  # MAX_BATCH is 64
    ("batch-with-suffix", "/v1/completions", {"prompt": ["a", "b"], "suffix": "c"}, 400, None, "suffix"),
    ("echo-with-suffix", "/v1/completions", {"prompt": "a", "echo": True, "suffix": "b"}, 400, None, "echo"),
    # the prompt is echoed before generation validates it: a bad id was a 500 (found by schemathesis)
    ("echo-bad-token-id", "/v1/completions", {"prompt": [[-1]], "echo": True}, 400, None, "prompt"),
    ("echo-token-id-past-vocab", "/v1/completions", {"prompt": [5, 10**9], "echo": True}, 400, None, "prompt"),
    ("suffix-no-fim-tokens", "/v1/completions", {"prompt": "def f(", "suffix": "):"}, 400, None, "suffix"),
    ("suffix-token-prompt", "/v1/completions", {"prompt": [1, 2], "suffix": ""}, 400, None, "suffix"),
    # every field's type and range is checked before the engine sees it (these were 500s or nonsense)
    *[(f"surrogate-{name}", path, body, 400, None, param) for name, path, body, param in [
        ("content", "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi \ud800 there"}]},
         "messages[0].content"),
        ("part", "/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "text",
                                                                                     "text": "\udfff"}]}]},
         "messages[0].content[0].text"),
        ("name", "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi", "name": "\ud800"}]},
         "messages[0].name"),
        ("prompt", "/v1/completions", {"prompt": "hi \ud800 there"}, "prompt"),
        ("stop", "/v1/completions", {"prompt": "hi", "stop": ["ok", "\ud800"]}, "stop[1]"),
        ("model", "/v1/completions", {"model": "\ud800", "prompt": "hi"}, "model"),
        ("key", "/v1/completions", {"prompt": "hi", "logit_bias": {"\ud800": 1}}, "logit_bias"),  # not quoted
    ]],
    *[(f"{param}={value}", "/v1/completions", {"prompt": "hi", "stream": stream, param: value}, 400, None, param)
      for param, value, stream in [
          ("seed", 2**64, False), ("seed", 2**64, True), ("seed", -(2**63) - 1, False),
          ("temperature", float("inf"), False), ("temperature", float("nan"), True),
          ("top_p", 0, False), ("top_p", 1.5, False), ("top_k", -2, False), ("min_p", 2, False),
          ("presence_penalty", 3, False), ("frequency_penalty", -3, False),
          ("repetition_penalty", 0, False), ("repetition_penalty", float("inf"), False),
          ("max_tokens", 0, False), ("max_tokens", 2.5, False), ("logprobs", 30, False), ("logprobs", -1, False),
          ("logit_bias", {"5": 101}, False), ("logit_bias", {"5": float("nan")}, False),
          ("logit_bias", {"five": 1}, False), ("stop", 5, False), ("n", 0, False), ("n", 17, True),
          ("stream", "maybe", False),
      ]],
    ("max-completion-tokens", "/v1/chat/completions", {"messages": CHAT, "max_completion_tokens": 0}, 400, None,
     "max_completion_tokens"),
    ("top-logprobs-negative", "/v1/chat/completions", {"messages": CHAT, "logprobs": True, "top_logprobs": -1},
     400, None, "top_logprobs"),
    ("message-not-an-object", "/v1/chat/completions", {"messages": ["hi"]}, 400, None, "messages[0]"),
    ("body-not-an-object", "/v1/completions", ["hi"], 400, None, None),
]


@pytest.mark.parametrize("path, body, status, code, param", [e[1:] for e in ERRORS], ids=[e[0] for e in ERRORS])
def test_error_table(http, path, body, status, code, param):
    # json.dumps, not httpx's json=: it sends a lone surrogate as an escape (and NaN), as clients may
    response = http.post(path, content=json.dumps(body), headers={"content-type": "application/json"})
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(response.json()) == {"error"} and set(error) == ERROR_KEYS
    assert error["type"] == "invalid_request_error" and error["message"]
    assert error["code"] == code and error["param"] == param


def test_malformed_json_is_400(http):
    response = http.post("/v1/chat/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert response.status_code == 400 and set(response.json()["error"]) == ERROR_KEYS
    assert response.json()["error"]["param"] is None  # not the character position "[1]"


def test_sdk_raises_typed_errors(client):
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="gpt-4", messages=CHAT)
    assert e.value.code == "model_not_found"
    with pytest.raises(openai.BadRequestError, match="cannot call tools"):
        client.chat.completions.create(model=MODEL, messages=CHAT, tool_choice="required",
                                       tools=[{"type": "function", "function": {"name": "f"}}])


MAX_REQUEST_BYTES = 4 * 2**20  # the default --max-request-bytes


def words(n_bytes: int) -> bytes:
    return json.dumps({"prompt": "word " * (n_bytes // 5), "max_tokens": 1}).encode()


def chunks(body: bytes, size: int = 2**16):
    yield from (body[i: i + size] for i in range(0, len(body), size))


@pytest.mark.parametrize("chunked", [False, True], ids=["content-length", "chunked"])
def test_oversize_body_is_413_before_it_is_read(http, chunked):
    body = words(3 * MAX_REQUEST_BYTES)
    start = time.perf_counter()
    response = http.post("/v1/completions", content=chunks(body) if chunked else body,
                         headers={"content-type": "application/json"})
    assert response.status_code == 413, response.text[:300]
    error = response.json()["error"]
    assert set(error) == ERROR_KEYS and error["code"] == "request_too_large"
    assert time.perf_counter() - start < 2  # tokenizing the text took 20 s


def test_health_answers_while_a_large_body_is_tokenized(server, http):
    body = words(MAX_REQUEST_BYTES - 1000)  # ~800k tokens: seconds of tokenizer work, then refused
    done: dict[str, float] = {}

    def post() -> None:
        with server.http() as other:
            status = other.post("/v1/completions", content=body, headers={"content-type": "application/json"})
        assert status.status_code == 400
        done["post"] = time.perf_counter()

    thread = threading.Thread(target=post)
    thread.start()
    time.sleep(0.5)  # the body is in; the tokenizer is busy
    start = time.perf_counter()
    assert http.get("/health").status_code == 200
    done["health"] = time.perf_counter()
    thread.join()
    assert done["health"] - start < 1.0
    assert done["health"] < done["post"]  # answered while the big request was still being prepared


def test_a_running_stream_is_not_held_up_by_another_prompt_being_tokenized(server, http):
    done: dict[str, float] = {}

    def big() -> None:
        with server.http() as other:
            other.post("/v1/completions", content=words(MAX_REQUEST_BYTES - 1000),
                       headers={"content-type": "application/json"})
        done["big"] = time.perf_counter()

    thread = threading.Thread(target=big)
    thread.start()
    time.sleep(0.5)  # the tokenizer is busy with the big prompt
    events = stream_events(http, "/v1/completions", {"prompt": [1, 2, 3], "max_tokens": 30, "ignore_eos": True})
    done["stream"] = time.perf_counter()
    thread.join()
    assert events[-1] == "[DONE]"
    assert done["stream"] < done["big"]  # decoding its tokens did not wait for that tokenizer


def test_unknown_route_is_404_in_openai_shape(http):
    response = http.get("/v1/nothing-here")
    assert response.status_code == 404 and set(response.json()["error"]) == ERROR_KEYS


def test_foreign_host_header_is_refused_while_bound_to_loopback(http):
    response = http.get("/v1/models", headers={"Host": "attacker.example:8000"})
    assert response.status_code == 403 and response.json()["error"]["code"] == "host_not_allowed"
    assert http.get("/v1/models", headers={"Host": "localhost:8000"}).status_code == 200


# -- cancellation ---------------------------------------------------------------------------
def expert_accesses(http: httpx.Client) -> int:
    view = http.get("/v1/expert-cache").json()
    return view["hits"] + view["misses"]


def wait_until_engine_idle(http: httpx.Client, timeout: float = 15) -> int:
    """The expert-access count once it stops moving (the engine ran nothing for 0.3 s)."""
    deadline = time.monotonic() + timeout
    last = expert_accesses(http)
    while True:
        time.sleep(0.3)
        now = expert_accesses(http)
        if now == last and metric(http, "moe_queue_depth") == 0:
            return now
        assert time.monotonic() < deadline, "the engine kept running"
        last = now


def assert_next_request_starts_at_once(client) -> None:
    start = time.monotonic()
    response = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=2, temperature=0)
    assert response.choices[0].finish_reason == "length"
    assert time.monotonic() - start < 5


def test_disconnect_mid_stream_aborts_and_the_next_request_starts_at_once(server, http, client):
    aborted_before, accesses_before = metric(http, 'moe_requests_total{status="aborted"}'), expert_accesses(http)
    body = {"model": MODEL, "messages": CHAT, "max_tokens": LONG, "temperature": 0, "stream": True,
            "extra_body": {"ignore_eos": True}}
    with server.openai().chat.completions.create(**body) as stream:
        chunks = [c for c, _ in zip(stream, range(3), strict=False)]
    assert len(chunks) == 3  # the role chunk and two tokens; closing the stream disconnects
    assert_next_request_starts_at_once(client)
    ran = wait_until_engine_idle(http) - accesses_before
    assert ran < ACCESSES_PER_TOKEN * LONG / 4  # stopped long before its 490 tokens
    assert metric(http, 'moe_requests_total{status="aborted"}') == aborted_before + 1


def test_disconnect_while_waiting_for_a_non_streamed_answer_aborts(server, http, client):
    aborted_before, accesses_before = metric(http, 'moe_requests_total{status="aborted"}'), expert_accesses(http)
    body = json.dumps({"model": MODEL, "messages": CHAT, "max_tokens": LONG, "ignore_eos": True}).encode()
    with socket.create_connection(("127.0.0.1", server.port)) as sock:  # a client that hangs up
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        deadline = time.monotonic() + 10
        while expert_accesses(http) < accesses_before + 10 * ACCESSES_PER_TOKEN:  # it is decoding
            assert time.monotonic() < deadline
            time.sleep(0.02)
    assert_next_request_starts_at_once(client)
    ran = wait_until_engine_idle(http) - accesses_before
    assert ran < ACCESSES_PER_TOKEN * LONG / 4
    assert metric(http, 'moe_requests_total{status="aborted"}') == aborted_before + 1


N_LONG = 100  # tokens per choice of the n=16 requests below: 1600 in all unless stopped


def test_disconnect_during_a_later_choice_of_a_stream_aborts_them_all(server, http, client):
    aborted_before, accesses_before = metric(http, 'moe_requests_total{status="aborted"}'), expert_accesses(http)
    body = {"model": MODEL, "messages": CHAT, "n": 16, "max_tokens": N_LONG, "temperature": 0, "stream": True,
            "extra_body": {"ignore_eos": True}}
    with server.openai().chat.completions.create(**body) as stream:
        for chunk in stream:
            if chunk.choices and chunk.choices[0].index == 1:  # the second choice is under way
                break
    assert_next_request_starts_at_once(client)
    ran = wait_until_engine_idle(http) - accesses_before
    assert ran < ACCESSES_PER_TOKEN * N_LONG * 3 / 2  # the first choice; the second stopped as it began
    assert metric(http, 'moe_requests_total{status="aborted"}') == aborted_before + 1


def test_disconnect_during_a_later_choice_of_a_non_streamed_request_aborts_them_all(server, http, client):
    aborted_before, accesses_before = metric(http, 'moe_requests_total{status="aborted"}'), expert_accesses(http)
    body = json.dumps({"model": MODEL, "messages": CHAT, "n": 16, "max_tokens": N_LONG, "ignore_eos": True}).encode()
    with socket.create_connection(("127.0.0.1", server.port)) as sock:  # a client that hangs up
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        deadline = time.monotonic() + 20
        while expert_accesses(http) < accesses_before + (N_LONG + 10) * ACCESSES_PER_TOKEN:  # past the first choice
            assert time.monotonic() < deadline
            time.sleep(0.02)
    assert_next_request_starts_at_once(client)
    ran = wait_until_engine_idle(http) - accesses_before
    assert ran < ACCESSES_PER_TOKEN * N_LONG * 4  # not the 16 choices
    assert metric(http, 'moe_requests_total{status="aborted"}') == aborted_before + 1


def test_requests_run_one_at_a_time_in_arrival_order(server, client, http):
    done: dict[int, float] = {}

    def ask(i: int) -> None:
        client.completions.create(model=MODEL, prompt="Count:", max_tokens=400 if i == 0 else 1, temperature=0,
                                  extra_body={"ignore_eos": True})
        done[i] = time.monotonic()

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(3)]
    for i, t in enumerate(threads):
        t.start()
        deadline = time.monotonic() + 10
        while metric(http, "moe_queue_depth") < i + 1:  # arrival order 0, 1, 2; 1 and 2 wait behind the long 0
            assert time.monotonic() < deadline
            time.sleep(0.01)
    for t in threads:
        t.join(60)
    # 1 and 2 waited behind the long 0: they end right after it, never seconds before (client threads
    # receiving near-simultaneous answers may append in any order, hence the small tolerance)
    assert sorted(done) == [0, 1, 2]
    assert done[1] >= done[0] - 0.3 and done[2] >= done[1] - 0.3


# -- metrics and the cache view -------------------------------------------------------------
DESIGN_METRICS = [
    "moe_expert_cache_hits_total", "moe_expert_cache_misses_total", "moe_expert_prefetches_total",
    "moe_expert_prefetch_used_total", "moe_expert_bytes_transferred_total", "moe_eamc_entries",
    'moe_requests_total{status="ok"}', "moe_queue_depth", "moe_time_to_first_token_seconds_count",
    "moe_time_per_output_token_seconds_count", "moe_generated_tokens_total",
]


def test_metrics_names_and_counts(http, client):
    before = {name: metric(http, name) for name in DESIGN_METRICS}
    response = client.completions.create(model=MODEL, prompt="Hello", max_tokens=4, temperature=0)
    after = {name: metric(http, name) for name in DESIGN_METRICS}
    assert http.get("/metrics").headers["content-type"].startswith("text/plain")
    assert after['moe_requests_total{status="ok"}'] == before['moe_requests_total{status="ok"}'] + 1
    assert after["moe_generated_tokens_total"] == before["moe_generated_tokens_total"] + 4
    assert after["moe_time_to_first_token_seconds_count"] == before["moe_time_to_first_token_seconds_count"] + 1
    assert after["moe_time_per_output_token_seconds_count"] == before["moe_time_per_output_token_seconds_count"] + 1
    accesses = after["moe_expert_cache_hits_total"] + after["moe_expert_cache_misses_total"]
    assert accesses > before["moe_expert_cache_hits_total"] + before["moe_expert_cache_misses_total"]
    assert after["moe_queue_depth"] == 0
    assert response.usage.completion_tokens == 4


def test_invalid_requests_are_counted(http):
    before = metric(http, 'moe_requests_total{status="invalid"}')
    http.post("/v1/chat/completions", json={"messages": CHAT, "n": 17})
    assert metric(http, 'moe_requests_total{status="invalid"}') == before + 1


def test_expert_cache_view(http, client):
    client.completions.create(model=MODEL, prompt="Hello", max_tokens=2)
    view = http.get("/v1/expert-cache").json()
    assert view["policy"] == "sparsity-aware"
    for key in ("capacity_experts", "hits", "misses", "hit_rate", "prefetches", "prefetch_accuracy", "eamc_entries",
                "layers"):
        assert key in view
    assert 0 <= view["hit_rate"] <= 1
    # on CPU the cache holds every expert by default: nothing to prefetch, so no look-ahead either
    assert view["prefetch"] is False and view["lookahead_accuracy"] is None
    assert view["eamc_path"].endswith("eamc.json")  # the fixture's --eamc-path
    assert len(view["layers"]) == view["num_moe_layers"] == 3  # the fixture's 3 MoE layers
    resident = sum(len(layer["resident_experts"]) for layer in view["layers"])
    assert resident == view["capacity_experts"] == view["total_experts"]  # on CPU all stay in RAM by default
    for layer in view["layers"]:
        assert {"layer", "hits", "misses", "hit_rate", "resident_experts"} <= set(layer)


def test_tokenize_gives_the_ids_each_endpoint_sees_and_detokenize_reverses_them(http, tokenizer):
    prompt = http.post("/tokenize", json={"prompt": "Hello there, friend"}).json()
    assert prompt["tokens"] == tokenizer("Hello there, friend")["input_ids"]
    assert prompt["count"] == len(prompt["tokens"]) and prompt["max_model_len"] == 512
    messages = [{"role": "user", "content": "Hello there, friend"}]
    chat = http.post("/tokenize", json={"model": MODEL, "messages": messages}).json()
    want = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert chat["tokens"] == tokenizer(want, add_special_tokens=False)["input_ids"]
    text = http.post("/detokenize", json={"tokens": prompt["tokens"]}).json()["prompt"]
    assert text == tokenizer.decode(prompt["tokens"], skip_special_tokens=True) and "Hello there, friend" in text


def test_llama_cpp_s_tokenize_adds_the_bos_only_when_asked(http, tokenizer):
    """llama.cpp's shape (`content`) on a tokenizer with a BOS (Mixtral's): `add_special` adds it."""
    plain = tokenizer("Hello there", add_special_tokens=False)["input_ids"]
    assert http.post("/tokenize", json={"content": "Hello there"}).json() == {"tokens": plain}
    special = http.post("/tokenize", json={"content": "Hello there", "add_special": True}).json()["tokens"]
    assert special == [tokenizer.bos_token_id, *plain]


@pytest.mark.parametrize("path, body, param", [
    ("/tokenize", {}, "prompt"),
    ("/tokenize", {"prompt": "x", "messages": [{"role": "user", "content": "x"}]}, "prompt"),
    ("/tokenize", {"prompt": 5}, "prompt"),
    ("/detokenize", {"tokens": [1, -1]}, "tokens"),
    ("/detokenize", {"tokens": [10**9]}, "tokens"),
    ("/tokenize", {"prompt": "x", "model": "other"}, "model"),
])
def test_tokenize_and_detokenize_refuse_bad_input(http, path, body, param):
    response = http.post(path, json=body)
    assert 400 <= response.status_code < 500
    assert response.json()["error"]["param"] == param


def test_a_chat_s_next_turn_reads_the_last_turn_from_the_kept_kv_cache(client, http):
    """A chat client resends the conversation: the last turn's prompt and answer are not computed
    again, and usage says how many prompt tokens were read (OpenAI's `cached_tokens`)."""
    before = metric(http, "moe_prompt_tokens_cached_total")
    first = [{"role": "user", "content": "Tell me a long story about a fox, a dog and a river, please."}]
    answer = client.chat.completions.create(model=MODEL, messages=first, max_tokens=12, temperature=0)
    assert answer.usage.prompt_tokens_details.cached_tokens == 0
    turn = [*first, {"role": "assistant", "content": answer.choices[0].message.content},
            {"role": "user", "content": "And then?"}]
    reply = client.chat.completions.create(model=MODEL, messages=turn, max_tokens=4, temperature=0)
    cached = reply.usage.prompt_tokens_details.cached_tokens
    assert answer.usage.prompt_tokens <= cached < reply.usage.prompt_tokens  # the first prompt at least
    assert metric(http, "moe_prompt_tokens_cached_total") - before == cached


# -- echo: the prompt's text and logprobs, then the completion's (lm-eval's local-completions) --
ECHO_PROMPT = "The capital of France is"
# float32 on CPU both sides, the same sums in another order (tests/test_engine_prompt_logprobs.py says more)
ECHO_TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def reference(checkpoint):
    from tests.fixtures.models import load_reference

    model = load_reference(checkpoint)

    def logprobs(ids: list[int]) -> torch.Tensor:
        """[T, V]: row i is the distribution of token i + 1."""
        with torch.no_grad():
            return torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)

    return logprobs


def echo_completion(client, prompt, **kwargs):
    return client.completions.create(model=MODEL, prompt=prompt, echo=True, temperature=0, **kwargs)


def test_echo_with_logprobs_scores_the_prompt(client, tokenizer, reference):
    ids = tokenizer(ECHO_PROMPT)["input_ids"]
    response = echo_completion(client, ECHO_PROMPT, logprobs=1, max_tokens=1)
    choice, logprobs = response.choices[0], response.choices[0].logprobs
    plain = client.completions.create(model=MODEL, prompt=ECHO_PROMPT, temperature=0, logprobs=1,
                                      max_tokens=1)
    assert choice.text == ECHO_PROMPT + plain.choices[0].text
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == len(logprobs.top_logprobs) == len(ids) + 1
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    expected = reference(ids)
    assert logprobs.token_logprobs[1:-1] == pytest.approx(
        [expected[i - 1, ids[i]].item() for i in range(1, len(ids))], abs=ECHO_TOLERANCE)
    # the generated token's (its logits computed with the prompt's: rounding apart, the same)
    generated = plain.choices[0].logprobs.token_logprobs[0]
    assert logprobs.token_logprobs[-1] == pytest.approx(generated, abs=ECHO_TOLERANCE)
    assert all(len(top) == 1 for top in logprobs.top_logprobs[1:])
    assert (response.usage.prompt_tokens, response.usage.completion_tokens) == (len(ids), 1)


def test_text_offsets_point_into_the_echoed_text(client):
    response = echo_completion(client, ECHO_PROMPT + " Paris, and", logprobs=0, max_tokens=3,
                               extra_body={"ignore_eos": True})
    text, logprobs = response.choices[0].text, response.choices[0].logprobs
    offsets = logprobs.text_offset
    assert offsets == sorted(offsets) and len(offsets) == len(logprobs.tokens)
    prompt = list(zip(logprobs.tokens, offsets))[:-3]
    # from the second word on (the BOS is not in the text; SentencePiece drops the first word's space)
    assert all(text.startswith(token, offset) for token, offset in prompt[2:])
    assert offsets[-3] == len(ECHO_PROMPT + " Paris, and")  # the completion's first token: after the prompt


def test_token_id_prompt_is_echoed_decoded(client, tokenizer):
    ids = tokenizer(ECHO_PROMPT)["input_ids"]
    by_ids = echo_completion(client, ids, logprobs=1, max_tokens=1)
    by_text = echo_completion(client, ECHO_PROMPT, logprobs=1, max_tokens=1)
    completion = by_text.choices[0].text[len(ECHO_PROMPT):]
    assert by_ids.choices[0].text == tokenizer.decode(ids, skip_special_tokens=True) + completion
    assert by_ids.choices[0].logprobs.token_logprobs == by_text.choices[0].logprobs.token_logprobs


def test_streamed_echo_sends_the_prompt_first(http):
    body = {"model": MODEL, "prompt": ECHO_PROMPT, "echo": True, "logprobs": 1, "max_tokens": 4,
            "temperature": 0, "ignore_eos": True}
    full = http.post("/v1/completions", json=body).json()["choices"][0]
    chunks = [c["choices"][0] for c in stream_events(http, "/v1/completions", body)[:-1] if c["choices"]]
    assert chunks[0]["text"] == ECHO_PROMPT and chunks[0]["logprobs"]["token_logprobs"][0] is None
    assert "".join(c["text"] for c in chunks) == full["text"]
    for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
        assert [v for c in chunks if c["logprobs"] for v in c["logprobs"][key]] == full["logprobs"][key]


def test_echo_without_logprobs_is_just_the_text(client, http):
    response = echo_completion(client, ECHO_PROMPT, max_tokens=3)
    assert response.choices[0].text.startswith(ECHO_PROMPT) and response.choices[0].logprobs is None
    body = {"model": MODEL, "prompt": ECHO_PROMPT, "echo": True, "max_tokens": 3, "temperature": 0}
    chunks = [c["choices"][0] for c in stream_events(http, "/v1/completions", body)[:-1] if c["choices"]]
    assert chunks[0]["text"] == ECHO_PROMPT and "".join(c["text"] for c in chunks) == response.choices[0].text


def test_max_tokens_zero_echoes_only_the_prompt(client, tokenizer):
    ids = tokenizer(ECHO_PROMPT)["input_ids"]
    scored = echo_completion(client, ECHO_PROMPT, logprobs=1, max_tokens=0)
    assert scored.choices[0].text == ECHO_PROMPT and scored.choices[0].finish_reason == "length"
    assert len(scored.choices[0].logprobs.tokens) == len(ids) and scored.usage.completion_tokens == 0
    assert echo_completion(client, ECHO_PROMPT, max_tokens=0).choices[0].text == ECHO_PROMPT


def test_each_choice_echoes_the_prompt(client):
    response = echo_completion(client, ECHO_PROMPT, logprobs=1, max_tokens=2, n=2)
    assert len(response.choices) == 2 and all(c.text.startswith(ECHO_PROMPT) for c in response.choices)
    assert response.choices[0].logprobs.token_logprobs == response.choices[1].logprobs.token_logprobs


def test_log_likelihood_as_lm_eval_computes_it(client, tokenizer, reference):
    """lm-eval's `local-completions` sends context + continuation as token ids with echo, logprobs=1 and
    max_tokens=1, and sums `token_logprobs[ctxlen:-1]` (the last entry is the generated token); a
    continuation is greedy when each of its logprobs is the largest of its `top_logprobs`."""
    context = tokenizer(ECHO_PROMPT)["input_ids"]
    continuation = tokenizer(" Paris, of course", add_special_tokens=False)["input_ids"]
    ids = context + continuation
    choice = echo_completion(client, [ids], logprobs=1, max_tokens=1).choices[0]
    token_logprobs = choice.logprobs.token_logprobs[len(context):-1]
    top_logprobs = choice.logprobs.top_logprobs[len(context):-1]
    expected = reference(ids)
    log_likelihood = sum(expected[i - 1, ids[i]].item() for i in range(len(context), len(ids)))
    assert sum(token_logprobs) == pytest.approx(log_likelihood, abs=ECHO_TOLERANCE * len(continuation))
    is_greedy = all(lp == max(top.values()) for lp, top in zip(token_logprobs, top_logprobs))
    assert is_greedy == all(expected[i - 1].argmax().item() == ids[i] for i in range(len(context), len(ids)))
