"""Batching of calls and replies, and the compact envelope of the hottest messages.

A burst of small calls to one proc (and their replies) leaves in a few frames
instead of one each (``Mailbox.send_frames(..., batch=True)``). These tests
check what must not change: every message arrives, in the order sent, even when
nobody waits on a reply; a batched reply is not held back by a slow call behind
it; malformed batches are dropped like any malformed message.
"""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from monarch_tensor.actor import Actor, endpoint, this_host
from monarch_tensor.errors import ProtocolError
from monarch_tensor.transport import _wire
from monarch_tensor.transport import mailbox as mailbox_mod
from monarch_tensor.transport.mailbox import Mailbox
from monarch_tensor.transport.messages import (
    CallEndpoint,
    PortRef,
    SendToPort,
    StopProc,
    call_envelope,
    reply_envelope,
)

pytestmark = pytest.mark.timeout(120)


# ---- the frame format --------------------------------------------------------------------------
@settings(max_examples=200, deadline=None)
@given(st.lists(st.binary(max_size=300), max_size=40))
def test_batch_frames_round_trip(parts):
    assert [bytes(p) for p in _wire.unpack_batch(_wire.pack_batch(parts))] == parts
    assert _wire.is_batch(_wire.pack_batch(parts))


@pytest.mark.parametrize("cut", [1, 4, 9, 12])
def test_truncated_batches_raise(cut):
    frame = _wire.pack_batch([b"abcdef", b"ghij"])
    with pytest.raises(ProtocolError):
        _wire.unpack_batch(frame[:-cut])


def test_batch_with_trailing_bytes_or_a_lying_count_raises():
    frame = _wire.pack_batch([b"abc"])
    with pytest.raises(ProtocolError, match="after"):
        _wire.unpack_batch(frame + b"zz")
    lying = _wire._HEADER.pack(_wire.MAGIC_BATCH, 5) + frame[_wire._HEADER.size:]
    with pytest.raises(ProtocolError, match="ends inside"):
        _wire.unpack_batch(lying)
    with pytest.raises(ProtocolError):
        _wire.unpack_batch(b"MT0")


# ---- the compact envelope -------------------------------------------------------------------------
@pytest.mark.parametrize("msg", [
    CallEndpoint("a", "m", (1, "x"), {"k": [1]}, PortRef("ipc:///tmp/x", 7)),
    CallEndpoint("a", "m", (), {}, None),
    SendToPort(3, {"v": (1, 2)}, None, 5),
    SendToPort(3, None, ValueError("boom"), -1),
])
def test_compact_messages_round_trip(msg):
    frames = _wire.encode(msg)
    got = _wire.decode(frames)
    assert type(got) is type(msg)
    if isinstance(msg, SendToPort) and msg.error is not None:
        assert (got.port_id, got.value, got.rank, repr(got.error)) == (3, None, -1, repr(msg.error))
    else:
        assert got == msg
    # the envelope holds no class reference: just the tag and the fields
    assert b"CallEndpoint" not in bytes(frames[0]) and b"SendToPort" not in bytes(frames[0])


def test_plain_tuples_are_not_taken_for_compact_messages():
    for value in [("hello", 1), (1, "\0call"), ("\0nope", 1, 2)]:
        assert _wire.decode(_wire.encode(value)) == value


def test_a_call_whose_reply_is_not_a_port_still_round_trips():
    msg = CallEndpoint("a", "m", (), {}, "nowhere")
    assert _wire.decode(_wire.encode(msg)) == msg


# ---- runs of immutable envelopes ("\0many") --------------------------------------------------------
_SCALARS = st.one_of(st.integers(), st.floats(allow_nan=False), st.text(max_size=30), st.binary(max_size=30),
                     st.none(), st.booleans())
_FROZEN = st.recursive(_SCALARS, lambda inner: st.lists(inner, max_size=4).map(tuple), max_leaves=12)


class _MyInt(int):
    pass


class _MyStr(str):
    pass


@settings(max_examples=300, deadline=None)
@given(_FROZEN)
def test_frozen_size_takes_builtins_and_tuples_of_them_and_bounds_their_pickle(x):
    n = _wire.frozen_size(x, depth=64)
    assert n >= 0, x
    assert len(pickle.dumps(x, protocol=5)) <= n + 16


