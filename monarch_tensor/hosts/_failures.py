"""How this process learns of failures of the procs and actors it holds: a proc it spawned exited
(``_proc_exited``, as the template reports it), another process passed on that a proc died or was stopped
(``_on_proc_gone``), an actor it spawned raised in a call nobody awaited (``_on_actor_fault``). Calls waiting on
a dead proc fail, the other processes of the tree are told, and the owner supervises (``_supervision.py``).
"""

from __future__ import annotations

import logging
import sys

from ..errors import MeshStoppedError, SupervisionError
from ..transport import _wire
from ..transport._fanout import send_many
from ..transport.mailbox import SYSTEM_HANDLERS, current_mailbox, local_mailboxes
from ..transport.messages import ActorFault, ReportProcGone, SendToPort
from . import _script_proc
from . import local as _local
from ._supervision import _supervise_later
from .local import ProcInfo
from .proc_mesh import _live_meshes

log = logging.getLogger("monarch_tensor.hosts.host")  # (the public module's name, for all its parts)


def _proc_exited(info: ProcInfo, status: str) -> None:
    from ..transport import _shm

    _shm.remove_files_of(info.pid)
    _shm.release_reader(info.addr)  # what it held of our messages (killed before it let go)
    info.alive = False
    info.exit_status = status
    mesh = info.owner
    if info.stopping:  # calls still waiting on it fail (not a supervision event: its mesh was stopped)
        why = getattr(getattr(mesh, "_alloc", None), "_stop_reason", "") or "stopped"
        stopped = MeshStoppedError(f"proc {info.addr} (rank {info.rank}) was stopped ({why}) before it answered")
        for mailbox in local_mailboxes():
            mailbox.proc_died(info.addr, stopped)
        _tell_holders(info.addr, stopped, up=True)
        return
    where = f"rank {info.rank} of proc mesh {mesh._shape if mesh else '?'}"
    died = "died during its start" if info.starting else "died"
    err = SupervisionError(f"proc {info.addr} ({where}, pid {info.pid}) {died}: {status}",
                           proc=info.addr, rank=info.rank, exit_status=status)
    observed = sum(mailbox.proc_died(info.addr, err) for mailbox in local_mailboxes())
    # Then its tensor workers' groups with it stop waiting for it (to form, or for a collective it broke:
    # Collectives._wait). After the calls above failed: a fetch that waits on such a group gets this death,
    # not the group's failure that the workers reply with once told.
    client = getattr(getattr(mesh, "_alloc", None), "_tensor_client", None)
    if client is not None:
        client.peers_died(info.rank)
    _tell_holders(info.addr, err, up=True)
    # A waiting caller got the error: that is handling it. One that died during its start (before it said
    # it serves) is no fault of a running mesh: the first call on it (spawning actors on the mesh, its
    # bootstrap) raises this error, which a fault would also have sent to the script that caught it.
    if mesh is not None and not observed and not info.starting:
        mesh._failed(err)


def _tell_holders(addr: str, error: BaseException, up: bool) -> None:
    """Tell every other process of the tree that the proc at ``addr`` died or was stopped (``error``): any of
    them may hold a mesh of it (an actor mesh passed to an actor, or returned to the script), and its calls to
    the proc would never be answered. Only the process that spawned the proc learns of it first hand, so the
    notice goes up to the script, as forwarded logs do, and from there down to every proc each process spawned
    (``_on_proc_gone``): one small message per proc per death, nothing on the call path. ``up``: from a proc,
    to its client; else (the script, or a notice on its way down) to this process's own live procs."""
    mailbox = current_mailbox()
    # A proc's runtime; None in the script, which need not import _proc for it (this may run at its exit).
    proc = sys.modules.get("monarch_tensor.runtime._proc")
    rt = proc.current_runtime() if proc is not None else None
    try:
        if up and rt is not None:
            mailbox.send(rt.client_addr, ReportProcGone(addr, error, True))
            return
        # (procs being stopped are left out: at exit every mesh stops at once; so are procs behind a lost host
        # agent, which nothing reaches)
        addrs = [p.addr for mesh in list(_live_meshes) for p in mesh._procs
                 if p.alive and not p.stopping and not getattr(getattr(p, "agent", None), "lost", "")]
        if addrs:
            send_many(mailbox, addrs, _wire.encode(ReportProcGone(addr, error, False)))
    except Exception as e:  # noqa: BLE001 - this process is stopping (its mailbox closed), or its client is gone
        log.debug("could not pass on that proc %s is gone: %r", addr, e)


def _on_proc_gone(mailbox, msg: ReportProcGone) -> None:
    """Another process learnt that the proc ``msg.proc`` died or was stopped: calls here waiting on it fail,
    and later ones are refused (``ActorMesh._check`` asks ``death_of``), with the error its owner's calls get.
    Not a supervision event here: its owner (the process that spawned it) supervises it. Passed on up to the
    script, or down to this process's own procs."""
    for mb in {mailbox, *local_mailboxes()}:  # (a script's in-process runtime's too: its actors' calls)
        if mb.death_of(msg.proc) is None:  # (its owner, and the processes the notice passed on its way up, know)
            mb.proc_died(msg.proc, msg.error)
    _tell_holders(msg.proc, msg.error, msg.up)


SYSTEM_HANDLERS[ReportProcGone] = _on_proc_gone


def _on_actor_fault(mailbox, msg: ActorFault) -> None:
    """An endpoint nobody awaited (called with ``broadcast``) raised, on an actor this process spawned (the
    actor goes on serving), or such an actor died (killed by its endpoint, or aborted): a supervision event for
    the actor mesh's owner (its ``__supervise__``, else ``unhandled_fault_hook``), as Monarch's, rather than a
    line in the proc's output only. Handled in order with procs' deaths (``_supervise_later``): a hook may
    block. Where the dying actor asks (``msg.ack``), it hears that the owner has the failure, and then answers
    the call that killed it."""
    from ..actor import _mesh_owners

    name = getattr(msg.error, "actor", "?")
    owner = _mesh_owners.get((msg.proc, name))
    if isinstance(msg.error, SupervisionError):  # the actor aborted itself (ActorAbortedError)
        err = msg.error
    else:
        what = getattr(msg.error, "message", None) or repr(msg.error)
        rank = getattr(msg.error, "rank", None)
        err = SupervisionError(f"{what} (in a call nobody awaited: a broadcast)", proc=msg.proc, rank=rank)
    err.mesh = next((m for m in [*_live_meshes, _script_proc._script_mesh] if m is not None and any(
        p.addr == msg.proc for p in m._procs)), None)
    _supervise_later(owner, err)
    if msg.ack is not None:  # the killed actor's caller may hear of it now: see _proc._FaultAck
        mailbox.send(msg.ack.addr, SendToPort(msg.ack.port_id, None, None, -1))


SYSTEM_HANDLERS[ActorFault] = _on_actor_fault


# The exits of this process's own procs (LocalHost's template reports them) go to its supervision.
_local.client_proc_exited = _proc_exited
