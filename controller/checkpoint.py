"""Checkpoints of models on a mesh: ``torch.distributed.checkpoint`` on the workers, driven from the controller.

The names and arguments follow ``torch.distributed.checkpoint`` (``save``,
``load``) and ``torch.distributed.checkpoint.state_dict`` (``get_state_dict``,
``set_state_dict`` and their model/optimizer halves, ``StateDictOptions``),
so a training script keeps its shape::

    from monarch_tensor import checkpoint as dcp

    model_sd, optim_sd = dcp.get_state_dict(model, opt)          # FQN-keyed, mesh tensors: nothing moves
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)   # each rank writes its shards

    model_sd, optim_sd = dcp.get_state_dict(model2, opt2)        # a fresh model on a mesh of any dp size
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=path)                          # each rank reads what its shards need
    dcp.set_state_dict(model2, opt2, model_state_dict=state["model"], optim_state_dict=state["optim"])

``save``/``load`` run DCP's planner and storage on every rank of the state
dict's mesh (``worker/checkpoint.py``); the controller only carries the plans
between the ranks and the coordinator (rank 0), never tensor data. The files
are DCP's: ``.metadata`` and one ``__<rank>_0.distcp`` per rank. Loading
into DTensors of other placements or another mesh size is DCP's resharding.

``options=StateDictOptions(full_state_dict=True)`` gives the whole values as
CPU tensors on the controller (gathered on the workers), for export; a state
dict of CPU tensors given to ``set_*_state_dict`` is placed on the mesh like
the model's own tensors (each optimizer state tensor like its parameter), and
a tensor whose shape differs from its parameter's fails there, naming both.
"""

from __future__ import annotations

import itertools
import uuid
from collections.abc import Iterable, Mapping
from typing import Any

import torch
from monarch_tensor.worker import messages as m
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions
from torch.distributed.checkpoint.stateful import Stateful

from .client import user_loc
from .dtensor import distribute, placements_of
from .errors import MeshTensorError
from .placements import ShardingError
from .tensor import Tensor, contiguous_meta, forget_value, intern_meta

__all__ = ["StateDictOptions", "get_model_state_dict", "get_optimizer_state_dict", "get_state_dict", "load",
           "save", "set_model_state_dict", "set_optimizer_state_dict", "set_state_dict"]

_SUPPORTED = {"full_state_dict", "cpu_offload", "ignore_frozen_params", "keep_submodule_prefixes", "strict"}


# ---- save / load ---------------------------------------------------------------------------------------------
def _wire(obj, path: tuple, found: list, kept: list, what: str):
    """``obj`` with mesh tensors as refs (appended to ``found``); the paths of the other leaves go to ``kept``.
    Containers as DCP walks them: mappings (made plain dicts) and lists; anything else is one value."""
    if isinstance(obj, Tensor):
        found.append((path, obj))
        return m.Ref(obj._ref)
    if isinstance(obj, Mapping):
        return {k: _wire(v, path + (k,), found, kept, what) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_wire(v, path + (i,), found, kept, what) for i, v in enumerate(obj)]
    if isinstance(obj, tuple) and any(isinstance(x, Tensor) for x in torch.utils._pytree.tree_leaves(obj)):
        raise MeshTensorError(f"{what}: the tuple at {_name(path)} holds mesh tensors; DCP stores a tuple as one "
                              f"pickled object, so put them in a list or dict")
    kept.append(path)
    return obj


def _name(path: tuple) -> str:
    return ".".join(map(str, path)) or "<root>"


def _mesh_of(found: list, what: str):
    if not found:
        raise MeshTensorError(f"{what}: the state dict holds no mesh tensor, so there is no mesh to run on; "
                              f"use torch.distributed.checkpoint.{what} (no_dist=True) for local tensors")
    path0, t0 = found[0]
    ctx = t0._ctx
    for path, t in found:
        c = t._ctx
        if c.client is not ctx.client or c.ranks != ctx.ranks or c.sid != ctx.sid:
            raise MeshTensorError(f"{what}: {_name(path)} lives on {c.pm._label()} but {_name(path0)} on "
                                  f"{ctx.pm._label()}; a checkpoint's tensors live on one mesh and one stream")
    return ctx


