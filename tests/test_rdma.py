"""The shared suite every data-plane backend available here passes, on real processes.

Owners are actors on procs of this host; the reader is the test process (and,
in one test, another proc). Each test runs once per backend that can serve
CPU memory here (forced with MONARCH_TENSOR_RDMA_BACKEND); cuda_ipc runs in
tests/test_rdma_cuda.py where a GPU exists; verbs's seams are in
tests/test_rdma_verbs.py (no RDMA device here).
"""

from __future__ import annotations

import errno
import os
import pickle
import signal
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from monarch_tensor.rdma import (
    BufferDroppedError,
    OwnerDiedError,
    RDMAAction,
    RDMABuffer,
    RDMATcpFallbackWarning,
    TransferTimeoutError,
    get_rdma_backend,
    is_ibverbs_available,
    is_rdma_available,
    preferred_backend,
    publish_tensor,
    transfer_stats,
)
from monarch_tensor.rdma.backends import cma
from monarch_tensor.rdma.buffer import ENV_BACKEND, unavailable_backends
from monarch_tensor.rdma.errors import BackendUnavailableError

from monarch_tensor.actor import Actor, endpoint, this_host

BACKENDS = ["cma", "tcp"]
N = 1 << 16


class Owner(Actor):
    def __init__(self):
        self.tensors, self.bufs = {}, {}

    @endpoint
    def make(self, key: str, n: int, dtype: str = "uint8", seed: int = 0) -> RDMABuffer:
        g = torch.Generator().manual_seed(seed)
        t = torch.randint(0, 250, (n,), generator=g).to(getattr(torch, dtype))
        self.tensors[key] = t
        self.bufs[key] = RDMABuffer(t)
        return self.bufs[key]

    @endpoint
    def value(self, key: str) -> torch.Tensor:
        return self.tensors[key].clone()

    @endpoint
    def drop(self, key: str) -> None:
        self.bufs[key].drop()

    @endpoint
    def drop_handle(self, buf: RDMABuffer) -> None:
        buf.drop()

    @endpoint
    def pid(self) -> int:
        return os.getpid()

    @endpoint
    def addr(self) -> str:
        from monarch_tensor.transport.mailbox import current_mailbox

        return current_mailbox().addr

    @endpoint
    def read(self, buf: RDMABuffer, n: int) -> tuple[torch.Tensor, str]:
        out = torch.empty(n, dtype=torch.uint8)
        buf.read_into(out).get(timeout=30)
        return out, buf.backend

    @endpoint
    async def read_async(self, buf: RDMABuffer, n: int) -> torch.Tensor:
        out = torch.empty(n, dtype=torch.uint8)
        await buf.read_into(out)
        return out


@pytest.fixture(scope="module")
def owners():
    procs = this_host().spawn_procs(per_host={"gpus": 2})
    mesh = procs.spawn("rdma_owner", Owner)
    yield mesh
    procs.stop().get(timeout=30)


@pytest.fixture(params=BACKENDS)
def backend(request, monkeypatch):
    monkeypatch.setenv(ENV_BACKEND, request.param)
    return request.param


def _stop(pid: int, timeout: float = 10.0) -> None:
    """SIGSTOP ``pid`` and wait until every one of its threads is stopped: the signal takes effect a few
    ms later on a busy 2-core machine, and a thread still running meanwhile could serve a transfer."""
    os.kill(pid, signal.SIGSTOP)
    deadline = time.monotonic() + timeout
    while True:
        states = []
        for t in os.listdir(f"/proc/{pid}/task"):
            try:
                with open(f"/proc/{pid}/task/{t}/stat") as f:
                    states.append(f.read().rsplit(") ", 1)[1][0])
            except FileNotFoundError:  # a thread that ended meanwhile
                pass
        if all(s in "tT" for s in states):
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"pid {pid} still has running threads ({states}) {timeout} s after SIGSTOP")
        time.sleep(0.001)


def _owner(owners, i=0):
    return owners.slice(gpus=i)


def _transfer_with_the_owner_stopped(owners, key: str, n: int, seed: int, kind: str, timeout: float):
    """Owner 1's buffer ``key`` (``n`` bytes, ``seed``), a connection to it in the pool, then the owner
    stopped and a read of it (into zeroed memory) or a write (of other bytes) submitted: ``(buffer, future,
    owner pid, holds)``. SIGCONT the pid when done; then ``holds()`` says whether the read's destination or the
    buffer has the bytes it should."""
    o = _owner(owners, 1)
    buf = o.make.call_one(key, n, seed=seed).get()
    want = o.value.call_one(key).get()
    out = torch.empty(n, dtype=torch.uint8)
    buf.read_into(out).get(timeout=10)  # a connection in the pool, before the owner stops
    if kind == "read":
        out.zero_()
    else:
        want = torch.randint(0, 250, (n,), generator=torch.Generator().manual_seed(seed + 1)).to(torch.uint8)
    pid = o.pid.call_one().get()
    _stop(pid)
    try:
        fut = buf.read_into(out, timeout=timeout) if kind == "read" else buf.write_from(want, timeout=timeout)
    except BaseException:
        os.kill(pid, signal.SIGCONT)
        raise

    def holds() -> bool:
        return torch.equal(out if kind == "read" else o.value.call_one(key).get(), want)

    return buf, fut, pid, holds


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(-1).view(torch.uint8)


def test_read_and_write_whole_buffer(owners, backend):
    o = _owner(owners)
    buf = o.make.call_one("whole", N).get()
    assert buf.size() == N and buf.owner == o.addr.call_one().get()
    before = transfer_stats()[backend]
    out = torch.empty(N, dtype=torch.uint8)
    buf.read_into(out).get(timeout=30)
    assert buf.backend == backend  # the one that moved the bytes
    assert torch.equal(out, o.value.call_one("whole").get())
    src = torch.arange(N, dtype=torch.int64).to(torch.uint8).flip(0).contiguous()
    buf.write_from(src).get(timeout=30)
    assert torch.equal(o.value.call_one("whole").get(), src)
    after = transfer_stats()[backend]
    assert (after["reads"] - before["reads"], after["writes"] - before["writes"]) == (1, 1)
    assert after["bytes"] - before["bytes"] == 2 * N


@pytest.mark.parametrize("dtype", ["float32", "int64", "bfloat16", "uint8", "bool"])
def test_dtypes(owners, backend, dtype):
    o = _owner(owners)
    buf = o.make.call_one(f"d-{dtype}", 1001, dtype).get()
    out = torch.empty(1001, dtype=getattr(torch, dtype))
    buf.read_into(out).get(timeout=30)
    assert torch.equal(out, o.value.call_one(f"d-{dtype}").get())


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_offsets_and_sizes_match_a_local_copy(owners, data):
    """Hypothesis: any (offset, size) inside the buffer reads and writes exactly those bytes."""
    name = data.draw(st.sampled_from(BACKENDS))
    os.environ[ENV_BACKEND] = name
    try:
        o = _owner(owners)
        buf = o.make.call_one("hyp", 4099, seed=7).get()
        ref = o.value.call_one("hyp").get()
        off = data.draw(st.integers(0, 4098))
        n = data.draw(st.integers(1, 4099 - off))
        out = torch.empty(n, dtype=torch.uint8)
        buf.read_into(out, offset=off).get(timeout=30)
        assert torch.equal(out, ref[off:off + n])
        src = torch.full((n,), 251, dtype=torch.uint8)
        buf.write_from(src, offset=off).get(timeout=30)
        ref[off:off + n] = 251
        assert torch.equal(o.value.call_one("hyp").get(), ref)
    finally:
        del os.environ[ENV_BACKEND]


def test_large_transfer_several_streams(owners, backend):
    o = _owner(owners)
    n = 24 << 20  # above tcp's stream chunk: 4+ connections in parallel
    buf = o.make.call_one("large", n, seed=3).get()
    out = torch.empty(n, dtype=torch.uint8)
    buf.read_into(out).get(timeout=60)
    assert torch.equal(out, o.value.call_one("large").get())


@settings(max_examples=200, deadline=None)
@given(n=st.integers(1, 1 << 28), k=st.integers(1, 16))
def test_cma_pieces_tile_the_transfer(n, k):
    """Hypothesis: the pieces of a cma transfer cover [0, n) in order, without gaps, page-aligned."""
    parts = cma.pieces(n, k)
    assert parts[0][0] == 0 and sum(m for _, m in parts) == n
    assert all(o1 + m1 == o2 for (o1, m1), (o2, _) in zip(parts, parts[1:]))
    assert all(o % 4096 == 0 and m > 0 for o, m in parts)
    if len(parts) > 1:
        assert k > 1 and all(m <= cma.PIECE_MAX for _, m in parts)