@settings(max_examples=300, deadline=None)
@given(_FROZEN, st.sampled_from([[1], [], {}, {"a": 1}, {1}, frozenset([1]), bytearray(b"x"), object(), _MyInt(3),
                                 _MyStr("s"), range(3), Path("/")]), st.integers(0, 4))
def test_frozen_size_refuses_anything_mutable_or_not_builtin_wherever_it_is(x, bad, depth):
    v = (x, bad)
    for _ in range(depth):
        v = ("outer", v, 1)
    assert _wire.frozen_size(v, depth=64) == -1
    assert _wire.frozen_size(bad) == -1


def test_frozen_size_refuses_what_is_too_deep_or_too_large():
    assert _wire.frozen_size((1, (2, (3,))), depth=3) >= 0
    assert _wire.frozen_size((1, (2, (3, (4,)))), depth=3) == -1
    assert _wire.frozen_size(("x" * 100_000,)) == -1
    assert _wire.frozen_size((b"x" * 100_000,)) == -1
    assert _wire.frozen_size((7 ** 100_000,)) == -1  # (an int's pickle grows with it)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["envelope", "frame"]), st.integers(0, 10**6)), max_size=40))
def test_a_batch_of_envelopes_and_frames_arrives_in_order(items):
    batch = [reply_envelope(i, (i, "v"), None, 0) if kind == "envelope" else _wire.encode(StopProc(f"s{i}"))[0]
             for kind, i in items]
    frames = _wire.pack_runs(batch)
    assert len(frames) <= len(batch)
    got = []
    for frame in frames:
        msg = _wire.decode([frame])
        got.extend(msg if type(msg) is _wire.Many else [msg])
    assert [("envelope", m.port_id) if isinstance(m, SendToPort) else ("frame", int(m.reason[1:])) for m in got] \
        == items
    assert all(m.value == (m.port_id, "v") for m in got if isinstance(m, SendToPort))


def test_a_run_that_is_not_a_list_is_a_protocol_error():
    with pytest.raises(ProtocolError):
        _wire.decode([_wire.encode_plain((_wire.MANY, ("not", "a list")))])


# ---- two mailboxes in this process ------------------------------------------------------------------
class _Inbox:
    def __init__(self) -> None:
        self.got: list = []
        self.cond = threading.Condition()

    def __call__(self, msg) -> None:
        with self.cond:
            self.got.append(msg)
            self.cond.notify_all()

    def wait_for(self, n: int, timeout: float = 30.0) -> list:
        with self.cond:
            assert self.cond.wait_for(lambda: len(self.got) >= n, timeout), f"got {len(self.got)} of {n}"
            return list(self.got)


@pytest.fixture
def pair():
    inbox, other = _Inbox(), _Inbox()
    rx, rx2 = Mailbox(on_message=inbox), Mailbox(on_message=other)
    tx = Mailbox()
    try:
        yield tx, rx, inbox, rx2, other
    finally:
        for mb in (tx, rx, rx2):
            mb.close()


def _call(i: int) -> CallEndpoint:
    return CallEndpoint("a", "m", (i,), {}, None)


def _call_of(*args) -> CallEndpoint:
    return CallEndpoint("a", "m", args, {}, None)


def test_a_burst_arrives_whole_and_in_order_in_fewer_frames_without_anyone_flushing(pair):
    tx, rx, inbox, _, _ = pair
    n = 3000
    for i in range(n):
        tx.send(rx.addr, _call(i), batch=True)
    got = inbox.wait_for(n)  # no flush(), no Future: the flush thread sends the tail
    assert [m.args[0] for m in got] == list(range(n))
    assert tx.batches_sent > 0, "a burst of 3,000 small messages went out one frame each"


def _mixed_burst(tx, rx, n: int, send, send_other) -> tuple[list, list]:
    """``n`` sends from ``tx``: a plain one to ``rx`` every 50 from 7 (it flushes the batch before it in the middle
    of a burst), ``send_other(i)`` to another destination every 50 from 30, ``send(i)`` to ``rx`` otherwise; what
    ``rx`` and the other destination must get, in order."""
    sent, sent2 = [], []
    for i in range(n):
        if i % 50 == 7:
            tx.send(rx.addr, StopProc(f"plain {i}"))
            sent.append(f"plain {i}")
        elif i % 50 == 30:
            send_other(i)
            sent2.append(i)
        else:
            send(i)
            sent.append(i)
    return sent, sent2


