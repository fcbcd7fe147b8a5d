"""Incremental detokenization and stop strings, with the real Mixtral SentencePiece tokenizer."""

import pytest

from engine.text_stream import IncrementalDetokenizer, StopStringMatcher
from tests.fixtures.tokenizers import TOKENIZER_KINDS, build_tokenizer

TEXT = "Grüße aus 東京 🙂 🦩, naïve café — ça va?\n  indented   spaces"


@pytest.mark.parametrize("kind", TOKENIZER_KINDS)
def test_streamed_pieces_add_up_to_the_full_decode(kind):
    tokenizer = build_tokenizer(kind)
    ids = tokenizer(TEXT, add_special_tokens=False)["input_ids"]
    detokenizer = IncrementalDetokenizer(lambda ids: tokenizer.decode(ids, skip_special_tokens=True))
    pieces = [detokenizer.push(t) for t in ids]
    assert "".join(pieces) == tokenizer.decode(ids, skip_special_tokens=True)
    assert "".join(pieces).strip() == TEXT.strip()
    assert not any("\ufffd" in p for p in pieces)


def test_a_character_split_over_byte_tokens_arrives_whole():
    tokenizer = build_tokenizer("mixtral")
    ids = tokenizer("🦩", add_special_tokens=False)["input_ids"]
    assert len(ids) > 3  # SentencePiece byte fallback: one token per UTF-8 byte
    detokenizer = IncrementalDetokenizer(lambda ids: tokenizer.decode(ids, skip_special_tokens=True))
    pieces = [detokenizer.push(t) for t in ids]
    assert "".join(pieces).strip() == "🦩"
    assert [p for p in pieces if p.strip()] == [pieces[-1]]  # nothing before the last byte


@pytest.mark.parametrize("kind", TOKENIZER_KINDS)
def test_a_continuation_decoded_after_the_prompt_keeps_its_leading_space(kind):
    """A completion goes on from its prompt: prompt text + completion text is the text of both together.
    Decoded alone, a SentencePiece continuation loses the space before its first word."""
    tokenizer = build_tokenizer(kind)
    decode = lambda ids: tokenizer.decode(ids, skip_special_tokens=True)  # noqa: E731
    prompt = tokenizer("The capital of France is", add_special_tokens=False)["input_ids"]
    answer = tokenizer("The capital of France is Paris, naïve 東京.", add_special_tokens=False)["input_ids"][len(prompt):]
    detokenizer = IncrementalDetokenizer(decode, context=prompt[-4:])
    text = "".join(detokenizer.push(t) for t in answer)
    assert decode(prompt) + text == decode(prompt + answer)
    assert text.startswith(" Paris")
    if kind == "mixtral":  # the bug this fixes: decoded alone, the first word lost its space
        assert decode(answer[:1]) == "Paris"


def test_stop_string_spanning_pieces_is_cut_and_never_emitted():
    matcher = StopStringMatcher(["END"])
    assert matcher.feed("foo E") == ("foo ", False)
    assert matcher.feed("N") == ("", False)
    assert matcher.feed("D and more") == ("", True)


def test_held_back_text_is_released_when_it_stops_matching():
    matcher = StopStringMatcher(["</s>", "STOP"])
    assert matcher.feed("a </") == ("a ", False)
    assert matcher.feed("b") == ("</b", False)
    assert matcher.feed("ST") == ("", False)
    assert matcher.flush() == "ST"


def test_earliest_of_several_stop_strings_wins():
    matcher = StopStringMatcher(["world", "lo w"])
    assert matcher.feed("hello world") == ("hel", True)


def test_without_stop_strings_everything_passes_through():
    matcher = StopStringMatcher([])
    assert matcher.feed("abc") == ("abc", False)


def test_the_matched_stop_string_is_kept():
    matcher = StopStringMatcher(["world", "lo w", "hel"])
    assert matcher.matched is None
    assert matcher.feed("hello world") == ("", True)
    assert matcher.matched == "hel"
    later = StopStringMatcher(["xyz", "lo"])
    assert later.feed("hello") == ("hel", True) and later.matched == "lo"