def test_cma_transfer_in_many_pieces_on_several_threads(owners, monkeypatch):
    """A transfer cut into more pieces than threads moves exactly its bytes, at an odd offset, both ways."""
    monkeypatch.setenv(ENV_BACKEND, "cma")
    monkeypatch.setattr(cma, "PIECE_MIN", 4096)
    monkeypatch.setattr(cma, "PIECE_MAX", 3 * 4096)
    monkeypatch.setattr(cma, "threads", lambda: 3)
    used, real, meet = set(), cma._call, threading.Barrier(2, timeout=20)

    def call(write, pid, local, remote, n):
        if n > 8:  # (8 bytes: the registration's slot, read before the pieces)
            if not used:  # the first two pieces wait for each other: two threads take pieces
                meet.wait()
            used.add(threading.get_ident())
        return real(write, pid, local, remote, n)

    monkeypatch.setattr(cma, "_call", call)
    o = _owner(owners)
    n = 20 * 4096 + 123
    buf = o.make.call_one("pieces", n + 77, seed=11).get()
    ref = o.value.call_one("pieces").get()
    out = torch.empty(n, dtype=torch.uint8)
    buf.read_into(out, offset=77).get(timeout=30)
    assert torch.equal(out, ref[77:])
    src = torch.randint(0, 250, (n,), dtype=torch.uint8)
    buf.write_from(src, offset=77).get(timeout=30)
    assert torch.equal(o.value.call_one("pieces").get()[77:], src)
    assert len(used) > 1, "the pieces all ran on one thread"


@settings(max_examples=300, deadline=None)
@given(dst=st.integers(0, 1 << 48), src=st.integers(0, 1 << 48), base=st.integers(0, 1 << 48))
def test_cma_short_distance_and_placement(dst, src, base):
    """Hypothesis: ``short_distance`` is exactly "the destination lies 1 to SHORT - 1 bytes past the source
    within a page" (on a CPU with fast string copies: forced here); ``_placed`` puts staging memory within
    the 4 KiB after its base, STAGE_SHIFT bytes past the remote bytes within a page, a fast distance."""
    real = cma._string_copies
    cma._string_copies = lambda: True
    try:
        assert cma.short_distance(dst, src) == (0 < (dst - src) % 4096 < cma.SHORT)
        at = cma._placed(base, src)
        assert base <= at < base + 4096 and (at - src) % 4096 == cma.STAGE_SHIFT
        assert not cma.short_distance(at, src) and not cma.short_distance(src, at)
    finally:
        cma._string_copies = real


def _at_page_offset(n: int, page_offset: int) -> tuple[np.ndarray, np.ndarray]:
    """``n`` bytes of fresh memory starting ``page_offset`` bytes into a page: (the view, what keeps it)."""
    backing = np.zeros(n + 8192, dtype=np.uint8)
    start = (page_offset - backing.ctypes.data) % 4096
    return backing[start:start + n], backing


def test_cma_stages_a_transfer_whose_kernel_copy_would_be_slow(owners, monkeypatch):
    """A cma read into memory a few bytes past the remote bytes within a page (and a write from memory a
    few bytes before them) goes through staging memory, each of its pieces in STAGE-byte steps (not a
    whole number of pages here, so each step places its staging memory anew), and moves exactly its bytes, at an
    odd offset and size; a transfer at a fast distance, or on a CPU without fast string copies, does not
    stage."""
    monkeypatch.setenv(ENV_BACKEND, "cma")
    monkeypatch.setattr(cma, "_string_copies", lambda: True)
    monkeypatch.setattr(cma, "STAGE", 3 * 4096 + 512)
    monkeypatch.setattr(cma, "STAGE_MIN", 4096)
    monkeypatch.setattr(cma, "PIECE_MIN", 8 * 4096)  # and the pieces of two threads
    monkeypatch.setattr(cma, "threads", lambda: 2)
    staged, real = [], cma.CmaBackend._move_staged

    def spy(self, write, desc, local, remote, n, deadline):
        staged.append(("w" if write else "r", n))
        return real(self, write, desc, local, remote, n, deadline)

    monkeypatch.setattr(cma.CmaBackend, "_move_staged", spy)
    o = _owner(owners)
    n, off = 40 * 4096 + 123, 77
    buf = o.make.call_one("staged", n + off, seed=21).get()
    ref = o.value.call_one("staged").get().numpy()
    remote = (buf._desc.addr + off) % 4096
    out, keep = _at_page_offset(n, remote + 16)  # 16 bytes past the remote bytes: a slow copy
    buf.read_into(out, offset=off).get(timeout=30)
    assert np.array_equal(out, ref[off:])
    assert staged and {k for k, _ in staged} == {"r"} and sum(m for _, m in staged) == n and len(staged) > 1
    staged.clear()
    src, keep2 = _at_page_offset(n, remote - 16)  # the remote bytes 16 past the source: a slow copy
    src[:] = np.random.default_rng(5).integers(0, 250, n, dtype=np.uint8)
    buf.write_from(src, offset=off).get(timeout=30)
    assert np.array_equal(o.value.call_one("staged").get().numpy()[off:], src)
    assert {k for k, _ in staged} == {"w"} and sum(m for _, m in staged) == n
    staged.clear()
    fast, keep3 = _at_page_offset(n, remote + 64)
    buf.read_into(fast, offset=off).get(timeout=30)
    assert np.array_equal(fast, src) and staged == []
    monkeypatch.setattr(cma, "_string_copies", lambda: False)  # a CPU without fast string copies: direct
    out[:] = 0
    buf.read_into(out, offset=off).get(timeout=30)
    assert np.array_equal(out, src) and staged == []


def test_concurrent_transfers_and_action(owners, backend):
    o = _owner(owners)
    bufs = [o.make.call_one(f"c{i}", 5000 + i, seed=i).get() for i in range(6)]
    outs = [torch.empty(5000 + i, dtype=torch.uint8) for i in range(6)]
    futs = [b.read_into(x) for b, x in zip(bufs, outs)]
    for f in futs:
        f.get(timeout=30)
    for i, x in enumerate(outs):
        assert torch.equal(x, o.value.call_one(f"c{i}").get())
    src = torch.zeros(100, dtype=torch.uint8)
    again = torch.empty(5000, dtype=torch.uint8)
    RDMAAction().write_remote(bufs[1], src).read_remote(again, bufs[0]).submit(timeout=30).get(timeout=30)
    assert torch.equal(again, outs[0])
    assert torch.equal(o.value.call_one("c1").get()[:100], src)
    # the buffer first in read_remote (this project's earlier order), the local memory first in write_remote
    more = torch.empty(5002, dtype=torch.uint8)
    ones = torch.ones(50, dtype=torch.uint8)
    RDMAAction().read_remote(bufs[2], more).write_remote(ones, bufs[3]).submit(timeout=30).get(timeout=30)
    assert torch.equal(more, outs[2])
    assert torch.equal(o.value.call_one("c3").get()[:50], ones)
    with pytest.raises(TypeError, match="not between two buffers"):
        RDMAAction().read_remote(bufs[0], bufs[1])
    with pytest.raises(TypeError, match="needs an RDMABuffer and local memory"):
        RDMAAction().write_remote(again, src)


class Adder(Actor):
    @endpoint
    def add_many(self, buf: RDMABuffer, times: int) -> list[int]:
        seen, old = [], torch.zeros(1, dtype=torch.int64)
        for _ in range(times):
            RDMAAction().fetch_add(buf, old, 1, offset=8).submit(timeout=30).get(timeout=30)
            seen.append(int(old))
        return seen


def test_atomics_fetch_add_and_compare_and_swap(owners, backend):
    """Monarch declares these and raises NotImplementedError; here the owner does them, one at a time."""
    o = _owner(owners)
    buf = o.make.call_one("atomic", 4, dtype="int64").get(timeout=30)
    start = o.value.call_one("atomic").get(timeout=30)
    old = torch.zeros(1, dtype=torch.int64)
    RDMAAction().fetch_add(buf, old, 5).submit(timeout=30).get(timeout=30)
    assert int(old) == int(start[0])
    RDMAAction().fetch_add(buf, old, -7).submit(timeout=30).get(timeout=30)  # two's complement: subtracts
    assert int(old) == int(start[0]) + 5
    now = o.value.call_one("atomic").get(timeout=30)
    assert int(now[0]) == int(start[0]) - 2 and torch.equal(now[1:], start[1:])
    # compare-and-swap: swapped only when the word equals ``compare``; ``dst`` gets the value before
    word = int(now[0])
    RDMAAction().compare_and_swap(buf, old, word + 1, 99).submit(timeout=30).get(timeout=30)
    assert int(old) == word and int(o.value.call_one("atomic").get(timeout=30)[0]) == word
    RDMAAction().compare_and_swap(buf, old, word, 99, offset=24).submit(timeout=30).get(timeout=30)
    assert int(old) == int(start[3])
    RDMAAction().compare_and_swap(buf, old, word, 99).submit(timeout=30).get(timeout=30)
    assert int(old) == word and int(o.value.call_one("atomic").get(timeout=30)[0]) == 99
    # wraps modulo 2**64, as RDMA's do
    RDMAAction().compare_and_swap(buf, old, 99, -1).submit(timeout=30).get(timeout=30)
    RDMAAction().fetch_add(buf, old, 2).submit(timeout=30).get(timeout=30)
    assert int(old) == -1 and int(o.value.call_one("atomic").get(timeout=30)[0]) == 1
    # atomic with respect to each other: this process and another proc add at once, no update lost
    first = int(o.value.call_one("atomic").get(timeout=30)[1])
    adder = owners._proc_mesh.spawn(f"adder_{backend}", Adder).slice(gpus=1)  # the owner is on gpus=0
    theirs = adder.add_many.call_one(buf, 200)
    ours = []
    for _ in range(200):
        RDMAAction().fetch_add(buf, old, 1, offset=8).submit(timeout=30).get(timeout=30)
        ours.append(int(old))
    seen = sorted(ours + theirs.get(timeout=60))
    assert seen == list(range(first, first + 400))  # every add saw a distinct value before it
    assert int(o.value.call_one("atomic").get(timeout=30)[1]) == first + 400


