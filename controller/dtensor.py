"""Global sharded tensors: ``distribute``, ``redistribute``, ``full_tensor``, ``to_local``, ``from_local``.

A distributed tensor is an ordinary mesh ``Tensor`` whose metadata is the
GLOBAL shape and which carries ``_dist`` (its proc mesh and placements). On
every proc of the mesh its ref holds a ``torch.distributed.tensor.DTensor``
(``worker/dtensor.py``), so the aten ops the controller records on the global
shape run on DTensors and torch's sharding propagation and redistribution do
the collectives. Autograd and ``torch.optim`` run on the controller as for any
mesh tensor; ``redistribute``, ``to_local`` and ``from_local`` are autograd
functions here, so gradients flow through them.

>>> procs = this_host().spawn_procs({"dp": 2})
>>> dt = distribute(torch.randn(1024, 1024), procs, sharding_spec=["dp", None])
>>> dt                       # no data moves
DTensor(shape=(1024, 1024), dtype=torch.float32, placements={dp: S(0)}, mesh={'dp': 2})
>>> (dt @ dt.T).full_tensor().shape
torch.Size([1024, 1024])
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from monarch_tensor.worker import messages as m
from torch.distributed.tensor import Partial, Placement, Replicate, Shard

from .client import user_loc
from .dtensor_methods import ACTIVE, DistInfo
from .placements import ShardingError, parse_placements, placements_str
from .tensor import Tensor, contiguous_meta, intern_meta, state

__all__ = ["Partial", "Replicate", "Shard", "ShardingError", "distribute", "from_local"]


# ---- the mesh as the workers see it --------------------------------------------------------------------
def _grid(shape) -> tuple:
    ranks = shape.ranks()

    def nest(dims, flat):
        if not dims:
            return flat[0]
        step = len(flat) // dims[0]
        return tuple(nest(dims[1:], flat[i * step:(i + 1) * step]) for i in range(dims[0]))

    return nest(list(shape.dims), ranks)


def _mesh_info(pm, placements) -> DistInfo:
    shape = pm._shape
    return DistInfo(pm, tuple(shape.names), tuple(shape.dims), _grid(shape), placements)


def _spec(ctx, info: DistInfo) -> tuple:
    return (ctx.client.store_addr, info.grid, info.names)


_rank_tensors: dict = {}


def _rank_tensor(ctx) -> Tensor:
    """Each proc's own rank as a 0-dim mesh tensor (how a worker function learns which proc it runs on)."""
    key = (id(ctx.client), ctx.ranks, ctx.sid)
    t = _rank_tensors.get(key)
    if t is None or t._ctx is not ctx:
        client = ctx.client
        ref = next(client.refs)
        client.issue(m.CreateRank(ref, {r: r for r in client.all_ranks}, ctx.sid), ctx.ranks)
        meta = contiguous_meta((), torch.int64)
        t = _rank_tensors[key] = Tensor(meta, intern_meta(meta), ctx, ref)
    return t


def _call(ctx, fn: str, args: tuple, shape, dtype, info: DistInfo | None) -> Tensor:
    """Run ``worker.dtensor.<fn>(*args)`` on every proc of ``ctx``; a new mesh tensor of ``shape`` holds it."""
    client = ctx.client
    wire = tuple(m.Ref(a._ref) if type(a) is Tensor else a for a in args)
    ref = next(client.refs)
    client.issue(m.CallFunction(f"monarch_tensor.worker.dtensor.{fn}", wire, {}, (ref,), (), ctx.sid, user_loc()), ctx.ranks)
    meta = contiguous_meta(tuple(shape), dtype)
    out = Tensor(meta, intern_meta(meta), ctx, ref)
    if info is not None:
        out._dist = info
        ACTIVE.n += 1
    return out


def require_dist(t, what: str) -> DistInfo:
    info = getattr(t, "_dist", None)
    if info is None:
        raise ShardingError(f"{what} needs a distributed tensor (made by distribute() or from_local()); "
                            f"got {'a mesh tensor' if isinstance(t, Tensor) else type(t).__name__}")
    return info


