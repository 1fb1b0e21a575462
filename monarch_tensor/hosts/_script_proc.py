"""The script's own process as a proc mesh (``ScriptProc``), and ``this_proc()``."""

from __future__ import annotations

import logging
import os
import sys
import threading

from ..errors import MeshStoppedError
from ..future import Future
from ..runtime import _context
from ..shape import Shape
from ..transport.mailbox import current_mailbox, local_mailboxes, new_ipc_address
from .local import ProcInfo
from .proc_mesh import ProcMesh

log = logging.getLogger("monarch_tensor.hosts.host")  # (the public module's name, for all its parts)


def this_proc() -> ProcMesh:
    """The current process as a mesh of one proc (no dims): in a proc, that proc; in the script (its actors
    running in it included), the script's own process, whose actors run on an actor runtime of its own
    (``ScriptProc``), sharing the script's memory."""
    proc = sys.modules.get("monarch_tensor.runtime._proc")
    if proc is None or proc._runtime is None:  # the script
        return _script_proc()
    mailbox = current_mailbox()
    ctx = _context.current()
    return ProcMesh([ProcInfo(mailbox.addr, ctx.proc_rank)], Shape((), ()))


_context.this_proc_hook = this_proc


class ScriptProc(ProcMesh):
    """The script's own process as a proc mesh of one (``this_proc()`` in the script), as Monarch's: actors
    spawned on it run in the script's process, on an actor runtime (``_proc.start_in_script``) started on
    first use, on a thread of its own, with its own mailbox and event loop. They share the script's memory
    (its modules, their globals), and run as on any proc: their endpoints, constructors, supervision and
    ``context()`` alike; the script's own threads keep the script's mailbox. Stopping the mesh (and the
    script's exit) runs their ``__cleanup__`` and ends the runtime; a later ``this_proc()`` gives a new one."""

    def __init__(self) -> None:
        info = ProcInfo(new_ipc_address("inproc"), 0, os.getpid())
        super().__init__([info], Shape((), ()))
        info.owner = self
        self._runtime = None
        self._start_lock = threading.Lock()

    def _start(self) -> None:
        """Start the runtime, unless it runs (or this mesh was stopped: its calls say so)."""
        if self._runtime is not None or self._stopped:
            return
        from ..runtime import _proc

        with self._start_lock:
            if self._runtime is None:
                self._runtime = _proc.start_in_script(self._procs[0].addr, self._runtime_ended)

    def _check_alive(self) -> None:
        super()._check_alive()
        self._start()  # (whatever is sent to it next needs its address served)

    def _runtime_ended(self) -> None:
        """On the runtime's thread, once it stopped: calls still waiting on it fail, as for a stopped proc."""
        info = self._procs[0]
        if not info.alive:
            return
        info.alive = False
        info.exit_status = "stopped"
        why = self._stop_reason or "stopped"
        err = MeshStoppedError(f"the script's own proc {info.addr} was stopped ({why}) before it answered")
        for mailbox in local_mailboxes():
            mailbox.proc_died(info.addr, err)

    def _kill(self, p: ProcInfo) -> None:
        """A thread cannot be killed: one of its actors still runs a call after the stop's wait (its ``__cleanup__``
        did not run); the runtime is abandoned, its calls fail, and the thread ends with the script."""
        log.warning("the script's in-process actors did not stop within the stop timeout (an endpoint still "
                    "runs); they are abandoned")
        self._runtime_ended()

    def stop(self, reason: str = "stopped by client") -> Future:
        if self._runtime is None and not self._stopped:  # never started: nothing runs to stop
            if not isinstance(reason, str):
                raise TypeError(f"stop(reason=...) takes a string, got {reason!r}")
            self._stopped, self._stop_reason = True, reason
            self._runtime_ended()
            return Future.ready(None)
        return super().stop(reason)

    def __reduce__(self):
        # In this process it stays this very mesh (an actor's ``context().actor_instance.proc_mesh``, a mesh
        # sent back by an actor); elsewhere it is a plain mesh of one proc at its address. (``_portable``
        # pickles a copy: the live mesh is found by its address.)
        info = self._procs[0]
        live = _script_mesh
        if live is not None and live._procs[0].addr == info.addr:
            live._start()  # (who gets it may spawn on it: its address must be served)
        return _script_proc_at, (info.addr, info.pid, self._stopped, self._stop_reason)


_script_mesh: ScriptProc | None = None
_script_lock = threading.Lock()


def _script_proc() -> ScriptProc:
    global _script_mesh
    with _script_lock:
        if _script_mesh is None or _script_mesh._stopped:
            _script_mesh = ScriptProc()
        return _script_mesh


def _script_proc_at(addr: str, pid: int, stopped: bool, reason: str) -> ProcMesh:
    """Unpickles a ``ScriptProc``: in its script, the mesh itself."""
    mesh = _script_mesh
    if mesh is not None and mesh._procs[0].addr == addr:
        return mesh
    out = ProcMesh([ProcInfo(addr, 0, pid)], Shape((), ()))
    out._stopped, out._stop_reason = stopped, reason
    return out