_WORD = st.integers(-(1 << 63), (1 << 64) - 1)


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=st.lists(st.tuples(st.sampled_from(["add", "cas", "cas_hit"]), st.integers(0, 3), _WORD, _WORD),
                    min_size=1, max_size=12))
def test_atomics_match_a_local_model(owners, ops):
    """Hypothesis: any sequence of fetch_add and compare_and_swap on the buffer's words returns and leaves
    what 64-bit wrapping arithmetic on a local copy does."""
    o = _owner(owners)
    buf = o.make.call_one("atomic_hyp", 4, dtype="int64", seed=11).get(timeout=30)
    model = [int(v) & 0xFFFF_FFFF_FFFF_FFFF for v in o.value.call_one("atomic_hyp").get(timeout=30)]
    old = torch.zeros(1, dtype=torch.int64)
    for kind, i, a, b in ops:
        if kind == "add":
            RDMAAction().fetch_add(buf, old, a, offset=8 * i).submit(timeout=30).get(timeout=30)
            before, model[i] = model[i], (model[i] + a) & 0xFFFF_FFFF_FFFF_FFFF
        else:
            compare = model[i] if kind == "cas_hit" else a
            RDMAAction().compare_and_swap(buf, old, compare, b, offset=8 * i).submit(timeout=30).get(timeout=30)
            before = model[i]
            if model[i] == compare & 0xFFFF_FFFF_FFFF_FFFF:
                model[i] = b & 0xFFFF_FFFF_FFFF_FFFF
        assert int(old) & 0xFFFF_FFFF_FFFF_FFFF == before
    assert [int(v) & 0xFFFF_FFFF_FFFF_FFFF for v in o.value.call_one("atomic_hyp").get(timeout=30)] == model


def test_atomics_refuse_bad_input_and_report_a_dropped_buffer(owners, backend):
    o = _owner(owners)
    buf = o.make.call_one("atomic_bad", 2, dtype="int64").get(timeout=30)
    old = torch.zeros(1, dtype=torch.int64)
    with pytest.raises(ValueError, match="not a multiple of 8"):
        RDMAAction().fetch_add(buf, old, 1, offset=4)
    with pytest.raises(ValueError, match="must be 8 bytes"):
        RDMAAction().fetch_add(buf, torch.zeros(2, dtype=torch.int64), 1)
    with pytest.raises(ValueError, match="size mismatch"):
        RDMAAction().fetch_add(buf, old, 1, offset=16)
    for bad in (1 << 64, -(1 << 63) - 1, 1.5, True):
        with pytest.raises(ValueError, match="fits in 64 bits"):
            RDMAAction().fetch_add(buf, old, bad)
    with pytest.raises(TypeError, match="not between two buffers"):
        RDMAAction().compare_and_swap(buf, buf, 0, 1)
    ro = RDMABuffer(memoryview(bytes(8)))
    with pytest.raises(ValueError, match="read-only"):
        RDMAAction().fetch_add(ro, old, 1)
    ro.drop()
    o.drop.call_one("atomic_bad").get(timeout=30)
    with pytest.raises(BufferDroppedError):
        RDMAAction().fetch_add(buf, old, 1).submit(timeout=30).get(timeout=30)


def test_reader_is_another_proc_sync_and_async(owners):
    buf = _owner(owners, 0).make.call_one("p2p", 3000, seed=5).get()
    ref = _owner(owners, 0).value.call_one("p2p").get()
    got, name = _owner(owners, 1).read.call_one(buf, 3000).get(timeout=30)
    assert torch.equal(got, ref) and name == preferred_backend()
    assert torch.equal(_owner(owners, 1).read_async.call_one(buf, 3000).get(timeout=30), ref)


def test_drop_then_read_fails_clearly(owners, backend):
    o = _owner(owners)
    buf = o.make.call_one("dropped", 4096).get()
    o.drop.call_one("dropped").get()
    out = torch.full((4096,), 7, dtype=torch.uint8)
    with pytest.raises(BufferDroppedError, match="dropped"):
        buf.read_into(out).get(timeout=30)
    assert bool((out == 7).all()), "no byte moved"


def test_drop_from_a_non_owner(owners, backend):
    o = _owner(owners)
    buf = o.make.call_one("remote-drop", 4096).get()
    buf.drop()  # a message to the owner
    o.pid.call_one().get()  # the owner handled it (messages from us arrive in order)
    with pytest.raises(BufferDroppedError):
        buf.read_into(torch.empty(4096, dtype=torch.uint8)).get(timeout=30)


def test_drop_is_a_future_set_once_the_drop_took_effect(owners):
    # Monarch's drop() returns a Future[None]; it returned None here, and a holder could not wait for it.
    import asyncio

    buf = _owner(owners).make.call_one("drop-future", 4096).get()
    assert buf.drop().get(timeout=30) is None  # the owner answered: dropped there
    with pytest.raises(BufferDroppedError):
        buf.read_into(torch.empty(4096, dtype=torch.uint8)).get(timeout=30)

    async def drop_again():
        return await buf.drop()  # dropping a dropped buffer does nothing

    assert asyncio.run(drop_again()) is None
    local = RDMABuffer(torch.zeros(8)).drop()
    assert local.done() and local.get() is None  # in the owner: at once


def test_a_holder_drops_a_buffer_made_before_its_owner_had_a_mailbox(owners, monkeypatch):
    # Its handle named no owner address, and a holder's drop() did nothing.
    from monarch_tensor.transport import mailbox

    src = torch.arange(100, dtype=torch.uint8)
    with monkeypatch.context() as m:
        m.setattr(mailbox, "_mailbox", None)  # as in a script before its first mesh
        buf = RDMABuffer(src)
    _owner(owners).drop_handle.call_one(buf).get(timeout=30)  # (its drop arrives here before the reply)
    with pytest.raises(BufferDroppedError):
        buf.read_into(torch.empty(100, dtype=torch.uint8)).get(timeout=30)


def test_a_read_takes_a_larger_destination_and_refuses_a_smaller_one(owners, backend):
    # Monarch's rule: the whole buffer, into a destination at least as large. Here a larger one was refused,
    # and a smaller one silently got the buffer's first bytes only.
    o = _owner(owners)
    buf = o.make.call_one("larger-dst", 100).get()
    ref = o.value.call_one("larger-dst").get()
    for read in (lambda out: buf.read_into(out), lambda out: RDMAAction().read_remote(out, buf).submit()):
        out = torch.full((128,), 7, dtype=torch.uint8)
        read(out).get(timeout=30)
        assert torch.equal(out[:100], ref) and bool((out[100:] == 7).all())
        with pytest.raises(ValueError, match="must be at least as large"):
            read(torch.empty(64, dtype=torch.uint8))
    part = torch.empty(64, dtype=torch.uint8)
    buf.read_into(part, offset=10).get(timeout=30)  # with offset=: a part of the buffer
    assert torch.equal(part, ref[10:74])


def test_bad_handle_is_refused(owners, backend):
    buf = _owner(owners).make.call_one("forged", 4096).get()
    d = buf._desc
    from dataclasses import replace

    forged = RDMABuffer._from_desc(replace(d, buf_id=d.buf_id + 1000, token=d.token ^ 1))
    with pytest.raises(BufferDroppedError):
        forged.read_into(torch.empty(4096, dtype=torch.uint8)).get(timeout=30)


def test_size_mismatch_and_bad_input_refused_before_transfer(owners):
    buf = _owner(owners).make.call_one("sizes", 100).get()
    with pytest.raises(ValueError, match="size mismatch"):
        buf.read_into(torch.empty(99, dtype=torch.uint8))
    with pytest.raises(ValueError, match="size mismatch"):
        buf.read_into(torch.empty(10, dtype=torch.uint8), offset=95)
    with pytest.raises(ValueError, match="size mismatch"):
        buf.write_from(torch.empty(10, dtype=torch.uint8), offset=95)
    with pytest.raises(ValueError, match="offset"):
        buf.read_into(torch.empty(1, dtype=torch.uint8), offset=-1)
    with pytest.raises(ValueError, match="contiguous"):
        buf.read_into(torch.empty(10, 10, dtype=torch.uint8).t())
    with pytest.raises(ValueError, match="empty"):
        RDMABuffer(torch.empty(0))
    with pytest.raises(ValueError, match="contiguous"):
        RDMABuffer(torch.empty(4, 4).t())
    with pytest.raises(ValueError, match="contiguous"):
        RDMABuffer(np.zeros((4, 4))[:, 1])
    with pytest.raises(TypeError, match="tensor, an ndarray"):
        RDMABuffer("not memory")
    z = torch.randn(8, dtype=torch.complex64)
    with pytest.raises(ValueError, match="lazily conjugated view.*resolve_conj"):
        RDMABuffer(z.conj())  # its bytes are z's: a reader would get the values unconjugated
    with pytest.raises(ValueError, match="lazily negated view"):
        buf.read_into(torch.empty(12, dtype=torch.float64)._neg_view())
    with pytest.raises(ValueError, match="read-only"):
        RDMABuffer(b"abc").write_from(bytearray(b"x"))


