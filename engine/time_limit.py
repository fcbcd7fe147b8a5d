"""A time bound for pure-Python work that cannot be trusted to end (a model's Jinja chat template).

The work runs in the calling thread; a timer raises `TimeLimitExceeded` inside it when the
time is up. Python delivers such an exception between bytecodes, so a template's loops are
stopped, but one long call into C (a huge string join) finishes before it lands.
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


class TimeLimitExceeded(Exception):
    """The work did not finish within its time bound."""


def call_with_time_limit(work: Callable[[], T], seconds: float) -> T:
    """`work()`, or `TimeLimitExceeded` raised inside it once `seconds` have passed."""
    thread_id = threading.get_ident()
    lock = threading.Lock()
    state = {"done": False, "fired": False}

    def interrupt() -> None:
        with lock:
            if not state["done"]:
                state["fired"] = True
                _set_async_exception(thread_id, TimeLimitExceeded)

    timer = threading.Timer(seconds, interrupt)
    timer.daemon = True
    timer.start()
    try:
        return work()
    finally:
        timer.cancel()
        with lock:
            state["done"] = True
            if state["fired"]:  # not yet delivered when `work` returned: it must not land later
                _set_async_exception(thread_id, None)


def _set_async_exception(thread_id: int, exception: type[BaseException] | None) -> None:
    """Raise `exception` in the thread at its next bytecode; None clears one not yet raised."""
    pending = None if exception is None else ctypes.py_object(exception)  # None passes NULL
    ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread_id), pending)
