"""Shutdown: the script's procs stop at its exit (and at ``shutdown_context()``), its own actors' first."""

from __future__ import annotations

from ..future import Future
from ..runtime import _hooks
from ..transport._at_exit import at_exit
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


@at_exit
def _shutdown_at_exit() -> None:
    """Stop this machine's procs; then the tools it used remove what they keep for this client session here
    (``_hooks.session_end``: the default workspace root, which its procs wrote and nothing reads any more (a killed script's goes with its template, ``_zygote``; a host
    agent's with the session, ``HostAgent._end``). Not at the exit of a child forked from the script (``os.fork``,
    then ``sys.exit``): the procs are the script's, which goes on using them."""
    _shutdown()
    from ..transport import mailbox

    if mailbox._mailbox is not None:  # (the tools this script used: a sync from here imported its hook's module)
        _hooks.session_end((mailbox._mailbox.addr,), loaded_only=True)


def shutdown_context(host_timeout: float | None = None) -> Future:
    """Stop every proc mesh this process spawned, and this machine's template process (Monarch's; it also
    runs at exit). The script goes on; a later ``spawn_procs`` starts a new template."""
    _shutdown()
    proc_mesh.forget_local_hosts()
    return Future.ready(None)
