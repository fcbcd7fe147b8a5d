"""The Responses API (`/v1/responses`), driven by the openai SDK and by raw httpx.

- A real server on a tiny random Mixtral: greedy text and usage equal chat completions', the stream's
  events in order, `previous_response_id`, GET and DELETE, `max_output_tokens`, JSON output, bad input,
  output_text logprobs (chat's for the same greedy request, streamed and whole alike).
- A scripted engine (tests/test_server_tools.py's, with a thinking template): tool calls and reasoning
  come back as output items, streamed and whole, and tool history reaches the chat template; logprobs
  leave out the thinking's and the calls' tokens.
"""

from __future__ import annotations

import json
import re

import httpx
import jsonschema
import openai
import pytest
from openai.types.responses import ResponseCustomToolCall, ResponseFunctionToolCall

from server import responses_protocol as rp
from server.errors import APIError
from server.responses import ResponseStore, StoredResponse
from server.responses_format import ResponsesFormat
from server.testing import RemoteServer, sse_data
from server.tools import WARNING_HEADER
from tests.test_server_faults import InProcessServer, wait_for_health
from tests.test_server_tools import ASK, TOOLS, TWO_CALLS, ThinkingRecordedEngine

MODEL = "tiny-mixtral"
ONE_THREAD = {"OMP_NUM_THREADS": "1"}
ERROR_KEYS = {"message", "type", "param", "code"}
QUESTION = "Hello, who are you?"
BRIEF = "Answer briefly."
FLAT_TOOLS = [{"type": "function", **tool["function"]} for tool in TOOLS]  # Responses' tool shape


# -- a real server on a tiny random model -----------------------------------------------------
@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from tests.fixtures.models import build_checkpoint

    folder = build_checkpoint("mixtral", tmp_path_factory.mktemp("tiny-mixtral-responses"))
    with RemoteServer(["--model", str(folder), "--served-model-name", MODEL, "--device", "cpu"],
                      env=ONE_THREAD) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return server.openai()


@pytest.fixture(scope="module")
def http(server):
    with server.http() as c:
        yield c


def stream_events(http: httpx.Client, body: dict) -> list[tuple[str, dict]]:
    """(event name, data) of each event of a streamed response; the raw data must all be JSON (no [DONE])."""
    with http.stream("POST", "/v1/responses", json={**body, "stream": True}) as response:
        assert response.status_code == 200, response.read()
        assert response.headers["content-type"].startswith("text/event-stream")
        lines = list(response.iter_lines())
    names = [line.partition(":")[2].strip() for line in lines if line.startswith("event:")]
    data = list(sse_data(iter(lines)))
    assert "[DONE]" not in data and len(names) == len(data)
    return list(zip(names, (json.loads(d) for d in data), strict=True))


def shape(types: list[str]) -> str:
    """The event types in order, each run of deltas written once: `a b delta+ c`."""
    return re.sub(r"(\S+\.delta)( \1)+", r"\1+", " ".join(types))


def test_greedy_text_and_usage_equal_chat_completions(client):
    response = client.responses.create(model=MODEL, input=QUESTION, instructions=BRIEF, temperature=0,
                                       max_output_tokens=12)
    chat = client.chat.completions.create(model=MODEL, temperature=0, max_tokens=12, messages=[
        {"role": "system", "content": BRIEF}, {"role": "user", "content": QUESTION}])

    assert response.object == "response" and response.id.startswith("resp_") and response.model == MODEL
    assert response.output_text == chat.choices[0].message.content and response.output_text
    (message,) = response.output
    assert message.type == "message" and message.role == "assistant" and message.id.startswith("msg_")
    assert message.content[0].type == "output_text" and message.content[0].annotations == []
    usage = response.usage
    assert (usage.input_tokens, usage.output_tokens, usage.total_tokens) == (
        chat.usage.prompt_tokens, chat.usage.completion_tokens, chat.usage.total_tokens)
    assert usage.input_tokens_details.cached_tokens == 0 and usage.output_tokens_details.reasoning_tokens == 0
    cut = chat.choices[0].finish_reason == "length"
    assert response.status == ("incomplete" if cut else "completed")
    assert (response.instructions, response.max_output_tokens, response.temperature) == (BRIEF, 12, 0)
    assert response.error is None and response.store is True and response.tools == []


