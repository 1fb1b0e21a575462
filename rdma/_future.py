"""The Future that transfers return: set from a data-plane thread, awaited anywhere.

A transfer that ``RDMABuffer`` defers waits in its Future (``_job``) and runs on the
first of: the thread that waits on the Future (``get`` runs it there), a pool
thread once someone awaits it, or once it has waited ``KICK_S`` unclaimed (nobody
waited: fire-and-forget, or a caller busy with other work). A ``get`` with a
shorter timeout than the transfer's runs a read too, until that timeout
(``_run_until``).

``read_into(...).get()`` is the common case: waking a pool thread for it cost more
than the transfer itself on this project's 2-core VM (a 4 KiB tcp read took 92 µs
through the pool, 55 µs run by the waiter; 1 MiB 400 against 210 µs), because the
woken thread competes for the cores and the GIL while the transfer runs.
``RDMAAction`` starts its transfers on the pool at once: they run in parallel.

``Future.get`` on the thread that receives a proc's messages (a sync endpoint)
waits by polling the mailbox every 100 ms, since replies arrive there; a
transfer finishes on another thread, so here the wait also polls a pipe that
the finishing thread writes to: no 100 ms stall, and the mailbox keeps being
served meanwhile (the verbs handshake needs its replies).
"""

from __future__ import annotations

import concurrent.futures
import os
import threading
import time

import zmq

from monarch_tensor.future import Future, wait_limit
from monarch_tensor.transport.mailbox import _poke

from ._host import per_process
from .errors import TransferTimeoutError

KICK_S = 0.001  # how long a transfer nobody waits on may wait before a pool thread takes it


@per_process
def _pool() -> concurrent.futures.ThreadPoolExecutor:
    return concurrent.futures.ThreadPoolExecutor(max_workers=8, thread_name_prefix="mt-rdma")


class TransferFuture(Future):
    __slots__ = ("_job",)

    def __init__(self, what: str = "result") -> None:
        super().__init__(what)
        # A deferred transfer nobody has started yet: a one-item list [(buf, kind, local, offset, timeout,
        # cands)], so that of the threads that try to take it, one does (``list.pop`` is atomic).
        self._job: list | None = None

    def defer(self, job: tuple, kick: bool = True) -> None:
        """Hold ``job`` (the arguments of ``buf._run`` after the Future) until a thread takes it; with ``kick``,
        a pool thread takes it after ``KICK_S`` if nobody has, else one takes it now."""
        self._job = [job]
        if kick:
            _kicker().add(self)
        else:
            self.start()

    def _take(self) -> tuple | None:
        job = self._job
        if job:
            try:
                return job.pop()
            except IndexError:  # another thread took it in between
                pass
        return None

    def _run_taken(self) -> None:
        job = self._take()
        if job is not None:
            job[0]._run(self, *job[1:])

    def start(self) -> None:
        """Run the deferred transfer on a pool thread, unless a thread takes it first."""
        if self._job:
            _pool().submit(self._run_taken)

    def get(self, timeout: float | None = None):
        timeout = wait_limit(timeout)
        wait = timeout  # (what the caller asked for, for the message: ``timeout`` becomes what is left of it)
        job = self._take() if self._job else None
        if job is not None:
            buf, kind, local, offset, own, cands = job
            if timeout is None or timeout >= own:
                buf._run(self, kind, local, offset, own, cands)  # here: bounded by the transfer's own timeout
            elif kind == "read":  # here until the wait ends; then again on a pool thread
                start = time.monotonic()
                self._run_until(job, timeout)
                timeout = max(0.0, timeout - (time.monotonic() - start))
            else:  # a write is not started twice (see _run_until): a pool thread runs it
                _pool().submit(buf._run, self, kind, local, offset, own, cands)
        if not self.done():
            from monarch_tensor.transport import mailbox as _mb

            mb = _mb.mailbox_here()
            if mb is not None and mb.receiver_ident == threading.get_ident():
                self._wait_serving(mb, timeout)
            else:
                self._wait(timeout)
        if self.done():
            # not Future.get: it would report a TransferTimeoutError (a TimeoutError) as its own timeout
            return self._result()
        raise TimeoutError(f"no {self._what} within {wait} s")

    result = get

    def _run_until(self, job: tuple, wait: float) -> None:
        """Run a read with ``wait`` seconds as its deadline. If the wait ends first, it starts again on a pool
        thread with what is left of its own timeout: the same bytes are read again (``read_into(...)
        .get(timeout=10)``, a wait shorter than the transfer's 60 s, ran through the pool at 2-3x the latency
        of a small read before). Not for writes: the owner may still apply an abandoned attempt's bytes after
        the retry, and after a later write."""
        buf, kind, local, offset, own, cands = job
        start = time.monotonic()
        try:
            buf.transfer(kind, local, offset, wait, cands)
        except TransferTimeoutError as e:
            left = own - (time.monotonic() - start)
            if left > 0:
                _pool().submit(buf._run, self, kind, local, offset, left, cands)
            else:
                self._set_exception(e)
        except BaseException as e:  # noqa: BLE001 - delivered to the waiter
            self._set_exception(e)
        else:
            self._set_result(None)

    def __await__(self):
        self.start()  # never on the event loop's thread
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
                with mb._rx_lock:  # the socket is used by one thread at a time (Mailbox.receive_for)
                    poller.poll(100 if left is None else max(1, min(100, int(left * 1000))))
        finally:
            os.close(r)
            try:
                os.close(w)
            except OSError:
                pass


class _Kicker:
    """One thread per process that starts, after ``KICK_S``, the deferred transfers nobody took. It wakes
    once per burst of transfers and then once per ``KICK_S`` while new ones keep coming, not per transfer."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pending: list[TransferFuture] = []
        self._active = False
        self._wake = threading.Event()
        threading.Thread(target=self._loop, daemon=True, name="mt-rdma-kick").start()

    def add(self, fut: TransferFuture) -> None:
        with self._lock:
            self._pending.append(fut)
            idle, self._active = not self._active, True
        if idle:
            self._wake.set()

    def _loop(self) -> None:
        while True:
            self._wake.wait()
            self._wake.clear()
            while True:
                time.sleep(KICK_S)
                with self._lock:
                    futs, self._pending = self._pending, []
                    if not futs:
                        self._active = False
                        break
                for f in futs:
                    try:
                        f.start()
                    except Exception as e:  # noqa: BLE001 - e.g. the pool is shut down at exit
                        if f._take() is not None:
                            f._set_exception(e)


_kicker = per_process(_Kicker)
