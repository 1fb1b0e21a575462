"""Errors of the runtime, named for whose fault they are."""

from __future__ import annotations


def actor_label(name: str) -> str:
    """An actor mesh's name as shown (errors, ``current_actor_name()``, logs): the name it was spawned under,
    without the mark that keeps meshes of one name spawned by different processes apart on a proc
    (``actor._spawner_mark``: everything from a NUL on)."""
    return name.partition("\0")[0]


class ActorError(Exception):
    """An endpoint raised: the user's code failed on a remote actor.

    Carries the remote traceback (``.traceback``), the actor's name and rank;
    the actor itself keeps serving. ``.actor`` is the name as its proc knows it: that of a mesh a proc spawned
    ends in a NUL and its spawner's token (``actor_label`` drops it, as the message does).
    """

    def __init__(self, actor: str, rank: int, method: str, exc_repr: str, traceback: str,
                 exception: BaseException | None = None) -> None:
        self.actor, self.rank, self.method = actor, rank, method
        self.exc_repr, self.traceback, self.exception = exc_repr, traceback, exception
        super().__init__(actor, rank, method, exc_repr, traceback)

    def __reduce__(self):
        return (ActorError, (self.actor, self.rank, self.method, self.exc_repr, self.traceback,
                             self.exception))

    @property
    def message(self) -> str:
        """What failed, without the traceback (Monarch's ``ActorError.message``)."""
        return f"endpoint {actor_label(self.actor)}.{self.method} raised on rank {self.rank}: {self.exc_repr}"

    @property
    def exception_formatted(self) -> str:
        """The remote traceback, formatted (Monarch's name for ``.traceback``)."""
        return self.traceback

    def __str__(self) -> str:
        return f"{self.message}\nremote traceback:\n{self.traceback}"


class DeviceMeshError(Exception):
    """A mesh lost procs or hosts (the seeds' name, ``monarch.exceptions.DeviceMeshError``): the base of
    ``SupervisionError``, so ``except DeviceMeshError`` catches every node failure; ``heal_mesh(mesh)``
    gives a working mesh of the same sizes."""


class SupervisionError(DeviceMeshError, RuntimeError):
    """A proc or actor died (infrastructure failure, not an exception in user code).

    Raised in everything waiting on the dead proc, and on every later call to a
    mesh that includes it. Monarch calls this ``MeshFailure``. A ``RuntimeError``, as Monarch's is.
    """

    def __init__(self, message: str, *, proc: str = "", rank: int | None = None,
                 exit_status: str = "") -> None:
        self.proc, self.rank, self.exit_status = proc, rank, exit_status
        self.mesh = None  # the proc mesh it happened on, where known here (Monarch's ``failure.mesh``)
        super().__init__(message)

    def __str__(self) -> str:
        text = super().__str__()
        if not self.__dict__.get("_as_failure"):
            return text
        ranks = [] if self.rank is None else [self.rank]
        return f"MeshFailure(mesh_name={self.mesh_name or '<none>'}, crashed_ranks={ranks}, event={text})"

    def as_failure(self) -> SupervisionError:
        """This error as ``__supervise__`` and ``unhandled_fault_hook`` get it, Monarch's ``MeshFailure``: a
        copy, of the same class and attributes, shown as ``MeshFailure(mesh_name=..., crashed_ranks=[...],
        event=<this error's message>)`` (Monarch's form), while the error calls raise keeps its message."""
        if self.__dict__.get("_as_failure"):
            return self
        failure = type(self).__new__(type(self))
        failure.__dict__.update(self.__dict__)
        failure.args = self.args
        failure.__cause__, failure.__context__ = self.__cause__, self.__context__
        failure.__traceback__ = self.__traceback__
        failure.__dict__["_as_failure"] = True
        return failure

    def _text(self) -> str:
        """The failure's own message (``str()`` of it, where it is not shown as a ``MeshFailure``)."""
        return str(self.args[0]) if self.args else ""

    @property
    def mesh_name(self) -> str:
        """Which mesh failed (Monarch's): the actor mesh's name where an actor failed (``ActorFailedError``),
        else ``"proc mesh #N"`` for this script's N-th proc mesh; "" if unknown."""
        actor = getattr(self, "actor", "")
        if actor:
            return actor_label(actor)
        seq = getattr(getattr(self.mesh, "_alloc", None), "_seq", None)
        return f"proc mesh #{seq}" if seq is not None else ""

    def report(self) -> str:
        """A readable account of the failure: what failed, on which mesh and rank, and why."""
        lines = [str(self)]
        if self.mesh is not None:
            lines.append(f"  mesh: {self.mesh._label()}")
        if self.rank is not None:
            lines.append(f"  rank: {self.rank}")
        if self.proc:
            lines.append(f"  proc: {self.proc}")
        if self.exit_status:
            lines.append(f"  exit: {self.exit_status}")
        return "\n".join(lines)

    def __reduce__(self):
        return (_make_supervision_error, (self._text(), self.proc, self.rank, self.exit_status))


