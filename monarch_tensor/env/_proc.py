"""Environment inspection, the proc side: handlers of ``env/messages.py``."""

from __future__ import annotations

import os
import socket

from ..transport._net import ip_towards
from ..transport.mailbox import Mailbox
from ..transport.messages import SendToPort
from .messages import ReadEnv, ReserveMasterPort, WriteEnv


def _reply(mailbox: Mailbox, port, value=None, error: BaseException | None = None) -> None:
    from ..runtime._proc import current_runtime

    rt = current_runtime()
    mailbox.send(port.addr, SendToPort(port.port_id, value, error, rt.rank if rt else 0))


def handle_read(mailbox: Mailbox, msg: ReadEnv) -> None:
    env = os.environ
    if msg.names is not None:
        _reply(mailbox, msg.reply, {n: env.get(n) for n in msg.names})
    else:
        _reply(mailbox, msg.reply, {k: v for k, v in sorted(env.items()) if k.startswith(msg.prefix)})


ROOT_VARS = {"WORKSPACE_DIR": "", "CONDA_PREFIX": "CONDA_PREFIX"}  # variable -> workspace sync's root_var


def handle_write(mailbox: Mailbox, msg: WriteEnv) -> None:
    for name, value in msg.values.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
    _reply(mailbox, msg.reply, _roots_now(msg))


def _roots_now(msg: WriteEnv) -> dict | None:
    """For a write that moved this proc's workspace root (``WORKSPACE_DIR``) or environment (``CONDA_PREFIX``):
    ``{root_var: (hostname, root)}``, what a sync's ``DescribeWorkspace`` would answer now, so that the
    client's next sync need not ask (``workspace_sync.learn_roots``). None for any other write."""
    moved = [ROOT_VARS[name] for name in msg.values if name in ROOT_VARS]
    if not moved:
        return None
    from ..workspace_sync._proc import client_key, where

    out = {}
    for root_var in moved:
        try:
            out[root_var] = where(client_key(msg.reply.addr), root_var)
        except ValueError:  # $CONDA_PREFIX unset: a sync would fail on it, and will say so then
            pass
    return out


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def handle_reserve(mailbox: Mailbox, msg: ReserveMasterPort) -> None:
    try:
        routed = None if msg.towards is None else ip_towards(msg.towards)
        _reply(mailbox, msg.reply, (socket.gethostname(), free_port(), routed))
    except OSError as e:
        _reply(mailbox, msg.reply, error=e)


# The env tool's messages and their handlers (its registry entry names them: ``runtime/_hooks.py``).
HANDLERS = {ReadEnv: handle_read, WriteEnv: handle_write, ReserveMasterPort: handle_reserve}