def test_one_element_tensor_with_an_odd_stride_is_a_buffer():
    src = torch.arange(4.).reshape(1, 4)[:, 1]  # shape (1,), stride (4,): contiguous for torch
    buf = RDMABuffer(src)
    out = torch.zeros(4).reshape(1, 4)[:, 0]
    buf.read_into(out).get(timeout=10)
    assert out.item() == 1.0
    buf.drop()
    handle = publish_tensor(src)
    assert torch.equal(handle.fetch(), src)
    handle.drop()


def test_buffers_of_bytes_and_memoryviews_in_process():
    src = bytearray(b"hello data plane")
    buf = RDMABuffer(memoryview(src))
    out = bytearray(len(src))
    buf.read_into(out).get(timeout=10)
    assert out == src
    buf2 = pickle.loads(pickle.dumps(buf))
    buf2.write_from(b"HELLO", offset=0).get(timeout=10)
    assert src.startswith(b"HELLO")
    buf.drop()


def test_a_buffer_of_another_host_read_over_tcp_warns_as_monarch_does(monkeypatch):
    import dataclasses
    import warnings

    src = bytearray(b"bytes from another host")
    buf = RDMABuffer(memoryview(src))
    # The same buffer as a reader on another host sees it: only tcp can reach it (no NIC here).
    far = RDMABuffer._from_desc(dataclasses.replace(buf._desc, host="elsewhere/boot-id"))
    out = bytearray(len(src))
    with pytest.warns(RDMATcpFallbackWarning, match="moves over TCP: no RDMA device"):
        far.read_into(out).get(timeout=10)
    assert out == src and far.backend == "tcp"
    monkeypatch.setenv(ENV_BACKEND, "tcp")  # chosen on purpose: no warning
    with warnings.catch_warnings():
        warnings.simplefilter("error", RDMATcpFallbackWarning)
        far.read_into(out).get(timeout=10)
        buf.read_into(out).get(timeout=10)  # (same host)
    with pytest.warns(DeprecationWarning, match="is_ibverbs_available"):
        assert is_rdma_available() == is_ibverbs_available()
    buf.drop()


def _wait_dead(pid: int, timeout: float = 10.0) -> None:
    """Until ``pid`` is a zombie or gone (its memory released)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rpartition(")")[2].split()[0] in ("Z", "X"):
                    return
        except OSError:
            return
        time.sleep(0.01)
    raise AssertionError(f"pid {pid} still runs {timeout} s after SIGKILL")


@pytest.mark.parametrize("who", ["backend", "mailbox"])
def test_owner_death_fails_within_the_timeout(backend, monkeypatch, who):
    """A read of a dead owner's buffer fails with OwnerDiedError: found by the backend itself when the
    death's report has not reached this process (``death_of`` hidden), and before any transfer once it has."""
    import re

    import monarch_tensor.actor as actor_mod
    from monarch_tensor.transport.mailbox import Mailbox, current_mailbox

    faults: list = []  # the owner's death is expected here, not a failure that should stop the script
    monkeypatch.setattr(actor_mod, "unhandled_fault_hook", faults.append)
    procs = this_host().spawn_procs(per_host={"gpus": 1})
    try:
        o = procs.spawn("doomed", Owner)
        buf = o.make.call_one("x", 1 << 20).get()
        pid = o.pid.call_one().get()
        os.kill(pid, signal.SIGKILL)
        _wait_dead(pid)  # SIGKILL is asynchronous: a read that wins the race with it succeeds, rightly
        out = torch.empty(1 << 20, dtype=torch.uint8)
        if who == "backend":
            with monkeypatch.context() as m, pytest.raises(OwnerDiedError, match=rf"\(pid {pid}\) died"):
                m.setattr(Mailbox, "death_of", lambda self, addr: None)
                buf.read_into(out).get(timeout=20)
        else:
            deadline = time.monotonic() + 30
            while current_mailbox().death_of(buf.owner) is None:
                assert time.monotonic() < deadline, "the owner's death was never reported"
                time.sleep(0.01)
            with pytest.raises(OwnerDiedError, match=re.escape(f"({buf.owner}) died")):
                buf.read_into(out).get(timeout=20)
    finally:
        procs.stop().get(timeout=30)


def test_a_holder_drops_a_buffer_of_a_stopped_owner_at_once():
    # The owner's death was reported before drop() opened the port its answer would come to: the Future
    # waited for a death it had missed, for ever. A dead owner has nothing left to drop.
    procs = this_host().spawn_procs(per_host={"gpus": 1})
    buf = procs.spawn("stopped_owner", Owner).make.call_one("gone", 4096).get(timeout=60)
    procs.stop().get(timeout=30)
    with pytest.raises(OwnerDiedError):  # the death is known here
        buf.read_into(torch.empty(4096, dtype=torch.uint8)).get(timeout=20)
    assert buf.drop().get(timeout=20) is None


def test_tcp_timeout_when_the_owner_is_stopped(owners, monkeypatch):
    """A frozen owner (SIGSTOP) cannot serve tcp: the read fails at its timeout, never hangs."""
    monkeypatch.setenv(ENV_BACKEND, "tcp")
    o = _owner(owners, 1)
    buf = o.make.call_one("frozen", 1 << 20).get()
    pid = o.pid.call_one().get()
    _stop(pid)
    try:
        with pytest.raises(TransferTimeoutError):
            buf.read_into(torch.empty(1 << 20, dtype=torch.uint8), timeout=1.0).get(timeout=10)
    finally:
        os.kill(pid, signal.SIGCONT)
    monkeypatch.setenv(ENV_BACKEND, "cma")  # cross-memory attach needs nothing from the owner
    out = torch.empty(1 << 20, dtype=torch.uint8)
    buf.read_into(out).get(timeout=10)


@pytest.mark.parametrize("kind", ["read", "write"])
@pytest.mark.parametrize("n", [4 << 10, 4 << 20])
def test_tcp_polls_then_blocks_for_a_slow_owner(owners, monkeypatch, n, kind):
    """An answer later than the tcp client's polling (the owner is stopped for 0.3 s) still arrives whole:
    the client went back to a blocking wait under its timeout (and a 4 MiB read's rest after its first bytes)."""
    from monarch_tensor.rdma.backends import tcp

    monkeypatch.setenv(ENV_BACKEND, "tcp")
    monkeypatch.setattr(tcp, "SPIN_S", 0.02)
    buf, fut, pid, holds = _transfer_with_the_owner_stopped(owners, f"slow{n}", n, 5, kind, timeout=20)
    try:
        fut.start()  # on a pool thread, while this one resumes the owner
        time.sleep(0.3)
        assert not fut.done()
    finally:
        os.kill(pid, signal.SIGCONT)
    fut.get(timeout=20)
    assert holds()
    assert buf.backend == "tcp"


def test_cma_refused_falls_back_to_tcp(owners, monkeypatch):
    """The kernel's EPERM (forced here) makes the pair fall back to tcp, with the right bytes."""
    monkeypatch.delenv(ENV_BACKEND, raising=False)
    o = _owner(owners)
    buf = o.make.call_one("eperm", 5000, seed=9).get()
    assert buf.backend == "cma"
    backend_obj = [b for b in __import__("monarch_tensor.rdma", fromlist=["backends"]).backends() if b.name == "cma"][0]
    monkeypatch.setattr(cma, "FORCE_ERRNO", errno.EPERM)
    try:
        out = torch.empty(5000, dtype=torch.uint8)
        buf.read_into(out).get(timeout=30)
        assert torch.equal(out, o.value.call_one("eperm").get())
        assert buf.backend == "tcp"
    finally:
        backend_obj.refused.clear()


def test_cma_read_checks_the_slot_in_the_same_call(owners, monkeypatch):
    """A cma read of up to ONE_CALL_MAX bytes is one system call (the registration's slot, then the
    data); a larger read, and a write, read the slot in a call of their own first; a small read the
    kernel cut short goes on from where it stopped; a dropped buffer's read fails."""
    monkeypatch.setenv(ENV_BACKEND, "cma")
    o = _owner(owners)
    n, big = 10000, cma.ONE_CALL_MAX + 1
    assert n <= cma.ONE_CALL_MAX
    buf = o.make.call_one("onecall", n, seed=13).get()
    ref = o.value.call_one("onecall").get()
    big_buf = o.make.call_one("onecall-big", big, seed=14).get()
    big_ref = o.value.call_one("onecall-big").get()
    calls = []
    real = cma._call

    def spy(write, pid, local, remote, k, slot=None):
        calls.append(("w" if write else "r", k, slot is not None))
        return real(write, pid, local, remote, k, slot)

    monkeypatch.setattr(cma, "_call", spy)
    out = torch.zeros(n, dtype=torch.uint8)
    buf.read_into(out).get(timeout=30)
    assert torch.equal(out, ref) and calls == [("r", n, True)]
    calls.clear()
    buf.write_from(out).get(timeout=30)
    assert calls == [("r", 8, False), ("w", n, False)]
    calls.clear()
    big_out = torch.zeros(big, dtype=torch.uint8)
    big_buf.read_into(big_out).get(timeout=30)
    assert torch.equal(big_out, big_ref) and calls == [("r", 8, False), ("r", big, False)]

    def short(write, pid, local, remote, k, slot=None):  # the kernel moves 1000 bytes of the data at most
        calls.append(("r", k, slot is not None))
        return real(write, pid, local, remote, min(k, 1000), slot)

    monkeypatch.setattr(cma, "_call", short)
    calls.clear()
    out.zero_()
    buf.read_into(out).get(timeout=30)
    assert torch.equal(out, ref)
    assert calls[0] == ("r", n, True) and [c[1] for c in calls[1:]] == list(range(n - 1000, 0, -1000))
    monkeypatch.setattr(cma, "_call", real)
    o.drop.call_one("onecall").get()
    with pytest.raises(BufferDroppedError):
        buf.read_into(out).get(timeout=30)


