"""Who is running right now: the client script, or an actor on some rank."""

from __future__ import annotations

import contextvars
from dataclasses import dataclass, field
from typing import Any

from .shape import Point


@dataclass
class ActorContext:
    """What ``context()`` returns inside an endpoint (and in the client script)."""

    actor_name: str
    rank: Point
    proc_rank: int
    instance: Any = None
    sizes: dict = field(default_factory=dict)
    owned_meshes: list = field(default_factory=list)

    @property
    def actor_instance(self):
        return self

    @property
    def message_rank(self) -> Point:
        """The rank the current message is for (Monarch's name; this actor's rank in its mesh)."""
        return self.rank


_CLIENT = ActorContext("client", Point(0, {}), 0)
_current: contextvars.ContextVar[ActorContext] = contextvars.ContextVar("monarch_tensor_actor", default=_CLIENT)


def current() -> ActorContext:
    return _current.get()


def enter(ctx: ActorContext) -> contextvars.Token:
    return _current.set(ctx)


def leave(token: contextvars.Token) -> None:
    _current.reset(token)


def in_client() -> bool:
    return _current.get() is _CLIENT
