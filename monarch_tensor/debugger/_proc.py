"""The debugger, the proc side: ``breakpoint()`` opens a pdb whose terminal is the client.

``sys.breakpointhook`` is set in every proc (``on_start``, a proc-start hook: ``runtime/_hooks.py``). The pdb
registers its session with the client (``DebugRegister``), sends what it prints
(``DebugOutput``) and reads input lines from a port of its own; the client's
debug controller (``debugger/__init__.py``) is the other end. While paused, the proc
keeps receiving, and its other actors' sync endpoints keep serving: they run
on the paused thread while pdb waits for its next line. pdb's wait holds the
proc's event loop, though (a frame cannot pause anywhere else), so calls of
async endpoints, and the calls queued behind them, run once the rank continues;
a ``breakpoint()`` in such a call pauses only then.
"""

from __future__ import annotations

import dis
import inspect
import os
import pdb
import socket
import sys
import uuid

from ..runtime import _context
from ..transport._ports import Receiver
from ..transport.mailbox import current_mailbox
from .messages import DebugEnd, DebugOutput, DebugRegister

# Frames of the runtime are never stopped in: stepping out of an endpoint ends the session.
SKIP = ["monarch_tensor.*", "asyncio.*", "concurrent.*", "selectors", "threading", "zmq.*"]

_RESUMABLE = inspect.CO_COROUTINE | inspect.CO_ASYNC_GENERATOR | inspect.CO_GENERATOR
_YIELD_VALUE = dis.opmap["YIELD_VALUE"]


def _suspends(frame) -> bool:
    """Whether a return event of ``frame`` is a coroutine or generator pausing at an ``await`` or ``yield``.

    Python reports that pause as a return of the frame, like its end; the frame then runs on (and pdb's
    ``n`` stops at its next line, as bdb does). A frame that pauses stands on its ``YIELD_VALUE``.
    """
    code = frame.f_code
    return bool(code.co_flags & _RESUMABLE) and code.co_code[frame.f_lasti] == _YIELD_VALUE


class _Out:
    """pdb's stdout: text goes to the client in ``DebugOutput`` messages."""

    def __init__(self, dbg: RemotePdb) -> None:
        self.dbg, self.parts = dbg, []

    def write(self, s: str) -> int:
        self.parts.append(s)
        return len(s)

    def send(self, waiting: bool) -> None:
        text, self.parts = "".join(self.parts), []
        if text or waiting:
            self.dbg.send(DebugOutput(self.dbg.session, text, waiting))

    def flush(self) -> None:
        self.send(False)


class _In:
    """pdb's stdin: each line comes as a value on the session's port."""

    def __init__(self, dbg: RemotePdb) -> None:
        self.dbg = dbg

    def readline(self) -> str:
        self.dbg.out.send(waiting=True)
        line = self.dbg.rx.recv().get()
        return "c\n" if line is None else str(line).rstrip("\n") + "\n"


class RemotePdb(pdb.Pdb):
    """A pdb whose input and output travel to the client's debug controller."""

    def __init__(self, client_addr: str) -> None:
        self.client_addr = client_addr
        self.session = uuid.uuid4().hex[:12]
        self.rx = Receiver()
        self.port = current_mailbox().open_port(self.rx)
        self.out = _Out(self)
        super().__init__(stdin=_In(self), stdout=self.out, skip=SKIP, nosigint=True, readrc=False)
        self.use_rawinput = False
        self.prompt = "(Pdb) "
        self._ended = False
        ctx = _context.current()
        self.actor, self.point = ctx.name, ctx.rank

    def send(self, msg) -> None:
        current_mailbox().send(self.client_addr, msg)

    def interaction(self, frame, tb) -> None:
        if self._ended:  # stopped again (a pdb breakpoint set with `b`): a new session on the same pdb
            self._ended = False
            self.port = current_mailbox().open_port(self.rx)
        if frame is not None:
            code = frame.f_code
            self.send(DebugRegister(self.session, self.actor, self.point.rank, dict(self.point.items()),
                                    socket.gethostname(), os.getpid(),
                                    f"{frame.f_globals.get('__name__', '?')}.{code.co_name}",
                                    code.co_filename, frame.f_lineno, self.port))
        super().interaction(frame, tb)

    def dispatch_return(self, frame, arg):
        r = super().dispatch_return(frame, arg)
        if not self._ended and self._returns_to_runtime(frame) and not _suspends(frame):
            self.set_continue()  # stepped out of the endpoint (or of a thread's function): done
        return r

    def _returns_to_runtime(self, frame) -> bool:
        """Whether ``frame`` is user code that the runtime's own code (frames pdb skips) called: a helper
        that called breakpoint() returns to its caller instead, where ``n`` goes on, as in plain pdb. (The
        runtime's frames below the endpoint are traced too, since set_trace; their returns do not count.)"""
        if self.is_skipped_module(frame.f_globals.get("__name__")):
            return False
        caller = frame.f_back
        return caller is None or self.is_skipped_module(caller.f_globals.get("__name__"))

    def _end(self, quit: bool = False) -> None:
        if not self._ended:
            self._ended = True
            self.out.flush()
            self.send(DebugEnd(self.session, quit=quit))
            current_mailbox().close_port(self.port.port_id)

    def set_continue(self) -> None:
        super().set_continue()
        self._end()

    def set_quit(self) -> None:
        super().set_quit()
        self._end(quit=True)  # (bdb raises BdbQuit in the endpoint next)


def breakpoint_hook(*args, **kwargs) -> None:
    """``sys.breakpointhook`` in procs: pause this rank under the distributed debugger."""
    if os.environ.get("PYTHONBREAKPOINT") == "0":
        return None
    from ..runtime._proc import current_runtime

    rt = current_runtime()
    if rt is None:
        return sys.__breakpointhook__(*args, **kwargs)
    RemotePdb(rt.client_addr).set_trace(sys._getframe(1))
    return None


def on_start(rt) -> None:
    """A new proc (its start hook): ``breakpoint()`` pauses its rank under the distributed debugger."""
    sys.breakpointhook = breakpoint_hook