def _each(ctx, fn: str, args_per_rank: list, token: str) -> list:
    """Run ``worker.checkpoint.<fn>(*args)`` on the given ranks (``args_per_rank``: ``(index, args)``, index
    into the mesh's ranks); their results. A failure on any rank drops the operation on every rank and
    raises the first rank's error."""
    loc, client = user_loc(), ctx.client
    futs = [client.request(ctx.ranks[i],
                           lambda port, a=a: m.FetchValue((a, {}), f"monarch_tensor.worker.checkpoint.{fn}", port, ctx.sid, loc),
                           f"checkpoint {fn}", mesh=ctx.ranks)
            for i, a in args_per_rank]
    out, error = [], None
    for f in futs:
        try:
            out.append(f.get())
        except Exception as e:  # noqa: BLE001 - every rank's reply is awaited before one error is raised
            error = error or e
            out.append(None)
    if error is not None:
        drops = [client.request(r, lambda port: m.FetchValue(((token,), {}), "monarch_tensor.worker.checkpoint.drop", port,
                                                             ctx.sid, loc), "checkpoint drop", mesh=ctx.ranks)
                 for r in ctx.ranks]
        for f in drops:
            try:
                f.get()
            except Exception:  # noqa: BLE001 - a dead proc keeps nothing to drop
                pass
        raise error
    return out


def _statefuls(state_dict: dict) -> dict:
    """``state_dict`` with its ``Stateful`` values (a module, an optimizer) as their state dicts (DCP's rule)."""
    return {k: (v.state_dict() if isinstance(v, Stateful) else v) for k, v in state_dict.items()}


def save(state_dict: dict, *, checkpoint_id=None, storage_writer=None, planner=None):
    """Save ``state_dict`` (mesh tensors, DTensor-backed or not, and plain values) with
    ``torch.distributed.checkpoint``: each rank of the tensors' mesh writes its own shards; rank 0 writes the
    ``.metadata``. Returns DCP's ``Metadata``.

    >>> model_sd, optim_sd = get_state_dict(model, opt)
    >>> save({"model": model_sd, "optim": optim_sd}, checkpoint_id="/ckpt/step100")
    """
    if not isinstance(state_dict, Mapping):
        raise TypeError(f"save: state_dict must be a dict, not {type(state_dict).__name__}")
    if checkpoint_id is None and storage_writer is None:
        raise ValueError("save: give checkpoint_id (a directory) or storage_writer")
    found, kept = [], []
    wire = _wire(_statefuls(dict(state_dict)), (), found, kept, "save")
    ctx = _mesh_of(found, "save")
    token, n = uuid.uuid4().hex, len(ctx.ranks)
    plans = _each(ctx, "save_plan", [(i, (token, wire, i, checkpoint_id, storage_writer, planner))
                                     for i in range(n)], token)
    (central,) = _each(ctx, "save_global", [(0, (token, plans))], token)
    results = _each(ctx, "save_write", [(i, (token, central[i])) for i in range(n)], token)
    (metadata,) = _each(ctx, "save_finish", [(0, (token, results))], token)
    return metadata


def load(state_dict: dict, *, checkpoint_id=None, storage_reader=None, planner=None) -> None:
    """Load a checkpoint into ``state_dict`` in place, as ``torch.distributed.checkpoint.load`` does: its mesh
    tensors are written on the workers (each rank reads the parts its shards need, whatever the mesh size
    and placements were at the save); its other values (step counts, hyperparameters, CPU tensors) are
    replaced by the saved ones, and its ``Stateful`` values get ``load_state_dict``.

    >>> model_sd, optim_sd = get_state_dict(model, opt)
    >>> state = {"model": model_sd, "optim": optim_sd}
    >>> load(state, checkpoint_id="/ckpt/step100")
    >>> set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    """
    if not isinstance(state_dict, dict):
        raise TypeError(f"load: state_dict must be a dict (loaded in place), not {type(state_dict).__name__}")
    if checkpoint_id is None and storage_reader is None:
        raise ValueError("load: give checkpoint_id (a directory) or storage_reader")
    plain = _statefuls(state_dict)
    found, kept = [], []
    wire = _wire(plain, (), found, kept, "load")
    ctx = _mesh_of(found, "load")
    token, n = uuid.uuid4().hex, len(ctx.ranks)
    plans = _each(ctx, "load_plan", [(i, (token, wire, i, checkpoint_id, storage_reader, planner))
                                     for i in range(n)], token)
    (central,) = _each(ctx, "load_global", [(0, (token, plans))], token)
    values = _each(ctx, "load_read", [(i, (token, central[i], kept)) for i in range(n)], token)[0]
    for _, t in found:
        forget_value(t)  # written on the workers: a value the controller knew (and its views') is stale
    for path, value in zip(kept, values):
        _put(plain, path, value)
    for k, v in state_dict.items():
        if isinstance(v, Stateful):
            v.load_state_dict(plain[k])
        else:
            state_dict[k] = plain[k]


