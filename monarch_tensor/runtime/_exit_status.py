"""The script's exit status after an unhandled fault that came while it was exiting.

An unhandled fault interrupts the script's main thread (``host._unhandled_fault``). One that comes once the
main thread has ended (a ``broadcast`` whose endpoint raised, right before the script's end) finds nothing to
interrupt: the ``atexit`` hooks (stopping the procs, flushing the logs) still run to their end, and the script
then ends with status 1 instead of 0, the failure already on stderr. The package imports this module first,
so that its hook, registered first, runs last (``atexit`` runs hooks in reverse order).
"""

from __future__ import annotations

import atexit
import os
import sys
import threading

_lock = threading.Lock()
_failed = False  # an unhandled fault came while the script was exiting
_hooks_ran = False  # _exit_at_exit ran: no hook of this package is left to run


def fail_at_exit() -> None:
    """An unhandled fault came while the script exits: it ends with status 1, once this package's ``atexit``
    hooks ran (now, if they did)."""
    global _failed
    with _lock:
        if not _hooks_ran:
            _failed = True
            return
    _exit(1)


@atexit.register
def _exit_at_exit() -> None:
    global _hooks_ran
    with _lock:
        _hooks_ran = True
        failed = _failed
    if failed:
        _exit(1)


def _exit(status: int) -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001 - closed
            pass
    os._exit(status)
