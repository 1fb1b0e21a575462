"""Replies up the agent tree (``_fanout.GATHER``, ``_gather.py``) on real agents: chunks, per-rank errors and
deaths, a dead subtree, one sender's order.

One LocalJob (module fixture): two hosts of two procs each, and a spare host that the last test kills. The
agents' gather window is long (``MONARCH_TENSOR_GATHER_WINDOW_MS``), so what the tests see is what the rules
send at once (a whole subtree answered, an error, a death, a message passed up), never a window's flush.
"""

import os
import signal

import numpy as np
import pytest

from monarch_tensor import _fanout, mailbox
from monarch_tensor._ports import Collector, Receiver
from monarch_tensor.actor import Actor, ActorError, Channel, SupervisionError, current_rank, endpoint
from monarch_tensor.job import LocalJob


class Echo(Actor):
    @endpoint
    def value(self, big: bool = False):
        r = current_rank().rank
        return (r, np.full(1 << 18, r, dtype=np.float32)) if big and r == 1 else (r, r * 10)

    @endpoint
    def fail_on(self, ranks: list, gate: str = ""):
        r = current_rank().rank
        if r in ranks:
            raise ValueError(f"rank {r} fails")
        if gate:
            _wait_for(gate)
        return r

    @endpoint
    def exit_on(self, rank: int):
        if current_rank().rank == rank:
            os._exit(3)
        return current_rank().rank

    @endpoint
    def emit(self, port, i: int, slow_rank: int):
        r = current_rank().rank
        if r == slow_rank:
            import time

            time.sleep(0.02)  # (its peer's reply to this call waits at the agent meanwhile)
        port.send((r, i))
        return i

    @endpoint
    def wait_gate(self, gate: str):
        _wait_for(gate)
        return current_rank().rank


def _wait_for(path: str, limit: float = 60) -> None:
    import time

    t0 = time.monotonic()
    while not os.path.exists(path) and time.monotonic() - t0 < limit:
        time.sleep(0.01)


def _wait_for_value(ok, limit: float = 30) -> None:
    import time

    t0 = time.monotonic()
    while not ok() and time.monotonic() - t0 < limit:
        time.sleep(0.01)


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    old = os.environ.get("MONARCH_TENSOR_GATHER_WINDOW_MS")
    os.environ["MONARCH_TENSOR_GATHER_WINDOW_MS"] = "60000"
    try:
        j = LocalJob(meshes={"hosts": 2, "spare": 1}, root_dir=str(tmp_path_factory.mktemp("job")), ttl=120)
        j.state()
    finally:
        if old is None:
            del os.environ["MONARCH_TENSOR_GATHER_WINDOW_MS"]
        else:
            os.environ["MONARCH_TENSOR_GATHER_WINDOW_MS"] = old
    yield j
    j.kill()


@pytest.fixture(scope="module")
def echo(job):
    procs = job.state().hosts.spawn_procs(per_host={"gpus": 2})
    mesh = procs.spawn("echo", Echo)
    mesh.initialized.get(timeout=60)
    yield mesh
    procs.stop().get(timeout=30)


@pytest.fixture
def chunks(monkeypatch):
    """The chunks of gathered replies this process receives: (port id, ranks of their replies, errors)."""
    seen = []
    orig = mailbox.Mailbox._up_entries

    def spy(self, frames):
        msgs = list(orig(self, frames))
        ranks, errors = [], []
        for m, _ in msgs:
            if isinstance(m, mailbox._Replies):  # plain values, delivered in one go
                ranks += m.ranks
            elif getattr(m, "port_id", 0) > 0:
                ranks.append(m.rank)
                if m.error is not None:
                    errors.append(m.rank)
        seen.append((ranks, errors))
        yield from msgs

    monkeypatch.setattr(mailbox.Mailbox, "_up_entries", spy)
    return seen


@pytest.mark.timeout(120)
def test_each_agent_sends_one_chunk_per_call_and_results_equal_the_direct_path(echo, chunks, monkeypatch):
    gathered = [echo.value.call(big).get(timeout=30) for big in (False, True, False)]
    assert len(chunks) == 6  # one per agent per call: each holds its two procs' replies
    assert sorted(sorted(ranks) for ranks, _ in chunks) == [[0, 1], [0, 1], [0, 1], [2, 3], [2, 3], [2, 3]]
    monkeypatch.setattr(_fanout, "GATHER", False)
    chunks.clear()
    direct = [echo.value.call(big).get(timeout=30) for big in (False, True, False)]
    assert chunks == []  # (each reply came on its own)
    for a, b in zip(gathered, direct):
        assert [v[0] for v in a.values()] == [v[0] for v in b.values()] == [0, 1, 2, 3]
        for (_, x), (_, y) in zip(a.values(), b.values()):
            np.testing.assert_array_equal(x, y)
    assert gathered[1].item(hosts=0, gpus=1)[1].shape == (1 << 18,)