def test_stream_events_in_order_and_their_text_is_the_whole_response(client, http):
    body = {"model": MODEL, "input": QUESTION, "temperature": 0, "max_output_tokens": 10}
    whole = client.responses.create(**body)
    events = stream_events(http, body)

    names, data = [name for name, _ in events], [d for _, d in events]
    assert names == [d["type"] for d in data]
    assert [d["sequence_number"] for d in data] == list(range(len(data)))
    final = "response.incomplete" if whole.status == "incomplete" else "response.completed"
    assert shape(names) == ("response.created response.in_progress response.output_item.added "
                            "response.content_part.added response.output_text.delta+ response.output_text.done "
                            f"response.content_part.done response.output_item.done {final}")
    created = data[0]["response"]
    assert created["status"] == "in_progress" and created["output"] == [] and created["usage"] is None
    item_id = data[2]["item"]["id"]
    deltas = [d for d in data if d["type"] == "response.output_text.delta"]
    assert all(d["item_id"] == item_id and (d["output_index"], d["content_index"], d["logprobs"]) == (0, 0, [])
               for d in deltas)
    text = "".join(d["delta"] for d in deltas)
    assert text == data[-4]["text"] == data[-3]["part"]["text"] == whole.output_text
    done = data[-1]["response"]
    assert done["id"] == created["id"] and done["output"] == [data[-2]["item"]]
    assert done["output"][0]["content"][0]["text"] == text and done["usage"] == whole.usage.to_dict()
    assert http.get(f"/v1/responses/{done['id']}").json() == done  # a streamed response is stored too


def test_sdk_consumes_the_stream(client):
    body = {"model": MODEL, "input": QUESTION, "temperature": 0, "max_output_tokens": 8}
    whole = client.responses.create(**body)
    events = list(client.responses.create(**body, stream=True))
    assert type(events[0]).__name__ == "ResponseCreatedEvent"
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == whole.output_text and events[-1].response.output_text == text
    assert events[-1].response.usage == whole.usage


# -- logprobs: include ["message.output_text.logprobs"] -----------------------------------------
LOGPROBS = {"model": MODEL, "input": QUESTION, "instructions": BRIEF, "temperature": 0, "max_output_tokens": 8,
            "include": [rp.LOGPROBS_INCLUDE], "top_logprobs": 2}


def test_output_text_logprobs_are_chat_completions_for_the_same_greedy_request(client):
    # ignore_eos: every output token is answer text
    response = client.responses.create(**LOGPROBS, extra_body={"ignore_eos": True})
    messages = [{"role": "system", "content": BRIEF}, {"role": "user", "content": QUESTION}]
    chat = client.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=8,
                                          logprobs=True, top_logprobs=2, extra_body={"ignore_eos": True})
    logprobs = response.output[0].content[0].logprobs
    assert len(logprobs) == response.usage.output_tokens == 8
    # the engine decodes each token alone, so a SentencePiece token loses its leading space
    assert "".join(lp.token for lp in logprobs).replace(" ", "") == response.output_text.replace(" ", "")
    assert all(lp.logprob <= 0 and len(lp.top_logprobs) == 2 for lp in logprobs)
    assert all(lp.top_logprobs[0].logprob >= lp.top_logprobs[1].logprob for lp in logprobs)
    content = chat.choices[0].logprobs.content
    assert [(lp.token, lp.bytes, [top.token for top in lp.top_logprobs]) for lp in logprobs] == [
        (t.token, t.bytes, [top.token for top in t.top_logprobs]) for t in content]
    # float32 on CPU: two runs of the same request may differ in the last bits
    values = [[lp.logprob] + [top.logprob for top in lp.top_logprobs] for lp in logprobs]
    assert values == [pytest.approx([t.logprob] + [top.logprob for top in t.top_logprobs], abs=1e-4)
                      for t in content]


