"""SharePredictor: the prior's mix of EAMC match, popularity and prompt is learned from the tokens."""

from __future__ import annotations

import numpy as np
import pytest

from cache.eam import RequestEAM
from cache.eamc import EAMC
from cache.sparsity_aware import SharePredictor, simplex_grid

L, E = 2, 16


def run_requests(predictor: SharePredictor, rng: np.random.Generator, count: int, prompt_like_decode: bool) -> None:
    """Each request decodes 32 tokens from its own 2 experts per layer (top-1); its 8 prompt
    tokens use those experts too, or (`prompt_like_decode` False) any expert, while every
    request decodes from experts 0 and 1."""
    request = RequestEAM(L, E)
    for _ in range(count):
        own = [rng.choice(E, 2, replace=False) for _ in range(L)] if prompt_like_decode else [[0, 1]] * L
        request.reset()
        predictor.start(1)
        for layer in range(L):
            prompt = rng.choice(own[layer], 8) if prompt_like_decode else rng.choice(E, 8)
            experts, counts = np.unique(prompt, return_counts=True)
            request.add(layer, experts.tolist(), "prefill", 8, counts.tolist())
        for _ in range(32):
            predictor.update(request)
            for layer in range(L):
                request.add(layer, [int(rng.choice(own[layer]))], "decode")
        predictor.end(request)


def test_simplex_grid_sums_to_one():
    grid = simplex_grid(3, 4)
    assert grid.shape == (15, 3) and np.allclose(grid.sum(axis=1), 1.0)


def test_a_prompt_that_routes_like_the_decode_gets_the_weight():
    predictor = SharePredictor(EAMC(L, E, capacity=64))
    run_requests(predictor, np.random.default_rng(0), 30, prompt_like_decode=True)
    assert predictor.mix[2] >= 0.5  # (match, popularity, prompt)
    # a new request: its first decode token is already predicted from its prompt
    request = RequestEAM(L, E)
    predictor.start(1)
    request.add(0, [3, 9], "prefill", 8, [4, 4])
    request.add(1, [5, 12], "prefill", 8, [6, 2])
    share = predictor.update(request)  # [L, E]
    assert set(np.argsort(share[0])[-2:]) == {3, 9}
    assert set(np.argsort(share[1])[-2:]) == {5, 12}


def test_a_random_prompt_gets_little_weight_when_traffic_is_alike():
    predictor = SharePredictor(EAMC(L, E, capacity=64))
    run_requests(predictor, np.random.default_rng(1), 30, prompt_like_decode=False)
    assert predictor.mix[2] <= 0.25
    request = RequestEAM(L, E)
    predictor.start(1)
    request.add(0, [7], "prefill", 8, [8])
    share = predictor.update(request)
    assert share[0, :2].sum() == pytest.approx(1.0, abs=0.1)  # experts 0 and 1 all the same


def test_requests_shorter_than_a_rematch_leave_the_prior_weight_as_it_was():
    # a checkpoint at the first decode token has no counts yet: every prior weight predicts the
    # tokens after it alike, so they are no evidence for any weight (they were: the first one won)
    predictor = SharePredictor(EAMC(L, E, capacity=64))
    weight = predictor.weight
    rng = np.random.default_rng(2)
    request = RequestEAM(L, E)
    for _ in range(5):
        request.reset()
        predictor.start(1)
        for layer in range(L):
            request.add(layer, [3, 4], "prefill", 8, [4, 4])
        for _ in range(predictor.rematch_every - 1):
            predictor.update(request)
            for layer in range(L):
                request.add(layer, [int(rng.choice([3, 4]))], "decode")
        predictor.end(request)
    assert predictor.weight == weight
    assert predictor.mix[2] >= 0.5  # the mix did learn: the prompt named the experts used
