"""Torch's intra-op threads in procs: a share of the host's cores by default (torchrun's rule), with one
line of notice; ``spawn_procs(threads=N)`` and the script's ``OMP_NUM_THREADS`` choose instead."""

from __future__ import annotations

import os

import pytest
import torch

from monarch_tensor import Stream, call_on_shard_and_fetch, remote, this_host
from monarch_tensor.actor import Actor, endpoint
from monarch_tensor.hosts.host import local_procs
from monarch_tensor.runtime._threads import cores

pytestmark = pytest.mark.timeout(120)


def _threads() -> tuple[int, str, str]:
    return torch.get_num_threads(), os.environ.get("OMP_NUM_THREADS", ""), os.environ.get("MKL_NUM_THREADS", "")


def _spawn(**kwargs):
    return this_host().spawn_procs(per_host={"procs": 2}, **kwargs)


def test_each_proc_gets_its_share_of_the_cores_by_default(capfd, monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    live = len(local_procs())
    procs = _spawn()
    try:
        expected = max(1, cores() // (live + 2))
        got = procs.execute(_threads).values()
        assert [g[0] for g in got] == [expected, expected]
        assert all(g[1] == str(expected) for g in got)  # what the proc's own children read
        err = capfd.readouterr().err
        notices = [line for line in err.splitlines() if "intra-op thread" in line]
        if expected < cores():
            assert len(notices) == 1 and f"uses {expected} intra-op thread" in notices[0], err
            assert f"/ {live + 2} procs on this host" in notices[0]
        else:
            assert notices == []
    finally:
        procs.stop()


def test_threads_n_and_the_users_omp_num_threads_win_without_a_notice(capfd, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "3")  # set after the template started: still the procs' count
    procs = _spawn()
    chosen = _spawn(threads=2)
    try:
        assert [g[:2] for g in procs.execute(_threads).values()] == [(3, "3"), (3, "3")]
        assert [g[:2] for g in chosen.execute(_threads).values()] == [(2, "2"), (2, "2")]
        assert "intra-op thread" not in capfd.readouterr().err
        chosen.execute(torch.set_num_threads, 1)  # the user's own call on the proc wins later
        assert [g[0] for g in chosen.execute(_threads).values()] == [1, 1]
    finally:
        procs.stop()
        chosen.stop()


@pytest.mark.parametrize("bad, error", [(0, ValueError), (-1, ValueError), ("x", TypeError), (2.0, TypeError),
                                        (True, TypeError)])
def test_a_bad_thread_count_is_refused_at_the_call(bad, error):
    before = len(local_procs())
    with pytest.raises(error, match="threads"):
        _spawn(threads=bad)
    assert len(local_procs()) == before


@pytest.mark.timeout(180)
def test_procs_behind_a_host_agent_take_their_hosts_share(tmp_path, capfd, monkeypatch):
    from monarch_tensor.job import LocalJob

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    job = LocalJob(meshes={"hosts": 1}, root_dir=str(tmp_path), ttl=120)
    try:
        hosts = job.state().hosts
        procs = hosts.spawn_procs(per_host={"procs": 2})
        chosen = hosts.spawn_procs(per_host={"procs": 1}, threads=3)
        expected = max(1, cores() // 2)  # (the agent's host is this machine; its procs: 2 when they spawned)
        assert [g[:2] for g in procs.execute(_threads).values()] == [(expected, str(expected))] * 2
        assert [g[:2] for g in chosen.execute(_threads).values()] == [(3, "3")]
        notices = [ln for ln in capfd.readouterr().err.splitlines() if "intra-op thread" in ln]
        assert notices == ["monarch_tensor: torch in each of the 2 new procs uses its host's cores / 2 intra-op "
                           "threads (at least 1); choose with spawn_procs(threads=N) or OMP_NUM_THREADS"]
    finally:
        job.kill()


def _new_threads_of_a_matrix_product() -> int:
    """In the calling thread: the OS threads this process gained from a first matrix product (MKL's team)."""
    before = set(os.listdir("/proc/self/task"))
    torch.mm(torch.empty(512, 512), torch.empty(512, 512))  # (empty: no kernel runs before the product)
    return len(set(os.listdir("/proc/self/task")) - before)


class _Multiplies(Actor):
    def __init__(self) -> None:  # (an actor's constructor runs on a thread of its own)
        self.gained = _new_threads_of_a_matrix_product()

    @endpoint
    def gained_threads(self) -> int:
        return self.gained


@pytest.mark.skipif(not os.path.isdir("/proc/self/task") or cores() < 2, reason="counts threads in /proc; needs 2 cores")
def test_threads_a_proc_starts_compute_with_its_count():
    """A tensor engine stream's thread and an actor constructor's thread compute with the proc's count from their
    first op: a matrix product first (before any op made torch read its count) ran on every core's MKL thread."""
    procs = _spawn(threads=1)
    try:
        with procs.activate():
            with Stream("first_product").activate():
                gained = call_on_shard_and_fetch(remote(_new_threads_of_a_matrix_product, propagate=lambda: 0),
                                                 shard={"procs": 1}).result(timeout=60)
        assert gained == 0
        assert procs.spawn("multiplies", _Multiplies).gained_threads.call().get(timeout=60).values() == [0, 0]
    finally:
        procs.stop()
