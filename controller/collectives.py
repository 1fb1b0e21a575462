"""Collectives over named mesh dimensions: ``reduce`` and ``reduce_`` (all-reduce, all-gather with "stack",
reduce-scatter with ``scatter=True``), one batch of collectives for a pytree of tensors.

>>> y = reduce(x, "gpus", "sum")
>>> reduce_([g1, g2], "dp", "avg")
"""

from __future__ import annotations

import functools
import itertools

from monarch_tensor.worker import messages as m
from torch.utils import _pytree as pytree

from .client import user_loc
from .errors import MeshTensorError
from .tensor import (
    Tensor,
    check_live,
    check_readable,
    check_writable,
    contiguous_meta,
    forget_value,
    intern_meta,
    memory_span,
    state,
)


@functools.lru_cache(maxsize=1024)
def _groups(shape, dims: tuple) -> tuple:
    names = shape.names
    for d in dims:
        if d not in names:
            raise KeyError(f"mesh {shape} has no dimension {d!r}")
    other = [n for n in names if n not in dims]
    stride = dict(zip(names, shape.strides))
    size = shape.sizes
    groups = []
    for oc in itertools.product(*(range(size[n]) for n in other)):
        base = shape.offset + sum(c * stride[n] for c, n in zip(oc, other))
        red = [n for n in names if n in dims]
        groups.append(tuple(base + sum(c * stride[n] for c, n in zip(rc, red))
                            for rc in itertools.product(*(range(size[n]) for n in red))))
    return tuple(groups)


_REDUCTIONS = ("sum", "avg", "max", "min", "product", "stack")


def _reduce_tree(tensors, dims, reduction: str, scatter: bool, inplace: bool):
    """Every mesh tensor of a pytree reduced, the structure kept. The leaves go out in one held batch, those
    of one mesh and dtype one after another, so that the client folds each such run into one collective
    (``MeshClient._fuse``: a ``ReduceMany``, one buffer as DDP's buckets; not for "stack" or ``scatter``)."""
    from .client import coalescing

    leaves, spec = pytree.tree_flatten(tensors)
    runs: dict = {}
    for i, t in enumerate(leaves):
        runs.setdefault((id(getattr(t, "_ctx", None)), getattr(t, "dtype", None)), []).append(i)
    out: list = [None] * len(leaves)
    with coalescing():
        for run in runs.values():
            for i in run:
                out[i] = _reduce(leaves[i], dims, reduction, scatter, inplace)
    return pytree.tree_unflatten(out, spec)


def _reduce(t: Tensor, dims, reduction: str, scatter: bool, inplace: bool) -> Tensor:
    if type(t) is not Tensor:
        raise TypeError(f"reduce needs a mesh tensor, got {type(t).__name__}")
    check_live(t._ctx, "reduce")
    check_readable("reduce", (t,))
    if reduction not in _REDUCTIONS:
        raise ValueError(f"unknown reduction {reduction!r}; use one of {list(_REDUCTIONS)}")
    if isinstance(dims, str):
        dims = (dims,)
    elif isinstance(dims, (tuple, list)) and all(isinstance(d, str) for d in dims):
        dims = tuple(dims)
    else:
        raise TypeError(f"reduce's dims must be a dimension name or a list of them, such as 'gpus', not {dims!r}")
    ctx = t._ctx
    active = state.stream
    if (active.id if active else 0) != ctx.sid:
        raise MeshTensorError(f"reduce: the tensor lives on stream {ctx.stream.name!r}, not the active one")
    groups = _groups(ctx.pm._shape, dims)
    n = len(groups[0])
    shape = tuple(t.shape)
    if reduction == "stack":
        if scatter or inplace:
            raise ValueError("reduction 'stack' (all-gather) cannot be combined with scatter=True or reduce_")
        out_shape = (n,) + shape
    elif scatter:
        if inplace:
            raise ValueError("reduce_ cannot scatter (the result has a different shape); use reduce(scatter=True)")
        if not shape or shape[0] % n:
            raise ValueError(f"reduce(scatter=True) over {n} ranks needs a first dimension divisible by {n}, "
                             f"got shape {shape}")
        out_shape = (shape[0] // n,) + shape[1:]
    else:
        out_shape = shape
    client = ctx.client
    if inplace:
        check_writable("reduce_", t)
        forget_value(t)
        client.issue(m.Reduce(t._ref, t._ref, groups, reduction, scatter, True, t.numel(), t.dtype, ctx.sid,
                              user_loc()), ctx.ranks, memory=memory_span(t))
        return t
    ref = next(client.refs)
    meta = contiguous_meta(out_shape, t.dtype)
    client.issue(m.Reduce(ref, t._ref, groups, reduction, scatter, False, t.numel(), t.dtype, ctx.sid, user_loc()),
                 ctx.ranks)
    return Tensor(meta, intern_meta(meta), ctx, ref)


def _refuse_mesh(mesh, what: str) -> None:
    """``reduce(..., mesh=m)`` was accepted and ignored (the result stayed on the tensor's mesh): refused, as
    Monarch's reduce refuses it."""
    if mesh is not None:
        raise NotImplementedError(f"{what}(mesh=...) is not supported (a reduce's result lives on its tensor's "
                                  f"mesh): move the result with to_mesh(mesh), or keep some ranks' with slice_mesh(...)")


def reduce(tensors, dims, reduction: str = "sum", scatter: bool = False, mesh=None, out=None):
    """Collective over the ranks of the named ``dims`` (gloo on CPU, NCCL on GPU).

    ``reduce(t, "gpus", "sum")`` all-reduces; ``"avg"``, ``"max"``, ``"min"``,
    ``"product"`` likewise; ``"stack"`` all-gathers into a new first dim;
    ``scatter=True`` reduce-scatters along the first dim. ``tensors`` may be a
    pytree of mesh tensors (Monarch's): each leaf is reduced (each must be one), the structure kept; the
    leaves of one dtype go in one collective. ``mesh`` (placing the result on another mesh) is not supported, as
    in Monarch: move the result with ``to_mesh`` or ``slice_mesh``.
    """
    _refuse_mesh(mesh, "reduce")
    if type(tensors) is not Tensor:
        if out is not None:
            raise TypeError("reduce(out=...) takes one tensor, not a pytree of them")
        return _reduce_tree(tensors, dims, reduction, scatter, False)
    r = _reduce(tensors, dims, reduction, scatter, False)
    if out is not None:
        out.copy_(r)
        return out
    return r


def reduce_(tensors, dims, reduction: str = "sum", scatter: bool = False, mesh=None):
    """In-place ``reduce``: ``grad.reduce_("dp", "avg")``; or each mesh tensor of a pytree
    (``reduce_([g1, g2], "dp", "avg")``)."""
    _refuse_mesh(mesh, "reduce_")
    if type(tensors) is not Tensor:
        return _reduce_tree(tensors, dims, reduction, scatter, True)
    return _reduce(tensors, dims, reduction, scatter, True)
