"""The Future that transfers return: set from a data-plane thread, awaited anywhere.

``Future.get`` on the thread that receives a proc's messages (a sync endpoint)
waits by polling the mailbox every 100 ms, since replies arrive there; a
transfer finishes on another thread, so here the wait also polls a pipe that
the finishing thread writes to: no 100 ms stall, and the mailbox keeps being
served meanwhile (the verbs handshake needs its replies).
"""

from __future__ import annotations

import os
import threading
import time

import zmq

from monarch_tensor.future import Future
from monarch_tensor.mailbox import _poke


class TransferFuture(Future):
    __slots__ = ("_task",)

    def __init__(self, what: str = "result") -> None:
        super().__init__(what)
        self._task = None  # a deferred transfer nobody has started yet (see buffer._Transfer)

    def get(self, timeout: float | None = None):
        task, self._task = self._task, None
        if task is not None and not self.done():
            if timeout is None or timeout >= task.timeout:
                task.run()  # on this thread (bounded by the transfer's own timeout), unless taken already
            elif task.kind == "read":  # on this thread until the wait ends; then again on a pool thread
                start = time.monotonic()
                task.run_until(timeout)
                timeout = max(0.0, timeout - (time.monotonic() - start))
            else:  # a write is not started twice (see _Transfer.run_until): a pool thread runs it
                task.start()
        if not self.done():
            from monarch_tensor import mailbox as _mb

            mb = _mb._mailbox
            if mb is not None and mb.receiver_ident == threading.get_ident():
                self._wait_serving(mb, timeout)
            else:
                self._wait(timeout)
        if self.done():
            # not Future.get: it would report a TransferTimeoutError (a TimeoutError) as its own timeout
            return self._result()
        return super().get(0)

    result = get

    def __await__(self):
        task, self._task = self._task, None
        if task is not None:
            task.start()  # never on the event loop's thread
        return (yield from super().__await__())

    def _wait_serving(self, mb, timeout: float | None) -> None:
        r, w = os.pipe()
        try:
            self.add_done_callback(lambda _f: _poke(w))
            poller = zmq.Poller()
            poller.register(mb._router, zmq.POLLIN)
            poller.register(r, zmq.POLLIN)
            deadline = None if timeout is None else time.monotonic() + timeout
            while not self.done():
                mb.drain(mb.on_deferred)
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return
                poller.poll(100 if left is None else max(1, min(100, int(left * 1000))))
        finally:
            os.close(r)
            try:
                os.close(w)
            except OSError:
                pass
