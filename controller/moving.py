"""Placing and moving mesh tensors: ``shard_batch`` (each rank's slice of a global batch), ``to_mesh`` (a copy
on another mesh, its gradient coming back), ``slice_mesh`` (a tensor on a slice of its mesh).

>>> x, y = shard_batch((x, y), "dp")
>>> h = to_mesh(h, stage2_procs)
"""

from __future__ import annotations

import itertools

import torch
from monarch_tensor.worker import messages as m
from torch.utils import _pytree as pytree

# activation imports torch_patches, which imports this module: its siblings in that cycle are imported as
# modules (their names are looked up at the call)
from . import activation
from .client import Ctx, user_loc
from .collectives import _groups
from .errors import MeshTensorError
from .streams import Stream
from .tensor import Tensor, check_live, check_readable, contiguous_meta, forget_value, intern_meta, state

RECV_TIMEOUT = 300.0


def shard_batch(batch, dims, mesh=None):
    """Each rank's own slice of a global batch: ``x, y = shard_batch((x, y), "dp")`` inside ``activate()``.

    ``batch``: a tensor or a pytree of them (a DataLoader's ``(inputs, targets)``) holding the whole global
    batch; each one's dim 0 is split in equal chunks over the ranks of the named ``dims`` (a name or a list
    of names), rank ``i`` along them getting chunk ``i``, as ``torch.chunk`` and ``DistributedSampler`` with
    ``shuffle=False`` order them; ranks that differ only along other dims get the same chunk. A local
    tensor's chunks travel to their ranks only; a mesh tensor (the same global batch on every rank) is
    sliced where it lives. ``mesh``: the mesh to put local tensors on (default: the active one).

    >>> for x, y in DataLoader(data, batch_size=64):  # doctest: +SKIP
    ...     x, y = shard_batch((x, y), "dp")          # 64 // dp rows on each dp rank
    """
    if isinstance(dims, str):
        dims = (dims,)
    elif not (isinstance(dims, (tuple, list)) and dims and all(isinstance(d, str) for d in dims)):
        raise TypeError(f"shard_batch's dims must be a dimension name or a list of them, such as 'dp', not {dims!r}")
    leaves, spec = pytree.tree_flatten(batch)
    if not leaves or not all(isinstance(x, torch.Tensor) for x in leaves):
        raise TypeError(f"shard_batch takes a tensor or tuples, lists and dicts of tensors, got {type(batch).__name__}")
    return pytree.tree_unflatten([_shard_one(x, tuple(dims), mesh) for x in leaves], spec)


def _shard_one(x, dims: tuple, mesh) -> Tensor:
    if type(x) is Tensor:
        if mesh is not None and mesh is not x._ctx.pm:
            raise MeshTensorError("shard_batch(mesh=...) places local tensors; this one is a mesh tensor already "
                                  "(move it with to_mesh)")
        pm = x._ctx.pm
    else:
        pm = mesh if mesh is not None else state.ctx_mesh
        if pm is None:
            raise MeshTensorError("shard_batch: no mesh to put the batch on: call it inside `with procs.activate():` "
                                  "or pass mesh=procs")
        if isinstance(x, Tensor) or x.device.type == "meta" or type(x) not in (torch.Tensor, torch.nn.Parameter):
            raise MeshTensorError(f"shard_batch takes plain local tensors or mesh tensors, not {type(x).__name__} "
                                  f"on {x.device}")
    shape = pm._shape
    groups = _groups(shape, dims)
    n = len(groups[0])
    if x.dim() == 0 or x.shape[0] % n:
        raise ValueError(f"shard_batch over {dims} ({n} ranks) needs tensors whose dim 0 divides by {n}, got shape "
                         f"{tuple(x.shape)}: pick a batch size that is a multiple of {n} (drop_last=True drops a "
                         f"short last batch)")
    index = {r: j for g in groups for j, r in enumerate(g)}  # each rank's chunk
    ctx = activation.ctx_for(pm)
    client = ctx.client
    rows = x.shape[0] // n
    if type(x) is Tensor:
        ref = next(client.refs)
        client.issue(m.CreateRank(ref, index, ctx.sid), ctx.ranks)
        meta = contiguous_meta((), torch.int64)
        which = Tensor(meta, intern_meta(meta), ctx, ref)
        return x.reshape(n, rows, *x.shape[1:]).index_select(0, which.reshape(1)).reshape(rows, *x.shape[1:])
    chunks = x.detach().reshape(n, rows, *x.shape[1:])
    ref = next(client.refs)
    for r in ctx.ranks:  # one upload per rank, each its own chunk (a message each)
        client.issue(m.CreateValue(ref, chunks[index[r]].clone(), ctx.sid), (r,))
    meta = contiguous_meta((rows, *x.shape[1:]), x.dtype)
    return Tensor(meta, intern_meta(meta), ctx, ref)


