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
  Planned parameters are replicated over the data-parallel dim. As torch's
  ``RowwiseParallel``, a rowwise module's output is made ``Replicate()`` over
  ``tp_dim`` (its ``Partial`` sums all-reduced) as it leaves the module, and
  as ``ColwiseParallel``, a colwise Linear's input (and that input's gradient
  in the backward) too, so what lies between (a residual add, a layer norm)
  sees whole activations and whole gradients. Left to sharding propagation, a
  layer norm reduce-scatters them and the next Linear all-gathers its weight.
  A rowwise Linear's input gradient is replicated over ``tp_dim`` as well.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Mapping, Sequence

import torch
from monarch_tensor.worker import messages as m
from torch import nn

from .dtensor import _resolve_mesh, distribute, replicate_over
from .fsdp import FSDPState, Unit
from .placements import Replicate, Shard, ShardingError
from .tensor import Tensor, contiguous_meta, intern_meta

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
                   plan: Mapping[str, str] | None = None, reshard_after_forward: bool = True, mp_policy=None,
                   units: Sequence[str] | None = None) -> nn.Module:
    """Replace ``module``'s parameters and buffers (in place) by tensors on ``mesh``; returns ``module``.

    >>> model = module_to_mesh(GPT(config), procs)                  # {"dp": 2}: FSDP2-style
    >>> loss = model(x.to_local(), y.to_local())                    # each rank its own batch (plain mesh tensors)
    >>> model = module_to_mesh(GPT(config), procs, plan={"*.fc": "colwise", "*.proj": "rowwise"})  # dp x tp
    >>> loss = model(distribute(x, procs, {"dp": Shard(0)}), ...)   # global inputs: DTensor ops

    ``reshard_after_forward``: free each unit's gathered parameters after its forward and gather them again
    for its backward (FSDP2's default); ``mp_policy``: ``MixedPrecisionPolicy(param_dtype=..., reduce_dtype=...)``
    as FSDP2's; ``units``: names or fnmatch patterns of the submodules that gather their parameters
    together (default: every element of an ``nn.ModuleList``, such as each transformer block; the root
    gathers what is left).
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
    styles = {n: plan[p] for p, n in _matches(plan, submodules, module, "plan entries")}
    # A parameter (or buffer) reachable from several modules (tied embeddings: ``head.weight is tok.weight``)
    # becomes one tensor, set on each of them: matched by identity, as torch's own sharding APIs do.
    made: dict[int, list] = {}  # id(original) -> [new, placements, first name, original, [(module name, module, attr)]]
    for mname, mod in submodules.items():
        for pname, p in list(mod.named_parameters(recurse=False)):
            places = {}
            if mname in styles:
                places[tp_dim] = _tp_placement(mod, pname, styles[mname], mname)
            elif dp_dim is not None and p.dim() > 0 and p.shape[0] >= dp_size:
                places[dp_dim] = Shard(0)
            seen = made.get(id(p))
            if seen is None:
                dt = distribute(p.detach(), mesh, places)
                param = nn.Parameter(dt, requires_grad=p.requires_grad)
                param._dist = dt._dist  # detach() keeps the placements
                seen = made[id(p)] = [param, places, f"{mname}.{pname}", p, []]  # (p kept: its id stays unique)
            elif seen[1] != places:
                raise ShardingError(f"parameter {mname}.{pname} is shared with {seen[2]}, which the plan lays out "
                                    f"differently ({seen[1]} and {places}); a shared parameter has one layout: "
                                    f"give both modules the same style, or neither a style")
            seen[4].append((mname, mod, pname))
            setattr(mod, pname, seen[0])
        for bname, b in list(mod.named_buffers(recurse=False)):
            if b is not None and isinstance(b, torch.Tensor):
                seen = made.get(id(b))
                if seen is None:
                    new = distribute(b, mesh, {}) if plan else _plain(b, mesh)
                    seen = made[id(b)] = [new, None, f"{mname}.{bname}", b, []]
                setattr(mod, bname, seen[0])
    if dp_dim is None and mp_policy is not None:
        raise ShardingError(f"mp_policy needs a data-parallel mesh dim; the mesh {mesh._shape.sizes} has only tp_dim")
    if plan:
        tp_index = names.index(tp_dim)
        for mname, style in styles.items():
            if style == "rowwise":
                submodules[mname].register_forward_hook(_replicated_output(tp_index))
                submodules[mname].register_forward_pre_hook(_replicated_input_grad(tp_index))
            elif isinstance(submodules[mname], nn.Linear):
                submodules[mname].register_forward_pre_hook(_replicated_input(tp_index))
    params = [v for v in made.values() if v[1] is not None]
    _make_units(module, submodules, params, units, FSDPState(dp_dim, reshard_after_forward, mp_policy, bool(plan)))
    return module


def _replicated_output(dim: int):
    """A forward hook: the module's output (a distributed tensor) replicated over mesh dim ``dim``."""

    def hook(module, args, out):
        if getattr(out, "_dist", None) is not None:
            return replicate_over(out, dim)
        return None

    return hook


