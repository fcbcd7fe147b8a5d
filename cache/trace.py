"""Routing traces in the `moe-trace/1` format (JSON Lines), written by the engine and read by replay.

Line 1 is the header `{"format": "moe-trace/1", "model", "num_layers", "num_experts", "top_k"}`;
every further line is one request `{"id", "prefill": [[[ids] × L] × P], "decode": [[[ids] × L] × T]}`.
In memory a request's steps are int32 arrays `[tokens, L, K]`, padded with -1 where a token
picked fewer than K experts.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

log = logging.getLogger(__name__)

FORMAT = "moe-trace/1"
PHASES = ("prefill", "decode")


class TraceFormatError(ValueError):
    """The file is not a valid moe-trace/1 trace; the message names the line."""


@dataclass(frozen=True)
class TraceHeader:
    model: str
    num_layers: int
    num_experts: int
    top_k: int

    def to_json(self) -> dict:
        return {
            "format": FORMAT,
            "model": self.model,
            "num_layers": self.num_layers,
            "num_experts": self.num_experts,
            "top_k": self.top_k,
        }


@dataclass
class TraceRequest:
    id: str
    prefill: np.ndarray  # [P, L, K] int32, -1 = padding
    decode: np.ndarray  # [T, L, K] int32, -1 = padding

    def to_json(self) -> dict:
        return {"id": self.id, "prefill": _steps_to_lists(self.prefill), "decode": _steps_to_lists(self.decode)}


# -- reading ---------------------------------------------------------------------------


def read_trace(path: str | os.PathLike) -> tuple[TraceHeader, Iterator[TraceRequest]]:
    """Open a trace: its validated header and a lazy iterator of validated requests."""
    handle = open(path, encoding="utf-8")
    try:
        header = parse_header(handle.readline(), path)
    except BaseException:
        handle.close()
        raise
    return header, _iter_requests(handle, header, path)


def load_trace(path: str | os.PathLike) -> tuple[TraceHeader, list[TraceRequest]]:
    """Read a whole trace into memory."""
    header, requests = read_trace(path)
    return header, list(requests)


def parse_header(line: str, path: str | os.PathLike = "<trace>") -> TraceHeader:
    where = f"{path}:1"
    if not line.strip():
        raise TraceFormatError(f"{where}: empty file, expected a {FORMAT} header")
    obj = _parse_json(line, where)
    if not isinstance(obj, dict) or obj.get("format") != FORMAT:
        raise TraceFormatError(f"{where}: not a {FORMAT} header (format={_get(obj, 'format')!r})")
    for key in ("num_layers", "num_experts", "top_k"):
        value = obj.get(key)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise TraceFormatError(f"{where}: {key} must be a positive integer, got {value!r}")
    if not isinstance(obj.get("model"), str):
        raise TraceFormatError(f"{where}: model must be a string")
    return TraceHeader(obj["model"], obj["num_layers"], obj["num_experts"], obj["top_k"])


def parse_request(line: str, header: TraceHeader, where: str = "<trace>") -> TraceRequest:
    obj = _parse_json(line, where)
    if not isinstance(obj, dict):
        raise TraceFormatError(f"{where}: a request line must be a JSON object")
    rid = obj.get("id")
    if not isinstance(rid, str):
        raise TraceFormatError(f"{where}: request id must be a string, got {rid!r}")
    steps = {phase: _parse_steps(obj.get(phase), header, f"{where} ({rid!r} {phase})") for phase in PHASES}
    return TraceRequest(rid, steps["prefill"], steps["decode"])


def _iter_requests(handle, header: TraceHeader, path) -> Iterator[TraceRequest]:
    with handle:
        for number, line in enumerate(handle, start=2):
            if line.strip():
                yield parse_request(line, header, f"{path}:{number}")


def _parse_json(line: str, where: str):
    try:
        return json.loads(line)
    except json.JSONDecodeError as exc:
        raise TraceFormatError(f"{where}: invalid JSON ({exc.msg} at column {exc.colno})") from None


def _get(obj, key):
    return obj.get(key) if isinstance(obj, dict) else None


def _parse_steps(tokens, header: TraceHeader, where: str) -> np.ndarray:
    """Validate `[[[ids] × L] × tokens]` and return it as int32 `[tokens, L, K]`, -1 padded."""
    if not isinstance(tokens, list):
        raise TraceFormatError(f"{where}: expected a list of tokens")
    L, E = header.num_layers, header.num_experts
    if not tokens:
        return np.zeros((0, L, header.top_k), dtype=np.int32)
    try:
        arr = np.asarray(tokens)
    except (ValueError, TypeError):
        arr = None  # ragged: tokens with fewer experts than others
    if arr is None or arr.dtype.kind not in "iu" or arr.ndim != 3:
        arr = _ragged_to_array(tokens, L, where)
    elif arr.shape[1] != L:
        raise TraceFormatError(f"{where}: each token needs one expert list per layer ({L} layers)")
    elif (arr < 0).any():
        raise TraceFormatError(f"{where}: expert ids must be non-negative")
    if (arr >= E).any():
        raise TraceFormatError(f"{where}: expert ids must lie in 0..{E - 1}")
    ordered = np.sort(arr, axis=2)
    if (ordered[..., 1:] == ordered[..., :-1])[ordered[..., 1:] >= 0].any():
        raise TraceFormatError(f"{where}: a token lists the same expert twice at one layer")
    return arr.astype(np.int32)


def _ragged_to_array(tokens: list, num_layers: int, where: str) -> np.ndarray:
    width = 0
    for token in tokens:
        if not isinstance(token, list) or len(token) != num_layers:
            raise TraceFormatError(f"{where}: each token needs one expert list per layer ({num_layers} layers)")
        for ids in token:
            if not isinstance(ids, list) or not all(type(e) is int for e in ids):
                raise TraceFormatError(f"{where}: expert lists must hold integers")
            if any(e < 0 for e in ids):
                raise TraceFormatError(f"{where}: expert ids must be non-negative")
            width = max(width, len(ids))
    arr = np.full((len(tokens), num_layers, max(width, 1)), -1, dtype=np.int64)
    for t, token in enumerate(tokens):
        for layer, ids in enumerate(token):
            arr[t, layer, : len(ids)] = ids
    return arr


def _steps_to_lists(steps: np.ndarray) -> list:
    if steps.size and (steps < 0).any():
        return [[[int(e) for e in ids if e >= 0] for ids in token] for token in steps.tolist()]
    return steps.tolist()


# -- writing ---------------------------------------------------------------------------


class TraceWriter:
    """Appends one JSON line per finished request; the engine calls `record` per layer per step.

    An existing file is appended to when its header matches (else `TraceFormatError`).
    """

    def __init__(self, path: str | os.PathLike, model: str, num_layers: int, num_experts: int, top_k: int) -> None:
        self.header = TraceHeader(model, num_layers, num_experts, top_k)
        self.path = Path(path)
        self._lock = threading.Lock()
        self.failures = 0  # requests whose line could not be written
        self._fd = self._open()
        self._request_id: str | None = None
        self._steps: dict[str, list[list[list[int]]]] = {}

    def begin_request(self, request_id: str) -> None:
        with self._lock:
            self._request_id = request_id
            self._steps = {phase: [[] for _ in range(self.header.num_layers)] for phase in PHASES}

    def record(self, phase: str, layer: int, token_experts: Sequence[Sequence[int]]) -> None:
        """Per-token expert ids of one forward step at one MoE `layer`."""
        if phase not in PHASES:
            raise ValueError(f"phase must be one of {PHASES}, not {phase!r}")
        with self._lock:
            if self._request_id is None:
                raise RuntimeError("record() outside begin_request()/end_request()")
            self._steps[phase][layer].extend([int(e) for e in ids] for ids in token_experts)

    def end_request(self) -> None:
        """Write the request (an aborted one is cut to the tokens every layer saw).

        A failed write (a full disk) is logged and counted, never raised: the request it
        records has already been answered. The file is cut back to its last whole line.
        """
        with self._lock:
            if self._request_id is None:
                return
            line = {"id": self._request_id}
            for phase in PHASES:
                line[phase] = _tokens_major(self._steps[phase])
            self._request_id = None
            self._steps = {}
            try:
                _append_line(self._fd, json.dumps(line, separators=(",", ":")))
            except OSError as exc:
                self.failures += 1
                log.warning("could not write request %s to the trace %s: %s", line["id"], self.path, exc)

    def close(self) -> None:
        with self._lock:
            if self._fd >= 0:
                os.close(self._fd)
                self._fd = -1

    def __enter__(self) -> TraceWriter:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _open(self) -> int:
        """An unbuffered append-only descriptor, with the header written if the file is new."""
        if self.path.exists() and self.path.stat().st_size > 0:
            with open(self.path, encoding="utf-8") as f:
                existing = parse_header(f.readline(), self.path)
            if existing != self.header:
                raise TraceFormatError(f"{self.path}: holds a trace of another model ({existing})")
            return os.open(self.path, os.O_WRONLY | os.O_APPEND)
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_TRUNC, 0o644)
        _append_line(fd, json.dumps(self.header.to_json()))
        return fd


def _append_line(fd: int, text: str) -> None:
    """Append one line whole, or (on an error) leave the file as it was and raise."""
    data = memoryview((text + "\n").encode())
    start = os.fstat(fd).st_size
    try:
        while data:
            data = data[os.write(fd, data) :]
    except OSError:
        try:
            os.ftruncate(fd, start)  # no partial line for a reader to choke on
        except OSError:
            pass
        raise


def _tokens_major(per_layer: list[list[list[int]]]) -> list:
    """`[layer][token] → [token][layer]`, cut to the shortest layer (an abort mid-step)."""
    tokens = min(len(rows) for rows in per_layer)
    return [[rows[t] for rows in per_layer] for t in range(tokens)]


def write_trace(path: str | os.PathLike, header: TraceHeader, requests: Sequence[TraceRequest]) -> None:
    """Write a whole trace at once (the synthetic generator and tests use this)."""
    with open(path, "w", encoding="utf-8") as f:
        f.write(json.dumps(header.to_json()) + "\n")
        for request in requests:
            f.write(json.dumps(request.to_json(), separators=(",", ":")) + "\n")
