"""Actors, endpoints and their adverbs: Monarch's public actor API.

>>> from monarch_tensor.actor import Actor, endpoint, this_host
>>> class Counter(Actor):
...     def __init__(self, start: int):
...         self.n = start
...     @endpoint
...     def incr(self) -> int:
...         self.n += 1
...         return self.n
>>> procs = this_host().spawn_procs(per_host={"gpus": 2})
>>> counters = procs.spawn("counter", Counter, 0)
>>> counters.incr.call().get().values()
[1, 1]
>>> counters.slice(gpus=0).incr.call_one().get()
2
"""

from __future__ import annotations

import base64
import functools
import inspect
import logging
import operator
import os
import random
import secrets
import sys
import threading
import weakref
from collections.abc import Mapping
from typing import Any, Callable, Generic, Iterator, TypeVar

import cloudpickle

from .. import config  # noqa: F401 - monarch_tensor.actor.config, as Monarch's monarch.actor.config
from .. import future as _future_mod
from ..errors import ActorError, MeshFailure, SupervisionError, actor_label
from ..future import Future, returns_future
from ..hosts import host as _host
from ..hosts.bootstrap import BootstrapCommand, default_bootstrap_cmd
from ..hosts.host import (
    HostMesh,
    ProcMesh,
    proc_mesh,
    shutdown_context,
    this_host,
    this_proc,
)
from ..hosts.local import ProcInfo
from ..runtime import _context, _names
from ..runtime._context import ActorContext as Context
from ..runtime._port import Port
from ..shape import Extent, MeshTrait, Point, Shape
from ..transport import _fanout, _wire
from ..transport import channel as _channel
from ..transport._ports import Collector, FoldCollector, OneReply, Receiver, StreamCollector
from ..transport.channel import ChannelTransport, enable_transport  # Monarch's names, here
from ..transport.mailbox import SYSTEM_HANDLERS, Mailbox, current_mailbox
from ..transport.messages import CallEndpoint, GetController, PortRef, SendToPort, SpawnActor, call_envelope
from .telemetry import get_meter, span, traced

R = TypeVar("R")
A = TypeVar("A")  # an actor mesh's actor class

__all__ = [
    "Actor", "ActorError", "ActorMesh", "Accumulator", "BootstrapCommand", "Channel", "Context", "Extent", "Future",
    "HostMesh", "default_bootstrap_cmd",
    "MeshFailure", "NotAnEndpoint", "Point", "Port", "PortReceiver", "ProcMesh", "RankedPortReceiver",
    "SupervisionError", "ChannelTransport", "enable_transport",
    "ValueMesh", "as_endpoint", "concurrent_endpoint", "context", "current_actor_name", "current_rank",
    "current_size", "endpoint", "get_meter", "get_or_spawn_controller", "gpu_direct_rdma_supported",
    "local_proc_mesh", "proc_mesh", "returns_future", "send", "shutdown_context", "span", "this_host", "this_proc",
    "traced", "unhandled_fault_hook",
]

local_proc_mesh = proc_mesh  # Monarch's older name for a mesh of procs on this host: local_proc_mesh(gpus=4)


def gpu_direct_rdma_supported() -> bool:
    """Whether the data plane can move GPU memory with RDMA directly (Monarch's): an RDMA device (the
    ``verbs`` backend, which registers CUDA memory through dmabuf) and a GPU are both present."""
    from .. import _seams

    if not _seams.get("is_ibverbs_available")():
        return False
    import torch

    return torch.cuda.is_available()


class Actor:
    """Base class of actors. Methods marked ``@endpoint`` can be called remotely."""

    @property
    def logger(self) -> logging.Logger:
        """A logger named for the actor's class, at DEBUG (Monarch's ``self.logger``). With no handler set up,
        Python prints WARNING and above to the proc's stderr, which reaches the script as its output does."""
        lgr = logging.getLogger(type(self).__name__)
        lgr.setLevel(logging.DEBUG)
        return lgr


def endpoint(fn: Callable | None = None, **options):
    """Mark a method (sync or ``async def``) as callable from other processes."""
    if fn is None:
        return functools.partial(endpoint, **options)
    unknown = set(options) - {"explicit_response_port", "propagator", "propagate", "instrument"}
    if unknown:
        raise TypeError(f"@endpoint got unknown option(s) {sorted(unknown)}; it takes explicit_response_port=")
    if inspect.isgeneratorfunction(fn) or inspect.isasyncgenfunction(fn):
        raise TypeError(f"endpoint {fn.__qualname__} is a generator: endpoints return one value; return a list, "
                        f"or send values through a port (Channel.open(), or explicit_response_port=True)")
    fn._is_endpoint = True
    fn._endpoint_coro = inspect.iscoroutinefunction(fn)  # so that procs need not ask on every call
    # With explicit_response_port=True the endpoint gets the caller's reply port as its first argument
    # (after self) and answers with port.send(value) instead of returning it (Monarch's).
    fn._explicit_port = bool(options.get("explicit_response_port", False))
    fn._propagate = options.get("propagate", options.get("propagator"))  # the result's shapes, for rref()
    return fn


def concurrent_endpoint(fn: Callable | None = None, **options):
    """An ``async def`` endpoint whose calls run as background tasks (Monarch's): the actor takes its next
    message as soon as one starts, so calls overlap at their ``await``s (plain endpoints of an actor run one
    at a time). Calls start in the order they arrive. An exception reaches the caller as ``ActorError``, as
    any endpoint's does. Takes ``@endpoint``'s options."""
    if fn is None:
        return functools.partial(concurrent_endpoint, **options)
    if getattr(fn, "_is_endpoint", False):
        raise ValueError(f"@concurrent_endpoint does not wrap @endpoint ({fn.__qualname__}): use one of the two; "
                         f"@concurrent_endpoint takes @endpoint's options itself")
    if not inspect.iscoroutinefunction(fn):  # (Monarch's error type: concurrent.py's _wrap_endpoint)
        raise ValueError(f"@concurrent_endpoint needs an async def: {getattr(fn, '__qualname__', fn)} is not one "
                         f"(a plain def blocks the actor however it is marked)")
    fn = endpoint(fn, **options)
    fn._concurrent = True
    return fn


def _interrupt_call(info: tuple) -> None:
    """A wait on a call's Future was interrupted: tell each proc it went to (``InterruptCall``)."""
    from ..transport.messages import InterruptCall

    if callable(info):  # the tensor engine's: MeshClient.withdraw
        info()
        return
    addrs, port = info
    mailbox = current_mailbox()
    for addr in addrs:
        try:
            mailbox.send(addr, InterruptCall(port))
        except Exception:  # noqa: BLE001 - a proc gone meanwhile: nothing runs there to stop
            pass
    mailbox.flush()


_future_mod._interrupt_hook = _interrupt_call


