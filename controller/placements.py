"""Placements of global sharded tensors: parsing and checking what the script asked for.

A placement says, per mesh dim, how a tensor is laid out along it: ``Shard(d)``
(tensor dim ``d`` is split over that mesh dim), ``Replicate()`` (every rank
holds all of it) or ``Partial("sum")`` (each rank holds a summand). These are
torch's own ``torch.distributed.tensor`` types, re-exported by
``monarch_tensor``. The script may give them three ways:

    placements=[Shard(0), Replicate()]            # one per mesh dim, in mesh order
    placements={"dp": Shard(0)}                   # by mesh dim name; the rest Replicate()
    sharding_spec=["dp", None]                    # one per TENSOR dim: the mesh dim(s) it is split over

Everything is checked here on the controller, before anything is sent, so a
mistake raises ``ShardingError`` at the user's line naming what was wrong.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from torch.distributed.tensor import Partial, Placement, Replicate, Shard

__all__ = ["Partial", "Placement", "Replicate", "Shard", "ShardingError", "parse_placements", "placements_str"]


class ShardingError(ValueError):
    """The script asked for a layout that does not fit the mesh or the tensor.

    Examples: a mesh dim name the mesh does not have, a placement list whose
    length is not the mesh's number of dims, ``Shard(d)`` for a dim the tensor
    does not have, a sharding spec longer than the tensor's rank.
    """


def _mesh_desc(names: Sequence[str], sizes: Sequence[int]) -> str:
    return "{" + ", ".join(f"{n!r}: {s}" for n, s in zip(names, sizes)) + "}"


def _check_shard(p: Placement, ndim: int, where: str) -> Placement:
    if not isinstance(p, Placement):
        hint = (" (to name mesh dims per tensor dim, as [\"dp\", None], pass sharding_spec=)"
                if p is None or isinstance(p, str) else "")
        raise ShardingError(f"{where}: {p!r} is not a placement; use Shard(dim), Replicate() or Partial(){hint}")
    if isinstance(p, Shard):
        if not -ndim <= p.dim < ndim or ndim == 0:
            raise ShardingError(f"{where}: {p!r} names tensor dim {p.dim}, but the tensor has {ndim} dim(s)"
                                + (f" (valid: {-ndim}..{ndim - 1})" if ndim else ""))
        if p.dim < 0:
            return Shard(p.dim + ndim)
    return p


def parse_placements(names: Sequence[str], sizes: Sequence[int], ndim: int,
                     placements: Sequence[Placement] | Mapping[str, Placement] | None = None,
                     sharding_spec: Sequence[str | Sequence[str] | None] | None = None) -> tuple[Placement, ...]:
    """Check a layout against a mesh (dim ``names`` and ``sizes``) and a tensor of ``ndim`` dims.

    Returns one placement per mesh dim, in mesh order, with ``Shard`` dims made
    non-negative. Neither given: replicated everywhere.

    >>> parse_placements(("dp", "tp"), (2, 2), 2, sharding_spec=["dp", None])
    (Shard(dim=0), Replicate())
    >>> parse_placements(("dp",), (2,), 2, placements=[Shard(-1)])
    (Shard(dim=1),)
    """
    names, sizes = tuple(names), tuple(sizes)
    mesh = _mesh_desc(names, sizes)
    if placements is not None and sharding_spec is not None:
        raise ShardingError("give placements= or sharding_spec=, not both")
    if sharding_spec is not None:
        return _from_spec(names, mesh, ndim, sharding_spec)
    if placements is None:
        return tuple(Replicate() for _ in names)
    if isinstance(placements, Placement):
        raise ShardingError(f"placements must be a list with one entry per mesh dim of {mesh}, "
                            f"got a single {placements!r}; write [{placements!r}]")
    if isinstance(placements, Mapping):
        unknown = [k for k in placements if k not in names]
        if unknown:
            raise ShardingError(f"placements name mesh dim(s) {unknown} that the mesh {mesh} does not have")
        return tuple(_check_shard(placements.get(n, Replicate()), ndim, f"placement for mesh dim {n!r}")
                     for n in names)
    if isinstance(placements, str) or not isinstance(placements, Sequence):
        raise ShardingError(f"placements must be a list of Shard/Replicate/Partial, got {placements!r}")
    if _is_spec(placements):  # ["dp", None]: mesh dim names per tensor dim, as sharding_spec= takes them
        return _from_spec(names, mesh, ndim, placements)
    if len(placements) != len(names):
        raise ShardingError(f"{len(placements)} placement(s) {list(placements)} for a mesh with {len(names)} "
                            f"dim(s) {mesh}: give one per mesh dim, in order {list(names)}")
    return tuple(_check_shard(p, ndim, f"placement {i} (mesh dim {n!r})")
                 for i, (p, n) in enumerate(zip(placements, names)))


def _is_spec(entries: Sequence) -> bool:
    """Whether a placements list is really a sharding spec: mesh dim names (or None) per tensor dim, at least
    one name, and no placement."""
    def name_like(e):
        return isinstance(e, str) or (isinstance(e, (list, tuple)) and e and all(isinstance(x, str) for x in e))

    return (any(name_like(e) for e in entries)
            and all(e is None or name_like(e) for e in entries))


def _from_spec(names: tuple, mesh: str, ndim: int, spec) -> tuple[Placement, ...]:
    if isinstance(spec, str) or not isinstance(spec, Sequence):
        raise ShardingError(f"sharding_spec must be a list with one entry per tensor dim, got {spec!r}")
    if len(spec) > ndim:
        raise ShardingError(f"sharding_spec {list(spec)} has {len(spec)} entries but the tensor has only "
                            f"{ndim} dim(s): give one entry (a mesh dim name or None) per tensor dim")
    out: dict[str, Placement] = {}
    for tdim, entry in enumerate(spec):
        if entry is None:
            continue
        for name in (entry,) if isinstance(entry, str) else tuple(entry):
            if name not in names:
                raise ShardingError(f"sharding_spec entry {tdim} names mesh dim {name!r}, but the mesh {mesh} "
                                    f"has dims {list(names)}")
            if name in out:
                raise ShardingError(f"sharding_spec splits tensor dims {out[name].dim} and {tdim} over the same "
                                    f"mesh dim {name!r}; a mesh dim can split one tensor dim")
            out[name] = Shard(tdim)
    return tuple(out.get(n, Replicate()) for n in names)


def placements_str(placements: Sequence[Placement], names: Sequence[str]) -> str:
    """Short form for reprs: ``{dp: S(0), tp: R}``."""
    return "{" + ", ".join(f"{n}: {p}" for n, p in zip(names, placements)) + "}"
