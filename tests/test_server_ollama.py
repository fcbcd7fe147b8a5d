"""Ollama's native API (`/api/chat`, `/api/generate`, `/api/tags`, `/api/show`, `/api/ps`, `/api/version`),
driven by the `ollama` library and by raw httpx reading the NDJSON stream line by line.

- A real server on a tiny random Qwen3-MoE with a tool template: greedy answers equal chat's, streamed
  (Ollama's default) equals whole, counts, `num_predict`, raw and templated generate, the model
  endpoints, `format` schemas, a client that leaves mid-stream, errors in Ollama's `{"error": str}`; a
  history longer than the context (or `num_ctx`) answered with its oldest turns dropped, counted against
  /tokenize, and what cannot fit refused.
- The scripted engine of the tool tests (recorded output, real Qwen tokenizer): tool calls come back
  with arguments as objects, thinking as `thinking`, and tool history reaches the template as chat's;
  with a prompt as long as its text, which messages a cut history keeps (tool answers go with their call).
"""

from __future__ import annotations

import json
import re
import signal
import time

import httpx
import jsonschema
import ollama
import pytest
import transformers

from server import protocol as p
from server.ollama_context import ContextFit
from server.ollama_models import human_count
from server.testing import RemoteServer
from tests.fixtures.tokenizers import QWEN_TOOLS_TEMPLATE
from tests.test_server_anthropic import THOUGHT
from tests.test_server_faults import InProcessServer, ScriptedEngine, wait_for_health
from tests.test_server_tools import (
    ASK,
    HISTORY,
    TOOLS,
    TWO_CALLS,
    ThinkingRecordedEngine,
    qwen_tool_checkpoint,
)

MODEL = "tiny-qwen"
HELLO = [{"role": "user", "content": "Hello, who are you?"}]
GREEDY = {"temperature": 0, "num_predict": 8}
TIMINGS = ("total_duration", "load_duration", "prompt_eval_count", "prompt_eval_duration", "eval_count",
           "eval_duration")
PLAN = {"type": "object", "properties": {"unit": {"enum": ["celsius", "fahrenheit"]}, "days": {"enum": [1, 2, 3]}},
        "required": ["unit", "days"], "additionalProperties": False}


def ndjson(url: str, path: str, body: dict) -> list[dict]:
    """The stream's lines, each parsed on its own (no SSE framing); `stream` is left to its default."""
    with httpx.stream("POST", f"{url}{path}", json=body, timeout=60) as response:
        assert response.status_code == 200, response.read()
        assert response.headers["content-type"].startswith("application/x-ndjson")
        lines = list(response.iter_lines())
    assert lines and all(line for line in lines)
    return [json.loads(line) for line in lines]


def assert_ollama_error(response: httpx.Response, status: int, needle: str = "") -> str:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"} and isinstance(body["error"], str) and needle in body["error"], body
    return body["error"]


def assert_done(last: dict, reason: str) -> None:
    assert last["done"] is True and last["done_reason"] == reason
    assert all(isinstance(last[key], int) and last[key] >= 0 for key in TIMINGS)
    assert last["total_duration"] >= last["prompt_eval_duration"] + last["eval_duration"] > 0


# -- the fit alone ----------------------------------------------------------------------------------
def test_the_cut_is_found_in_few_renderings_and_keeps_every_system_message():
    messages = [p.ChatMessage(role="system", content="rules")] + [
        p.ChatMessage(role="user" if k % 2 == 0 else "assistant", content=f"m{k}") for k in range(400)]
    messages.insert(101, p.ChatMessage(role="system", content="a late system message"))
    renders: list[list[p.ChatMessage]] = []

    def render(kept: list[p.ChatMessage]) -> list[int]:  # ten tokens a message
        renders.append(kept)
        return [0] * (10 * len(kept))

    prompt = ContextFit(limit=1001).prompt(messages, render)
    kept = next(kept for kept in renders if 10 * len(kept) == len(prompt))
    assert len(prompt) == 1000 and len(renders) <= 12  # not one rendering per message
    assert [m.content for m in kept[:2]] == ["rules", "a late system message"] and kept[2].role == "user"
    assert kept[2:] == messages[-98:]
    renders.clear()
    assert len(ContextFit(limit=5000).prompt(messages, render)) == 4020 and renders == [messages]  # fits: once


