"""A GGUF file's byte-level vocabulary splits text as llama.cpp splits it for the rule the file names
(`tokenizer.ggml.pre`), where transformers has no rule of its own for that name."""

from pathlib import Path

import pytest
from tokenizers import Regex, Tokenizer, pre_tokenizers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from engine.checkpoint import resolve_model_path
from engine.demo_model import gguf_location
from engine.gguf_tokenizer import SPLITS, apply_file_split_rule, load_gguf_tokenizer
from tests.fixtures.gguf_files import DEEPSEEK_V3_TOKENIZER, tiny_gguf_model, write_gguf, write_tokenizer_gguf

# Numbers longer than three digits, CJK and kana runs, punctuation glued to words, code, runs of blanks.
TEXTS = [
    "The year 2024 had 365 days, or 31536000 seconds.",
    "我爱北京天安门，今天是2026年12月2日。こんにちは世界！カタカナとひらがな",
    "def f(x):\n    return x**2 + 3.14159  # squared\n\n\n",
    "Hello,world!!! @user #tag https://example.com/a?b=c&d=[1,2]",
    "  leading blanks\tand\ttabs   then 12  34",
    "한국어 텍스트와 Ελληνικά και русский, naïve café",
]


def _pieces(pre_name: str, text: str) -> list[str]:
    splits = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(p), behavior="isolated") for p in SPLITS[pre_name]])
    return [piece for piece, _ in splits.pre_tokenize_str(text)]


@pytest.fixture(scope="module")
def deepseek_v3_file(tmp_path_factory) -> Path:
    return write_tokenizer_gguf(DEEPSEEK_V3_TOKENIZER, tmp_path_factory.mktemp("ds") / "v3.gguf", "deepseek-v3")


def test_a_deepseek_v3_file_tokenizes_as_deepseek_v3s_own_tokenizer(deepseek_v3_file):
    reference = Tokenizer.from_file(str(DEEPSEEK_V3_TOKENIZER))
    tokenizer = load_gguf_tokenizer(deepseek_v3_file, reads_config=False)
    for text in TEXTS:
        assert tokenizer.encode(text, add_special_tokens=False) == reference.encode(text, add_special_tokens=False).ids


def test_without_the_rule_the_same_file_tokenizes_otherwise(deepseek_v3_file):
    """The texts above tell the rules apart: transformers' default split gives other tokens on most of them."""
    reference = Tokenizer.from_file(str(DEEPSEEK_V3_TOKENIZER))
    plain = PreTrainedTokenizerFast.from_pretrained(deepseek_v3_file.parent, gguf_file=deepseek_v3_file.name)
    differing = [text for text in TEXTS
                 if plain.encode(text, add_special_tokens=False)
                 != reference.encode(text, add_special_tokens=False).ids]
    assert len(differing) >= 4


def test_kimi_k2_keeps_han_runs_apart_from_other_letters():
    assert _pieces("kimi-k2", "Hello世界 It's 1234567") == ["Hello", "世界", " It's", " ", "123", "456", "7"]
    assert _pieces("kimi-k2", "naïve Ωmega") == ["naïve", " Ωmega"]


def test_deepseek_llm_keeps_numbers_whole_and_breaks_every_line():
    assert _pieces("deepseek-llm", "x 1234567\n\nab") == ["x", " ", "1234567", "\n", "\n", "ab"]
    assert _pieces("deepseek-llm", "(ab)") == ["(", "ab", ")"]


def test_deepseek_llm_letters_include_look_alikes_of_ascii():
    """The Kelvin and Ohm signs are letters of DeepSeek LLM's class; their normal forms (K, Ω) are other
    characters, so the class must hold the signs themselves."""
    assert _pieces("deepseek-llm", "5\u212a and 3\u2126") == ["5", "\u212a", " and", " ", "3", "\u2126"]


def test_glm4_groups_digits_by_three_like_llama3():
    assert _pieces("glm4", "GLM 1234567 it's") == ["GLM", " ", "123", "456", "7", " it", "'s"]


def test_smollm_splits_digits_one_by_one():
    assert _pieces("smollm", "  12 ab") == ["  ", "1", "2", " ab"]


def test_an_unknown_rule_leaves_the_tokenizer_as_transformers_built_it():
    folder, name = gguf_location()
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    before = tokenizer.backend_tokenizer.pre_tokenizer.__getstate__()
    assert not apply_file_split_rule(tokenizer, "no-such-rule")
    assert tokenizer.backend_tokenizer.pre_tokenizer.__getstate__() == before


def test_a_rule_of_transformers_own_table_is_applied_too():
    """Qwen2's rule, which Ollama's Nemotron-H model applies where its file names none."""
    folder, name = gguf_location()
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    assert apply_file_split_rule(tokenizer, "qwen2")
    pieces = tokenizer.backend_tokenizer.pre_tokenizer.pre_tokenize_str("ab 123")
    assert [piece for piece, _ in pieces] == ["ab", "Ġ", "1", "2", "3"]


def test_a_served_file_keeps_its_split_rule(tmp_path):
    """The SmolLM2 vocabulary of the test files names `smollm`: digits one by one, even after blanks."""
    folder = resolve_model_path(str(write_gguf(tiny_gguf_model("qwen3_moe"), tmp_path / "t.gguf")))
    converted = AutoTokenizer.from_pretrained(folder)
    assert converted.convert_ids_to_tokens(converted.encode("  12")) == ["ĠĠ", "1", "2"]
