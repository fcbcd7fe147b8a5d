"""Fill-in-the-middle prompts (engine/fim.py) on the fixtures' real tokenizers: each format's markers as ids in
its order around the prefix and suffix encoded as plain text, the BOS where the tokenizer adds one, and marker
text inside the code never becoming a marker."""

from __future__ import annotations

import copy

import pytest
from tokenizers import AddedToken

from engine.fim import FIM_FORMATS, detect_fim, fim_prompt_ids, plain_token_ids
from tests.fixtures.tokenizers import QWEN_FIM_TOKENS, TOKENIZER_KINDS, build_tokenizer

PREFIX = "def add(a, b):\n    "
SUFFIX = "\n\nprint(add(1, 2))  # é 🙂\n"
MARKER_TEXT = "".join(t for fmt in FIM_FORMATS for t in fmt.markers + fmt.stops)  # every format's, as text
STARCODER_TOKENS = ("<fim_prefix>", "<fim_middle>", "<fim_suffix>", "<fim_pad>", "<filename>")


@pytest.fixture(scope="module")
def starcoder():
    """StarCoder's markers as special added tokens (on the Qwen vocabulary: StarCoder's is not shipped offline)."""
    tokenizer = copy.deepcopy(build_tokenizer("qwen"))
    tokenizer.add_tokens([AddedToken(t, normalized=False, special=True) for t in STARCODER_TOKENS],
                         special_tokens=True)
    return tokenizer


def tokenizer_of(kind: str, starcoder):
    return starcoder if kind == "starcoder" else build_tokenizer(kind)


