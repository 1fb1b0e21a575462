"""Handlers of the data plane's control messages, registered with this process's mailbox."""

from __future__ import annotations

import logging

from monarch_tensor.transport import mailbox as _mailbox
from monarch_tensor.transport.messages import SendToPort

from ._registry import registry
from .messages import ConnectQueuePair, DropBuffer, ReleasePayload

log = logging.getLogger("monarch_tensor.rdma")


def handle_ConnectQueuePair(mb: _mailbox.Mailbox, msg: ConnectQueuePair) -> None:
    from .backends import verbs

    try:
        value, error = verbs.accept_connection(msg.peer, msg.device, msg.endpoint), None
    except Exception as e:  # noqa: BLE001 - reported to the reader
        value, error = None, e
    mb.send(msg.reply.addr, SendToPort(msg.reply.port_id, value, error, 0))


def handle_DropBuffer(mb: _mailbox.Mailbox, msg: DropBuffer) -> None:
    reg = registry().lookup(msg.buf_id, msg.token)
    if reg is not None:
        registry().drop(msg.buf_id)
    if msg.reply is not None:  # (dropped already, or never ours: there is nothing left to drop either way)
        mb.send(msg.reply.addr, SendToPort(msg.reply.port_id, None, None, 0))


def handle_ReleasePayload(mb: _mailbox.Mailbox, msg: ReleasePayload) -> None:
    from . import payload

    payload.handle_release(msg.buf_id, msg.token)


HANDLERS = {ConnectQueuePair: handle_ConnectQueuePair, DropBuffer: handle_DropBuffer,
            ReleasePayload: handle_ReleasePayload}


def install() -> None:
    """Make this process's mailbox (any process: client or proc) handle the messages above."""
    _mailbox.SYSTEM_HANDLERS.update(HANDLERS)
