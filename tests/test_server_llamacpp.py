"""llama.cpp's own server API besides /infill, as its clients call it (SillyTavern's llama.cpp backend, scripts
using `/completion`): `/completion`, the llama.cpp shapes of `/tokenize` and `/detokenize`, and `/props`, on the
real server test_server_infill.py uses (tiny random Qwen3-MoE, Qwen2.5-Coder's tokenizer). The answers are
checked against `/v1/completions` and `/tokenize`'s vLLM shape on the same engine."""

from __future__ import annotations

import json
import math
from pathlib import Path

import httpx
import pytest

from engine.api import GenerationEvent
from server.llamacpp_routes import CompletionFormat
from server.testing import sse_json
from tests import test_server_infill as infill
from tests.test_server_fim import MODEL
from tests.test_server_infill import completion_of, forced, text_ids

PROMPT = "def fibonacci(n):\n    "
GREEDY = {"temperature": 0, "n_predict": 8}
server, tokenizer, http = infill.server, infill.tokenizer, infill.http  # the same fixtures, the same server


def completion(http: httpx.Client, path: str = "/completion", **body) -> dict:
    answer = http.post(path, json=body)
    assert answer.status_code == 200, answer.text
    return answer.json()


def test_the_greedy_content_is_v1_completions_text(http):
    answer = completion(http, prompt=PROMPT, **GREEDY)
    openai = completion_of(http, PROMPT)
    assert answer["content"] == openai["choices"][0]["text"]
    assert answer["tokens_evaluated"] == openai["usage"]["prompt_tokens"]
    assert answer["tokens_predicted"] == openai["usage"]["completion_tokens"]
    assert answer["stop"] is True and answer["model"] == MODEL and answer["truncated"] is False
    assert answer["stop_type"] == {"length": "limit", "stop": "eos"}[openai["choices"][0]["finish_reason"]]
    assert answer["timings"]["predicted_n"] == answer["tokens_predicted"]
    assert "completion_probabilities" not in answer


def test_completions_is_the_same_route(http):
    assert completion(http, "/completions", prompt=PROMPT, **GREEDY)["content"] == \
        completion(http, prompt=PROMPT, **GREEDY)["content"]


def test_a_token_id_prompt_is_the_text_prompt(http, tokenizer):
    ids = text_ids(tokenizer, PROMPT)  # Qwen's tokenizer adds no BOS
    by_text = completion(http, prompt=PROMPT, **GREEDY)
    by_ids = completion(http, prompt=ids, **GREEDY)
    assert by_ids["content"] == by_text["content"] and by_ids["tokens_evaluated"] == len(ids)
    head, tail = "def fibonacci(n):", "\n    "
    mixed = completion(http, prompt=[head, *text_ids(tokenizer, tail)], **GREEDY)
    assert mixed["tokens_evaluated"] == len(text_ids(tokenizer, head)) + len(text_ids(tokenizer, tail))


def test_streamed_pieces_make_the_whole_answer(http):
    whole = completion(http, prompt=PROMPT, **GREEDY)
    with http.stream("POST", "/completion", json={"prompt": PROMPT, "stream": True, **GREEDY}) as stream:
        assert stream.status_code == 200 and stream.headers["content-type"].startswith("text/event-stream")
        events = list(sse_json(stream.iter_lines()))
    assert "[DONE]" not in events
    *pieces, last = events
    assert pieces and all(piece["stop"] is False for piece in pieces)
    assert "".join(piece["content"] for piece in pieces) == whole["content"]
    assert last["stop"] is True and last["content"] == "" and last["tokens_predicted"] == whole["tokens_predicted"]


