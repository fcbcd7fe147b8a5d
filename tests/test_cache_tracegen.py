"""The synthetic trace generator hits the statistics of real decode traces."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from cache.trace import load_trace
from cache.trace_stats import trace_stats as issue_stats
from cache.tracegen import REAL_DECODE_STATS, REAL_TRACE_STATS, SHAPES, generate, main, trace_stats

TOLERANCE = {  # absolute
    "distinct_median": 3.0,
    "distinct_p90": 5.0,
    "top_share_median": 0.04,
    "same_as_previous": 0.03,
    "in_last_8": 0.04,
    "entropy": 0.03,
}


@pytest.fixture(scope="module")
def many_small_stats() -> dict:
    header, requests = generate(SHAPES["many-small"], 400, seed=11)
    return trace_stats(header, requests)


@pytest.mark.parametrize("name", list(TOLERANCE))
def test_many_small_matches_real_decode_statistics(many_small_stats, name):
    assert many_small_stats[name] == pytest.approx(REAL_DECODE_STATS[name], abs=TOLERANCE[name])


def test_activation_groups_per_thousand_requests(many_small_stats):
    # 400 requests from 20 Zipf-popular request kinds; the paper: 10-30 per 1,000 requests
    assert 10 <= many_small_stats["groups"] <= 30


@pytest.mark.parametrize("shape", list(SHAPES))
def test_shapes_are_valid_and_reproducible(tmp_path, shape):
    path = tmp_path / f"{shape}.jsonl"
    main(["--shape", shape, "--requests", "3", "--seed", "5", "--decode-tokens", "16", "--out", str(path)])
    header, requests = load_trace(path)
    params = SHAPES[shape]
    assert (header.num_layers, header.num_experts, header.top_k) == (params.num_layers, params.num_experts, params.top_k)
    assert len(requests) == 3 and all(r.decode.shape == (16, params.num_layers, params.top_k) for r in requests)
    for r in requests:
        assert np.all(np.sort(r.decode, axis=2)[..., 1:] != np.sort(r.decode, axis=2)[..., :-1])  # k distinct
    _, same_seed = generate(replace(params, decode_tokens=16, decode_sigma=0.0), 3, seed=5)
    for a, b in zip(requests, same_seed, strict=True):
        assert np.array_equal(a.decode, b.decode) and np.array_equal(a.prefill, b.prefill)


def test_tokens_repeat_more_than_chance_in_every_shape():
    for params in SHAPES.values():
        header, requests = generate(params, 20, seed=1)
        stats = trace_stats(header, requests)
        chance = params.top_k / params.num_experts
        assert stats["same_as_previous"] > chance + 0.05


PRESET_TOLERANCE = {  # absolute; request-to-request spread of a few hundred requests is about this
    "tokens_median": 6.0,  # DeepSeek's long-tailed lengths: the median of 200 draws varies by ~4
    "first_use_share": 0.02,
    "reuse_p50": 1.0,
    "reuse_p90": 3.0,
    "same_as_previous": 0.03,
    "distinct_median": 3.0,
    "top10_share": 0.06,
    "nearest_cosine": 0.03,
}


@pytest.mark.parametrize("preset", list(REAL_TRACE_STATS))
def test_presets_match_issue_12_statistics(preset):
    header, requests = generate(SHAPES[preset], 200, seed=4)
    stats = issue_stats(header, requests)
    for name, target in REAL_TRACE_STATS[preset].items():
        assert stats[name] == pytest.approx(target, abs=PRESET_TOLERANCE[name]), name


def test_decode_lengths_vary_only_when_asked():
    fixed = SHAPES["many-small"]
    _, requests = generate(replace(fixed, decode_tokens=16), 30, seed=2)
    assert {len(r.decode) for r in requests} == {16}
    varied = replace(fixed, decode_tokens=16, decode_sigma=1.0, decode_max=64)
    _, requests = generate(varied, 30, seed=2)
    lengths = [len(r.decode) for r in requests]
    assert len(set(lengths)) > 5 and max(lengths) <= 64 and min(lengths) >= 1