# -- a real server ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    folder = qwen_tool_checkpoint(tmp_path_factory.mktemp("tiny-qwen-ollama"))
    return folder


def serve(checkpoint, *args: str) -> RemoteServer:
    return RemoteServer(["--model", str(checkpoint), "--served-model-name", MODEL, "--device", "cpu", *args],
                        env={"OMP_NUM_THREADS": "1"})


@pytest.fixture(scope="module")
def server(checkpoint):
    with serve(checkpoint) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return ollama.Client(host=server.url, timeout=60)


def test_greedy_chat_equals_the_chat_completion_and_counts_the_same(server, client):
    answer = client.chat(model=MODEL, messages=HELLO, options=GREEDY, stream=False)
    chat = server.openai().chat.completions.create(model=MODEL, messages=HELLO, temperature=0, max_tokens=8)

    assert answer.model == MODEL and answer.message.role == "assistant"
    assert answer.message.content == chat.choices[0].message.content and answer.message.content
    assert answer.done and answer.done_reason == "length" == chat.choices[0].finish_reason
    assert answer.prompt_eval_count == chat.usage.prompt_tokens
    assert answer.eval_count == chat.usage.completion_tokens == 8
    assert answer.created_at.endswith("Z")
    raw = httpx.post(f"{server.url}/api/chat", json={"model": MODEL, "messages": HELLO, "options": GREEDY,
                                                      "stream": False}, timeout=60).json()
    assert raw["message"] == {"role": "assistant", "content": answer.message.content}
    assert_done(raw, "length")


def test_chat_streams_ndjson_by_default_and_the_lines_join_to_the_whole(server, client):
    whole = client.chat(model=MODEL, messages=HELLO, options=GREEDY, stream=False)
    lines = ndjson(server.url, "/api/chat", {"model": MODEL, "messages": HELLO, "options": GREEDY})

    *pieces, last = lines
    assert len(pieces) > 1 and all(line["done"] is False and "done_reason" not in line for line in pieces)
    assert "".join(line["message"]["content"] for line in lines) == whole.message.content
    assert last["message"] == {"role": "assistant", "content": ""}
    assert_done(last, "length")
    assert (last["prompt_eval_count"], last["eval_count"]) == (whole.prompt_eval_count, whole.eval_count)
    streamed = "".join(part.message.content for part in client.chat(model=MODEL, messages=HELLO, options=GREEDY,
                                                                     stream=True))
    assert streamed == whole.message.content
    nulled = ndjson(server.url, "/api/chat", {"model": MODEL, "messages": HELLO, "options": GREEDY, "stream": None})
    assert len(nulled) == len(lines)  # null is the default: a stream


def test_latest_tag_and_sampling_options_are_read(server, client):
    answer = client.chat(model=f"{MODEL}:latest", messages=HELLO, stream=False,
                         options={**GREEDY, "num_predict": 3, "num_ctx": 8192, "repeat_penalty": 1.1, "seed": 1})
    assert answer.model == f"{MODEL}:latest" and answer.eval_count == 3 and answer.done_reason == "length"
    unlimited = client.chat(model=MODEL, messages=HELLO, stream=False,
                            options={"temperature": 0, "num_predict": -1, "stop": [" "]})
    assert unlimited.done_reason in ("stop", "length")


def test_num_predict_beyond_the_context_ends_where_the_context_does(server, client):
    max_model_len = server.openai().models.retrieve(MODEL).model_extra["max_model_len"]
    answer = client.generate(model=MODEL, prompt="story " * (max_model_len - 40), raw=True, stream=False,
                             options={"temperature": 0, "num_predict": 100})
    assert answer.done_reason == "length" and answer.eval_count == max_model_len - answer.prompt_eval_count < 100