def unhandled_fault_hook(failure: SupervisionError) -> None:
    """Called with a failure nothing handled (a proc that died, and no owner's ``__supervise__`` returned
    True); replace it to handle failures yourself: a hook that returns drops the fault.

    The default (Monarch's) writes the failure to stderr and raises ``SystemExit``. A hook that raises leaves
    the fault unhandled: the script's main thread then gets a ``KeyboardInterrupt``, so that its ``finally``
    blocks, context managers and ``atexit`` hooks run as it ends. (In a proc, an unhandled fault ends the
    proc, whose owner is told in turn.)
    """
    sys.stderr.write(f"monarch_tensor: unhandled supervision failure, exiting: {failure}\n")
    sys.stderr.flush()
    sys.exit(1)


def _call_fault_hook(err: SupervisionError) -> None:
    sys.modules[__name__].unhandled_fault_hook(err)


# ---- context ---------------------------------------------------------------------
def context() -> _context.ActorContext:
    """The running actor's context (name, rank); in the client script, the client's."""
    return _context.current()


def current_rank() -> Point:
    """Where the running actor lies in the mesh the current message was sent to (Monarch's: ``context().
    message_rank``): ``current_rank().rank``, ``current_rank()["gpus"]``. A call to a slice
    ``actors.slice(gpus=slice(2, 4))`` finds its actors at ranks 0 and 1 of it; in ``__init__`` and for
    calls to the whole mesh, the actor's rank in the mesh it was spawned as (``context().actor_instance.rank``)."""
    return _context.current().message_rank


def current_actor_name() -> str:
    """The running actor's name and rank (``"counter[3]"``); ``"client"`` in the script."""
    ctx = _context.current()
    return "client" if _context.in_client() else f"{ctx.name}[{ctx.rank.rank}]"


def current_size() -> dict[str, int]:
    """The sizes of the mesh the current message was sent to (``current_rank()``'s extent, Monarch's)."""
    extent = _context.current().message_rank.extent
    return {k: extent[k] for k in extent}


# ---- results ---------------------------------------------------------------------
class ValueMesh(MeshTrait, Generic[R]):
    """One value per rank of a mesh: ``item(gpus=1)``, ``items()``, ``values()``."""

    def __init__(self, shape: Shape, values: list[R]) -> None:
        self._shape = Shape(shape.names, shape.dims)
        self._values = list(values)
        if len(self._values) != len(self._shape):  # (item() would then answer for a rank the mesh lacks)
            raise ValueError(f"ValueMesh: {len(self._values)} values for the {len(self._shape)} ranks of "
                             f"{self._shape}")

    @classmethod
    def from_indexed(cls, shape: Shape, pairs) -> ValueMesh:
        """A value mesh of ``shape`` from ``(rank, value)`` pairs, a later pair for a rank winning (Monarch's);
        every rank needs a value."""
        n = len(shape)
        values: dict[int, Any] = {}
        for pair in pairs:
            try:
                rank, value = pair
            except (TypeError, ValueError):
                raise TypeError(f"from_indexed takes (rank, value) pairs, got {pair!r}") from None
            if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < n:
                raise ValueError(f"from_indexed: rank {rank!r} is not one of the {n} ranks of {shape}")
            values[rank] = value
        missing = [r for r in range(n) if r not in values]
        if missing:
            raise ValueError(f"from_indexed: no value for rank(s) {missing[:10]} of {shape}")
        return cls(shape, [values[r] for r in range(n)])

    def item(self, **coords: int) -> R:
        if set(coords) != set(self._shape.names):
            raise KeyError(f"item() needs every dimension {list(self._shape.names)}, got {list(coords)}")
        return self._values[self._shape.slice(**coords).offset]

    def items(self) -> Iterator[tuple[Point, R]]:
        for i, v in enumerate(self._values):
            yield self._shape.point(i), v

    def values(self) -> list[R]:
        return list(self._values)

    def get(self, rank: int) -> R:
        """The value of the ``rank``-th point of this mesh (row-major, as ``items()`` counts)."""
        if isinstance(rank, bool) or not isinstance(rank, int):
            raise TypeError(f"ValueMesh.get() takes an int rank, got {rank!r}")
        if not 0 <= rank < len(self._values):
            raise IndexError(f"rank {rank} is out of range for value mesh {self._shape} of {len(self._values)} values")
        return self._values[rank]

    def __iter__(self):
        return self.items()

    def _new_with_shape(self, shape: Shape) -> ValueMesh[R]:
        """The values of a slice (``values.slice(hosts=0).item(gpus=1)``), or of a split, rename or flatten."""
        return ValueMesh(shape, [self._values[r] for r in shape.ranks()])

    def _what(self) -> str:
        return f"value mesh {self._shape}"

    def __eq__(self, other) -> bool:
        if not isinstance(other, ValueMesh):
            return NotImplemented
        return (tuple(self._shape.names), tuple(self._shape.dims), self._values) == \
            (tuple(other._shape.names), tuple(other._shape.dims), other._values)

    __hash__ = None  # values may change meaning; equal meshes need not hash alike

    def __repr__(self) -> str:
        return f"ValueMesh({self._shape}, {self._values!r})"

    def _repr_html_(self) -> str:
        """Jupyter's display: a row per rank, its coordinates and its value."""
        from . import _display

        names = list(self._shape.names)
        return _display.table(f"ValueMesh {self._shape}", [*names, "value"],
                              [[*_display.coords(self._shape, i), v] for i, v in enumerate(self._values)])


