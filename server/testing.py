"""Helpers to drive a real `python -m server` process: for the end-to-end tests and the benchmarks.

`RemoteServer` starts the server on a free port, waits for `/health`, and stops it with
SIGTERM (a graceful shutdown). `sse_data` is a small hand-written Server-Sent Events parser,
independent of the SDK, so the tests see the wire as a client does.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import httpx

REPO_ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RemoteServer:
    def __init__(self, args: Sequence[str], env: dict[str, str] | None = None, ready_timeout: float = 180,
                 api_key: str | None = None) -> None:
        self.port = free_port()
        self.args = [sys.executable, "-m", "server", "--port", str(self.port), *args]
        self.env = {**os.environ, **(env or {})}
        self.ready_timeout = ready_timeout
        self.api_key = api_key
        fd, path = tempfile.mkstemp(prefix="moe-serve-", suffix=".log")
        os.close(fd)
        self.log_file = Path(path)
        self.process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def launch(self) -> RemoteServer:
        """Start the process without waiting for it to be ready."""
        with self.log_file.open("wb") as log:
            self.process = subprocess.Popen(self.args, cwd=REPO_ROOT, env=self.env, stdout=log,
                                            stderr=subprocess.STDOUT)
        return self

    def start(self) -> RemoteServer:
        self.launch()
        deadline = time.monotonic() + self.ready_timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"server exited with {self.process.returncode}:\n{self.log()[-4000:]}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            time.sleep(0.25)
        self.stop()
        raise TimeoutError(f"server not healthy after {self.ready_timeout} s:\n{self.log()[-4000:]}")

    def stop(self, timeout: float = 30) -> int:
        """SIGTERM, then wait; returns the exit code (kills it if it does not stop in time)."""
        if self.process is None:
            return 0
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        return self.process.returncode

    def log(self) -> str:
        return self.log_file.read_text(errors="replace")

    def __enter__(self) -> RemoteServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def http(self, **kwargs: Any) -> httpx.Client:
        return httpx.Client(base_url=self.url, headers=self.headers(), **{"timeout": 60, **kwargs})

    def openai(self, **kwargs: Any):
        import openai

        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=self.api_key or "unused",
                             **{"max_retries": 0, "timeout": 60, **kwargs})


def sse_data(lines: Iterator[str]) -> Iterator[str]:
    """The `data` of each event in a text/event-stream; comments (`: ping`) are skipped."""
    data: list[str] = []
    for line in lines:
        if line == "":
            if data:
                yield "\n".join(data)
                data = []
        elif line.startswith(":"):
            continue
        else:
            field, _, value = line.partition(":")
            if field == "data":
                data.append(value[1:] if value.startswith(" ") else value)
    if data:
        yield "\n".join(data)


def sse_json(lines: Iterator[str]) -> Iterator[dict | str]:
    """Each event parsed as JSON, and the final "[DONE]" as the string itself."""
    for data in sse_data(lines):
        yield data if data == "[DONE]" else json.loads(data)
