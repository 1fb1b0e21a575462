"""Collectives, process groups, slicing, to_mesh, remote functions and streams on a {"hosts": 2, "gpus": 2} mesh.

Collectives are checked against a local reference computed from each rank's
known input (rank r holds ``base * (r + 1)``).
"""

from __future__ import annotations

import gc
import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from monarch_tensor.controller.api import worker_stats

from monarch_tensor import (
    MeshTensorError,
    RemoteException,
    Stream,
    call_on_shard_and_fetch,
    fetch_shard,
    inspect,
    no_mesh,
    reduce,
    reduce_,
    remote,
    this_host,
)
from monarch_tensor.actor import Actor, endpoint

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


def test_reduce_takes_a_pytree_of_tensors(mesh):  # Monarch's reduce(tensors, ...)
    with mesh.activate():
        x = _per_rank(mesh)
        y = x * 2
        got = reduce({"x": x, "pair": (y, x)}, "gpus", "sum")
        assert isinstance(got, dict) and isinstance(got["pair"], tuple)
        vals = [inspect(t, hosts=1, gpus=0) for t in (got["x"], got["pair"][0], got["pair"][1])]
        z = x.clone()
        reduce_([z], "hosts", "max")
        got_z = inspect(z, hosts=0, gpus=1)
        with pytest.raises(TypeError, match="reduce needs a mesh tensor, got int"):
            reduce([x, 3], "gpus")
        with pytest.raises(TypeError, match="takes one tensor, not a pytree"):
            reduce([x], "gpus", out=x)
    both = _local(2) + _local(3)
    torch.testing.assert_close(vals[0], both)
    torch.testing.assert_close(vals[1], both * 2)
    torch.testing.assert_close(vals[2], both)
    torch.testing.assert_close(got_z, torch.maximum(_local(1), _local(3)))


def test_tensors_on_a_split_or_flattened_mesh_reduce_over_its_dims(mesh):
    """``mesh.split``/``flatten``/``rename`` give meshes of the same procs whose dims reductions name."""
    sp = mesh.split(gpus=("g_a", "g_b"), g_b=1).rename(hosts="dp")
    with sp.activate():
        r = sp.rank_tensor("dp") * 2 + sp.rank_tensor("g_a")  # the flat rank, as in _per_rank
        y = reduce(torch.tensor(BASE.tolist()) * (r + 1).to(torch.float32), "dp", "sum")
        got = [fetch_shard(y, dp=h, g_a=g, g_b=0).result(timeout=60) for h in range(2) for g in range(2)]
    for h in range(2):
        for g in range(2):
            torch.testing.assert_close(got[2 * h + g], _local(g) + _local(2 + g))
    flat = mesh.flatten("all")
    with flat.activate():
        z = reduce(torch.tensor(BASE.tolist()) * (flat.rank_tensor("all") + 1).to(torch.float32), "all", "sum")
        got = fetch_shard(z, all=3).result(timeout=60)
    torch.testing.assert_close(got, sum(_local(r) for r in range(4)))


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


def test_to_mesh_is_differentiable_so_a_model_split_over_two_meshes_trains_as_one(mesh):
    """A pipeline's two stages on two meshes: the gradient of a tensor moved with to_mesh goes back to its mesh,
    as locally. The moved tensor did not require grad, and the first stage's parameters got no gradient."""
    h0, h1 = mesh.slice(hosts=0), mesh.slice(hosts=1)
    torch.manual_seed(0)
    l0, l1 = torch.nn.Linear(4, 3), torch.nn.Linear(3, 2)
    x = torch.randn(5, 4)
    loss = l1(torch.relu(l0(x)).t().t()).pow(2).sum()  # (a transposed tensor, and gradient, cross the meshes)
    loss.backward()
    with h0.activate():
        s0 = torch.nn.Linear(4, 3)
        s0.load_state_dict(l0.state_dict())
        a = torch.relu(s0(torch.tensor(x.tolist()))).t()
    with h1.activate():
        s1 = torch.nn.Linear(3, 2)
        s1.load_state_dict(l1.state_dict())
        b = a.to_mesh(h1)
        assert b.requires_grad and b.mesh._shape == h1._shape
        with torch.no_grad():
            assert not a.to_mesh(h1).requires_grad
        got_loss = s1(b.t()).pow(2).sum()
        got_loss.backward()
        got = [inspect(t, gpus=1) for t in (got_loss, s1.weight.grad, s1.bias.grad)]
    assert s0.weight.grad.mesh._shape == h0._shape
    got += [inspect(t, gpus=0) for t in (s0.weight.grad, s0.bias.grad)]
    for g, want in zip(got, (loss, l1.weight.grad, l1.bias.grad, l0.weight.grad, l0.bias.grad)):
        torch.testing.assert_close(g, want.detach())


def test_to_mesh_of_a_non_contiguous_tensor_arrives_contiguous(mesh):
    """The controller describes a moved tensor as contiguous; a transposed one kept its strides on the wire, so
    an op that needs contiguous memory there (view) failed on the receiving ranks."""
    with mesh.activate():
        x = _per_rank(mesh).t().slice_mesh(hosts=0)
        moved = x.to_mesh(mesh.slice(hosts=1))
        got = inspect(moved.view(-1), gpus=1)
    torch.testing.assert_close(got, _local(1).t().reshape(-1))