def test_order_holds_across_batched_and_plain_sends_and_destinations(pair):
    tx, rx, inbox, rx2, other = pair
    sent, sent2 = _mixed_burst(tx, rx, 600, lambda i: tx.send(rx.addr, _call(i), batch=True),
                               lambda i: tx.send(rx2.addr, _call(i), batch=True))
    got = inbox.wait_for(len(sent))
    assert [m.reason if isinstance(m, StopProc) else m.args[0] for m in got] == sent
    assert [m.args[0] for m in other.wait_for(len(sent2))] == sent2


def test_envelopes_batched_frames_and_plain_sends_arrive_in_the_order_sent(pair):
    tx, rx, inbox, rx2, other = pair

    def send(i):
        if i % 3:  # a call of immutable values: waits as its envelope
            # (its size given: the kwargs dict is the caller's to vouch for, as Endpoint._send does)
            assert tx.send_plain(rx.addr, call_envelope("a", "m", (i, ("x", 1.5)), {}, None, None), 64)
        else:  # one that is not (a list): encoded at once, batched as its frame
            tx.send(rx.addr, _call_of([i]), batch=True)

    def send_other(i):
        assert tx.send_plain(rx2.addr, call_envelope("a", "m", (i,), {}, None, None), 64)

    sent, sent2 = _mixed_burst(tx, rx, 900, send, send_other)
    got = inbox.wait_for(len(sent))
    assert [m.reason if isinstance(m, StopProc) else (m.args[0] if isinstance(m.args[0], int) else m.args[0][0])
            for m in got] == sent
    assert all(m.args[1] == ("x", 1.5) for m in got if isinstance(m, CallEndpoint) and isinstance(m.args[0], int))
    assert [m.args[0] for m in other.wait_for(len(sent2))] == sent2
    assert tx.batches_sent > 0


def test_an_envelope_of_anything_mutable_or_not_builtin_is_not_taken(pair):
    tx, rx, _, _, _ = pair
    assert tx.send_plain(rx.addr, reply_envelope(1, (1, "x", b"y", None, 2.5, True), None, 0))
    for value in [[1], {"a": 1}, object(), (1, [2]), _MyInt(1), bytearray(b"x")]:
        assert not tx.send_plain(rx.addr, reply_envelope(1, value, None, 0))
    assert not tx.send_plain(rx.addr, reply_envelope(1, None, ValueError("boom"), 0))
    assert not tx.send_plain(rx.addr, call_envelope("a", "m", (1,), {}, None, None))  # (a dict, unvouched for)


def test_a_send_after_a_flush_leaves_at_once_while_a_burst_is_held(pair, monkeypatch):
    """A loop of synchronous calls: each call follows the last one within the gap, but its caller
    waited for the reply (a flush) in between, so the burst had ended and the call must not wait for
    a batch. Without a flush in between, the same send is held."""
    monkeypatch.setattr(mailbox_mod, "BATCH_DELAY", 60.0)  # a held message would not arrive in this test
    monkeypatch.setattr(mailbox_mod, "BATCH_GAP", 10.0)  # every send is within the gap of the last one
    tx, rx, inbox, _, _ = pair
    tx.send(rx.addr, _call(0), batch=True)
    inbox.wait_for(1)
    for i in range(1, 20):
        tx.flush()  # what Future.get does before it waits
        tx.send(rx.addr, _call(i), batch=True)
        assert [m.args[0] for m in inbox.wait_for(i + 1, timeout=10)] == list(range(i + 1))
    tx.send(rx.addr, _call(20), batch=True)  # no flush before it: the burst goes on, the message is held
    time.sleep(0.3)
    assert len(inbox.got) == 20
    tx.flush()
    assert inbox.wait_for(21)[-1].args[0] == 20


def test_batching_off_sends_one_frame_per_message(pair, monkeypatch):
    monkeypatch.setattr(mailbox_mod, "BATCH_GAP", 0.0)
    tx, rx, inbox, _, _ = pair
    for i in range(500):
        tx.send(rx.addr, _call(i), batch=True)
    assert [m.args[0] for m in inbox.wait_for(500)] == list(range(500))
    assert tx.batches_sent == 0


