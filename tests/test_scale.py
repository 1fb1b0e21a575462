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
        replies = [m for m, _ in msgs if getattr(m, "port_id", 0) > 0]
        seen.append(([m.rank for m in replies], [m.rank for m in replies if m.error is not None]))
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
    deliver, receive = Collector.deliver, Receiver.deliver

    def on_reply(self, msg):
        order.append(("reply", msg.rank, msg.value))
        return deliver(self, msg)

    def on_value(self, msg):
        order.append(("value", *msg.value))
        return receive(self, msg)

    monkeypatch.setattr(Collector, "deliver", on_reply)
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