SYSTEM = [{"role": "system", "content": "You are a patient storyteller."}]


def exchanges(count: int, words: int = 24) -> list[dict]:
    """`count` user/assistant exchanges, each message `words` numbered words, then a last question."""
    history = []
    for turn in range(count):
        history += [{"role": "user", "content": " ".join(f"ask{turn}w{w}" for w in range(words))},
                    {"role": "assistant", "content": " ".join(f"told{turn}w{w}" for w in range(words))}]
    return history + [{"role": "user", "content": "And then what happened?"}]


def template_tokens(url: str, messages: list[dict]) -> int:
    response = httpx.post(f"{url}/tokenize", json={"model": MODEL, "messages": messages}, timeout=30)
    return response.json()["count"]


def longest_fitting_tokens(url: str, messages: list[dict], limit: int) -> int:
    """The prompt tokens of the most history (from a user message on, the system message kept) under `limit`,
    found one cut at a time."""
    system, history = messages[:1], messages[1:]
    for start in (k for k, message in enumerate(history) if message["role"] == "user"):
        tokens = template_tokens(url, system + history[start:])
        if tokens < limit:
            return tokens
    raise AssertionError("nothing fits")


def test_a_history_longer_than_the_context_drops_the_oldest_turns_streamed_or_not(server, client):
    max_model_len = server.openai().models.retrieve(MODEL).model_extra["max_model_len"]
    messages = SYSTEM + exchanges(12)
    assert template_tokens(server.url, messages) > max_model_len
    expected = longest_fitting_tokens(server.url, messages, max_model_len)

    answer = client.chat(model=MODEL, messages=messages, options=GREEDY, stream=False)
    assert answer.prompt_eval_count == expected and answer.eval_count == 8
    lines = ndjson(server.url, "/api/chat", {"model": MODEL, "messages": messages, "options": GREEDY})
    assert lines[-1]["prompt_eval_count"] == expected
    assert "".join(line["message"]["content"] for line in lines) == answer.message.content
    chat = httpx.post(f"{server.url}/v1/chat/completions", json={"model": MODEL, "messages": messages}, timeout=60)
    assert chat.status_code == 400 and chat.json()["error"]["code"] == "context_length_exceeded"  # unchanged


def test_num_ctx_below_the_context_is_where_the_history_is_cut_and_above_it_is_capped(server, client):
    max_model_len = server.openai().models.retrieve(MODEL).model_extra["max_model_len"]
    messages = SYSTEM + exchanges(12)
    small = client.chat(model=MODEL, messages=messages, options={**GREEDY, "num_ctx": 200}, stream=False)
    assert small.prompt_eval_count == longest_fitting_tokens(server.url, messages, 200)
    large = client.chat(model=MODEL, messages=messages, options={**GREEDY, "num_ctx": 8 * max_model_len},
                        stream=False)
    assert large.prompt_eval_count == longest_fitting_tokens(server.url, messages, max_model_len)


def test_a_history_that_fits_is_the_whole_prompt(server, client):
    messages = SYSTEM + exchanges(2, words=4)
    answer = client.chat(model=MODEL, messages=messages, options={**GREEDY, "num_ctx": 2048}, stream=False)
    assert answer.prompt_eval_count == template_tokens(server.url, messages)


@pytest.mark.parametrize("body, needle", [
    ({"messages": SYSTEM + exchanges(12), "truncate": False}, "(truncate is false)"),
    ({"messages": SYSTEM + exchanges(2, words=4), "truncate": False, "options": {"num_ctx": 40}},
     "(40 tokens (options.num_ctx))"),
    ({"messages": SYSTEM + exchanges(2) + [{"role": "user", "content": "word " * 600}]}, "latest message alone"),
])
def test_what_cannot_fit_is_refused_in_ollamas_shape(server, body, needle):
    response = httpx.post(f"{server.url}/api/chat", json={"model": MODEL, **body}, timeout=60)
    message = assert_ollama_error(response, 400, "the input length exceeds the context length")
    assert needle in message


