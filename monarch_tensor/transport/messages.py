"""Every runtime message, one frozen record each, named as verbs.

A ``Port`` is an address (a proc's or client's ROUTER socket) plus a port id
owned by that mailbox; replies and channel values are sent to ports.
The handler for ``X`` in a proc is ``ProcRuntime.handle_X`` (worker side) or
``Mailbox.handle_X`` (any process); ``tests/test_wire.py`` checks that every
message round-trips and has a handler. The two hottest, ``CallEndpoint`` and
``SendToPort``, travel as tuples tagged with a short string (``_wire``'s
compact envelope): pickling a class by reference costs several times more.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from . import _wire


def _fast_reduce(cls):
    """Pickle a frozen slots dataclass as (cls, field values): several times cheaper than the default."""
    names = tuple(f.name for f in fields(cls))
    cls.__reduce__ = lambda self: (cls, tuple(getattr(self, n) for n in names))
    return cls


@_fast_reduce
@dataclass(frozen=True, slots=True)
class PortRef:
    """Where a value should go: a mailbox address and a port id in it."""

    addr: str
    port_id: int


@_fast_reduce
@dataclass(frozen=True, slots=True)
class SpawnActor:
    """Client -> proc: construct ``cls(*args, **kwargs)`` as actor ``name``; ack on ``reply``. ``proc_mesh``:
    the pickled proc mesh it is spawned on (``context().actor_instance.proc_mesh``), read when asked for.
    ``args_by_engine``: the arguments hold mesh tensors, and come instead in a call of ``__init__`` from the
    tensor engine's worker, which gives the constructor this rank's own tensors. ``ranks``: one message for the
    whole mesh (down the tree of host agents, its acks gathered up it): each proc's place in the mesh is the
    index of its own proc rank in ``ranks`` (``rank`` is then -1). ``cls``: the class, or its
    ``"package.module:Class"`` path, imported by the proc (a spawner that does not import it)."""

    name: str
    cls: Any
    args: tuple
    kwargs: dict
    rank: int
    shape: Any
    reply: PortRef
    proc_mesh: bytes | None = None
    args_by_engine: bool = False
    ranks: tuple | None = None


@dataclass(frozen=True, slots=True)
class GetController:
    """Proc -> the process that spawned it, passed up to the script: the job's controller actor ``name``
    (``get_or_spawn_controller``), spawned by the script the first time; its mesh, or the error, to ``reply``."""

    name: str
    cls: Any
    args: tuple
    kwargs: dict
    reply: PortRef


@_fast_reduce
@dataclass(frozen=True, slots=True)
class CallEndpoint:
    """Anyone -> proc: run ``actor.method(*args, **kwargs)``; send the result to ``reply`` (if any). ``shape``:
    the slice of the actor mesh the call went to (``context().message_rank``); None: the whole mesh."""

    actor: str
    method: str
    args: tuple
    kwargs: dict
    reply: PortRef | None
    shape: Any = None


@_fast_reduce
@dataclass(frozen=True, slots=True)
class SendToPort:
    """Anyone -> mailbox: deliver ``value`` (or raise ``error``) on port ``port_id``; ``rank`` of the sender.
    ``output_before``: ``(pid, stdout bytes, stderr bytes)`` that the sending proc had written when it sent
    this, which the receiver prints before it delivers the value (``logs.OutputHandled``); None: nothing new.
    Port 0 is no port: such a message only carries ``output_before``, for the messages that follow it (a
    relayed proc's batch of replies, ``Mailbox.output_mark``)."""

    port_id: int
    value: Any
    error: BaseException | None
    rank: int
    output_before: tuple | None = None


def call_envelope(actor: str, method: str, args: tuple, kwargs: dict, reply, shape) -> tuple | None:
    """The compact envelope of ``CallEndpoint(actor, method, args, kwargs, reply, shape)`` (made without the
    call itself), or None where it has none (a reply that is not a port, a shape that is not a ``Shape``)."""
    if shape is not None:  # a call to a slice: its shape as plain tuples (a Shape pickles several times slower)
        if type(reply) is not PortRef and reply is not None or type(shape).__name__ != "Shape":
            return None  # pickled as it is
        return ("\0call", actor, method, args, kwargs, None if reply is None else reply.addr,
                0 if reply is None else reply.port_id, (shape.names, shape.dims, shape.offset, shape.strides))
    if reply is None:
        return ("\0call", actor, method, args, kwargs, None, 0)
    if type(reply) is PortRef:
        return ("\0call", actor, method, args, kwargs, reply.addr, reply.port_id)
    return None  # not a port: pickled as it is


def _compact_call(m: CallEndpoint) -> tuple | CallEndpoint:
    envelope = call_envelope(m.actor, m.method, m.args, m.kwargs, m.reply, m.shape)
    return m if envelope is None else envelope


_shapes: dict[tuple, Any] = {}  # a call's shape as it travels -> the Shape (a few per mesh slice called)


def _shape_of(t: tuple):
    """The ``Shape`` of a compact call's shape tuple, made once per distinct shape (made, it is checked)."""
    shape = _shapes.get(t)
    if shape is None:
        from ..shape import Shape

        if len(_shapes) >= 1024:
            _shapes.clear()
        shape = _shapes[t] = Shape(*t)
    return shape


# The received calls and replies, and every port, are made without their frozen ``__init__`` (an
# ``object.__setattr__`` per field): each field set through its slot, about half the cost, the same object.
_new = object.__new__
_port_addr, _port_id = getattr(PortRef, "addr").__set__, getattr(PortRef, "port_id").__set__  # noqa: B009


def port_ref(addr: str, port_id: int) -> PortRef:
    """``PortRef(addr, port_id)``, made at half the cost."""
    port = _new(PortRef)
    _port_addr(port, addr)
    _port_id(port, port_id)
    return port


_call_fields = tuple(getattr(CallEndpoint, f.name).__set__ for f in fields(CallEndpoint))
_reply_fields = tuple(getattr(SendToPort, f.name).__set__ for f in fields(SendToPort))


def _call_from(t: tuple) -> CallEndpoint:
    actor, method, args, kwargs, reply, shape = _call_fields
    m = _new(CallEndpoint)
    actor(m, t[1])
    method(m, t[2])
    args(m, t[3])
    kwargs(m, t[4])
    reply(m, None if t[5] is None else port_ref(t[5], t[6]))
    shape(m, _shape_of(t[7]) if len(t) > 7 else None)
    return m


def reply_envelope(port_id: int, value: Any, error: BaseException | None, rank: int,
                   output_before: tuple | None = None) -> tuple:
    """The compact envelope of ``SendToPort(port_id, value, error, rank, output_before)``, made without it."""
    return ("\0reply", port_id, value, error, rank, output_before)


def _compact_reply(m: SendToPort) -> tuple:
    return reply_envelope(m.port_id, m.value, m.error, m.rank, m.output_before)


def _reply_from(t: tuple) -> SendToPort:
    port_id, value, error, rank, output_before = _reply_fields
    m = _new(SendToPort)
    port_id(m, t[1])
    value(m, t[2])
    error(m, t[3])
    rank(m, t[4])
    output_before(m, t[5])
    return m


_wire.COMPACT_ENCODERS.update({CallEndpoint: _compact_call, SendToPort: _compact_reply})  # type: ignore[dict-item]
_wire.COMPACT_DECODERS.update({"\0call": _call_from, "\0reply": _reply_from})


@_fast_reduce
@dataclass(frozen=True, slots=True)
class FoldedReplies:
    """Host agent -> caller: replies to a folded call (``Accumulator``) that agents combined on the way up. Each
    run ``(lo, hi, value)`` is the fold of the replies at positions ``lo..hi`` of the call's ranks, in order."""

    port_id: int
    runs: tuple


@dataclass(frozen=True, slots=True)
class GatheredReplies:
    """Host agent -> caller: plain replies of its own procs to a gathered ``call()`` (values of builtin types
    only, no error, no output to print first), read on the agent and sent up as one entry: ``values[i]`` is
    rank ``ranks[i]``'s reply to port ``port_id``."""

    port_id: int
    ranks: tuple
    values: tuple


@_fast_reduce
@dataclass(frozen=True, slots=True)
class ActorFault:
    """Proc -> the actor mesh's owner: an endpoint called with no reply port (``broadcast``, ``send`` without a
    port) raised ``error`` on proc ``proc``, or an actor died (a supervision event for its owner). ``ack``: the
    port the owner answers on once its ``__supervise__`` has the failure in order with the owner's later
    messages; the killed actor's caller hears of the death only then (``_proc._FaultAck``)."""

    proc: str
    error: BaseException
    ack: PortRef | None = None


@_fast_reduce
@dataclass(frozen=True, slots=True)
class ReportProcGone:
    """Up (a proc -> its client, ``up=True``), then down from the script (a client -> its procs): the proc at
    ``proc`` died or was stopped, ``error`` says which (``SupervisionError``, ``MeshStoppedError``). Only the
    process that spawned it learns of it first hand; every other process that holds a mesh of it fails its
    calls to it with ``error`` (``Mailbox.proc_died``), and supervises nothing: its owner does that."""

    proc: str
    error: BaseException
    up: bool


@_fast_reduce
@dataclass(frozen=True, slots=True)
class ForwardLogs:
    """Proc -> client: lines a proc wrote to stdout (``stream=1``) or stderr (``2``)."""

    rank: int
    stream: int
    lines: tuple[str, ...]


@_fast_reduce
@dataclass(frozen=True, slots=True)
class SetLogging:
    """Client -> proc: turn forwarding of stdout/stderr to the client on or off, set the root logger's
    ``level``; ack on ``reply``."""

    stream_to_client: bool
    reply: PortRef
    level: int = 20  # the proc's root logger level (logging.INFO)


@_fast_reduce
@dataclass(frozen=True, slots=True)
class KnowPeers:
    """Client -> its procs: what they need to reach the procs behind the host agents it attached to. Its
    procs on its own host get each agent's job key, ``(agent address, public, secret)`` in ``peers``; a
    proc behind an agent gets, in ``relayed``, the addresses of the other jobs' agents, which it reaches
    through the client's gateway (a job's key stays on its own hosts and the client's)."""

    peers: tuple
    relayed: tuple = ()


@_fast_reduce
@dataclass(frozen=True, slots=True)
class StopActor:
    """Client -> proc: stop actor ``name`` (``ActorMesh.stop``) after the calls that came before this; later
    calls fail saying ``reason``; ack on ``reply``."""

    name: str
    reason: str
    reply: PortRef


@_fast_reduce
@dataclass(frozen=True, slots=True)
class InterruptCall:
    """Client -> proc: the caller stopped waiting for the call that answers on ``reply`` (Ctrl-C, a notebook's
    stop button): not started, it is dropped; running, an async endpoint's task is cancelled and a synchronous
    one gets ``KeyboardInterrupt`` raised in it. Either way its caller is answered with an ``ActorError``."""

    reply: PortRef


@_fast_reduce
@dataclass(frozen=True, slots=True)
class StopProc:
    """Client -> proc: stop every actor and exit the process."""

    reason: str


def _compact_replies(m: GatheredReplies) -> tuple:
    return ("\0replies", m.port_id, m.ranks, m.values)


_wire.COMPACT_ENCODERS[GatheredReplies] = _compact_replies  # type: ignore[assignment]
_wire.COMPACT_DECODERS["\0replies"] = lambda t: GatheredReplies(t[1], t[2], t[3])