def test_streamed_logprobs_add_up_to_the_whole_list(client, http):
    whole = client.responses.create(**LOGPROBS).model_dump()["output"][0]["content"][0]["logprobs"]
    data = [d for _, d in stream_events(http, LOGPROBS)]
    deltas = [d for d in data if d["type"] == "response.output_text.delta"]
    (done,) = [d for d in data if d["type"] == "response.output_text.done"]
    final = data[-1]["response"]["output"][0]["content"][0]["logprobs"]
    assert whole and [lp for d in deltas for lp in d["logprobs"]] == done["logprobs"] == final == whole
    assert all(len(lp["top_logprobs"]) == 2 for lp in whole)


@pytest.mark.parametrize("extra", [{"top_logprobs": 3}, {"include": [rp.LOGPROBS_INCLUDE]}])
def test_logprobs_only_where_include_asks_and_top_logprobs_defaults_to_none(client, extra):
    body = {"model": MODEL, "input": QUESTION, "temperature": 0, "max_output_tokens": 4, **extra}
    logprobs = client.responses.create(**body).output[0].content[0].logprobs
    if "include" in extra:  # as OpenAI: top_logprobs alone returns none
        assert len(logprobs) == 4 and all(lp.top_logprobs == [] and lp.logprob <= 0 for lp in logprobs)
    else:
        assert logprobs == []


def test_max_output_tokens_cuts_the_response_incomplete(client, http):
    body = {"model": MODEL, "input": QUESTION, "max_output_tokens": 3, "extra_body": {"ignore_eos": True}}
    response = client.responses.create(**body)
    assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"
    assert response.usage.output_tokens == 3 and response.output[0].status == "incomplete"
    events = stream_events(http, {"input": QUESTION, "max_output_tokens": 3, "ignore_eos": True})
    name, last = events[-1]
    assert name == "response.incomplete" and last["response"]["incomplete_details"] == {"reason": "max_output_tokens"}


def test_previous_response_id_continues_the_conversation(client, http):
    first = client.responses.create(model=MODEL, input=QUESTION, instructions=BRIEF, temperature=0,
                                    max_output_tokens=6)
    second = client.responses.create(model=MODEL, input="And what can you do?", previous_response_id=first.id,
                                     temperature=0, max_output_tokens=6)
    # the earlier turns, without the earlier instructions (as OpenAI documents)
    chat = client.chat.completions.create(model=MODEL, temperature=0, max_tokens=6, messages=[
        {"role": "user", "content": QUESTION}, {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "And what can you do?"}])
    assert second.previous_response_id == first.id
    assert second.usage.input_tokens == chat.usage.prompt_tokens > first.usage.input_tokens
    assert second.output_text == chat.choices[0].message.content

    assert client.responses.retrieve(first.id).model_dump() == first.model_dump()
    deleted = http.delete(f"/v1/responses/{first.id}")
    assert deleted.status_code == 200 and deleted.json() == {"id": first.id, "object": "response", "deleted": True}
    for method in ("GET", "DELETE"):
        gone = http.request(method, f"/v1/responses/{first.id}")
        assert gone.status_code == 404 and gone.json()["error"]["code"] == "not_found"
    bad_tool_output = [{"type": "function_call_output", "output": "x"}]  # no call_id: named as in this input
    response = http.post("/v1/responses", json={"input": bad_tool_output, "previous_response_id": second.id})
    assert response.status_code == 400 and response.json()["error"]["param"] == "input[0].call_id"
    with pytest.raises(openai.NotFoundError) as e:
        client.responses.create(model=MODEL, input="Hi", previous_response_id=first.id)
    assert e.value.body["param"] == "previous_response_id"


