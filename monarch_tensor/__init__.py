"""monarch-tensor: a single-controller distributed tensor engine for PyTorch.

Users import from here (``monarch_tensor.actor`` for actors and meshes).
"""

from . import debugger as _debugger  # noqa: F401, E402 - registers the debugger's message handlers
from .actor import (  # noqa: F401
    Accumulator,
    Actor,
    ActorError,
    ActorMesh,
    Channel,
    Future,
    HostMesh,
    MeshFailure,
    Point,
    Port,
    PortReceiver,
    ProcMesh,
    SupervisionError,
    ValueMesh,
    context,
    current_rank,
    current_size,
    endpoint,
    get_or_spawn_controller,
    proc_mesh,
    this_host,
    this_proc,
)
from .shape import Shape  # noqa: F401
from .tools.config import Workspace  # noqa: F401

__version__ = "0.1.0"