def test_to_mesh_broadcasts_along_the_destination_dims_the_source_lacks(mesh):
    """Monarch's: each rank of the destination gets the value of the source rank at its coordinates on the dims
    they share (initialize on one host, send to every host). It was refused: meshes of other sizes."""
    h0 = mesh.slice(hosts=0)
    with mesh.activate():
        x = _per_rank(mesh)
        y = x.slice_mesh(hosts=1).to_mesh(mesh)
        got = {(h, g): inspect(y, hosts=h, gpus=g) for h in range(2) for g in range(2)}
        one = x.slice_mesh(hosts=0, gpus=1).to_mesh(mesh)  # one rank's value, to every rank
        got_one = [inspect(one, hosts=h, gpus=g) for h, g in ((0, 0), (1, 1))]
        with pytest.raises(ValueError, match="every dim of the source at the same size"):
            x.to_mesh(mesh.slice(hosts=1))  # the destination has no "hosts"
    with h0.activate():
        w = torch.ones(2).requires_grad_() * 2
        with pytest.raises(MeshTensorError, match="broadcasts.*requires grad.*detach"):
            w.to_mesh(mesh)
        z = w.detach().to_mesh(mesh)
    for (_, g), value in got.items():
        torch.testing.assert_close(value, _local(2 + g))
    for value in got_one:
        torch.testing.assert_close(value, _local(1))
    assert inspect(z, hosts=1, gpus=1).tolist() == [2.0, 2.0]


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.data())
def test_a_pytrees_tensors_reduce_in_one_collective_per_dtype_like_one_at_a_time(mesh, data):
    """reduce/reduce_ of a pytree (ReduceMany: a dtype's leaves side by side in one buffer) gives what each leaf
    reduced alone gives, for any shapes, dtypes, reductions and dims."""
    n = data.draw(st.integers(2, 5))
    shapes = [tuple(data.draw(st.lists(st.integers(1, 3), max_size=2))) for _ in range(n)]
    dtypes = [data.draw(st.sampled_from([torch.float32, torch.float64, torch.int64])) for _ in range(n)]
    reduction = data.draw(st.sampled_from(["sum", "avg", "max", "min", "product"]))
    dims = data.draw(st.sampled_from(["gpus", "hosts", ("hosts", "gpus")]))
    inplace = data.draw(st.booleans())
    with mesh.activate():
        r = mesh.rank_tensor("hosts") * 2 + mesh.rank_tensor("gpus")
        tree = {"t": [(torch.arange(math.prod(s), dtype=d).reshape(s) - 1 + r.to(d) * (i + 1))
                      for i, (s, d) in enumerate(zip(shapes, dtypes))]}
        alone = [t.reduce(dims, reduction) for t in tree["t"]]
        if inplace:
            reduce_(tree, dims, reduction)
            got = tree
        else:
            got = reduce(tree, dims, reduction)
        assert list(got) == ["t"] and len(got["t"]) == n
        for t, want, d in zip(got["t"], alone, dtypes):
            assert t.dtype == d
            for h, g in ((0, 1), (1, 0)):
                torch.testing.assert_close(inspect(t, hosts=h, gpus=g), inspect(want, hosts=h, gpus=g))


def test_a_run_of_reduces_is_one_collective_with_each_result_its_own(mesh):
    """Adjacent reduces of a batch go in one collective (the controller folds them into a ReduceMany); a
    reduce of what an earlier one made still sees that result."""
    from monarch_tensor.worker import messages as m

    from monarch_tensor import coalescing

    with mesh.activate():
        x = _per_rank(mesh)
        grads = [x * (i + 1) for i in range(4)]
        with coalescing():  # (held until the block ends: the batch can be looked at)
            for g in grads:
                g.reduce_("gpus", "avg")
            last = x._ctx.client._q[-1]
            assert type(last) is m.ReduceMany and last.srcs == tuple(g._ref for g in grads)
        twice = x.clone()
        twice.reduce_("gpus", "sum")
        twice.reduce_("gpus", "sum")  # depends on the one before
        dup = x.clone()
        reduce_([dup, dup], "gpus", "sum")  # the same tensor twice: reduced twice, as leaf by leaf
        y = x.reduce("gpus", "max")
        z = y.reduce("hosts", "sum")
        got = [inspect(g, hosts=1, gpus=0) for g in grads]
        got_twice, got_z = inspect(twice, hosts=0, gpus=1), inspect(z, hosts=0, gpus=0)
        got_dup = inspect(dup, hosts=0, gpus=0)
    both = _local(2) + _local(3)
    for i, g in enumerate(got):
        torch.testing.assert_close(g, both / 2 * (i + 1))
    torch.testing.assert_close(got_twice, (_local(0) + _local(1)) * 2)
    torch.testing.assert_close(got_dup, (_local(0) + _local(1)) * 2)
    torch.testing.assert_close(got_z, torch.maximum(_local(0), _local(1)) + torch.maximum(_local(2), _local(3)))


def _fails_on_gpu_1(x, gpu):
    if int(gpu) == 1:
        raise ValueError("this input fails on gpus=1 on purpose")
    return x


