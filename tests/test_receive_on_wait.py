"""A client thread that waits on a reply receives it itself (``Mailbox.lead``), and hands the socket back.

The I/O thread receives while nobody waits; a waiting thread takes the socket over (one thread
hand-off less per synchronous call). These check who dispatched what, several waiters at once, a
wait nested inside a callback, the I/O thread taking over again, and a close during a wait.
"""

from __future__ import annotations

import os
import threading
import time

import pytest

from monarch_tensor.actor import Actor, endpoint, this_host
from monarch_tensor.future import Future
from monarch_tensor.transport import mailbox as mb_mod

pytestmark = pytest.mark.timeout(120)


class Echo(Actor):
    @endpoint
    def echo(self, x):
        return x

    @endpoint
    def slow(self, x, dt: float):
        time.sleep(dt)
        return x

    @endpoint
    def gated(self, x, gate: str):
        """Returns ``x`` once the file ``gate`` exists (at most 60 s)."""
        deadline = time.monotonic() + 60
        while not os.path.exists(gate) and time.monotonic() < deadline:
            time.sleep(0.005)
        return x


@pytest.fixture(scope="module")
def echo():
    procs = this_host().spawn_procs(per_host={"gpus": 1})
    yield procs.spawn("echo", Echo)
    procs.stop()


def _settled_on(fut: Future) -> list:
    where: list = []
    fut.add_done_callback(lambda _f: where.append(threading.current_thread()))
    return where


def _open_once_waiting(monkeypatch, gate: str) -> None:
    """Create the file ``gate`` from another thread as soon as a thread starts waiting on a reply
    (``Mailbox.lead``): a gated call's reply then comes during the wait, however slow the machine."""
    entered = threading.Event()
    real = mb_mod.Mailbox.lead

    def lead(self, fut, timeout):
        entered.set()
        return real(self, fut, timeout)

    monkeypatch.setattr(mb_mod.Mailbox, "lead", lead)

    def opener() -> None:
        if entered.wait(60):
            open(gate, "w").close()

    threading.Thread(target=opener, daemon=True).start()


def test_the_waiting_thread_dispatches_its_own_reply(echo, monkeypatch, tmp_path):
    assert echo.echo.call_one(0).get(timeout=30) == 0
    gate = str(tmp_path / "gate")
    fut = echo.gated.call_one(1, gate)  # replies once get() below waits: the reply comes during the wait
    _open_once_waiting(monkeypatch, gate)
    where = _settled_on(fut)
    assert fut.get(timeout=30) == 1
    assert where == [threading.current_thread()]

    monkeypatch.setattr(mb_mod, "RECEIVE_ON_WAIT", False)  # the switch: the I/O thread receives
    fut = echo.slow.call_one(2, 0.2)
    where = _settled_on(fut)
    assert fut.get(timeout=30) == 2
    assert where and where[0] is not threading.current_thread() and where[0].name == "monarch-tensor-io"


def test_several_threads_wait_at_once_and_each_gets_its_reply(echo):
    results: dict = {}
    errors: list = []

    def worker(i: int) -> None:
        try:
            for k in range(30):
                results[(i, k)] = echo.slow.call_one((i, k), 0.001 * (k % 3)).get(timeout=60)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(90)
    assert not errors, errors
    assert results == {(i, k): (i, k) for i in range(4) for k in range(30)}


def test_a_callback_that_waits_runs_on_the_receiving_thread_without_deadlock(echo):
    inner: list = []
    fut = echo.slow.call_one("outer", 0.1)
    fut.add_done_callback(lambda f: inner.append(echo.echo.call_one(f.get() + "+inner").get(timeout=30)))
    assert fut.get(timeout=30) == "outer"
    deadline = time.monotonic() + 30
    while not inner and time.monotonic() < deadline:
        time.sleep(0.01)
    assert inner == ["outer+inner"]


def _settled_by_the_io_thread(echo) -> list:
    """Calls that nobody waits on (no get()): only the I/O thread can settle them; their values."""
    futs = [echo.echo.call_one(i) for i in range(20)]
    deadline = time.monotonic() + 30
    while not all(f.done() for f in futs) and time.monotonic() < deadline:
        time.sleep(0.005)
    return [f.get(timeout=0) for f in futs]


def test_the_io_thread_takes_over_again_when_nobody_waits(echo):
    assert echo.echo.call_one(1).get(timeout=30) == 1  # this thread received; the I/O thread parked
    assert _settled_by_the_io_thread(echo) == list(range(20))