@pytest.mark.timeout(120)
def test_a_failed_rank_fails_the_call_at_once_and_hides_no_other_value(echo, chunks, tmp_path):
    gate = str(tmp_path / "gate")
    with pytest.raises(ActorError, match="rank 2 fails"):  # rank 3, its agent's other proc, waits meanwhile
        echo.fail_on.call([2], gate).get(timeout=30)
    assert ([2], [2]) in chunks  # the error went up at once, alone
    open(gate, "w").close()
    # The others' values came all the same (rank 3's once it answered).
    _wait_for_value(lambda: sorted(r for ranks, _ in chunks for r in ranks) == [0, 1, 2, 3])
    assert sorted(r for ranks, _ in chunks for r in ranks) == [0, 1, 2, 3]
    with pytest.raises(ActorError, match="rank [03] fails"):
        echo.fail_on.call([0, 3]).get(timeout=30)
    assert echo.value.call().get(timeout=30).values() == [(r, r * 10) for r in range(4)]


@pytest.mark.timeout(120)
def test_messages_from_one_proc_reach_the_caller_in_the_order_sent(echo, chunks, monkeypatch):
    """A proc's channel value for call i+1 never overtakes its reply to call i, which its agent may hold
    waiting for a slower peer (the value goes up behind it)."""
    order = []
    deliver, deliver_values, receive = Collector.deliver, Collector.deliver_values, Receiver.deliver

    def on_reply(self, msg):
        order.append(("reply", msg.rank, msg.value))
        return deliver(self, msg)

    def on_replies(self, ranks, values):
        order.extend(("reply", r, v) for r, v in zip(ranks, values))
        return deliver_values(self, ranks, values)

    def on_value(self, msg):
        order.append(("value", *msg.value))
        return receive(self, msg)

    monkeypatch.setattr(Collector, "deliver", on_reply)
    monkeypatch.setattr(Collector, "deliver_values", on_replies)
    monkeypatch.setattr(Receiver, "deliver", on_value)
    port, recv = Channel.open()
    two = echo.slice(hosts=0)
    futures = [two.emit.call(port, i, 1) for i in range(10)]
    assert [f.get(timeout=30).values() for f in futures] == [[i, i] for i in range(10)]
    for _ in range(20):
        recv.recv().get(timeout=30)
    for rank in (0, 1):
        mine = [e for e in order if e[1] == rank]
        assert mine == [e for i in range(10) for e in (("value", rank, i), ("reply", rank, i))]


@pytest.mark.timeout(180)
def test_a_dead_proc_or_subtree_fails_its_own_ranks_and_holds_nothing_else(job, monkeypatch, tmp_path):
    """A chain (fan-out 1): controller -> host 0 -> host 1 -> spare, procs on host 0 and the spare. A proc
    that dies, then the spare's agent dying while a call waits on it: their ranks fail by supervision, the
    call does not hang, and the host before them still answers."""
    from monarch_tensor import actor as actor_mod
    from monarch_tensor.remote_hosts import RemoteHostMesh

    monkeypatch.setattr(actor_mod, "unhandled_fault_hook", lambda f: None)
    monkeypatch.setattr(_fanout, "FANOUT", 1)
    st = job.state()
    procs = RemoteHostMesh([st.hosts._agents[0], st.spare._agents[0]]).spawn_procs(per_host={"gpus": 2})
    m = procs.spawn("echo", Echo)
    assert m.value.call().get(timeout=60).values() == [(r, r * 10) for r in range(4)]
    with pytest.raises(SupervisionError):
        m.exit_on.call(3).get(timeout=30)
    assert m.slice(hosts=0).value.call().get(timeout=30).values() == [(0, 0), (1, 10)]
    gate = str(tmp_path / "gate")
    pending = m.slice(gpus=0).wait_gate.call(gate)
    os.kill(job.pids[2], signal.SIGKILL)  # the spare's agent, and with it its procs
    with pytest.raises(SupervisionError):
        pending.get(timeout=30)
    open(gate, "w").close()
    assert m.slice(hosts=0).value.call().get(timeout=30).values() == [(0, 0), (1, 10)]
    procs.stop().get(timeout=30)


