"""``ThreadTimeout``: a time limit on synchronous Python in any thread (Monarch's ``monarch.experimental``).

>>> from monarch_tensor.experimental.thread_timeout import ThreadTimeout, ThreadTimeoutError
>>> class Worker(Actor):
...     @endpoint
...     def solve(self, problem):
...         try:
...             with ThreadTimeout(5):
...                 return slow_python_search(problem)
...         except ThreadTimeoutError:
...             return None

Endpoints do not run on the main thread, where ``signal.alarm`` would deliver,
so a watchdog thread raises ``ThreadTimeoutError`` in the protected thread
instead (CPython's ``PyThreadState_SetAsyncExc``). It arrives at the thread's
next bytecode: a blocking native call (a sleep, a socket read, a long torch op)
is not interrupted, the error comes when it returns. ``ThreadTimeoutError``
derives from ``BaseException``, so ``except Exception`` inside the block does
not swallow it; and once the limit passed, leaving the block raises it even if
the code inside caught it. One use per instance; not nested in one thread, and
not across an ``await`` (it targets the thread, not the task).
"""

from __future__ import annotations

import ctypes
import sys
import threading

__all__ = ["ThreadTimeout", "ThreadTimeoutError"]


class ThreadTimeoutError(BaseException):
    """Raised in a thread whose ``ThreadTimeout`` ran out."""


_active = threading.local()  # whether this thread is inside a ThreadTimeout (one pending async error per thread)
_set_async_exc = None


def _raise_in(thread_id: int, exc: type[BaseException] | None) -> int:
    """Schedule ``exc`` in thread ``thread_id`` (None: cancel a pending one); the number of threads touched."""
    global _set_async_exc
    if _set_async_exc is None:
        f = ctypes.pythonapi.PyThreadState_SetAsyncExc
        f.argtypes, f.restype = (ctypes.c_ulong, ctypes.py_object), ctypes.c_int
        _set_async_exc = f
    return _set_async_exc(thread_id, ctypes.py_object() if exc is None else exc)  # (an empty one is NULL)


class ThreadTimeout:
    """``with ThreadTimeout(seconds):`` raises ``ThreadTimeoutError`` in this thread after ``seconds``
    (``math.inf``: never)."""

    def __init__(self, seconds: float) -> None:
        if sys.implementation.name != "cpython":
            raise RuntimeError("ThreadTimeout needs CPython (it raises through PyThreadState_SetAsyncExc)")
        if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not seconds > 0:
            raise ValueError(f"ThreadTimeout(seconds) takes a positive number, got {seconds!r}")
        self.seconds = float(seconds)
        self._thread: int | None = None
        self._done = threading.Event()
        self._lock = threading.Lock()
        self._fired = False

    def __enter__(self) -> ThreadTimeout:
        if self._thread is not None:
            raise RuntimeError("a ThreadTimeout is used once: make a new one")
        if getattr(_active, "on", False):
            raise RuntimeError("ThreadTimeout blocks cannot nest in one thread")
        self._thread = threading.get_ident()
        _active.on = True
        try:
            threading.Thread(target=self._watch, daemon=True, name=f"thread-timeout-{self._thread}").start()
        except BaseException:
            _active.on = False
            raise
        return self

    def _watch(self) -> None:
        # inf (or any limit longer than a wait can take, centuries) is no limit: waiting for it overflowed
        limit = None if self.seconds > threading.TIMEOUT_MAX else self.seconds
        if self._done.wait(limit):
            return
        with self._lock:  # (not after the block ended: the error would hit whatever the thread runs next)
            if self._done.is_set():
                return
            touched = _raise_in(self._thread, ThreadTimeoutError)
            if touched > 1:  # cannot happen for a live thread id; undo rather than hit others
                _raise_in(self._thread, None)
            self._fired = touched == 1

    def __exit__(self, exc_type, exc, tb) -> None:
        try:
            with self._lock:
                self._done.set()
                fired = self._fired
            if fired:
                _raise_in(self._thread, None)  # not delivered yet (the block ended first): cancel it
        finally:
            _active.on = False
        if fired and exc_type is None:
            raise ThreadTimeoutError(f"the block ran past its {self.seconds:g} s")

    @property
    def fired(self) -> bool:
        """Whether the time ran out."""
        return self._fired