def test_generate_templated_equals_chat_and_raw_equals_completions(server, client):
    chat = client.chat(model=MODEL, messages=[{"role": "system", "content": "Be brief."}, *HELLO], options=GREEDY,
                       stream=False)
    templated = client.generate(model=MODEL, prompt=HELLO[0]["content"], system="Be brief.", options=GREEDY,
                                stream=False)
    assert templated.response == chat.message.content and templated.prompt_eval_count == chat.prompt_eval_count

    completion = server.openai().completions.create(model=MODEL, prompt="Once upon a time", temperature=0,
                                                    max_tokens=8)
    raw = client.generate(model=MODEL, prompt="Once upon a time", raw=True, options=GREEDY, stream=False)
    assert raw.response == completion.choices[0].text
    assert raw.prompt_eval_count == completion.usage.prompt_tokens < templated.prompt_eval_count
    lines = ndjson(server.url, "/api/generate", {"model": MODEL, "prompt": "Once upon a time", "raw": True,
                                                 "options": GREEDY})
    assert "".join(line["response"] for line in lines) == raw.response
    assert_done(lines[-1], "length")


def test_an_empty_prompt_or_no_messages_is_a_load_answered_at_once(server):
    for path, body in (("/api/generate", {"model": MODEL}), ("/api/chat", {"model": MODEL, "messages": []})):
        response = httpx.post(f"{server.url}{path}", json=body, timeout=10)
        assert response.status_code == 200 and response.headers["content-type"] == "application/json"
        answer = response.json()
        assert answer["done"] is True and answer["done_reason"] == "load" and answer["model"] == MODEL
    unload = httpx.post(f"{server.url}/api/generate", json={"model": MODEL, "keep_alive": 0}, timeout=10).json()
    assert unload["done_reason"] == "unload"  # said, not done: the model stays loaded
    assert_ollama_error(httpx.post(f"{server.url}/api/generate", json={"model": MODEL, "options": {"top_p": 9}}),
                        400, "options.top_p")  # a load request's options are still checked


def test_format_schema_gives_valid_json(client):
    for seed in range(2):
        answer = client.chat(model=MODEL, messages=ASK, format=PLAN, stream=False,
                             options={"temperature": 1.0, "seed": seed, "num_predict": 40})
        jsonschema.validate(json.loads(answer.message.content), PLAN)
    generated = client.generate(model=MODEL, prompt="Give a plan.", format=PLAN, stream=False,
                                options={"temperature": 0, "num_predict": 40})
    jsonschema.validate(json.loads(generated.response), PLAN)
    # "json": any object (a random model's may not end within num_predict)
    loose = client.generate(model=MODEL, prompt="Give a plan.", format="json", stream=False,
                            options={"temperature": 0, "num_predict": 5})
    assert loose.response.lstrip().startswith("{")


@pytest.mark.parametrize(("count", "shown"), [(46_702_792_704, "46.7B"), (134_515_008, "134.52M"),
                                               (8_030_261_248, "8.0B"), (999, "999"), (52_000, "52.00K")])
def test_parameter_counts_read_as_ollama_writes_them(count, shown):
    assert human_count(count) == shown


