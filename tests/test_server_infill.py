"""llama.cpp's `/infill` end to end, as llama.vim and llama.vscode call it: a real server on the tiny random
Qwen3-MoE with Qwen2.5-Coder's tokenizer (tests/conftest.py, shared with test_server_fim.py). The prompt is the
one `/v1/completions` with `suffix` builds (after the other files of `input_extra`, in Qwen's repo-level
layout), seen through its length and the greedy middle the same engine writes after it sent as token ids."""

from __future__ import annotations

import httpx
import pytest
from starlette.testclient import TestClient

from server.testing import sse_json
from tests.test_server_fim import FIM_MIDDLE, FIM_PREFIX, FIM_SUFFIX, MODEL, PREFIX, SUFFIX

REPO_NAME, FILE_SEP = 151663, 151664  # Qwen2.5-Coder's <|repo_name|>, <|file_sep|>
GREEDY = {"temperature": 0, "n_predict": 8}
EXTRA = [{"filename": "util.py", "text": "def sub(a, b):\n    return a - b\n", "time": 1}]
LLAMA_VIM_FIELDS = {"samplers": ["top_k", "top_p", "infill"], "cache_prompt": True, "t_max_prompt_ms": 500,
                    "t_max_predict_ms": 250, "n_indent": 4, "top_k": 40, "top_p": 0.9}


@pytest.fixture(scope="module")
def server(qwen_coder_server):
    return qwen_coder_server


@pytest.fixture(scope="module")
def tokenizer(qwen_coder_checkpoint):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(qwen_coder_checkpoint)


@pytest.fixture(scope="module")
def http(server):
    with server.http(timeout=120) as client:
        yield client


def text_ids(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def infill(http: httpx.Client, **body) -> dict:
    answer = http.post("/infill", json=body)
    assert answer.status_code == 200, answer.text
    return answer.json()


def completion_of(http: httpx.Client, prompt, max_tokens: int = 8, **body) -> dict:
    answer = http.post("/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": max_tokens,
                                                 "temperature": 0, **body})
    assert answer.status_code == 200, answer.text
    return answer.json()


def fim_ids(tokenizer, prefix: str = PREFIX, suffix: str = SUFFIX) -> list[int]:
    return [FIM_PREFIX, *text_ids(tokenizer, prefix), FIM_SUFFIX, *text_ids(tokenizer, suffix), FIM_MIDDLE]


def test_the_middle_is_the_suffix_completions_middle(http, tokenizer):
    answer = infill(http, input_prefix=PREFIX, input_suffix=SUFFIX, **GREEDY)
    by_suffix = completion_of(http, PREFIX, suffix=SUFFIX)
    by_ids = completion_of(http, fim_ids(tokenizer))
    assert answer["content"] == by_suffix["choices"][0]["text"] == by_ids["choices"][0]["text"]
    assert answer["tokens_evaluated"] == by_suffix["usage"]["prompt_tokens"] == len(fim_ids(tokenizer))
    assert answer["tokens_predicted"] == by_suffix["usage"]["completion_tokens"]
    assert answer["stop"] is True and answer["model"] == MODEL and answer["truncated"] is False
    expected_stop = {"length": "limit", "stop": "eos"}[by_suffix["choices"][0]["finish_reason"]]
    assert answer["stop_type"] == expected_stop and answer["stopping_word"] == ""
    timings = answer["timings"]
    assert timings["predicted_n"] == answer["tokens_predicted"]
    assert timings["prompt_n"] + timings["cache_n"] == answer["tokens_evaluated"]
    assert timings["cache_n"] == answer["tokens_cached"]
    assert timings["prompt_ms"] > 0 and timings["predicted_per_second"] >= 0


def test_prompt_goes_on_from_the_prefix(http):
    """llama.vim sends the lines before the cursor as input_prefix and the cursor line's start as prompt."""
    split = infill(http, input_prefix="def add(a, b):\n", prompt="    ", input_suffix=SUFFIX, **GREEDY)
    whole = infill(http, input_prefix=PREFIX, input_suffix=SUFFIX, **GREEDY)
    assert split["content"] == whole["content"] and split["tokens_evaluated"] == whole["tokens_evaluated"]


def test_input_extra_goes_before_the_fim_part_in_the_repo_level_layout(http, tokenizer):
    chunk = EXTRA[0]
    expected = [REPO_NAME, *text_ids(tokenizer, "myproject\n"), FILE_SEP, *text_ids(tokenizer, "util.py\n"),
                *text_ids(tokenizer, chunk["text"]), FILE_SEP, *text_ids(tokenizer, "filename\n"),
                *fim_ids(tokenizer)]
    answer = infill(http, input_prefix=PREFIX, input_suffix=SUFFIX, input_extra=EXTRA, **GREEDY)
    assert answer["tokens_evaluated"] == len(expected)
    assert answer["content"] == completion_of(http, expected)["choices"][0]["text"]