def _make_supervision_error(message, proc, rank, exit_status):
    return SupervisionError(message, proc=proc, rank=rank, exit_status=exit_status)


MeshFailure = SupervisionError


class ActorFailedError(SupervisionError):
    """An actor died while its proc goes on (Monarch's "The actor X and all its descendants have failed"): an
    endpoint raised a ``BaseException`` that is not an ``Exception`` (``SystemExit``, a custom one), or an
    endpoint with an explicit response port raised. The call that failed it raises this; its owner's
    supervision sees it (``__supervise__``, else ``unhandled_fault_hook``); calls to it fail. ``exception``:
    what the endpoint raised, where it could travel here; ``traceback``: its remote traceback."""

    def __init__(self, message: str, *, actor: str = "", rank: int | None = None, proc: str = "",
                 traceback: str = "", exception: BaseException | None = None) -> None:
        super().__init__(message, proc=proc, rank=rank)
        self.actor, self.traceback, self.exception = actor, traceback, exception

    def __reduce__(self):
        return (_make_actor_failure, (type(self), self._text(), self.actor, self.rank, self.proc, self.traceback,
                                      self.exception))


def _make_actor_failure(cls, message, actor, rank, proc, traceback="", exception=None):
    err = cls(message, actor=actor, rank=rank, proc=proc)
    err.traceback, err.exception = traceback, exception
    return err


class ActorAbortedError(ActorFailedError):
    """An actor stopped itself with a failure: ``context().actor_instance.abort(reason)`` (Monarch's). Its
    owner's supervision sees it (``__supervise__``, else ``unhandled_fault_hook``); calls to it fail."""


def _make_aborted_error(message, actor, rank, proc):  # (what errors pickled before ActorFailedError name)
    return ActorAbortedError(message, actor=actor, rank=rank, proc=proc)


class ProtocolError(Exception):
    """A message on the wire could not be decoded (a bug or a stray sender)."""


class MeshStoppedError(SupervisionError):
    """The mesh was stopped by its owner; calls on it are refused. A ``SupervisionError``, as Monarch raises
    for calls after ``stop()``, so ``except SupervisionError`` (and ``except DeviceMeshError``) catch it."""

    def __reduce__(self):
        return (_make_stopped_error, (type(self), self._text(), self.proc, self.rank, self.exit_status))


def _make_stopped_error(cls, message, proc, rank, exit_status):
    return cls(message, proc=proc, rank=rank, exit_status=exit_status)


class ActorStoppedError(MeshStoppedError, ActorError):  # type: ignore[misc] # (rank: an int here, as both take it)
    """A call reached actors that ``stop()`` stopped: an ``ActorError`` naming the actor, rank and endpoint, and
    a ``SupervisionError`` (``MeshStoppedError``), which is what Monarch raises for it."""

    def __init__(self, actor: str, rank: int, method: str, reason: str) -> None:
        self.actor, self.rank, self.method, self.reason = actor, rank, method, reason
        self.exc_repr, self.traceback, self.exception = f"actor {actor_label(actor)!r} was stopped ({reason})", "", None
        self.proc, self.exit_status, self.mesh = "", "", None
        Exception.__init__(self, self.exc_repr)

    def __str__(self) -> str:
        return self.message

    def __reduce__(self):
        return (ActorStoppedError, (self.actor, self.rank, self.method, self.reason))


# ---- hosts and jobs (agent.py, remote_hosts.py, job/) ---------------------------------
class JobKeyError(Exception):
    """The job's CURVE key is missing, malformed, readable by others, or not the one the peer expects."""


class HostUnreachableError(DeviceMeshError):
    """No host agent answered at an address in time (nothing listens there, or the network drops it)."""


class AddressInUseError(Exception):
    """A host agent could not listen: something else already holds that address."""


class JobStartError(Exception):
    """A job's hosts did not come up: the scheduler refused it, it never left the queue, or an agent died."""


class SyncError(Exception):
    """A workspace sync failed on a host (its disk, its permissions); the message names the host."""