_xfers = itertools.count(1)


def _tree_of_mesh_tensors(fn, tensors, what: str):
    """``fn`` applied to every mesh tensor of a pytree (a tensor, or lists, tuples and dicts of them, as
    Monarch's ``to_mesh`` and ``slice_mesh`` take); other leaves stay, but a local torch tensor is an error."""
    def one(leaf):
        if type(leaf) is Tensor:
            return fn(leaf)
        if isinstance(leaf, torch.Tensor):
            raise TypeError(f"{what} moves mesh tensors; this one is a local torch tensor (of shape "
                            f"{tuple(leaf.shape)}): make it inside `with procs.activate():`")
        return leaf

    return pytree.tree_map(one, tensors)


def slice_mesh(tensors, **kwargs):
    """Each mesh tensor of ``tensors`` (a tensor or a pytree of them) on a slice of its mesh (the ranks of the
    slice keep their data): ``slice_mesh(t, gpus=0)``, ``slice_mesh({"w": w, "b": b}, hosts=1)``."""
    return _tree_of_mesh_tensors(lambda t: _slice_mesh(t, **kwargs), tensors, "slice_mesh")


def to_mesh(tensors, mesh, stream: Stream | None = None):
    """Copy each mesh tensor of ``tensors`` (a tensor or a pytree of them) to ``mesh`` (same sizes): rank i of
    a tensor's mesh sends to rank i of ``mesh``; ``stream`` (default: the tensor's) orders it there."""
    return _tree_of_mesh_tensors(lambda t: _to_mesh(t, mesh, stream), tensors, "to_mesh")


def _slice_mesh(t: Tensor, **kwargs) -> Tensor:
    """``t`` on a slice of its mesh (the ranks of the slice keep their data)."""
    check_live(t._ctx, "slice_mesh")
    check_readable("slice_mesh", (t,))
    ctx = t._ctx
    sub = ctx.pm.slice(**kwargs)
    forget_value(t)  # the slice shares its memory
    sctx = sub._alloc._tensor_client.ctx(sub, ctx.stream)
    ref = next(ctx.client.refs)
    ctx.client.issue(m.CallOp("aten::alias", (t._ref,), {}, (0,), (ref,), (), ctx.sid, user_loc()), sctx.ranks)
    return Tensor(t._meta, t._mid, sctx, ref)


