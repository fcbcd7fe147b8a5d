"""The EAMC file under faults (issue 11, items 5 and 6): kill -9 at random moments during saves,
200 times, leaves the old file or the new one and no temp file behind; a read-only folder, a full
disk or a folder in place of the file is a warning, serving goes on, and the next save works."""

from __future__ import annotations

import errno
import logging
import os
import random
import signal
import time

import numpy as np
import pytest

import cache.eamc_file as eamc_file
from cache.eamc import EAMC
from cache.eamc_file import EAMCAutosaver, ModelFingerprint, encode, load_eamc, save_eamc
from engine.api import GenerationRequest, SamplingParams
from engine.config import EngineConfig
from engine.engine import Engine
from tests.fixtures.models import build_checkpoint

FP = ModelFingerprint("toy-moe", 24, 128, "toy@abc123")
KILLS = 200


def eamc_of(seed: int, entries: int = 32) -> EAMC:
    """A distinct EAMC per seed, about 1.5 MB on disk: a save takes long enough to be cut."""
    rng = np.random.default_rng(seed)
    eamc = EAMC(24, 128, capacity=64)
    for _ in range(entries):
        eamc.add(rng.random((24, 128)), rng.random((24, 128)), 16)
    return eamc


def temp_files(folder) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if ".tmp-" in p.name)


def save_forever_in_a_child(path, eamc: EAMC) -> tuple[int, int]:
    """Fork a process that saves `eamc` to `path` over and over; (its pid, a pipe that says it began)."""
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns
        try:
            os.close(read_end)
            os.write(write_end, b"go")
            while True:
                save_eamc(path, eamc, FP)
        finally:
            os._exit(1)
    os.close(write_end)
    return pid, read_end


def test_kill_9_at_random_moments_during_saves_leaves_the_old_or_the_new_file(tmp_path):
    path = tmp_path / "m.eamc"
    save_eamc(path, eamc_of(99), FP)
    rnd = random.Random(11)
    cut_mid_save = 0
    for kill in range(KILLS):
        old = path.read_bytes()
        new_eamc = eamc_of(kill % 7, entries=1 + kill % 32)
        new = encode(new_eamc, FP)
        pid, began = save_forever_in_a_child(path, new_eamc)
        assert os.read(began, 2) == b"go"
        os.close(began)
        time.sleep(rnd.uniform(0, 0.012))  # a save of this size takes a few ms
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        left = temp_files(tmp_path)
        assert len(left) <= 1, left  # at most the one the killed save was writing
        cut_mid_save += len(left)
        assert path.read_bytes() in (old, new), f"kill {kill}: neither the old nor the new file"
        loaded = load_eamc(path, FP, capacity=64)  # what a restart does: it also clears dead temps
        assert loaded is not None
        assert temp_files(tmp_path) == [], "a dead saver's temp file was left to grow"
    assert not list(tmp_path.glob("*.corrupt-*"))
    assert cut_mid_save > 0, "no kill landed inside a save: the test did not test anything"


# -- item 6: faults that are only warnings -------------------------------------------------


class FailingOpen:
    """`open` for the EAMC module: temp files fail as a read-only folder or a full disk make them."""

    def __init__(self, real_open, error: int, after_bytes: int | None = None) -> None:
        self.real_open, self.error, self.after_bytes = real_open, error, after_bytes

    def __call__(self, file, mode="r", *args, **kwargs):
        if "w" not in mode:
            return self.real_open(file, mode, *args, **kwargs)
        if self.after_bytes is None:  # read-only: the file cannot be created
            raise OSError(self.error, os.strerror(self.error), str(file))
        handle = self.real_open(file, mode, *args, **kwargs)
        limit, real_write = self.after_bytes, handle.write

        def write(data):  # a full disk: part of it, then ENOSPC
            real_write(bytes(data[:limit]))
            raise OSError(self.error, os.strerror(self.error))

        handle.write = write
        return handle


@pytest.mark.parametrize("fault", ["read-only", "disk-full"])
def test_a_failed_save_is_a_warning_and_the_next_save_works(tmp_path, monkeypatch, caplog, fault):
    path = tmp_path / "m.eamc"
    eamc = eamc_of(1, entries=3)
    saver = EAMCAutosaver(path, FP, lambda: eamc, interval_s=3600)
    assert saver.save_if_changed()
    eamc.add(np.ones((24, 128)), np.ones((24, 128)), 4)
    failing = FailingOpen(open, errno.EROFS) if fault == "read-only" else FailingOpen(open, errno.ENOSPC, 1000)
    monkeypatch.setattr(eamc_file, "open", failing, raising=False)
    with caplog.at_level(logging.WARNING):
        assert not saver.save_if_changed()
    assert "could not save the EAMC" in caplog.text
    assert temp_files(tmp_path) == []  # the partial temp file is gone
    assert len(load_eamc(path, FP, capacity=64)) == 3  # the old file, whole
    monkeypatch.undo()
    assert saver.save_if_changed()  # the change was not forgotten
    assert len(load_eamc(path, FP, capacity=64)) == 4
    saver.close()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return build_checkpoint("mixtral", tmp_path_factory.mktemp("tiny"), num_layers=2)


def generate(engine: Engine) -> str:
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    events = list(engine.generate(GenerationRequest("r", engine.encode("Hello there"), params)))
    assert events[-1].finish_reason == "length"
    return "".join(e.text for e in events)


def test_a_folder_in_place_of_the_eamc_file_is_a_warning_and_serving_goes_on(tiny, tmp_path, caplog):
    path = tmp_path / "state" / "m.eamc"
    path.mkdir(parents=True)
    with caplog.at_level(logging.WARNING):
        engine = Engine.load(EngineConfig(model=str(tiny), device="cpu", prefetch=False, eamc_path=str(path)))
        generate(engine)
        assert engine._eamc_saver.save_if_changed() is False
    assert "cannot read the EAMC file" in caplog.text and "could not save the EAMC" in caplog.text
    assert temp_files(path.parent) == []
    path.rmdir()  # the operator fixes it: the next save works
    assert engine._eamc_saver.save_if_changed()
    engine.close()
    assert len(load_eamc(path, engine._eamc_saver.fingerprint, capacity=256)) >= 1


def test_a_read_only_state_folder_is_a_warning_and_serving_goes_on(tiny, tmp_path, monkeypatch, caplog):
    path = tmp_path / "state" / "m.eamc"

    real_os_open = os.open

    def read_only(file, *args, **kwargs):  # tests may run as root, where chmod does not stop a write
        if str(file).startswith(str(path.parent)):
            raise OSError(errno.EROFS, "Read-only file system")
        return real_os_open(file, *args, **kwargs)

    monkeypatch.setattr(eamc_file.os, "open", read_only)  # the lock file and the folder's fsync
    monkeypatch.setattr(eamc_file, "open", FailingOpen(open, errno.EROFS), raising=False)
    with caplog.at_level(logging.WARNING):
        engine = Engine.load(EngineConfig(model=str(tiny), device="cpu", prefetch=False, eamc_path=str(path)))
        text = generate(engine)
        engine.close()  # the last save fails: a warning, no crash
    assert "cannot open the lock file" in caplog.text and "could not save the EAMC" in caplog.text
    assert text and not path.exists()