# ---- actor meshes ------------------------------------------------------------------
class ActorMesh(MeshTrait, Generic[A]):
    """Actors of one class on a proc mesh (``ActorMesh[Counter]``, generic as Monarch's); attribute access gives
    endpoints, which hide the mesh's own methods and properties of the same name (``ActorMesh.stop(mesh)``
    reaches the mesh's; see ``_YieldsToEndpoint``)."""

    def __init__(self, name: str, cls: type, procs: list[ProcInfo], shape: Shape,
                 spawned: Future | None = None, proc_mesh: ProcMesh | None = None, whole: Shape | None = None,
                 stopped: dict[int, str] | None = None, watch: _SpawnCollector | None = None) -> None:
        self._name, self._class, self._procs, self._shape = name, cls, procs, shape
        self._label = actor_label(name)  # the name as shown (``_name`` is the one its procs know)
        self._watch = watch  # the spawn's replies (this process spawned it): told once anyone waits on the mesh
        self._rank_list = shape.ranks()  # read on every call: computed once (never mutated)
        self._addr_list: list[str] | None = None  # their procs' addresses (``_addrs``), made on the first call
        self._behind_agents = False  # whether each of them is a proc behind a host agent (made with _addr_list)
        self._spawned = spawned or Future.ready(None)
        self._proc_mesh = proc_mesh
        self._whole = shape if whole is None else whole  # the shape it was spawned with
        # What calls tell the actors of where they lie (``message_rank``): None for the whole mesh.
        self._sent_shape = None if shape == self._whole else shape
        # rank -> the reason, for the actors this process stopped (``stop``); shared with the mesh's slices.
        self._stopped: dict[int, str] = {} if stopped is None else stopped

    def __reduce__(self):
        return (ActorMesh, (self._name, self._class, self._procs, self._shape, None, None, self._whole))

    def __getattr__(self, method: str) -> Endpoint:
        if method.startswith("_"):
            raise AttributeError(method)
        fn = getattr(self._class, method, None)
        if fn is None or not callable(fn):
            raise AttributeError(f"{self._class.__name__} has no endpoint {method!r}")
        if not getattr(fn, "_is_endpoint", False):
            return NotAnEndpoint(self, method)
        # Kept on the mesh, as Monarch's meshes keep theirs: the next ``mesh.method`` is a plain attribute (a
        # loop of calls does not build one per call). An endpoint holds no state of its own to change.
        ep = self.__dict__[method] = Endpoint(self, method)
        return ep

    def __dir__(self) -> list[str]:
        """The mesh's own names and its actors' endpoints (tab completion in a notebook or a REPL)."""
        eps = [n for n in dir(self._class) if not n.startswith("_") and getattr(getattr(self._class, n, None),
                                                                                "_is_endpoint", False)]
        return sorted(set(super().__dir__()) | set(eps))

    def _new_with_shape(self, shape: Shape) -> ActorMesh:
        return ActorMesh(self._name, self._class, self._procs, shape, self._spawned, self._proc_mesh, self._whole,
                         self._stopped, self._watch)

    def _what(self) -> str:
        return f"actor mesh {self._label!r}"

    def _observe(self) -> None:
        """Someone waits on these actors (a call, ``initialized``): a constructor's failure is theirs to see."""
        if self._watch is not None:
            self._watch.seen = True

    @property
    def initialized(self) -> Future:
        self._observe()
        return self._spawned

    def stop(self, reason: str = "stopped by client") -> Future:
        """Stop these actors (Monarch's ``ActorMesh.stop``), not their procs, in order with their calls: the
        calls sent before it run, then ``__cleanup__`` runs, and every call after it fails with an
        ``ActorError`` that gives ``reason``; the name may then be spawned again. A Future of None, once
        every actor has stopped."""
        from ..transport.messages import StopActor

        if not isinstance(reason, str):
            raise TypeError(f"stop(reason=...) takes a string, got {reason!r}")
        members = [self._procs[r] for r in self._rank_list if self._procs[r].alive]
        pm = self._proc_mesh
        if not members or (pm is not None and pm._alloc._stopped):
            return Future.ready(None)
        mailbox = current_mailbox()
        col = Collector([p.addr for p in members], [p.rank for p in members], lambda _: None,
                        f"stop of actor mesh {self._label!r}", observing=False)
        port = mailbox.open_port(col)
        for p in members:
            mailbox.send(p.addr, StopActor(self._name, reason, port))
            p.actors.discard(self._name)
        for r in self._rank_list:  # (later calls are refused here, at the call: see _check)
            self._stopped.setdefault(r, reason)
        return col.future

    def __await__(self):
        self._observe()
        yield from self._spawned.__await__()
        return self

    def _addrs(self) -> list[str]:
        """The addresses of the procs of ``_rank_list``, in its order (made once: a proc's address never changes;
        never mutated)."""
        addrs = self._addr_list
        if addrs is None:
            addrs = [self._procs[r].addr for r in self._rank_list]
            self._behind_agents = all("|" in a for a in addrs)
            self._addr_list = addrs
        return addrs

    def _check(self, method: str = "", mailbox: Mailbox | None = None) -> None:
        """Refuse a call of ``method`` on this mesh: its procs stopped or died, or its actors stopped by ``stop``
        here (the error their proc would answer with; a broadcast's would be nobody's, and end the script as an
        unhandled failure). Where none of that can be, it is seen without a Python step per rank."""
        pm = self._proc_mesh
        if pm is not None and pm._alloc._stopped:
            from ..errors import MeshStoppedError

            raise MeshStoppedError(f"the proc mesh of actor mesh {self._label!r} was stopped "
                                   f"({pm._alloc._stop_reason})")
        if mailbox is None:
            mailbox = current_mailbox()
        ranks = self._rank_list
        if self._stopped.keys().isdisjoint(ranks) and all(map(_ALIVE, map(self._procs.__getitem__, ranks))) \
                and not mailbox.any_death_among(self._addrs()) \
                and (pm is not None or _host.stopped_addrs.isdisjoint(self._addrs())):
            return
        for r in ranks:  # (something is amiss: the first rank it concerns, in order, says what)
            p = self._procs[r]
            if pm is None and p.addr in _host.stopped_addrs:
                from ..errors import MeshStoppedError

                raise MeshStoppedError(f"the proc mesh of actor mesh {self._label!r} was stopped")
            if not p.alive:
                raise SupervisionError(f"actor {self._label} rank {r}: its proc {p.addr} died: {p.exit_status}",
                                       proc=p.addr, rank=r, exit_status=p.exit_status)
            death = mailbox.death_of(p.addr)
            if death is not None:
                raise death
            if r in self._stopped:
                from ..errors import ActorStoppedError

                raise ActorStoppedError(self._name, r, method, self._stopped[r])

    def __repr__(self) -> str:
        return f"<ActorMesh {self._label!r} {self._class.__name__} {self._shape}>"


class _YieldsToEndpoint:
    """One of the mesh's own methods or properties (``stop``, ``slice``, ``size``, ``initialized`` ...) that an
    endpoint of the same name hides, as in Monarch, whose ``ActorMesh`` sets every endpoint of its actor class
    as an attribute of the mesh: ``trainer.stop`` is the ``stop`` endpoint of a ``Trainer`` that has one, the
    mesh's own ``stop`` otherwise. Looked up on each access (the actor class is the mesh's, so slices and meshes
    unpickled in other procs agree). The mesh's own stays reachable on the class: ``ActorMesh.stop(trainer)``,
    ``ActorMesh.slice(trainer, gpus=0)``; the package's own code calls it so on meshes of users' classes."""

    def __init__(self, name: str, own: Any) -> None:
        self._name, self._own = name, own
        self.__doc__ = getattr(own, "__doc__", None)

    def __get__(self, mesh: ActorMesh | None, owner: type | None = None) -> Any:
        if mesh is None:
            return self._own  # ActorMesh.stop: the mesh's own
        if getattr(getattr(mesh._class, self._name, None), "_is_endpoint", False):
            return Endpoint(mesh, self._name)
        return self._own.__get__(mesh, owner)


for _name in [n for n in dir(ActorMesh) if not n.startswith("_")]:
    setattr(ActorMesh, _name, _YieldsToEndpoint(_name, inspect.getattr_static(ActorMesh, _name)))