def test_a_failed_leaf_fails_its_collective_on_every_rank_and_says_why(mesh):
    with mesh.activate():
        good = torch.ones(2) * 2
        bad = remote(_fails_on_gpu_1, propagate=lambda x, g: x)(torch.ones(2), mesh.rank_tensor("gpus"))
        out = reduce([good, bad, torch.ones(4)], "gpus", "sum")  # one collective; only bad's result fails
        with pytest.raises(RemoteException, match="on purpose"):
            inspect(out[1], hosts=0, gpus=1)  # this rank's own input failed
        with pytest.raises(RemoteException, match="its input failed on another rank"):
            inspect(out[1], hosts=0, gpus=0)
        assert inspect(out[0], hosts=1, gpus=1).tolist() == [4.0, 4.0]
        assert inspect(out[2], hosts=1, gpus=0).tolist() == [2.0] * 4
        fine = good.clone()
        bad.reduce_("gpus", "sum")  # the same through a run of single reduces folded into one
        fine.reduce_("gpus", "sum")
        with pytest.raises(RemoteException, match="its input failed on another rank"):
            inspect(bad, hosts=1, gpus=0)
        assert inspect(fine, hosts=1, gpus=0).tolist() == [4.0, 4.0]


def test_module_level_to_mesh_and_slice_mesh_take_pytrees_and_drop_frees(mesh):
    import monarch_tensor

    h1 = mesh.slice(hosts=1)
    with pytest.raises(ValueError, match="no mesh is active"):
        monarch_tensor.get_active_mesh()
    with mesh.activate():
        assert monarch_tensor.get_active_mesh() is mesh
        with h1.activate():
            assert monarch_tensor.get_active_mesh() is h1
        ranks = mesh.rank_tensors()
        assert list(ranks) == ["hosts", "gpus"]
        assert [int(inspect(ranks[d], hosts=1, gpus=0)) for d in ranks] == [1, 0]
        x = _per_rank(mesh)
        tree = {"x": x, "pair": (x * 2, "kept"), "n": 3}
        sliced = monarch_tensor.slice_mesh(tree, hosts=0)
        assert sliced["n"] == 3 and sliced["pair"][1] == "kept"
        assert sliced["x"].mesh.sizes == {"gpus": 2}
        moved = monarch_tensor.to_mesh(sliced, h1)
        got = [inspect(moved["pair"][0], gpus=g) for g in range(2)]
        on_side = monarch_tensor.to_mesh(sliced["x"], h1, stream=Stream("to_mesh_side"))
        assert on_side.stream.name == "to_mesh_side"
        got_side = inspect(on_side, gpus=1)
        with pytest.raises(TypeError, match="takes a Stream"):
            monarch_tensor.to_mesh(sliced["x"], h1, stream="side")
        with pytest.raises(TypeError, match="local torch tensor.*activate"):
            with monarch_tensor.no_mesh.activate():
                local = torch.ones(2)
            monarch_tensor.to_mesh([moved["x"], local], mesh.slice(hosts=0))
        y = x + 1
        gc.collect()
        worker_stats(mesh)  # the deletes of earlier temporaries are flushed by now
        before = worker_stats(mesh)
        assert not y.dropped
        y.drop()
        y.drop()  # twice: nothing more
        assert y.dropped
        for use in (lambda t: t + 1, lambda t: inspect(t), lambda t: t.to_mesh(h1), lambda t: t.reduce("gpus")):
            with pytest.raises(MeshTensorError, match=r"this tensor was dropped \(t.drop\(\)\)"):
                use(y)
        after = worker_stats(mesh)
    for g in range(2):
        torch.testing.assert_close(got[g], _local(g) * 2)
    torch.testing.assert_close(got_side, _local(1))
    assert after["refs"] == before["refs"] - 1, (before, after)


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
        with pytest.raises(MeshTensorError, match="different meshes") as e:
            a.slice_mesh(hosts=1) + b
    # two meshes of the same sizes read apart: which allocation, which of its procs
    n = mesh._seq
    assert (f"({{'gpus': 2}} of proc mesh #{n} (its procs [2, 3]) and {{'gpus': 2}} of proc mesh #{n} "
            f"(its procs [0, 1]))") in str(e.value)
    other = this_host().spawn_procs({"gpus": 2})
    try:
        with other.activate():
            c = torch.ones(2)
        with pytest.raises(MeshTensorError, match=f"{{'gpus': 2}} of proc mesh #{other._seq} and"):
            fetch_shard((c, b), gpus=0)
    finally:
        other.stop()


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


@remote(propagate=lambda t, group: t)
def _all_reduce(t, group):
    torch.distributed.all_reduce(t, group=group)
    return t


@remote
def _all_gather(t, group):  # no propagate: the controller runs it on fake tensors with a stand-in group
    outs = [torch.zeros_like(t) for _ in range(group.size())]
    torch.distributed.all_gather(outs, t, group=group)
    return torch.stack(outs)


@remote(propagate=lambda t, group, src: t.clone())
def _broadcast_from(t, group, src):
    t = t.clone()
    torch.distributed.broadcast(t, src=src, group=group)  # src: a global rank (the proc's rank in the mesh)
    return t


@remote(propagate=lambda t, group: torch.zeros(4, dtype=torch.long))
def _where_am_i(t, group):
    return torch.tensor(torch.distributed.get_process_group_ranks(group) + [group.rank(), group.size()])


@remote(propagate="inspect")
def _my_group_rank(t, group):
    return torch.tensor([group.rank(), group.size()])


