"""Hooks of the interactive tools in every proc: workspace sync, env inspection, the debugger.

Imported by ``_proc`` (so the template process preloads it); importing it
registers the handlers of the tools' messages in ``mailbox.SYSTEM_HANDLERS``.
``on_start`` runs in each new proc before it serves anything.
"""

from __future__ import annotations

import sys

from . import _debug_proc, _env_proc, _sync_proc  # noqa: F401 - register their message handlers


def on_start(rt) -> None:
    """Put the dirs synced so far on ``sys.path``; route ``breakpoint()`` to the distributed debugger."""
    try:
        _sync_proc.on_start(rt.client_addr)
    except Exception as e:  # noqa: BLE001 - a proc must start even if its workspace root is unreadable
        print(f"monarch_tensor: cannot read the workspace root: {e!r}", file=sys.stderr)
    sys.breakpointhook = _debug_proc.breakpoint_hook
