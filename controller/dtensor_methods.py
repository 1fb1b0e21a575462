"""What a mesh ``Tensor`` knows and does when it is a global sharded tensor (the engine's hooks).

``controller/tensor.py`` mixes ``DistributedMethods`` into its ``Tensor`` and
calls ``after_record`` for each recorded op, so outputs of ops on distributed
tensors are distributed too. Everything else lives in ``controller/dtensor.py``
(imported lazily here, so the engine does not import torch.distributed.tensor
until a script distributes something).
"""

from __future__ import annotations

from typing import Any


class DistInfo:
    """Where a global tensor lives: its proc mesh (dim names, sizes, proc ranks) and placements.

    ``placements`` is ``None`` for the output of an op until someone asks:
    torch's sharding propagation on the workers decides it, and the controller
    asks rank 0 once (a metadata round trip; no tensor data moves).
    """

    __slots__ = ("mesh", "names", "sizes", "grid", "placements")

    def __init__(self, mesh, names: tuple, sizes: tuple, grid: tuple, placements: tuple | None) -> None:
        self.mesh, self.names, self.sizes, self.grid, self.placements = mesh, names, sizes, grid, placements

    def derived(self) -> DistInfo:
        return DistInfo(self.mesh, self.names, self.sizes, self.grid, None)


class _Active:
    n = 0  # distributed tensors ever made; 0: after_record costs one attribute read


ACTIVE = _Active()


def after_record(tensors: list, out: Any) -> None:
    """Mark the new outputs of an op that read a distributed tensor as distributed (placements: ask later)."""
    info = None
    for t in tensors:
        info = getattr(t, "_dist", None)
        if info is not None:
            break
    if info is None:
        return
    if isinstance(out, (tuple, list)):
        for o in out:
            after_record(tensors, o)
        return
    if isinstance(out, DistributedMethods) and out._dist is None:
        out._dist = info.derived()


def _shard_shape(global_shape: tuple, placements, mesh_sizes, coords) -> tuple:
    """The local shape a rank at ``coords`` holds of a global tensor laid out by ``placements`` (``Shard(d)``
    splits dim d as ``torch.chunk`` does, one mesh dim after another)."""
    local = list(global_shape)
    for place, size, c in zip(placements, mesh_sizes, coords):
        d = getattr(place, "dim", None)
        if d is not None and type(place).__name__ == "Shard":
            chunk = -(-local[d] // size)
            local[d] = max(0, min(chunk, local[d] - c * chunk))
    return tuple(local)


class DistributedMethods:
    """DTensor's methods on the controller's mesh ``Tensor`` (see ``monarch_tensor.distribute``).

    >>> dt = distribute(torch.randn(8, 8), procs, [Shard(0)])
    >>> dt.placements, dt.device_mesh
    ((Shard(dim=0),), <ProcMesh {'gpus': 2}>)
    >>> (dt @ dt.T).full_tensor()
    """

    _dist: DistInfo | None = None

    @property
    def is_distributed(self) -> bool:
        """Whether this is a global sharded tensor (its shape is the global shape)."""
        return self._dist is not None

    @property
    def placements(self) -> tuple:
        """One placement per mesh dim (``Shard(d)``, ``Replicate()``, ``Partial()``)."""
        from .dtensor import placements_of

        return placements_of(self)

    @property
    def device_mesh(self):
        """The proc mesh this global tensor is laid out over."""
        from .dtensor import require_dist

        return require_dist(self, "device_mesh").mesh

    def item(self):
        """A one-element global tensor's value, fetched (as ``loss.item()`` of a DTensor loss gives it); a mesh
        tensor that is not distributed holds a value per rank: fetch the one you want (``fetch_shard``)."""
        if self._dist is None:
            return super().item()
        return self.full_tensor().item()

    def __float__(self):
        return float(self.item()) if self._dist is not None else super().__float__()

    def __int__(self):
        return int(self.item()) if self._dist is not None else super().__int__()

    def __bool__(self):
        return bool(self.item()) if self._dist is not None else super().__bool__()

    def full_tensor(self):
        """The whole value, fetched to the controller as a local CPU tensor."""
        from .dtensor import full_tensor

        return full_tensor(self)

    def redistribute(self, device_mesh=None, placements=None, *, sharding_spec=None):
        """This tensor with other placements; torch does the collectives, autograd flows through."""
        from .dtensor import redistribute

        return redistribute(self, device_mesh, placements, sharding_spec=sharding_spec)

    def to_local(self):
        """Each rank's shard as an ordinary mesh tensor (shape: rank 0's shard)."""
        from .dtensor import to_local

        return to_local(self)

    def _repr_html_(self) -> str:
        """Jupyter's display: a row per rank with what it holds (for a global tensor: its shard's shape). No
        value is read from the workers: fetch with ``fetch_shard``/``full_tensor()`` to see values."""
        from monarch_tensor.actor import _display

        ctx = self._ctx
        shape = ctx.pm._shape
        dims = list(shape.names)
        n = len(shape)
        if self._dist is None:
            known = "known here" if hasattr(self, "_val") else "on the workers"
            rows = [[*_display.coords(shape, i), tuple(self.shape), known] for i in range(n)]
            return _display.table(f"mesh tensor {tuple(self.shape)} {self.dtype} on {shape}",
                                  [*dims, "local shape", "value"], rows)
        places = self.placements
        rows = [[*_display.coords(shape, i), _shard_shape(tuple(self.shape), places, shape.dims,
                                                          _display.coords(shape, i))] for i in range(n)]
        return _display.table(f"DTensor {tuple(self.shape)} {self.dtype} on {shape}, placements "
                              f"{[str(p) for p in places]}", [*dims, "shard shape"], rows)

    def dist_repr(self) -> str:
        from .dtensor import dist_repr

        return dist_repr(self)
