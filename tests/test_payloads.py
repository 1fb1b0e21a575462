"""Large message buffers to other hosts ride the data plane (rdma/payload.py), never the control link.

The first tests drive the wire format and a mailbox in this process (a lost payload fails whoever waits
on it). The rest run a LocalJob of two host agents: their procs are reached over tcp through the
agents, as on a real cluster, so actor arguments, replies, broadcasts, fetch_shard and to_mesh all
take the path; ``MONARCH_TENSOR_RDMA_BACKEND=tcp`` makes the pulls use the tcp backend as between
machines (tests/test_netns_hosts.py does it across network namespaces).
"""

from __future__ import annotations

import os
import pickle
import time

import numpy as np
import pytest
import torch
from monarch_tensor.rdma import payload, transfer_stats
from monarch_tensor.rdma._registry import registry

from monarch_tensor import fetch_shard, inspect
from monarch_tensor.actor import Actor, endpoint
from monarch_tensor.job import LocalJob
from monarch_tensor.transport import _wire
from monarch_tensor.transport._ports import Collector
from monarch_tensor.transport.mailbox import LOST_REWRITES, Mailbox, current_mailbox
from monarch_tensor.transport.messages import CallEndpoint, PortRef, SendToPort

MiB = 1 << 20


def _remote(n: int = 1) -> tuple:
    """``encode``'s remote argument: n receivers on another host, release messages to this process."""
    return (n, "tcp://127.0.0.1:1", current_mailbox().public_addr)


def _wait(cond, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.01)


# ---- the wire format, in this process ------------------------------------------------------------
@pytest.mark.timeout(60)
def test_large_buffers_for_another_host_travel_as_a_payload_and_are_released_once_pulled():
    x = torch.arange(MiB, dtype=torch.float32)  # 4 MiB
    a = np.arange(300_000, dtype=np.int64)
    before = payload.stats()
    frames = _wire.encode(CallEndpoint("a", "m", (x, a, "small"), {}, None), remote=_remote())
    assert len(frames) == 2 and bytes(frames[0][:4]) == _wire.MAGIC_DP
    assert sum(len(f) for f in frames) < 4096  # only the descriptor: no tensor bytes in the frames
    x.add_(1)  # the message is a snapshot: changing the tensor after the send does not change it
    msg = _wire.decode(frames)
    assert torch.equal(msg.args[0], torch.arange(MiB, dtype=torch.float32))
    assert np.array_equal(msg.args[1], a) and msg.args[2] == "small"
    _wait(lambda: payload.stats()["live"] == before["live"])  # the release reached us: dropped
    after = payload.stats()
    assert after["published"] == before["published"] + 1 and after["released"] == before["released"] + 1
    assert after["pulled_bytes"] - before["pulled_bytes"] >= x.nbytes + a.nbytes
    # Small messages and messages to this host are unchanged.
    assert bytes(_wire.encode(("tiny", torch.ones(4)), remote=_remote())[0][:4]) == _wire.MAGIC
    assert bytes(_wire.encode(x, shm=True)[0][:4]) == _wire.MAGIC_SHM