def test_forced_backend_that_cannot_serve_is_a_clear_error(owners, monkeypatch, caplog):
    monkeypatch.setenv(ENV_BACKEND, "cuda_ipc")
    buf = _owner(owners).make.call_one("forced", 100).get()
    if torch.cuda.is_available():
        with pytest.raises(Exception, match="cannot move buffer"):  # (CPU memory: not cuda_ipc's)
            buf.read_into(torch.empty(100, dtype=torch.uint8)).get(timeout=10)
    else:  # the reason the project knows, not just "cannot"
        with pytest.raises(BackendUnavailableError, match=f"{ENV_BACKEND}=cuda_ipc, but the cuda_ipc backend is "
                                                          f"unavailable here: (no CUDA device|this torch is a CPU-only)"):
            buf.read_into(torch.empty(100, dtype=torch.uint8)).get(timeout=10)
        assert "cuda_ipc" in unavailable_backends()
    from monarch_tensor import config

    monkeypatch.delenv(ENV_BACKEND)
    if "verbs" in unavailable_backends():
        with config.configured(rdma_backend="verbs"):  # the setting, as well as the variable
            with pytest.raises(BackendUnavailableError, match="configure\\(rdma_backend='verbs'\\), but the verbs "
                                                              "backend is unavailable here: .*(pyverbs|RDMA device)"):
                buf.read_into(torch.empty(100, dtype=torch.uint8)).get(timeout=10)
    import logging

    from monarch_tensor.rdma import buffer

    monkeypatch.setattr(buffer, "_logged", set())
    with config.configured(rdma_backend="tcp"), caplog.at_level(logging.INFO, logger="monarch_tensor.rdma"):
        for _ in range(2):
            buf.read_into(torch.empty(100, dtype=torch.uint8)).get(timeout=10)
        assert buf.backend == "tcp"
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("data plane:")]
    assert said == ["data plane: tcp moves buffers of this host (first transfer by it in this process)"]
    buf.read_into(torch.empty(100, dtype=torch.uint8)).get(timeout=10)
    assert buf.backend != "tcp"  # back to the best one for the pair
    with pytest.raises(ValueError, match="takes one of \\['', 'verbs', 'cuda_ipc', 'cma', 'tcp'\\]"):
        config.configure(rdma_backend="rdma")
    monkeypatch.setenv(ENV_BACKEND, "nonsense")  # the error names the variable the name came from
    with pytest.raises(Exception, match=f"{ENV_BACKEND} must be one of \\['', 'verbs', 'cuda_ipc', 'cma', 'tcp'\\], got 'nonsense'"):
        preferred_backend()
    with pytest.raises(Exception, match=f"{ENV_BACKEND} must be one of \\['', 'verbs', 'cuda_ipc', 'cma', 'tcp'\\], got 'nonsense'"):
        buf.read_into(torch.empty(100, dtype=torch.uint8)).get(timeout=10)


def test_forced_backend_is_read_at_every_transfer(owners, monkeypatch):
    """$MONARCH_TENSOR_RDMA_BACKEND set, changed and unset between transfers of one handle takes effect at
    the next transfer (it is read from the environment's own dict, not cached)."""
    monkeypatch.delenv(ENV_BACKEND, raising=False)
    o = _owner(owners)
    buf = o.make.call_one("reread", 5000, seed=4).get()
    ref = o.value.call_one("reread").get()
    out = torch.empty(5000, dtype=torch.uint8)
    for forced, used in [(None, "cma"), ("tcp", "tcp"), ("cma", "cma"), (None, "cma"), ("tcp", "tcp")]:
        if forced is None:
            monkeypatch.delenv(ENV_BACKEND, raising=False)
        else:
            monkeypatch.setenv(ENV_BACKEND, forced)
        out.zero_()
        buf.read_into(out).get(timeout=30)
        assert torch.equal(out, ref) and buf.backend == used
    assert preferred_backend() == "tcp" and get_rdma_backend() == "tcp"
    monkeypatch.delenv(ENV_BACKEND)
    assert preferred_backend() != "tcp" or not cma.CmaBackend().available()


def test_pid_and_per_process_values_follow_a_fork():
    """A forked child's cached pid is its own (``my_pid`` stands for ``os.getpid``), and a ``per_process``
    value is made again there."""
    from monarch_tensor.rdma._host import my_pid, per_process

    made: list = []
    get = per_process(lambda: made.append(os.getpid()) or os.getpid())
    assert my_pid() == os.getpid() and get() == os.getpid()
    r, w = os.pipe()
    child = os.fork()
    if child == 0:  # pragma: no cover - the child reports through the pipe and exits at once
        try:
            os.write(w, f"{my_pid()} {os.getpid()} {get()}".encode())
        finally:
            os._exit(0)
    os.close(w)
    try:
        with os.fdopen(r, "rb") as f:
            cached, real, value = map(int, f.read().split())
    finally:
        os.waitpid(child, 0)
    assert cached == real == value == child != os.getpid()
    assert my_pid() == os.getpid() and get() == os.getpid() and made == [os.getpid()]


def test_a_read_into_read_only_memory_or_with_a_bad_timeout_is_refused(owners, backend):
    buf = _owner(owners).make.call_one("ro", 16).get()
    ro = np.zeros(16, dtype=np.uint8)
    ro.setflags(write=False)
    for dst in (bytes(16), ro, memoryview(bytearray(16)).toreadonly()):
        with pytest.raises(ValueError, match="is read-only"):
            buf.read_into(dst)
        with pytest.raises(ValueError, match="is read-only"):
            RDMAAction().read_remote(dst, buf)
    assert bytes(ro) == bytes(16)  # untouched
    for timeout in (None, 0, -1, "5", True):
        with pytest.raises(ValueError, match="timeout must be a positive number"):
            buf.read_into(bytearray(16), timeout=timeout)
        with pytest.raises(ValueError, match="timeout must be a positive number"):
            buf.write_from(bytearray(16), timeout=timeout)
    out = bytearray(16)
    buf.read_into(out, timeout=30).get(timeout=30)
    assert torch.equal(torch.frombuffer(out, dtype=torch.uint8), _owner(owners).value.call_one("ro").get())


def test_a_zombie_owner_is_not_alive():
    """A process that exited and that its parent has not reaped yet still has its /proc entry and start
    time: it is dead all the same (a reader's tcp connection to it was reset, and the error says so)."""
    from monarch_tensor.rdma._host import alive, start_time

    assert alive(os.getpid(), start_time(os.getpid()))
    child = os.fork()
    if child == 0:
        os._exit(0)
    try:
        started = start_time(child)
        deadline = time.monotonic() + 30
        while Path(f"/proc/{child}/stat").read_text().rpartition(")")[2].split()[0] != "Z":
            assert time.monotonic() < deadline, "the child never became a zombie"
            time.sleep(0.005)
        assert start_time(child) == started != -1  # still listed, with its start time
        assert not alive(child, started)
    finally:
        os.waitpid(child, 0)
    assert not alive(child, started) and start_time(child) == -1


def test_no_ibverbs_here_is_reported_cleanly(monkeypatch):
    from monarch_tensor.rdma.backends import verbs

    from monarch_tensor import config

    monkeypatch.delenv(ENV_BACKEND, raising=False)
    reason = verbs.unavailable_reason()
    assert is_ibverbs_available() == (reason is None)
    if reason is not None:  # (no machine of this project has an RDMA NIC)
        assert reason.startswith(("no RDMA device", "pyverbs does not import")), reason
        assert preferred_backend() != "verbs"
        assert get_rdma_backend() == "tcp"  # Monarch's values (the fallback is allowed by default)
        with config.configured(rdma_allow_tcp_fallback=False):
            assert get_rdma_backend() == "none"