def test_large_messages_are_never_batched(pair):
    tx, rx, inbox, _, _ = pair
    big = b"x" * (mailbox_mod.BATCH_BYTES + 1)
    for i in range(20):
        tx.send(rx.addr, CallEndpoint("a", "m", (i, big if i % 2 else b""), {}, None), batch=True)
    got = inbox.wait_for(20)
    assert [m.args[0] for m in got] == list(range(20))
    assert all(m.args[1] == (big if m.args[0] % 2 else b"") for m in got)
    assert tx.batches_sent == 0  # (the small ones each sat between two large ones: nothing to batch with)


def test_close_sends_what_is_still_batched():
    inbox = _Inbox()
    rx = Mailbox(on_message=inbox)
    tx = Mailbox()
    try:
        for i in range(200):
            tx.send(rx.addr, _call(i), batch=True)
        tx.close()
        assert [m.args[0] for m in inbox.wait_for(200)] == list(range(200))
    finally:
        tx.close()
        rx.close()


# ---- real procs ----------------------------------------------------------------------------------
class Worker(Actor):
    def __init__(self) -> None:
        self.seen: list[int] = []

    @endpoint
    def quick(self, i: int) -> int:
        self.seen.append(i)
        return i

    @endpoint
    def slow(self, gate: str) -> str:
        """Returns once the file ``gate`` exists (at most 60 s)."""
        deadline = time.monotonic() + 60
        while not os.path.exists(gate) and time.monotonic() < deadline:
            time.sleep(0.01)
        return "slow done" if os.path.exists(gate) else "gate never opened"

    @endpoint
    def order(self) -> list[int]:
        return self.seen

    @endpoint
    def echo(self, x):
        return x

    @endpoint
    def grow(self, i: int) -> list[int]:
        """Its own list, which the next call changes."""
        if i == 0:
            self.grown: list[int] = []
        self.grown.append(i)
        return self.grown


@pytest.fixture(scope="module")
def worker():
    procs = this_host().spawn_procs({"gpus": 1})
    try:
        yield procs.spawn("w", Worker)
    finally:
        procs.stop().get(timeout=30)


def test_pipelined_calls_run_in_order_and_every_reply_arrives(worker):
    futs = [worker.quick.call_one(i) for i in range(2000)]
    assert [f.get(timeout=60) for f in futs] == list(range(2000))
    assert worker.order.call_one().get(timeout=30)[-2000:] == list(range(2000))


def test_a_value_changed_after_its_call_or_reply_arrives_as_it_was_when_sent(worker):
    # A burst's calls and replies wait in batches; what they carry must be what it was when sent, not what
    # it became by the time the batch left.
    buf = [0]
    futs = []
    for i in range(1000):
        buf[0] = i
        futs.append(worker.echo.call_one((i, buf)))
        futs.append(worker.echo.call_one(i if i % 2 else ("t", i)))  # (immutable: these wait as envelopes)
    got = [f.get(timeout=60) for f in futs]
    assert got[::2] == [(i, [i]) for i in range(1000)]
    assert got[1::2] == [i if i % 2 else ("t", i) for i in range(1000)]
    futs = [worker.grow.call_one(i) for i in range(1000)]
    assert [f.get(timeout=60) for f in futs] == [list(range(i + 1)) for i in range(1000)]


def test_a_reply_is_not_held_back_by_a_slow_call_behind_it(worker, tmp_path):
    gate = str(tmp_path / "gate")
    futs = [worker.quick.call_one(i) for i in range(200)]
    slow = worker.slow.call_one(gate)  # in the same burst: the proc runs it right after the quick ones
    # The quick replies arrive while the slow call still waits for its gate, which opens only after
    # them: a batched reply waits for at most the flush thread's delay, never for the calls after it.
    assert [f.get(timeout=50) for f in futs] == list(range(200))
    assert not slow.done()
    open(gate, "w").close()
    assert slow.get(timeout=60) == "slow done"


def test_stream_and_call_on_a_mesh_with_batching(worker):
    futs = [worker.quick.call(i) for i in range(300)]
    assert [f.get(timeout=60).item(gpus=0) for f in futs] == list(range(300))
    assert [f.get(timeout=30) for f in worker.quick.stream(5)] == [5]


