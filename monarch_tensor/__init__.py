"""monarch-tensor: a single-controller distributed tensor engine for PyTorch.

Users import from here (``monarch_tensor.actor`` for actors and meshes).
"""

from . import _exit_status  # noqa: F401 - first: its atexit hook runs last
from . import debugger as _debugger  # noqa: F401 - registers the debugger's message handlers
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
from .config import (  # noqa: F401
    clear_runtime_config,
    configure,
    configured,
    get_global_config,
    get_runtime_config,
)
from .host import heal_mesh  # noqa: F401
from .selection import Selection  # noqa: F401
from .shape import Extent, NDSlice, Shape  # noqa: F401
from .tools.config import Workspace  # noqa: F401

__version__ = "0.1.0"

# The tensor engine (controller/), imported on first use so that `import monarch_tensor` stays light.
_ENGINE = {
    "fetch_shard": "monarch_tensor.controller.api", "inspect": "monarch_tensor.controller.api", "show": "monarch_tensor.controller.api", "remote": "monarch_tensor.controller.api",
    "reduce": "monarch_tensor.controller.api", "reduce_": "monarch_tensor.controller.api", "Stream": "monarch_tensor.controller.api",
    "no_mesh": "monarch_tensor.controller.api", "call_on_shard_and_fetch": "monarch_tensor.controller.api",
    "get_active_stream": "monarch_tensor.controller.api", "get_active_mesh": "monarch_tensor.controller.api", "to_mesh": "monarch_tensor.controller.api",
    "slice_mesh": "monarch_tensor.controller.api", "shard_batch": "monarch_tensor.controller.api", "preview": "monarch_tensor.controller.api", "coalescing": "monarch_tensor.controller.client",
    "compile": "monarch_tensor.controller.compile", "Tensor": "monarch_tensor.controller.tensor",
    "RemoteException": "monarch_tensor.controller.errors", "MeshTensorError": "monarch_tensor.controller.errors",
    "RemoteProcessGroup": "monarch_tensor.controller.process_group", "OpaqueRef": "monarch_tensor.worker.opaque",
    "OpaqueObject": "monarch_tensor.controller.opaque", "opaque_method": "monarch_tensor.controller.opaque",
    "grad_generator": "monarch_tensor.controller.gradient_generator", "grad_function": "monarch_tensor.controller.gradient_generator",
    # global sharded tensors (controller/dtensor.py, controller/placements.py, controller/sharding.py)
    "distribute": "monarch_tensor.controller.dtensor", "from_local": "monarch_tensor.controller.dtensor", "Shard": "monarch_tensor.controller.placements",
    "Replicate": "monarch_tensor.controller.placements", "Partial": "monarch_tensor.controller.placements",
    "ShardingError": "monarch_tensor.controller.placements", "module_to_mesh": "monarch_tensor.controller.sharding",
}


_SUBMODULES = ("checkpoint",)  # engine submodules, imported on first use too


def __getattr__(name: str):
    import importlib

    if name in _SUBMODULES:
        return importlib.import_module(f"{__name__}.{name}")
    mod = _ENGINE.get(name)
    if mod is None:
        raise AttributeError(f"module 'monarch_tensor' has no attribute {name!r}")
    return getattr(importlib.import_module(mod), name)