def _put(root, path: tuple, value) -> None:
    """Set ``root[path]`` to ``value``; a CPU tensor of the same shape and dtype is copied into in place."""
    node = root
    for key in path[:-1]:
        node = node[key]
    old = node[path[-1]]
    if (isinstance(old, torch.Tensor) and isinstance(value, torch.Tensor) and old.shape == value.shape
            and old.dtype == value.dtype):
        with torch.no_grad():
            old.copy_(value)
    else:
        node[path[-1]] = value


# ---- state dicts: FQN-keyed, as torch.distributed.checkpoint.state_dict --------------------------------------
def _options(options: StateDictOptions | None) -> StateDictOptions:
    options = options if options is not None else StateDictOptions()
    if not isinstance(options, StateDictOptions):
        raise TypeError(f"options must be a StateDictOptions, not {type(options).__name__}")
    default = StateDictOptions()
    odd = [f for f in vars(options) if f not in _SUPPORTED and getattr(options, f) != getattr(default, f)]
    if odd:
        raise ValueError(f"StateDictOptions {odd} are not supported for mesh models (supported: "
                         f"{sorted(_SUPPORTED)}); a full state dict is on the controller, where rank 0's would be")
    if options.cpu_offload and not options.full_state_dict:
        raise ValueError("StateDictOptions(cpu_offload=True) needs full_state_dict=True here: a sharded state "
                         "dict's tensors stay where the workers hold them")
    return options


def _optimizers(optimizers) -> list[torch.optim.Optimizer]:
    if isinstance(optimizers, torch.optim.Optimizer):
        return [optimizers]
    out = list(optimizers) if isinstance(optimizers, Iterable) else [optimizers]
    for o in out:
        if not isinstance(o, torch.optim.Optimizer):
            raise TypeError(f"expected a torch.optim.Optimizer (or several), got {type(o).__name__}")
    return out


def _fqns(model: nn.Module) -> dict[int, str]:
    """Parameter id -> its name in ``model`` (a tied parameter: its first name, as ``named_parameters``)."""
    return {id(p): name for name, p in model.named_parameters()}


def _full(tree):
    """``tree`` with its mesh tensors as whole CPU tensors: distributed ones gathered on the workers (the
    first rank's copy is fetched, in one fetch per mesh), the others as the first rank holds them."""
    from .dtensor import _call
    from .fetching import fetch_shard

    leaves, spec = torch.utils._pytree.tree_flatten(tree)
    by_mesh: dict = {}
    for i, x in enumerate(leaves):
        if isinstance(x, Tensor):
            if getattr(x, "_dist", None) is not None:
                with torch.no_grad():
                    x = _call(x._ctx, "full_tensor", (x,), x.shape, x.dtype, None)
            key = (id(x._ctx.client), x._ctx.ranks, x._ctx.sid)
            by_mesh.setdefault(key, {})[i] = x
    for wholes in by_mesh.values():
        for i, v in fetch_shard(wholes).result().items():
            leaves[i] = v
    return torch.utils._pytree.tree_unflatten(leaves, spec)


def get_model_state_dict(model: nn.Module, *, options: StateDictOptions | None = None) -> dict[str, Any]:
    """``model``'s state dict keyed by FQN: its mesh tensors as they are (sharded; nothing moves), or with
    ``StateDictOptions(full_state_dict=True)`` whole CPU tensors on the controller (for export).

    >>> torch.save(get_model_state_dict(model, options=StateDictOptions(full_state_dict=True)), "model.pt")
    """
    options = _options(options)
    sd = model.state_dict()
    if options.ignore_frozen_params:
        frozen = {n for n, p in model.named_parameters() if not p.requires_grad}
        sd = {k: v for k, v in sd.items() if k not in frozen}
    return _full(dict(sd)) if options.full_state_dict else dict(sd)