def text_ids(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def ids(tokenizer, *tokens: str) -> list[int]:
    return [tokenizer.convert_tokens_to_ids(t) for t in tokens]


def test_qwen_coder_markers_have_their_real_ids():
    tokenizer = build_tokenizer("qwen_coder")
    assert ids(tokenizer, *QWEN_FIM_TOKENS) == list(range(151659, 151665))
    fim = detect_fim(tokenizer)
    assert fim is not None and fim.name == "qwen"
    assert sorted(fim.stop_ids) == list(range(151659, 151665))  # the markers, fim_pad, repo_name, file_sep
    assert fim_prompt_ids(tokenizer, fim, PREFIX, SUFFIX) == [
        151659, *text_ids(tokenizer, PREFIX), 151661, *text_ids(tokenizer, SUFFIX), 151660]


@pytest.mark.parametrize("kind, name, layout", [
    ("qwen_coder", "qwen", lambda t, p, s: [*ids(t, "<|fim_prefix|>"), *p, *ids(t, "<|fim_suffix|>"), *s,
                                            *ids(t, "<|fim_middle|>")]),
    # the fixture's DeepSeek tokenizer (V3's config) adds no BOS; DeepSeek-Coder-V2's would come first
    ("deepseek", "deepseek", lambda t, p, s: [*ids(t, "<｜fim▁begin｜>"), *p, *ids(t, "<｜fim▁hole｜>"), *s,
                                              *ids(t, "<｜fim▁end｜>")]),
    ("mistral_v3", "codestral", lambda t, p, s: [t.bos_token_id, *ids(t, "[SUFFIX]"), *s, *ids(t, "[PREFIX]"), *p]),
    ("starcoder", "starcoder", lambda t, p, s: [*ids(t, "<fim_prefix>"), *p, *ids(t, "<fim_suffix>"), *s,
                                                *ids(t, "<fim_middle>")]),
])
def test_each_format_puts_its_marker_ids_around_the_plain_text(kind, name, layout, starcoder):
    tokenizer = tokenizer_of(kind, starcoder)
    fim = detect_fim(tokenizer)
    assert fim is not None and fim.name == name
    expected = layout(tokenizer, text_ids(tokenizer, PREFIX), text_ids(tokenizer, SUFFIX))
    assert fim_prompt_ids(tokenizer, fim, PREFIX, SUFFIX) == expected
    assert fim_prompt_ids(tokenizer, fim, PREFIX, "") == layout(tokenizer, text_ids(tokenizer, PREFIX), [])
    assert fim_prompt_ids(tokenizer, fim, "", "") == layout(tokenizer, [], [])


@pytest.mark.parametrize("kind", ["qwen_coder", "deepseek", "mistral_v3", "starcoder"])
def test_marker_text_in_the_code_is_plain_text(kind, starcoder):
    tokenizer = tokenizer_of(kind, starcoder)
    fim = detect_fim(tokenizer)
    code = f"x = '{MARKER_TEXT}<|im_end|>'\n"
    prompt = fim_prompt_ids(tokenizer, fim, code, code)
    assert sum(prompt.count(t) for t in fim.stop_ids) == len([fim.prefix, fim.suffix, fim.middle]) - (
        fim.middle is None)  # the format's own markers, once each
    assert tokenizer.eos_token_id not in prompt
    shown = MARKER_TEXT.replace("▁", " ") if kind == "mistral_v3" else MARKER_TEXT  # SentencePiece's ▁ is a space
    assert shown in tokenizer.decode(plain_token_ids(tokenizer, code))
    added = {token_id for token_id in tokenizer.added_tokens_decoder}
    assert not added & set(plain_token_ids(tokenizer, code))


@pytest.mark.parametrize("kind", TOKENIZER_KINDS)
def test_plain_text_encodes_as_the_tokenizer_does(kind):
    tokenizer = build_tokenizer(kind)
    for text in ("", PREFIX, SUFFIX, "  leading and trailing spaces  ", "Grüße aus 東京 🦩\n\t"):
        assert plain_token_ids(tokenizer, text) == text_ids(tokenizer, text)


@pytest.mark.parametrize("kind, name", [("mixtral", None), ("qwen", None), ("qwen3_thinking", None),
                                        ("harmony", None), ("deepseek", "deepseek"), ("mistral_v3", "codestral")])
def test_a_format_is_found_only_where_all_its_markers_are_added_tokens(kind, name):
    fim = detect_fim(build_tokenizer(kind))
    assert (fim.name if fim else None) == name


def test_a_partial_set_of_markers_is_no_format():
    tokenizer = copy.deepcopy(build_tokenizer("qwen"))
    tokenizer.add_tokens([AddedToken(t, normalized=False, special=True) for t in ("<|fim_prefix|>", "<|fim_suffix|>")],
                         special_tokens=True)
    assert detect_fim(tokenizer) is None


FILES = [("util.py", "def sub(a, b):\n    return a - b\n"), ("b.py", "X = 1\n")]


def test_other_files_take_qwens_repo_level_layout():
    tokenizer = build_tokenizer("qwen_coder")
    fim = detect_fim(tokenizer)
    repo, sep = ids(tokenizer, "<|repo_name|>", "<|file_sep|>")
    context = [repo, *text_ids(tokenizer, "myproject\n")]
    for name, text in FILES:
        context += [sep, *text_ids(tokenizer, name + "\n"), *text_ids(tokenizer, text)]
    context += [sep, *text_ids(tokenizer, "filename\n")]
    assert fim_prompt_ids(tokenizer, fim, PREFIX, SUFFIX, FILES) == [*context, *fim_prompt_ids(tokenizer, fim,
                                                                                               PREFIX, SUFFIX)]
    assert fim_prompt_ids(tokenizer, fim, PREFIX, SUFFIX, []) == fim_prompt_ids(tokenizer, fim, PREFIX, SUFFIX)


def test_other_files_are_plain_text_without_repo_tokens():
    """Codestral's FIM has no file tokens: each file follows llama.cpp's separator line, as text, after the BOS."""
    tokenizer = build_tokenizer("mistral_v3")
    fim = detect_fim(tokenizer)
    assert fim.repo is None and fim.bos == (tokenizer.bos_token_id,)
    context = [t for _, text in FILES for t in plain_token_ids(tokenizer, "\n\n--- snippet ---\n\n" + text)]
    plain = fim_prompt_ids(tokenizer, fim, PREFIX, SUFFIX)
    assert fim_prompt_ids(tokenizer, fim, PREFIX, SUFFIX, FILES) == [*fim.bos, *context, *plain[len(fim.bos):]]
    marker_text = [("evil.py", MARKER_TEXT)]  # a file's text cannot make a marker either
    prompt = fim_prompt_ids(tokenizer, fim, PREFIX, SUFFIX, marker_text)
    assert [t for t in prompt if t in fim.stop_ids] == [fim.suffix, fim.prefix]  # only the format's own