def _replicated_input_grad(dim: int):
    """A forward pre-hook: the gradient of the module's input (a distributed tensor) replicated over mesh dim
    ``dim`` as the backward hands it on. A rowwise Linear's input gradient comes out of its matmul sharded
    over ``tp_dim``; whatever made that input (an attention's reshapes of its heads) then sees whole
    gradients, as its forward saw whole activations, instead of torch's sharding propagation mixing the
    two (a ``_StridedShard`` of the batch and the heads, whose first propagation alone took seconds)."""

    def replicate(grad):
        return replicate_over(grad, dim) if getattr(grad, "_dist", None) is not None else None

    def hook(module, args):
        if args and getattr(args[0], "_dist", None) is not None and args[0].requires_grad:
            args[0].register_hook(replicate)
        return None

    return hook


def _replicated_input(dim: int):
    """A forward pre-hook: the module's input (a distributed tensor) replicated over mesh dim ``dim``, and its
    gradient too (torch's ``ColwiseParallel`` input layout)."""

    def hook(module, args):
        if args and getattr(args[0], "_dist", None) is not None:
            return (replicate_over(args[0], dim, grad_too=True), *args[1:])
        return None

    return hook


def _matches(patterns, submodules: dict, module, what: str) -> list[tuple[str, str]]:
    """(pattern, submodule name) for every submodule each fnmatch pattern names; a pattern naming none is refused."""
    matched = {p: [n for n in submodules if fnmatch.fnmatchcase(n, p)] for p in patterns}
    unmatched = [p for p, hits in matched.items() if not hits]
    if unmatched:
        raise ShardingError(f"{what} {unmatched} match no submodule of {type(module).__name__} "
                            f"(its submodules: {[n for n in submodules if n][:12]}...)")
    return [(p, n) for p, hits in matched.items() for n in hits]


def _plain(b: torch.Tensor, mesh) -> Tensor:
    """``b`` as a plain mesh tensor, the same value on every rank (a buffer: FSDP2 leaves buffers unsharded)."""
    from .activation import ctx_for

    ctx = ctx_for(mesh)
    if type(b) is Tensor:
        if b._ctx is not ctx:
            raise ShardingError(f"module_to_mesh: a buffer lives on {b.mesh._label()}, not on {mesh._label()}")
        return b
    client = ctx.client
    ref = next(client.refs)
    client.issue(m.CreateValue(ref, b.detach().contiguous().clone(), ctx.sid), ctx.ranks)
    meta = contiguous_meta(tuple(b.shape), b.dtype)
    return Tensor(meta, intern_meta(meta), ctx, ref)


def _make_units(module: nn.Module, submodules: dict, params: list, patterns, state: FSDPState) -> None:
    """One ``Unit`` per chosen submodule, and the root; each parameter joins the innermost unit holding every
    module it is set on (a tied parameter used by two blocks joins their common ancestor, the root at worst)."""
    containers = (nn.ModuleList, nn.ModuleDict)  # (no forward: hooks on them never run)
    if patterns is None:
        names = [f"{n}.{k}" if n else k for n, mod in submodules.items() if isinstance(mod, nn.ModuleList)
                 for k, sub in mod._modules.items() if not isinstance(sub, containers)]
    else:
        names = sorted({n for _, n in _matches(list(patterns), submodules, module, "units")} - {""})
        bad = [n for n in names if isinstance(submodules[n], containers)]
        if bad:
            raise ShardingError(f"units {bad} are containers (nn.ModuleList / nn.ModuleDict), which run no forward; "
                                f"name their elements instead (e.g. {bad[0] + '.*'!r})")

    def owner(mname: str) -> str:
        return max((u for u in names if mname == u or mname.startswith(u + ".")), key=len, default="")

    def within(inner: str, outer: str) -> bool:
        return outer == "" or inner == outer or inner.startswith(outer + ".")

    owned: dict[str, list] = {n: [] for n in [""] + names}
    for param, _, _, _, where in params:
        owners = [owner(mname) for mname, _, _ in where]
        home = owners[0]
        while not all(within(o, home) for o in owners):
            home = owner(home.rsplit(".", 1)[0]) if "." in home else ""
        owned[home].append((param, [(mod, attr) for _, mod, attr in where]))
    for name in [""] + names:
        items = owned[name]
        if name and not items:
            continue
        Unit(submodules[name], name, [p for p, _ in items], [w for _, w in items], state, root=not name)