def test_transfers_from_many_threads(owners, backend):
    buf = _owner(owners).make.call_one("threads", 10000, seed=11).get()
    ref = _owner(owners).value.call_one("threads").get()
    errors = []

    def worker():
        try:
            for _ in range(5):
                out = torch.empty(10000, dtype=torch.uint8)
                buf.read_into(out).get(timeout=30)
                assert torch.equal(out, ref)
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    ts = [threading.Thread(target=worker) for _ in range(4)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(60)
    assert not errors, errors
    assert buf.backend == backend


def _threads_running(monkeypatch, cls, name: str) -> list:
    """Spy on the method ``cls.name``: the list, filled as it runs, of the threads that ran it."""
    ran: list = []
    real = getattr(cls, name)

    def spy(self, *args):
        ran.append(threading.current_thread())
        return real(self, *args)

    monkeypatch.setattr(cls, name, spy)
    return ran


def test_who_runs_a_deferred_transfer(owners, monkeypatch):
    """tcp transfers start on the first of: the thread that waits on the Future (no thread hop, also for a
    wait shorter than the transfer's timeout), a pool thread when the Future is awaited, or a pool thread
    after KICK_S when nobody waits at all (fire and forget)."""
    from monarch_tensor.rdma import _future as rdma_future
    from monarch_tensor.rdma.backends import tcp

    monkeypatch.setenv(ENV_BACKEND, "tcp")
    o = _owner(owners)
    buf = o.make.call_one("deferred", 4096, seed=3).get()
    ref = o.value.call_one("deferred").get()
    ran_on = _threads_running(monkeypatch, tcp.TcpBackend, "_read")
    out = torch.empty(4096, dtype=torch.uint8)
    buf.read_into(out).get(timeout=120)  # waits longer than the transfer's own 60 s: runs here
    assert ran_on[-1] is threading.current_thread() and torch.equal(out, ref)

    out2 = torch.empty(4096, dtype=torch.uint8)
    buf.read_into(out2, timeout=60).get(timeout=30)  # a shorter wait: a read runs here too, until it ends
    assert ran_on[-1] is threading.current_thread() and torch.equal(out2, ref)
    wrote_on = _threads_running(monkeypatch, tcp.TcpBackend, "_write")
    buf.write_from(ref, timeout=60).get(timeout=30)  # ... but a write goes to a pool thread
    assert wrote_on[-1] is not threading.current_thread()
    buf.write_from(ref).get()
    assert wrote_on[-1] is threading.current_thread()

    out3 = torch.empty(4096, dtype=torch.uint8)
    fut = buf.read_into(out3)
    deadline = time.monotonic() + 30
    while not fut.done() and time.monotonic() < deadline:  # nobody waits: the kicker starts it
        time.sleep(rdma_future.KICK_S)
    assert fut.done() and ran_on[-1] is not threading.current_thread() and torch.equal(out3, ref)

    async def awaited():
        dst = torch.empty(4096, dtype=torch.uint8)
        await buf.read_into(dst)
        return dst

    import asyncio

    assert torch.equal(asyncio.run(awaited()), ref)
    assert ran_on[-1] is not threading.current_thread()

    src = torch.full((4096,), 7, dtype=torch.uint8)
    buf.write_from(src)  # fire and forget: it lands without anyone waiting
    deadline = time.monotonic() + 30
    while not torch.equal(o.value.call_one("deferred").get(), src) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert torch.equal(o.value.call_one("deferred").get(), src)


@pytest.mark.parametrize("kind", ["read", "write"])
def test_a_shorter_wait_runs_the_transfer_then_hands_it_over(owners, monkeypatch, kind):
    """``get(timeout)`` shorter than the transfer's timeout (the owner is stopped here): the wait times out
    on time, the transfer goes on on a pool thread (a read ran on the waiting thread until the wait ended,
    then again there; a write runs there from the start), and once the owner runs again the Future
    settles with the right bytes."""
    from monarch_tensor.rdma.errors import TransferTimeoutError

    monkeypatch.setenv(ENV_BACKEND, "tcp")
    _, fut, pid, holds = _transfer_with_the_owner_stopped(owners, f"handoff-{kind}", 1 << 16, 13, kind, timeout=30)
    try:  # (a wait that ignored its timeout would last while the owner is stopped: the test's timeout)
        with pytest.raises(TimeoutError, match=r"within 0\.5 s") as err:  # (it said "within 0 s")
            fut.get(timeout=0.5)
        assert not isinstance(err.value, TransferTimeoutError)  # the wait ended; the transfer did not fail
        assert not fut.done()
    finally:
        os.kill(pid, signal.SIGCONT)
    fut.get(timeout=30)
    assert holds()


@settings(max_examples=40, deadline=None)
@given(shape=st.lists(st.integers(1, 5), min_size=1, max_size=3), dtype=st.sampled_from(["float32", "int16", "uint8"]),
       row=st.integers(0, 4), kind=st.sampled_from(["tensor", "ndarray", "bytearray"]))
def test_mem_describes_exactly_the_bytes_given(shape, dtype, row, kind):
    """``as_mem``: address and length of exactly the bytes (a row of a bigger tensor included), and its
    flat uint8 view, made on first use, holds those bytes."""
    from monarch_tensor.rdma._memory import as_mem

    base = torch.arange(int(np.prod(shape)) * 5, dtype=torch.int64).to(getattr(torch, dtype)).reshape(5, *shape)
    t = base[row % 5]  # a view at an offset into its storage
    if kind == "tensor":
        obj, want, ptr = t, t.contiguous().view(-1).view(torch.uint8).numpy().tobytes(), t.data_ptr()
    elif kind == "ndarray":
        obj = t.numpy()
        want, ptr = obj.tobytes(), obj.ctypes.data
    else:
        obj = bytearray(t.numpy().tobytes())
        want, ptr = bytes(obj), None
    mem = as_mem(obj)
    assert mem.nbytes == len(want) and mem.device == "cpu" and mem.writable
    if ptr is not None:
        assert mem.ptr == ptr
    assert bytes(mem.view(0, mem.nbytes)) == want
    flat = mem.flat
    assert tuple(flat.shape) == (len(want),) and bytes(np.asarray(flat)) == want


@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 5000), data=st.data())
def test_mem_view_is_a_writable_window_on_the_bytes(n, data):
    """``Mem.view(offset, k)``: a flat, writable memoryview of exactly bytes [offset, offset + k), any
    offset and length; bytes written through it land in the object."""
    from monarch_tensor.rdma._memory import as_mem

    buf = bytearray(np.random.default_rng(n).integers(0, 256, n, dtype=np.uint8).tobytes())
    offset = data.draw(st.integers(0, n - 1))
    k = data.draw(st.integers(1, n - offset))
    v = as_mem(buf).view(offset, k)
    assert v.format == "B" and v.ndim == 1 and len(v) == k and not v.readonly
    assert bytes(v) == bytes(buf[offset:offset + k])
    want = bytes(255 - x for x in buf[offset:offset + k])
    v[:] = want
    assert bytes(buf[offset:offset + k]) == want


def test_mem_of_a_tensor_that_needs_grad_and_of_other_devices():
    from monarch_tensor.rdma._memory import as_mem

    w = torch.ones(4, requires_grad=True)
    assert not as_mem(w).flat.requires_grad  # detached: backends copy into it
    with pytest.raises(ValueError, match="only CPU and CUDA"):
        as_mem(torch.empty(4, device="meta"))


def _tcp_pair():
    """A connected (reader, owner) pair of loopback TCP sockets, the reader's set up as the data plane's."""
    import socket as _socket

    from monarch_tensor.rdma.backends import tcp

    srv = _socket.create_server(("127.0.0.1", 0))
    with srv:
        reader = tcp.client_socket(_socket.create_connection(srv.getsockname(), timeout=5))
        owner, _ = srv.accept()
    return reader, owner


def test_tcp_client_socket_setup():
    import socket as _socket

    from monarch_tensor.rdma.backends import tcp

    reader, owner = _tcp_pair()
    with reader, owner:
        assert reader.gettimeout() is None and reader.getblocking()
        assert reader.getsockopt(_socket.IPPROTO_TCP, _socket.TCP_NODELAY)
        sec, usec = tcp.struct.unpack("@ll", reader.getsockopt(_socket.SOL_SOCKET, _socket.SO_RCVTIMEO, 16))
        assert sec + usec / 1e6 == pytest.approx(tcp.TICK_S, abs=0.01)


def test_tcp_client_socket_waits_under_its_deadline(monkeypatch):
    """A reader's socket blocks with the kernel's timeouts (no Python socket timeout): a silent owner
    times the receive out at the deadline, an owner that reads nothing times the send out, and bytes
    that come in pieces, with pauses longer than the kernel's timeout, are received whole."""
    from monarch_tensor.rdma.backends import tcp

    monkeypatch.setattr(tcp, "TICK_S", 0.05)
    reader, owner = _tcp_pair()
    with reader, owner:
        with pytest.raises(TimeoutError, match="sent nothing"):
            tcp._recv_first(reader, [bytearray(1)], time.monotonic() + 0.3)
        with pytest.raises(TimeoutError, match="took no bytes"):
            tcp._send_parts(reader, b"head", bytes(64 << 20), time.monotonic() + 0.3)
    reader, owner = _tcp_pair()
    with reader, owner:
        data = os.urandom(1 << 20)

        threading.Thread(target=_send_in_pieces, args=(owner, data, 1 << 18, (0.08,)), daemon=True).start()
        out = bytearray(len(data))
        tcp._recv_exact(reader, memoryview(out), time.monotonic() + 20)
        assert out == data
        with pytest.raises(TimeoutError, match="had not come"):
            tcp._recv_exact(reader, memoryview(bytearray(10)), time.monotonic() + 0.2)