del _name


# (proc address, actor name) -> who spawned it there from this process (its context; None: the script): the
# owner that hears of a failure of a call nobody awaited (``host._on_actor_fault``).
_mesh_owners: dict[tuple[str, str], _context.ActorContext | None] = {}


_mark: tuple[int, str] = (0, "")


def _spawner_mark() -> str:
    """What a mesh spawned from this process adds to its name on the procs, so that meshes of one name that
    different processes spawn on the same procs (each rank of an actor mesh spawning ``"worker"``, say) are
    meshes of their own, as in Monarch, and a call, which names its actor, reaches its own mesh's. The script's
    meshes keep their plain name; a proc's get a NUL and a token of its own (new after a fork: procs fork from
    one template). Never shown: ``errors.actor_label``."""
    global _mark
    from ..runtime import _proc

    if _proc._runtime is None and _context.in_client():  # the script
        return ""
    pid = os.getpid()
    if _mark[0] != pid:
        _mark = (pid, "\0" + secrets.token_hex(8))
    return _mark[1]


def _spawn_actor_mesh(procs: ProcMesh, name: str, cls: type, args: tuple, kwargs: dict,
                      rename: bool = True, implementation: str | None = None) -> ActorMesh:
    """Spawn actors of ``cls`` named ``name`` on ``procs``. A name that actors this process spawned there still
    use gives a second, independent actor mesh (Monarch's: a name is a label, each spawn a mesh of its own),
    under ``name<2>``, ``name<3>``...: its actors' name, errors and ``current_actor_name()`` say so. Without
    ``rename`` (the runtime's own actors, whose name is their address) such a name is refused.
    ``implementation``: ``"package.module:Class"``, what the procs construct (imported there, not here), when
    ``cls`` only declares the endpoints that the returned mesh calls."""
    if not (isinstance(cls, type) and issubclass(cls, Actor)):
        raise TypeError(f"spawn() needs a subclass of Actor, got {cls!r}")
    if implementation is not None:
        _names.check(implementation, "spawn's implementation")
    if not isinstance(name, str) or not name:
        raise ValueError(f"actor name must be a non-empty string, got {name!r}")
    if "\0" in name:  # (the mark of a proc's spawns starts with one: _spawner_mark)
        raise ValueError(f"actor name must not contain a NUL character, got {name!r}")
    procs._check_alive()
    members = procs._members()
    mark = _spawner_mark() if rename else ""
    taken = [p.rank for p in members if name + mark in p.actors]
    if taken and not rename:
        raise ValueError(f"an actor named {name!r} already runs on proc(s) of rank {taken} of this mesh: spawn "
                         f"it under another name (the running one keeps its state)")
    if taken:
        k = 2
        while any(f"{name}<{k}>{mark}" in p.actors for p in members):
            k += 1
        name = f"{name}<{k}>"
    name += mark
    shape = Shape(procs._shape.names, procs._shape.dims)
    mailbox = current_mailbox()
    if isinstance(procs._alloc, _host.ScriptProc):  # this_proc() of the script: its runtime starts on first use
        procs._alloc._start()
    addrs = [p.addr for p in members]
    # Acks only come after the sends below, so `mesh` is bound by the time finish runs.
    owner = None if _context.in_client() else _context.current()
    col = _SpawnCollector(addrs, list(range(len(members))), lambda _: mesh, f"spawn of actor mesh {name!r}",
                          observing=False)
    col.name, col.cls, col.owner, col.procs = name, cls, owner, procs
    col.seen = not rename  # (the runtime's own actors: a failed constructor is their user's error)
    port = mailbox.open_port(col)
    mesh = ActorMesh(name, cls, members, shape, col.future, procs, watch=col)
    if owner is not None:
        _context.own(mesh)  # (it stops with the actor that spawned it)
    for p in members:
        p.actors.add(name)
        _mesh_owners[(p.addr, name)] = owner

    def failed(f: Future) -> None:  # a constructor that raised: the name may be used again
        if f.exception() is not None:
            for p in members:
                p.actors.discard(name)

    col.future.add_done_callback(failed)
    portable = procs._portable()
    ranks = tuple(p.rank for p in members)
    made = cls if implementation is None else implementation  # (a class path: resolved on the procs)
    i = 0
    try:
        try:
            if len(addrs) > 1 and _fanout.GATHER and _context.in_client() and all("|" in a for a in addrs) and \
                    len(set(ranks)) == len(ranks):  # procs behind host agents: one message down their tree
                up = PortRef(_fanout.GATHER_PREFIX + port.addr, port.port_id)  # (its acks gathered up it)
                msg = SpawnActor(name, made, args, kwargs, -1, shape, up, portable, ranks=ranks)
                _fanout.send_many(mailbox, addrs, _wire.encode_for(msg, addrs, mailbox)[0], (port.addr, port.port_id))
                return mesh
            for i, p in enumerate(members):
                mailbox.send(p.addr, SpawnActor(name, made, args, kwargs, i, shape, port, portable))
        except Exception as e:
            errors = sys.modules.get("monarch_tensor.controller.errors")
            if i != 0 or errors is None or not isinstance(e, errors.MeshTensorError):  # (none was sent)
                raise
            # Mesh tensors among the arguments: each rank's constructor gets its own, through the tensor engine.
            from .. import _seams

            for i, p in enumerate(members):
                mailbox.send(p.addr, SpawnActor(name, made, (), {}, i, shape, port, portable, args_by_engine=True))
            _seams.get("call_actor")(mesh, mesh._rank_list, "__init__", args, kwargs, None)
    except BaseException:  # e.g. arguments that cannot be pickled: nothing was spawned, the name is free
        if i == 0:
            for p in members:
                p.actors.discard(name)
            mailbox.close_port(port.port_id)
        raise
    return mesh


class _SpawnCollector(Collector):
    """A spawn's replies. A constructor that raised on a proc before anyone waited on the actor mesh (a call,
    ``initialized``, ``await mesh``) is a supervision event for the mesh's owner, one per proc, as Monarch's:
    its ``__supervise__``, else ``unhandled_fault_hook``. One somebody waits on is theirs (their call or
    ``initialized`` raises it)."""

    seen = False
    name, cls, owner, procs = "", None, None, None

    def deliver(self, msg) -> bool:
        err = msg.error
        if err is not None and not self.seen and isinstance(err, ActorError) and err.method == "__init__":
            from ..errors import ActorFailedError
            from ..hosts import host

            addr = self.addr_of(msg.rank)
            failure = ActorFailedError(
                f"The actor {actor_label(self.name)} and all its descendants have failed: {self.cls.__name__} rank {msg.rank}: "
                f"__init__ raised {err.exc_repr} (an actor mesh nobody waited on yet)", actor=self.name,
                rank=msg.rank, proc=addr, traceback=err.traceback, exception=err.exception)
            failure.mesh = self.procs
            host._supervise_later(self.owner, failure)
        return super().deliver(msg)