def test_the_store_keeps_the_most_recently_used_within_its_count_and_bytes():
    def stored(text: str) -> StoredResponse:
        return StoredResponse(rp.ResponseObject(id=rp.item_id("resp"), model="m"), [rp.InputItem(role="user", content=text)])

    base = stored("").size()
    small = [stored("hi") for _ in range(3)]
    store = ResponseStore(capacity=2, max_bytes=3 * base + 5_000)
    for entry in small:
        store.put(entry)
    assert store.get(small[0].response.id) is None and store.get(small[1].response.id) is small[1]
    store.put(big := stored("x" * 5_000))  # a third: the least recently used goes
    assert store.get(small[2].response.id) is None and store.get(small[1].response.id) is small[1]
    store.put(huge := stored("x" * (3 * base + 6_000)))  # alone over the bytes: kept, so that it can be continued
    assert [store.get(e.response.id) for e in (small[1], big, huge)] == [None, None, huge]
    assert store.bytes == huge.size() and store.delete(huge.response.id) and store.bytes == 0


def test_store_false_keeps_nothing(client, http):
    response = client.responses.create(model=MODEL, input=QUESTION, max_output_tokens=2, store=False)
    assert response.store is False and http.get(f"/v1/responses/{response.id}").status_code == 404


PLAN = {"type": "object", "properties": {"unit": {"enum": ["celsius", "fahrenheit"]}, "days": {"enum": [1, 2, 3]}},
        "required": ["unit", "days"], "additionalProperties": False}


def test_text_format_json_schema_gives_valid_json(client):
    text = {"format": {"type": "json_schema", "name": "plan", "schema": PLAN, "strict": True}}
    for seed in range(2):
        response = client.responses.create(model=MODEL, input=QUESTION, text=text, max_output_tokens=40,
                                           temperature=1.0, extra_body={"seed": seed})
        assert response.status == "completed"
        jsonschema.validate(json.loads(response.output_text), PLAN)
        assert response.text.format.type == "json_schema"


@pytest.mark.parametrize("body, status, param", [
    ({"tools": [{"type": "function", "parameters": {}}]}, 400, "tools[0].name"),
    ({"tools": [{"type": "namespace", "name": "n", "tools": [{"type": "web_search"}]}]}, 400, "tools[0].tools[0].type"),
    ({"tools": [FLAT_TOOLS[0], {**FLAT_TOOLS[0], "description": "again"}]}, 400, "tools[1].name"),
    ({"tools": [{"type": "custom", "name": "patch", "format": {"type": "grammar", "syntax": "ebnf"}}]}, 400,
     "tools[0].format.syntax"),
    ({"background": True}, 400, "background"),
    ({"max_output_tokens": -1}, 400, "max_output_tokens"),
    ({"max_output_tokens": 10**6}, 400, "input"),  # the context's room: as chat's, named after the prompt
    ({"max_output_tokens": "5"}, 400, "max_output_tokens"),
    ({"input": ""}, 400, "input"),
    ({"input": []}, 400, "input"),
    ({"input": [{"role": "robot", "content": "hi"}]}, 400, "input[0].role"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, 400,
     "input[0].content[0]"),
    ({"input": [{"type": "function_call_output", "output": "14:05"}]}, 400, "input[0].call_id"),
    ({"input": [{"type": "function_call", "call_id": "c", "arguments": "{}"}]}, 400, "input[0].name"),
    ({"text": {"format": {"type": "json_schema", "name": "x"}}}, 400, "text.format.schema"),
    ({"text": {"format": {"type": "xml"}}}, 400, "text.format.type"),
    ({"reasoning": {"effort": "extreme"}}, 400, "reasoning.effort"),
    ({"tool_choice": "required"}, 400, "tool_choice"),
    ({"tools": FLAT_TOOLS, "tool_choice": {"type": "function", "name": "nope"}}, 400, "tool_choice"),
    ({"temperature": -1}, 400, "temperature"),
    ({"include": ["message.output_text.logprobs"], "top_logprobs": 21}, 400, "top_logprobs"),
    ({"top_logprobs": -1}, 400, "top_logprobs"),
    ({"previous_response_id": "resp_unknown"}, 404, "previous_response_id"),
    ({"model": "another-model"}, 404, "model"),
])
def test_bad_requests_are_openai_shaped_errors_naming_the_field(http, body, status, param):
    response = http.post("/v1/responses", json={"input": QUESTION, **body})
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == ERROR_KEYS and error["message"] and error["param"] == param, error