def _resolve_mesh(mesh, what: str):
    if mesh is None:
        mesh = state.ctx_mesh
        if mesh is None:
            raise ShardingError(f"{what}: no mesh given and none is active; pass one, or use `with procs.activate():`")
    if not hasattr(mesh, "_shape") or not hasattr(mesh, "_alloc"):
        raise ShardingError(f"{what}: {mesh!r} is not a proc mesh (this_host().spawn_procs(...))")
    return mesh


# ---- distribute / from_local ---------------------------------------------------------------------------------
def distribute(tensor: torch.Tensor, mesh=None, placements: Sequence[Placement] | Mapping | None = None, *,
               sharding_spec: Sequence | None = None) -> Tensor:
    """Lay ``tensor`` (a local tensor, or a mesh tensor equal on every rank) out over ``mesh``.

    ``placements``: one ``Shard(d)``/``Replicate()`` per mesh dim (or a dict by
    mesh dim name); ``sharding_spec``: one entry per tensor dim naming the mesh
    dim it is split over, or ``None``. Default: replicated. Each proc keeps only
    its shard; the result's shape is the global shape.

    >>> dt = distribute(torch.randn(8, 4), procs, [Shard(0), Replicate()])
    >>> dt = distribute(torch.randn(8, 4), procs, sharding_spec=["dp", None])
    """
    from .activation import ctx_for

    mesh = _resolve_mesh(mesh, "distribute")
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"distribute needs a torch.Tensor, got {type(tensor).__name__}")
    if getattr(tensor, "_dist", None) is not None:
        raise ShardingError("distribute: the tensor is already distributed; use t.redistribute(placements=...)")
    shape = mesh._shape
    places = parse_placements(shape.names, shape.dims, tensor.dim(), placements, sharding_spec)
    if any(isinstance(p, Partial) for p in places):
        raise ShardingError("distribute cannot make a Partial tensor from a whole one (every rank would hold "
                            "all of it); use from_local(shards, mesh, [Partial()])")
    ctx = ctx_for(mesh)
    info = _mesh_info(mesh, places)
    if type(tensor) is Tensor:
        if tensor._ctx.client is not ctx.client or tensor._ctx.ranks != ctx.ranks:
            raise ShardingError(f"distribute: the mesh tensor lives on {tensor.mesh._label()}, not on {mesh._label()}; "
                                f"move it with t.to_mesh(mesh)")
        src = tensor.detach()
    else:
        client = ctx.client
        ref = next(client.refs)
        client.issue(m.CreateValue(ref, tensor.detach().contiguous().clone(), ctx.sid), ctx.ranks)
        meta = contiguous_meta(tuple(tensor.shape), tensor.dtype)
        src = Tensor(meta, intern_meta(meta), ctx, ref)  # deleted on the workers when src goes away
    out = _call(ctx, "engine_distribute", (src, _rank_tensor(ctx), _spec(ctx, info), places),
                tensor.shape, tensor.dtype, info)
    if tensor.requires_grad:
        out.requires_grad_(True)
    return out