_ALIVE = operator.attrgetter("alive")
_ENVELOPE_BYTES = 512  # about what a call's envelope holds besides its arguments (names, reply port, shape)
_signatures: dict = {}  # (class, wire method) -> (signature, its leading args, fewest and most positional args)


def _positional_bounds(sig: inspect.Signature, leading: tuple) -> tuple[float, float]:
    """How many positional arguments (after ``leading``) a call without keywords may pass so that ``sig`` binds
    them: (fewest, most); (inf, -1) when such a call needs the full check (a required keyword-only one)."""
    lo, hi = 0, 0
    for p in sig.parameters.values():
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD):
            hi += 1
            lo += p.default is p.empty
        elif p.kind is p.VAR_POSITIONAL:
            hi = float("inf")
        elif p.kind is p.KEYWORD_ONLY and p.default is p.empty:
            return float("inf"), -1
    return lo - len(leading), hi - len(leading)


def _signature(cls: type, method: str, wire_method: str) -> tuple:
    """What checks a call's arguments against its endpoint's signature: ``(signature or None, leading, lo,
    hi)``, found once per class and method (``_check_arguments``). ``wire_method``: the method as sent
    (``"name/port"``: as_endpoint(..., explicit_response_port=True))."""
    entry = _signatures.get((cls, wire_method))
    if entry is None:
        fn = inspect.getattr_static(cls, method, None)
        try:
            sig = inspect.signature(fn) if inspect.isfunction(fn) else None  # (a staticmethod and such: unchecked)
        except (TypeError, ValueError):
            sig = None
        explicit = wire_method.endswith("/port") or ("/" not in wire_method and getattr(fn, "_explicit_port", False))
        leading = (None, None) if explicit else (None,)  # self (and port)
        lo, hi = (0, float("inf")) if sig is None else _positional_bounds(sig, leading)
        entry = _signatures[(cls, wire_method)] = (sig, leading, lo, hi)
    return entry


def _check_arguments(cls: type, method: str, entry: tuple, args: tuple, kwargs: dict) -> None:
    """A call's arguments must fit its endpoint's signature (``entry``, from ``_signature``): a ``TypeError``
    at the call, as Monarch's (not an ``ActorError`` from every rank later, nor only a log line for a
    broadcast). A call without keywords is checked by its count of arguments alone (what binding it would
    decide)."""
    sig, leading, lo, hi = entry
    if sig is None or (not kwargs and lo <= len(args) <= hi):
        return
    try:
        sig.bind(*leading, *args, **kwargs)
    except TypeError as e:
        raise TypeError(f"{cls.__name__}.{method}(): {e}") from None


