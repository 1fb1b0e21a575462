"""Fetching values to the controller: ``fetch_shard`` (one rank's value, as a future), ``inspect``, ``preview``
(every rank's), ``show``.

>>> fetch_shard(y, gpus=0).result()
tensor([3., 3., 3., 3.])
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from monarch_tensor.worker import messages as m

from monarch_tensor.future import Future

# activation imports torch_patches, which imports this module (through remote_functions): its siblings in that
# cycle are imported as modules (their names are looked up at the call)
from . import activation
from .arguments import mesh_leaves, to_wire
from .client import Ctx, user_loc
from .errors import MeshTensorError
from .tensor import Tensor, check_live, check_readable


def _leaves_ctx(obj, what: str = "fetch_shard") -> tuple[list, Ctx | None]:
    leaves = mesh_leaves(obj, what)
    if not leaves:
        check_readable(what, leaves)
        return leaves, None
    ctx = leaves[0]._ctx
    for t in leaves:
        check_live(t._ctx, what)
        if t._ctx.client is not ctx.client or t._ctx.ranks != ctx.ranks:
            raise MeshTensorError(f"{what}: the tensors live on different meshes ({ctx.pm._label()} and "
                                  f"{t._ctx.pm._label()}); move one with t.to_mesh(mesh)")
        if t._ctx.sid != ctx.sid:
            raise MeshTensorError(f"{what}: the tensors live on different streams ({ctx.stream.name!r} and "
                                  f"{t._ctx.stream.name!r}); borrow one with stream.borrow(t)")
    check_readable(what, leaves)
    return leaves, ctx


def _to_wire(obj, what: str = ""):
    return to_wire(obj, what)


def _rank_of(ctx: Ctx, shard: dict | None, kwargs: dict) -> int:
    if shard is not None and not isinstance(shard, Mapping):
        raise TypeError(f"shard must be a dict of coordinates such as {{'gpus': 1}} (or keywords: gpus=1), "
                        f"not {type(shard).__name__} {shard!r}")
    coords = dict(shard or {})
    coords.update(kwargs)
    shape = ctx.pm._shape
    unknown = set(coords) - set(shape.names)
    if unknown:
        raise KeyError(f"mesh {shape} has no dimension(s) {sorted(unknown)}")
    full = {n: coords.get(n, 0) for n in shape.names}
    return shape.slice(**full).offset


def fetch_shard(obj: Any, shard: dict[str, int] | None = None, **kwargs: int) -> Future:
    """The value of ``obj``'s mesh tensors on one rank, as CPU tensors: ``fetch_shard(t, gpus=1).result()``.

    Unnamed dims default to coordinate 0. Raises ``RemoteException`` (on
    ``.result()``) if the value depends on an op that failed.
    """
    leaves, ctx = _leaves_ctx(obj)
    if ctx is None:
        return Future.ready(obj)
    rank = _rank_of(ctx, shard, kwargs)
    value, sid, loc = _to_wire(obj), ctx.sid, user_loc()
    return ctx.client.request(rank, lambda port: m.FetchValue(value, None, port, sid, loc), mesh=ctx.ranks)


def inspect(obj: Any, shard: dict[str, int] | None = None, **kwargs: int) -> Any:
    """``fetch_shard(obj, ...).result()``: the value on one rank, now."""
    return fetch_shard(obj, shard, **kwargs).result()


def preview(t: Tensor):
    """Every rank's value of mesh tensor ``t``, fetched now (a synchronisation): a ``ValueMesh`` of CPU tensors,
    which prints each rank's value as torch prints a tensor (and shows as a table in Jupyter). A global
    (DTensor) tensor has one value: ``t.full_tensor()``."""
    from monarch_tensor.actor import ValueMesh

    if type(t) is not Tensor:
        raise TypeError(f"preview() takes a mesh tensor, got {type(t).__name__}")
    if t._dist is not None:
        return t.full_tensor()
    shape = t._ctx.pm._shape
    futures = [fetch_shard(t, dict(shape.point(i))) for i in range(len(shape))]
    return ValueMesh(shape, [f.result() for f in futures])


def show(obj: Any, shard: dict[str, int] | None = None, **kwargs: int) -> Any:
    """``inspect`` one rank's value, then draw it with ``torchshow.show`` (Monarch's; torchshow is optional)."""
    try:
        from torchshow import show as draw
    except ImportError:
        raise ImportError("show() draws tensors with torchshow, which is not installed: pip install torchshow "
                          "(or use inspect() for the value)") from None
    value = inspect(obj, shard, **kwargs)
    with activation.no_mesh.activate():
        return draw(value)