def test_tags_show_ps_version_through_the_library_and_raw(server, client, checkpoint):
    (listed,) = client.list().models
    assert listed.model == MODEL and listed.details.family == "qwen3_moe" and listed.size > 0 and listed.digest
    assert listed.details.format == "safetensors" and listed.details.quantization_level
    model = transformers.AutoModelForCausalLM.from_pretrained(checkpoint)  # every parameter, experts included
    assert listed.details.parameter_size == human_count(sum(p.numel() for p in model.parameters()))
    raw = httpx.get(f"{server.url}/api/tags").json()
    assert set(raw["models"][0]) == {"name", "model", "modified_at", "size", "digest", "details"}
    assert raw["models"][0]["name"] == MODEL and set(raw["models"][0]["details"]) >= {
        "format", "family", "families", "parameter_size", "quantization_level"}

    shown = client.show(f"{MODEL}:latest")
    assert shown.template == QWEN_TOOLS_TEMPLATE and shown.details.family == "qwen3_moe"
    assert set(shown.capabilities) == {"completion", "tools"}  # the template has no <think>
    assert shown.modelinfo["general.architecture"] == "qwen3_moe" and shown.modelinfo["general.basename"] == MODEL
    max_model_len = server.openai().models.retrieve(MODEL).model_extra["max_model_len"]
    assert shown.modelinfo["qwen3_moe.context_length"] == max_model_len
    legacy = httpx.post(f"{server.url}/api/show", json={"name": MODEL}).json()
    assert legacy["capabilities"] == shown.capabilities

    (running,) = client.ps().models
    assert running.model == MODEL and running.size_vram == 0 and running.expires_at.year > 2100  # on CPU
    assert running.context_length == max_model_len
    version = httpx.get(f"{server.url}/api/version").json()
    assert tuple(map(int, version["version"].split("."))) >= (0, 6, 4)  # VS Code Copilot's minimum
    assert version["moe_serve_version"]
    root = httpx.get(server.url)
    assert root.status_code == 200 and root.text == "moe-serve is running"
    assert httpx.head(server.url).status_code == 200


def generated_tokens(url: str) -> float:
    """The server's count of generated tokens, once it stops moving (the engine is idle)."""
    last = None
    while True:
        text = httpx.get(f"{url}/metrics").text
        now = float(re.search(r"^moe_generated_tokens_total (\S+)$", text, re.MULTILINE).group(1))
        if now == last and "moe_queue_depth 0.0" in text:
            return now
        last = now
        time.sleep(0.3)


def test_a_client_that_leaves_mid_stream_frees_the_engine(server, client):
    before = generated_tokens(server.url)
    body = {"model": MODEL, "messages": HELLO, "options": {"temperature": 0, "num_predict": 400}}
    with httpx.stream("POST", f"{server.url}/api/chat", json=body, timeout=60) as response:
        lines = response.iter_lines()
        assert json.loads(next(lines))["done"] is False
        assert json.loads(next(lines))["done"] is False
    start = time.monotonic()  # the long request was aborted: this one runs at once
    answer = client.chat(model=MODEL, messages=HELLO, options={"temperature": 0, "num_predict": 2}, stream=False)
    assert answer.done_reason == "length" and time.monotonic() - start < 5
    assert generated_tokens(server.url) - before < 100  # stopped long before its 400 tokens
    metrics = httpx.get(f"{server.url}/metrics").text
    assert 'moe_requests_total{status="aborted"} 1.0' in metrics


def test_past_the_drain_a_stream_ends_with_an_error_line(checkpoint):
    server = serve(checkpoint, "--drain-timeout", "0").start()
    try:
        body = {"model": MODEL, "messages": HELLO, "options": {"temperature": 0, "num_predict": 490}}
        with httpx.stream("POST", f"{server.url}/api/chat", json=body, timeout=60) as response:
            lines = response.iter_lines()
            received = [json.loads(next(lines)), json.loads(next(lines))]  # it is running
            server.process.send_signal(signal.SIGTERM)
            received += [json.loads(line) for line in lines]
        assert received[-1] == {"error": "the server is shutting down"}
        assert not any(line.get("done") for line in received[:-1])
        assert server.process.wait(30) in (0, -signal.SIGTERM)
    finally:
        server.stop()


