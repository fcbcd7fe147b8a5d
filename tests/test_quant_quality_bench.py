"""`bench.quant_quality`'s scoring: agreement with the reference's tokens and its own choices, flip margins."""

import math

import torch

from bench import quant_quality


def _log_probs(rows: list[list[float]]) -> torch.Tensor:
    return torch.log_softmax(torch.tensor(rows), dim=-1)


def test_compare_scores_agreement_in_both_readings_and_the_flips_margins(monkeypatch):
    # a 1-token prompt, then 3 continuation tokens; position p predicts ids[p + 1]
    ids = [0, 1, 2, 1]
    reference = _log_probs([[0.0, 3.0, 0.0], [0.0, 0.0, 1.0], [0.0, 2.0, 1.9], [0.0, 0.0, 0.0]])
    # the reference's decode wrote token 1 at the last position: its own prefill agrees everywhere
    form = _log_probs([[0.0, 3.0, 0.0], [0.0, 0.0, 1.0], [0.0, 1.9, 2.0], [0.0, 0.0, 0.0]])  # flips the near-tie
    monkeypatch.setattr(quant_quality, "_log_probs", lambda engine, seq: form)
    row = quant_quality._compare(object(), [(1, ids)], [reference])
    assert row["positions"] == 3
    assert row["agreement"] == row["agreement_same_pass"] == 2 / 3
    assert math.isclose(row["flip_margin_max"], 0.1, abs_tol=1e-4)
    assert row["positions_within_flip_margin_max"] == 1  # only the flipped position is that close to a tie
    assert row["mean_kl"] > 0


def test_compare_of_the_reference_with_itself_has_no_flips():
    ids = [0, 1, 2]
    reference = _log_probs([[0.0, 3.0, 0.0], [0.0, 0.0, 1.0], [1.0, 0.0, 0.0]])
    row = quant_quality._compare(None, [(1, ids)], [reference])
    assert row["agreement"] == row["agreement_same_pass"] == 1.0
    assert row["flip_margin_max"] is None and row["mean_kl"] == 0.0


def test_same_pass_agreement_ignores_where_the_references_decode_chose_otherwise(monkeypatch):
    ids = [0, 2, 2]  # the decode wrote 2 where the reference's prefill prefers 1
    reference = _log_probs([[0.0, 3.0, 0.0], [0.0, 0.0, 1.0], [0.0, 0.0, 0.0]])
    monkeypatch.setattr(quant_quality, "_log_probs", lambda engine, seq: reference)
    row = quant_quality._compare(object(), [(1, ids)], [reference])
    assert row["agreement"] == 0.5 and row["agreement_same_pass"] == 1.0
