"""Large actor-message buffers between procs of one host ride pooled shared-memory segments.

Real procs: the bytes arrive intact, segments are reused once the receiver's
views are gone, a view the receiver still holds is never overwritten, and a
broadcast to several procs waits for every reader.
"""

from __future__ import annotations

import glob
import os
import signal
import time

import numpy as np
import pytest

import monarch_tensor.actor as actor_mod
from monarch_tensor.actor import Actor, current_rank, endpoint, this_host
from monarch_tensor.transport import _shm

MIB = 1 << 20


class Echo(Actor):
    @endpoint
    def echo(self, x):
        return x

    @endpoint
    def total(self, x) -> float:
        return float(x.sum())

    @endpoint
    def keep_on(self, x, rank: int) -> None:
        """Rank ``rank`` keeps ``x``: a view into the sender's segment, still held after the call."""
        if current_rank().rank == rank:
            self.kept = x

    @endpoint
    def keep_and_add(self, x) -> None:
        """Keeps ``x`` and adds this rank + 1 to it in place."""
        self.kept = x
        x += current_rank().rank + 1

    @endpoint
    def kept_total(self) -> float:
        return float(self.kept.sum())

    @endpoint
    def pid(self) -> int:
        return os.getpid()


def _pool_files() -> set[str]:
    return set(glob.glob(f"/dev/shm/mt-{os.getpid()}-p*"))


@pytest.fixture(scope="module")
def echo():
    if not _shm.available():
        pytest.skip("no writable /dev/shm")
    procs = this_host().spawn_procs(per_host={"gpus": 2})
    yield procs.spawn("shm_echo", Echo)
    procs.stop().get(timeout=30)