def _local_shapes(info: DistInfo, shape: tuple, places: tuple) -> set:
    """The set of local shard shapes over all mesh coordinates (torch.chunk semantics, as DTensor)."""
    import itertools

    out = set()
    for coord in itertools.product(*(range(n) for n in info.sizes)):
        local = list(shape)
        for c, n, p in zip(coord, info.sizes, places):
            if isinstance(p, Shard):
                size = local[p.dim]
                chunk = -(-size // n)
                local[p.dim] = max(0, min(chunk, size - c * chunk))
        out.add(tuple(local))
    return out


class _ToLocal(torch.autograd.Function):
    @staticmethod
    def forward(ctx_, t: Tensor, local_shape: tuple) -> Tensor:
        info = t._dist
        ctx_.info, ctx_.places, ctx_.gshape = info, placements_of(t), tuple(t.shape)
        return _call(t._ctx, "to_local", (t,), local_shape, t.dtype, None)

    @staticmethod
    def backward(ctx_, grad):
        return _from_local(grad, ctx_.info, ctx_.places, ctx_.gshape), None


def to_local(t: Tensor) -> Tensor:
    """Each rank's shard of ``t`` as an ordinary mesh tensor (all shards must have one shape)."""
    info = require_dist(t, "to_local")
    places = placements_of(t)
    shapes = _local_shapes(info, tuple(t.shape), places)
    if len(shapes) != 1:
        raise ShardingError(f"to_local: the shards of a {tuple(t.shape)} tensor placed {placements_str(places, info.names)} "
                            f"have different shapes {sorted(shapes)}, but a mesh tensor has one shape on every rank; "
                            f"redistribute first, or shard a dim divisible by the mesh size")
    return _ToLocal.apply(t, next(iter(shapes)))


def _from_local(local: Tensor, info: DistInfo, places: tuple, shape: tuple) -> Tensor:
    ctx = local._ctx
    stride = contiguous_meta(shape, local.dtype)[1]
    return _call(ctx, "engine_from_local", (local, _rank_tensor(ctx), _spec(ctx, info), places, shape, stride),
                 shape, local.dtype, DistInfo(info.mesh, info.names, info.sizes, info.grid, places))


class _FromLocal(torch.autograd.Function):
    @staticmethod
    def forward(ctx_, local: Tensor, info: DistInfo, places: tuple, shape: tuple) -> Tensor:
        ctx_.places = places
        return _from_local(local, info, places, shape)

    @staticmethod
    def forward_places(places: tuple) -> tuple:
        return tuple(Replicate() if isinstance(p, Partial) else p for p in places)

    @staticmethod
    def backward(ctx_, grad):
        if getattr(grad, "_dist", None) is None:
            raise ShardingError("from_local: the gradient reaching it is not a distributed tensor")
        target = _FromLocal.forward_places(ctx_.places)
        if placements_of(grad) != target:
            grad = _Redistribute.apply(grad, target)
        return to_local(grad), None, None, None


def from_local(local: Tensor, mesh=None, placements: Sequence[Placement] | Mapping | None = None, *,
               shape: Sequence[int] | None = None) -> Tensor:
    """A global tensor whose shard on each rank is ``local`` (a mesh tensor); no data moves.

    ``shape``: the global shape (default: the local shape scaled by the
    sharded mesh dims). ``Partial()`` placements mean the ranks' values sum to
    the global value.

    >>> dt = from_local(torch.ones(2, 4), procs, [Shard(0)])    # global (2 * n, 4)
    """
    mesh = _resolve_mesh(mesh, "from_local")
    if type(local) is not Tensor or local._dist is not None:
        raise ShardingError("from_local needs an ordinary (not distributed) mesh tensor made on the mesh")
    names, sizes = mesh._shape.names, mesh._shape.dims
    places = parse_placements(names, sizes, local.dim(), placements)
    if shape is None:
        g = list(local.shape)
        for n, p in zip(sizes, places):
            if isinstance(p, Shard):
                g[p.dim] *= n
        shape = tuple(g)
    info = _mesh_info(mesh, places)
    return _FromLocal.apply(local, info, places, tuple(shape))


# ---- redistribute / placements / full_tensor ---------------------------------------------------------------
class _Redistribute(torch.autograd.Function):
    @staticmethod
    def forward(ctx_, t: Tensor, places: tuple) -> Tensor:
        info = t._dist
        ctx_.src = placements_of(t)
        return _call(t._ctx, "redistribute", (t, places), t.shape, t.dtype,
                     DistInfo(info.mesh, info.names, info.sizes, info.grid, places))

    @staticmethod
    def backward(ctx_, grad):
        back = tuple(Replicate() if isinstance(p, Partial) else p for p in ctx_.src)
        if getattr(grad, "_dist", None) is None:
            return grad, None
        return _Redistribute.apply(grad, back), None


class _ReplicateOver(torch.autograd.Function):
    """``t`` replicated over one mesh dim, its other placements kept (decided on the workers, where they are
    known: no round trip). Redistributing keeps the global value, so the gradient is the output's, in any
    placement: as it comes (``grad_too=False``), or replicated over the same dim (torch's ``ColwiseParallel``
    input: the backward's ``Partial`` sums all-reduced there, once, rather than in whatever reads them next)."""

    @staticmethod
    def forward(ctx_, t: Tensor, dim: int, grad_too: bool) -> Tensor:
        ctx_.dim, ctx_.grad_too = dim, grad_too
        return _call(t._ctx, "replicate_over", (t, dim), t.shape, t.dtype, t._dist.derived())

    @staticmethod
    def backward(ctx_, grad):
        if ctx_.grad_too and getattr(grad, "_dist", None) is not None:
            grad = _ReplicateOver.apply(grad, ctx_.dim, False)
        return grad, None, None


def replicate_over(t: Tensor, dim: int, *, grad_too: bool = False) -> Tensor:
    """``t`` (a distributed tensor) made ``Replicate()`` over its mesh's dim ``dim`` (an index), the rest as it is:
    a ``Partial`` there all-reduced, a ``Shard`` all-gathered, a ``Replicate`` copied (torch's ``RowwiseParallel``
    output layout); ``grad_too``: its gradient replicated over that dim as well (``ColwiseParallel``'s input)."""
    require_dist(t, "replicate_over")
    return _ReplicateOver.apply(t, dim, grad_too)


def redistribute(t: Tensor, device_mesh=None, placements=None, *, sharding_spec=None) -> Tensor:
    """``t`` with new placements (``Shard``/``Replicate``); torch performs the collectives on the workers."""
    info = require_dist(t, "redistribute")
    if device_mesh is not None and device_mesh is not info.mesh and device_mesh._shape != info.mesh._shape:
        raise ShardingError(f"redistribute keeps the mesh {info.mesh._shape}; moving to {device_mesh._shape} "
                            f"is not supported (full_tensor() and distribute() again)")
    places = parse_placements(info.names, info.sizes, t.dim(), placements, sharding_spec)
    if any(isinstance(p, Partial) for p in places) and places != placements_of(t):
        raise ShardingError("redistribute to Partial() is not possible (torch: for internal use only); "
                            "use Shard(d) or Replicate()")
    return _Redistribute.apply(t, places)


def placements_of(t) -> tuple:
    """``t.placements``: known on the controller for tensors made here; asked from the first rank once otherwise."""
    info = require_dist(t, "placements")
    if info.placements is None:
        ctx = t._ctx
        rank = ctx.ranks[0]
        fut = ctx.client.request(rank, lambda port: m.FetchValue(((m.Ref(t._ref),), {}), "monarch_tensor.worker.dtensor.placements_of",
                                                                 port, ctx.sid, user_loc()))
        info.placements = tuple(fut.get())
    return info.placements


def full_tensor(t: Tensor) -> torch.Tensor:
    """The whole value of ``t`` on the controller (gathered on the workers, fetched from the first rank)."""
    from .fetching import fetch_shard

    require_dist(t, "full_tensor")
    with torch.no_grad():
        whole = _call(t._ctx, "full_tensor", (t,), t.shape, t.dtype, None)
    return fetch_shard(whole).result()  # the mesh's first rank


def dist_repr(t) -> str:
    info = t._dist
    places = info.placements if info.placements is not None else placements_of(t)
    grad = ", requires_grad=True" if t.requires_grad else ""
    return (f"DTensor(shape={tuple(t.shape)}, dtype={t.dtype}, placements={placements_str(places, info.names)}, "
            f"mesh={dict(zip(info.names, info.sizes))}{grad})")
