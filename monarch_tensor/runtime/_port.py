"""``Port``: the sending end of a channel, and an endpoint's explicit response port (``monarch_tensor.actor``
re-exports it). Here, below the actor layer, because the proc runtime makes the explicit response ports."""

from __future__ import annotations

from typing import Any, Generic, TypeVar

from ..transport.mailbox import current_mailbox
from ..transport.messages import PortRef, SendToPort
from . import _context

R = TypeVar("R")


class Port(Generic[R]):
    """The sending end of a channel; picklable, so it can be passed to actors (``Port[int]`` in a type hint,
    as Monarch's).

    An endpoint's explicit response port carries the rank of the actor it answers for (Monarch's
    ``Port._rank``), which travels with it: a reply sent from another thread, or by another actor it was
    forwarded to, counts as that rank's. A channel's port has none: a value counts as its sender's."""

    def __init__(self, ref: PortRef | None, rank: int | None = None) -> None:
        self._ref = ref  # None: nobody listens (an explicit response port of a broadcast)
        self._rank = rank

    def _sender_rank(self) -> int:
        return self._rank if self._rank is not None else _context.current().rank.rank

    def send(self, value: Any) -> None:
        if self._ref is not None:
            mb, addr = current_mailbox(), self._ref.addr
            mb.send(addr, SendToPort(self._ref.port_id, value, None, self._sender_rank(), mb.output_before(addr)))

    def exception(self, error: BaseException) -> None:
        if not isinstance(error, BaseException):
            raise TypeError(f"port.exception() needs an exception, got {type(error).__name__} {error!r}")
        if self._ref is None:  # nobody listens (a broadcast's): the endpoint fails with it, as Monarch's
            raise error
        mb, addr = current_mailbox(), self._ref.addr
        mb.send(addr, SendToPort(self._ref.port_id, None, error, self._sender_rank(), mb.output_before(addr)))

    def __repr__(self) -> str:
        if self._ref is None:
            return "Port(None)"
        return f"Port({self._ref.addr}, {self._ref.port_id})"
