"""Exit hooks that belong to one process: a child forked from it (``os.fork``, then ``sys.exit``) inherits the
``atexit`` registrations, and what they do (stop the script's procs, close its mailbox) is not the child's."""

from __future__ import annotations

import atexit
import os


def at_exit(fn, *args):
    """``atexit.register(fn, *args)``, run at this process's exit only, not at a forked child's. Returns ``fn``
    (a decorator too)."""
    pid = os.getpid()

    def run() -> None:
        if os.getpid() == pid:
            fn(*args)

    atexit.register(run)
    return fn
