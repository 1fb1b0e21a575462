"""``ThreadTimeout`` (Monarch's ``monarch.experimental.thread_timeout``): a time limit on Python in any thread,
inside an actor's endpoint too."""

import math
import threading
import time

import pytest

from monarch_tensor.actor import Actor, endpoint, this_host
from monarch_tensor.experimental.thread_timeout import ThreadTimeout, ThreadTimeoutError


def spin(seconds: float) -> int:
    """Pure Python for ``seconds`` (interruptible at every bytecode)."""
    n, end = 0, time.monotonic() + seconds
    while time.monotonic() < end:
        n += 1
    return n


@pytest.mark.timeout(30)
def test_the_limit_interrupts_python_and_spares_quick_blocks():
    t0 = time.monotonic()
    with pytest.raises(ThreadTimeoutError):
        with ThreadTimeout(0.2):
            spin(20)
    assert time.monotonic() - t0 < 10
    with ThreadTimeout(5) as t:
        assert spin(0.01) > 0
    assert not t.fired
    time.sleep(0.1)  # nothing pending arrives after the block
    # `except Exception` inside does not swallow it; and caught inside, it is raised again on leaving
    with pytest.raises(ThreadTimeoutError):
        with ThreadTimeout(0.1):
            try:
                spin(20)
            except Exception:  # noqa: BLE001
                pass
    with pytest.raises(ThreadTimeoutError):
        with ThreadTimeout(0.1):
            try:
                spin(20)
            except ThreadTimeoutError:
                pass


@pytest.mark.timeout(30)
def test_it_targets_its_own_thread_only():
    results = {}

    def worker():
        try:
            with ThreadTimeout(0.2):
                spin(20)
            results["worker"] = "finished"
        except ThreadTimeoutError:
            results["worker"] = "timed out"

    t = threading.Thread(target=worker)
    t.start()
    results["main"] = spin(0.6) > 0  # the main thread runs on, untouched
    t.join(20)
    assert results == {"worker": "timed out", "main": True}


def test_bad_use_is_a_clear_error():
    for bad in (0, -1, "5", True, math.nan):
        with pytest.raises(ValueError, match="positive number"):
            ThreadTimeout(bad)
    t = ThreadTimeout(5)
    with t:
        with pytest.raises(RuntimeError, match="cannot nest"):
            with ThreadTimeout(5):
                pass
    with pytest.raises(RuntimeError, match="used once"):
        with t:
            pass


@pytest.mark.timeout(30)
@pytest.mark.parametrize("seconds", [math.inf, 1e300])
def test_an_infinite_limit_is_no_limit(seconds, monkeypatch):
    # The watchdog's wait overflowed ("timestamp out of range for platform time_t"): a thread's traceback.
    crashes: list = []
    monkeypatch.setattr(threading, "excepthook", crashes.append)
    with ThreadTimeout(seconds) as t:
        watchdogs = [th for th in threading.enumerate() if th.name == f"thread-timeout-{threading.get_ident()}"]
        spin(0.2)
    for th in watchdogs:
        th.join(10)
    assert crashes == [] and not t.fired and not any(th.is_alive() for th in watchdogs)


class Solver(Actor):
    @endpoint
    def solve(self, seconds: float, limit: float) -> str:
        try:
            with ThreadTimeout(limit):
                spin(seconds)
            return "done"
        except ThreadTimeoutError:
            return "gave up"


@pytest.mark.timeout(60)
def test_inside_an_endpoint():
    procs = this_host().spawn_procs()
    try:
        s = procs.spawn("solver", Solver)
        assert s.solve.call_one(30, 0.3).get(timeout=30) == "gave up"
        assert s.solve.call_one(0.01, 5).get(timeout=30) == "done"  # the actor serves on
    finally:
        procs.stop()
