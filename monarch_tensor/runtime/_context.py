"""Who is running right now: the client script, or an actor on some rank."""

from __future__ import annotations

import contextvars
from dataclasses import dataclass, field
from typing import Any

from ..errors import actor_label
from ..shape import Point


@dataclass
class ActorContext:
    """What ``context()`` returns inside an endpoint (and in the client script)."""

    actor_name: str
    rank: Point
    proc_rank: int
    instance: Any = None
    sizes: dict = field(default_factory=dict)
    owned_meshes: list = field(default_factory=list)  # the meshes it spawned: they stop with it (``own``)
    proc_mesh_bytes: bytes | None = None  # the proc mesh it was spawned on, pickled (see proc_mesh)
    loop: Any = field(default=None, repr=False, compare=False)  # where its async endpoints (and __supervise__) run
    runtime: Any = field(default=None, repr=False, compare=False)  # the proc runtime it runs on (None: the script)

    @property
    def actor_instance(self):
        return self

    # ---- Monarch's ``Instance`` -------------------------------------------------------------
    @property
    def name(self) -> str:
        """The name this actor was spawned under (``"client"`` in the script)."""
        return actor_label(self.actor_name)

    @property
    def class_name(self) -> str:
        """The actor's class, ``module.QualName`` (Monarch's); ``""`` in the script."""
        if self.instance is None:
            return ""
        cls = type(self.instance)
        return f"{cls.__module__}.{cls.__qualname__}"

    @property
    def proc_id(self) -> str:
        """This proc's address."""
        from ..transport.mailbox import current_mailbox

        return current_mailbox().addr

    @property
    def actor_id(self) -> str:
        """``<proc address>/<name>[<rank in its mesh>]``: which actor this is, unique among the live ones (the name of a
        mesh spawned by a proc, not the script, is followed by ``@`` and its spawner's token: two procs may each
        spawn a mesh of one name here)."""
        return f"{self.proc_id}/{self.actor_name.replace(chr(0), '@')}[{int(self.rank)}]"

    @property
    def proc(self):
        """This proc as a mesh of one (Monarch's ``Instance.proc``): ``context().actor_instance.proc.spawn(
        "sibling", Cls)`` spawns an actor beside this one."""
        return _this_proc()

    @property
    def proc_mesh(self):
        """The proc mesh this actor was spawned on (Monarch's ``Instance.proc_mesh``): ``spawn`` on it puts an
        actor beside each of this mesh's actors; in the script, ``this_proc()``."""
        if self.proc_mesh_bytes is None:
            return _this_proc()
        mesh = getattr(self, "_proc_mesh", None)
        if mesh is None:
            import pickle

            mesh = self._proc_mesh = pickle.loads(self.proc_mesh_bytes)
        return mesh

    def abort(self, reason: str | None = None) -> None:
        """Stop this actor with a failure (Monarch's): calls queued to it and later ones fail, the running one
        still answers, its ``__cleanup__`` runs, and its owner's supervision is told (``__supervise__``, else
        ``unhandled_fault_hook``) with a ``SupervisionError`` giving ``reason``."""
        from ._proc import current_runtime

        rt = current_runtime()
        if rt is None or self.instance is None:
            raise RuntimeError("abort() stops the actor it is called in: call it from an endpoint (the script is "
                               "no actor; raise or sys.exit() there)")
        if reason is not None and not isinstance(reason, str):
            raise TypeError(f"abort(reason) takes a string or None, got {reason!r}")
        rt.abort_actor(self.actor_name, reason)

    def __str__(self) -> str:
        """Which actor this is, as Monarch writes it: ``<root>`` for the script, else
        ``<root>.<module.Class name{'gpus': 1/4}>`` (its class, name, and place in its mesh)."""
        if self.instance is None and self.actor_name == "client":
            return "<root>"
        coords = ", ".join(f"'{k}': {v}/{self.sizes.get(k, '?')}" for k, v in self.rank.items())
        return f"<root>.<{self.class_name} {actor_label(self.actor_name)}{{{coords}}}>"

    @property
    def message_rank(self) -> Point:
        """Where this actor lies in the slice of its mesh that the current message was sent to (Monarch's:
        ``mesh.slice(gpus=slice(2, 4))``'s actors are at 0 and 1 of it; a one-actor slice's has no dims); a
        message to the whole mesh: this actor's rank in it."""
        shape = _message.get()
        if shape is None:
            return self.rank
        from ._proc import _point_in

        point = _point_in(shape, self.rank.rank)
        return self.rank if point is None else point


_CLIENT = ActorContext("client", Point(0, {}), 0)

# ``this_proc()`` of the hosts layer, which enters it here when it is imported (the actor layer imports it, so
# wherever an actor or the script asks for its proc, it is there): this layer imports nothing above it.
this_proc_hook: Any = None


def _this_proc():
    if this_proc_hook is None:
        raise RuntimeError("this proc as a mesh needs monarch_tensor.actor imported in this process")
    return this_proc_hook()
_current: contextvars.ContextVar[ActorContext] = contextvars.ContextVar("monarch_tensor_actor", default=_CLIENT)
# The shape of the slice the current message was sent to (None: the whole mesh); its point is found when asked.
_message: contextvars.ContextVar[Any] = contextvars.ContextVar("monarch_tensor_message", default=None)


def current() -> ActorContext:
    return _current.get()


def enter(ctx: ActorContext, message=None) -> tuple:
    """Run as ``ctx``'s actor, handling a message sent to the slice of shape ``message`` (None: the whole
    mesh); ``message_rank`` finds the actor's point in it when asked."""
    return _current.set(ctx), _message.set(message)


def leave(tokens: tuple) -> None:
    _current.reset(tokens[0])
    _message.reset(tokens[1])


def in_client() -> bool:
    return _current.get() is _CLIENT


def own(mesh: Any) -> None:
    """``mesh`` (an actor mesh, or a proc mesh) was spawned by the current actor: it is stopped when that actor
    stops (Monarch's ownership; see ``_proc._cleanup``). In the script: nothing (its meshes stop at its exit)."""
    ctx = _current.get()
    if ctx is not _CLIENT:
        owned = ctx.owned_meshes
        if len(owned) >= _PRUNE_AT and len(owned) & (len(owned) - 1) == 0:  # (an actor spawning mesh after mesh)
            owned[:] = [m for m in owned if not _stopped(m)]
        owned.append(mesh)


_PRUNE_AT = 64  # owned meshes: past this, the stopped ones are dropped whenever the count reaches a power of 2


def _stopped(mesh: Any) -> bool:
    """Whether an owned mesh was stopped already (an actor mesh: each of its actors, or its procs)."""
    alloc = getattr(mesh, "_alloc", None)
    if alloc is not None:  # a proc mesh
        return bool(alloc._stopped)
    pm = getattr(mesh, "_proc_mesh", None)
    if pm is not None and pm._alloc._stopped:
        return True
    ranks = getattr(mesh, "_rank_list", None)
    return ranks is not None and all(r in mesh._stopped for r in ranks)
