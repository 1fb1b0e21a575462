"""Environment inspection, the proc side: handlers of ``env_messages``."""

from __future__ import annotations

import os
import socket

from .env_messages import ReadEnv, ReserveMasterPort, WriteEnv
from .mailbox import SYSTEM_HANDLERS, Mailbox
from .messages import SendToPort


def _reply(mailbox: Mailbox, port, value=None, error: BaseException | None = None) -> None:
    from ._proc import current_runtime

    rt = current_runtime()
    mailbox.send(port.addr, SendToPort(port.port_id, value, error, rt.rank if rt else 0))


def handle_read(mailbox: Mailbox, msg: ReadEnv) -> None:
    env = os.environ
    if msg.names is not None:
        _reply(mailbox, msg.reply, {n: env.get(n) for n in msg.names})
    else:
        _reply(mailbox, msg.reply, {k: v for k, v in sorted(env.items()) if k.startswith(msg.prefix)})


def handle_write(mailbox: Mailbox, msg: WriteEnv) -> None:
    for name, value in msg.values.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
    _reply(mailbox, msg.reply, None)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def handle_reserve(mailbox: Mailbox, msg: ReserveMasterPort) -> None:
    try:
        _reply(mailbox, msg.reply, (socket.gethostname(), free_port()))
    except OSError as e:
        _reply(mailbox, msg.reply, error=e)


SYSTEM_HANDLERS.update({ReadEnv: handle_read, WriteEnv: handle_write, ReserveMasterPort: handle_reserve})
