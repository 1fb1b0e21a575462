"""``Future`` on its own: settled from another thread, waited on by several, awaited, called back.

Every call returns one and the mailbox's I/O thread settles it, so these check the
hand-over between threads (and event loops) without any proc in the way.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time

import pytest

from monarch_tensor.future import Future

pytestmark = pytest.mark.timeout(60)


def _later(fn, delay: float = 0.05) -> threading.Thread:
    t = threading.Timer(delay, fn)
    t.start()
    return t


def test_get_blocks_until_another_thread_sets_the_result():
    f: Future[int] = Future("answer")
    assert not f.done()
    _later(lambda: f._set_result(42))
    assert f.get(timeout=10) == 42
    assert f.done() and f.result() == 42 and f.exception() is None


def test_the_remote_error_is_raised_by_get_and_returned_by_exception():
    f: Future[int] = Future()
    err = ValueError("boom")
    _later(lambda: f._set_exception(err))
    with pytest.raises(ValueError, match="boom"):
        f.get(timeout=10)
    assert f.exception() is err


def test_a_timeout_names_what_was_awaited_and_a_later_result_still_arrives():
    f: Future[str] = Future("reply of echo")
    with pytest.raises(TimeoutError, match="no reply of echo within 0.05 s"):
        f.get(timeout=0.05)
    with pytest.raises(TimeoutError):
        f.exception(timeout=0.01)
    _later(lambda: f._set_result("late"))
    assert f.get(timeout=10) == "late"


def test_only_the_first_settlement_counts():
    f: Future[int] = Future()
    f._set_result(1)
    f._set_result(2)
    f._set_exception(RuntimeError("too late"))
    assert f.get() == 1


def test_every_thread_waiting_on_one_future_wakes():
    f: Future[int] = Future()
    got: list = []
    waiters = [threading.Thread(target=lambda: got.append(f.get(timeout=10))) for _ in range(8)]
    for w in waiters:
        w.start()
    time.sleep(0.1)  # most of them are blocked by now
    f._set_result(7)
    for w in waiters:
        w.join(10)
    assert got == [7] * 8


def test_callbacks_run_once_whether_added_before_or_after_settling():
    f: Future[int] = Future()
    seen: list = []
    f.add_done_callback(lambda g: seen.append(("before", g.get())))
    f._set_result(5)
    f.add_done_callback(lambda g: seen.append(("after", g.get())))
    f.add_callback(lambda g: seen.append(("monarch's name", g.get())))
    f._set_result(6)
    assert seen == [("before", 5), ("after", 5), ("monarch's name", 5)]


def test_a_failing_callback_does_not_stop_the_others(caplog):
    f: Future[int] = Future()
    seen: list = []
    f.add_done_callback(lambda g: 1 / 0)
    f.add_done_callback(lambda g: seen.append(g.get()))
    f._set_result(3)
    assert seen == [3]
    assert "ZeroDivisionError" in caplog.text


def test_ready_and_failed_futures_are_settled_at_once():
    assert Future.ready(9).get(timeout=0) == 9
    with pytest.raises(KeyError):
        Future.failed(KeyError("k")).get(timeout=0)


def test_await_in_a_running_loop_while_another_thread_settles():
    async def main():
        ok: Future[int] = Future()
        bad: Future[int] = Future()
        _later(lambda: ok._set_result(11))
        _later(lambda: bad._set_exception(LookupError("gone")), 0.1)
        assert await ok == 11
        with pytest.raises(LookupError, match="gone"):
            await bad
        assert await Future.ready(12) == 12
        return "done"

    assert asyncio.run(main()) == "done"


def test_an_awaiting_task_can_be_cancelled_and_the_future_still_settles(caplog):
    f: Future[int] = Future()

    async def wait():
        return await f

    async def main():
        task = asyncio.ensure_future(wait())
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
    with caplog.at_level(logging.ERROR, logger="monarch_tensor"):
        f._set_result(1)  # the loop is closed: waking it must not raise
    assert f.get(timeout=0) == 1
    assert "exception calling callback" not in caplog.text  # (a callback's error would only be logged)


# ---- returns_future (Monarch's) ----------------------------------------------------------------------
def test_returns_future_runs_its_body_once_where_first_observed():
    import contextvars

    from monarch_tensor.actor import returns_future

    var = contextvars.ContextVar("rf_var", default="unset")
    runs: list = []

    @returns_future
    async def double(x, delay=0.0):
        runs.append(x)
        await asyncio.sleep(delay)
        if x < 0:
            raise ValueError("negative")
        return x * 2, var.get()

    var.set("the caller's")
    fut = double(3)
    assert runs == []  # calling it starts nothing
    assert fut.get(timeout=10) == (6, "the caller's") and fut.get(timeout=10) == (6, "the caller's")
    assert runs == [3]  # once, however often it is observed

    async def from_a_loop():
        got = [await double(4), await double(5).as_asyncio()]
        got.append(double(6).get(timeout=10))  # inside a running loop: a helper thread drives it
        with pytest.raises(ValueError, match="negative"):
            await double(-1)
        return got

    assert asyncio.run(from_a_loop()) == [(8, "the caller's"), (10, "the caller's"), (12, "the caller's")]
    with pytest.raises(TimeoutError, match="within 0.2 s \\(the body was cancelled\\)"):
        double(7, delay=30).get(timeout=0.2)
    unobserved = double(8)
    del unobserved  # never observed: never run
    assert runs == [3, 4, 5, 6, -1, 7]
    with pytest.raises(RuntimeError, match="running asyncio event loop"):
        double(9).as_asyncio()
    with pytest.raises(TypeError, match="needs an async def"):
        returns_future(lambda: 1)


def test_a_future_of_a_coroutine_and_gather_as_monarchs():
    runs: list = []

    async def double(x, delay=0.0):
        runs.append(x)
        await asyncio.sleep(delay)
        if x < 0:
            raise ValueError("negative")
        return x * 2

    fut = Future(coro=double(3))
    assert runs == [] and fut.get(timeout=10) == 6 and runs == [3]  # run where first observed
    settled = Future("reply")
    _later(lambda: settled._set_result("late"))
    assert Future.gather(Future(coro=double(1)), settled, Future.ready(7)).get(timeout=10) == [2, "late", 7]
    assert Future.gather().get(timeout=10) == []
    with pytest.raises(ValueError, match="negative"):
        Future.gather(Future(coro=double(-1)), Future(coro=double(2))).get(timeout=10)
    got = Future.gather(Future(coro=double(-2)), Future(coro=double(4)), return_exceptions=True).get(timeout=10)
    assert isinstance(got[0], ValueError) and got[1] == 8

    async def in_a_loop():
        return await Future.gather(Future(coro=double(5, 0.2)), Future(coro=double(6, 0.2)))

    assert asyncio.run(in_a_loop()) == [10, 12]
    with pytest.raises(TypeError, match="needs a coroutine"):
        Future(coro=5)
    with pytest.raises(TypeError, match="takes Futures"):
        Future.gather(1)


def test_a_body_interrupted_in_get_goes_on_for_the_next_observer():
    # Ctrl-C in a Future(coro=...).get() closed the body's loop with its task pending: the Future stayed
    # pending for ever ("Task was destroyed but it is pending!" at exit).
    import signal

    go_on = threading.Event()

    async def body():
        while not go_on.is_set():
            await asyncio.sleep(0.01)
        return 7

    fut = Future(coro=body())
    threading.Timer(0.1, signal.pthread_kill, args=(threading.get_ident(), signal.SIGINT)).start()
    with pytest.raises(KeyboardInterrupt):
        fut.get(timeout=30)
    assert not fut.done()
    go_on.set()
    assert fut.get(timeout=30) == 7


def test_a_body_cancelled_by_the_loop_it_ran_on_fails_with_an_exception():
    # First awaited in an asyncio.run that ended (its tasks cancelled), the body's Future held a bare
    # CancelledError, a BaseException that `except Exception` misses, for every later observer.
    async def forever():
        await asyncio.sleep(60)

    fut = Future("result of forever", coro=forever())

    async def impatient():
        await asyncio.wait_for(asyncio.shield(fut.as_asyncio()), 0.05)

    with pytest.raises(TimeoutError):
        asyncio.run(impatient())
    with pytest.raises(RuntimeError, match="result of forever: cancelled before it ended"):
        fut.get(timeout=10)


def test_repr_says_pending_done_or_failed():
    f = Future("reply of a.f")
    assert repr(f) == "<Future reply of a.f pending>"
    f._set_exception(ValueError("x"))
    assert repr(f) == "<Future reply of a.f failed>"
    assert repr(Future.ready(1)) == "<Future result done>"
