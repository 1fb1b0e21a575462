"""``HostMesh``: hosts to spawn procs on; ``this_host()``, the machine the script runs on.

>>> procs = this_host().spawn_procs(per_host={"gpus": 2})  # doctest: +SKIP
"""

from __future__ import annotations

import os
import shutil
from typing import Mapping

from ..config import setting
from ..future import CoroutineFuture, Future
from ..runtime import _hooks
from ..shape import MeshTrait, Shape
from ._spawn import HOST_PYTHON_ENV, _procs_shape, _spawn_procs, check_procs_per_host, per_host_sizes
from .bootstrap import bootstrap_plan, check_bootstrap, run_bootstrap
from .local import ProcInfo
from .proc_mesh import ProcMesh, _live_meshes, local_host


class HostMesh(MeshTrait):
    """Hosts you can spawn procs on. ``this_host()`` is the local machine (a mesh of one host, no dims);
    a job's hosts have a ``hosts`` dim, and slice, split and rename like any mesh."""

    def __init__(self, shape: Shape | None = None, python_exe: str | None = None) -> None:
        self._shape = shape or Shape((), ())
        self._python_exe = python_exe

    def _new_with_shape(self, shape: Shape) -> HostMesh:
        return HostMesh(shape, self._python_exe)

    def with_python_executable(self, python_exe: str) -> HostMesh:
        """The same hosts, whose procs run ``python_exe`` (Monarch's): another virtual environment, say.
        It must import this ``monarch_tensor`` and its dependencies (the script's ``sys.path`` is on its
        ``PYTHONPATH``); procs those procs spawn on their own host run it too."""
        if not isinstance(python_exe, str) or not python_exe:
            raise TypeError(f"with_python_executable() takes the path of a Python interpreter, got {python_exe!r}")
        path = shutil.which(python_exe)
        if path is None:
            raise FileNotFoundError(f"with_python_executable({python_exe!r}): no such executable")
        return HostMesh(self._shape, os.path.abspath(path))

    def _what(self) -> str:
        return f"host mesh {self._shape}"

    def spawn_procs(self, per_host: Mapping[str, int] | None = None, bootstrap=None, name: str | None = None,
                    proc_bind: list[dict[str, str]] | None = None, threads: int | None = None,
                    bootstrap_command=None) -> ProcMesh:
        """``spawn_procs(per_host={"gpus": 4})`` -> ProcMesh of shape {hosts..., "gpus": 4}; ``bootstrap``
        (a function of no arguments, or an async one) runs on every proc before this returns; ``proc_bind``
        binds each proc of a host to CPUs or NUMA nodes (see ``_bind.py``); ``threads``: torch's intra-op
        threads in each proc (default: ``OMP_NUM_THREADS``, else its share of the host's cores: see
        ``_threads.py``); ``bootstrap_command`` (Monarch's): a ``BootstrapCommand``, or a function of each
        proc's ``Point`` returning one: its program runs the procs, its env is added to theirs (see
        ``BootstrapCommand`` for what cannot be honoured here)."""
        from ..runtime import _bind, _threads

        check_bootstrap(bootstrap)
        threads = _threads.check(threads)
        per_host = per_host_sizes(per_host)
        shape = _procs_shape(self._shape, per_host)
        check_procs_per_host(per_host, len(shape))
        per = len(shape) // max(1, len(self._shape))
        proc_bind = _bind.check(proc_bind, per)
        _bind.check_here(proc_bind)
        python_exe, rank_envs = bootstrap_plan(bootstrap_command, shape, self._python_exe)
        mesh = _spawn_procs(shape, proc_bind, per, python_exe, threads=threads, rank_envs=rank_envs)
        mesh._proc_bind = proc_bind  # heal_mesh binds the new procs alike
        mesh._threads = threads  # and gives them as many threads
        return run_bootstrap(mesh, bootstrap)

    def _runs_here(self, p: ProcInfo) -> bool:
        return getattr(p, "agent", None) is None  # (a host agent's procs are on its host)

    def sync_workspace(self, workspace, conda: bool = False, auto_reload: bool = False) -> CoroutineFuture:
        """Mirror ``workspace`` onto these hosts' workspace roots and reload the procs running there (a Future
        that is a coroutine too, as ``ProcMesh.sync_workspace``).

        >>> await this_host().sync_workspace(Workspace(dirs=["./proj"]))  # doctest: +SKIP
        """
        return CoroutineFuture.of(self._sync_workspace(workspace, conda, auto_reload))

    def _sync_workspace(self, workspace, conda: bool, auto_reload: bool) -> Future:
        procs = [p for mesh in list(_live_meshes) for p in mesh._procs if p.alive and self._runs_here(p)]
        return _hooks.api("workspace_sync", "sync_this_host")(procs, workspace, auto_reload, conda=conda)

    @property
    def is_fake_in_process(self) -> bool:
        """Monarch's: whether these hosts are the script's own process standing in for hosts. Always False
        here: every host mesh has real procs (there is no in-process fake)."""
        return False

    @property
    def stream_logs(self) -> bool:
        """Whether procs spawned on these hosts stream their stdout and stderr to this script (Monarch's;
        ``configure(enable_log_forwarding=...)`` sets it, ``procs.logging_option`` switches running procs)."""
        from .. import config

        return bool(config.get("enable_log_forwarding"))

    @property
    def initialized(self) -> Future:
        """Resolves to True once the hosts are up (they are, once the mesh exists)."""
        return Future.ready(True)

    def stop(self) -> Future:
        """Stop every proc mesh this script spawned on these hosts; the hosts stay usable."""
        for mesh in [m for m in list(_live_meshes) if any(self._runs_here(p) for p in m._procs)]:
            mesh.stop()
        return Future.ready(None)

    def shutdown(self) -> Future:
        """Stop the procs on these hosts, and the hosts' agents where a job started them (the local
        machine itself stays, of course). Also what leaving ``async with hosts:`` does."""
        return self.stop()

    async def __aenter__(self) -> HostMesh:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.shutdown()

    def __repr__(self) -> str:
        return f"<HostMesh {self._shape}>"

    def _repr_html_(self) -> str:
        """Jupyter's display: a row per host and its coordinates."""
        from ..actor import _display

        n = len(self._shape)
        return _display.table(f"HostMesh {self._shape}", [*self._shape.names, "rank"],
                              [[*_display.coords(self._shape, i), i] for i in range(n)])


def this_host() -> HostMesh:
    """The machine this script runs on, as a host mesh of one host (in a proc started by a host mesh's
    ``with_python_executable``, of that interpreter)."""
    python_exe = setting(HOST_PYTHON_ENV) or None
    local_host(python_exe)  # start the template process early: it imports torch while the script goes on
    return HostMesh(python_exe=python_exe)
