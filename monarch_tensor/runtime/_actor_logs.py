"""The actor's identity on the log records its code writes, in every proc (and the script's in-process runtime)."""

from __future__ import annotations

import logging


class ActorLogFilter(logging.Filter):
    """Log records written while an actor's code runs carry its identity, as Monarch's do: attributes
    ``actor_id``, ``actor_name`` and ``actor_prefix`` (``"[actor=<root>.<module.Class name{'gpus': 0/2}>] "``),
    and the message starts with that prefix (``config.prefix_python_logs_with_actor = False`` leaves the message
    alone). On every handler of the proc, those added later included. Records of the runtime's own threads
    (no actor running) are left alone, and so are empty messages (torch.compile's structured logs)."""

    _installed = False

    @classmethod
    def install(cls) -> None:
        if cls._installed:
            return
        cls._installed = True
        f = cls()
        for h in logging.getLogger().handlers:
            h.addFilter(f)
        add = logging.Logger.addHandler

        def add_handler(self, hdlr, _add=add, _f=f):
            _add(self, hdlr)
            if _f not in hdlr.filters:
                hdlr.addFilter(_f)

        logging.Logger.addHandler = add_handler

    def filter(self, record: logging.LogRecord) -> bool:
        if getattr(record, "actor_prefix", None) is not None:  # (another handler's filter did it)
            return True
        try:
            from .. import config
            from . import _context

            if _context.in_client():
                return True
            ctx = _context.current()
            prefix = f"[actor={ctx}] "
            record.actor_prefix, record.actor_name = prefix, ctx.name
            record.actor_id = ctx.actor_id
            if config.prefix_python_logs_with_actor and isinstance(record.msg, str) and record.msg:
                record.msg = prefix + record.msg
        except Exception:  # noqa: BLE001 - a log line must never fail for its prefix
            pass
        return True