def _to_mesh(t: Tensor, mesh, stream: Stream | None = None) -> Tensor:
    """Copy ``t`` to ``mesh``: rank i of ``t``'s mesh sends to rank i of ``mesh`` (same sizes), or each rank of
    ``mesh`` gets the value of the rank of ``t``'s mesh at its coordinates on their shared dims (``mesh`` has
    more dims: a broadcast, see ``_to_mesh_pairs``). The gradient of a ``t`` that requires grad goes back the
    same way (``_ToMesh``)."""
    if type(t) is not Tensor:
        raise TypeError(f"to_mesh needs a mesh tensor, got {type(t).__name__}")
    from monarch_tensor.hosts.host import ProcMesh

    if not isinstance(mesh, ProcMesh):
        raise TypeError(f"to_mesh needs a proc mesh to copy to, such as this_host().spawn_procs(...), "
                        f"not {type(mesh).__name__} {mesh!r}")
    check_live(t._ctx, "to_mesh")
    check_readable("to_mesh", (t,))
    src = t._ctx
    pairs = _to_mesh_pairs(src.pm._shape, mesh._shape)
    if stream is not None and not isinstance(stream, Stream):
        raise TypeError(f"to_mesh(stream=...) takes a Stream, got {stream!r}")
    dst = activation.ctx_for(mesh, stream or src.stream)
    if not (t.requires_grad and torch.is_grad_enabled()):
        return _send_to_mesh(t, dst, pairs)
    if len(pairs) > 1:
        raise MeshTensorError(f"to_mesh from {src.pm._shape} to {mesh._shape} broadcasts along the dims the source "
                              f"lacks, which does not work with autograd, and this tensor requires grad: move "
                              f"t.detach() (a broadcast is meant for initialization), or to a mesh of the same sizes")
    return _ToMesh.apply(t, dst)


def _to_mesh_pairs(src, dst) -> list[list[tuple[int, int]]]:
    """Which rank of shape ``src`` sends to which rank of shape ``dst`` (each a position in its shape's
    row-major order), in rounds in which every source rank sends once.

    Meshes of the same sizes pair position i with position i (one round). Otherwise each dim of ``src`` must be
    a dim of ``dst`` of the same size, and ``dst``'s other dims are broadcast along, as Monarch's ``to_mesh``
    does (to initialize every host from one, say): a destination rank gets the value of the source rank at its
    coordinates on the shared dims, one round per coordinate of the broadcast dims.
    """
    if tuple(src.dims) == tuple(dst.dims):
        return [[(i, i) for i in range(len(src))]]
    sizes = dst.sizes
    for name, size in src.sizes.items():
        if sizes.get(name) != size:
            raise ValueError(f"to_mesh needs meshes of the same sizes, or a destination with every dim of the source "
                             f"at the same size (it broadcasts along its other dims): {src} vs {dst}")
    index = {tuple(c.values()): i for i, c in enumerate(src.coordinates())}
    rounds: dict = {}
    for i, c in enumerate(dst.coordinates()):
        key = tuple(v for n, v in c.items() if n not in src.names)
        rounds.setdefault(key, []).append((index[tuple(c[n] for n in src.names)], i))
    return list(rounds.values())


def _send_to_mesh(t: Tensor, dst: Ctx, pairs: list) -> Tensor:
    """Issue the transfer of ``t`` to ``dst``'s ranks (``pairs``: see ``_to_mesh_pairs``); its new tensor there."""
    src = t._ctx
    # Data goes proc to proc: the receiving workers must exist before the senders' messages arrive.
    dst.client.workers.initialized.get(timeout=60)
    xfer = next(_xfers)  # (one transfer id for every round: each destination proc receives once)
    loc = user_loc()
    for round_ in pairs:
        dests = {src.ranks[s]: dst.client.addrs[dst.ranks[d]] for s, d in round_}
        src.client.issue(m.SendTensor(t._ref, xfer, dests, src.sid, loc), src.ranks)
    src.client.flush()
    ref = next(dst.client.refs)
    dst.client.issue(m.RecvTensor(ref, xfer, RECV_TIMEOUT, dst.sid, loc), dst.ranks)
    meta = contiguous_meta(tuple(t.shape), t.dtype)
    return Tensor(meta, intern_meta(meta), dst, ref)


class _ToMesh(torch.autograd.Function):
    """``to_mesh`` of a tensor that requires grad: its gradient goes back to the source mesh (and stream) the
    same way, so a model split over meshes (a pipeline's stages) trains as one graph, as it would locally."""

    @staticmethod
    def forward(ctx_, t: Tensor, dst: Ctx) -> Tensor:
        ctx_.src = t._ctx
        return _send_to_mesh(t, dst, _to_mesh_pairs(t._ctx.pm._shape, dst.pm._shape))

    @staticmethod
    def backward(ctx_, grad):
        src = ctx_.src
        return _to_mesh(grad, src.pm, src.stream), None