@pytest.mark.timeout(60)
def test_echo_reuses_the_pooled_segment(echo):
    one = echo.slice(gpus=0)
    arr = np.arange(4 * MIB // 8, dtype=np.int64)
    _shm._close_pool()  # this process's pool starts empty: what is in it below, these calls made
    for i in range(20):
        out = one.echo.call_one(arr + i).get(timeout=30)
        np.testing.assert_array_equal(out, arr + i)
        del out
    made = _shm._get_pool().segments
    # One segment, or two: the proc may still hold its view of a request when its reply comes back, and
    # then the next request takes a second one; never one per call.
    assert 1 <= len(made) <= 2, f"{len(made)} segments for 20 calls"
    assert {s.name for s in made} <= {os.path.basename(f) for f in _pool_files()}


@pytest.mark.timeout(60)
def test_a_held_view_is_never_overwritten(echo):
    one = echo.slice(gpus=0)
    arr = np.arange(2 * MIB // 8, dtype=np.int64)
    kept = one.echo.call_one(arr).get(timeout=30)  # a view into the proc's segment, still held
    for i in range(1, 4):
        np.testing.assert_array_equal(one.echo.call_one(arr * 0 + i).get(timeout=30), arr * 0 + i)
    np.testing.assert_array_equal(kept, arr)


@pytest.mark.timeout(60)
def test_broadcast_to_several_procs_waits_for_every_reader(echo):
    arr = np.ones(2 * MIB // 8, dtype=np.float64)
    echo.keep_on.call(arr * 7, 1).get(timeout=30)  # rank 1 holds its view of the segment; rank 0 let go
    for i in range(1, 4):
        totals = echo.total.call(arr * i).get(timeout=30).values()
        assert totals == [float(arr.size * i)] * 2
    assert echo.slice(gpus=1).kept_total.call_one().get(timeout=30) == float(arr.size * 7)  # not overwritten


@pytest.mark.timeout(60)
def test_receivers_of_one_broadcast_change_only_their_own_arguments(echo):
    # Both receivers mapped the one segment shared and writable: each saw the other's += as well (3 and 3).
    arr = np.zeros(2 * MIB // 8, dtype=np.float64)
    echo.keep_and_add.call(arr).get(timeout=30)
    assert echo.kept_total.call().get(timeout=30).values() == [float(arr.size), float(arr.size * 2)]
    assert not arr.any()
    assert echo.slice(gpus=0).total.call_one(arr).get(timeout=30) == 0.0


def _oneoff_files() -> set[str]:
    return set(glob.glob(f"/dev/shm/mt-{os.getpid()}-*")) - _pool_files()


@pytest.mark.timeout(60)
def test_a_broadcast_beyond_the_pool_reaches_every_reader(echo, monkeypatch):
    # It went into a one-off file that the first reader unlinked on arrival: the other could not open it,
    # and the call never completed.
    monkeypatch.setattr(_shm, "SHM_POOL_BYTES", MIB)
    arr = np.ones(4 * MIB // 8, dtype=np.float64)
    before = _oneoff_files()
    assert echo.total.call(arr).get(timeout=30).values() == [float(arr.size)] * 2
    assert _oneoff_files() == before, "each reader unlinks its own name of the file"


@pytest.mark.timeout(60)
def test_a_message_a_reader_cannot_map_fails_the_call(echo, monkeypatch):
    # The reader only logged it; the caller waited for ever.
    real = _shm.for_reader
    monkeypatch.setattr(_shm, "for_reader", lambda desc, i: ("mt-0-gone", *real(desc, i)[1:]) if i else desc)
    with pytest.raises(Exception, match="cannot map the shared-memory buffers .* of the arguments of "):
        echo.total.call(np.ones(2 * MIB // 8)).get(timeout=30)
    monkeypatch.undo()
    assert echo.total.call(np.ones(2 * MIB // 8)).get(timeout=30).values() == [float(2 * MIB // 8)] * 2


class _Big(Actor):
    @endpoint
    def array(self, n: int):
        return os.getpid(), np.full(n, 7, dtype=np.uint8)


def _mapped_fds_of(pid: int) -> list[str]:
    return [target for target in _shm_fds() if f"/mt-{pid}-" in target]


def test_a_stopped_procs_segments_are_unmapped_here():
    # The receiver kept every segment it had mapped (each with an open descriptor) after their proc
    # exited, up to the cache's 2 GiB: 80 MiB after 20 meshes that each sent 2 MiB results.
    import gc

    procs = this_host().spawn_procs(per_host={"gpus": 2})
    big = procs.spawn("big", _Big)
    got = big.array.call(_shm.SHM_THRESHOLD * 2).get(timeout=60).values()
    pids = [pid for pid, _ in got]
    assert all(int(a[0]) == 7 for _, a in got)
    del got
    gc.collect()
    assert any(n.startswith(f"mt-{pid}-") for pid in pids for n in _shm._maps.maps)
    procs.stop().get(timeout=30)
    gc.collect()
    assert not any(n.startswith(f"mt-{pid}-") for pid in pids for n in _shm._maps.maps)
    assert [f for pid in pids for f in _mapped_fds_of(pid)] == []


@pytest.mark.timeout(60)
def test_what_a_killed_reader_held_is_released(monkeypatch):
    # A reader killed before it let go never cleared its hold flag on our pooled segment (never reused
    # again) nor unlinked its name of a one-off file: each such call left its bytes in /dev/shm until the
    # script exited (64 MiB more per call of a script that killed a receiver each time).
    if not _shm.available():
        pytest.skip("no writable /dev/shm")
    from monarch_tensor.errors import SupervisionError

    monkeypatch.setattr(actor_mod, "unhandled_fault_hook", lambda failure: None)
    before = _oneoff_files()
    procs = this_host().spawn_procs(per_host={"gpus": 2})
    try:
        echo = procs.spawn("shm_killed", Echo)
        pids = echo.pid.call().get(timeout=30).values()
        os.kill(pids[1], signal.SIGSTOP)  # rank 1 reads nothing from now on
        _shm._close_pool()
        arr = np.ones(2 * MIB // 8)
        pooled = echo.total.call(arr)  # a pooled segment, rank 1's flag set
        monkeypatch.setattr(_shm, "SHM_POOL_BYTES", MIB)
        oneoff = echo.total.call(arr * 2)  # no room in the pool: a one-off file, one name per rank
        assert _shm._get_pool().segments
        os.kill(pids[1], signal.SIGKILL)
        for fut in (pooled, oneoff):
            with pytest.raises(SupervisionError, match="SIGKILL"):
                fut.get(timeout=30)
        deadline = time.monotonic() + 10  # (released as the death is handled, which a loaded machine may finish
        while ((_oneoff_files() != before or not all(s.free() for s in _shm._get_pool().segments))
               and time.monotonic() < deadline):  # after the calls' failure reached us)
            time.sleep(0.05)
        assert _oneoff_files() == before, "the dead reader's name of the one-off file is unlinked"
        assert all(s.free() for s in _shm._get_pool().segments), "the dead reader's hold flag is cleared"
    finally:
        procs.stop().get(timeout=30)


def _shm_fds() -> list[str]:
    """The shared-memory files (of any process) this process holds a descriptor of."""
    out = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith(f"{_shm.SHM_DIR}/mt-"):
            out.append(target)
    return out


class _Keeper(Actor):
    def __init__(self) -> None:
        self.kept = []

    @endpoint
    def keep(self, x) -> list[str]:
        self.kept.append(x)
        return _shm_fds()

    @endpoint
    def array(self, n: int):
        return np.full(n, 7, dtype=np.uint8)


@pytest.mark.timeout(60)
def test_kept_messages_hold_no_descriptors():
    # Each kept message pins its own segment of the sender's pool, and a Python mmap keeps a duplicate of
    # its file's descriptor open: one per segment in the sender, three per segment in the reader (kept
    # after the message was freed), so a few hundred kept 1 MiB results or arguments ran out of the common
    # `ulimit -n 1024` ("cannot map the shared-memory buffers ... Too many open files").
    if not _shm.available():
        pytest.skip("no writable /dev/shm")
    procs = this_host().spawn_procs(per_host={"gpus": 1})
    try:
        keeper = procs.spawn("shm_keeper", _Keeper)
        results = [keeper.array.call_one(_shm.SHM_THRESHOLD).get(timeout=30) for _ in range(20)]
        assert all(int(r[0]) == 7 for r in results)
        assert _shm_fds() == [], "the results' segments are mapped here without a descriptor each"
        held = [keeper.keep.call_one(np.ones(MIB // 8)).get(timeout=30) for _ in range(20)]
        assert held[-1] == [], "the proc maps the arguments it keeps without a descriptor each"
        assert _shm_fds() == [], "our pool's segments are mapped without a descriptor each"
    finally:
        procs.stop().get(timeout=30)


@pytest.mark.timeout(60)
def test_oneoff_files_no_reader_took_are_removed_at_exit(monkeypatch):
    # Only a reader unlinked its name of a one-off file (on arrival), and the sender's exit hook removed
    # only its pooled segments: a message still queued to a proc that never read it stayed in /dev/shm
    # after the script exited.
    if not _shm.available():
        pytest.skip("no writable /dev/shm")
    _shm._close_pool()  # (a free pooled segment would take the message)
    monkeypatch.setattr(_shm, "SHM_POOL_BYTES", 0)  # no room in the pool: a one-off file
    holders = ["ipc://nobody-0", "ipc://nobody-1"]
    before = _oneoff_files()
    try:
        _shm.write([np.ones(MIB // 8)], readers=2, holders=holders)
        assert len(_oneoff_files() - before) == 2, "one name per reader"
        _shm._close_pool()  # the exit hook
        assert _oneoff_files() == before, "the names no reader took are removed"
    finally:
        for h in holders:
            _shm.release_reader(h)
