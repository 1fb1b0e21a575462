"""``Future``: a result that is waited on with ``.get()`` or ``await``.

The same object works in a plain script (``fut.get(timeout=5)``), inside an
async endpoint, and in a notebook whose event loop already runs (``await fut``):
results are set by the mailbox's I/O thread, never by the waiter's loop.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from typing import Any, Callable, Generic, TypeVar

R = TypeVar("R")


class Future(Generic[R]):
    """``fut.get(timeout=None)`` / ``fut.result()`` / ``await fut``."""

    __slots__ = ("_f", "_what")

    def __init__(self, what: str = "result") -> None:
        self._f: concurrent.futures.Future = concurrent.futures.Future()
        self._what = what

    @classmethod
    def ready(cls, value: Any) -> Future:
        f = cls()
        f._f.set_result(value)
        return f

    @classmethod
    def failed(cls, error: BaseException) -> Future:
        f = cls()
        f._f.set_exception(error)
        return f

    def get(self, timeout: float | None = None) -> R:
        """Block until the value is there; raise the remote error, or ``TimeoutError``."""
        if not self._f.done():
            from .mailbox import _mailbox

            if _mailbox is not None:
                _mailbox.flush()  # a call this waits on may still sit in a batch
            if _mailbox is not None and _mailbox.receiver_ident == threading.get_ident():
                # We are the thread that receives replies: receive until ours is in.
                _mailbox.wait_until(self._f.done, timeout)
                if not self._f.done():
                    raise TimeoutError(f"no {self._what} within {timeout} s")
        try:
            return self._f.result(timeout)
        except concurrent.futures.TimeoutError:
            raise TimeoutError(f"no {self._what} within {timeout} s") from None

    result = get

    def done(self) -> bool:
        return self._f.done()

    def exception(self, timeout: float | None = None) -> BaseException | None:
        return self._f.exception(timeout)

    def add_done_callback(self, fn: Callable[[Future], None]) -> None:
        self._f.add_done_callback(lambda _f: fn(self))

    def __await__(self):
        if self._f.done():
            return self._f.result()
        from .mailbox import _mailbox

        if _mailbox is not None:
            _mailbox.flush()
        return (yield from asyncio.wrap_future(self._f).__await__())

    # set by the runtime
    def _set_result(self, value: Any) -> None:
        if not self._f.done():
            self._f.set_result(value)

    def _set_exception(self, error: BaseException) -> None:
        if not self._f.done():
            self._f.set_exception(error)

    def __repr__(self) -> str:
        state = "done" if self._f.done() else "pending"
        return f"<Future {self._what} {state}>"
