"""Polling before blocking (``mailbox.Spin``): a thread about to block for the next message polls the
socket first while messages lately came soon enough, and stops polling after a wait that was longer.

On real sockets: a message that comes during the poll is seen, a poll that saw nothing switches polling
off until a short blocked wait switches it on again, ``until`` ends a poll, the setting's bad values are
refused, and a tensor worker's streams report when they compute (the proc's loop does not poll then).
"""

from __future__ import annotations

import os
import threading
import time

import pytest
import zmq

from monarch_tensor.actor import Actor, endpoint, this_host
from monarch_tensor.transport import mailbox as mb_mod
from monarch_tensor.transport.mailbox import Spin

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def pair():
    ctx = zmq.Context()
    rx, tx = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    for s in (rx, tx):
        s.setsockopt(zmq.LINGER, 0)
    port = rx.bind_to_random_port("tcp://127.0.0.1")
    tx.connect(f"tcp://127.0.0.1:{port}")
    yield rx, tx
    rx.close()
    tx.close()
    ctx.term()


def _readable(sock, timeout_ms=5000) -> None:
    assert sock.poll(timeout_ms, zmq.POLLIN), "the message never arrived"


def test_a_message_that_comes_while_polling_ends_the_poll(pair):
    rx, tx = pair
    spin = Spin(rx, seconds=30.0)  # long enough that only the message can end it
    threading.Timer(0.05, tx.send, (b"x",)).start()
    assert spin.poll() is True
    assert rx.recv(zmq.NOBLOCK) == b"x"


class _StepClock:
    """``time`` for the mailbox module whose ``perf_counter`` moves 1 ms at each reading (and ``advance``
    moves it on): a polling window of 20 ms ends after 20 tries, whatever the machine's speed."""

    def __init__(self) -> None:
        self.now = 1000.0

    def perf_counter(self) -> float:
        self.now += 0.001
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds

    def __getattr__(self, name):
        return getattr(time, name)


@pytest.fixture
def clock(monkeypatch):
    c = _StepClock()
    monkeypatch.setattr(mb_mod, "time", c)
    monkeypatch.setattr(mb_mod, "_crowded", lambda: False)  # (a busy machine would end a poll early)
    return c


def test_a_poll_that_saw_nothing_switches_polling_off_until_a_short_wait(pair, clock):
    rx, tx = pair
    spin = Spin(rx, seconds=0.02)
    assert spin.poll() is False  # nothing came: off
    tx.send(b"a")
    _readable(rx)
    assert spin.poll() is False  # off: it does not even look (the thread blocks, and wakes at once)
    spin.woke()  # that blocked wait was short: on again
    assert spin.poll() is True
    assert rx.recv(zmq.NOBLOCK) == b"a"


def test_a_long_blocked_wait_keeps_polling_off(pair, clock):
    rx, tx = pair
    spin = Spin(rx, seconds=0.02)
    assert spin.poll() is False
    assert spin.poll() is False  # still off; this one starts the blocked wait below
    clock.advance(0.1)  # the blocked wait, longer than the polling window
    spin.woke()
    tx.send(b"b")
    _readable(rx)
    assert spin.poll() is False  # stayed off
    spin.woke()
    assert spin.poll() is True


def test_until_ends_a_poll(pair):
    rx, _ = pair
    spin = Spin(rx, seconds=30.0)
    flag = threading.Event()
    threading.Timer(0.05, flag.set).start()
    assert spin.poll(flag.is_set) is True


def test_zero_never_polls(pair):
    rx, tx = pair
    tx.send(b"c")
    _readable(rx)
    spin = Spin(rx, seconds=0.0)
    assert spin.poll() is False


@pytest.mark.parametrize("raw", ["fast", "-5"])
def test_a_bad_setting_is_refused_with_its_name(monkeypatch, raw):
    monkeypatch.setenv("MONARCH_TENSOR_SPIN_US", raw)
    with pytest.raises(ValueError, match="MONARCH_TENSOR_SPIN_US"):
        mb_mod._us_from_env("MONARCH_TENSOR_SPIN_US")


def test_the_setting_is_read_in_microseconds(monkeypatch):
    monkeypatch.setenv("MONARCH_TENSOR_SPIN_US", "350")
    assert mb_mod._us_from_env("MONARCH_TENSOR_SPIN_US") == pytest.approx(350e-6)


def test_a_tensor_stream_is_busy_from_its_put_until_its_handler_returns():
    torch = pytest.importorskip("torch")
    from monarch_tensor.worker.worker import _Stream

    class _Worker:
        device = torch.device("cpu")

    s = _Stream(_Worker(), 0, "t")
    go, ran = threading.Event(), threading.Event()
    assert s.idle()
    s.put(lambda _: (go.wait(10), ran.set()), None)
    assert not s.idle()  # queued, then running
    go.set()
    assert ran.wait(10)
    deadline = time.monotonic() + 10
    while not s.idle() and time.monotonic() < deadline:
        time.sleep(0.001)
    assert s.idle()
    s.put(None, None)  # ends the thread
    s.thread.join(10)


class Counter(Actor):
    def __init__(self):
        self.n = 0

    @endpoint
    def add(self, k):
        self.n += k
        return self.n

    @endpoint
    async def later(self, k):
        import asyncio

        for _ in range(50):  # ready callbacks on the proc's loop: it must not poll while they wait
            await asyncio.sleep(0)
        return k


def test_sync_calls_async_calls_and_gaps_on_a_polling_proc():
    """Calls close together (the proc polls), after a pause (it blocked), and async endpoints in between
    all get their replies in order."""
    procs = this_host().spawn_procs(per_host={"gpus": 1})
    try:
        c = procs.spawn("counter", Counter)
        total = 0
        for i in range(300):
            total += i
            assert c.add.call_one(i).get(timeout=30) == total
            if i % 100 == 99:
                time.sleep(0.05)  # longer than the polling window
                assert c.later.call_one(i).get(timeout=30) == i
        futs = [c.add.call_one(1) for _ in range(200)]
        assert [f.get(timeout=30) for f in futs] == list(range(total + 1, total + 201))
    finally:
        procs.stop()


@pytest.fixture(autouse=True)
def fake_loadavg(tmp_path, monkeypatch):
    """Points the runnable-task count at a file of ours (``/proc/loadavg``'s format): one runnable task
    unless a test says otherwise, so that a busy machine (the rest of the suite's procs exiting) does not
    end a poll that a test expects to go on."""

    fds = []

    def runnable(n: int) -> None:
        path = tmp_path / f"loadavg{len(fds)}"
        path.write_text(f"0.50 0.40 0.30 {n}/321 4242\n")
        fds.append(os.open(path, os.O_RDONLY))
        monkeypatch.setattr(mb_mod, "_loadavg_fd", fds[-1])

    monkeypatch.setattr(mb_mod, "_NCPU", 2)
    runnable(1)
    yield runnable
    monkeypatch.undo()
    for fd in fds:
        os.close(fd)


def test_crowded_counts_runnable_threads_against_the_cores(fake_loadavg):
    fake_loadavg(3)
    assert not mb_mod._crowded()
    fake_loadavg(5)  # more than twice the cores want to run
    assert mb_mod._crowded()


def test_a_crowded_machine_blocks_instead_of_polling(pair, fake_loadavg):
    rx, tx = pair
    fake_loadavg(9)
    spin = Spin(rx, seconds=30.0)  # would poll for 30 s if nothing stopped it
    assert spin.poll() is False
    fake_loadavg(1)
    threading.Timer(0.05, tx.send, (b"d",)).start()
    assert spin.poll() is True  # still on: crowding ends one poll, it does not switch polling off
