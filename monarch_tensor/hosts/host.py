"""Hosts and proc meshes: ``this_host().spawn_procs(per_host={"gpus": 4})``.

Monarch's module path for ``HostMesh``, ``ProcMesh``, ``this_host()``, ``this_proc()`` and the rest; each
concern lives in a module of its own, which this one gathers:

* ``proc_mesh.py``: ``ProcMesh``, the proc meshes this process runs, this machine's template processes;
* ``host_mesh.py``: ``HostMesh`` and ``this_host()``;
* ``_spawn.py``: spawning procs (``per_host`` sizes, ``proc_mesh(gpus=4)``, ``heal_mesh``);
* ``_script_proc.py``: the script's own process as a proc mesh (``this_proc()``);
* ``_failures.py``: how this process learns of procs' deaths and actors' faults;
* ``_supervision.py``: the supervision thread (``__supervise__``, the fault hook, an unhandled fault);
* ``_shutdown.py``: stopping the procs at exit and at ``shutdown_context()``.

The template process that forks local procs is driven from ``local.py``; how procs start
(``BootstrapCommand``, ``bootstrap=``) is ``bootstrap.py``; host agents are ``agent.py`` and ``remote_hosts.py``.
"""

from __future__ import annotations

from typing import Any

from . import _script_proc as _script_proc_module
from . import _supervision as _supervision_module
from . import proc_mesh as _proc_mesh_module
from ._failures import _on_actor_fault, _on_proc_gone, _proc_exited, _tell_holders  # noqa: F401
from ._script_proc import ScriptProc, _script_lock, _script_proc, _script_proc_at, this_proc  # noqa: F401
from ._shutdown import _shutdown, _shutdown_at_exit, shutdown_context  # noqa: F401
from ._spawn import (  # noqa: F401
    HOST_PYTHON_ENV,
    _procs_shape,
    _spawn_procs,
    check_procs_per_host,
    heal_mesh,
    local_procs,
    per_host_sizes,
    proc_mesh,
    share_peers,
)
from ._supervision import (  # noqa: F401
    SUPERVISE_TIMEOUT_S,
    _await_on_actor_loop,
    _interrupted_for,
    _interrupted_lock,
    _on_actor_loop,
    _supervise,
    _supervise_later,
    _supervision_loop,
    _supervisor_lock,
    _to_supervise,
    _unhandled_fault,
    log,
)
from .bootstrap import BOOTSTRAP_TIMEOUT, bootstrap_plan, check_bootstrap, run_bootstrap  # noqa: F401
from .host_mesh import HostMesh, this_host  # noqa: F401
from .local import LocalHost, ProcInfo  # noqa: F401
from .proc_mesh import (  # noqa: F401
    ProcMesh,
    _agents_of,
    _live_meshes,
    _local_lock,
    _mesh_seq,
    _other_hosts,
    forget_local_hosts,
    local_host,
    stopped_addrs,
)

# Globals their modules rebind: read here, they are read there, now (a name imported once would stay stale).
_REBOUND = {"_local_host": _proc_mesh_module, "_script_mesh": _script_proc_module, "_supervisor": _supervision_module}


def __getattr__(name: str) -> Any:
    module = _REBOUND.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(module, name)
