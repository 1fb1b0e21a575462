"""monarch-tensor: a single-controller distributed tensor engine for PyTorch.

Users import from here (``monarch_tensor.actor`` for actors and meshes).

The tensor engine (``monarch_tensor.controller``), its workers (``monarch_tensor.worker``) and the data plane
(``monarch_tensor.rdma``) are sub-packages of this one. In the repository their folders sit beside this one
(``controller/ worker/ rdma/``); an install maps them in (pyproject.toml's ``package-dir``), and a checkout used
in place (its root on ``sys.path``) finds them through this package's ``__path__``.
"""

import os as _os

_root = _os.path.dirname(_os.path.dirname(_os.path.abspath(__file__)))
if not _os.path.isdir(_os.path.join(__path__[0], "controller")) and \
        _os.path.isfile(_os.path.join(_root, "controller", "__init__.py")):
    __path__.append(_root)
del _root

# The tools plug into every proc here, and only here: each proc imports their modules and runs their start
# hooks, and a host's template process cleans up after a killed client through them (runtime/_hooks.py).
from .runtime import _hooks as _proc_hooks

_proc_hooks.register("workspace_sync", serves=("monarch_tensor.workspace_sync._proc",),
                     start="monarch_tensor.workspace_sync._proc:on_start",
                     client_gone="monarch_tensor.workspace_sync._proc:on_client_gone",
                     session_end="monarch_tensor.workspace_sync._proc:on_session_end",
                     handlers=("monarch_tensor.workspace_sync._proc:HANDLERS",),
                     api={"sync_workspace": "monarch_tensor.workspace_sync:sync_workspace",     # ProcMesh's, a job's hosts'
                          "sync_this_host": "monarch_tensor.workspace_sync:sync_this_host"})  # HostMesh's
_proc_hooks.register("env", serves=("monarch_tensor.env._proc",), handlers=("monarch_tensor.env._proc:HANDLERS",),
                     api={"ProcEnv": "monarch_tensor.env:ProcEnv"})  # ProcMesh.env
_proc_hooks.register("debugger", serves=("monarch_tensor.debugger._proc",),
                     start="monarch_tensor.debugger._proc:on_start",
                     client_gone="monarch_tensor.debugger._server:on_client_gone",
                     handlers=("monarch_tensor.debugger:HANDLERS",))
# The debugger's handlers answer in every process, not only where the tools serve: a proc passes its ranks'
# breakpoints on to its client, which serves them.
_proc_hooks.install("debugger")
# The protocol modules above the transport whose records carry messages: a relay that cannot deliver a message
# still tells its sender (its reply port read from the record) where these are known (_wire.envelopes).
from .transport import _wire as _transport_wire

_transport_wire.add_envelope_modules("monarch_tensor.hosts.agent_messages", "monarch_tensor.workspace_sync.messages")
del _transport_wire

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
from .hosts.host import heal_mesh  # noqa: F401
from .runtime import _exit_status  # noqa: F401 - first: its atexit hook runs last
from .selection import Selection  # noqa: F401
from .shape import Extent, NDSlice, Shape  # noqa: F401
from .tools.config import Workspace  # noqa: F401

__version__ = "0.1.0"

# The tensor engine (monarch_tensor.controller), imported on first use so that `import monarch_tensor` stays
# light: name -> its module, under this package.
_ENGINE = {
    "fetch_shard": "controller.api", "inspect": "controller.api", "show": "controller.api", "remote": "controller.api",
    "reduce": "controller.api", "reduce_": "controller.api", "Stream": "controller.api",
    "no_mesh": "controller.api", "call_on_shard_and_fetch": "controller.api",
    "get_active_stream": "controller.api", "get_active_mesh": "controller.api", "to_mesh": "controller.api",
    "slice_mesh": "controller.api", "shard_batch": "controller.api", "preview": "controller.api", "coalescing": "controller.client",
    "compile": "controller.compile", "Tensor": "controller.tensor",
    "RemoteException": "controller.errors", "MeshTensorError": "controller.errors",
    "RemoteProcessGroup": "controller.process_group", "OpaqueRef": "worker.opaque",
    "OpaqueObject": "controller.opaque", "opaque_method": "controller.opaque",
    "grad_generator": "controller.gradient_generator", "grad_function": "controller.gradient_generator",
    # global sharded tensors (controller/dtensor.py, controller/placements.py, controller/sharding.py)
    "distribute": "controller.dtensor", "from_local": "controller.dtensor", "Shard": "controller.placements",
    "Replicate": "controller.placements", "Partial": "controller.placements",
    "ShardingError": "controller.placements", "module_to_mesh": "controller.sharding",
}


_SUBMODULES = ("checkpoint",)  # engine submodules, imported on first use too


def __getattr__(name: str):
    import importlib

    if name in _SUBMODULES:
        return importlib.import_module(f"{__name__}.{name}")
    mod = _ENGINE.get(name)
    if mod is None:
        raise AttributeError(f"module 'monarch_tensor' has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{mod}"), name)
