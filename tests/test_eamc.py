"""EAM, EAMC matching/replacement, and the EAMC file (atomic, versioned, fingerprinted)."""

from __future__ import annotations

import logging
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from cache.eam import IterationEAM, RequestEAM
from cache.eamc import EAMC
from cache.eamc_file import EAMCAutosaver, ModelFingerprint, encode, load_eamc, save_eamc

ROOT = Path(__file__).resolve().parents[1]
FP = ModelFingerprint("toy-moe", 1, 4, "toy@abc123")


def row(*values: float) -> np.ndarray:
    return np.array([values], dtype=np.float32)  # [L=1, E=4]


# -- EAM -------------------------------------------------------------------------------


def test_request_eam_keeps_prefill_and_decode_apart():
    eam = RequestEAM(2, 4)
    eam.add(0, [0, 1], "prefill", tokens=5)
    eam.add(1, [1], "prefill", tokens=5)
    for _ in range(3):
        eam.add(0, [2], "decode")
        eam.add(1, [3], "decode")
    assert eam.prefill.tolist() == [[1, 1, 0, 0], [0, 1, 0, 0]]
    assert eam.decode.tolist() == [[0, 0, 3, 0], [0, 0, 0, 3]]
    assert (eam.prefill_tokens, eam.decode_tokens) == (5, 3)
    assert eam.decode_probability()[0, 2] == 1.0
    eam.reset()
    assert eam.is_empty() and eam.decode.sum() == 0


def test_iteration_eam_counts_tokens():
    eam = IterationEAM.from_top_k(2, 4, 1, np.array([[0, 1], [1, 3], [1, 2]]))
    assert eam.counts[1].tolist() == [1, 3, 1, 1]
    eam.add(0, [2, 3], counts=[4, 1])
    assert eam.counts[0].tolist() == [0, 0, 4, 1]
    total = RequestEAM(2, 4)
    total.add_iteration(eam, "prefill", tokens=3)
    assert total.prefill.sum() == 11 and total.prefill_tokens == 3


# -- matching --------------------------------------------------------------------------


def two_entry_eamc(capacity: int = 4) -> EAMC:
    eamc = EAMC(1, 4, capacity)
    eamc.add(row(1, 0, 0, 0), row(1, 1, 0, 0), 2)  # A
    eamc.add(row(0, 1, 0, 0), row(0, 0, 1, 1), 2)  # B
    return eamc


def test_cosine_similarity_by_hand():
    # query prefill (1,1,0,0): cos 1/√2 with A and with B; decode (1,0,0,0): 1/√2 with A, 0 with B
    # at decode weight 0.5: A = 0.5/√2 + 0.5/√2 = 0.7071, B = 0.5/√2 = 0.3536
    eamc = two_entry_eamc()
    assert eamc.similarities(row(1, 1, 0, 0), row(1, 0, 0, 0), 0.5) == pytest.approx([0.70711, 0.35355], abs=1e-4)
    # prompt only (weight 0)
    assert eamc.similarities(row(1, 1, 0, 0), row(0, 0, 0, 0), 0.0) == pytest.approx([0.70711, 0.70711], abs=1e-4)


def test_full_collection_replaces_the_most_similar_entry():
    eamc = two_entry_eamc(capacity=2)
    slot = eamc.add(row(0, 2, 0, 0), row(0, 0, 2, 3), 5)  # like B
    assert slot == 1 and len(eamc) == 2
    arrays = eamc.arrays()
    assert arrays["decode"][1].tolist() == [[0, 0, 2, 3]]
    assert arrays["decode"][0].tolist() == [[1, 1, 0, 0]]  # A untouched
    assert arrays["decode_tokens"].tolist() == [2, 5]
    assert eamc.version == 3


def test_the_mean_prediction_follows_adds():
    eamc = two_entry_eamc()
    # A's shares (0.5, 0.5, 0, 0), B's (0, 0, 0.5, 0.5)
    assert eamc.mean_decode_probability()[0].tolist() == pytest.approx([0.25] * 4)
    eamc.add(row(0, 2, 0, 0), row(0, 0, 0, 4), 4)  # a third entry
    assert eamc.mean_decode_probability()[0].tolist() == pytest.approx([1 / 6, 1 / 6, 1 / 6, 0.5])