@pytest.mark.timeout(60)
def test_a_payload_for_several_receivers_lives_until_the_last_has_pulled():
    x = torch.randn(MiB // 2)
    frames = _wire.encode(x, remote=_remote(3))
    live = payload.stats()["live"]
    for i in range(3):
        assert torch.equal(_wire.decode(frames), x)
        if i < 2:
            time.sleep(0.1)
            assert payload.stats()["live"] == live  # still there for the others
    _wait(lambda: payload.stats()["live"] == live - 1)


@pytest.mark.timeout(60)
def test_beyond_the_memory_bound_or_the_threshold_buffers_stay_in_the_frames(monkeypatch):
    x = torch.randn(MiB)
    monkeypatch.setattr(payload, "MAX_BYTES", payload.stats()["live_bytes"] + MiB)
    frames = _wire.encode(x, remote=_remote())
    assert bytes(frames[0][:4]) == _wire.MAGIC and torch.equal(_wire.decode(frames), x)
    monkeypatch.setattr(payload, "MAX_BYTES", 1 << 40)
    monkeypatch.setattr(payload, "THRESHOLD", 0)  # turned off
    assert bytes(_wire.encode(x, remote=_remote())[0][:4]) == _wire.MAGIC


@pytest.mark.timeout(60)
def test_the_threshold_is_the_first_size_that_rides_the_data_plane():
    at = torch.ones(payload.THRESHOLD, dtype=torch.uint8)  # 1 MiB or more go on the data plane
    frames = _wire.encode(at, remote=_remote())
    assert bytes(frames[0][:4]) == _wire.MAGIC_DP and torch.equal(_wire.decode(frames), at)
    under = torch.ones(payload.THRESHOLD - 1, dtype=torch.uint8)
    frames = _wire.encode(under, remote=_remote())
    assert bytes(frames[0][:4]) == _wire.MAGIC and torch.equal(_wire.decode(frames), under)


@pytest.mark.timeout(60)
def test_a_payload_nobody_pulls_is_dropped_after_its_ttl(monkeypatch):
    monkeypatch.setattr(payload, "TTL", 0.3)
    frames = _wire.encode(torch.randn(MiB), remote=_remote())
    buf = pickle.loads(frames[1]).buf
    assert registry().lookup(buf._desc.buf_id, buf._desc.token) is not None
    expired = payload.stats()["expired"]
    _wait(lambda: payload.stats()["expired"] > expired)
    assert registry().lookup(buf._desc.buf_id, buf._desc.token) is None
    with pytest.raises(_wire.PayloadLost, match="could not be pulled"):
        _wire.decode(frames)


def _lost(msg) -> list:
    """Frames of ``msg`` whose payload is gone before the receiver pulls it (as if its sender died)."""
    frames = _wire.encode(msg, remote=_remote())
    d = pickle.loads(frames[1]).buf._desc
    assert registry().drop(d.buf_id)
    return frames


@pytest.mark.timeout(60)
def test_a_reply_whose_payload_is_lost_fails_the_callers_future():
    mb = Mailbox(io_thread=False)
    try:
        col = Collector(["ipc:///elsewhere"], [0], lambda vs: vs[0])
        port = mb.open_port(col)
        mb._dispatch(_lost(SendToPort(port.port_id, torch.randn(MiB), None, 0)))
        with pytest.raises(payload.PayloadError, match="could not be pulled from its sender"):
            col.future.get(timeout=5)
    finally:
        mb.close()


@pytest.mark.timeout(60)
def test_a_call_whose_payload_is_lost_answers_its_caller_with_the_error():
    receiver, caller = Mailbox(io_thread=False), Mailbox()
    try:
        col = Collector([receiver.addr], [0], lambda vs: vs[0])
        reply = caller.open_port(col)
        receiver.on_message = lambda m: pytest.fail(f"a call without its data was run: {m}")
        receiver._dispatch(_lost(CallEndpoint("actor", "method", (torch.randn(MiB),), {}, reply)))
        with pytest.raises(payload.PayloadError, match="over the data plane"):
            col.future.get(timeout=10)
    finally:
        receiver.close()
        caller.close()


@pytest.mark.timeout(60)
def test_to_mesh_data_whose_payload_is_lost_fails_the_receiving_tensor():
    from monarch_tensor.worker import worker  # registers its rewrite

    mb = Mailbox(io_thread=False)
    got = []
    mb.on_message = got.append
    try:
        mb._dispatch(_lost(CallEndpoint(worker.WORKER_NAME, "deliver", (7, torch.randn(MiB)), {}, None)))
    finally:
        mb.close()
    assert (worker.WORKER_NAME, "deliver") in LOST_REWRITES
    [msg] = got
    assert (msg.method, msg.args[0]) == ("deliver_failed", 7)
    assert isinstance(msg.args[1], payload.PayloadError)


@pytest.mark.timeout(60)
def test_a_tensor_batch_whose_payload_is_lost_fails_the_instructions_that_carried_tensors():
    import monarch_tensor.worker.worker as ww
    from monarch_tensor.worker import messages as wm

    const = wm.CreateValue(5, torch.randn(MiB), 0)  # its bytes ride the payload
    op = wm.CallOp("aten::add.Tensor", (wm.Ref(5), 1), {}, (0,), (6,), (), 0, None)  # no data of its own
    fetch = wm.FetchValue(wm.Ref(6), None, PortRef("ipc:///elsewhere", 3), 0, None)
    mb = Mailbox(io_thread=False)
    got = []
    mb.on_message = got.append
    try:
        mb._dispatch(_lost(CallEndpoint(ww.WORKER_NAME, "execute", ([const, op, wm.DeleteRefs((4,), 0), fetch],), {},
                                        None)))
    finally:
        mb.close()
    [msg] = got
    assert msg.method == "execute_unreadable"
    batch, error, payload_lost = msg.args
    assert payload_lost and isinstance(error, payload.PayloadError)
    marked = ww.mark_unreadable(batch, error, payload_lost)
    assert [type(i).__name__ for i in marked] == ["tuple", "CallOp", "DeleteRefs", "FetchValue"]
    assert marked[0][0].ref == 5 and marked[0][1:] == (error, True)
    # The same batch with a piece that could not be unpickled fails only the instruction holding it.
    stubbed = ww.mark_unreadable([op, wm.CreateValue(7, [1, _wire._Stub()], 0)], error, False)
    assert stubbed[0] is op and stubbed[1][0].ref == 7


# ---- real procs behind host agents ---------------------------------------------------------------
def _checksum(x: torch.Tensor) -> int:
    """The sum of the bits, exact in any order (a float sum's rounding depends on how many threads ran it)."""
    return int(x.view(torch.int32).to(torch.int64).sum())


class Echo(Actor):
    @endpoint
    def echo(self, x):
        return x

    @endpoint
    def total(self, x) -> int:
        return _checksum(x)

    @endpoint
    def stats(self):
        return payload.stats(), {k: dict(v) for k, v in transfer_stats().items()}

    @endpoint
    def use_backend(self, name: str) -> None:
        os.environ["MONARCH_TENSOR_RDMA_BACKEND"] = name


@pytest.fixture(scope="module")
def hosts(tmp_path_factory):
    job = LocalJob(meshes={"m": 2}, root_dir=str(tmp_path_factory.mktemp("payloads")), ttl=120)
    try:
        procs = job.state().m.spawn_procs(per_host={"gpus": 1})
        yield procs
        procs.stop().get(timeout=30)
    finally:
        job.kill()


@pytest.mark.timeout(120)
def test_a_proc_at_an_address_an_earlier_proc_had_is_not_taken_for_that_one(tmp_path):
    """A host agent whose port the system hands out again gives its procs the addresses an earlier agent's
    procs had: what this process recorded of those (a death) must not refuse calls to the new ones. (In CI
    an earlier test's stopped proc left such a record and a later fixture's fresh mesh was refused.)"""
    from monarch_tensor.errors import MeshStoppedError
    from monarch_tensor.transport.mailbox import local_mailboxes

    job = LocalJob(meshes={"m": 1}, root_dir=str(tmp_path), ttl=120)
    try:
        first = job.state().m.spawn_procs(per_host={"gpus": 1})
        base, _, n = first._procs[0].addr.rpartition("|")
        nxt = f"{base}|{int(n) + 1}"  # the agent numbers its procs: where its next one will be
        for mailbox in local_mailboxes():  # as an earlier proc stopped at that address leaves it
            mailbox.proc_died(nxt, MeshStoppedError(f"proc {nxt} (rank 0) was stopped (stopped by client)"))
        second = job.state().m.spawn_procs(per_host={"gpus": 1})
        assert second._procs[0].addr == nxt
        assert second.spawn("echo_again", Echo).echo.call_one(3).get(timeout=60) == 3
        second.stop().get(timeout=30)
        first.stop().get(timeout=30)
    finally:
        job.kill()


@pytest.mark.timeout(180)
@pytest.mark.parametrize("backend", ["", "tcp"])
def test_actor_arguments_and_results_to_other_hosts_are_pulled_over_the_data_plane(hosts, backend,
                                                                                   monkeypatch):
    e = hosts.spawn(f"echo{backend}", Echo)
    e.use_backend.call(backend).get(timeout=60)
    monkeypatch.setenv("MONARCH_TENSOR_RDMA_BACKEND", backend)
    x = torch.randn(3 * MiB // 4 + 5)  # ~3 MiB, not a round size
    arr = np.random.default_rng(0).integers(0, 1 << 30, size=MiB // 2)
    procs0 = e.stats.call().get(timeout=60).values()
    mine0 = payload.stats()

    fut = e.slice(hosts=1, gpus=0).echo.call_one((x, arr))
    expect = x.clone()
    x.add_(1)  # after the send: the proc still gets what was sent
    y, arr2 = fut.get(timeout=60)
    assert torch.equal(y, expect) and np.array_equal(arr2, arr)
    # A broadcast down the agents' tree: one payload, pulled by every proc.
    assert e.total.call(x).get(timeout=60).values() == [_checksum(x)] * 2

    procs1 = e.stats.call().get(timeout=60).values()
    mine1 = payload.stats()
    pulled = [b[0]["pulled"] - a[0]["pulled"] for a, b in zip(procs0, procs1)]
    assert pulled == [1, 2]  # host 0: the broadcast; host 1: the echo's argument and the broadcast
    assert mine1["published"] - mine0["published"] == 2 and mine1["pulled"] - mine0["pulled"] == 1
    assert procs1[1][0]["published"] - procs0[1][0]["published"] == 1  # the echo's result
    if backend == "tcp":
        reads = [b[1]["tcp"]["reads"] - a[1]["tcp"]["reads"] for a, b in zip(procs0, procs1)]
        assert all(r >= 1 for r in reads)
    _wait(lambda: payload.stats()["live"] == mine0["live"])
    _wait(lambda: [s[0]["live"] for s in e.stats.call().get(timeout=60).values()] == [0, 0])


@pytest.mark.timeout(180)
def test_fetch_shard_and_to_mesh_across_hosts_pull_over_the_data_plane(hosts):
    e = hosts.spawn("stats", Echo)  # the tensor engine's workers run in these same procs
    procs0 = [s[0]["pulled"] for s in e.stats.call().get(timeout=60).values()]
    mine = payload.stats()["pulled"]
    with hosts.activate():
        x = torch.arange(float(MiB)) + hosts.rank("hosts")  # 4 MiB per rank
        got = fetch_shard(x, hosts=1, gpus=0).result(timeout=60)
        moved = x.slice_mesh(hosts=0).to_mesh(hosts.slice(hosts=1))  # host 0's proc sends to host 1's
        back = inspect(moved * 2, gpus=0)
    assert torch.equal(got, torch.arange(float(MiB)) + 1)
    assert torch.equal(back, torch.arange(float(MiB)) * 2)
    assert payload.stats()["pulled"] - mine == 2  # the fetch and the inspect
    procs1 = [s[0]["pulled"] for s in e.stats.call().get(timeout=60).values()]
    assert [b - a for a, b in zip(procs0, procs1)] == [0, 1]  # host 1 pulled the to_mesh data from host 0


def test_payload_memory_is_page_aligned_from_64_kib():
    """A snapshot and its reader's copy start at the same offset within a page (page-aligned from
    ``_PAGED`` up), so the kernel's copy between them is never of the slow, few-bytes-apart kind; and the
    memory is writable and of the size asked."""
    for n in (payload._PAGED, payload._PAGED + 17, 3 << 20):
        a = payload._alloc(n)
        assert a.nbytes == n and a.ctypes.data % 4096 == 0 and a.flags.writeable
        a[:] = 7
        assert int(a[-1]) == 7