def test_n_predict_and_a_stop_word(http, tokenizer):
    limited = completion(http, prompt=PROMPT, n_predict=3, **forced(tokenizer, "x"))
    assert limited["content"] == "xxx" and limited["tokens_predicted"] == 3 and limited["stop_type"] == "limit"
    stopped = completion(http, prompt=PROMPT, n_predict=8, stop=["xxx"], **forced(tokenizer, "x"))
    assert stopped["stop_type"] == "word" and stopped["stopping_word"] == "xxx" and stopped["content"] == ""
    nothing = completion(http, prompt=PROMPT, n_predict=0)
    assert nothing["content"] == "" and nothing["tokens_predicted"] == 0
    assert nothing["tokens_evaluated"] == len(text_ids(tokenizer, PROMPT))


def test_n_probs_gives_completion_probabilities(http, tokenizer):
    answer = completion(http, prompt=PROMPT, n_probs=3, **GREEDY)
    openai = completion_of(http, PROMPT, logprobs=3)["choices"][0]["logprobs"]
    probs = answer["completion_probabilities"]
    assert len(probs) == answer["tokens_predicted"]
    assert "".join(prob["token"] for prob in probs) == answer["content"]
    for prob, logprob in zip(probs, openai["token_logprobs"]):
        assert len(prob["top_logprobs"]) == 3 and math.isclose(prob["logprob"], logprob, abs_tol=1e-4)
        assert bytes(prob["bytes"]).decode() == prob["token"]
        assert prob["top_logprobs"][0]["logprob"] >= prob["top_logprobs"][-1]["logprob"]
    with http.stream("POST", "/completion", json={"prompt": PROMPT, "stream": True, "n_probs": 3,
                                                   **GREEDY}) as stream:
        *pieces, _ = list(sse_json(stream.iter_lines()))
    assert [prob for piece in pieces for prob in piece["completion_probabilities"]] == probs


def test_tokenize_in_llama_cpp_shape(http, tokenizer):
    text = "Hello there, friend"
    vllm = http.post("/tokenize", json={"prompt": text}).json()
    llama = http.post("/tokenize", json={"content": text}).json()
    assert llama == {"tokens": text_ids(tokenizer, text)} and llama["tokens"] == vllm["tokens"]
    pieces = http.post("/tokenize", json={"content": text, "with_pieces": True}).json()["tokens"]
    assert [piece["id"] for piece in pieces] == llama["tokens"] and "".join(p["piece"] for p in pieces) == text
    # Qwen's tokenizer has no BOS: add_special adds nothing to it
    special = http.post("/tokenize", json={"content": text, "add_special": True}).json()["tokens"]
    assert tokenizer.bos_token is None and special == tokenizer(text)["input_ids"] == llama["tokens"]


def test_a_piece_of_a_character_is_its_bytes(http, tokenizer):
    text = "𠀋"  # three byte-level tokens, none a whole character
    ids = text_ids(tokenizer, text)
    pieces = http.post("/tokenize", json={"content": text, "with_pieces": True}).json()["tokens"]
    assert len(ids) > 1 and all(isinstance(p["piece"], list) for p in pieces)
    assert bytes(b for piece in pieces for b in piece["piece"]) == text.encode()


def test_detokenize_answers_both_names(http):
    tokens = http.post("/tokenize", json={"content": PROMPT}).json()["tokens"]
    answer = http.post("/detokenize", json={"tokens": tokens}).json()
    assert answer == {"prompt": PROMPT, "content": PROMPT}


def test_props(http, server, tokenizer):
    props = http.get("/props").json()
    (card,) = http.get("/v1/models").json()["data"]
    settings = props["default_generation_settings"]
    assert settings["n_ctx"] == card["max_model_len"] and props["total_slots"] == 1
    assert settings["params"]["n_predict"] == -1 and settings["params"]["temperature"] >= 0
    assert props["chat_template"] == tokenizer.chat_template and props["model_alias"] == MODEL
    assert props["build_info"].startswith("moe-serve ") and props["eos_token"] == tokenizer.eos_token
    assert props["model_path"]


def test_props_cannot_be_changed(http):
    answer = http.post("/props", json={})
    assert answer.status_code == 405 and answer.json()["error"]["message"]


