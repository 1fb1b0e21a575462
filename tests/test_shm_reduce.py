"""The shared-memory collectives of same-host groups (worker/shm_reduce.py), between real processes: results
equal local torch's bit for bit on every member (chunked buffers too; all-reduce, all-gather, reduce-scatter,
all-to-all, broadcast), the choice of it is the same on every
member, nothing is left in /dev/shm, and a member that is gone or silent fails the others' wait instead of
hanging it."""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import socket
import struct
import threading
import time
import traceback
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from monarch_tensor.worker import shm_reduce
from monarch_tensor.worker.shm_reduce import SLOT_BYTES, CrossHostTags, SameHostReduce

pytestmark = pytest.mark.timeout(120)
N = 3
# A fresh server process forks the members: forking this test process, whose other threads (a store's, a
# mesh's) may hold locks at that moment, can leave a child stuck.
CTX = mp.get_context("forkserver")
CTX.set_forkserver_preload(["torch", "torch.distributed", "monarch_tensor.worker.shm_reduce"])


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _store(port: int, master: bool = False) -> dist.TCPStore:
    """The rendezvous store: the test process serves it, as the controller does for procs."""
    return dist.TCPStore("127.0.0.1", port, None, master, timeout=timedelta(seconds=30), wait_for_workers=False)


def _member(rank: int, port: int, conn, host_id: str | None, cross: bool = False) -> None:
    """A member: takes (data, reduction, timeout) cases from ``conn``, answers each with its result or error.
    ``cross``: the group's tags alone, as across hosts (``CrossHostTags``), whose only collective is "sync"
    (``reduction``: the gloo method it stands before)."""
    try:
        torch.set_num_threads(1)
        if host_id is not None:
            shm_reduce._host_id = lambda: host_id
        store = dist.PrefixStore("g/", _store(port))
        shm = CrossHostTags.rendezvous(store, rank, N, "127.0.0.1") if cross else SameHostReduce.rendezvous(store, rank, N)
        conn.send(None if shm is None else getattr(shm, "nonce", "tcp"))
        try:
            _serve(rank, conn, shm)
        finally:
            if shm is not None:
                shm.close()
    except Exception:  # noqa: BLE001
        conn.send(("crash", traceback.format_exc()))