def test_hosted_tools_are_left_out_with_a_warning(http):
    """Codex declares OpenAI's hosted tools with its own: the request is answered without them."""
    tools = [{"type": "web_search"}, {"type": "file_search", "vector_store_ids": ["vs_1"]}, {"type": "web_search"}]
    response = http.post("/v1/responses", json={"input": QUESTION, "max_output_tokens": 2, "tools": tools})
    assert response.status_code == 200, response.text
    assert response.headers[WARNING_HEADER].endswith("not offered to the model: 'web_search', 'file_search'")
    assert [tool["type"] for tool in response.json()["tools"]] == ["web_search", "file_search", "web_search"]


def test_a_warning_quoting_the_request_is_a_valid_header(http):
    """Found by schemathesis: a tool type of "" ended the header in a space, which h11 refuses; the server then
    closed the connection without an answer. Types with a line break or non-ASCII are quoted escaped."""
    tools = [{"type": ""}, {"type": "wéb\nsearch"}, {"type": "日本"}]
    response = http.post("/v1/responses", json={"input": QUESTION, "max_output_tokens": 2, "tools": tools})
    assert response.status_code == 200, response.text
    assert response.headers[WARNING_HEADER].endswith(
        "not offered to the model: '', 'w\\xe9b\\nsearch', '\\u65e5\\u672c'")


def test_a_long_input_is_refused_against_the_input(http):
    response = http.post("/v1/responses", json={"input": "word " * 2000})
    error = response.json()["error"]
    assert response.status_code == 400, error
    assert error["code"] == "context_length_exceeded" and error["param"] == "input" and "input" in error["message"], error


# -- a scripted engine: tool calls and reasoning ------------------------------------------------
THOUGHT = "I need the weather and the time."
THINK_THEN_CALL = f"<think>{THOUGHT}</think>\n\n{TWO_CALLS}"


@pytest.fixture(scope="module")
def recorded():
    engine = ThinkingRecordedEngine()
    with InProcessServer(lambda: engine) as srv:
        wait_for_health(srv.url, 200)
        yield engine, openai.OpenAI(base_url=f"{srv.url}/v1", api_key="x", max_retries=0), srv.url


def check_calls(response) -> None:
    """THINK_THEN_CALL's output items: the thinking, the text, the two calls."""
    reasoning, message, *calls = response.output
    assert reasoning.type == "reasoning" and reasoning.id.startswith("rs_") and reasoning.summary == []
    assert [part.text for part in reasoning.content] == [THOUGHT]
    assert message.type == "message" and response.output_text == "I will look both up."
    assert all(isinstance(c, ResponseFunctionToolCall) for c in calls)
    assert [(c.name, json.loads(c.arguments), c.status) for c in calls] == [
        ("get_weather", {"city": "Paris"}, "completed"), ("get_time", {}, "completed")]
    assert all(c.call_id.startswith("call_") and c.id.startswith("fc_") for c in calls)
    assert response.status == "completed" and response.usage.output_tokens_details.reasoning_tokens > 0


def test_calls_and_reasoning_come_back_as_output_items_whole_and_streamed(recorded):
    engine, client, _ = recorded
    engine.output = THINK_THEN_CALL
    whole = client.responses.create(model="recorded", input=ASK, tools=FLAT_TOOLS)
    assert engine.tools == TOOLS  # offered to the template in the chat shape
    with client.responses.stream(model="recorded", input=ASK, tools=FLAT_TOOLS) as stream:
        streamed = stream.get_final_response()
    for response in (whole, streamed):
        check_calls(response)
    assert streamed.usage == whole.usage
    assert [t.name for t in whole.tools] == ["get_weather", "get_time"]


