"""Control-plane messages of the data plane, one frozen record each, named as verbs.

They travel through ordinary mailboxes; each process that imported ``rdma``
handles them (``rdma.service.handle_X``). ``tests/test_rdma_verbs.py`` checks
that every message round-trips through the wire format and has a handler.
"""

from __future__ import annotations

from dataclasses import dataclass

from monarch_tensor.transport.messages import PortRef


@dataclass(frozen=True, slots=True)
class ConnectQueuePair:
    """Reader -> owner: here is my RC queue pair (``endpoint``, packed); make yours for me and reply with it."""

    peer: str  # the reader's mailbox address (one queue pair per peer and device)
    device: str  # the owner's RDMA device the reader's buffer descriptor named
    endpoint: bytes
    reply: PortRef


@dataclass(frozen=True, slots=True)
class DropBuffer:
    """Anyone -> owner: drop registration ``buf_id`` (``token`` proves the sender holds the handle); then
    answer ``reply`` (if any) with None."""

    buf_id: int
    token: int
    reply: PortRef | None = None


@dataclass(frozen=True, slots=True)
class ReleasePayload:
    """Receiver -> sender: I pulled message payload ``buf_id`` (see ``rdma/payload.py``); drop it after the
    last receiver."""

    buf_id: int
    token: int