def test_process_groups_run_torch_distributed_collectives_in_remote_functions(mesh):
    by_gpus, by_hosts = mesh.process_group("gpus"), mesh.process_group(["hosts"])
    assert (by_gpus.dims, by_gpus.size(), by_hosts.dims) == (("gpus",), 2, ("hosts",))
    both = mesh.process_group(("hosts", "gpus"))
    with mesh.activate():
        x = _per_rank(mesh)
        summed = _all_reduce(x.clone(), by_gpus)
        summed_hosts = _all_reduce(x.clone(), by_hosts)
        summed_all = _all_reduce(x.clone(), both)
        gathered = _all_gather(x, by_gpus)
        assert gathered.shape == (2, 4, 2)
        from_first = _broadcast_from(x, by_hosts, 1)  # groups (0, 2) and (1, 3): rank 1 is in the second only
        where = _where_am_i(x, by_gpus)
        got = {(h, g): [inspect(t, hosts=h, gpus=g) for t in (summed, summed_hosts, summed_all, gathered, where)]
               for h in range(2) for g in range(2)}
        with pytest.raises(RemoteException, match="not part of group"):
            inspect(from_first, hosts=0, gpus=0)  # global rank 1 is not in group (0, 2)
        got_bcast = inspect(from_first, hosts=1, gpus=1)
        inspected = inspect(_my_group_rank(x, by_hosts), hosts=1, gpus=1)
        # on one rank only, collectives go to a stand-in: the value comes back as it went in
        alone = _all_reduce.call_on_shard_and_fetch(x, by_gpus, shard={"hosts": 1, "gpus": 1}).result(timeout=60)
    for (h, g), (s, sh, sa, gath, w) in got.items():
        r = h * 2 + g
        torch.testing.assert_close(s, _local(h * 2) + _local(h * 2 + 1))
        torch.testing.assert_close(sh, _local(g) + _local(2 + g))
        torch.testing.assert_close(sa, sum(_local(i) for i in range(4)))
        torch.testing.assert_close(gath, torch.stack([_local(h * 2), _local(h * 2 + 1)]))
        assert w.tolist() == [h * 2, h * 2 + 1, g, 2], (r, w)
    torch.testing.assert_close(got_bcast, _local(1))
    assert inspected.tolist() == [1, 2]
    torch.testing.assert_close(alone, _local(3))


@remote(propagate=lambda t, group: t.clone())
def _pass_along(t, group):
    """Each rank sends its tensor to the next rank of the group (global ranks) and receives the previous one's:
    send/recv, and isend/irecv waited on by the caller."""
    ranks = torch.distributed.get_process_group_ranks(group)
    me = ranks.index(torch.distributed.get_global_rank(group, group.rank()))
    out = torch.empty_like(t)
    nxt, prev = ranks[(me + 1) % len(ranks)], ranks[(me - 1) % len(ranks)]
    if me == 0:
        torch.distributed.send(t, dst=nxt, group=group)
        torch.distributed.recv(out, src=prev, group=group)
    else:
        got = torch.distributed.irecv(out, src=prev, group=group)
        got.wait()
        torch.distributed.isend(t, dst=nxt, group=group).wait()
    return out


def test_send_and_recv_on_a_process_group(mesh):
    # torch's send/recv wait on the Work they get, which the group had waited on already: a second wait of a
    # gloo send or recv never returned, and the remote function hung.
    by_gpus = mesh.process_group("gpus")
    with mesh.activate():
        got = _pass_along(_per_rank(mesh), by_gpus)
        for h in range(2):
            for g in range(2):
                torch.testing.assert_close(inspect(got, hosts=h, gpus=g), _local(h * 2 + (1 - g)))


@remote(propagate=lambda t, group, how, gloo: t.clone())
def _second_rank_skips_its_all_reduce(t, group, how, gloo):
    """On gpus=1 the all-reduce is skipped: the function raises before it (``how`` "raise") or returns without
    it ("return"). ``gloo``: a collective that goes through gloo (an all-gather into a list), summed after."""
    from monarch_tensor.actor import current_rank

    if current_rank()["gpus"] == 1:
        if how == "raise":
            raise ValueError("rank gpus=1 raises before its all-reduce")
        return t.clone()
    if gloo:
        parts = [torch.empty_like(t) for _ in range(group.size())]
        torch.distributed.all_gather(parts, t, group=group)
        return sum(parts)
    out = t.clone()
    torch.distributed.all_reduce(out, group=group)
    return out


@pytest.mark.parametrize("how", ["raise", "return"])
@pytest.mark.parametrize("gloo", [False, True])
def test_a_rank_that_skips_a_collective_fails_its_peers_call_and_the_next_reduce_is_right(mesh, how, gloo):
    # Collectives pair up by order: rank gpus=0's all-reduce paired with gpus=1's next collective (the reduce_
    # below), and both results were wrong without an error; with "raise", gpus=0 then waited in the reduce
    # until the collective timeout, as it did in a call with no collective after it.
    _skips_a_collective(mesh, how, gloo)


@pytest.fixture(scope="module")
def mesh_across_hosts():
    """Procs whose groups have no shared memory, as procs on different hosts: every collective through gloo."""
    from monarch_tensor.actor import proc_mesh

    m = proc_mesh(hosts=2, gpus=2, env={"MONARCH_TENSOR_NO_SHM_REDUCE": "1"})
    yield m
    m.stop()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("how", ["raise", "return"])
def test_across_hosts_a_rank_that_skips_a_collective_fails_its_peers_call_and_the_next_reduce_is_right(
        mesh_across_hosts, how):
    # Through gloo alone the same happened: wrong values, or gpus=0 waiting for the collective timeout. Each
    # collective is now tagged first, with frames on TCP connections of the group's own (CrossHostTags).
    _skips_a_collective(mesh_across_hosts, how, False)