@pytest.mark.parametrize("path, body, status, needle", [
    ("/api/chat", {"model": "nope", "messages": HELLO}, 404, "model 'nope' not found"),
    ("/api/show", {"model": "nope:7b"}, 404, "model 'nope:7b' not found"),
    ("/api/chat", {"model": MODEL, "messages": [{**HELLO[0], "images": ["aGk="]}]}, 400, "messages[0].images"),
    ("/api/generate", {"model": MODEL, "prompt": "hi", "images": ["aGk="]}, 400, "images"),
    ("/api/generate", {"model": MODEL, "prompt": "hi", "suffix": "end"}, 400, "no fill-in-the-middle tokens"),
    ("/api/chat", {"model": MODEL, "messages": HELLO, "options": {"temperature": "hot"}}, 400, "options.temperature"),
    ("/api/chat", {"model": MODEL, "messages": HELLO, "options": {"top_p": 5}}, 400, "options.top_p"),
    ("/api/chat", {"model": MODEL, "messages": HELLO, "options": {"num_predict": 0}}, 400, "options.num_predict"),
    ("/api/chat", {"model": MODEL, "messages": HELLO, "format": "yaml"}, 400, "format"),
    ("/api/chat", {"model": MODEL, "messages": [{"role": "robot", "content": "hi"}]}, 400, "role"),
    ("/api/pull", {"model": "llama3"}, 501, "serves the one model"),
    ("/api/copy", {"source": MODEL, "destination": "copy"}, 501, "serves the one model"),
    ("/api/embed", {"model": MODEL, "input": ["hi", ""]}, 400, "input[1] is empty"),
    ("/api/embed", {"model": "nope", "input": "hi"}, 404, "model 'nope' not found"),
    ("/api/nothing", {}, 404, ""),
])
def test_errors_are_ollamas_shape(server, path, body, status, needle):
    assert_ollama_error(httpx.post(f"{server.url}{path}", json=body, timeout=60), status, needle)


def test_the_library_raises_a_response_error_with_the_message(client):
    with pytest.raises(ollama.ResponseError) as caught:
        client.chat(model="nope", messages=HELLO)
    assert caught.value.status_code == 404 and "not found" in caught.value.error
    with pytest.raises(ollama.ResponseError) as caught:
        client.pull("llama3")
    assert caught.value.status_code == 501
    assert_ollama_error(httpx.delete(f"{client._client.base_url}/api/delete", timeout=10), 501)


# -- scripted output: tool calls and thinking -----------------------------------------------------
@pytest.fixture(scope="module")
def recorded():
    engine = ThinkingRecordedEngine()
    with InProcessServer(lambda: engine) as srv:
        wait_for_health(srv.url, 200)
        yield engine, ollama.Client(host=srv.url, timeout=60), srv.url


CALLS = [("get_weather", {"city": "Paris"}), ("get_time", {})]


def test_tool_calls_come_back_with_object_arguments_whole_and_streamed(recorded):
    engine, client, url = recorded
    engine.output = TWO_CALLS
    whole = client.chat(model="recorded", messages=ASK, tools=TOOLS, stream=False)
    assert engine.tools == TOOLS  # offered to the template as chat offers them
    assert whole.message.content == "I will look both up." and whole.done_reason == "stop"
    assert [(c.function.name, c.function.arguments) for c in whole.message.tool_calls] == CALLS

    lines = ndjson(url, "/api/chat", {"model": "recorded", "messages": ASK, "tools": TOOLS})
    calls = [call["function"] for line in lines for call in line["message"].get("tool_calls", [])]
    assert [(c["name"], c["arguments"]) for c in calls] == CALLS
    assert "".join(line["message"]["content"] for line in lines) == "I will look both up."
    assert_done(lines[-1], "stop")
    streamed = [c for part in client.chat(model="recorded", messages=ASK, tools=TOOLS, stream=True)
                for c in part.message.tool_calls or []]
    assert [(c.function.name, c.function.arguments) for c in streamed] == CALLS


OLLAMA_HISTORY = ASK + [  # the tool tests' chat HISTORY, as Ollama's client sends it
    {"role": "assistant", "content": "", "tool_calls": [
        {"function": {"name": "get_weather", "arguments": {"city": "Paris"}}},
        {"function": {"name": "get_time", "arguments": {}}}]},
    {"role": "tool", "tool_name": "get_weather", "content": '{"temperature": 21, "sky": "clear"}'},
    {"role": "tool", "tool_name": "get_time", "content": "14:05"},
]