def test_streamed_calls_and_reasoning_events(recorded):
    engine, _, url = recorded
    engine.output = THINK_THEN_CALL
    with httpx.Client(base_url=url) as http:
        events = stream_events(http, {"input": ASK, "tools": FLAT_TOOLS})
    names, data = [name for name, _ in events], [d for _, d in events]
    item = ("response.output_item.added response.function_call_arguments.delta "
            "response.function_call_arguments.done response.output_item.done")
    assert shape(names) == (
        "response.created response.in_progress "
        "response.output_item.added response.content_part.added response.reasoning_text.delta+ "
        "response.reasoning_text.done response.content_part.done response.output_item.done "
        "response.output_item.added response.content_part.added response.output_text.delta+ "
        "response.output_text.done response.content_part.done response.output_item.done "
        f"{item} {item} response.completed")
    thought = "".join(d["delta"] for d in data if d["type"] == "response.reasoning_text.delta")
    assert thought == THOUGHT
    assert [d["output_index"] for d in data if d["type"] == "response.output_item.done"] == [0, 1, 2, 3]
    arguments = [d for d in data if d["type"] == "response.function_call_arguments.done"]
    assert [(a["name"], a["arguments"]) for a in arguments] == [("get_weather", '{"city": "Paris"}'),
                                                                ("get_time", "{}")]
    added = [d["item"] for d in data if d["type"] == "response.output_item.added"]
    assert added[2]["status"] == "in_progress" and added[2]["arguments"] == ""  # as it was when added
    assert [d["sequence_number"] for d in data] == list(range(len(data)))


def test_output_text_logprobs_leave_out_the_thinking_and_the_calls(recorded):
    engine, client, url = recorded
    engine.output = THINK_THEN_CALL
    body = {"model": "recorded", "input": ASK, "tools": FLAT_TOOLS, "include": [rp.LOGPROBS_INCLUDE]}
    whole = client.responses.create(**body)
    check_calls(whole)
    (message,) = [item for item in whole.output if item.type == "message"]
    logprobs = message.content[0].logprobs
    tokens = [lp.token for lp in logprobs]
    # the text before the first call, its last token with the newline the call parser drops
    assert "".join(tokens) == whole.output_text + "\n" and all(lp.logprob == -0.5 for lp in logprobs)
    assert engine.params.top_logprobs == 0
    with httpx.Client(base_url=url) as http:
        data = [d for _, d in stream_events(http, body)]
    streamed = [lp["token"] for d in data if d["type"] == "response.output_text.delta" for lp in d["logprobs"]]
    assert streamed == tokens
    assert all("logprobs" not in d for d in data if d["type"].startswith("response.reasoning_text."))


def test_function_call_outputs_reach_the_template_as_tool_turns(recorded):
    engine, client, _ = recorded
    engine.output = THINK_THEN_CALL
    first = client.responses.create(model="recorded", input=ASK, tools=FLAT_TOOLS)
    calls = [item for item in first.output if item.type == "function_call"]
    results = [{"type": "function_call_output", "call_id": calls[0].call_id, "output": '{"temperature": 21}'},
               {"type": "function_call_output", "call_id": calls[1].call_id, "output": "14:05"}]
    engine.output = "It is 21 degrees; the time is 14:05."
    history = ASK + [item.model_dump(exclude_none=True) for item in first.output] + results
    by_input = client.responses.create(model="recorded", input=history, tools=FLAT_TOOLS)
    sent = engine.messages
    by_id = client.responses.create(model="recorded", input=results, tools=FLAT_TOOLS, previous_response_id=first.id)

    assert by_input.output_text == by_id.output_text == engine.output and by_id.status == "completed"
    assert engine.messages == sent  # the stored conversation is the same history
    user, assistant, *tools = sent
    assert user == {"role": "user", "content": ASK[0]["content"]}
    assert assistant["role"] == "assistant" and assistant["content"] == "I will look both up."
    assert assistant["reasoning_content"] == THOUGHT  # the reasoning item: the assistant turn's thinking
    assert [(c["id"], c["function"]) for c in assistant["tool_calls"]] == [
        (calls[0].call_id, {"name": "get_weather", "arguments": '{"city": "Paris"}'}),
        (calls[1].call_id, {"name": "get_time", "arguments": "{}"})]
    assert tools == [
        {"role": "tool", "content": '{"temperature": 21}', "tool_call_id": calls[0].call_id, "name": "get_weather"},
        {"role": "tool", "content": "14:05", "tool_call_id": calls[1].call_id, "name": "get_time"}]