@pytest.mark.parametrize("path, body, param", [
    ("/completion", {"prompt": 5}, "prompt"),
    ("/completion", {"prompt": [1.5]}, "prompt"),
    ("/completion", {"prompt": [10**9]}, "prompt"),
    ("/completion", {"prompt": ""}, "prompt"),
    ("/completion", {"prompt": ["one", "two"]}, "prompt"),
    ("/completion", {"prompt": [[1, 2], [3]]}, "prompt"),
    ("/completion", {"prompt": "x", "n_predict": -2}, "n_predict"),
    ("/completion", {"prompt": "x", "n_probs": 50}, "n_probs"),
    ("/completion", {"prompt": "x", "n_probs": "3"}, "n_probs"),
    ("/completion", {"prompt": "x", "n": 2}, "n"),
    ("/tokenize", {"content": 5}, "content"),
    ("/tokenize", {"content": "x", "prompt": "x"}, "content"),
    ("/tokenize", {"content": "x", "with_pieces": "yes"}, "with_pieces"),
])
def test_bad_input_is_a_400_naming_the_field(http, path, body, param):
    answer = http.post(path, json=body)
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert error["param"] is not None and error["param"].startswith(param), error


# -- SillyTavern's llama.cpp backend (bench/sillytavern_browser.py recorded the body, the prompt shortened) ----
SILLYTAVERN = Path(__file__).parent / "fixtures" / "clients" / "sillytavern_llamacpp_completion.json"


def sillytavern_body(**changes) -> dict:
    return {**json.loads(SILLYTAVERN.read_text()), **changes}


def test_sillytavern_s_streamed_completion_is_answered(http):
    body = sillytavern_body(model=MODEL, n_predict=4, max_tokens=4)
    assert body["logit_bias"] == [] and body["stream"] is True  # as SillyTavern sends it: llama.cpp's list form
    with http.stream("POST", "/completion", json=body) as stream:
        assert stream.status_code == 200, stream.read()
        *pieces, last = list(sse_json(stream.iter_lines()))
    assert last["stop"] is True and last["tokens_predicted"] == 4
    # one piece per token, but where sampling (temperature 1) picks a token that ends inside a character, it goes
    # with the next piece
    assert len(pieces) <= 4 and sum(len(piece["tokens"]) for piece in pieces) == 4, pieces


def test_a_token_whose_text_is_held_back_goes_with_the_piece_that_carries_it():
    fmt = CompletionFormat(model=MODEL, max_model_len=64)
    assert fmt.delta(GenerationEvent("", token_ids=(7,)), 0) == []  # the first bytes of a character
    (piece,) = fmt.delta(GenerationEvent("é", token_ids=(8,)), 0)
    assert piece.content == "é" and piece.tokens == [7, 8]
    (piece,) = fmt.delta(GenerationEvent("x", token_ids=(9,)), 1)
    assert piece.tokens == [9]


def test_llama_cpp_logit_bias_pairs_and_bans(http, tokenizer):
    (x,) = text_ids(tokenizer, "x")
    pairs = completion(http, prompt=PROMPT, logit_bias=[[x, 100]], **GREEDY)
    assert pairs["content"] == "x" * 8
    greedy = completion(http, prompt=PROMPT, **GREEDY)
    first = text_ids(tokenizer, greedy["content"])[0]
    banned = completion(http, prompt=PROMPT, logit_bias=[[first, False]], **GREEDY)  # llama.cpp's ban
    assert text_ids(tokenizer, banned["content"])[0] != first
    as_object = completion(http, prompt=PROMPT, logit_bias={str(first): False}, **GREEDY)
    assert as_object["content"] == banned["content"]


@pytest.mark.parametrize("bias", [[["hello", 1.0]], [[5, True]], [[5]], "x"])
def test_a_bad_llama_cpp_logit_bias_is_a_400(http, bias):
    answer = http.post("/completion", json={"prompt": PROMPT, "logit_bias": bias, **GREEDY})
    assert answer.status_code == 400, answer.text
    assert answer.json()["error"]["param"].startswith("logit_bias")
