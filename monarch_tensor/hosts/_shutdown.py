"""Shutdown: the script's procs stop at its exit (and at ``shutdown_context()``), its own actors' first."""

from __future__ import annotations

import atexit
import sys

from ..future import Future
from . import _script_proc, proc_mesh
from .proc_mesh import _live_meshes


def _shutdown() -> None:
    mesh = _script_proc._script_mesh  # first: its actors' __cleanup__ may still call actors on the procs
    if mesh is not None and mesh._runtime is not None:
        try:
            mesh.stop()
        except Exception:  # noqa: BLE001
            pass
    for mesh in list(_live_meshes):
        try:
            mesh.stop()
        except Exception:  # noqa: BLE001
            pass
    for host in [proc_mesh._local_host, *proc_mesh._other_hosts.values()]:
        if host is not None:
            host.close()


@atexit.register
def _shutdown_at_exit() -> None:
    """Stop this machine's procs; then remove this client session's default workspace root here, which its
    procs wrote and nothing reads any more (a killed script's goes with its template, ``_zygote``; a host
    agent's with the session, ``HostAgent._end``)."""
    _shutdown()
    sync = sys.modules.get("monarch_tensor.workspace_sync._proc")  # (imported by any sync from here)
    from ..transport import mailbox

    if sync is not None and mailbox._mailbox is not None:
        sync.remove_default_root(mailbox._mailbox.addr)


def shutdown_context(host_timeout: float | None = None) -> Future:
    """Stop every proc mesh this process spawned, and this machine's template process (Monarch's; it also
    runs at exit). The script goes on; a later ``spawn_procs`` starts a new template."""
    _shutdown()
    proc_mesh.forget_local_hosts()
    return Future.ready(None)