def test_tool_history_reaches_the_template_as_chats(recorded):
    engine, client, url = recorded
    engine.output = "It is 21 degrees and clear; the time is 14:05."
    answer = client.chat(model="recorded", messages=OLLAMA_HISTORY, tools=TOOLS, stream=False)
    assert answer.message.content == engine.output
    ollamas = engine.messages
    httpx.post(f"{url}/v1/chat/completions", json={"messages": HISTORY, "tools": TOOLS}, timeout=30)
    chats = engine.messages
    assert [m["role"] for m in ollamas] == [m["role"] for m in chats]
    assert [json.loads(c["function"]["arguments"]) for c in ollamas[1]["tool_calls"]] == [
        json.loads(c["function"]["arguments"]) for c in chats[1]["tool_calls"]]
    assert [c["function"]["name"] for c in ollamas[1]["tool_calls"]] == ["get_weather", "get_time"]
    assert [m["content"] for m in ollamas[2:]] == [m["content"] for m in chats[2:]]
    # each answer carries the id of the call it answers, and the tool's name
    call_ids = [c["id"] for c in ollamas[1]["tool_calls"]]
    assert [(m["tool_call_id"], m["name"]) for m in ollamas[2:]] == list(zip(call_ids, ["get_weather", "get_time"],
                                                                             strict=True))


def test_thinking_comes_back_apart_and_think_sets_the_template(recorded):
    engine, client, url = recorded
    engine.output = THOUGHT
    answer = client.chat(model="recorded", messages=ASK, think=True, stream=False)
    assert engine.template_kwargs == {"enable_thinking": True}
    assert (answer.message.thinking, answer.message.content) == ("The user wants the weather.", "It is sunny.")
    lines = ndjson(url, "/api/chat", {"model": "recorded", "messages": ASK, "think": "high"})
    assert engine.template_kwargs == {"reasoning_effort": "high", "enable_thinking": True}
    assert "".join(line["message"].get("thinking", "") for line in lines) == "The user wants the weather."
    assert "".join(line["message"]["content"] for line in lines) == "It is sunny."
    generated = client.generate(model="recorded", prompt="Weather?", think=False, stream=False)
    assert engine.template_kwargs == {"enable_thinking": False}
    assert (generated.thinking, generated.response) == ("The user wants the weather.", "It is sunny.")
    shown = httpx.post(f"{url}/api/show", json={"model": "recorded"}).json()
    assert shown["capabilities"] == ["completion", "tools", "thinking"]


class ContextRecordedEngine(ThinkingRecordedEngine):
    """The recorded engine with a prompt as long as its messages' text in Qwen tokens; it records every
    rendering, and which one ran."""

    def __init__(self) -> None:
        super().__init__()
        self.renders: list[tuple[list[dict], list[int]]] = []
        self.ran: list[dict] = []
        self.prompt: list[int] = []

    def apply_chat_template(self, messages, tools=None, template_kwargs=None, continue_final=False) -> list[int]:
        text = "\n".join(f"{m['role']}: {m.get('content') or ''} {m.get('tool_calls') or ''}" for m in messages)
        tokens = self.tokenizer.encode(text, add_special_tokens=False)
        self.renders.append((messages, tokens))
        return tokens

    def generate(self, request, should_abort):
        self.prompt = request.prompt_token_ids
        self.ran = next(messages for messages, tokens in self.renders if tokens == self.prompt)
        self.renders = []
        return super().generate(request, should_abort)


@pytest.fixture(scope="module")
def recorded_context():
    engine = ContextRecordedEngine()
    engine.output = "Once upon a time."
    with InProcessServer(lambda: engine) as srv:
        wait_for_health(srv.url, 200)
        yield engine, ollama.Client(host=srv.url, timeout=60), srv.url


