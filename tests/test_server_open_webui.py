"""Open WebUI's chat actions, replayed: the bodies Open WebUI 0.12.4 sent moe-serve when a user clicked them
(recorded by `bench/open_webui_browser.py --actions`, the model renamed), on the real server
test_server_infill.py uses.

"Continue Response" sends the conversation ending with the partial assistant answer (the 36 tools of Open
WebUI's built-in tools too, which this template cannot take): the answer must continue that message, as
Ollama and llama.cpp's server do, not open a new assistant turn after it. A PNG attached to a message reaches
the server as an `image_url` part: a 400 whose message (which Open WebUI shows in the chat) says why."""

from __future__ import annotations

import json
from pathlib import Path

import httpx

from engine.api import InvalidRequestError
from server.testing import sse_json
from tests import test_server_infill as infill
from tests.test_server_faults import InProcessServer, ScriptedEngine, wait_for_health
from tests.test_server_fim import MODEL

CLIENTS = Path(__file__).parent / "fixtures" / "clients"
server, http, tokenizer = infill.server, infill.http, infill.tokenizer  # the same fixtures, the same server
TOKENS = 4


def recorded(name: str, **changes) -> dict:
    return {**json.loads((CLIENTS / f"open_webui_{name}.json").read_text()), "model": MODEL, **changes}


def prompt_tokens(http, body: dict) -> int:
    answer = http.post("/v1/chat/completions", json={**body, "stream": False, "max_tokens": TOKENS})
    assert answer.status_code == 200, answer.text
    return answer.json()["usage"]["prompt_tokens"]


def rendered(tokenizer, messages: list[dict], continued: bool) -> int:
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=not continued,
                                         continue_final_message=continued, tokenize=False)
    return len(infill.text_ids(tokenizer, text))


def test_continue_response_continues_the_partial_answer(http, tokenizer):
    body = recorded("continue_response")
    *_, partial = body["messages"]
    assert partial["role"] == "assistant" and partial["content"].startswith("Once upon a time")  # as it sent it
    with http.stream("POST", "/v1/chat/completions", json={**body, "max_tokens": TOKENS}) as stream:
        assert stream.status_code == 200, stream.read()
        *chunks, done = list(sse_json(stream.iter_lines()))
    assert done == "[DONE]" and all(chunk["choices"][0]["delta"].get("role") in (None, "assistant")
                                    for chunk in chunks if chunk["choices"])
    # the prompt ends inside the partial answer: no end of its turn, no new assistant turn opened
    assert prompt_tokens(http, body) == rendered(tokenizer, body["messages"], continued=True)
    assert rendered(tokenizer, body["messages"], continued=True) < rendered(tokenizer, body["messages"], False)


def test_tokenize_counts_the_messages_as_the_chat_reads_them(http, tokenizer):
    messages = recorded("continue_response")["messages"]
    for continued in (True, False):
        body = {"model": MODEL, "messages": messages, "continue_final_message": None if continued else False}
        answer = http.post("/tokenize", json=body)
        assert answer.status_code == 200, answer.text
        assert answer.json()["count"] == rendered(tokenizer, messages, continued=continued)


def test_continue_final_message_false_opens_a_new_turn(http, tokenizer):
    body = recorded("continue_response", continue_final_message=False)  # vLLM's default, asked for
    assert prompt_tokens(http, body) == rendered(tokenizer, body["messages"], continued=False)


def test_continue_final_message_needs_a_partial_answer(http):
    body = recorded("continue_response", continue_final_message=True)
    body["messages"] = body["messages"][:-1]  # ends with the user's question
    answer = http.post("/v1/chat/completions", json={**body, "max_tokens": TOKENS})
    assert answer.status_code == 400
    assert answer.json()["error"]["param"] == "continue_final_message"
    both = recorded("continue_response", continue_final_message=True, add_generation_prompt=True)  # vLLM: 400 too
    assert http.post("/v1/chat/completions", json={**both, "max_tokens": TOKENS}).status_code == 400


def test_an_attached_image_is_a_400_that_says_the_model_is_text_only(http):
    body = recorded("image")
    *_, parts = body["messages"][-1]["content"]  # Open WebUI: the file's note, the question, the image
    assert parts["type"] == "image_url" and parts["image_url"]["url"].startswith("data:image/png;base64,")
    answer = http.post("/v1/chat/completions", json=body)
    assert answer.status_code == 400  # before any stream starts: Open WebUI shows the message in the chat
    error = answer.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == "messages[6].content"
    assert "images are not supported" in error["message"] and "text-only" in error["message"]


def test_ollama_chat_continues_the_partial_answer_too(http, tokenizer):
    """The same conversation through `/api/chat` (Open WebUI's Ollama connection; Ollama itself continues a last
    assistant message): the messages of the recorded body, in Ollama's request shape."""
    messages = recorded("continue_response")["messages"]
    answer = http.post("/api/chat", json={"model": MODEL, "messages": messages, "stream": False,
                                          "options": {"num_predict": TOKENS}})
    assert answer.status_code == 200, answer.text
    assert answer.json()["prompt_eval_count"] == rendered(tokenizer, messages, continued=True)


class NoContinuationEngine(ScriptedEngine):
    """A template that cannot end inside the last message (it rewrites the assistant's text, say): rendering a
    continuation fails as transformers fails it, a new turn renders; `rendered` keeps which one each got."""

    def __init__(self) -> None:
        super().__init__(fail=False)
        self.rendered: list[bool] = []

    def apply_chat_template(self, messages, tools=None, template_kwargs=None, continue_final=False) -> list[int]:
        if continue_final:
            raise InvalidRequestError("the chat template rejected the messages: the final message does not "
                                      "appear in the chat", param="messages")
        self.rendered.append(continue_final)
        return [1, 2, 3]


def test_a_template_that_cannot_continue_opens_a_new_turn_unless_asked():
    engine = NoContinuationEngine()
    partial = {"messages": [{"role": "user", "content": "Tell a story"},
                            {"role": "assistant", "content": "Once upon a time"}]}
    with InProcessServer(lambda: engine) as srv:
        wait_for_health(srv.url, 200)
        answer = httpx.post(f"{srv.url}/v1/chat/completions", json=partial)  # continuation not asked: a new turn
        assert answer.status_code == 200 and answer.json()["choices"][0]["message"]["content"] == "ab"
        assert engine.rendered == [False]
        asked = httpx.post(f"{srv.url}/v1/chat/completions", json={**partial, "continue_final_message": True})
        assert asked.status_code == 400 and "final message" in asked.json()["error"]["message"]
