"""Monarch's ``monarch.common.device_mesh`` path (a proc mesh plays its ``DeviceMesh``'s part here:
``procs.activate()``, ``procs.rank(dim)``, ``procs.process_group(dims)``)."""

from monarch_tensor.controller.api import get_active_mesh, no_mesh, slice_mesh, to_mesh
from monarch_tensor.controller.process_group import RemoteProcessGroup
from monarch_tensor.hosts.host import ProcMesh as DeviceMesh  # (for isinstance checks and annotations)

__all__ = ["DeviceMesh", "RemoteProcessGroup", "get_active_mesh", "no_mesh", "slice_mesh", "to_mesh"]
