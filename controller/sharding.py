"""``module_to_mesh``: a module's parameters as global sharded tensors (FSDP-style, plus tensor parallelism).

Every parameter becomes a distributed tensor of the same global shape, so the
module's forward, ``loss.backward()`` and any ``torch.optim`` optimizer run
unchanged; torch's sharding propagation on the workers decides the
collectives (an all-gather of a ``Shard(0)`` weight before a matmul, a
reduce-scatter of its gradient in the optimizer's update, ...).

* Default (FSDP-style): each parameter is ``Shard(0)`` over the data-parallel
  mesh dim and replicated over the others. A parameter whose dim 0 is smaller
  than the data-parallel dim (an ``nn.Linear(n, 1)``'s weight and bias) is
  replicated: torch treats such a dim as not shardable, so it would find no
  placement for the optimizer's in-place update (``exp_avg.lerp_(grad)`` of a
  ``Partial`` gradient) that keeps ``Shard(0)``, and refuse it.
* ``plan={"mlp.fc": "colwise", "mlp.proj": "rowwise"}`` (names or fnmatch
  patterns of submodules): tensor parallelism over ``tp_dim``. ``colwise``
  splits an ``nn.Linear``'s output features (weight and bias ``Shard(0)``),
  ``rowwise`` its input features (weight ``Shard(1)``, bias replicated); for an
  ``nn.Embedding`` colwise splits the embedding dim, rowwise the vocabulary.
  Planned parameters are replicated over the data-parallel dim.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Mapping

import torch
from torch import nn

from .dtensor import _resolve_mesh, distribute
from .placements import Replicate, Shard, ShardingError

STYLES = ("colwise", "rowwise")


def _tp_placement(mod: nn.Module, pname: str, style: str, where: str):
    if isinstance(mod, nn.Linear):
        if style == "colwise":
            return Shard(0)
        return Shard(1) if pname == "weight" else Replicate()
    if isinstance(mod, nn.Embedding):
        return Shard(1) if style == "colwise" else Shard(0)
    raise ShardingError(f"plan entry {where!r}: {style} parallelism applies to nn.Linear and nn.Embedding, "
                        f"not {type(mod).__name__}")


def module_to_mesh(module: nn.Module, mesh=None, *, dp_dim: str | None = None, tp_dim: str | None = None,
                   plan: Mapping[str, str] | None = None) -> nn.Module:
    """Replace ``module``'s parameters and buffers (in place) by global tensors on ``mesh``; returns ``module``.

    >>> model = module_to_mesh(GPT(config), procs)                         # {"dp": 2}: FSDP-style
    >>> model = module_to_mesh(GPT(config), procs, plan={"*.fc": "colwise", "*.proj": "rowwise"})  # dp x tp
    """
    mesh = _resolve_mesh(mesh, "module_to_mesh")
    names = tuple(mesh._shape.names)
    plan = dict(plan or {})
    for pattern, style in plan.items():
        if style not in STYLES:
            raise ShardingError(f"plan entry {pattern!r}: unknown style {style!r}; use one of {list(STYLES)}")
    if plan:
        tp_dim = tp_dim or ("tp" if "tp" in names else names[-1])
    for d, what in ((dp_dim, "dp_dim"), (tp_dim, "tp_dim")):
        if d is not None and d not in names:
            raise ShardingError(f"{what}={d!r} is not a dim of the mesh {mesh._shape.sizes}; its dims are {list(names)}")
    if dp_dim is None:
        dp_dim = next((n for n in names if n != tp_dim), None)
    dp_size = mesh._shape.dims[names.index(dp_dim)] if dp_dim is not None else 1
    submodules = dict(module.named_modules())
    matched = {p: [n for n in submodules if fnmatch.fnmatchcase(n, p)] for p in plan}
    unmatched = [p for p, hits in matched.items() if not hits]
    if unmatched:
        raise ShardingError(f"plan entries {unmatched} match no submodule of {type(module).__name__} "
                            f"(its submodules: {[n for n in submodules if n][:12]}...)")
    styles = {n: plan[p] for p, hits in matched.items() for n in hits}
    # A parameter (or buffer) reachable from several modules (tied embeddings: ``head.weight is tok.weight``)
    # becomes one global tensor, set on each of them: matched by identity, as torch's own sharding APIs do.
    made: dict[int, tuple] = {}
    for mname, mod in submodules.items():
        for pname, p in list(mod.named_parameters(recurse=False)):
            places = {}
            if mname in styles:
                places[tp_dim] = _tp_placement(mod, pname, styles[mname], mname)
            elif dp_dim is not None and p.dim() > 0 and p.shape[0] >= dp_size:
                places[dp_dim] = Shard(0)
            seen = made.get(id(p))
            if seen is not None:
                if seen[1] != places:
                    raise ShardingError(f"parameter {mname}.{pname} is shared with {seen[2]}, which the plan lays out "
                                        f"differently ({seen[1]} and {places}); a shared parameter has one layout: "
                                        f"give both modules the same style, or neither a style")
                setattr(mod, pname, seen[0])
                continue
            dt = distribute(p.detach(), mesh, places)
            param = nn.Parameter(dt, requires_grad=p.requires_grad)
            param._dist = dt._dist  # detach() keeps the placements
            made[id(p)] = (param, places, f"{mname}.{pname}", p)  # (p kept: its id stays unique)
            setattr(mod, pname, param)
        for bname, b in list(mod.named_buffers(recurse=False)):
            if b is not None and isinstance(b, torch.Tensor):
                seen = made.get(id(b))
                if seen is None:
                    seen = made[id(b)] = (distribute(b, mesh, {}), None, f"{mname}.{bname}", b)
                setattr(mod, bname, seen[0])
    return module