def test_instructions_and_message_items_become_chat_turns(recorded):
    engine, client, _ = recorded
    engine.output = "Fine."
    client.responses.create(model="recorded", instructions="Be brief.", input=[
        {"role": "developer", "content": "Use metric units."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "How "},
                                                        {"type": "input_text", "text": "warm?"}]},
        {"role": "assistant", "content": [{"type": "output_text", "text": "Where?"}]},
        {"role": "user", "content": "Paris."}])
    assert [(m["role"], m["content"]) for m in engine.messages] == [
        ("system", "Be brief."), ("developer", "Use metric units."), ("user", "How warm?"), ("assistant", "Where?"),
        ("user", "Paris.")]


@pytest.mark.parametrize("extra, calls", [({"parallel_tool_calls": False}, 1), ({"tool_choice": "none"}, 0)])
def test_parallel_tool_calls_and_tool_choice_pass_through(recorded, extra, calls):
    engine, client, _ = recorded
    engine.output = TWO_CALLS
    response = client.responses.create(model="recorded", input=ASK, tools=FLAT_TOOLS, **extra)
    assert sum(item.type == "function_call" for item in response.output) == calls
    assert (engine.tools is None) == (calls == 0)


@pytest.mark.parametrize("kind, name, other", [("function", "get_time", "get_weather"),
                                              ("custom", "apply_patch", "mcp__fs__read")])
def test_named_tool_choice_forces_that_call(recorded, kind, name, other):
    engine, client, _ = recorded
    engine.output = TWO_CALLS
    tools = FLAT_TOOLS if kind == "function" else CODEX_TOOLS
    client.responses.create(model="recorded", input=ASK, tools=tools, tool_choice={"type": kind, "name": name})
    assert f'"const": "{name}"' in engine.params.grammar and other not in engine.params.grammar


def test_an_error_after_the_stream_began_is_an_error_event_in_sequence():
    fmt = ResponsesFormat(rp.ResponseObject(id="resp_1", model="m"))
    opening = fmt.opening()
    event = fmt.error_event(APIError(503, "the server is shutting down", "server_error", code="server_shutdown"))
    assert [e.sequence_number for e in opening] == [0, 1] and event.event == "error"
    assert json.loads(event.data) == {"type": "error", "sequence_number": 2, "code": "server_shutdown",
                                      "message": "the server is shutting down", "param": None}


# -- Codex's tools: custom (freeform) tools and namespaces -------------------------------------
PATCH = "*** Begin Patch\n*** Add File: hello.txt\n+hello\n*** End Patch"
PATCH_GRAMMAR = 'start: "*** Begin Patch" /(.|\\n)+/ "*** End Patch"'
CODEX_TOOLS = [
    {"type": "custom", "name": "apply_patch", "description": "Edit files.",
     "format": {"type": "grammar", "syntax": "lark", "definition": PATCH_GRAMMAR}},
    {"type": "namespace", "name": "mcp__fs", "description": "Files.", "tools": [
        {"type": "function", "name": "read", "description": "Read a file.",
         "parameters": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}]},
    {"type": "web_search"},
]
CODEX_CALLS = ("<tool_call>\n" + json.dumps({"name": "apply_patch", "arguments": {"input": PATCH}}) + "\n</tool_call>\n"
               "<tool_call>\n" + json.dumps({"name": "mcp__fs__read", "arguments": {"path": "a.txt"}}) + "\n</tool_call>")