@pytest.mark.timeout(30)
def test_a_wait_without_timeout_ends_when_its_mailbox_closes():
    mb = mb_mod.Mailbox()
    fut: Future = Future("reply that never comes")
    saved = mb_mod._mailbox
    try:
        mb_mod._mailbox = mb
        threading.Timer(0.2, mb.close).start()
        with pytest.raises(RuntimeError, match="no reply that never comes: this process's mailbox closed"):
            fut.get()  # it used to wait forever
    finally:
        mb_mod._mailbox = saved


def test_a_waiter_whose_reply_another_waiter_receives_waits_on_its_future(echo, monkeypatch, tmp_path):
    """While the main thread holds the socket waiting on a Future that another thread settles (a script
    waiting on a workspace sync, whose own thread waits on the replies), it dispatches that thread's
    replies: the thread waits on its Future, woken when it is settled, rather than on the socket's lock."""
    assert echo.echo.call_one(0).get(timeout=30) == 0
    outer: Future = Future("outer")  # settled by the thread below (a plain Future: the main thread leads)
    inner: list = []
    main = threading.get_ident()

    def second() -> None:
        try:
            mb, deadline = mb_mod._mailbox, time.monotonic() + 30
            while mb.receiver_ident != main and time.monotonic() < deadline:
                time.sleep(0.001)  # until the main thread receives
            gate = str(tmp_path / "gate")
            f = echo.gated.call_one("inner", gate)  # replies once the gate is open: after the callback is on
            inner.append((f, _settled_on(f)))
            _open_once_waiting(monkeypatch, gate)  # opens it once this thread waits (the main thread already does)
            outer._set_result(f.get(timeout=30))
        except BaseException as e:  # noqa: BLE001 - the main thread's get raises it
            outer._set_exception(e)

    t = threading.Thread(target=second)
    t.start()
    assert outer.get(timeout=60) == "inner"
    t.join(30)
    f, where = inner[0]
    assert where == [threading.current_thread()]  # the main thread, receiving, dispatched the reply
    assert f._waiter is not None  # and the second thread blocked on its Future, whose settling woke it


def test_a_thread_future_is_waited_on_without_taking_the_socket(echo, monkeypatch, tmp_path):
    """A script waiting on a ``ThreadFuture`` (a workspace sync's result) blocks on it and leaves the socket
    to the thread at work, which dispatches its own replies."""
    from monarch_tensor.future import ThreadFuture

    assert echo.echo.call_one(0).get(timeout=30) == 0
    result: ThreadFuture = ThreadFuture("work")
    blocked = threading.Event()
    real_wait = Future._wait

    def _wait(self, timeout):
        if self is result:
            blocked.set()
        return real_wait(self, timeout)

    monkeypatch.setattr(Future, "_wait", _wait)

    def work() -> None:
        try:
            if not blocked.wait(30):
                raise TimeoutError("the main thread did not block on the ThreadFuture")
            gate = str(tmp_path / "gate")
            f = echo.gated.call_one("reply", gate)
            where = _settled_on(f)
            _open_once_waiting(monkeypatch, gate)  # the reply comes while this thread waits on it
            result._set_result((f.get(timeout=30), where))
        except BaseException as e:  # noqa: BLE001 - the main thread's get raises it
            result._set_exception(e)

    t = threading.Thread(target=work)
    t.start()
    value, where = result.get(timeout=60)
    t.join(30)
    assert value == "reply" and where == [t]  # the worker received its reply itself


def _switches(tid: int) -> int:
    with open(f"/proc/self/task/{tid}/status") as f:
        return sum(int(line.split()[1]) for line in f if line.startswith(("voluntary_ctxt", "nonvoluntary_ctxt")))


@pytest.mark.skipif(not os.path.exists("/proc/self/task"), reason="counts the I/O thread's switches in /proc")
def test_the_io_thread_sleeps_through_a_long_wait_and_takes_over_when_it_ends(echo, monkeypatch):
    monkeypatch.setattr(mb_mod, "_PARKED_S", 3600.0)  # only the leaving waiter's notify can wake it in time
    mb = mb_mod.current_mailbox()
    assert echo.echo.call_one(0).get(timeout=30) == 0
    tid = mb._thread.native_id
    before = _switches(tid)
    assert echo.slow.call_one(1, 1.0).get(timeout=30) == 1  # one wait of a second: the I/O thread stays asleep
    assert _switches(tid) - before < 100  # (it woke every 2 ms to look: about 500 times)
    assert _settled_by_the_io_thread(echo) == list(range(20))  # the I/O thread, woken as the wait ended
