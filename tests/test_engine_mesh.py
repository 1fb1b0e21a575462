"""Collectives, slicing, to_mesh, remote functions and streams on a {"hosts": 2, "gpus": 2} mesh.

Collectives are checked against a local reference computed from each rank's
known input (rank r holds ``base * (r + 1)``).
"""

from __future__ import annotations

import gc

import pytest
import torch

from controller.api import worker_stats
from monarch_tensor import (
    MeshTensorError,
    RemoteException,
    Stream,
    call_on_shard_and_fetch,
    fetch_shard,
    inspect,
    reduce,
    remote,
    this_host,
)

pytestmark = pytest.mark.timeout(120)

BASE = torch.arange(8.0).reshape(4, 2) - 3


@pytest.fixture(scope="module")
def mesh():
    m = this_host().spawn_procs(per_host={"hosts": 2, "gpus": 2})
    yield m
    m.stop()


def _per_rank(mesh):
    """Rank r (flat) holds BASE * (r + 1)."""
    r = mesh.rank_tensor("hosts") * 2 + mesh.rank_tensor("gpus")
    return torch.tensor(BASE.tolist()) * (r + 1).to(torch.float32)


def _local(r):
    return BASE * (r + 1)


REFS = {
    "sum": lambda xs: sum(xs),
    "avg": lambda xs: sum(xs) / len(xs),
    "max": lambda xs: torch.stack(xs).amax(0),
    "min": lambda xs: torch.stack(xs).amin(0),
    "product": lambda xs: torch.stack(xs).prod(0),
    "stack": lambda xs: torch.stack(xs),
}


@pytest.mark.parametrize("reduction", sorted(REFS))
def test_reduce_over_gpus_matches_reference(mesh, reduction):
    with mesh.activate():
        y = reduce(_per_rank(mesh), "gpus", reduction)
        got = {(h, g): fetch_shard(y, hosts=h, gpus=g) for h in range(2) for g in range(2)}
        got = {k: f.result(timeout=60) for k, f in got.items()}
    for h in range(2):
        want = REFS[reduction]([_local(2 * h), _local(2 * h + 1)])
        for g in range(2):
            torch.testing.assert_close(got[(h, g)], want)


def test_reduce_multi_dim_inplace_and_scatter(mesh):
    with mesh.activate():
        x = _per_rank(mesh)
        both = x.reduce(("hosts", "gpus"), "sum")
        sc = x.reduce("hosts", "sum", scatter=True)
        x.reduce_("hosts", "max")
        got_both = inspect(both, hosts=1, gpus=0)
        got_sc = [inspect(sc, hosts=h, gpus=1) for h in range(2)]
        got_x = inspect(x, hosts=0, gpus=1)
        with pytest.raises(ValueError, match="divisible"):
            torch.ones(3).reduce("gpus", "sum", scatter=True)
    torch.testing.assert_close(got_both, sum(_local(r) for r in range(4)))
    full = _local(1) + _local(3)  # gpus=1: flat ranks 1 and 3
    torch.testing.assert_close(torch.cat(got_sc), full)
    torch.testing.assert_close(got_x, torch.maximum(_local(1), _local(3)))


def test_slice_and_to_mesh(mesh):
    h0, h1 = mesh.slice(hosts=0), mesh.slice(hosts=1)
    with mesh.activate():
        x = _per_rank(mesh)
        x0 = x.slice_mesh(hosts=0)
        moved = x0.to_mesh(h1)  # hosts=0 ranks send to hosts=1 ranks
        assert moved.mesh.sizes == {"gpus": 2}
        doubled = moved * 2
        got = [inspect(doubled, gpus=g) for g in range(2)]
        back = inspect(doubled.to_mesh(h0), gpus=1)
    for g in range(2):
        torch.testing.assert_close(got[g], _local(g) * 2)
    torch.testing.assert_close(back, _local(1) * 2)


def test_to_mesh_between_allocations(mesh):
    other = this_host().spawn_procs(per_host={"gpus": 2})
    try:
        with mesh.activate():
            x = _per_rank(mesh).slice_mesh(hosts=1)
            y = x.to_mesh(other)
        with other.activate():
            z = y + 1
            got = inspect(z, gpus=0)
    finally:
        other.stop()
    torch.testing.assert_close(got, _local(2) + 1)


def test_mixing_meshes_is_a_clear_error(mesh):
    with mesh.activate():
        a = torch.ones(2)
        b = a.slice_mesh(hosts=0)
        with pytest.raises(MeshTensorError, match="different meshes"):
            a.slice_mesh(hosts=1) + b


def _scaled(x, k):
    return x * k, {"k": k}


def test_remote_functions(mesh):
    triple = remote(_scaled, propagate=lambda x, k: (x, {"k": k}))
    qr = remote("torch.linalg.qr", propagate="inspect")
    with mesh.activate():
        x = _per_rank(mesh)
        y, meta = triple(x, 3)
        assert meta == {"k": 3}
        q, r = qr(x)
        assert q.shape == (4, 2) and r.shape == (2, 2)
        got_y = inspect(y, hosts=1, gpus=1)
        got_qr = inspect(q @ r, hosts=0, gpus=1)
        fetched = call_on_shard_and_fetch(remote(_scaled), x, 2, shard={"hosts": 1, "gpus": 0}).result(timeout=60)
    torch.testing.assert_close(got_y, _local(3) * 3)
    torch.testing.assert_close(got_qr, _local(1), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(fetched[0], _local(2) * 2)
    assert fetched[1] == {"k": 2}


def test_stream_borrow_overlaps_and_orders(mesh):
    comms = Stream("comms")
    with mesh.activate():
        x = _per_rank(mesh)
        bx, borrow = comms.borrow(x)
        with pytest.raises(MeshTensorError, match="borrow"):
            with comms.activate():
                x + 1  # x lives on the main stream
        with comms.activate():
            s = bx.reduce("gpus", "sum")
            s2 = s * 2
        y = x * 10  # the main stream keeps going meanwhile
        borrow.drop()
        with pytest.raises(MeshTensorError):
            bx + 1  # dropped
        got_s2 = inspect(s2, hosts=0, gpus=0)
        got_y = inspect(y, hosts=1, gpus=1)
        stats = worker_stats(mesh)
    torch.testing.assert_close(got_s2, (_local(0) + _local(1)) * 2)
    torch.testing.assert_close(got_y, _local(3) * 10)
    assert stats["streams"] >= 2 and stats["borrows"] == 0


def test_failed_collective_input_propagates(mesh):
    bad = remote(lambda x: x[100], propagate=lambda x: x)
    with mesh.activate():
        x = _per_rank(mesh)
        y = bad(x).reduce("gpus", "sum")
        with pytest.raises(RemoteException, match="IndexError|out of bounds"):
            inspect(y)
        ok = inspect(x.reduce("gpus", "sum"))  # the mesh and its process groups stay usable
    torch.testing.assert_close(ok, _local(0) + _local(1))
    gc.collect()