class Endpoint(Generic[R]):
    """``mesh.method``: call it with an adverb (``call``, ``call_one``, ``broadcast`` ...)."""

    def __init__(self, mesh: ActorMesh, method: str, plain: str = "") -> None:
        self._mesh, self._method = mesh, method
        self._what = f"reply of {mesh._label}.{method}"
        # as_endpoint(): the method is not an @endpoint, and the proc is told so ("name/plain", or
        # "name/port" for explicit_response_port), since it otherwise refuses to run one.
        self._wire_method = f"{method}/{plain}" if plain else method
        self._propagate = None  # as_endpoint(propagate=...); else the @endpoint's
        self._sig: tuple | None = None  # _signature's, found at the first call

    def __repr__(self) -> str:
        return f"<endpoint {self._mesh._label}.{self._method} of {self._mesh._what()} {self._mesh._shape}>"

    def _check(self, args: tuple, kwargs: dict) -> None:
        entry = self._sig
        if entry is None:
            entry = self._sig = _signature(self._mesh._class, self._method, self._wire_method)
        _check_arguments(self._mesh._class, self._method, entry, args, kwargs)

    def _send(self, ranks: list[int], args, kwargs, port: PortRef | None, addrs: list[str] | None = None,
              fold: dict | None = None, mailbox: Mailbox | None = None) -> None:
        if mailbox is None:
            mailbox = current_mailbox()
        if addrs is None:
            addrs = self._mesh._addrs() if ranks is self._mesh._rank_list else [self._mesh._procs[r].addr for r in ranks]
        if self._mesh._watch is not None:
            self._mesh._watch.seen = True
        if len(addrs) == 1:  # a call of immutable values waits in a batch as its envelope (Mailbox.send_plain)
            size = _wire.frozen_size(args, 2)
            if size >= 0 and kwargs:
                size = -1 if (k := _wire.frozen_size(tuple(kwargs.items()), 3)) < 0 else size + k
            # (the rest of the envelope is immutable and plain by making: strings, ints, the shape's tuples of them,
            # and the kwargs dict, which the adverbs make for each call and nothing changes)
            envelope = None if size < 0 else call_envelope(self._mesh._name, self._wire_method, args, kwargs, port,
                                                          self._mesh._sent_shape)
            if envelope is not None and mailbox.send_plain(addrs[0], envelope, size + _ENVELOPE_BYTES):
                return
        msg = CallEndpoint(self._mesh._name, self._wire_method, args, kwargs, port, self._mesh._sent_shape)
        try:
            encoded = _wire.encode_for(msg, addrs, mailbox)
        except Exception as e:
            errors = sys.modules.get("monarch_tensor.controller.errors")
            if errors is None or not isinstance(e, errors.MeshTensorError):
                raise
            # Mesh tensors among the arguments: each rank gets its own, through the tensor engine.
            from .. import _seams

            if port is not None and port.addr.startswith(_fanout.GATHER_PREFIX):  # (the engine replies itself)
                port = PortRef(port.addr[len(_fanout.GATHER_PREFIX):], port.port_id)
            _seams.get("call_actor")(self._mesh, ranks, self._wire_method, args, kwargs, port)
            return
        if len(addrs) > 1 and "|" in addrs[0]:  # procs behind host agents: down the fan-out tree
            gather = None
            if port is not None and port.addr.startswith(_fanout.GATHER_PREFIX):  # their replies up it, gathered
                gather = (port.addr[len(_fanout.GATHER_PREFIX):], port.port_id)
            _fanout.send_many(mailbox, addrs, encoded[0], gather, fold)
            return
        for addr, frames in zip(addrs, encoded):
            mailbox.send_frames(addr, frames, batch=True)

    def _collect(self, ranks: list[int], args, kwargs, finish, fold: tuple | None = None) -> Future:
        """Call ``ranks``; ``finish`` builds the future's value from their replies, or ``fold`` = (identity,
        combine, spec) folds them (``Accumulator``; ``spec``: what the agents may fold, or None)."""
        self._check(args, kwargs)
        mailbox = current_mailbox()
        try:
            self._mesh._check(self._method, mailbox)
        except Exception as e:  # noqa: BLE001 - surfaces on .get()
            return Future.failed(e)
        whole = ranks is self._mesh._rank_list
        addrs = self._mesh._addrs() if whole else [self._mesh._procs[r].addr for r in ranks]
        if not _context.in_client() and _context.current().actor_name == self._mesh._name and mailbox.addr in addrs:
            return Future.failed(RuntimeError(
                f"{self._mesh._label}.{self._method}: an actor calls itself and would wait for its own reply, which "
                f"can only come after the running endpoint returns (a deadlock); call the method directly, or queue "
                f"the call with broadcast()"))
        if fold is not None:
            col = FoldCollector(addrs, ranks, fold[0], fold[1], self._what)
        elif finish is _first:
            col = OneReply(addrs[0], self._what)
        else:
            col = Collector(addrs, ranks, finish, self._what)
        port = mailbox.open_port(col)
        gathered = finish is not _first and len(addrs) > 1 and _fanout.GATHER and _context.in_client() and \
            (self._mesh._behind_agents if whole else all("|" in a for a in addrs))  # they gather the replies
        if gathered:
            port = PortRef(_fanout.GATHER_PREFIX + port.addr, port.port_id)
        self._send(ranks, args, kwargs, port, addrs, fold[2] if gathered and fold is not None else None, mailbox)
        col.future._interrupt = (addrs, port)  # (what an interrupted wait stops: _interrupt_call)
        return col.future

    def call(self, *args, **kwargs) -> Future[ValueMesh[R]]:
        """Call every actor of the mesh; a ``ValueMesh`` of their results."""
        shape = self._mesh._shape
        return self._collect(self._mesh._rank_list, args, kwargs, lambda vs: ValueMesh(shape, vs))

    def call_one(self, *args, **kwargs) -> Future[R]:
        """Call the single actor of a one-actor mesh (slice first)."""
        ranks = self._mesh._rank_list
        if len(ranks) != 1:
            raise ValueError(f"call_one() needs a mesh of exactly one actor, but {self._mesh._label!r} has "
                             f"{len(ranks)} ({self._mesh._shape}); slice it or use call()")
        return self._collect(ranks, args, kwargs, _first)

    def choose(self, *args, **kwargs) -> Future[R]:
        """Call one actor of the mesh, picked at random among the live ones."""
        live = [r for r in self._mesh._rank_list if self._mesh._procs[r].alive]
        if not live:
            self._mesh._check(self._method)  # a stopped mesh says so (MeshStoppedError), as every adverb does
            return Future.failed(SupervisionError(f"no live actor left in {self._mesh._label!r}"))
        return self._collect([random.choice(live)], args, kwargs, _first)

    def broadcast(self, *args, **kwargs) -> None:
        """Call every actor without waiting for results."""
        self._check(args, kwargs)
        self._mesh._check(self._method)
        self._send(self._mesh._rank_list, args, kwargs, None)

    def send(self, args: tuple = (), kwargs: dict | None = None, port: Port | None = None) -> None:
        """Low-level: call every actor; results (if ``port``) go to that port."""
        _check_send_args(args, kwargs)
        if port is not None and not isinstance(port, Port):
            raise TypeError(f"send(port=...) needs a Port (from Channel.open()), got {type(port).__name__} {port!r}")
        self._check(tuple(args), dict(kwargs or {}))
        self._mesh._check(self._method)
        self._send(self._mesh._rank_list, tuple(args), dict(kwargs or {}), port._ref if port else None)

    def stream(self, *args, **kwargs) -> Iterator[Future[R]]:
        """Call every actor now; the returned generator yields a future per reply, in the order replies
        arrive (Monarch's): ``for f in counters.value.stream(): print(f.get(timeout=10))``."""
        self._check(args, kwargs)
        self._mesh._check(self._method)
        ranks = self._mesh._rank_list
        mailbox = current_mailbox()
        col = StreamCollector([self._mesh._procs[r].addr for r in ranks], ranks)
        port = mailbox.open_port(col)
        self._send(ranks, args, kwargs, port)
        mailbox.flush()
        return (col.recv() for _ in ranks)

    def rref(self, *args, **kwargs):
        """Call the endpoint on every rank as a tensor-engine instruction; its tensor results come back as mesh
        tensors (shapes from ``@endpoint(propagate=...)``), used by later ops without a round trip (Monarch's)."""
        from .. import _seams

        actor_rref = _seams.get("actor_rref")
        self._check(args, kwargs)
        self._mesh._check(self._method)
        propagate = self._propagate
        if propagate is None:
            propagate = getattr(getattr(self._mesh._class, self._method, None), "_propagate", None)
        return actor_rref(self._mesh, self._method, self._wire_method, propagate, args, kwargs)

    def __call__(self, *args, **kwargs):
        raise TypeError(f"call an endpoint through an adverb: {self._method}.call(...), .call_one(...), "
                        f".broadcast(...), .choose(...), .stream(...) or .rref(...)")


class NotAnEndpoint:
    """``mesh.method`` where ``method`` is not an ``@endpoint``: ``as_endpoint(mesh.method)`` makes it one."""

    def __init__(self, mesh: ActorMesh, method: str) -> None:
        self._mesh, self._method = mesh, method

    def _why(self) -> str:
        return (f"{self._mesh._class.__name__}.{self._method} is not annotated as an endpoint: add @endpoint to it, "
                f"or wrap it: as_endpoint({self._mesh._label}.{self._method}).call(...)")

    def __call__(self, *args, **kwargs):
        raise RuntimeError(self._why())

    def __getattr__(self, name: str):
        if name.startswith("_"):
            raise AttributeError(name)
        raise AttributeError(self._why())

    def __repr__(self) -> str:
        return f"<not an endpoint: {self._mesh._label}.{self._method}>"


def as_endpoint(not_an_endpoint: NotAnEndpoint, *, propagate=None, explicit_response_port: bool = False) -> Endpoint:
    """Call a spawned actor's method that is not an ``@endpoint`` through the adverbs (Monarch's):
    ``as_endpoint(mesh.method).call(...)``. With ``explicit_response_port=True`` the method gets the
    caller's port as its first argument and answers with ``port.send(v)``; ``propagate`` gives its
    results' shapes for ``rref()``, as ``@endpoint(propagate=...)`` does."""
    if isinstance(not_an_endpoint, Endpoint):
        raise ValueError(f"{not_an_endpoint._mesh._label}.{not_an_endpoint._method} is an @endpoint already: "
                         f"call it directly")
    if not isinstance(not_an_endpoint, NotAnEndpoint):
        raise ValueError(f"as_endpoint() expects a method of a spawned actor mesh (mesh.method), got "
                         f"{not_an_endpoint!r}")
    ep = Endpoint(not_an_endpoint._mesh, not_an_endpoint._method, "port" if explicit_response_port else "plain")
    ep._propagate = propagate
    return ep