def _init_optim_state(optim: torch.optim.Optimizer) -> None:
    """Give a fresh optimizer its state (as torch's ``get_state_dict`` does: one step with zero gradients and
    ``lr=0``), so that a checkpoint has tensors to load into. Existing gradients are kept."""
    if optim.state:
        return
    params = [p for g in optim.param_groups for p in g["params"]]
    grads = [p.grad for p in params]
    for p in params:
        if p.requires_grad:
            p.grad = torch.zeros_like(p)
    lrs = [g["lr"] for g in optim.param_groups]
    for g in optim.param_groups:
        g["lr"] = torch.tensor(0.0) if isinstance(g["lr"], torch.Tensor) else 0.0
    try:
        optim.step()
    finally:
        for g, lr in zip(optim.param_groups, lrs):
            g["lr"] = lr
        for p, grad in zip(params, grads):
            p.grad = grad


def get_optimizer_state_dict(model: nn.Module, optimizers, *, options: StateDictOptions | None = None) -> dict:
    """The optimizer state of ``model``'s parameters keyed by parameter FQN (torch's
    ``get_optimizer_state_dict`` format: ``{"state": {fqn: {...}}, "param_groups": [{..., "params": [fqn]}]}``).
    A fresh optimizer is given its state first. State tensors stay mesh tensors (placed like their
    parameters), or are whole CPU tensors with ``full_state_dict=True``.
    """
    options = _options(options)
    names = _fqns(model)
    state: dict = {}
    groups: list = []
    for optim in _optimizers(optimizers):
        _init_optim_state(optim)
        osd = optim.state_dict()
        ids = itertools.count()
        by_index = {}
        for g in optim.param_groups:
            for p in g["params"]:
                i = next(ids)
                if id(p) not in names:
                    raise ValueError(f"parameter {i} of the optimizer ({tuple(p.shape)}) is not a parameter of "
                                     f"{type(model).__name__}; pass the model whose parameters it optimizes")
                by_index[i] = names[id(p)]
        for i, s in osd["state"].items():
            state[by_index[i]] = dict(s)
        for g in osd["param_groups"]:
            groups.append({**g, "params": [by_index[i] for i in g["params"]]})
    out = {"state": state, "param_groups": groups}
    return _full(out) if options.full_state_dict else out


def get_state_dict(model: nn.Module, optimizers, *, options: StateDictOptions | None = None) -> tuple[dict, dict]:
    """``(get_model_state_dict(model), get_optimizer_state_dict(model, optimizers))``, as torch's.

    >>> model_sd, optim_sd = get_state_dict(model, opt)
    """
    return (get_model_state_dict(model, options=options),
            get_optimizer_state_dict(model, optimizers, options=options))


def _on_mesh_plain(value: torch.Tensor, like: Tensor) -> Tensor:
    """``value`` (a CPU tensor) as an ordinary mesh tensor on ``like``'s mesh and stream, equal on every rank."""
    ctx = like._ctx
    ref = next(ctx.client.refs)
    ctx.client.issue(m.CreateValue(ref, value.detach().to(like.dtype).contiguous().clone(), ctx.sid), ctx.ranks)
    meta = contiguous_meta(tuple(value.shape), like.dtype)
    return Tensor(meta, intern_meta(meta), ctx, ref)


def _place_like(value, like, where: str):
    """``value`` placed as ``like`` is: a CPU tensor for a mesh tensor is sent to its mesh (distributed with
    its placements, for a distributed one), one for a CPU tensor is copied; anything else is kept. A shape
    that differs raises, naming ``where``."""
    if not isinstance(like, torch.Tensor) or not isinstance(value, torch.Tensor):
        return value
    if tuple(value.shape) != tuple(like.shape):
        raise ShardingError(f"{where}: the state has shape {tuple(value.shape)} but the model's tensor has "
                            f"{tuple(like.shape)}; the state dict was made for another model")
    if isinstance(value, Tensor):
        return value
    if not isinstance(like, Tensor):
        return value.clone()  # (the optimizer steps it in place: the caller's state dict stays as it was)
    if getattr(like, "_dist", None) is not None:
        return distribute(value.detach().to(like.dtype), like._dist.mesh, placements_of(like))
    return _on_mesh_plain(value, like)