def prompt_that_ran(engine: ContextRecordedEngine, client: ollama.Client, messages: list[dict], **options) -> list:
    client.chat(model="recorded", messages=messages, tools=TOOLS, options=options, stream=False)
    return [(m["role"], m["content"]) for m in engine.ran]


def test_the_kept_history_holds_the_system_message_and_the_latest_turns(recorded_context):
    engine, client, url = recorded_context
    engine.max_model_len = 4096
    messages = SYSTEM + exchanges(20, words=8)
    whole = prompt_that_ran(engine, client, messages)
    assert whole == [(m["role"], m["content"]) for m in messages]  # it fits: unchanged

    engine.max_model_len = 300
    kept = prompt_that_ran(engine, client, messages)
    assert kept[0] == ("system", SYSTEM[0]["content"]) and kept[-1] == whole[-1]
    assert kept[1][0] == "user" and kept[1:] == whole[-len(kept) + 1:] and len(kept) < len(whole) - 4
    streamed = ndjson(url, "/api/chat", {"model": "recorded", "messages": messages})
    assert [(m["role"], m["content"]) for m in engine.ran] == kept and streamed[-1]["done"]


def test_an_assistant_turn_is_dropped_with_its_tool_answers(recorded_context):
    engine, client, _ = recorded_context
    engine.max_model_len = 4096
    latest = exchanges(1, words=4)
    messages = SYSTEM + [{"role": "user", "content": "Hi"}] + OLLAMA_HISTORY[1:] + latest
    prompt_that_ran(engine, client, messages)
    # under num_ctx = the whole prompt, dropping "Hi" alone would fit, but would leave its call's answers first
    kept = prompt_that_ran(engine, client, messages, num_ctx=len(engine.prompt))
    assert kept == [(m["role"], m["content"]) for m in SYSTEM + latest]


def test_an_error_after_the_stream_started_is_an_error_line():
    with InProcessServer(lambda: ScriptedEngine(fail=True)) as srv:
        wait_for_health(srv.url, 200)
        lines = ndjson(srv.url, "/api/chat", {"model": "scripted", "messages": HELLO})
        assert [line.get("message", {}).get("content") for line in lines[:2]] == ["a", "b"]
        assert set(lines[2]) == {"error"} and "device fell off the bus" in lines[2]["error"] and len(lines) == 3
        with pytest.raises(ollama.ResponseError, match="device fell off the bus"):
            list(ollama.Client(host=srv.url).chat(model="scripted", messages=HELLO, stream=True))


# litellm's `ollama_chat/` and `ollama/` providers send their bodies without a Content-Type (and an empty
# `images`); FastAPI 0.165 read such a body as bytes, so each was a 400 "Input should be a valid dictionary"
LITELLM_CHAT = {"model": "recorded", "messages": [{"role": "user", "content": "Say hello in five words.",
                                                   "images": []}],
                "options": {"temperature": 0, "num_predict": 16}, "stream": False, "tools": TOOLS}
LITELLM_GENERATE = {"model": "recorded", "prompt": "### User:\nSay hello in five words.\n\n",
                    "options": {"temperature": 0, "num_predict": 16}, "stream": False, "images": []}


def test_litellms_bodies_without_a_content_type_are_read_as_json(recorded):
    engine, _, url = recorded
    engine.output = TWO_CALLS
    chat = httpx.post(f"{url}/api/chat", content=json.dumps(LITELLM_CHAT), timeout=60)
    assert "content-type" not in chat.request.headers
    assert chat.status_code == 200, chat.text
    calls = chat.json()["message"]["tool_calls"]
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in calls] == CALLS
    engine.output = "Hello there."
    generate = httpx.post(f"{url}/api/generate", content=json.dumps(LITELLM_GENERATE), timeout=60)
    assert generate.status_code == 200 and generate.json()["response"] == "Hello there.", generate.text
    openai_chat = httpx.post(f"{url}/v1/chat/completions", content=json.dumps(
        {"model": "recorded", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}), timeout=60)
    assert openai_chat.status_code == 200, openai_chat.text
