"""A proc's interpreter shutdown when it is stopped gracefully (``StopProc``), as a process that exits does.

A proc is forked from its host's template and ends with ``os._exit`` (unwinding the template's stack is not
its to do), so Python's own shutdown does not run there. What it would run is run here instead, in its order:
the ``atexit`` hooks registered in this proc (those the template registered before the fork are dropped at
the proc's start: ``forget_inherited_hooks``), then the finalizers (``__del__``) of what the user's modules
hold, as the interpreter's teardown of ``sys.modules`` frees it. All of it is bounded: past ``EXIT_LIMIT_S``
the proc exits anyway (its client kills it a little later: ``configure(stop_timeout=...)``, 5 s).
"""

from __future__ import annotations

import atexit
import gc
import os
import sys
import sysconfig
import threading
import traceback

EXIT_LIMIT_S = 4.0

# Where modules that are not the user's live: the standard library, installed packages, and this project's
# folders (wherever they are installed; a module run as ``__main__`` from there too).
_NOT_USERS = tuple(sorted({os.path.realpath(p) + os.sep for p in (
    sys.prefix, sys.base_prefix, sys.exec_prefix, *(sysconfig.get_paths()[k] for k in ("stdlib", "purelib", "platlib")),
    *(os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), pkg) for pkg in (
        "monarch_tensor", "controller", "worker", "rdma")),
) if p}))
_OURS = ("monarch_tensor",)


def forget_inherited_hooks() -> None:
    """At a proc's start: the ``atexit`` hooks registered so far are the template's, not this proc's."""
    atexit._clear()


def exit_within(limit: float, code: int) -> None:
    """``os._exit(code)`` after ``limit`` seconds, whatever the shutdown is doing then."""
    t = threading.Timer(limit, os._exit, (code,))
    t.daemon = True
    t.start()


def run_exit_hooks() -> None:
    """The ``atexit`` hooks registered in this proc, last registered first (their errors are printed)."""
    try:
        atexit._run_exitfuncs()
    except BaseException:  # noqa: BLE001 - user code; the proc stops all the same
        traceback.print_exc()


def finalize_user_modules() -> None:
    """Drop what the user's modules hold (their globals, as the interpreter's teardown sets them to None) and
    collect, so that the finalizers of those objects run. Modules of the standard library, of installed
    packages and of this project keep theirs: the runtime still needs them until ``os._exit``."""
    for name, mod in list(sys.modules.items()):
        if name.partition(".")[0] in _OURS or not _is_users(mod):
            continue
        d = getattr(mod, "__dict__", None)
        if not isinstance(d, dict):
            continue
        for key in list(d):
            if not (key.startswith("__") and key.endswith("__")):
                d[key] = None
    gc.collect()


def _is_users(mod: object) -> bool:
    path = getattr(mod, "__file__", None)
    if not isinstance(path, str) or not os.path.isabs(path):  # (torch.ops's is "_ops.py": no file of the user's)
        return False
    path = os.path.realpath(path)
    return not path.startswith(_NOT_USERS)