@remote(propagate=lambda t, group: t.clone())
def _ranks_differ_in_their_collective(t, group):
    """gpus=0 all-reduces where gpus=1 all-gathers: code that branches on the rank."""
    from monarch_tensor.actor import current_rank

    out = t.clone()
    if current_rank()["gpus"] == 0:
        torch.distributed.all_reduce(out, group=group)
    else:
        torch.distributed.all_gather([torch.empty_like(t) for _ in range(group.size())], t, group=group)
    return out


@pytest.mark.timeout(120)
def test_across_hosts_ranks_that_run_different_collectives_at_one_point_both_fail(mesh_across_hosts):
    # Through gloo alone, an all-reduce paired with an all-gather: wrong values, or a proc died (SIGABRT).
    by_gpus = mesh_across_hosts.process_group("gpus")
    with mesh_across_hosts.activate():
        a = _ranks_differ_in_their_collective(_per_rank(mesh_across_hosts), by_gpus)
        z = _all_reduce(_per_rank(mesh_across_hosts), by_gpus)  # the group is still in step
        for h in range(2):
            for g in range(2):
                with pytest.raises(RemoteException, match="runs another collective here than this member"):
                    inspect(a, hosts=h, gpus=g)
                torch.testing.assert_close(inspect(z, hosts=h, gpus=g), _local(2 * h) + _local(2 * h + 1))


@remote(propagate=lambda t, group: t.clone())
def _group_rank_added(t, group):
    return t + group.rank()  # (given the group, no collective on it)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("hosts", ["one host", "across hosts"])
def test_many_calls_given_a_group_without_a_collective_then_one_with(mesh, mesh_across_hosts, hosts):
    # Each call given a group tells the group's members when it ends; on one host that was a datagram, which a
    # member reads only in a collective of the group: the host queues 10, and the 11th call blocked its proc for
    # good (the fetch below timed out).
    m = mesh if hosts == "one host" else mesh_across_hosts
    by_gpus = m.process_group("gpus")
    with m.activate():
        x = _per_rank(m)
        for _ in range(30):
            x = _group_rank_added(x, by_gpus)
        z = _all_reduce(x, by_gpus)
        for h in range(2):
            torch.testing.assert_close(inspect(z, hosts=h, gpus=0), _local(2 * h) + _local(2 * h + 1) + 30)


def _skips_a_collective(mesh, how, gloo):
    by_gpus = mesh.process_group("gpus")
    with mesh.activate():
        x = _per_rank(mesh)
        a = _second_rank_skips_its_all_reduce(x, by_gpus, how, gloo)
        y = _per_rank(mesh) * 3
        y.reduce_("gpus", "sum")
        z = _all_reduce(_per_rank(mesh), by_gpus)  # the group is still in step
        alone = _second_rank_skips_its_all_reduce(x, by_gpus, how, gloo)  # no collective after it: at once too
        with pytest.raises(RemoteException, match="member 1 of this group ended this call"):
            inspect(alone, hosts=0, gpus=0)
        for h in range(2):
            for g in range(2):
                torch.testing.assert_close(inspect(y, hosts=h, gpus=g), (_local(2 * h) + _local(2 * h + 1)) * 3)
                torch.testing.assert_close(inspect(z, hosts=h, gpus=g), _local(2 * h) + _local(2 * h + 1))
            with pytest.raises(RemoteException, match="member 1 of this group ended this call"):
                inspect(a, hosts=h, gpus=0)
            if how == "raise":
                with pytest.raises(RemoteException, match="raises before its all-reduce"):
                    inspect(a, hosts=h, gpus=1)
            else:
                torch.testing.assert_close(inspect(a, hosts=h, gpus=1), _local(2 * h + 1))