def check_codex_calls(response) -> None:
    custom, function = response.output
    assert isinstance(custom, ResponseCustomToolCall) and isinstance(function, ResponseFunctionToolCall)
    assert (custom.name, custom.input, custom.namespace) == ("apply_patch", PATCH, None)
    assert custom.id.startswith("ctc_") and custom.call_id.startswith("call_")
    assert (function.namespace, function.name, json.loads(function.arguments)) == ("mcp__fs", "read", {"path": "a.txt"})


def test_custom_and_namespaced_tools_are_offered_as_functions_and_calls_come_back_in_kind(recorded):
    engine, client, url = recorded
    engine.output = CODEX_CALLS
    whole = client.responses.create(model="recorded", input=ASK, tools=CODEX_TOOLS)
    offered = {tool["function"]["name"]: tool["function"] for tool in engine.tools}
    assert list(offered) == ["apply_patch", "mcp__fs__read"]  # web_search left out
    assert offered["apply_patch"]["parameters"]["properties"] == {"input": {"type": "string"}}
    assert offered["apply_patch"]["description"].startswith("Edit files.") and PATCH_GRAMMAR in (
        offered["apply_patch"]["description"])
    assert offered["mcp__fs__read"]["parameters"] == CODEX_TOOLS[1]["tools"][0]["parameters"]
    with client.responses.stream(model="recorded", input=ASK, tools=CODEX_TOOLS) as stream:
        streamed = stream.get_final_response()
    for response in (whole, streamed):
        check_codex_calls(response)

    with httpx.Client(base_url=url) as http:
        events = stream_events(http, {"input": ASK, "tools": CODEX_TOOLS})
    names, data = [name for name, _ in events], [d for _, d in events]
    assert shape(names) == (
        "response.created response.in_progress response.output_item.added response.custom_tool_call_input.delta "
        "response.custom_tool_call_input.done response.output_item.done response.output_item.added "
        "response.function_call_arguments.delta response.function_call_arguments.done response.output_item.done "
        "response.completed")
    added, done = data[2]["item"], data[5]["item"]
    assert (added["type"], added["input"], "namespace" in added) == ("custom_tool_call", "", False)
    assert data[4]["input"] == data[3]["delta"] == done["input"] == PATCH
    assert data[6]["item"]["namespace"] == "mcp__fs" and data[6]["item"]["name"] == "read"
    assert [d["sequence_number"] for d in data] == list(range(len(data)))


def test_custom_tool_history_reaches_the_template_as_tool_turns(recorded):
    engine, client, _ = recorded
    engine.output = CODEX_CALLS
    first = client.responses.create(model="recorded", input=ASK, tools=CODEX_TOOLS)
    custom, function = first.output
    results = [{"type": "custom_tool_call_output", "call_id": custom.call_id, "output": "Done!"},
               {"type": "function_call_output", "call_id": function.call_id, "output": "hello"}]
    engine.output = "The file is written."
    history = ASK + [item.model_dump(exclude_none=True) for item in first.output] + results
    client.responses.create(model="recorded", input=history, tools=CODEX_TOOLS)
    sent = engine.messages
    client.responses.create(model="recorded", input=results, tools=CODEX_TOOLS, previous_response_id=first.id)

    assert engine.messages == sent
    _, assistant, *tools = sent
    assert [(c["id"], c["function"]["name"], json.loads(c["function"]["arguments"])) for c in assistant["tool_calls"]] == [
        (custom.call_id, "apply_patch", {"input": PATCH}), (function.call_id, "mcp__fs__read", {"path": "a.txt"})]
    assert [(t["tool_call_id"], t["name"], t["content"]) for t in tools] == [
        (custom.call_id, "apply_patch", "Done!"), (function.call_id, "mcp__fs__read", "hello")]