# ---- pure: the agent's gathers and the caller's reading of chunks, no processes ---------------------------
def _agent_tree(sent: list):
    """A two-level tree in one process: a root agent's and a child agent's ``Gathers``; what the root sends
    up lands in ``sent``, what the child sends goes to the root."""
    from monarch_tensor._gather import Gathers

    root = Gathers(lambda addr, frames: sent.append((addr, frames)), 60.0, 600.0)
    child = Gathers(lambda addr, frames: root.take(b"child", frames), 60.0, 600.0)
    return root, child


def _reply(key, rank, value=None, error=None):
    import json

    from monarch_tensor import _wire
    from monarch_tensor.messages import SendToPort

    head = _fanout.UP_MAGIC + b"g" + json.dumps({"k": key, "u": int(error is not None), "w": "gw"}).encode()
    return [head, *_wire.encode(SendToPort(key[1], value, error, rank))]


def test_chunks_up_two_levels_read_as_the_replies_one_by_one_would_be():
    """Entries of a child's chunk and the root's own, errors among them, reach the caller's port in full and in
    order, as the same replies sent one by one would."""
    from monarch_tensor import _wire
    from monarch_tensor.messages import SendToPort

    mb = mailbox.Mailbox(io_thread=False)
    try:
        col = Collector([f"a|{i}" for i in range(6)], list(range(6)), list)
        port = mb.open_port(col)
        key = [port.addr, port.port_id]
        sent: list = []
        root, child = _agent_tree(sent)
        root.start({"g": key, "w": "gw", "t": ["0", "1", "2"], "c": [["child", {"t": ["3", "4", "5"], "c": []}]]})
        child.start({"g": key, "w": "gw", "u": "root", "t": ["3", "4", "5"], "c": []})
        for r in (3, 5):
            child.take(str(r), _reply(key, r, value=r * 10))
        for r in (0, 1):
            root.take(str(r), _reply(key, r, value=np.arange(r + 3)))
        assert sent == []  # nobody answered in full yet
        child.take("4", _reply(key, 4, value=40))  # the child's subtree is done: its chunk goes to the root
        root.take("2", _reply(key, 2, value="two"))
        assert len(sent) == 1 and sent[0][0] == "gw"
        mb._dispatch([bytes(f.buffer if hasattr(f, "buffer") else f) for f in sent[0][1]])
        got = col.future.get(timeout=1)
        assert got[2:] == ["two", 30, 40, 50] and [list(a) for a in got[:2]] == [[0, 1, 2], [0, 1, 2, 3]]

        # An error goes up at once, alone, and fails the call as a reply of its own would.
        col2 = Collector([f"a|{i}" for i in range(6)], list(range(6)), list)
        port2 = mb.open_port(col2)
        key2 = [port2.addr, port2.port_id]
        root.start({"g": key2, "w": "gw", "t": ["0", "1", "2"], "c": [["child", {"t": ["3", "4", "5"], "c": []}]]})
        child.start({"g": key2, "w": "gw", "u": "root", "t": ["3", "4", "5"], "c": []})
        root.take("0", _reply(key2, 0, value=0))
        child.take("4", _reply(key2, 4, error=ValueError("rank 4")))
        assert len(sent) == 2
        mb._dispatch([bytes(f.buffer if hasattr(f, "buffer") else f) for f in sent[1][1]])
        with pytest.raises(ValueError, match="rank 4"):
            col2.future.get(timeout=1)
        # (The error took the root's held entries up with it.) A message a proc passes up goes behind its held
        # reply, at once.
        root.take("1", _reply(key2, 1, value=1))
        assert len(sent) == 2
        root.pass_up("1", "gw", _wire.encode(SendToPort(99, "after", None, 0)))
        assert len(sent) == 3
        frames = [bytes(f.buffer if hasattr(f, "buffer") else f) for f in sent[2][1]]
        msgs = [m for m, _ in mb._decoded(frames)]
        assert [(m.port_id, m.values) for m in msgs] == [(port2.port_id, [1]), (99, ["after"])]
        # A proc that exits accounts for its rank: the gathers waiting on it may finish.
        root.proc_exited("2")
        assert list(root.open) == [tuple(key2)]  # the child's ranks 3 and 5 are still out
    finally:
        mb.close()