@remote(propagate=lambda t, group: (t.new_empty(2 * t.numel()), t.new_empty(t.numel() // 2), t.clone(), t.clone()))
def _newer_collectives(t, group):
    """torch 2.13's all_gather_into_tensor / reduce_scatter_tensor (all_gather_single, reduce_scatter_single on
    the group), monitored_barrier, a functional collective, which finds the group by its name, and an
    all-to-all in equal parts."""
    import torch.distributed._functional_collectives as funcol

    gathered = t.new_empty(2 * t.numel())
    torch.distributed.all_gather_into_tensor(gathered, t, group=group)
    scattered = t.new_empty(t.numel() // 2)
    torch.distributed.reduce_scatter_tensor(scattered, t.clone(), group=group)
    torch.distributed.monitored_barrier(group=group)
    exchanged = torch.empty_like(t)
    torch.distributed.all_to_all_single(exchanged, t, group=group)
    return gathered, scattered, funcol.all_reduce(t, "sum", group), exchanged


@remote(propagate=lambda t, group: t.clone())
def _broadcast_after_a_destroy(t, group):
    import torch.distributed.distributed_c10d as c10d

    c10d._world.pg_map.clear()  # what the script's own dist.destroy_process_group() does to torch's registry
    c10d._world.pg_group_ranks.clear()
    return t


def test_newer_collectives_and_a_group_after_the_scripts_destroy_process_group():
    # They failed ('No backend type associated with device type cpu', 'Could not resolve the process group
    # registered under the name'); after an actor's dist.destroy_process_group() on the same procs, calls
    # naming global ranks failed on the engine's group ('is not registered').
    procs = this_host().spawn_procs({"gpus": 2})
    try:
        pg = procs.process_group("gpus")
        with procs.activate():
            x = procs.rank("gpus").float() * 10 + torch.arange(4.)
            gathered, scattered, summed, exchanged = _newer_collectives(x, pg)
            for r in range(2):
                assert inspect(gathered, gpus=r).tolist() == [0, 1, 2, 3, 10, 11, 12, 13]
                assert inspect(scattered, gpus=r).tolist() == [[10, 12], [14, 16]][r]
                assert inspect(summed, gpus=r).tolist() == [10, 12, 14, 16]
                assert inspect(exchanged, gpus=r).tolist() == [[0, 1, 10, 11], [2, 3, 12, 13]][r]
            inspect(_broadcast_after_a_destroy(x, pg), gpus=0)
            assert inspect(_broadcast_from(x, pg, 1), gpus=0).tolist() == [10, 11, 12, 13]
    finally:
        procs.stop()


def test_process_group_on_another_stream_and_on_a_slice(mesh):
    comms = Stream("pg_comms")
    half = mesh.slice(hosts=1)
    pg_half = half.process_group("gpus")
    with half.activate():
        y = half.rank_tensor("gpus").to(torch.float32) + 1
        on_slice = _all_reduce(y.clone(), pg_half)
        got_slice = [inspect(on_slice, gpus=g).item() for g in range(2)]
    pg = mesh.process_group("gpus")
    with comms.activate(), mesh.activate():
        x = mesh.rank_tensor("gpus").to(torch.float32) * 10
        on_comms = _all_reduce(x.clone(), pg)
        got_comms = inspect(on_comms, hosts=0, gpus=1).item()
    assert got_slice == [3.0, 3.0] and got_comms == 10.0


class _Holder(Actor):
    @endpoint(propagate=lambda t, group: t)
    def take(self, t, group):
        return t


def test_process_group_misuse_is_a_clear_error(mesh):
    with pytest.raises(ValueError, match=r"no dimension\(s\) \['gpu'\]"):
        mesh.process_group("gpu")
    with pytest.raises(TypeError, match="dimension name"):
        mesh.process_group(3)
    with pytest.raises(ValueError, match="named twice"):
        mesh.process_group(("gpus", "gpus"))
    pg = mesh.process_group("hosts")
    with pytest.raises(TypeError, match="cannot be pickled"):
        import pickle

        pickle.dumps(pg)
    with mesh.slice(hosts=0).activate():  # groups (0, 2) and (1, 3) cut in half
        x = torch.ones(2)
        with pytest.raises(ValueError, match="only part of the group"):
            _all_reduce(x, pg)
    half = mesh.slice(hosts=0)
    with mesh.activate():  # a group of the slice, called on the whole mesh: ranks 2 and 3 have none
        x = torch.ones(2)
        with pytest.raises(ValueError, match="outside the mesh the group was made on"):
            _all_reduce(x, half.process_group("gpus"))
    holder = mesh.spawn("pg_holder", _Holder)
    with mesh.activate():
        x = torch.ones(2)
        with pytest.raises(TypeError, match="not of actor endpoints"):
            holder.take.call(x, pg)
        with pytest.raises(TypeError, match="not of actor endpoints"):
            holder.take.rref(x, pg)
    with pytest.raises(TypeError, match="cannot be pickled"):
        holder.take.call(1, pg)
    other = this_host().spawn_procs({"gpus": 2})
    try:
        with other.activate():
            y = torch.ones(2)
            with pytest.raises(ValueError, match="another proc mesh"):
                _all_reduce(y, mesh.process_group("gpus"))
    finally:
        other.stop()


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


def _fail_on_rank(x, rank_t, bad_rank):
    if int(rank_t) == bad_rank:
        raise ValueError(f"rank {bad_rank} fails on purpose")
    return x * 1


def test_a_collective_whose_input_failed_on_one_rank_fails_on_every_rank_without_waiting(mesh):
    # Before, the other members waited in the collective for the failed one until the collective timeout
    # (300 s), and the group was broken after.
    fail = remote(_fail_on_rank, propagate=lambda x, r, b: x)
    with mesh.activate():
        x = _per_rank(mesh)
        y = fail(x, mesh.rank_tensor("gpus") + 2 * mesh.rank_tensor("hosts"), 1)  # fails on rank 1 only
        z = y.reduce("gpus", "sum")
        with pytest.raises(RemoteException, match="its input failed on another rank of the group \\(0, 1\\)"):
            fetch_shard(z, hosts=0, gpus=0).result(timeout=60)
        with pytest.raises(RemoteException, match="rank 1 fails on purpose"):
            fetch_shard(z, hosts=0, gpus=1).result(timeout=60)
        other_group = fetch_shard(z, hosts=1, gpus=0).result(timeout=60)  # ranks 2 and 3 had their inputs
        again = fetch_shard(x.reduce("gpus", "sum"), hosts=0, gpus=0).result(timeout=60)
        stacked = y.reduce("gpus", "stack")  # (an all-gather, through shared memory on one host: the same flag)
        with pytest.raises(RemoteException, match="its input failed on another rank of the group \\(0, 1\\)"):
            fetch_shard(stacked, hosts=0, gpus=0).result(timeout=60)
        other_stack = fetch_shard(stacked, hosts=1, gpus=1).result(timeout=60)
    torch.testing.assert_close(other_group, _local(2) + _local(3))
    torch.testing.assert_close(again, _local(0) + _local(1))
    torch.testing.assert_close(other_stack, torch.stack([_local(2), _local(3)]))


def test_collectives_on_two_streams_keep_to_their_own_tensors(mesh):
    # The streams' threads used one process group: their collectives interleaved differently on each
    # rank, and a rank's tensor of one stream was summed with another rank's of the other (or hung).
    comms = Stream("comms_collectives")
    with mesh.activate():
        r = mesh.rank_tensor("gpus").to(torch.float32)
        a = torch.ones(1000) * (r + 1)
        b = torch.ones(1000) * (r + 1) * 100
        bb, borrow = comms.borrow(b)
        on_main, on_comms = [], []
        for _ in range(5):
            on_main.append(a.reduce("gpus", "sum"))
            with comms.activate():
                on_comms.append(bb.reduce("gpus", "sum").sum())
        main_sums = [inspect(t.sum(), hosts=0, gpus=0).item() for t in on_main]
        with comms.activate():
            comms_sums = [inspect(t, hosts=1, gpus=1).item() for t in on_comms]
        borrow.drop()
    assert main_sums == [3000.0] * 5 and comms_sums == [300000.0] * 5


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


def test_borrow_rules_are_enforced_and_a_dropped_borrow_is_refused_everywhere(mesh):
    from monarch_tensor.controller.errors import BorrowError

    comms = Stream("comms_rules")
    other = this_host().spawn_procs(per_host={"hosts": 2, "gpus": 2})
    try:
        with mesh.activate():
            x = _per_rank(mesh)
            bx, borrow = comms.borrow(x)
            with pytest.raises(BorrowError, match="lent to stream"):
                x.add_(1)  # the original cannot be written while lent
            with pytest.raises(BorrowError, match="lent to stream"):
                x.reduce_("gpus")
            with comms.activate():
                with pytest.raises(BorrowError, match="mutable=False"):
                    bx.mul_(2)
                s = bx * 2  # reading is fine
            borrow.drop()
            x.add_(1)  # writable again
            for use in (lambda t: fetch_shard(t).result(timeout=60), inspect, lambda t: t.to_mesh(other),
                        lambda t: t.reduce("gpus"), lambda t: t.slice_mesh(gpus=0), comms.borrow):
                with pytest.raises(BorrowError, match="was dropped"):  # these used to hang, or fail later
                    use(bx)
            with comms.activate():
                got_s = inspect(s, hosts=0, gpus=1)
            got_x = inspect(x, hosts=0, gpus=1)
            y = _per_rank(mesh) * 3
            by, b2 = comms.borrow(y, mutable=True)
            del y
            gc.collect()  # the borrow keeps the lent tensor alive for the other stream
            with comms.activate():
                by.add_(1)
                got_by = inspect(by, hosts=1, gpus=0)
            b2.drop()
            del by, bx, s
            gc.collect()
            stats = worker_stats(mesh)  # dropped borrows' tensors send no deletes of their own
    finally:
        other.stop()
    torch.testing.assert_close(got_s, _local(1) * 2)
    torch.testing.assert_close(got_x, _local(1) + 1)
    torch.testing.assert_close(got_by, _local(2) * 3 + 1)
    assert stats["borrows"] == 0


def test_mixing_streams_in_a_fetch_and_local_targets_are_clear_errors(mesh):
    comms = Stream("comms_mixing")
    with mesh.activate():
        x = _per_rank(mesh)
        bx, borrow = comms.borrow(x)
        with comms.activate():
            s = bx * 10
        with pytest.raises(MeshTensorError, match="different streams \\('main' and 'comms_mixing'\\)"):
            fetch_shard((x, s))
        with pytest.raises(MeshTensorError, match="different streams"):
            remote(lambda a, b: a + b, propagate=lambda a, b: a)(x, s)
        with no_mesh():
            local = torch.zeros(tuple(x.shape))
        with pytest.raises(MeshTensorError, match="a local tensor cannot receive the result"):
            local.copy_(x)
        with pytest.raises(MeshTensorError, match="ranks hold different values.*fetch_shard"):
            x.tolist()
        assert inspect(torch.ones(2, 3).t()).shape == (3, 2)  # a strided reply unpickles inside activate()
        borrow.drop()


def _fails(t):
    raise ValueError("written wrong")


fails = remote(_fails, propagate=lambda t: t.clone())


def test_borrow_rules_hold_for_views_and_bases(mesh):
    # Only writes to the very tensor were refused: through a view of it, to its base, or through a view of a
    # read-only borrow, they went through and changed memory the other stream was using.
    from monarch_tensor.controller.errors import BorrowError

    comms = Stream("comms_views")
    with mesh.activate():
        w = torch.ones(4)
        v = w[1:]  # a view made before the loan
        _, lent = comms.borrow(w, mutable=True)
        for write in (lambda: w[0].fill_(9), lambda: w.view(2, 2).mul_(2), lambda: v.add_(1)):
            with pytest.raises(BorrowError, match="lent to stream"):
                write()
        lent.drop()
        v.add_(1)  # writable again, through every view
        q = torch.ones(3)
        bq, read_only = comms.borrow(q)
        with comms.activate():
            with pytest.raises(BorrowError, match="mutable=False"):
                bq[:1].add_(5)
        read_only.drop()
        z = torch.ones(4)
        _, part = comms.borrow(z[:2], mutable=True)
        with pytest.raises(BorrowError, match="lent to stream"):
            z.mul_(10)  # the base of a lent view
        part.drop()
        z.mul_(10)
        assert inspect(w).tolist() == [1.0, 2.0, 2.0, 2.0] and inspect(q).tolist() == [1.0, 1.0, 1.0]
        assert inspect(z).tolist() == [10.0] * 4


def test_a_failure_written_into_a_mutable_borrow_reaches_the_lender(mesh):
    """An op that writes a mutably borrowed tensor and fails leaves the failure in the lender's tensor after
    the drop, as it would on the lender's own stream (it came back with its old value and no error, while a
    successful write did show)."""
    side = Stream("side_failures")
    with mesh.activate():
        z = torch.ones(2)
        bz, borrow = side.borrow(z, mutable=True)
        with side.activate():
            bz.add_(fails(bz))
        borrow.drop()
        with pytest.raises(RemoteException, match="written wrong"):
            inspect(z)
        with pytest.raises(RemoteException, match="written wrong"):
            inspect(z + 1)  # and what is computed from it
        w = torch.ones(2)
        bw, borrow = side.borrow(w, mutable=True)
        with side.activate():
            bw.mul_(5)
        borrow.drop()
        assert inspect(w).tolist() == [5.0, 5.0]


def test_a_mutably_borrowed_tensor_cannot_be_read_until_the_drop(mesh):
    """Monarch's BORROWED: while another stream may write the lender's memory, the lender's stream cannot use
    it. Reads went through and saw the value from before or after the other stream's write, at random."""
    from monarch_tensor.controller.errors import BorrowError

    side = Stream("side_mutable_reads")
    with mesh.activate():
        y = torch.ones(64, 64)
        v = y[1:]  # a view made before the loan
        q = torch.ones(3)
        bq, read_only = side.borrow(q)
        yb, borrow = side.borrow(y, mutable=True)
        with side.activate():
            yb.mul_(2)
            yb.fill_(5.0)
        for use in (lambda: fetch_shard(y), lambda: y + 1, lambda: v.sum(), lambda: y[0], lambda: y.reduce("gpus"),
                    lambda: remote(lambda t: t, propagate=lambda t: t)(y), lambda: Stream("third").borrow(y)):
            with pytest.raises(BorrowError, match="with mutable=True"):
                use()
        with pytest.raises(BorrowError, match="lent to stream"):
            y.add_(1)
        with pytest.raises(BorrowError, match=r"lent to stream\(s\) \['side_mutable_reads'\] already"):
            side.borrow(q, mutable=True)  # the read-only borrow reads it meanwhile
        assert inspect(q + 1).tolist() == [2.0] * 3  # a read-only loan leaves it readable
        read_only.drop()
        borrow.drop()
        assert inspect(y).eq(5.0).all() and inspect(v.sum(), hosts=1, gpus=1).item() == 5.0 * 63 * 64


def test_a_borrow_garbage_collected_before_drop_drops_itself(mesh):
    """A Borrow deleted before drop() drops itself, with a warning (Monarch's), and orders the lender's stream
    after the other stream's work as drop() does. It stayed lent for good: the lender could never be written
    nor dropped again, and its reads raced the other stream's writes."""
    side = Stream("side_collected")
    with mesh.activate():
        for _ in range(5):
            y = torch.ones(256, 256)
            yb, borrow = side.borrow(y, mutable=True)
            with side.activate():
                for _ in range(5):
                    yb.mul_(1.0)
                yb.fill_(5.0)
            with pytest.warns(UserWarning, match="garbage-collected before borrow.drop"):
                del yb, borrow
                gc.collect()
            assert inspect(y, hosts=1, gpus=1).eq(5.0).all()  # after the other stream's write
        z = torch.ones(3)
        zb, borrow = side.borrow(z)
        with side.activate():
            w = zb * 2
        with pytest.warns(UserWarning, match="garbage-collected"):
            del zb, borrow, w
            gc.collect()
        z.add_(1)  # writable again
        assert inspect(z).tolist() == [2.0] * 3
        z.drop()
        assert worker_stats(mesh)["borrows"] == 0


@pytest.mark.timeout(60)
def test_a_borrow_collected_after_its_mesh_stopped_sends_nothing():
    procs = this_host().spawn_procs(per_host={"gpus": 1})
    side = Stream("side_stopped")
    with procs.activate():
        yb, borrow = side.borrow(torch.ones(2), mutable=True)
    client = procs._alloc._tensor_client
    procs.stop()
    with pytest.warns(UserWarning, match="garbage-collected"):
        del yb, borrow
        gc.collect()
    assert not client._late


def test_rank_of_several_dims_is_the_row_major_rank_within_them(mesh):
    """Monarch's ``mesh.rank(("hosts", "gpus"))``: the rank within those dims, in the order given."""
    names = list(mesh._shape.names)
    sizes = mesh._shape.sizes
    both = mesh.rank(names)
    reverse = mesh.rank(names[::-1])
    for i in range(len(mesh._shape)):
        coords = mesh._shape.point(i)
        where = dict(coords)
        assert inspect(both, **where).item() == coords[names[0]] * sizes[names[1]] + coords[names[1]]
        assert inspect(reverse, **where).item() == coords[names[1]] * sizes[names[0]] + coords[names[0]]
    with pytest.raises(KeyError, match="has no dimension 'nope'"):
        mesh.rank((names[0], "nope"))