def test_a_script_that_exits_right_after_a_burst_still_delivers_it(tmp_path):
    inbox = _Inbox()
    rx = Mailbox(on_message=inbox)
    script = tmp_path / "burst.py"
    script.write_text(
        "import sys\n"
        "from monarch_tensor.transport.mailbox import current_mailbox\n"
        "from monarch_tensor.transport.messages import CallEndpoint\n"
        "mb = current_mailbox()\n"
        "for i in range(50):\n"
        "    mb.send(sys.argv[1], CallEndpoint('a', 'm', (i,), {}, None), batch=True)\n"
        "print('batched' if mb._batch else 'sent', flush=True)\n")
    try:
        out = subprocess.run([sys.executable, str(script), rx.addr], capture_output=True, text=True, timeout=60,
                             cwd=str(tmp_path), env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[1])})
        assert out.returncode == 0, out.stderr
        assert [m.args[0] for m in inbox.wait_for(50)] == list(range(50))
        assert out.stdout.strip() == "batched", "the script's last messages were still batched when it exited"
    finally:
        rx.close()


def test_what_a_script_sent_last_waits_at_its_exit_for_a_peer_not_connected_yet(tmp_path):
    # The script's peer binds only after the script sent its burst and printed that it ends: the burst
    # can reach it only if the script's exit waits for delivery (at the interpreter's exit pyzmq leaves
    # its context as it is, and queued messages went with the process). The test binds right after the
    # line; the exit waits up to _EXIT_LINGER_MS for it.
    addr = mailbox_mod.new_ipc_address("late-peer")
    script = tmp_path / "burst_then_exit.py"
    script.write_text(
        "import sys\n"
        "from monarch_tensor.transport.mailbox import current_mailbox\n"
        "from monarch_tensor.transport.messages import CallEndpoint\n"
        "mb = current_mailbox()\n"
        "for i in range(20):\n"
        "    mb.send(sys.argv[1], CallEndpoint('a', 'm', (i,), {}, None), batch=i % 2 == 0)\n"
        "print('ending', flush=True)\n")
    proc = subprocess.Popen([sys.executable, str(script), addr], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, cwd=str(tmp_path),
                            env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[1])})
    rx = None
    try:
        assert proc.stdout.readline().strip() == "ending", proc.stderr.read()
        time.sleep(0.3)  # longer than the interpreter takes to end (40-70 ms here) when nothing waits
        inbox = _Inbox()
        rx = Mailbox(addr=addr, on_message=inbox)
        assert [m.args[0] for m in inbox.wait_for(20)] == list(range(20))
        assert proc.wait(timeout=30) == 0, proc.stderr.read()
    finally:
        proc.kill()
        proc.wait(timeout=30)
        if rx is not None:
            rx.close()


def test_a_child_forked_from_a_script_leaves_the_scripts_mailbox_alone_at_its_exit(tmp_path):
    # The child inherits the script's mailbox object: its exit hook closed nothing of the parent's, but
    # removed the parent's socket file, so no new peer could reach the script after the child ended.
    script = tmp_path / "fork_exit.py"
    script.write_text(
        "import os, queue, sys\n"
        "from monarch_tensor.transport.mailbox import Mailbox, set_current_mailbox\n"
        "from monarch_tensor.transport.messages import CallEndpoint\n"
        "got = queue.Queue()\n"
        "mb = Mailbox(on_message=got.put)\n"
        "set_current_mailbox(mb)  # (the one the exit hook closes)\n"
        "pid = os.fork()\n"
        "if pid == 0:\n"
        "    sys.exit(0)\n"
        "assert os.waitpid(pid, 0)[1] == 0\n"
        "late = Mailbox()  # a peer that connects after the child ended\n"
        "late.send(mb.addr, CallEndpoint('a', 'm', (7,), {}, None))\n"
        "print('got', got.get(timeout=20).args, flush=True)\n")
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60, cwd=str(tmp_path),
                         env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[1])})
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "got (7,)"


@pytest.mark.parametrize("bad", ["fast", "-5"])
def test_a_bad_batch_gap_setting_is_a_clear_error(monkeypatch, bad):
    monkeypatch.setenv("MONARCH_TENSOR_BATCH_GAP_US", bad)
    with pytest.raises(ValueError, match="MONARCH_TENSOR_BATCH_GAP_US"):
        mailbox_mod._us_from_env("MONARCH_TENSOR_BATCH_GAP_US")
    monkeypatch.setenv("MONARCH_TENSOR_BATCH_GAP_US", "50")
    assert mailbox_mod._us_from_env("MONARCH_TENSOR_BATCH_GAP_US") == pytest.approx(50e-6)