def test_centred_similarity_ignores_the_routing_every_request_shares():
    # every request mostly uses expert 0; kind A adds expert 1, kind B expert 2
    eamc = EAMC(1, 4)
    eamc.add(row(8, 2, 0, 0), row(8, 2, 0, 0), 10)  # A
    eamc.add(row(8, 0, 2, 0), row(8, 0, 2, 0), 10)  # B
    query = row(16, 4, 0, 0)  # an A, twice as long
    assert eamc.similarities(query, query, 0.5) == pytest.approx([1.0, 0.941], abs=1e-3)  # raw: alike
    assert eamc.centred_similarities(query, query, 0.5) == pytest.approx([1.0, -1.0], abs=1e-5)
    assert eamc.centred_similarities(query, row(0, 0, 0, 0), 0.0) == pytest.approx([1.0, -1.0], abs=1e-5)
    eamc.add(row(8, 2, 0, 0), row(8, 1, 1, 0), 10)  # a third entry: the profiles are recomputed
    assert len(eamc.centred_similarities(query, query, 0.5)) == 3


def test_centred_similarity_equals_the_cosine_of_centred_profiles_after_replacements():
    rng = np.random.default_rng(3)
    eamc = EAMC(3, 8, capacity=5)
    for _ in range(9):  # the last 4 replace entries
        sparse = rng.random((2, 3, 8)) * (rng.random((2, 3, 8)) < 0.5)
        eamc.add(sparse[0], sparse[1], 4)
    stored = eamc.arrays()
    query = rng.random((2, 3, 8)).astype(np.float32)

    def centred_cosines(entries: np.ndarray, q: np.ndarray) -> np.ndarray:
        profiles = entries.reshape(len(entries), -1)
        profiles = profiles / profiles.sum(axis=1, keepdims=True)
        mean = profiles.mean(axis=0)
        q = q.ravel() / q.sum() - mean
        centred = profiles - mean
        return centred @ q / (np.linalg.norm(centred, axis=1) * np.linalg.norm(q))

    expected = 0.3 * centred_cosines(stored["prefill"], query[0]) + 0.7 * centred_cosines(stored["decode"], query[1])
    assert eamc.centred_similarities(query[0], query[1], 0.7) == pytest.approx(expected, abs=1e-5)


def test_pooled_prediction_weighs_long_requests_more():
    eamc = EAMC(1, 4)
    eamc.add(row(1, 0, 0, 0), row(4, 0, 0, 0), 4)  # 4 tokens, all on expert 0
    eamc.add(row(1, 0, 0, 0), row(0, 1, 0, 0), 1)  # 1 token on expert 1
    assert eamc.pooled_decode_probability(np.array([1.0, 1.0]))[0].tolist() == pytest.approx([0.8, 0.2, 0, 0])
    assert eamc.pooled_decode_probability(np.array([0.0, 2.0]))[0].tolist() == pytest.approx([0, 1, 0, 0])


def test_kernel_prediction_follows_the_nearest_kind():
    eamc = EAMC(1, 4)
    for _ in range(3):
        eamc.add(row(8, 2, 0, 0), row(0, 0, 0, 6), 6)  # prompts like A decode on expert 3
        eamc.add(row(8, 0, 2, 0), row(0, 6, 0, 0), 6)  # prompts like B decode on expert 1
    p = eamc.kernel_decode_probability(row(16, 4, 0, 0), row(0, 0, 0, 0), 0.0)
    assert p[0, 3] > 0.99 and p[0, 1] < 0.01
    assert EAMC(1, 4).kernel_decode_probability(row(1, 0, 0, 0), row(0, 0, 0, 0), 0.0).sum() == 0  # empty: the mean


# -- the file --------------------------------------------------------------------------


def test_round_trip(tmp_path):
    path = tmp_path / "m.eamc"
    eamc = two_entry_eamc()
    save_eamc(path, eamc, FP)
    loaded = load_eamc(path, FP, capacity=4)
    assert loaded is not None and len(loaded) == 2
    for name, arr in eamc.arrays().items():
        assert np.array_equal(loaded.arrays()[name], arr)
    assert not list(tmp_path.glob(".*tmp*"))  # no temp file left


