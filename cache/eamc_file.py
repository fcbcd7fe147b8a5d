"""The EAMC file: what the cache learned about request kinds, kept across restarts.

Layout (little-endian, never a pickle):

    b"MOEEAMC\\0" | u32 header length | header (JSON) | payload (raw float32 arrays)

The header holds the format version, the model fingerprint (architecture, L, E,
checkpoint identity), each array's dtype/shape/offset and a SHA-256 of the payload.
Writes are atomic: a temp file in the same folder, fsync, `os.replace`, fsync the
folder, so a crash at any moment leaves either the old file or the new one. On load, a
file of another version or model is ignored with a warning (the next save replaces
it); a truncated or corrupt one is moved aside to `<name>.corrupt-<time>` with a
warning, and the caller starts with an empty EAMC.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import re
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import BinaryIO

import numpy as np

from cache.eamc import ARRAY_NAMES, DEFAULT_CAPACITY, EAMC

log = logging.getLogger(__name__)

MAGIC = b"MOEEAMC\0"
VERSION = 1
MAX_HEADER_BYTES = 1 << 20


class CorruptEAMCFile(ValueError):
    """The file is truncated, damaged or not an EAMC file."""


@dataclass(frozen=True)
class ModelFingerprint:
    architecture: str  # e.g. the config's model_type or architectures[0]
    num_layers: int  # MoE layers
    num_experts: int
    checkpoint: str  # identity of the weights: hub id@revision, or a hash of the checkpoint index

    def to_json(self) -> dict:
        return asdict(self)


# -- encoding --------------------------------------------------------------------------


def encode(eamc: EAMC, fingerprint: ModelFingerprint) -> bytes:
    arrays = eamc.arrays()
    specs, chunks, offset = {}, [], 0
    for name in ARRAY_NAMES:
        data = np.ascontiguousarray(arrays[name], dtype="<f4").tobytes()
        specs[name] = {"dtype": "<f4", "shape": list(arrays[name].shape), "offset": offset, "nbytes": len(data)}
        chunks.append(data)
        offset += len(data)
    payload = b"".join(chunks)
    header = {
        "format": "moe-eamc",
        "version": VERSION,
        "fingerprint": fingerprint.to_json(),
        "entries": len(eamc),
        "arrays": specs,
        "payload_bytes": len(payload),
        "sha256": hashlib.sha256(payload).hexdigest(),
    }
    head = json.dumps(header, sort_keys=True).encode()
    return MAGIC + struct.pack("<I", len(head)) + head + payload


def decode_header(data: bytes) -> tuple[dict, int]:
    """The header and the offset where the payload starts; `CorruptEAMCFile` if unreadable."""
    if len(data) < len(MAGIC) + 4 or not data.startswith(MAGIC):
        raise CorruptEAMCFile("not an EAMC file (bad magic)")
    (length,) = struct.unpack_from("<I", data, len(MAGIC))
    start = len(MAGIC) + 4
    if length > MAX_HEADER_BYTES or start + length > len(data):
        raise CorruptEAMCFile("truncated header")
    try:
        header = json.loads(data[start : start + length])
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CorruptEAMCFile(f"unreadable header ({exc})") from None
    if not isinstance(header, dict) or header.get("format") != "moe-eamc":
        raise CorruptEAMCFile("not an EAMC header")
    return header, start + length


def decode_arrays(header: dict, payload: bytes) -> dict[str, np.ndarray]:
    if len(payload) != header.get("payload_bytes"):
        raise CorruptEAMCFile(f"payload is {len(payload)} bytes, header says {header.get('payload_bytes')}")
    if hashlib.sha256(payload).hexdigest() != header.get("sha256"):
        raise CorruptEAMCFile("payload checksum mismatch")
    arrays = {}
    try:
        for name in ARRAY_NAMES:
            spec = header["arrays"][name]
            count = int(np.prod(spec["shape"], dtype=np.int64))
            arr = np.frombuffer(payload, dtype="<f4", count=count, offset=spec["offset"])
            arrays[name] = arr.reshape(spec["shape"]).astype(np.float32)
    except (KeyError, TypeError, ValueError) as exc:
        raise CorruptEAMCFile(f"bad array table ({exc})") from None
    return arrays


# -- saving and loading ----------------------------------------------------------------


def save_eamc(path: str | os.PathLike, eamc: EAMC, fingerprint: ModelFingerprint) -> None:
    """Write atomically (see `write_atomically`)."""
    data = encode(eamc, fingerprint)
    write_atomically(Path(path), lambda f: f.write(data))


def write_atomically(path: Path, write: Callable[[BinaryIO], object]) -> None:
    """`write(file)` into a temp file in the same folder, fsync, rename over `path`, fsync the folder:
    a reader sees the old file or the whole new one, never a part."""
    path.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale_temps(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}-{threading.get_ident()}")
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)


def load_eamc(
    path: str | os.PathLike, fingerprint: ModelFingerprint, capacity: int = DEFAULT_CAPACITY
) -> EAMC | None:
    """The saved EAMC, or None (no file, another version or model, or corrupt: moved aside)."""
    path = Path(path)
    _remove_stale_temps(path)
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return None
    except OSError as exc:  # unreadable (permissions), a folder in its place, an I/O error
        log.warning("cannot read the EAMC file %s (%s); starting with an empty EAMC", path, exc)
        return None
    try:
        header, start = decode_header(data)
        if header.get("version") != VERSION:
            log.warning("ignoring EAMC file %s: format version %r, expected %d", path, header.get("version"), VERSION)
            return None
        if header.get("fingerprint") != fingerprint.to_json():
            log.warning("ignoring EAMC file %s: it belongs to another model (%s)", path, header.get("fingerprint"))
            return None
        arrays = decode_arrays(header, data[start:])
        if arrays["prefill"].shape[1:] != (fingerprint.num_layers, fingerprint.num_experts):
            raise CorruptEAMCFile(f"arrays of shape {arrays['prefill'].shape} in a file for this model")
        return EAMC.from_arrays(arrays, capacity=capacity)
    except (CorruptEAMCFile, ValueError) as exc:
        try:
            moved = f"moved it to {quarantine(path)}"
        except OSError as move_error:  # a read-only state folder
            moved = f"could not move it aside ({move_error})"
        log.warning("EAMC file %s is corrupt (%s); %s; starting with an empty EAMC", path, exc, moved)
        return None


def quarantine(path: Path) -> Path:
    """Move a bad file aside to `<name>.corrupt-<time>`."""
    stamp = time.strftime("%Y%m%dT%H%M%S") + f"-{time.time_ns() % 1_000_000_000:09d}"
    target = path.with_name(f"{path.name}.corrupt-{stamp}")
    os.replace(path, target)
    return target


def _fsync_dir(folder: Path) -> None:
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return  # platforms without directory handles
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


_TEMP = re.compile(r"\.(?P<name>.+)\.tmp-(?P<pid>\d+)-\d+$")


def _remove_stale_temps(path: Path) -> None:
    """Temp files left by a process that died mid-save (a read-only folder keeps them: a warning)."""
    try:
        siblings = list(path.parent.iterdir())
    except FileNotFoundError:
        return
    except OSError as exc:
        log.warning("cannot list the state folder %s: %s", path.parent, exc)
        return
    for other in siblings:
        match = _TEMP.match(other.name)
        if match and match["name"] == path.name and not _alive(int(match["pid"])):
            try:
                other.unlink(missing_ok=True)
            except OSError as exc:
                log.warning("cannot remove the stale temp file %s: %s", other, exc)


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


# -- periodic saving -------------------------------------------------------------------


class SaveLock:
    """An advisory lock (`flock`) on `.<name>.lock` beside a state file: one writer per file.

    Held from `acquire` until `release` or the end of the process. The EAMC file itself is
    replaced on every save, so the lock lives on a file of its own that never moves.
    """

    def __init__(self, path: Path) -> None:
        self.path = path.with_name(f".{path.name}.lock")
        self._fd: int | None = None

    def acquire(self) -> str | None:
        """None, unless another process holds the lock: then who does.

        A lock file that cannot be created (a read-only folder) is only a warning: saving
        may still work later, and fails with its own warning if not.
        """
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as exc:
            log.warning("cannot open the lock file %s (%s); saving without the lock", self.path, exc)
            return None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            return f"another process (pid {holder}) holds {self.path}"
        os.ftruncate(fd, 0)
        os.pwrite(fd, str(os.getpid()).encode(), 0)
        self._fd = fd
        return None

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing drops the flock
            self._fd = None


class EAMCAutosaver:
    """Saves an EAMC every `interval_s` seconds when it changed, and once more on `stop()`.

    `get_eamc` returns the EAMC to save (e.g. `lambda: policy.eamc`). Only one process
    saves to a path: when another holds its `SaveLock`, this one says so and never saves
    (two servers sharing a state folder would otherwise overwrite each other's learning).
    """

    def __init__(self, path: str | os.PathLike, fingerprint: ModelFingerprint, get_eamc, interval_s: float = 60.0):
        self.path = Path(path)
        self.fingerprint = fingerprint
        self.get_eamc = get_eamc
        self.interval_s = interval_s
        self._saved_version: int | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = SaveLock(self.path)
        self.save_blocked = self._lock.acquire()  # None, or why this process does not save
        if self.save_blocked:
            log.warning("the EAMC %s will not be saved by this server: %s", self.path, self.save_blocked)

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="eamc-autosave", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self.save_if_changed()

    def close(self) -> None:
        """The last save, then let another process take over the file."""
        self.stop()
        self._lock.release()

    def save_if_changed(self) -> bool:
        eamc = self.get_eamc()
        if self.save_blocked or eamc is None or eamc.version == self._saved_version:
            return False
        version = eamc.version
        try:
            save_eamc(self.path, eamc, self.fingerprint)
        except OSError as exc:
            log.warning("could not save the EAMC to %s: %s", self.path, exc)
            return False
        self._saved_version = version
        return True

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.save_if_changed()