def test_streamed_pieces_make_the_whole_answer(http):
    body = {"input_prefix": PREFIX, "input_suffix": SUFFIX, **GREEDY}
    whole = infill(http, **body)
    with http.stream("POST", "/infill", json={**body, "stream": True}) as stream:
        assert stream.status_code == 200 and stream.headers["content-type"].startswith("text/event-stream")
        events = list(sse_json(stream.iter_lines()))
    assert "[DONE]" not in events  # llama.cpp ends /infill streams with the last event, no [DONE]
    *pieces, last = events
    assert all(piece["stop"] is False and piece["tokens"] for piece in pieces)
    assert "".join(piece["content"] for piece in pieces) == whole["content"]
    assert last["stop"] is True and last["content"] == ""
    assert last["tokens_predicted"] == whole["tokens_predicted"] == sum(len(piece["tokens"]) for piece in pieces)
    assert last["tokens_evaluated"] == whole["tokens_evaluated"] and last["stop_type"] == whole["stop_type"]


def forced(tokenizer, text: str) -> dict:
    """A logit bias that makes the model write `text` (one token) at every step."""
    (token,) = text_ids(tokenizer, text)
    return {"logit_bias": {str(token): 100}, "temperature": 0}


def test_n_predict_limits_the_middle(http, tokenizer):
    answer = infill(http, input_prefix=PREFIX, input_suffix=SUFFIX, n_predict=3, **forced(tokenizer, "x"))
    assert answer["content"] == "xxx" and answer["tokens_predicted"] == 3
    assert answer["stop_type"] == "limit" and answer["truncated"] is False


def test_a_stop_word_ends_the_middle(http, tokenizer):
    answer = infill(http, input_prefix=PREFIX, input_suffix=SUFFIX, n_predict=8, stop=["xxx"],
                    **forced(tokenizer, "x"))
    assert answer["stop_type"] == "word" and answer["stopping_word"] == "xxx"
    assert answer["content"] == "" and answer["tokens_predicted"] == 3


def test_n_predict_zero_only_checks_the_prompt(http, tokenizer):
    answer = infill(http, input_prefix=PREFIX, input_suffix=SUFFIX, n_predict=0, input_extra=[])
    assert answer["content"] == "" and answer["tokens_predicted"] == 0 and answer["stop"] is True
    assert answer["tokens_evaluated"] == len(fim_ids(tokenizer)) and answer["stop_type"] == "limit"


def test_llama_vim_request_with_response_fields(http):
    fields = ["content", "timings/prompt_n", "timings/predicted_per_second", "truncated", "tokens_cached"]
    answer = infill(http, input_prefix=PREFIX, input_suffix=SUFFIX, prompt="", input_extra=EXTRA, n_predict=4,
                    response_fields=fields, **LLAMA_VIM_FIELDS)
    assert sorted(answer) == sorted(fields)
    assert isinstance(answer["content"], str) and answer["timings/prompt_n"] > 0 and answer["truncated"] is False


def test_a_repeated_prompt_reads_the_prefix_cache(http):
    body = {"input_prefix": PREFIX * 3, "input_suffix": SUFFIX, **GREEDY}
    infill(http, **body)
    again = infill(http, **body)
    assert again["tokens_cached"] > 0 and again["timings"]["cache_n"] == again["tokens_cached"]


@pytest.mark.parametrize("body, param", [
    ({"input_prefix": 5}, "input_prefix"),
    ({"input_extra": "util.py"}, "input_extra"),
    ({"input_extra": [{"filename": "a.py", "text": 3}]}, "input_extra.0.text"),
    ({"n_predict": "8"}, "n_predict"),
    ({"n_predict": -2}, "n_predict"),
    ({"stop": [1]}, "stop"),
    ({"temperature": -1}, "temperature"),
    ({"n": 2}, "n"),
])
def test_bad_input_is_a_400_naming_the_field(http, body, param):
    answer = http.post("/infill", json={"input_prefix": PREFIX, "input_suffix": SUFFIX, **body})
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert error["param"] is not None and error["param"].startswith(param.split(".")[0]), error
    assert error["message"]


def test_a_model_without_fim_tokens_is_a_400(tmp_path):
    from engine.config import EngineConfig
    from server.app import create_app
    from server.config import ServerConfig
    from tests.fixtures.models import build_checkpoint

    folder = build_checkpoint("qwen3_moe", tmp_path / "tiny-qwen", tokenizer="qwen")  # no FIM tokens
    app = create_app(ServerConfig(), EngineConfig(model=str(folder), device="cpu"))
    with TestClient(app, base_url="http://localhost") as client:
        assert app.state.client.wait_ready()
        answer = client.post("/infill", json={"input_prefix": PREFIX, "input_suffix": SUFFIX, "n_predict": 4})
    assert answer.status_code == 400
    assert "no fill-in-the-middle tokens" in answer.json()["error"]["message"]
    assert answer.json()["error"]["param"] == "input_suffix"