def _send_in_pieces(sock, data: bytes, piece: int, pauses: tuple[float, ...]) -> None:
    """Send ``data`` on ``sock`` ``piece`` bytes at a time, pausing after each piece for ``pauses`` in turn."""
    for k, i in enumerate(range(0, len(data), piece)):
        sock.sendall(data[i:i + piece])
        time.sleep(pauses[k % len(pauses)])


class _JumpClock:
    """A ``time`` for rdma/backends/tcp.py whose ``perf_counter`` jumps ahead on request, so a wait looks long
    or short whatever the machine's speed: after ``jump(s, after)``, the ``after``-th next reading is the
    real clock's and every later one ``s`` seconds ahead. ``jumped`` is set once it has. Only the thread
    that called ``jump`` sees it: other threads (the server threads of earlier tests, still polling) read
    the real clock, and used to take the readings the test counted on."""

    def __init__(self) -> None:
        self.offset, self.armed, self.jumped, self.owner = 0.0, None, threading.Event(), None

    def jump(self, seconds: float, after: int = 1) -> None:
        self.jumped.clear()
        self.owner = threading.get_ident()
        self.armed = [after, seconds]

    def perf_counter(self) -> float:
        if threading.get_ident() != self.owner:
            return time.perf_counter()
        t = time.perf_counter() + self.offset
        if self.armed is not None:
            self.armed[0] -= 1
            if self.armed[0] == 0:
                self.offset += self.armed[1]
                self.armed = None
                self.jumped.set()
        return t

    def __getattr__(self, name):
        return getattr(time, name)


def _answer(sock, n: int) -> bytes:
    out = bytearray()
    while len(out) < n:
        chunk = sock.recv(n - len(out))
        assert chunk, f"connection closed after {len(out)} of {n} bytes"
        out += chunk
    return bytes(out)


def test_tcp_headers_keep_the_data_aligned():
    """Every header on a data connection (a request, the owner's answer) is HEAD bytes, a multiple of 64,
    so the data behind it sits aligned in the kernel's socket buffers; the wire format, read with a plain
    socket: a read's answer is HEAD bytes (status OK) then exactly the data, a write's and a failure's
    answer is HEAD bytes."""
    import socket as _socket

    from monarch_tensor.rdma.backends import tcp

    assert tcp.HEAD % 64 == 0 and tcp._REQ.size == tcp.HEAD
    data = np.random.default_rng(4).integers(0, 256, 10000, dtype=np.uint8)
    buf = RDMABuffer(data)
    d = buf._desc
    try:
        with _socket.create_connection(tuple(d.tcp), timeout=10) as s:
            s.sendall(tcp.request(tcp.READ, 0, d.buf_id, d.token, 100, 5000))
            got = _answer(s, tcp.HEAD + 5000)
            assert got[0] == tcp.OK and got[1:tcp.HEAD] == bytes(tcp.HEAD - 1)
            assert got[tcp.HEAD:] == data[100:5100].tobytes()
            s.sendall(tcp.request(tcp.WRITE, tcp.ALONE, d.buf_id, d.token, 0, 3) + b"abc")
            assert _answer(s, tcp.HEAD)[0] == tcp.OK and bytes(data[:3]) == b"abc"
            s.sendall(tcp.request(tcp.READ, 0, d.buf_id, d.token + 1, 0, 10))
            assert _answer(s, tcp.HEAD)[0] == tcp.UNKNOWN
            s.sendall(tcp.request(tcp.READ, tcp.ALONE, d.buf_id, d.token, 9999, 10))
            assert _answer(s, tcp.HEAD)[0] == tcp.RANGE
            s.settimeout(0.2)
            with pytest.raises(TimeoutError):  # nothing follows a failure's answer
                s.recv(1)
    finally:
        buf.drop()


@pytest.mark.parametrize("timeout", [float("inf"), 1e10])
def test_tcp_transfer_takes_a_timeout_past_what_a_socket_takes(timeout):
    # Its connect passed the timeout to the socket: OverflowError.
    from monarch_tensor.rdma._memory import as_mem
    from monarch_tensor.rdma.backends import tcp

    src = bytearray(b"no time limit")
    buf = RDMABuffer(memoryview(src))
    backend = tcp.TcpBackend()  # no idle connection: it connects
    try:
        out = bytearray(len(src))
        backend.read(buf._desc, 0, as_mem(out), timeout)
        assert out == src
        backend.write(buf._desc, 0, as_mem(b"NO"), timeout)
        assert src.startswith(b"NO time")
    finally:
        for socks in backend._idle.values():
            for s in socks:
                s.close()
        buf.drop()


def test_tcp_reader_takes_an_answer_in_pieces():
    """An owner whose answer header comes in pieces (a pause inside it, then the rest with the data): the
    reader completes the header before it takes the data."""
    import dataclasses
    import socket as _socket

    from monarch_tensor.rdma._memory import as_mem
    from monarch_tensor.rdma.backends import tcp

    data = os.urandom(20000)
    srv = _socket.create_server(("127.0.0.1", 0))

    def owner():
        with srv:
            conn, _ = srv.accept()
            with conn:
                _answer(conn, tcp.HEAD)
                conn.sendall(bytes([tcp.OK]) + bytes(9))
                time.sleep(0.05)
                conn.sendall(bytes(tcp.HEAD - 10) + data)
                conn.recv(1)  # until the reader hangs up

    t = threading.Thread(target=owner, daemon=True)
    t.start()
    buf = RDMABuffer(bytearray(len(data)))  # a real descriptor, pointed at the fake owner
    try:
        desc = dataclasses.replace(buf._desc, tcp=srv.getsockname())
        backend = tcp.TcpBackend()
        out = bytearray(len(data))
        backend._one(tcp.READ, desc, 0, as_mem(out), 0, len(data), time.monotonic() + 10)
        assert out == data
        for socks in backend._idle.values():
            for s in socks:
                s.close()
    finally:
        buf.drop()
    t.join(10)


def test_tcp_streams_start_at_aligned_offsets(monkeypatch):
    """A transfer cut over several connections starts each piece at a multiple of ALIGN of the local
    memory (odd total size), and the pieces cover it exactly."""
    from monarch_tensor.rdma.backends import tcp

    monkeypatch.setenv(ENV_BACKEND, "tcp")
    n = 3 * tcp.MIN_STREAM_CHUNK + 12345
    data = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(8))
    buf = RDMABuffer(data)
    pieces = []
    real = tcp.TcpBackend._one

    def spy(self, op, desc, offset, local, lo, k, deadline, **kw):
        pieces.append((lo, k))
        return real(self, op, desc, offset, local, lo, k, deadline, **kw)

    monkeypatch.setattr(tcp.TcpBackend, "_one", spy)
    try:
        out = torch.empty(n, dtype=torch.uint8)
        buf.read_into(out).get(timeout=60)
        assert buf.backend == "tcp" and torch.equal(out, data)
    finally:
        buf.drop()
    pieces.sort()
    assert len(pieces) > 1 and all(lo % tcp.ALIGN == 0 for lo, _ in pieces)
    assert [lo for lo, _ in pieces[1:]] == [lo + k for lo, k in pieces[:-1]] and sum(k for _, k in pieces) == n


@pytest.mark.parametrize("spin_us", [0, 300])
def test_tcp_reader_polls_for_the_rest_then_blocks(monkeypatch, spin_us):
    """``_recv_rest`` (the rest of a read on one connection): bytes that come in pieces, with pauses both
    shorter and longer than its polling, arrive whole; a sender that stops times it out at the deadline;
    a sender that hangs up mid-transfer is a ConnectionError."""
    from monarch_tensor.rdma.backends import tcp

    monkeypatch.setattr(tcp, "SPIN_S", spin_us * 1e-6)
    monkeypatch.setattr(tcp, "TICK_S", 0.05)
    reader, owner = _tcp_pair()
    with reader, owner:
        data = os.urandom(3 << 20)

        threading.Thread(target=_send_in_pieces, args=(owner, data, 1 << 18, (0.06, 0.0001)), daemon=True).start()
        out = bytearray(len(data))
        tcp._recv_rest(reader, memoryview(out), time.monotonic() + 20)
        assert out == data
        owner.sendall(b"x" * 10)
        with pytest.raises(TimeoutError, match="had not come"):  # (the rest never comes: only the deadline ends it)
            tcp._recv_rest(reader, memoryview(bytearray(20)), time.monotonic() + 0.3)
    reader, owner = _tcp_pair()
    with reader:
        owner.sendall(b"y" * 5)
        owner.close()
        with pytest.raises(ConnectionError, match="closed mid-transfer"):
            tcp._recv_rest(reader, memoryview(bytearray(10)), time.monotonic() + 5)


