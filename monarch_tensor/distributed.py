"""The seeds' ``from monarch.distributed import Mesh``: a mesh of procs on this machine by shape and dim names.

>>> device_mesh = Mesh(shape=(4, 2), mesh_dim_names=("data_parallel", "model_parallel"))
>>> device_mesh.size()
8
>>> dt = distribute(torch.randn(1024, 1024), device_mesh, sharding_spec=["data_parallel", None])
"""

from __future__ import annotations

from collections.abc import Sequence

from .hosts.host import ProcMesh, this_host


def Mesh(shape: Sequence[int] | int, mesh_dim_names: Sequence[str] | None = None) -> ProcMesh:
    """Spawn ``prod(shape)`` procs on this machine as a ``ProcMesh`` with those dims (named ``dim0``,
    ``dim1`` ... unless ``mesh_dim_names`` names them), like torch's ``init_device_mesh``."""
    dims = (shape,) if isinstance(shape, int) and not isinstance(shape, bool) else tuple(shape)
    if not dims or any(isinstance(d, bool) or not isinstance(d, int) or d < 1 for d in dims):
        raise ValueError(f"Mesh(shape=...) takes positive int sizes, such as (4, 2); got {shape!r}")
    names = tuple(mesh_dim_names) if mesh_dim_names is not None else tuple(f"dim{i}" for i in range(len(dims)))
    if len(names) != len(dims):
        raise ValueError(f"Mesh: {len(dims)} sizes {dims} but {len(names)} mesh_dim_names {names}")
    return this_host().spawn_procs(dict(zip(names, dims)))


__all__ = ["Mesh"]
