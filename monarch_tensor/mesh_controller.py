"""Monarch's ``monarch.mesh_controller`` path: ``spawn_tensor_engine(procs)``.

Here a proc mesh is its own tensor engine: its procs run the engine's workers from their start, and the mesh
plays the part of Monarch's ``DeviceMesh`` (``with dm.activate():``, ``dm.rank(dim)``, slicing). So
``spawn_tensor_engine`` checks the mesh and gives it back, and code written as Monarch's runs unchanged.
"""

from __future__ import annotations

from monarch_tensor.worker.errors import RemoteException

__all__ = ["RemoteException", "spawn_tensor_engine"]


def spawn_tensor_engine(proc_mesh):
    """The tensor engine of ``proc_mesh`` (Monarch's): the mesh itself, to ``activate()`` as a device mesh.

    >>> dm = spawn_tensor_engine(this_host().spawn_procs({"gpus": 2}))
    >>> with dm.activate():
    ...     t = torch.ones(3)
    """
    from .hosts.host import ProcMesh

    if not isinstance(proc_mesh, ProcMesh):
        raise TypeError(f"spawn_tensor_engine takes a proc mesh (this_host().spawn_procs(...)), "
                        f"got {type(proc_mesh).__name__}")
    proc_mesh._check_alive()  # a stopped mesh: MeshStoppedError now, not at the first op
    return proc_mesh