def test_tcp_polls_for_the_rest_only_on_one_connection(owners, monkeypatch):
    """A read on one connection polls for its rest (``_recv_rest``); a read cut over several connections
    does not (they would poll at once); both get the right bytes."""
    from monarch_tensor.rdma.backends import tcp

    monkeypatch.setenv(ENV_BACKEND, "tcp")
    o = _owner(owners)
    small, big = 1 << 20, 2 * tcp.MIN_STREAM_CHUNK
    bufs = {n: o.make.call_one(f"rest{n}", n, seed=12).get() for n in (small, big)}
    calls = []
    real = tcp._recv_rest

    def spy(sock, view, deadline=None):
        calls.append(len(view))
        return real(sock, view, deadline)

    real_first = tcp._recv_first

    def first_byte_only(sock, bufs, deadline=None):  # the answer and one byte: a rest is always left
        return real_first(sock, bufs if len(bufs) < 2 else [bufs[0], bufs[1][:1]], deadline)

    monkeypatch.setattr(tcp, "_recv_rest", spy)
    monkeypatch.setattr(tcp, "_recv_first", first_byte_only)
    for n, buf in bufs.items():
        calls.clear()
        out = torch.empty(n, dtype=torch.uint8)
        buf.read_into(out).get(timeout=60)
        assert torch.equal(out, o.value.call_one(f"rest{n}").get())
        assert calls == ([n - 1] if n == small else []), (n, calls)


def test_tcp_reader_stops_polling_a_trickle(monkeypatch):
    """Bytes that keep trickling in (never a pause as long as its polling) are polled for ten times
    ``SPIN_S`` at most; then ``_recv_rest`` waits for the rest blocked (``_recv_exact``), whole."""
    from monarch_tensor.rdma.backends import tcp

    monkeypatch.setattr(tcp, "SPIN_S", 0.002)
    handed = []
    real = tcp._recv_exact

    def spy(sock, view, deadline=None):
        handed.append(len(view))
        return real(sock, view, deadline)

    monkeypatch.setattr(tcp, "_recv_exact", spy)
    reader, owner = _tcp_pair()
    with reader, owner:
        data = os.urandom(200 << 10)

        threading.Thread(target=_send_in_pieces, args=(owner, data, 1 << 10, (0.0002,)), daemon=True).start()
        import select

        assert select.select([reader], [], [], 10)[0]  # the first bytes are in: polling starts with bytes
        out = bytearray(len(data))
        tcp._recv_rest(reader, memoryview(out), time.monotonic() + 20)
        assert out == data
    assert handed and 0 < handed[0] < len(data)


@pytest.mark.parametrize("flags", [0, 1])
def test_tcp_owner_polls_for_a_lone_writes_bytes(monkeypatch, flags):
    """A write request flagged ALONE (the only connection of its transfer) has the owner poll for its
    bytes (``_recv_rest``), one without the flag not; bytes sent in pieces, with short and long pauses,
    land whole either way."""
    import socket as _socket

    from monarch_tensor.rdma.backends import tcp

    assert tcp.ALONE == 1
    used = []
    real = tcp._recv_rest

    def spy(sock, view, deadline=None):
        used.append(len(view))
        return real(sock, view, deadline)

    monkeypatch.setattr(tcp, "_recv_rest", spy)
    n = 1 << 20
    target = bytearray(n)
    buf = RDMABuffer(target)
    d = buf._desc
    data = os.urandom(n)
    try:
        with _socket.create_connection(tuple(d.tcp), timeout=10) as s:
            s.sendall(tcp.request(tcp.WRITE, flags, d.buf_id, d.token, 0, n))
            _send_in_pieces(s, data, 1 << 17, (0.02, 0.0001))
            assert _answer(s, tcp.HEAD)[0] == tcp.OK
        assert target == data
        assert used == ([n] if flags else [])
    finally:
        buf.drop()


@pytest.mark.parametrize("flags, cpu", [(0, None), (1, None), (1, 6), (1, 5)])
def test_tcp_owner_polls_for_the_next_request_after_a_lone_transfer(monkeypatch, flags, cpu):
    """After a transfer flagged ALONE (the only connection of its transfer), the owner's thread polls for
    the next request while requests keep coming within ``SPIN_S``, unless the request said the reader runs
    on the CPU the owner's thread is on (5 here; None: the reader's CPU is not known); after one without
    the flag, or after a request that came later than that, it blocks at once. The answers are right
    either way."""
    import socket as _socket

    from monarch_tensor.rdma.backends import tcp

    monkeypatch.setattr(tcp, "SPIN_S", 20.0)  # long: a slow machine's delays stay well within it
    monkeypatch.setattr(tcp, "_cpu", lambda: 5)
    clock = _JumpClock()
    monkeypatch.setattr(tcp, "time", clock)
    calls = []
    real = tcp._next_request
    data = os.urandom(4096)
    buf = RDMABuffer(bytearray(data))
    d = buf._desc

    def spy(conn, head, poll):
        try:  # (spied on before connecting: the server waits for a connection's first request at once)
            peer = conn.getpeername()
        except OSError:
            peer = None
        if [c[0] for c in calls].count(peer) == 2:  # the third wait on a connection: make it a long one
            clock.jump(60.0)  # once the wait has read its start time
        got = real(conn, head, poll)
        calls.append((peer, poll, got))
        return got

    monkeypatch.setattr(tcp, "_next_request", spy)
    try:
        with _socket.create_connection(tuple(d.tcp), timeout=10) as s:
            ours = s.getsockname()

            def read():
                s.sendall(tcp.request(tcp.READ, flags, d.buf_id, d.token, 0, len(data),
                                      tcp.NO_CPU if cpu is None else cpu))
                answer = _answer(s, tcp.HEAD + len(data))
                assert answer[0] == tcp.OK and answer[tcp.HEAD:] == data

            read()
            read()  # at once: polled for after a flagged transfer
            read()  # 60 s after the wait began, by the server's clock: the poll gives up, the wait is long
            read()  # after a long wait the thread blocks at once, and the wait is short again
    finally:
        buf.drop()
    polls = bool(flags) and cpu != 5
    mine = [(poll, got) for peer, poll, got in calls if peer == ours]  # not another test's pooled connection
    assert mine == [(False, True), (polls, True), (polls, False), (False, True)]


def test_tcp_reader_tells_its_cpu_only_on_the_owners_host(monkeypatch):
    """A reader puts the CPU it runs on in its request when the owner is on its host, and NO_CPU when not
    (another host's CPU numbers say nothing about sharing a core)."""
    import dataclasses

    from monarch_tensor.rdma.backends import tcp

    monkeypatch.setenv(ENV_BACKEND, "tcp")
    monkeypatch.setattr(tcp, "_cpu", lambda: 3)
    sent = []
    real = tcp.request

    def spy(*args):
        sent.append(args[6])
        return real(*args)

    monkeypatch.setattr(tcp, "request", spy)
    data = os.urandom(5000)
    buf = RDMABuffer(bytearray(data))
    try:
        d = buf._desc
        here = RDMABuffer._from_desc(dataclasses.replace(d, pid=d.pid + 1))
        away = RDMABuffer._from_desc(dataclasses.replace(d, pid=d.pid + 1, host="elsewhere/boot/1"))
        for b in (here, away):
            out = bytearray(5000)
            b.read_into(out).get(timeout=30)
            assert bytes(out) == data and b.backend == "tcp"
    finally:
        buf.drop()
    assert sent == [3, tcp.NO_CPU]


def test_tcp_owner_next_request_polls_then_blocks(monkeypatch):
    """``_next_request``: a header that comes in pieces while the thread polls, or after its polling
    ended, arrives whole; polling yields the core between tries, and does not start on a crowded machine;
    a client that hangs up while it polls is a ConnectionError."""
    from monarch_tensor.rdma.backends import tcp

    monkeypatch.setattr(tcp, "SPIN_S", 20.0)  # long against the pieces' pauses, even on a slow machine
    clock = _JumpClock()
    monkeypatch.setattr(tcp, "time", clock)
    yields = []
    me = threading.get_ident()  # server threads of earlier tests, still polling, yield through it too
    monkeypatch.setattr(tcp, "_sched_yield", lambda: yields.append(1) if threading.get_ident() == me else None)
    for long, crowded in ((False, False), (True, False), (False, True)):
        monkeypatch.setattr(tcp, "_crowded", lambda crowded=crowded: crowded)
        yields.clear()
        reader, owner = _tcp_pair()
        with reader, owner:
            head = os.urandom(tcp.HEAD)
            if long:  # the header comes 60 s into the wait by the clock, after two polls that found nothing
                clock.jump(60.0, after=3)

            def send(head=head, reader=reader, long=long):
                if long:
                    assert clock.jumped.wait(30), "the poll never read the clock three times"
                time.sleep(0.01)
                reader.sendall(head[:10])
                time.sleep(0.005)
                reader.sendall(head[10:])

            threading.Thread(target=send, daemon=True).start()
            got = memoryview(bytearray(tcp.HEAD))
            short = tcp._next_request(owner, got, True)
            assert bytes(got) == head
            assert short == (not long), (long, crowded)
            assert (len(yields) > 0) == (not crowded), (long, crowded, len(yields))
    reader, owner = _tcp_pair()
    with owner:
        threading.Timer(0.01, reader.close).start()
        with pytest.raises(ConnectionError):
            tcp._next_request(owner, memoryview(bytearray(tcp.HEAD)), True)