def test_loading_into_a_smaller_capacity_merges(tmp_path):
    path = tmp_path / "m.eamc"
    save_eamc(path, two_entry_eamc(), FP)
    assert len(load_eamc(path, FP, capacity=1)) == 1


def test_missing_file_is_a_fresh_start(tmp_path):
    assert load_eamc(tmp_path / "none.eamc", FP) is None


@pytest.mark.parametrize(
    "fingerprint",
    [
        ModelFingerprint("other-moe", 1, 4, "toy@abc123"),
        ModelFingerprint("toy-moe", 1, 4, "toy@def456"),
    ],
)
def test_wrong_model_is_ignored_with_a_warning(tmp_path, caplog, fingerprint):
    path = tmp_path / "m.eamc"
    save_eamc(path, two_entry_eamc(), FP)
    with caplog.at_level(logging.WARNING):
        assert load_eamc(path, fingerprint) is None
    assert "another model" in caplog.text
    assert path.exists()  # left in place: the next save replaces it


def test_wrong_version_is_ignored_with_a_warning(tmp_path, caplog, monkeypatch):
    import cache.eamc_file as ef

    path = tmp_path / "m.eamc"
    monkeypatch.setattr(ef, "VERSION", 99)
    save_eamc(path, two_entry_eamc(), FP)
    monkeypatch.setattr(ef, "VERSION", 1)
    with caplog.at_level(logging.WARNING):
        assert load_eamc(path, FP) is None
    assert "version 99" in caplog.text


def corrupt_variants(data: bytes) -> dict[str, bytes]:
    flipped = bytearray(data)
    flipped[-5] ^= 0xFF
    return {
        "truncated": data[: len(data) - 7],
        "truncated header": data[:20],
        "flipped payload byte": bytes(flipped),
        "garbage": b"\x00garbage" * 10,
        "empty": b"",
        "bad json": data[:12] + b"{" * (len(data) - 12),
    }


@pytest.mark.parametrize("kind", list(corrupt_variants(b"x" * 64)))
def test_corrupt_file_is_quarantined(tmp_path, caplog, kind):
    path = tmp_path / "m.eamc"
    good = encode(two_entry_eamc(), FP)
    path.write_bytes(corrupt_variants(good)[kind])
    with caplog.at_level(logging.WARNING):
        assert load_eamc(path, FP) is None
    assert not path.exists()
    moved = list(tmp_path.glob("m.eamc.corrupt-*"))
    assert len(moved) == 1 and "corrupt" in caplog.text
    save_eamc(path, two_entry_eamc(), FP)  # the caller starts fresh and saves again
    assert len(load_eamc(path, FP)) == 2


def test_array_shape_must_match_the_fingerprint(tmp_path):
    path = tmp_path / "m.eamc"
    wide = EAMC(1, 8)
    wide.add(np.ones((1, 8)), np.ones((1, 8)), 1)
    path.write_bytes(encode(wide, FP))  # says 4 experts, holds 8
    assert load_eamc(path, FP) is None
    assert list(tmp_path.glob("m.eamc.corrupt-*"))


def test_autosaver_saves_only_changes_and_on_stop(tmp_path):
    path = tmp_path / "m.eamc"
    eamc = two_entry_eamc()
    saver = EAMCAutosaver(path, FP, lambda: eamc, interval_s=3600)
    assert saver.save_if_changed() and not saver.save_if_changed()
    saver.start()
    eamc.add(row(0, 0, 1, 0), row(0, 0, 0, 1), 1)
    saver.stop()
    assert len(load_eamc(path, FP)) == 3


SAVER = """
import sys, numpy as np
from cache.eamc import EAMC
from cache.eamc_file import ModelFingerprint, save_eamc
fp = ModelFingerprint("toy-moe", 24, 128, "toy@abc123")
eamc = EAMC(24, 128, capacity=64)
rng = np.random.default_rng(int(sys.argv[2]))
first = True
while True:
    eamc.add(rng.random((24, 128)), rng.random((24, 128)), 16)
    save_eamc(sys.argv[1], eamc, fp)
    if first:
        print("saved", flush=True)
        first = False
"""


