"""Supervision: a failure reaches its owner, one at a time, on a thread of its own.

A proc's death or an actor's fault that nobody awaited goes to its mesh's owner (an actor's ``__supervise__``,
else ``unhandled_fault_hook``: Monarch's order); when the hook raises, the fault is unhandled and ends the script
(``_unhandled_fault``). How this process learns of failures is ``_failures.py``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import inspect
import logging
import os
import queue
import signal
import sys
import threading
from typing import TYPE_CHECKING

from ..errors import SupervisionError
from ..runtime import _exit_status

if TYPE_CHECKING:
    from .proc_mesh import ProcMesh

log = logging.getLogger("monarch_tensor.hosts.host")  # (the public module's name, for all its parts)

_to_supervise: queue.SimpleQueue = queue.SimpleQueue()  # (owner, failure, ran), for the supervision thread
_supervisor: threading.Thread | None = None
_supervisor_lock = threading.Lock()


def _supervise_later(owner, err: SupervisionError) -> None:
    """``_supervise(owner, err)`` on the supervision thread, one failure at a time in the order they came.
    Not on the thread that reports them: a hook or ``__supervise__`` may block (``heal_mesh`` waits for a
    spawn, whose reply that thread reads), and procs' exits must still be reported meanwhile.

    An owner that is an actor of this process has its ``__supervise__`` started now, on its proc's loop, in
    order with the messages it receives (``ProcRuntime.supervise_in_order``): a message that comes after the
    failure (the failed call's caller asking the owner what it saw) finds it seen. The supervision thread
    then waits for what it returned, and runs ``unhandled_fault_hook`` where it did not handle the failure."""
    global _supervisor
    err = err.as_failure()  # (shown as Monarch's MeshFailure; the error that calls raise keeps its text)
    ran = None
    rt = getattr(owner, "runtime", None)
    if rt is not None:
        handler = getattr(owner.instance, "__supervise__", None)
        if handler is not None:
            ran = rt.supervise_in_order(owner, handler, err, SUPERVISE_TIMEOUT_S)
    _to_supervise.put((owner, err, ran))
    with _supervisor_lock:
        if _supervisor is None or not _supervisor.is_alive():  # (not started, or not in this forked child)
            _supervisor = threading.Thread(target=_supervision_loop, daemon=True, name="monarch-tensor-supervise")
            _supervisor.start()


def _supervision_loop() -> None:
    while True:
        owner, err, ran = _to_supervise.get()
        _supervise(owner, err, ran)


def _supervise(owner, err: SupervisionError, ran: concurrent.futures.Future | None = None) -> None:
    """A failure for ``owner`` (an actor's context, None for the script): its ``__supervise__(err)`` may
    handle it by returning True; else ``unhandled_fault_hook`` runs (Monarch's order). ``ran``: what that
    ``__supervise__``, started already on its actor's loop (``_supervise_later``), returns."""
    from .. import actor

    handler = getattr(owner.instance, "__supervise__", None) if owner is not None else None
    if ran is not None or handler is not None:
        try:
            if ran is not None:
                try:
                    handled = ran.result(timeout=SUPERVISE_TIMEOUT_S)
                except concurrent.futures.TimeoutError:
                    raise TimeoutError(f"__supervise__ did not return within {SUPERVISE_TIMEOUT_S:g} s") from None
            else:
                handled = _on_actor_loop(owner, handler, err)
                if inspect.iscoroutine(handled):  # an async __supervise__: on its actor's loop, as its endpoints
                    handled = _await_on_actor_loop(owner, handled)
            if handled:
                return
        except Exception as e:  # noqa: BLE001
            err2 = SupervisionError(f"{err._text()} (and __supervise__ raised {e!r})", proc=err.proc,
                                    rank=err.rank, exit_status=err.exit_status)
            err2.mesh, err2.__cause__ = err.mesh, e
            err = err2.as_failure()
    try:
        actor.unhandled_fault_hook(err)
    except BaseException as e:  # noqa: BLE001 - the supervision thread goes on to the next failure
        _unhandled_fault(err, e)


# How long an async ``__supervise__`` may take before its failure counts as unhandled.
SUPERVISE_TIMEOUT_S = 300.0


def _on_actor_loop(owner, handler, err: SupervisionError):
    """``handler(err)`` run on its actor's loop thread, as the actor's sync endpoints run (no running loop in
    sight; a wait in it, ``heal_mesh``'s, goes on serving the proc): one message at a time with them, and with
    their state (an ``asyncio.Event`` it sets wakes an endpoint waiting on it), as Monarch runs it. Where the
    actor has no running loop (the script), here."""
    loop = getattr(owner, "loop", None)
    if loop is None or loop.is_closed() or not loop.is_running():
        return handler(err)
    done: concurrent.futures.Future = concurrent.futures.Future()

    def run() -> None:
        running = asyncio.events._get_running_loop()
        asyncio.events._set_running_loop(None)
        try:
            done.set_result(handler(err))
        except BaseException as e:  # noqa: BLE001 - the supervision thread reports it
            done.set_exception(e)
        finally:
            asyncio.events._set_running_loop(running)

    try:
        loop.call_soon_threadsafe(run)
    except RuntimeError:  # (closed meanwhile)
        return handler(err)
    try:
        return done.result(timeout=SUPERVISE_TIMEOUT_S)
    except concurrent.futures.TimeoutError:
        raise TimeoutError(f"__supervise__ did not return within {SUPERVISE_TIMEOUT_S:g} s") from None


def _await_on_actor_loop(owner, coro):
    """The result of an async ``__supervise__``'s coroutine, run on its actor's event loop (from the supervision
    thread); an error when the actor has no running loop or the coroutine does not finish in time."""
    loop = getattr(owner, "loop", None)
    if loop is None or loop.is_closed():
        coro.close()
        raise RuntimeError("its actor's event loop is gone")
    future = asyncio.run_coroutine_threadsafe(coro, loop)
    try:
        return future.result(timeout=SUPERVISE_TIMEOUT_S)
    except concurrent.futures.TimeoutError:
        future.cancel()
        raise TimeoutError(f"the async __supervise__ did not finish within {SUPERVISE_TIMEOUT_S:g} s") from None


# The proc meshes whose unhandled faults interrupted the script's main thread (None: faults of no known mesh).
_interrupted_for: set[ProcMesh | None] = set()
_interrupted_lock = threading.Lock()


def _unhandled_fault(err: SupervisionError, raised: BaseException) -> None:
    """The fault hook raised (the default one does, with ``SystemExit``): the fault is unhandled. The script's
    main thread gets a ``KeyboardInterrupt`` (Monarch's), so that it ends running its ``finally`` blocks and
    ``atexit`` hooks; a proc ends at once, and its owner is told. Where no Python handler takes SIGINT (a
    script started with it ignored), the process ends at once too.

    One interrupt per proc mesh: a broadcast that raises on every proc, or a host that dies with all its procs,
    is several faults at once, each on a thread of its own, and a second interrupt would cut off the
    ``finally`` blocks and ``atexit`` hooks the first one started. The later faults are only printed (by the
    hook). A script that catches the interrupt and goes on is interrupted again by a fault of another mesh."""
    # A proc's runtime; None in the script, which need not import _proc for it (this may run at its exit,
    # when an import that registers an atexit hook fails).
    proc = sys.modules.get("monarch_tensor.runtime._proc")
    rt = proc.current_runtime() if proc is not None else None
    if not isinstance(raised, SystemExit):
        log.error("unhandled_fault_hook raised %r handling %s", raised, err)
    if rt is None and callable(signal.getsignal(signal.SIGINT)):
        mesh = getattr(err.mesh, "_alloc", None)
        with _interrupted_lock:
            if mesh in _interrupted_for:  # its first fault ends the script already (maybe in its atexit hooks)
                return
            _interrupted_for.add(mesh)
        main = threading.main_thread()
        if main.is_alive():
            print("monarch_tensor: delivering KeyboardInterrupt to the main thread to end the script",
                  file=sys.stderr, flush=True)
            signal.pthread_kill(main.ident, signal.SIGINT)
            return
        # The script is exiting (its main thread ended): its atexit hooks run on, stopping its procs, and it
        # then ends with status 1, not 0.
        _exit_status.fail_at_exit()
        return
    from ..runtime import _zygote

    _zygote.leave_last_words(f"unhandled fault: {err}")  # (its exit's report says why)
    sys.stderr.flush()
    os._exit(1)