def _check_send_args(args, kwargs) -> None:
    """``send``'s arguments are a tuple and a dict, not the call's own: ``send(ep, 5, {})`` is not ``ep(5)``."""
    if not isinstance(args, (tuple, list)):
        raise TypeError(f"send() takes the call's positional arguments as a tuple, e.g. (5,), got {args!r}")
    if kwargs is not None and not isinstance(kwargs, Mapping):
        raise TypeError(f"send() takes the call's keyword arguments as a dict, e.g. {{'k': 1}}, got {kwargs!r}")


def send(endpoint: Endpoint, args: tuple, kwargs: dict, port: Port | None = None, selection: str = "all") -> None:
    """Fire-and-forget call of ``endpoint`` on its mesh (Monarch's ``send``): results, if ``port`` is given,
    go to that port (``Channel.open()``). ``selection``: ``"all"`` the whole mesh, ``"choose"`` one live rank."""
    _check_send_args(args, kwargs)
    if not isinstance(endpoint, Endpoint):
        rf = sys.modules.get("monarch_tensor.controller.remote_functions")  # (where a remote function comes from)
        if rf is not None and isinstance(endpoint, rf.Remote) and selection == "all":
            endpoint.send(args, kwargs, port)  # Monarch's Remote is an endpoint: every proc of the active mesh
            return
        raise TypeError(f"send() needs an endpoint (mesh.method), got {endpoint!r}")
    if selection == "all":
        endpoint.send(args, kwargs, port)
        return
    if selection != "choose":
        raise ValueError(f"send(selection=...) takes 'all' or 'choose', got {selection!r}")
    if port is not None and not isinstance(port, Port):
        raise TypeError(f"send(port=...) needs a Port (from Channel.open()), got {type(port).__name__} {port!r}")
    mesh = endpoint._mesh
    mesh._check(endpoint._method)
    live = [r for r in mesh._rank_list if mesh._procs[r].alive]
    if not live:
        raise SupervisionError(f"no live actor left in {mesh._label!r}")
    endpoint._send([random.choice(live)], tuple(args), dict(kwargs or {}), port._ref if port else None)


def _first(values: list):
    return values[0]


# Reductions the host agents fold without being told they are associative, and the types they fold them for:
# exact there whatever the other replies are (``operator.add`` is not: ints summed on an agent, then added to a
# float of an earlier rank, round differently than added to it one by one).
_KNOWN_FOLDS: dict[Callable, tuple[str, ...]] = {
    max: ("int", "bool", "str"), min: ("int", "bool", "str"), operator.and_: ("int", "bool"),
    operator.or_: ("int", "bool"), operator.xor: ("int", "bool"),
}
_UNSET = object()


class Accumulator(Generic[R]):
    """Fold the results of ``endpoint.call`` with ``combine``, starting from ``identity`` (Monarch's), in the
    order of the mesh's ranks: ``combine(...combine(combine(identity, r0), r1)..., rN)``.

    >>> total = Accumulator(counters.value, 0, operator.add, associative=True).accumulate().get()
    >>> Accumulator(counters.value, 0, max).accumulate().get()

    On procs behind host agents the agents fold the replies as they gather them, so the controller receives a
    few values per root agent instead of one per rank, wherever that gives the rank-order fold's result:

    * the known reductions ``max``, ``min`` (of ``int``, ``bool``, ``str`` replies) and ``operator.and_``,
      ``or_``, ``xor`` (of ``int``, ``bool``): exact whatever the other replies are, so folded there undeclared;
    * any ``combine`` with ``associative=True`` (``operator.add`` too): you declare ``combine(combine(a, b), c)
      == combine(a, combine(b, c))`` over ``identity`` and the replies, and that it takes two replies too. Agents
      combine replies of consecutive ranks, never reordering them (so it need not be commutative): the result is
      the rank-order fold bracketed by the tree, which for floats may differ from it in rounding.

    What the agents leave unfolded (errors, which fail the call naming their rank; values that travel with
    buffers, such as arrays and tensors; values of other types; a pair ``combine`` raised on; everything where
    ``combine`` cannot be pickled here or unpickled there, e.g. a function of a module the hosts cannot
    import) the controller folds in, at its place. ``combine`` runs on the agents' message loop: keep it quick.
    """

    def __init__(self, endpoint: Endpoint, identity: Any, combine: Callable[[Any, Any], Any], *,
                 associative: bool = False) -> None:
        if not callable(getattr(endpoint, "call", None)):  # (else accumulate() fails on None.call)
            raise TypeError(f"Accumulator(endpoint=...) needs an endpoint (mesh.method), got {endpoint!r}")
        if not callable(combine):
            raise TypeError(f"Accumulator(combine=...) must be callable, got {combine!r}")
        if not isinstance(associative, bool):
            raise TypeError(f"Accumulator(associative=...) takes True or False, got {associative!r}")
        self._endpoint, self._identity, self._combine = endpoint, identity, combine
        self._associative = associative
        self._spec: dict | None | object = _UNSET

    def _fold_spec(self) -> dict | None:
        """What the agents may fold (``_gather.fold_of``'s spec), made once; None: the controller folds alone."""
        if self._spec is _UNSET:
            try:
                exact = None if self._associative else _KNOWN_FOLDS.get(self._combine)
            except TypeError:  # an unhashable callable
                exact = None
            spec = None
            if self._associative or exact is not None:
                try:
                    data = cloudpickle.dumps(self._combine, protocol=5)
                except Exception:  # noqa: BLE001 - cannot travel: the controller folds
                    data = None
                if data is not None:
                    spec = {"f": base64.b64encode(data).decode()}
                    if exact is not None:
                        spec["e"] = list(exact)
            self._spec = spec
        return self._spec

    def accumulate(self, *args, **kwargs) -> Future:
        """Call the endpoint on every rank; a Future of the fold of their results."""
        ep = self._endpoint
        if isinstance(ep, Endpoint):
            return ep._collect(ep._mesh._rank_list, args, kwargs, None,
                               (self._identity, self._combine, self._fold_spec()))
        out = Future("accumulated reply")

        def done(f: Future) -> None:
            if f.exception():
                out._set_exception(f.exception())
                return
            acc = self._identity
            try:
                for v in f.get().values():
                    acc = self._combine(acc, v)
            except Exception as e:  # noqa: BLE001 - user code: the waiter gets it
                out._set_exception(e)
                return
            out._set_result(acc)

        self._endpoint.call(*args, **kwargs).add_done_callback(done)
        return out