def test_kill_during_save_loop_always_leaves_a_loadable_file(tmp_path):
    path = tmp_path / "m.eamc"
    fp = ModelFingerprint("toy-moe", 24, 128, "toy@abc123")
    rnd = random.Random(0)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    for i in range(25):
        proc = subprocess.Popen(
            [sys.executable, "-c", SAVER, str(path), str(i)], stdout=subprocess.PIPE, text=True, env=env
        )
        assert proc.stdout.readline().strip() == "saved"
        time.sleep(rnd.uniform(0.0, 0.15))
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        proc.stdout.close()
        loaded = load_eamc(path, fp, capacity=64)
        assert loaded is not None and len(loaded) >= 1
        assert not list(tmp_path.glob("*.corrupt-*"))
    assert not list(tmp_path.glob(".*tmp*"))  # temp files of killed savers are cleaned up


# -- state files that must not stop the server ---------------------------------------------


def test_an_unreadable_eamc_file_gives_an_empty_eamc_with_a_warning(tmp_path, monkeypatch, caplog):
    path = tmp_path / "m.eamc"
    save_eamc(path, two_entry_eamc(), FP)

    def denied(self):  # what a non-root server gets for a root-owned 0600 file (tests may run as root)
        raise PermissionError(13, "Permission denied", str(self))

    monkeypatch.setattr(Path, "read_bytes", denied)
    with caplog.at_level(logging.WARNING):
        assert load_eamc(path, FP) is None
    assert "cannot read" in caplog.text


def test_a_folder_in_place_of_the_eamc_file_gives_an_empty_eamc(tmp_path, caplog):
    path = tmp_path / "m.eamc"
    path.mkdir()
    with caplog.at_level(logging.WARNING):
        assert load_eamc(path, FP) is None
    assert "cannot read" in caplog.text


def test_a_corrupt_file_that_cannot_be_moved_aside_gives_an_empty_eamc(tmp_path, monkeypatch, caplog):
    path = tmp_path / "m.eamc"
    path.write_bytes(b"MOEEAMC\0" + b"\xff" * 100)

    def read_only(src, dst):  # a read-only state folder
        raise PermissionError(30, "Read-only file system", str(src))

    monkeypatch.setattr("cache.eamc_file.os.replace", read_only)
    with caplog.at_level(logging.WARNING):
        assert load_eamc(path, FP) is None
    assert "could not move it aside" in caplog.text


def test_a_stale_temp_file_in_a_read_only_folder_is_only_a_warning(tmp_path, monkeypatch, caplog):
    path = tmp_path / "m.eamc"
    save_eamc(path, two_entry_eamc(), FP)
    (tmp_path / ".m.eamc.tmp-999999999-1").write_bytes(b"partial")  # a dead process's temp file

    def read_only(self, missing_ok=False):
        raise PermissionError(30, "Read-only file system", str(self))

    monkeypatch.setattr(Path, "unlink", read_only)
    with caplog.at_level(logging.WARNING):
        assert len(load_eamc(path, FP)) == 2
    assert "stale temp file" in caplog.text


def test_a_second_saver_of_one_file_does_not_save_and_says_who_holds_it(tmp_path, caplog):
    path = tmp_path / "m.eamc"
    first_eamc, second_eamc = two_entry_eamc(), EAMC(1, 4)
    second_eamc.add(row(1, 1, 1, 1), row(1, 1, 1, 1), 1)
    first = EAMCAutosaver(path, FP, lambda: first_eamc)
    with caplog.at_level(logging.WARNING):
        second = EAMCAutosaver(path, FP, lambda: second_eamc)
    assert f"pid {os.getpid()}" in caplog.text and second.save_blocked
    assert first.save_if_changed() and not second.save_if_changed()
    assert len(load_eamc(path, FP)) == 2  # the first one's, not overwritten by the second
    first.close()
    third = EAMCAutosaver(path, FP, lambda: second_eamc)  # the lock is free again
    assert third.save_blocked is None and third.save_if_changed()
    third.close()
    second.close()
