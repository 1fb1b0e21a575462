"""FSDP2-style data parallelism on a worker: a unit's sharded parameters all-gathered, its gradients reduce-scattered.

The controller's ``module_to_mesh`` keeps each parameter at rest as a DTensor
(``Shard(0)`` over the data-parallel mesh dim, replicated over the others; or
replicated everywhere where dim 0 is too small to shard). For one FSDP unit (a
transformer block, say) it runs these functions as one ``CallFunction`` each:

* ``unshard``: every parameter's whole value as a plain tensor (one
  all-gather per dtype over the data-parallel group, FSDP2's copy-in buffer:
  each rank's shards side by side, padded to equal chunks);
* ``reshard`` / ``unshard_into``: free those plain tensors' memory after the
  forward and gather again into the same memory before the backward
  (``reshard_after_forward``), so views of them stay valid;
* ``prefetch``: the next unit's all-gather started (asynchronously) while this
  unit computes; its ``unshard`` (or, in the backward, ``unshard_into``) then
  waits for it instead of gathering, as FSDP2's forward and backward prefetch. The gathered values are used only where every
  parameter is the same tensor at the same version as when the prefetch
  read it (an optimizer step or any in-place write in between makes
  ``unshard`` gather afresh), so a prefetch never hands out stale values;
* ``reduce_grads``: the plain per-rank gradients averaged over every rank of
  the mesh (a reduce-scatter over the data-parallel group, then an all-reduce
  over each other mesh dim), each rank keeping its shard: the parameter's
  gradient as a DTensor with the parameter's placements.

With a tensor-parallel plan the ops inside a unit run on DTensors, so a unit's
parameters are gathered over the data-parallel dim only, into DTensors
(``unshard_dist``: replicated over that dim, each other dim as the parameter's
placement, the tensor-parallel shards untouched), and their gradients, which
torch's sharding propagation leaves ``Partial`` over the dims that split the
batch or the contraction, are reduced for the whole unit at once
(``reduce_dist_grads``: one flat all-reduce per mesh dim and one flat
reduce-scatter per dim a parameter is ``Shard(0)`` on) instead of one
collective per gradient in each optimizer op that reads it.

The groups are the parameters' own DeviceMesh groups (``worker/dtensor.py``),
the ones their DTensor ops use: gloo on CPU, NCCL on GPU.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

# torch 2.13's names (the older ones warn there); older torch has only those
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _check(p, dp: str) -> tuple[int, bool]:
    """(index of the data-parallel mesh dim, whether ``p`` is sharded over it); anything else is refused."""
    if not isinstance(p, DTensor):
        raise TypeError(f"FSDP: a parameter on this worker is a {type(p).__name__}, not a DTensor")
    names = p.device_mesh.mesh_dim_names
    i = names.index(dp)
    for j, pl in enumerate(p.placements):
        if j == i and pl == Shard(0):
            continue
        if not isinstance(pl, Replicate):
            raise ValueError(f"FSDP: a parameter placed {tuple(p.placements)} on mesh dims {names}; it must be Shard(0) "
                             f"over {dp!r} (or replicated) and replicated over the other dims")
    return i, p.placements[i] == Shard(0)


def _row(p) -> int:
    """Elements per dim-0 row of ``p`` (a shard is whole rows: torch.chunk's split, as DTensor's)."""
    rest = 1
    for d in p.shape[1:]:
        rest *= d
    return rest


def _gather(params: Sequence, dp: str, dtype, async_op: bool = False):
    """Every parameter's whole value, as a new plain contiguous tensor of ``dtype`` (None: its own). With
    ``async_op``: a function that waits for the all-gathers (started now) and returns those tensors."""
    out: list = [None] * len(params)
    runs: dict = {}
    for k, p in enumerate(params):
        i, sharded = _check(p, dp)
        dt = dtype or p.dtype
        if sharded and p.device_mesh.size(i) > 1:
            runs.setdefault(dt, []).append(k)
        else:
            out[k] = p._local_tensor.to(dt, copy=True)
    started = []
    for dt, ks in runs.items():
        mesh = params[ks[0]].device_mesh
        i = mesh.mesh_dim_names.index(dp)
        n = mesh.size(i)
        sizes = []
        for k in ks:
            p = params[k]
            chunk = -(-p.shape[0] // n)
            sizes.append(chunk * _row(p))
        total = sum(sizes)
        local = params[ks[0]]._local_tensor
        send = torch.empty(total, dtype=dt, device=local.device)
        off = 0
        for k, size in zip(ks, sizes):
            shard = params[k]._local_tensor.reshape(-1)
            send[off:off + shard.numel()].copy_(shard)
            off += size
        recv = torch.empty(n * total, dtype=dt, device=local.device)
        work = _all_gather(recv, send, group=mesh.get_group(i), async_op=async_op)
        started.append((work, send, recv, n, total, ks, sizes))

    def finish() -> list[torch.Tensor]:
        for work, _send, recv, n, total, ks, sizes in started:
            if work is not None:
                work.wait()
            rows = recv.view(n, total)
            off = 0
            for k, size in zip(ks, sizes):
                p = params[k]
                whole = rows[:, off:off + size].reshape(-1)  # (a copy: the ranks' chunks in order)
                out[k] = whole[:p.numel()].view(p.shape)
                off += size
        return out

    return finish if async_op else finish()


# unshards (forward) and unshard_intos (backward) served by a prefetch; prefetches dropped as stale (tests read them)
stats = {"prefetched": 0, "regathers_prefetched": 0, "stale": 0, "dist_gathers": 0, "dist_reduces": 0}

# Prefetched all-gathers on this worker, per (parameters' ids, dtype): (the parameters, their versions when
# read, the function that waits and returns their whole values). One entry per unit at most.
_prefetched: dict = {}


def _versions(params: Sequence) -> tuple:
    """In-place writes so far: a DTensor op's (which bumps the DTensor's counter, not its local tensor's) and
    any of its local tensor (a checkpoint's load)."""
    return tuple((p._version, p._local_tensor._version) for p in params)


def prefetch(params: Sequence, dp: str, dtype=None) -> None:
    """Start ``unshard(params, dp, dtype)``'s all-gathers now; that ``unshard`` waits for them."""
    key = (tuple(map(id, params)), dtype)
    old = _prefetched.pop(key, None)
    if old is not None:  # (one its unshard never took: a forward that stopped early) finish it; it is stale
        old[2]()
        stats["stale"] += 1
    _prefetched[key] = (list(params), _versions(params), _gather(params, dp, dtype, async_op=True))


def unshard(params: Sequence, dp: str, dtype=None, _counter: str = "prefetched") -> list[torch.Tensor]:
    """The whole value of every DTensor parameter in ``params``, as plain tensors of ``dtype`` (None: its own):
    a prefetch's, where one was started and nothing has changed the parameters since."""
    got = _prefetched.pop((tuple(map(id, params)), dtype), None)
    if got is not None:
        before, versions, finish = got
        fulls = finish()  # (waited for even when stale: every rank started that collective)
        if all(a is b for a, b in zip(before, params)) and versions == _versions(params):
            stats[_counter] += 1
            return fulls
        stats["stale"] += 1
    return _gather(params, dp, dtype)


def reshard(fulls: Sequence[torch.Tensor]) -> None:
    """Free the memory of ``unshard``'s tensors (and of their views); ``unshard_into`` fills it again."""
    for f in fulls:
        f.untyped_storage().resize_(0)


def unshard_into(params: Sequence, fulls: Sequence[torch.Tensor], dp: str, dtype=None) -> None:
    """``unshard`` again, into the memory ``reshard`` freed (views of ``fulls`` see the values again); a
    prefetch's values where one was started (the backward's prefetch: see controller/fsdp.py)."""
    for f, new in zip(fulls, unshard(params, dp, dtype, "regathers_prefetched")):
        storage = f.untyped_storage()
        need = (f.storage_offset() + f.numel()) * f.element_size()
        if storage.nbytes() < need:
            storage.resize_(need)
        f.copy_(new)


def reduce_grads(grads: Sequence[torch.Tensor], params: Sequence, dp: str, reduce_dtype=None) -> list[DTensor]:
    """Each gradient (a plain tensor of its parameter's whole shape, this rank's) averaged over every rank of the
    mesh, as a DTensor with its parameter's placements and dtype: a reduce-scatter over ``dp`` (one per dtype,
    FSDP2's padded copy-in layout), then an all-reduce over each other mesh dim; replicated parameters'
    gradients all-reduced over every dim."""
    out: list = [None] * len(params)
    runs: dict = {}
    for k, (g, p) in enumerate(zip(grads, params)):
        i, sharded = _check(p, dp)
        if tuple(g.shape) != tuple(p.shape):
            raise ValueError(f"FSDP: a gradient of shape {tuple(g.shape)} for a parameter of shape {tuple(p.shape)}")
        runs.setdefault((reduce_dtype or g.dtype, sharded and p.device_mesh.size(i) > 1), []).append(k)
    for (rd, sharded), ks in runs.items():
        mesh = params[ks[0]].device_mesh
        i = mesh.mesh_dim_names.index(dp)
        n = mesh.size(i)
        device = grads[ks[0]].device
        if sharded:
            sizes = [-(-params[k].shape[0] // n) * _row(params[k]) for k in ks]
            total = sum(sizes)
            send = torch.zeros(n, total, dtype=rd, device=device)
            off = 0
            for k, size in zip(ks, sizes):
                g = grads[k].reshape(-1)
                padded = torch.zeros(n * size, dtype=rd, device=device)
                padded[:g.numel()].copy_(g)
                send[:, off:off + size].copy_(padded.view(n, size))
                off += size
            flat = torch.empty(total, dtype=rd, device=device)
            _reduce_scatter(flat, send.view(-1), group=mesh.get_group(i))
            others = [d for d in range(mesh.ndim) if d != i]
        else:
            flat = torch.cat([grads[k].reshape(-1).to(rd) for k in ks])
            others = list(range(mesh.ndim))
        for d in others:
            if mesh.size(d) > 1:
                dist.all_reduce(flat, group=mesh.get_group(d))
        flat.div_(mesh.size())
        me = mesh.get_local_rank(i)
        off = 0
        for k in ks:
            p = params[k]
            if sharded:
                chunk = -(-p.shape[0] // n)
                rows = max(0, min(chunk, p.shape[0] - me * chunk))
                local = flat[off:off + rows * _row(p)].view(rows, *p.shape[1:])
                off += chunk * _row(p)
            else:
                local = flat[off:off + p.numel()].view(p.shape)
                off += p.numel()
            out[k] = DTensor.from_local(local.to(p.dtype), mesh, p.placements, run_check=False,
                                        shape=p.shape, stride=p.stride())
    return out


def _dp_replicated(p, dp: str) -> tuple:
    """``p``'s placements with the data-parallel dim replicated (what ``unshard_dist`` gathers it into)."""
    i = p.device_mesh.mesh_dim_names.index(dp)
    return tuple(Replicate() if j == i else pl for j, pl in enumerate(p.placements))


def unshard_dist(params: Sequence, dp: str) -> list[DTensor]:
    """Each DTensor parameter replicated over ``dp`` (its other dims' placements kept), as a new DTensor: the
    ``Shard(0)``-over-``dp`` ones all-gathered (one all-gather per dtype, as ``unshard``), the others the same
    local values (no copy, no collective)."""
    stats["dist_gathers"] += 1
    sharded = [k for k, p in enumerate(params) if p.placements[p.device_mesh.mesh_dim_names.index(dp)] == Shard(0)]
    fulls = _gather([params[k] for k in sharded], dp, None) if sharded else []
    local = {k: f for k, f in zip(sharded, fulls)}
    out = []
    for k, p in enumerate(params):
        value = local.get(k)
        if value is None:
            value = p._local_tensor.view_as(p._local_tensor)
        out.append(DTensor.from_local(value, p.device_mesh, _dp_replicated(p, dp), run_check=False,
                                      shape=p.shape, stride=p.stride()))
    return out


def _partial_sum(pl) -> bool:
    return isinstance(pl, Partial) and pl.reduce_op == "sum"


def reduce_dist_grads(grads: Sequence, params: Sequence) -> list[DTensor]:
    """Each DTensor gradient redistributed to its parameter's placements (and dtype). ``Partial(sum)`` dims
    whose target is ``Replicate`` are summed by one flat all-reduce per (mesh dim, dtype) for all the
    gradients; then those whose target is ``Shard(0)`` by one flat reduce-scatter per (mesh dim, dtype)
    (FSDP2's padded layout). A gradient needing anything else is redistributed by DTensor on its own."""
    stats["dist_reduces"] += 1
    n = len(params)
    out: list = [None] * n
    locals_: list = [None] * n
    todo: list = []  # (k, [(mesh dim, "replicate" or "shard")])
    for k, (g, p) in enumerate(zip(grads, params)):
        if not isinstance(g, DTensor):
            raise TypeError(f"a gradient on this worker is a {type(g).__name__}, not a DTensor")
        if tuple(g.shape) != tuple(p.shape):
            raise ValueError(f"a gradient of shape {tuple(g.shape)} for a parameter of shape {tuple(p.shape)}")
        cur, want = tuple(g.placements), tuple(p.placements)
        if cur == want:
            out[k] = g if g.dtype == p.dtype else g.to(p.dtype)
            continue
        steps = []
        batched = g.device_mesh == p.device_mesh
        for d, (c, w) in enumerate(zip(cur, want)):
            if c == w:
                continue
            if _partial_sum(c) and isinstance(w, Replicate):
                steps.append((d, "replicate"))
            elif _partial_sum(c) and w == Shard(0) and not any(
                    isinstance(x, Shard) and x.dim == 0 for j, x in enumerate(cur + want) if j % len(cur) != d):
                steps.append((d, "shard"))
            else:
                batched = False
        if not batched or sum(kind == "shard" for _, kind in steps) > 1:
            out[k] = g.redistribute(p.device_mesh, want).to(p.dtype)
            continue
        locals_[k] = g._local_tensor
        todo.append((k, steps))
    if todo:
        mesh = params[todo[0][0]].device_mesh
        for kind in ("replicate", "shard"):
            for d in range(mesh.ndim):
                ks = [k for k, steps in todo if (d, kind) in steps]
                by_dtype: dict = {}
                for k in ks:
                    by_dtype.setdefault(locals_[k].dtype, []).append(k)
                for dt, group in by_dtype.items():
                    if kind == "replicate":
                        flat = torch.cat([locals_[k].reshape(-1) for k in group])
                        dist.all_reduce(flat, group=mesh.get_group(d))
                        off = 0
                        for k in group:
                            m = locals_[k].numel()
                            locals_[k] = flat[off:off + m].view(locals_[k].shape)
                            off += m
                    else:
                        _reduce_scatter_rows([locals_[k] for k in group], mesh, d, dt, group, locals_)
        for k, _ in todo:
            p = params[k]
            out[k] = DTensor.from_local(locals_[k].to(p.dtype), p.device_mesh, p.placements, run_check=False,
                                        shape=p.shape, stride=p.stride())
    return out


def _reduce_scatter_rows(values: list, mesh, d: int, dtype, ks: list, into: list) -> None:
    """Sum ``values`` (whole dim 0 each) over mesh dim ``d``, each rank keeping its ``torch.chunk`` rows of dim 0:
    one reduce-scatter of the padded chunks side by side; the results go to ``into[k]``."""
    n = mesh.size(d)
    sizes = [-(-v.shape[0] // n) * _row(v) for v in values]
    total = sum(sizes)
    device = values[0].device
    send = torch.zeros(n, total, dtype=dtype, device=device)
    off = 0
    for v, size in zip(values, sizes):
        padded = torch.zeros(n * size, dtype=dtype, device=device)
        padded[:v.numel()].copy_(v.reshape(-1))
        send[:, off:off + size].copy_(padded.view(n, size))
        off += size
    flat = torch.empty(total, dtype=dtype, device=device)
    _reduce_scatter(flat, send.view(-1), group=mesh.get_group(d))
    me = mesh.get_local_rank(d)
    off = 0
    for k, v, size in zip(ks, values, sizes):
        chunk = -(-v.shape[0] // n)
        rows = max(0, min(chunk, v.shape[0] - me * chunk))
        into[k] = flat[off:off + rows * _row(v)].view(rows, *v.shape[1:])
        off += size
