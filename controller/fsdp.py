"""FSDP2-style units for ``module_to_mesh``: sharded parameters at rest, plain tensors inside each forward.

A unit is a module (each transformer block, and the root for what is left)
whose parameters are DTensor-backed mesh tensors at rest. Just before its
forward, one instruction all-gathers them (``worker/fsdp.py``) into plain mesh
tensors (the whole value, the same on every rank), which replace the
parameters on the module for the call; so every op inside runs as a plain aten
op on the workers, with no DTensor dispatch. The gather is an autograd
function whose backward reduce-scatters the per-rank gradients, averaged over
the mesh, into gradients with the parameters' placements: ``loss.backward()``
and ``torch.optim`` work on the sharded parameters as before.

Prefetch: the first forward with plain inputs records the order in which the
units gather; from then on each unit, having issued its own gather, issues the
next one's (``worker.fsdp.prefetch``), so that all-gather runs while this unit
computes, as FSDP2's forward prefetch. In the backward, where units reshard
after forward, a unit's regather also prefetches the regather of the unit freed
before it (the next whose backward runs, for units called one after another),
as FSDP2's backward prefetch.

Mode of a forward: the root's inputs decide it. Plain mesh tensors (each rank
its own batch, as FSDP2 takes them) run the units; global DTensor inputs
(``distribute(x, mesh, ...)``) run every op on the DTensor parameters
themselves, as tensor parallelism needs.
"""

from __future__ import annotations

import weakref

import torch
from monarch_tensor.worker import messages as m
from torch import nn
from torch.utils import _pytree as pytree

from .client import user_loc
from .dtensor_methods import ACTIVE, DistInfo
from .placements import ShardingError
from .tensor import Tensor, contiguous_meta, intern_meta


def _issue(ctx, fn: str, args: tuple, outs: list[tuple], mutates: tuple = (), infos: list | None = None) -> list:
    """Run ``worker.fsdp.<fn>(*args)`` on every proc of ``ctx``: one instruction; its results as mesh tensors of
    ``outs`` ((shape, dtype) each; ``infos``: a DistInfo each, for DTensor results)."""
    client = ctx.client

    def wire(a):
        if type(a) is Tensor:
            return m.Ref(a._ref)
        if type(a) in (list, tuple):
            return type(a)(wire(x) for x in a)
        return a

    refs = tuple(next(client.refs) for _ in outs)
    metas = tuple((tuple(s), d) for s, d in outs)
    client.issue(m.CallFunction(f"monarch_tensor.worker.fsdp.{fn}", tuple(wire(a) for a in args), {}, refs, mutates, ctx.sid,
                                user_loc(), metas), ctx.ranks)
    result = []
    for k, (ref, (shape, dtype)) in enumerate(zip(refs, outs)):
        meta = contiguous_meta(tuple(shape), dtype)
        t = Tensor(meta, intern_meta(meta), ctx, ref)
        if infos is not None:
            t._dist = infos[k]
            ACTIVE.n += 1
        result.append(t)
    return result


class _Gathered:
    """One forward call's unsharded parameters of a unit (freed after the forward where the unit reshards)."""

    __slots__ = ("unit", "fulls", "freed", "prefetched", "__weakref__")

    def __init__(self, unit) -> None:
        self.unit, self.fulls, self.freed, self.prefetched = unit, None, False, False

    def free(self) -> None:
        ctx = self.unit.params[0]._ctx
        _issue(ctx, "reshard", (self.fulls,), [], mutates=tuple(f._ref for f in self.fulls))
        self.freed = True
        self.unit.state.note_freed(self)

    def regather(self, *_) -> None:
        if self.freed and self.fulls is not None:
            u = self.unit
            s = u.state
            _issue(u.params[0]._ctx, "unshard_into", (u.params, self.fulls, s.dp, s.param_dtype), [],
                   mutates=tuple(f._ref for f in self.fulls))
            self.freed = False
            before = s.regathered(self)
            if before is not None and before.freed and before.fulls is not None and not before.prefetched:
                b = before.unit
                _issue(b.params[0]._ctx, "prefetch", (b.params, s.dp, s.param_dtype), [])
                before.prefetched = True


class _Unshard(torch.autograd.Function):
    """Forward: the unit's parameters all-gathered into plain tensors. Backward: their gradients reduce-scattered
    (averaged over the mesh) into gradients shaped and placed as the parameters."""

    @staticmethod
    def forward(ctx_, gathered: _Gathered, *params):
        ctx_.gathered = gathered
        ctx_.set_materialize_grads(False)
        return tuple(_unshard(gathered.unit))

    @staticmethod
    def backward(ctx_, *grads):
        g = ctx_.gathered
        u = g.unit
        g.fulls = None  # (their memory goes with the last tensor of them that autograd held)
        keep = [k for k, gr in enumerate(grads) if gr is not None]
        out = [None] * len(grads)
        if keep:
            params = [u.params[k] for k in keep]
            reduced = _issue(params[0]._ctx, "reduce_grads", ([grads[k] for k in keep], params, u.state.dp,
                                                             u.state.reduce_dtype),
                             [(p.shape, p.dtype) for p in params], infos=[_info(p) for p in params])
            for k, r in zip(keep, reduced):
                out[k] = r
        return (None, *out)


def _info(p) -> DistInfo:
    i = p._dist
    return DistInfo(i.mesh, i.names, i.sizes, i.grid, i.placements)


def _unshard(unit) -> list:
    dtype = unit.state.param_dtype
    return _issue(unit.params[0]._ctx, "unshard", (unit.params, unit.state.dp, dtype),
                  [(p.shape, dtype or p.dtype) for p in unit.params])


