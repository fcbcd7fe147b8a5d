"""`EngineClient`: the only thing the server talks to.

One worker thread owns the device. It loads the engine, then runs requests one at a time
in arrival order. `generate` bridges the worker's events into an asyncio iterator;
leaving that iterator early (a client disconnect) aborts the request.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from engine.api import (
    DEFAULT_MAX_QUEUE,
    EngineUnavailableError,
    GenerationEvent,
    GenerationRequest,
    QueueFullError,
)
from engine.engine import Engine

log = logging.getLogger(__name__)

_STOP = object()


@dataclass
class _Job:
    request: GenerationRequest
    emit: Callable[[object], None]  # thread-safe: GenerationEvent, an exception, or _STOP
    aborted: threading.Event = field(default_factory=threading.Event)


class EngineClient:
    def __init__(self, load_engine: Callable[[], Engine], max_queue: int = DEFAULT_MAX_QUEUE) -> None:
        self.max_queue = max_queue
        self.engine: Engine | None = None
        self.error: str | None = None
        self._jobs: queue.Queue[_Job | None] = queue.Queue()
        self._active: dict[str, _Job] = {}
        self._lock = threading.Lock()
        self._loaded = threading.Event()
        self._abandoned = False  # shut down while loading
        self._worker = threading.Thread(
            target=self._run, args=(load_engine,), name="engine-worker", daemon=True
        )
        self._worker.start()

    # -- health ------------------------------------------------------------------------
    @property
    def ready(self) -> bool:
        return self.engine is not None and self.error is None and self._worker.is_alive()

    @property
    def queue_depth(self) -> int:
        """Requests waiting or running."""
        with self._lock:
            return len(self._active)

    def wait_ready(self, timeout: float | None = None) -> bool:
        """Block until loading has finished (or failed); True when ready."""
        self._loaded.wait(timeout)
        return self.ready

    # -- requests ----------------------------------------------------------------------
    async def generate(self, request: GenerationRequest) -> AsyncIterator[GenerationEvent]:
        engine = self._require_engine()
        engine.validate(request)  # raises InvalidRequestError before anything is queued
        loop = asyncio.get_running_loop()
        events: asyncio.Queue[object] = asyncio.Queue()
        job = _Job(request, lambda item: loop.call_soon_threadsafe(events.put_nowait, item))
        with self._lock:  # one lock with the worker's death: a job is queued before it, or refused
            if self.error is not None:
                raise EngineUnavailableError(f"the engine failed: {self.error}")
            if len(self._active) >= self.max_queue:
                raise QueueFullError(f"the engine queue is full ({self.max_queue} requests); retry later")
            self._active[request.request_id] = job
            self._jobs.put(job)
        finished = False
        try:
            while True:
                item = await events.get()
                if item is _STOP:
                    finished = True
                    return
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                yield item
        finally:
            if not finished:  # the caller left early: a client disconnect
                self.abort(request.request_id)

    def abort(self, request_id: str) -> None:
        """Stop a running request within one step; a queued one never starts. Frees its queue slot."""
        with self._lock:
            job = self._active.pop(request_id, None)
        if job is not None:
            job.aborted.set()

    def shutdown(self, timeout: float = 60.0) -> None:
        """Abort everything, stop the worker, then let the engine persist its state.

        A load still running (it can take minutes) is abandoned to the daemon worker, which the
        process exit ends: there is no state to persist yet, and the demo build and the
        quantized-expert file are published atomically, so nothing half-written stays behind."""
        with self._lock:  # one lock with the worker keeping the loaded engine
            self._abandoned = self.engine is None and self.error is None
        if self._abandoned:
            log.warning("stopping during the model load: the load is abandoned")
            self._loaded.set()  # releases `wait_ready`: not ready
            return
        with self._lock:
            jobs = list(self._active.values())
            self._active.clear()
        for job in jobs:
            job.aborted.set()
        self._jobs.put(None)
        self._worker.join(timeout)
        if self._worker.is_alive():
            log.warning("the engine worker did not stop within %.0f s; not persisting its state", timeout)
        elif self.engine is not None:
            self.engine.close()

    # -- worker ------------------------------------------------------------------------
    def _require_engine(self) -> Engine:
        if self.error is not None:
            raise EngineUnavailableError(f"the engine failed: {self.error}")
        if self.engine is None:
            raise EngineUnavailableError("the model is still loading")
        if not self._worker.is_alive():
            raise EngineUnavailableError("the engine worker has stopped")
        return self.engine

    def _run(self, load_engine: Callable[[], Engine]) -> None:
        try:
            engine = load_engine()
            with self._lock:  # one lock with `shutdown`: the engine is kept, or the load was abandoned
                if not self._abandoned:
                    self.engine = engine
        except Exception as e:  # surfaced through /health and every request
            log.exception("loading the engine failed")
            self.error = f"{type(e).__name__}: {e}"
            return
        finally:
            self._loaded.set()
        if self.engine is None:  # abandoned
            return
        try:
            while (job := self._jobs.get()) is not None:
                self._run_job(self.engine, job)
        except BaseException as e:  # the worker dies: /health says so and no request waits for it
            log.critical("the engine worker died", exc_info=True)
            self._fail_waiting(f"the engine worker died: {type(e).__name__}: {e}")

    def _fail_waiting(self, reason: str) -> None:
        with self._lock:
            self.error = reason
            waiting = list(self._active.values())
            self._active.clear()
        for job in waiting:
            job.emit(EngineUnavailableError(reason))

    def _run_job(self, engine: Engine, job: _Job) -> None:
        try:
            if not job.aborted.is_set():  # a queued request whose client left never starts
                for event in engine.generate(job.request, job.aborted.is_set):
                    job.emit(event)
        except Exception as e:  # the server logs it, with this traceback, once
            job.emit(e)
        except BaseException as e:  # fatal to the worker (see _run); this request still gets an error
            job.emit(EngineUnavailableError(f"the engine worker died: {type(e).__name__}: {e}"))
            raise
        finally:
            with self._lock:
                self._active.pop(job.request.request_id, None)
            job.emit(_STOP)
