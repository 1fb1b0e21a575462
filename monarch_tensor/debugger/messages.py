"""The debugger protocol, procs -> client; handlers are in ``debugger/__init__.py``.

A proc paused at ``breakpoint()`` registers a session with the client that owns
it; the client sends input lines as values on the session's ``port`` (plain
``SendToPort``), and the proc answers with ``DebugOutput``.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..transport.messages import PortRef, _fast_reduce


@_fast_reduce
@dataclass(frozen=True, slots=True)
class DebugRegister:
    """Proc -> client: session ``session`` is paused at ``filename:lineno`` in ``function``; input goes to ``port``."""

    session: str
    actor: str
    rank: int
    coords: dict
    hostname: str
    pid: int
    function: str
    filename: str
    lineno: int
    port: PortRef


@_fast_reduce
@dataclass(frozen=True, slots=True)
class DebugOutput:
    """Proc -> client: text pdb printed; ``waiting`` when pdb now waits for an input line."""

    session: str
    text: str
    waiting: bool


@_fast_reduce
@dataclass(frozen=True, slots=True)
class DebugEnd:
    """Proc -> client: the session's rank continued (or quit); it is no longer paused.

    ``died`` says why when the rank's proc died instead: the process that watched that proc sends it.
    ``quit`` when pdb's ``q`` ended it: the endpoint raises ``BdbQuit``, as a program does in plain pdb.
    """

    session: str
    died: str = ""
    quit: bool = False