class FSDPState:
    """What the units of one ``module_to_mesh`` share: the data-parallel dim, the policy, the current mode."""

    def __init__(self, dp: str, reshard_after_forward: bool, mp_policy, tp_planned: bool) -> None:
        self.dp, self.reshard = dp, reshard_after_forward
        self.param_dtype = getattr(mp_policy, "param_dtype", None)
        self.reduce_dtype = getattr(mp_policy, "reduce_dtype", None) or self.param_dtype
        self.output_dtype = getattr(mp_policy, "output_dtype", None)
        self.cast_inputs = getattr(mp_policy, "cast_forward_inputs", True)
        self.mp = mp_policy is not None and (self.param_dtype or self.reduce_dtype or self.output_dtype)
        self.tp_planned = tp_planned
        self.modes: list[bool] = []  # per root forward in progress: whether it runs the units (plain inputs)
        self.order: list[Unit] = []  # the units with parameters, in the order the first plain forward gathered them
        self.ordered = False  # (that forward ended: from now on each unit prefetches the next in ``order``)
        self.freed: list = []  # weak references to the _Gathered freed after their forward, in that order

    def note_freed(self, g: _Gathered) -> None:
        freed = self.freed
        freed.append(weakref.ref(g))
        if len(freed) > 2 * len(self.order) + 8:  # (forwards whose backward never ran: their graphs went)
            self.freed = [r for r in freed if r() is not None and r().freed]

    def regathered(self, g: _Gathered) -> _Gathered | None:
        """``g`` was gathered again for its backward: the _Gathered freed just before it (whose backward comes
        next when the units ran one after another), if any."""
        freed = self.freed
        for i in range(len(freed) - 1, -1, -1):
            if freed[i]() is g:
                del freed[i]
                return freed[i - 1]() if i > 0 else None
        return None


def _has_dist(tree) -> bool:
    return any(getattr(x, "_dist", None) is not None for x in pytree.tree_leaves(tree) if isinstance(x, Tensor))


def _cast(tree, dtype):
    def one(x):
        if isinstance(x, torch.Tensor) and x.is_floating_point() and x.dtype != dtype:
            return x.to(dtype)
        return x

    return pytree.tree_map(one, tree)


class Unit:
    """A module whose forward all-gathers ``params`` (set at ``places``: (module, attribute name) pairs)."""

    def __init__(self, module: nn.Module, name: str, params: list, places: list[list[tuple]], state: FSDPState,
                 root: bool) -> None:
        self.module, self.name, self.params, self.places = module, name, params, places
        self.state, self.root = state, root
        self.calls: list[_Gathered] = []
        self.next: Unit | None = None  # the unit whose gather this one's prefetches (see FSDPState.order)
        module.register_forward_pre_hook(self._pre, with_kwargs=True, prepend=True)
        module.register_forward_hook(self._post, with_kwargs=True, always_call=True)

    def _runs(self, args, kwargs) -> bool:
        s = self.state
        if self.root:
            s.modes.append(False)  # (first: the post-hook, which runs after a failed pre-hook too, pops it)
            plain = not _has_dist((args, kwargs))
            if plain and s.tp_planned:
                raise ShardingError(
                    f"{type(self.module).__name__}: module_to_mesh(plan=...) runs tensor parallelism on DTensors; "
                    f"give the module global inputs (distribute(x, mesh, placements)), not plain mesh tensors")
            if not plain and s.mp:
                raise ShardingError(f"{type(self.module).__name__}: mp_policy applies to plain (per-rank) inputs; "
                                    f"with global DTensor inputs every op runs on the DTensor parameters in their "
                                    f"own dtype: give each rank its batch as a plain mesh tensor (x.to_local())")
            s.modes[-1] = plain
            return plain
        if s.modes:
            return s.modes[-1]
        return not _has_dist((args, kwargs))  # (a unit called on its own)

    def _pre(self, module, args, kwargs):
        self.calls.append(None)  # (first: the post-hook, which runs after a failed pre-hook too, pops it)
        runs = self._runs(args, kwargs)
        if not runs or not self.params:
            return None
        g = _Gathered(self)
        if torch.is_grad_enabled() and any(p.requires_grad for p in self.params):
            g.fulls = list(_Unshard.apply(g, *self.params))
        else:
            g.fulls = _unshard(self)
        self.calls[-1] = g
        s = self.state
        if s.ordered:
            nxt = self.next
            if nxt is not None:
                _issue(nxt.params[0]._ctx, "prefetch", (nxt.params, s.dp, s.param_dtype), [])
        elif self not in s.order:
            s.order.append(self)
        for full, where in zip(g.fulls, self.places):
            for mod, attr in where:
                mod._parameters[attr] = full
        if s.param_dtype is not None and s.cast_inputs:
            return _cast(args, s.param_dtype), _cast(kwargs, s.param_dtype)
        return None

    def _post(self, module, args, kwargs, output):
        g = self.calls.pop() if self.calls else None
        s = self.state
        if self.root and s.modes:
            if s.modes.pop() and not s.ordered and not s.modes:  # the first plain forward ended: link the order
                for a, b in zip(s.order, s.order[1:]):
                    a.next = b
                s.ordered = True
        if g is None:
            return None
        for p, where in zip(self.params, self.places):
            for mod, attr in where:
                mod._parameters[attr] = p
        if self.state.reshard and not self.root and torch.is_grad_enabled():
            outs = [t for t in pytree.tree_leaves(output) if isinstance(t, torch.Tensor) and t.requires_grad]
            if outs:
                g.free()
                hooked = [False]

                def before_backward(grad, g=g, hooked=hooked):
                    if not hooked[0]:
                        hooked[0] = True
                        g.regather()
                    return grad

                for t in outs:
                    t.register_hook(before_backward)
        if self.root and self.state.output_dtype is not None:
            return _cast(output, self.state.output_dtype)
        return None