# ---- channels ------------------------------------------------------------------------
class PortReceiver(Generic[R]):
    """The receiving end of a channel: ``recv()`` returns a Future of the next value, in order."""

    _ranked = False

    def __init__(self, receiver: Receiver, lifetime: object | None = None) -> None:
        self._r = receiver
        self._lifetime = lifetime  # shared by the channel's receivers: the port closes when the last goes

    def recv(self) -> Future[R]:
        fut = self._r.recv(self._ranked)
        if hasattr(fut, "_lifetime"):  # still waiting: it keeps the channel open, held or not
            fut._lifetime = self._lifetime
        return fut

    def ranked(self) -> RankedPortReceiver:
        """A receiver of the same channel whose ``recv()`` gives ``(rank, value)``: the rank of the sender in
        its actor mesh (0 for the client script)."""
        return RankedPortReceiver(self._r, self._lifetime)

    def __repr__(self) -> str:
        return f"<{type(self).__name__}{' once' if self._r._once else ''}, {len(self._r._values)} values waiting>"


class RankedPortReceiver(PortReceiver):
    """``recv()`` gives ``(sender's rank, value)``."""

    _ranked = True


class _ChannelLifetime:
    __slots__ = ("__weakref__",)


class Channel(Generic[R]):
    """``port, receiver = Channel.open()``; ``Channel.open(once=True)`` takes one value;
    ``Channel.open_ranked()`` receives ``(sender's rank, value)``."""

    @staticmethod
    def open(once: bool = False) -> tuple[Port, PortReceiver]:
        r = Receiver(once=bool(once))
        mailbox = current_mailbox()
        ref = mailbox.open_port(r)
        # Once no receiver of the channel is left, nobody can take its values: its port closes (values sent
        # to it later are dropped, as for any closed port). Every channel stayed open before, ~2 KB each.
        lifetime = _ChannelLifetime()
        weakref.finalize(lifetime, mailbox.close_port_later, ref.port_id)
        return Port(ref), PortReceiver(r, lifetime)

    @staticmethod
    def open_ranked(once: bool = False) -> tuple[Port, RankedPortReceiver]:
        port, receiver = Channel.open(once)
        return port, receiver.ranked()


class _Executor(Actor):
    """``ProcMesh.execute``'s actor: runs the functions it is sent."""

    @endpoint
    def run(self, fn, args: tuple, kwargs: dict):
        return fn(*args, **kwargs)


# ---- singletons --------------------------------------------------------------------------
_controllers: dict[str, ActorMesh] = {}
_controllers_lock = threading.RLock()


# How long the script takes to spawn a controller for an actor that asked for it (a constructor that does not
# return fails the request after it).
CONTROLLER_SPAWN_TIMEOUT = 600.0


def get_or_spawn_controller(name: str, actor_class: type, *args, **kwargs) -> Future[ActorMesh]:
    """One actor named ``name`` per job, as Monarch's: the script spawns it in its own process (``this_proc()``,
    the script's in-process actor runtime) the first time, and every later call, in the script or in any actor
    of the job (a proc's asks the script), gets that one."""
    with _controllers_lock:
        mesh = _controllers.get(name)
        if mesh is not None and mesh._proc_mesh is not None and mesh._proc_mesh._alloc._stopped:
            mesh = None  # (its process's runtime was stopped: a new one spawns it afresh)
        if mesh is None:
            if not (isinstance(actor_class, type) and issubclass(actor_class, Actor)):
                raise TypeError(f"get_or_spawn_controller() needs a subclass of Actor, got {actor_class!r}")
            from ..runtime._proc import current_runtime

            rt = current_runtime()
            if rt is not None and not rt.in_script:  # in a proc's actor: the script holds the job's controllers
                return _controller_of_script(rt.client_addr, name, actor_class, args, kwargs)
            mesh = _controllers[name] = this_proc().spawn(name, actor_class, *args, **kwargs)

            def forget_failed(f: Future, mesh: ActorMesh = mesh) -> None:  # a constructor that raised: the next
                if f.exception() is not None:  # call spawns afresh
                    with _controllers_lock:
                        if _controllers.get(name) is mesh:
                            del _controllers[name]

            mesh._spawned.add_done_callback(forget_failed)
    mesh._observe()  # (the Future returned gives the constructor's error)
    out: Future[ActorMesh] = Future(f"spawn of controller {name!r}")
    mesh._spawned.add_done_callback(
        lambda f: out._set_exception(f.exception()) if f.exception() else out._set_result(mesh))
    return out


def _controller_of_script(up: str, name: str, actor_class: type, args: tuple, kwargs: dict) -> Future[ActorMesh]:
    """In a proc: the job's controller ``name``, asked of the process that spawned this proc (``up``), which
    passes the request up to the script (``_on_get_controller``); kept here once it came."""
    mailbox = current_mailbox()
    col = OneReply(up, f"controller {name!r} from the script")
    port = mailbox.open_port(col)
    mailbox.send(up, GetController(name, actor_class, args, kwargs, port))

    def keep(f: Future) -> None:
        if f.exception() is None:
            _controllers.setdefault(name, f.get())

    col.future.add_done_callback(keep)
    return col.future


def _on_get_controller(mailbox, msg: GetController) -> None:
    """A ``GetController`` that came here: passed on up (a proc), or served on a thread of its own (the
    script: the spawn waits for the controller's constructor)."""
    from ..runtime._proc import current_runtime

    rt = current_runtime()
    if rt is not None and not rt.in_script:  # (a script's in-process runtime serves it as the script does)
        mailbox.send(rt.client_addr, msg)
        return

    def serve() -> None:
        try:
            value, error = get_or_spawn_controller(msg.name, msg.cls, *msg.args, **msg.kwargs).get(
                timeout=CONTROLLER_SPAWN_TIMEOUT), None
        except BaseException as e:  # noqa: BLE001 - the asking actor gets it
            value, error = None, e
        try:
            mailbox.send(msg.reply.addr, SendToPort(msg.reply.port_id, value, error, 0))
        except Exception as e:  # noqa: BLE001 - an error that does not pickle: its text then
            mailbox.send(msg.reply.addr, SendToPort(msg.reply.port_id, None, RuntimeError(
                f"get_or_spawn_controller({msg.name!r}) failed in the script: {error!r} ({e!r})"), 0))

    threading.Thread(target=serve, daemon=True, name="mt-get-controller").start()


SYSTEM_HANDLERS[GetController] = _on_get_controller


def __getattr__(name: str):
    """Monarch's multi-host entry points, imported on first use: ``attach_to_workers``, ``run_worker_loop_forever``,
    ``run_worker_loop_until_shutdown``, ``start_worker_loop_forever``."""
    if name == "attach_to_workers":
        from ..hosts.remote_hosts import attach_to_workers

        return attach_to_workers
    if name in ("run_worker_loop_forever", "run_worker_loop_until_shutdown", "start_worker_loop_forever"):
        from ..hosts import agent

        return getattr(agent, name)
    if name == "config":  # Monarch's monarch.actor.config: the settings module
        from .. import config

        return config
    if name == "enabled_transport":  # (the transport layer's, as enable_transport left it)
        return _channel.enabled_transport
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
