"""The environment-inspection protocol, client -> procs; handlers are in ``env/_proc.py``."""

from __future__ import annotations

from dataclasses import dataclass

from ..transport.messages import PortRef, _fast_reduce


@_fast_reduce
@dataclass(frozen=True, slots=True)
class ReadEnv:
    """Client -> proc: reply ``{name: value}`` of the variables named in ``names``, or starting with ``prefix``."""

    names: tuple[str, ...] | None
    prefix: str
    reply: PortRef


@_fast_reduce
@dataclass(frozen=True, slots=True)
class WriteEnv:
    """Client -> proc: set each variable of ``values`` (``None`` unsets it); ack on ``reply``."""

    values: dict
    reply: PortRef


@_fast_reduce
@dataclass(frozen=True, slots=True)
class ReserveMasterPort:
    """Client -> proc: reply ``(hostname, port, address)`` with a TCP port free on this host (torch's MASTER_PORT)
    and, given ``towards`` (an address on another host), this host's address on the route to it."""

    reply: PortRef
    towards: str | None
