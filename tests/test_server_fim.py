"""Fill-in-the-middle end to end: a real server on a tiny random Qwen3-MoE with Qwen2.5-Coder's tokenizer
(Qwen3-Coder-30B-A3B's family and markers), driven by the openai SDK (`/v1/completions` with `suffix`) and the
`ollama` library (`/api/generate` with `suffix`). The middle is what the same greedy engine writes after the
FIM prompt sent as token ids; a FIM token ends it."""

from __future__ import annotations

import json

import httpx
import ollama
import openai
import pytest

from tests.conftest import QWEN_CODER_MODEL

MODEL = QWEN_CODER_MODEL
PREFIX = "def add(a, b):\n    "
SUFFIX = "\n\nprint(add(1, 2))\n"
FIM_PREFIX, FIM_MIDDLE, FIM_SUFFIX, FIM_PAD = 151659, 151660, 151661, 151662  # Qwen2.5-Coder's ids
GREEDY = {"temperature": 0, "max_tokens": 8}


@pytest.fixture(scope="module")
def checkpoint(qwen_coder_checkpoint):
    return qwen_coder_checkpoint


@pytest.fixture(scope="module")
def server(qwen_coder_server):
    return qwen_coder_server


@pytest.fixture(scope="module")
def client(server):
    return server.openai()


@pytest.fixture(scope="module")
def fim_ids(checkpoint) -> list[int]:
    """The FIM prompt written out by hand: markers as ids, the code as the tokenizer encodes it."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(checkpoint)

    def text(t: str) -> list[int]:
        return tokenizer(t, add_special_tokens=False)["input_ids"]

    return [FIM_PREFIX, *text(PREFIX), FIM_SUFFIX, *text(SUFFIX), FIM_MIDDLE]


def test_the_middle_is_the_greedy_completion_of_the_fim_prompt(client, fim_ids):
    middle = client.completions.create(model=MODEL, prompt=PREFIX, suffix=SUFFIX, **GREEDY)
    same = client.completions.create(model=MODEL, prompt=fim_ids, **GREEDY)
    assert middle.choices[0].text == same.choices[0].text and middle.choices[0].text
    assert middle.choices[0].finish_reason == same.choices[0].finish_reason
    assert middle.usage.prompt_tokens == same.usage.prompt_tokens == len(fim_ids)
    assert middle.usage.completion_tokens == same.usage.completion_tokens


def test_streamed_middle_equals_the_whole_one(client, fim_ids):
    whole = client.completions.create(model=MODEL, prompt=PREFIX, suffix=SUFFIX, **GREEDY)
    chunks = list(client.completions.create(model=MODEL, prompt=PREFIX, suffix=SUFFIX, stream=True,
                                            stream_options={"include_usage": True}, **GREEDY))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    assert chunks[-1].usage.prompt_tokens == len(fim_ids)


def test_an_empty_suffix_is_still_fill_in_the_middle(client, checkpoint):
    from transformers import AutoTokenizer

    prefix_ids = AutoTokenizer.from_pretrained(checkpoint)(PREFIX, add_special_tokens=False)["input_ids"]
    fim_ids = [FIM_PREFIX, *prefix_ids, FIM_SUFFIX, FIM_MIDDLE]
    middle = client.completions.create(model=MODEL, prompt=PREFIX, suffix="", **GREEDY)
    assert middle.usage.prompt_tokens == len(fim_ids)
    assert middle.choices[0].text == client.completions.create(model=MODEL, prompt=fim_ids, **GREEDY).choices[0].text


def test_a_fim_token_ends_the_middle(client, fim_ids):
    forced = {"temperature": 0, "max_tokens": 4, "logit_bias": {str(FIM_PAD): 100}}  # the model emits <|fim_pad|>
    middle = client.completions.create(model=MODEL, prompt=PREFIX, suffix=SUFFIX, **forced)
    assert middle.choices[0].finish_reason == "stop" and middle.choices[0].text == ""
    assert middle.usage.completion_tokens == 1
    plain = client.completions.create(model=MODEL, prompt=fim_ids, **forced)  # no suffix: not a stop
    assert plain.choices[0].finish_reason == "length" and plain.usage.completion_tokens == 4


@pytest.mark.parametrize("prompt", [[1, 2, 3], ["def f():", "def g():"], [[1, 2, 3]]])
def test_a_suffix_needs_one_text_prompt(client, prompt):
    with pytest.raises(openai.BadRequestError) as refused:
        client.completions.create(model=MODEL, prompt=prompt, suffix=SUFFIX, max_tokens=4)
    assert refused.value.body["param"] == "suffix"


def test_ollama_generate_with_a_suffix_returns_the_middle(server, client, fim_ids):
    expected = client.completions.create(model=MODEL, prompt=PREFIX, suffix=SUFFIX, **GREEDY).choices[0].text
    ollama_client = ollama.Client(host=server.url, timeout=60)
    options = {"temperature": 0, "num_predict": 8}
    for raw in (False, True):
        answer = ollama_client.generate(model=MODEL, prompt=PREFIX, suffix=SUFFIX, raw=raw, options=options,
                                        system="ignored for FIM")
        assert answer.response == expected and answer.prompt_eval_count == len(fim_ids)
    streamed = ollama_client.generate(model=MODEL, prompt=PREFIX, suffix=SUFFIX, options=options, stream=True)
    assert "".join(part.response for part in streamed) == expected


def test_ollama_show_lists_insert(server):
    shown = ollama.Client(host=server.url, timeout=60).show(MODEL)
    assert "insert" in shown.capabilities and "completion" in shown.capabilities
    raw = httpx.post(f"{server.url}/api/show", json={"model": MODEL}, timeout=60).json()
    assert json.dumps(raw["capabilities"]) == json.dumps(list(shown.capabilities))
