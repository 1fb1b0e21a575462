"""Large actor-message buffers between procs of one host ride pooled shared-memory segments.

Real procs: the bytes arrive intact, segments are reused once the receiver's
views are gone, a view the receiver still holds is never overwritten, and a
broadcast to several procs waits for every reader.
"""

from __future__ import annotations

import glob
import os

import numpy as np
import pytest

from monarch_tensor import _shm
from monarch_tensor.actor import Actor, current_rank, endpoint, this_host

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
    def kept_total(self) -> float:
        return float(self.kept.sum())


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