def _serve(rank: int, conn, shm) -> None:
    """A member's cases, until the test sends None."""
    while True:
        case = conn.recv()
        if case is None:
            return
        kind, data, reduction, timeout, *tag = case
        shm_reduce.current.tag = tag[0] if tag else 0  # (what a worker's stream sets: see shm_reduce)
        if kind == "left":
            shm_reduce.left(shm_reduce.current.tag)
            conn.send(("ok", None))
            continue
        work = data[rank].clone() if kind not in ("many", "sync") else data and data[rank]
        if kind.endswith("+strided"):  # a one-element view with a stride of 2 (contiguous all the same)
            kind = kind.removesuffix("+strided")
            work = torch.stack([work, torch.zeros_like(work)], -1).view(-1)[::2]
        try:
            if kind == "sync":
                shm.sync(reduction, lambda: [], timeout)
            elif kind == "allreduce":
                shm.allreduce(work, reduction, lambda: [], timeout)
            elif kind == "allgather":
                out = torch.empty(N * work.numel(), dtype=work.dtype)
                shm.allgather(out, work, lambda: [], timeout)
                work = out
            elif kind == "alltoall":
                out = torch.full_like(work, -1)
                shm.alltoall(out, work, lambda: [], timeout)
                work = out
            elif kind == "alltoall_in_place":
                shm.alltoall(work, work, lambda: [], timeout)
            elif kind == "broadcast":
                shm.broadcast(work, int(reduction), lambda: [], timeout)
            elif kind == "many":
                work = _many(shm, work, reduction, timeout)
            else:
                out = torch.empty(work.numel() // N, dtype=work.dtype)
                shm.reduce_scatter(out, work, reduction, lambda: [], timeout)
                work = out
            conn.send(("ok", work))
        except Exception as e:  # noqa: BLE001 - reported to the test
            conn.send(("error", f"{type(e).__name__}: {e}"))


def _many(shm: SameHostReduce, case, reduction: str, timeout: float):
    """``allreduce_many`` of ``case`` = (tensors, None for a failed one; their sizes; dtype; in place; ``flat``): (per
    tensor, whether it came through; the results, None where not). ``flat``: this member lays the tensors out
    in one buffer instead, flags first, and all-reduces that, as ``Collectives.reduce_many``'s other path."""
    from monarch_tensor.worker.collectives import _FLAGS

    ts, numels, dtype, inplace, flat = case
    ok, failed = _FLAGS[reduction]
    flags = torch.tensor([ok if t is not None else failed for t in ts], dtype=dtype)
    if flat:
        work = torch.cat([flags] + [t if t is not None else torch.zeros(k, dtype=dtype) for t, k in zip(ts, numels)])
        shm.allreduce(work, reduction, lambda: [], timeout)
        good = (work[:len(ts)] == ok).tolist()
        if reduction == "avg":
            work[len(ts):].div_(N) if dtype.is_floating_point else work[len(ts):].floor_divide_(N)
        outs = list(work[len(ts):].split(list(numels)))
    else:
        ts = [t.clone() if t is not None else None for t in ts]
        into = ts if inplace else None
        good, outs = shm.allreduce_many(ts, numels, flags, ok, reduction, lambda: [], timeout, into=into)
        assert not inplace or all(o is None or o is t for o, t in zip(outs, ts))
    return good, [o if g else None for o, g in zip(outs, good)]


class Members:
    def __init__(self, host_ids=(None,) * N, cross: bool = False) -> None:
        port = _free_port()
        self.store = _store(port, master=True)
        self.conns, self.procs = [], []
        for r in range(N):
            parent, child = CTX.Pipe()
            p = CTX.Process(target=_member, args=(r, port, child, host_ids[r], cross), daemon=True)
            p.start()
            self.conns.append(parent)
            self.procs.append(p)
        self.nonces = [self._recv(c) for c in self.conns]

    def _recv(self, conn, timeout: float = 60):
        assert conn.poll(timeout), "a member did not answer"
        return conn.recv()

    def run(self, data, reduction: str, timeout: float = 60, members=range(N), kind: str = "allreduce",
            tag: int = 0) -> list:
        self.start(data, reduction, timeout, members, kind, tag)
        return self.answers(members, timeout)

    def start(self, data, reduction: str, timeout: float = 60, members=range(N), kind: str = "allreduce",
              tag: int = 0) -> None:
        for r in members:
            self.conns[r].send((kind, data, reduction, timeout, tag))

    def answers(self, members=range(N), timeout: float = 60) -> list:
        return [self._recv(self.conns[r], timeout + 30) for r in members]

    def close(self) -> None:
        for c, p in zip(self.conns, self.procs):
            if p.is_alive():
                c.send(None)
            p.join(10)
            if p.is_alive():
                p.kill()


@pytest.fixture(scope="module")
def members():
    m = Members()
    yield m
    m.close()


def _reference(data: list, reduction: str) -> torch.Tensor:
    op = {"sum": torch.add, "avg": torch.add, "max": torch.maximum, "min": torch.minimum, "product": torch.mul}
    out = op[reduction](data[0], data[1])
    for d in data[2:]:
        out = op[reduction](out, d)
    return out


DTYPES = [torch.float32, torch.float64, torch.int64, torch.int32, torch.bfloat16]


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(numel=st.integers(1, 3000), dtype=st.sampled_from(DTYPES),
       reduction=st.sampled_from(["sum", "avg", "max", "min", "product"]), seed=st.integers(0, 2**16))
def test_every_member_gets_local_torchs_result_bit_for_bit(members, numel, dtype, reduction, seed):
    g = torch.Generator().manual_seed(seed)
    data = [(torch.randn(numel, generator=g) * 10).to(dtype) for _ in range(N)]
    answers = members.run(data, reduction)
    ref = _reference(data, reduction)
    for kind, got in answers:
        assert kind == "ok", got
        assert got.dtype == dtype and torch.equal(got, ref)


def test_a_buffer_larger_than_a_slot_goes_through_in_chunks(members):
    numel = 2 * SLOT_BYTES // 4 + 1001  # three chunks of float32
    data = [torch.arange(numel, dtype=torch.float32) * (r + 1) for r in range(N)]
    for kind, got in members.run(data, "sum"):
        assert kind == "ok", got
        assert torch.equal(got, torch.arange(numel, dtype=torch.float32) * 6)
    small = [torch.full((5,), float(r)) for r in range(N)]  # and the slots keep alternating after it
    for kind, got in members.run(small, "max"):
        assert kind == "ok" and torch.equal(got, torch.full((5,), 2.0))
    big = [torch.arange(N * (SLOT_BYTES // 8 + 5), dtype=torch.float64) + r for r in range(N)]  # two chunks
    ref = _reference(big, "sum").chunk(N)
    for r, (kind, got) in enumerate(members.run(big, "sum", kind="reduce_scatter")):
        assert kind == "ok" and torch.equal(got, ref[r]), got
    for kind, got in members.run(big, "sum", kind="allgather"):
        assert kind == "ok" and torch.equal(got, torch.cat(big)), got


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(part=st.integers(1, 500), dtype=st.sampled_from(DTYPES),
       reduction=st.sampled_from(["sum", "max", "min", "product"]), seed=st.integers(0, 2**16))
def test_all_gather_and_reduce_scatter_equal_local_torch(members, part, dtype, reduction, seed):
    g = torch.Generator().manual_seed(seed)
    data = [(torch.randn(N * part, generator=g) * 10).to(dtype) for _ in range(N)]
    ref = _reference(data, reduction).chunk(N)
    for r, (kind, got) in enumerate(members.run(data, reduction, kind="reduce_scatter")):
        assert kind == "ok", got
        assert torch.equal(got, ref[r])
    for kind, got in members.run(data, reduction, kind="allgather"):
        assert kind == "ok", got
        assert torch.equal(got, torch.cat(data))


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(part=st.integers(1, 400), dtype=st.sampled_from(DTYPES), root=st.integers(0, N - 1),
       in_place=st.booleans(), seed=st.integers(0, 2**16))
def test_all_to_all_and_broadcast_equal_local_torch(members, part, dtype, root, in_place, seed):
    g = torch.Generator().manual_seed(seed)
    data = [(torch.randn(N * part, generator=g) * 10).to(dtype) for _ in range(N)]
    kind = "alltoall_in_place" if in_place else "alltoall"
    for r, (status, got) in enumerate(members.run(data, "", kind=kind)):
        assert status == "ok", got
        assert torch.equal(got, torch.cat([d.chunk(N)[r] for d in data]))
    for status, got in members.run(data, str(root), kind="broadcast"):
        assert status == "ok", got
        assert torch.equal(got, data[root])


@pytest.mark.parametrize("other", ["size", "dtype", "kind"])
def test_members_that_run_different_collectives_at_one_point_all_fail(other):
    """Code that differs between ranks (another size, dtype or kind of collective at the same point) fails the
    collective on every member, as gloo's checks do, instead of reading the others' slots as its own kind of
    data."""
    m = Members()
    try:
        data = [torch.ones(6) for _ in range(N)]
        odd = {"size": torch.ones(8), "dtype": torch.ones(6, dtype=torch.float64), "kind": torch.ones(6)}[other]
        m.start(data, "sum", members=(0, 1))
        m.start([odd] * N, "sum", members=(2,), kind="allgather" if other == "kind" else "allreduce")
        answers = m.answers()
        assert all(kind == "error" and "another collective" in msg for kind, msg in answers), answers
        answers = m.run(data, "sum")  # every member failed that collective alike: the group is still in step
        assert all(k == "ok" and torch.equal(out, torch.full((6,), float(N))) for k, out in answers), answers
    finally:
        m.close()


@pytest.mark.parametrize("kind", ["allreduce", "allgather", "broadcast"])
def test_a_one_element_tensor_with_any_stride_goes_through(members, kind):
    # A DTensor's one-row shard is such a view: its bytes could not be viewed flat ("stride(-1) must be 1").
    data = [torch.tensor([float(3 ** r)]) for r in range(N)]
    answers = members.run(data, "0" if kind == "broadcast" else "sum", kind=kind + "+strided")
    want = {"allreduce": torch.tensor([13.0]), "allgather": torch.tensor([1.0, 3.0, 9.0]),
            "broadcast": torch.tensor([1.0])}[kind]
    assert all(k == "ok" and torch.equal(out, want) for k, out in answers), answers


def test_all_to_all_and_broadcast_of_buffers_larger_than_a_slot(members):
    big = [torch.arange(N * (SLOT_BYTES // 8 + 3), dtype=torch.float64) * (r + 1) for r in range(N)]  # two chunks
    for r, (status, got) in enumerate(members.run(big, "", kind="alltoall")):
        assert status == "ok" and torch.equal(got, torch.cat([d.chunk(N)[r] for d in big])), got
    for r, (status, got) in enumerate(members.run(big, "", kind="alltoall_in_place")):
        assert status == "ok" and torch.equal(got, torch.cat([d.chunk(N)[r] for d in big])), got
    for status, got in members.run(big, "1", kind="broadcast"):
        assert status == "ok" and torch.equal(got, big[1]), got


def test_nothing_is_left_in_the_shared_memory_folder(members):
    folder = shm_reduce._shm_dir()
    assert members.nonces[0] is not None and len(set(members.nonces)) == 1
    assert not [f for f in os.listdir(folder) if members.nonces[0] in f]


def test_the_file_of_a_member_killed_during_a_rendezvous_goes_at_the_next_one():
    # A member killed between making its file and the rendezvous' unlink (a script killed while its procs formed
    # a group) left 8 MB in /dev/shm for good.
    import subprocess
    import time

    dead = subprocess.Popen(["true"])
    dead.wait()
    folder = shm_reduce._shm_dir()
    old = time.time() - 2 * shm_reduce.SWEEP_AGE_S
    files = {"dead, old": (f"monarch-tensor-{'a' * 32}-1.{dead.pid}", old),
             "alive, old": (f"monarch-tensor-{'b' * 32}-1.{os.getpid()}", old),
             "dead, new": (f"monarch-tensor-{'c' * 32}-1.{dead.pid}", time.time())}
    for name, when in files.values():
        with open(os.path.join(folder, name), "wb") as f:
            f.write(b"x")
        os.utime(os.path.join(folder, name), (when, when))
    m = Members()
    try:
        left = set(os.listdir(folder))
        assert [k for k, (name, _) in files.items() if name in left] == ["alive, old", "dead, new"]
    finally:
        m.close()
        for name, _ in files.values():
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(folder, name))


def test_members_on_different_hosts_all_take_gloo():
    m = Members(host_ids=("host-a", "host-a", "host-b"))
    try:
        assert m.nonces == [None, None, None]
    finally:
        for c in m.conns:
            c.send(None)
        for p in m.procs:
            p.join(10)


def test_a_silent_member_times_the_wait_out_and_a_gone_one_fails_it_at_once():
    m = Members()
    try:
        data = [torch.ones(4) for _ in range(N)]
        answers = m.run(data, "sum", timeout=1.0, members=(0, 1))  # member 2 never joins this one
        assert all(kind == "error" and "TimeoutError" in msg and "[2]" in msg for kind, msg in answers), answers
        answers = m.run(data, "sum", members=(0,))  # after a failure the group says so, at once
        assert answers[0][0] == "error" and "failed before" in answers[0][1]
    finally:
        m.close()
    m = Members()
    try:
        m.procs[2].kill()
        m.procs[2].join(10)
        answers = m.run([torch.ones(4) for _ in range(N)], "sum", members=(0, 1))
        assert all(kind == "error" and "gone" in msg for kind, msg in answers), answers
    finally:
        m.close()


def test_a_member_past_a_collective_or_out_of_its_call_fails_it_and_the_group_stays_in_step(members):
    """Collectives pair up by order: a member that skipped one (its remote function raised before it, or
    returned without it) must not pair its next collective with the others' skipped one, which gave both
    wrong sums without an error. The others' collective fails, naming the member, and the next one pairs
    every member's right tensors; a member that ended its call by an error (``left``) fails a collective of
    that call at once, not at the timeout; one that ends its call after its collectives fails nothing."""
    data = [torch.full((5,), float(10 ** r)) for r in range(N)]
    later = [torch.full((5,), float(2 ** r)) for r in range(N)]
    members.start(later, "sum", members=(2,), tag=7 << shm_reduce.STEP_BITS)  # member 2 is past call 5 already
    answers = members.run(data, "sum", members=(0, 1), tag=5 << shm_reduce.STEP_BITS)
    assert all(kind == "error" and "Skipped" in msg and "member 2" in msg and "later call" in msg
               for kind, msg in answers), answers
    members.start(later, "sum", members=(0, 1), tag=7 << shm_reduce.STEP_BITS)
    answers = members.answers()
    assert all(kind == "ok" and torch.equal(out, torch.full((5,), 7.0)) for kind, out in answers), answers

    assert members.run(None, "sum", members=(2,), kind="left", tag=9 << shm_reduce.STEP_BITS) == [("ok", None)]
    answers = members.run(data, "sum", members=(0, 1), tag=9 << shm_reduce.STEP_BITS, timeout=60)
    assert all(kind == "error" and "member 2" in msg and "ended this call" in msg for kind, msg in answers), answers

    tag = 11 << shm_reduce.STEP_BITS | 3  # (step 3 of a compiled program)
    members.start(data, "sum", members=(2,), tag=tag)
    members.start(None, "sum", members=(2,), kind="left", tag=tag)  # after its collective: no harm
    answers = members.run(data, "sum", members=(0, 1), tag=tag) + members.answers((2, 2))
    assert [a[0] for a in answers] == ["ok"] * 4, answers
    assert all(torch.equal(out, torch.full((5,), 111.0)) for _, out in answers[:3]), answers


@pytest.mark.timeout(120)
def test_across_hosts_the_tags_alone_fail_a_skipped_or_different_collective_and_a_member_gone():
    """``CrossHostTags``: the same frames over TCP connections, before each collective of a group across hosts
    (gloo moves the data, and would pair a skipped collective with the member's next one)."""
    m = Members(cross=True)
    try:
        assert m.nonces == ["tcp"] * N
        assert m.run(None, "allreduce", kind="sync", tag=3 << shm_reduce.STEP_BITS) == [("ok", None)] * N
        m.start(None, "allreduce", members=(2,), kind="sync", tag=7 << shm_reduce.STEP_BITS)  # past call 5 already
        answers = m.run(None, "allreduce", members=(0, 1), kind="sync", tag=5 << shm_reduce.STEP_BITS)
        assert all(k == "error" and "Skipped" in msg and "member 2" in msg and "later call" in msg
                   for k, msg in answers), answers
        m.start(None, "allreduce", members=(0, 1), kind="sync", tag=7 << shm_reduce.STEP_BITS)
        assert m.answers() == [("ok", None)] * N  # the group is in step
        assert m.run(None, "sum", members=(2,), kind="left", tag=9 << shm_reduce.STEP_BITS) == [("ok", None)]
        answers = m.run(None, "allreduce", members=(0, 1), kind="sync", tag=9 << shm_reduce.STEP_BITS)
        assert all(k == "error" and "member 2" in msg and "ended this call" in msg for k, msg in answers), answers
        m.start(None, "allgather", members=(2,), kind="sync", tag=11 << shm_reduce.STEP_BITS)
        answers = m.run(None, "allreduce", members=(0, 1), kind="sync", tag=11 << shm_reduce.STEP_BITS)
        answers += m.answers((2,))
        assert all(k == "error" and "another collective" in msg for k, msg in answers), answers
        assert m.run(None, "allreduce", kind="sync", tag=13 << shm_reduce.STEP_BITS) == [("ok", None)] * N
        m.procs[2].kill()  # its connections close: the others fail now, not at the timeout
        m.procs[2].join(10)
        answers = m.run(None, "allreduce", members=(0, 1), kind="sync", tag=15 << shm_reduce.STEP_BITS)
        assert all(k == "error" and "member 2 of this group is gone" in msg for k, msg in answers), answers
    finally:
        m.close()


class _StrangersFirst:
    """A store through which member 0's listener gets strangers before the other member hears of it: one that
    sends the start of a zmq greeting and waits (a zmq socket reconnecting to a port the kernel handed out
    again), one that connects and closes, one that sends a wrong token."""

    def __init__(self, store) -> None:
        self.store, self.strangers = store, []

    def set(self, key: str, value) -> None:
        if key == "tcp/addr/0":
            host, port = value.split()[:2]
            for hello in (b"\xff" + bytes(8) + b"\x7f\x03", b"", bytes(shm_reduce._TOKEN_BYTES) + struct.pack("<i", 1)):
                s = socket.create_connection((host, int(port)))
                s.sendall(hello)
                if not hello:
                    s.close()
                self.strangers.append(s)
        self.store.set(key, value)

    def get(self, key: str):
        return self.store.get(key)


@pytest.mark.timeout(60)
def test_across_hosts_the_rendezvous_hangs_up_on_strangers_and_still_connects_every_member():
    """A cross-host group's rendezvous listens on a port the kernel hands out, which another program's socket
    may still try to reach (zmq reconnects to a gone peer's port): a connection that does not open with the
    member's token and a new member's rank is hung up on, and the members still meet and run a collective's
    check (once, a zmq socket's greeting failed the whole group's rendezvous, and its collectives went
    unchecked)."""
    store = _StrangersFirst(dist.HashStore())
    got: dict = {}

    def member(r: int) -> None:
        got[r] = CrossHostTags.rendezvous(store, r, 2, "127.0.0.1", 20)

    def sync(r: int) -> None:
        got[r].sync("allreduce", lambda: [], 20)
        got[f"synced {r}"] = True

    try:
        for target in (member, sync):
            threads = [threading.Thread(target=target, args=(r,)) for r in range(2)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(30)
            assert not any(t.is_alive() for t in threads)
            if target is member:
                assert all(isinstance(got.get(r), CrossHostTags) for r in range(2)), got
        assert got["synced 0"] and got["synced 1"]
        for i in (0, 2):  # hung up on: their reads end with nothing
            store.strangers[i].settimeout(10)
            assert store.strangers[i].recv(1) == b"", i
    finally:
        for s in store.strangers:
            s.close()
        for r in range(2):
            if got.get(r) is not None:
                got[r].close()


def test_the_rendezvous_accepts_give_up_at_their_deadline_naming_the_members_missing():
    with socket.create_server(("127.0.0.1", 0)) as listener:
        with pytest.raises(OSError, match=r"members \[1, 2\] did not connect in time"):
            shm_reduce._accept_members(listener, b"t" * shm_reduce._TOKEN_BYTES, {1, 2}, time.monotonic() + 0.2)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("cross", [False, True])
def test_a_member_that_ends_many_calls_while_the_others_run_no_collective_never_blocks(cross):
    """Each end of a call (``left``) was a datagram, which a member reads only in a collective of the group:
    where a host queues 10 datagrams at most, a remote function given the group called 11 times without a
    collective blocked its proc for good. The ends of calls now never block, and still fail a collective
    of such a call at once."""
    m = Members(cross=cross)
    try:
        assert None not in m.nonces, m.nonces  # (every member's rendezvous met the others)
        for t in range(1, 60):
            assert m.run(None, "sum", members=(2,), kind="left", tag=t << shm_reduce.STEP_BITS) == [("ok", None)]
        answers = m.run(None, "allreduce", members=(0, 1), kind="sync", tag=59 << shm_reduce.STEP_BITS)
        assert all(k == "error" and "member 2" in msg and "ended this call" in msg for k, msg in answers), answers
        assert m.run(None, "allreduce", kind="sync", tag=61 << shm_reduce.STEP_BITS) == [("ok", None)] * N
    finally:
        m.close()


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(numels=st.lists(st.integers(0, 700), min_size=1, max_size=6), dtype=st.sampled_from(DTYPES),
       reduction=st.sampled_from(["sum", "avg", "max", "min", "product"]), inplace=st.booleans(),
       failed=st.one_of(st.none(), st.tuples(st.integers(0, N - 1), st.integers(0, 5))),
       flat=st.lists(st.booleans(), min_size=N, max_size=N), seed=st.integers(0, 2**16))
def test_many_tensors_at_once_equal_local_torch_and_either_layout_meets_the_other(
        members, numels, dtype, reduction, inplace, failed, flat, seed):
    """``allreduce_many`` (each tensor straight into the slot; in place, members 0 and 1 add the others' parts
    into their own tensors), whatever each member's choice between it and one buffer of them all: every
    tensor equals local torch's reduce bit for bit, and one that failed on some member (None there) comes
    through on none."""
    g = torch.Generator().manual_seed(seed)
    data = [[(torch.randn(k, generator=g) * 10).to(dtype) for k in numels] for _ in range(N)]
    lost = None
    if failed is not None and failed[1] < len(numels):
        lost = failed[1]
        data[failed[0]][lost] = None
    answers = members.run([(data[r], numels, dtype, inplace, flat[r]) for r in range(N)], reduction, kind="many")
    for kind, got in answers:
        assert kind == "ok", got
        good, outs = got
        assert good == [i != lost for i in range(len(numels))]
        for i, out in enumerate(outs):
            if i == lost:
                assert out is None
                continue
            ref = _reference([data[r][i] for r in range(N)], reduction)
            if reduction == "avg":
                ref = ref / N if dtype.is_floating_point else ref.floor_divide(N)
            assert out.dtype == dtype and torch.equal(out, ref), (i, out, ref)


def test_many_tensors_larger_than_a_slot_in_place(members):
    """Tensors that cross the chunks' boundaries (one larger than a slot), in place, then a small reduce: the
    slots keep alternating."""
    numels = [SLOT_BYTES // 4 + 3, 17, SLOT_BYTES // 8, 5]  # float32: three chunks
    data = [[torch.arange(k, dtype=torch.float32) * (r + 1) + i for i, k in enumerate(numels)] for r in range(N)]
    for flat in ((False,) * N, (True, False, False)):
        for kind, got in members.run([(data[r], numels, torch.float32, True, flat[r]) for r in range(N)], "sum", kind="many"):
            assert kind == "ok", got
            assert got[0] == [True] * 4
            for i, (out, k) in enumerate(zip(got[1], numels)):
                assert torch.equal(out, torch.arange(k, dtype=torch.float32) * 6 + 3 * i), i
    small = [torch.full((5,), float(r)) for r in range(N)]
    for kind, got in members.run(small, "max"):
        assert kind == "ok" and torch.equal(got, torch.full((5,), 2.0))
