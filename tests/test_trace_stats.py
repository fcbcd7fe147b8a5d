"""`cache.trace_stats` on hand-made traces whose statistics are worked out by hand."""

from __future__ import annotations

import math

import numpy as np
import pytest

from cache.trace import TraceHeader, TraceRequest, write_trace
from cache.trace_stats import main, table_row, top_share, trace_stats


def request(rid: str, tokens: list, num_layers: int = 1, k: int = 1) -> TraceRequest:
    empty = np.zeros((0, num_layers, k), dtype=np.int32)
    decode = np.asarray(tokens, dtype=np.int32).reshape(len(tokens), num_layers, k)
    return TraceRequest(rid, empty, decode)


def one_layer_trace() -> tuple[TraceHeader, list[TraceRequest]]:
    """One layer, 4 experts, top-1. a: 0 0 1 0 · b: 2 2 · d: 0 1 · c: no generated tokens."""
    header = TraceHeader("hand", 1, 4, 1)
    reqs = [
        request("a", [0, 0, 1, 0]),
        request("b", [2, 2]),
        request("c", []),
        request("d", [0, 1]),
    ]
    return header, reqs


def test_one_layer_by_hand():
    stats = trace_stats(*one_layer_trace())
    assert stats["requests"] == 3  # c has no decode
    assert stats["tokens_median"] == 2  # 4, 2, 2
    assert stats["first_use_share"] == pytest.approx(5 / 8)  # a: 0, 1 · b: 2 · d: 0, 1
    # reuses: a's expert 0 at tokens 1 (after 0) and 3 (after 1) · b's expert 2 at token 1
    assert stats["reuse_p50"] == 1 and stats["reuse_p90"] == pytest.approx(1.8)
    assert stats["same_as_previous"] == pytest.approx(2 / 5)  # 5 uses after a first token, 2 at distance 1
    assert stats["distinct_median"] == 2  # a 2, b 1, d 2
    assert stats["top10_share"] == pytest.approx(4 / 8)  # 1 of 4 keys: expert 0, 4 of 8 uses
    # a = [3,1,0,0], d = [1,1,0,0]: cos 4/√20; b = [0,0,2,0] is orthogonal to both
    assert stats["nearest_cosine"] == pytest.approx(4 / math.sqrt(20))


def test_layers_and_padding_by_hand():
    # 2 layers, 3 experts, top-2; layer 1 picks one expert (padded with -1)
    header = TraceHeader("hand", 2, 3, 2)
    tokens = [[[0, 1], [2, -1]], [[1, 2], [2, -1]]]
    stats = trace_stats(header, [request("r", tokens, num_layers=2, k=2)])
    assert stats["first_use_share"] == pytest.approx(4 / 6)  # layer 0: 0, 1, 2 · layer 1: 2
    assert stats["reuse_p50"] == 1 and stats["reuse_p90"] == 1  # layer-0 expert 1, layer-1 expert 2
    assert stats["same_as_previous"] == pytest.approx(2 / 3)  # token 1's three uses, two repeated
    assert stats["distinct_median"] == 2  # layer 0: 3, layer 1: 1
    assert stats["top10_share"] == pytest.approx(2 / 6)  # 1 of 6 keys, used twice
    assert math.isnan(stats["nearest_cosine"])  # no other request


def test_same_layer_expert_in_another_layer_is_not_a_reuse():
    header = TraceHeader("hand", 2, 2, 1)
    stats = trace_stats(header, [request("r", [[[0], [1]], [[1], [0]]], num_layers=2)])  # token 0: 0, 1 · token 1: 1, 0
    assert stats["first_use_share"] == 1.0  # (layer, expert) (0, 0), (1, 1), (0, 1), (1, 0): four keys


def test_top_share_of_uniform_usage_is_the_fraction():
    assert top_share(np.ones(100), 0.1) == pytest.approx(0.1)
    assert top_share(np.array([9.0, 1.0]), 0.1) == pytest.approx(0.9)  # ceil(0.2) = 1 key


def test_a_trace_without_generated_tokens_is_refused():
    header = TraceHeader("hand", 1, 4, 1)
    with pytest.raises(ValueError, match="no generated tokens"):
        trace_stats(header, [request("c", [])])


def test_cli_prints_the_issue_table_row(tmp_path, capsys):
    path = tmp_path / "t.jsonl"
    write_trace(path, *one_layer_trace())
    assert main([str(path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("| trace | tokens per request (median) | first uses in a request |")
    assert lines[-1] == "| hand | 2 | 62% | 1 / 1.8 | 40% | 2 of 4 | 50% | 0.89 |"
    assert lines[-1] == table_row("hand", trace_stats(*one_layer_trace()))