def set_model_state_dict(model: nn.Module, model_state_dict: Mapping[str, Any], *,
                         options: StateDictOptions | None = None):
    """Load an FQN-keyed state dict into ``model`` (``load_state_dict``); CPU tensors (a full state dict) are
    first placed like the model's tensors. Returns ``load_state_dict``'s missing and unexpected keys.

    >>> set_model_state_dict(model, torch.load("model.pt"))       # a full state dict into a sharded model
    """
    options = _options(options)
    own = model.state_dict()
    placed = {k: _place_like(v, own.get(k), f"model state {k!r}") for k, v in model_state_dict.items()}
    with torch.no_grad():
        return model.load_state_dict(placed, strict=options.strict)


def set_optimizer_state_dict(model: nn.Module, optimizers, optim_state_dict: Mapping, *,
                             options: StateDictOptions | None = None) -> None:
    """Load an FQN-keyed optimizer state dict (``get_optimizer_state_dict``'s format) into ``optimizers``.
    CPU state tensors (a full state dict) are placed like the state the optimizer makes for their parameter
    (a distributed parameter's ``exp_avg`` distributed as the parameter), so ``opt.step()`` runs on the
    mesh; one whose shape differs from its parameter's state raises here, naming the parameter.

    >>> set_optimizer_state_dict(model, opt, torch.load("optim.pt"))
    """
    _options(options)
    if not isinstance(optim_state_dict, Mapping) or {"state", "param_groups"} - set(optim_state_dict):
        raise ValueError("optim_state_dict must be get_optimizer_state_dict's format: a dict with 'state' "
                         "(by parameter FQN) and 'param_groups'")
    names = _fqns(model)
    saved_state, saved_groups = optim_state_dict["state"], list(optim_state_dict["param_groups"])
    mine = {names.get(id(p)) for o in _optimizers(optimizers) for g in o.param_groups for p in g["params"]}
    unknown = sorted(set(saved_state) - mine)
    if unknown:
        raise ValueError(f"the optimizer state names parameters {unknown[:8]} that the optimizer does not hold "
                         f"(its parameters: {sorted(n for n in mine if n)[:8]}...)")
    for optim in _optimizers(optimizers):
        _init_optim_state(optim)
        index, state = {}, {}
        for g in optim.param_groups:
            for p in g["params"]:
                fqn = names.get(id(p))
                if fqn is None:
                    raise ValueError(f"a parameter of the optimizer ({tuple(p.shape)}) is not a parameter of "
                                     f"{type(model).__name__}; pass the model whose parameters it optimizes")
                index[fqn] = len(index)
                if fqn in saved_state:
                    own = optim.state.get(p, {})
                    # an entry the optimizer makes none of is placed like the parameter if it has dims
                    state[index[fqn]] = {k: _place_like(v, own.get(k, p if _has_dims(v) else None),
                                                        f"optimizer state {k!r} of parameter {fqn!r}")
                                         for k, v in saved_state[fqn].items()}
        groups = [dict(g) for g in saved_groups[:len(optim.param_groups)]]
        saved_groups = saved_groups[len(optim.param_groups):]
        for g in groups:
            missing = [f for f in g["params"] if f not in index]
            if missing:
                raise ValueError(f"the optimizer state's param_groups name parameters {missing[:8]} that this "
                                 f"optimizer does not hold")
            g["params"] = [index[f] for f in g["params"]]
        optim.load_state_dict({"state": state, "param_groups": groups})


def _has_dims(value) -> bool:
    return isinstance(value, torch.Tensor) and value.dim() > 0


def set_state_dict(model: nn.Module, optimizers, *, model_state_dict: Mapping[str, Any],
                   optim_state_dict: Mapping, options: StateDictOptions | None = None):
    """``set_model_state_dict`` and ``set_optimizer_state_dict``, as torch's; returns the model's missing and
    unexpected keys.

    >>> set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    """
    keys = set_model_state_dict(model, model_state_dict, options=options)
    set_optimizer_state_dict(model, optimizers, optim_state_dict, options=options)
    return keys
