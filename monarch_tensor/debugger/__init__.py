"""The distributed debugger, client side: paused ranks, and the ``monarch_dbg>`` prompt.

Every ``breakpoint()`` hit in an endpoint registers a session here (see
``debugger/_proc.py``). The prompt runs in ``monarch-tensor debug`` (another
terminal, over an authenticated local TCP link: ``debugger/_server.py``) or, when
the script runs in a terminal and no debugger is connected, in the script's own
terminal. A rank whose proc dies while paused leaves the debugger: the process that
spawned the proc, which is told of its death, ends the session (``_DeathWatch``). Commands::

    list                                  paused ranks: actor, rank, coords, host, function, line
    attach NAME RANK                      a pdb session on that rank (n, s, p, l, c ...; detach to leave)
    cast NAME ranks(0,1,2) CMD            CMD on several ranks: ranks(0:4), ranks(gpus=0:2), ranks(*) also
    continue                              release every paused rank, then leave
    help, quit                            quit leaves the ranks paused
"""

from __future__ import annotations

import re
import threading
from dataclasses import dataclass, field

from ..errors import SupervisionError
from ..transport.mailbox import Mailbox, current_mailbox
from ..transport.messages import PortRef, SendToPort
from .messages import DebugEnd, DebugOutput, DebugRegister

REPLY_TIMEOUT = 30.0  # seconds to wait for a rank to answer one pdb command

# Where pdb stands, as it prints it when it stops (and ``where``, ``up``, ``down``): "> file(line)function()",
# then "-> source line" when it has the source.
_LOCATION = re.compile(r"^> .*\(\d+\).*\(\).*(?:\n-> .*)?$", re.M)

HELP = """monarch_dbg commands:
  list                         list the paused ranks
  attach <actor> <rank>        attach to a paused rank (pdb: n, s, p, l, c ...; 'detach' returns here)
  cast <actor> ranks(...) <cmd>  send a pdb command to several ranks; ranks(1), ranks(0,1,2),
                               ranks(0:4), ranks(0:8:2), ranks(gpus=0:2, hosts=0), ranks(*)
                               (counted from 0: no negative ranks, coordinates or steps)
  continue                     release every paused rank and leave the debugger
  help                         this text
  quit                         leave the debugger; ranks stay paused
"""


@dataclass
class Session:
    """One paused rank, as the client sees it."""

    id: str
    actor: str
    rank: int
    coords: dict
    hostname: str
    pid: int
    function: str
    filename: str
    lineno: int
    port: PortRef
    pending: list[str] = field(default_factory=list)
    waiting: bool = False
    ended: bool = False
    died: str = ""  # why, when the rank's proc died while paused
    quit: bool = False  # pdb's q ended it: the endpoint raises BdbQuit
    location: str = ""  # the last place pdb said it stands (_LOCATION), shown again on each attach


class Controller:
    """Paused sessions of this client; fed by the procs' debug messages."""

    def __init__(self) -> None:
        self.sessions: dict[str, Session] = {}
        self.cond = threading.Condition()
        self.on_register: list = []  # callbacks(session) when a rank pauses

    # ---- messages from procs (on the mailbox's I/O thread) ----------------------------
    def register(self, msg: DebugRegister) -> None:
        with self.cond:
            s = self.sessions.get(msg.session)
            new = s is None
            if new:
                s = self.sessions[msg.session] = Session(msg.session, msg.actor, msg.rank, dict(msg.coords),
                                                         msg.hostname, msg.pid, msg.function, msg.filename,
                                                         msg.lineno, msg.port)
            s.function, s.filename, s.lineno, s.port, s.ended = msg.function, msg.filename, msg.lineno, msg.port, False
            self.cond.notify_all()
        if new:
            for cb in list(self.on_register):
                cb(s)

    def output(self, msg: DebugOutput) -> None:
        with self.cond:
            s = self.sessions.get(msg.session)
            if s is not None:
                s.pending.append(msg.text)
                s.waiting = s.waiting or msg.waiting
                self.cond.notify_all()

    def end(self, msg: DebugEnd) -> None:
        with self.cond:
            s = self.sessions.pop(msg.session, None)
            if s is not None:
                s.ended, s.died, s.quit = True, msg.died, msg.quit
                self.cond.notify_all()

    # ---- driving sessions ---------------------------------------------------------------
    def paused(self) -> list[Session]:
        with self.cond:
            return sorted(self.sessions.values(), key=lambda s: (s.actor, s.rank))

    def find(self, actor: str, rank: int) -> Session | None:
        return next((s for s in self.paused() if s.actor == actor and s.rank == rank), None)

    def send(self, s: Session, line: str) -> None:
        with self.cond:
            s.waiting = False
        current_mailbox().send(s.port.addr, SendToPort(s.port.port_id, line, None, 0))

    def read(self, s: Session, timeout: float = REPLY_TIMEOUT) -> str:
        """What the rank printed until it waits for input again (or continued)."""
        with self.cond:
            self.cond.wait_for(lambda: s.waiting or s.ended, timeout)
            text, s.pending = "".join(s.pending), []
            where = _LOCATION.findall(text)
            if where:
                s.location = where[-1] + "\n"
            if not (s.waiting or s.ended):
                text += f"\n(no answer from rank {s.rank} within {timeout:.0f} s; it may be busy)\n"
            return text

    def wait_all_ended(self, sessions: list[Session], timeout: float) -> bool:
        with self.cond:
            return self.cond.wait_for(lambda: all(s.ended for s in sessions), timeout)


_controller: Controller | None = None
_lock = threading.Lock()


def controller() -> Controller:
    """This client's debug controller."""
    global _controller
    with _lock:
        if _controller is None:
            _controller = Controller()
    return _controller


class _DeathWatch:
    """A port that hears only of deaths: when a paused rank's proc dies, its session ends (``DebugEnd`` with
    ``died``) as if the rank had continued, instead of the prompt and ``continue`` waiting on it.

    Opened by the process the proc reports to (the one that spawned it), which is the one told of its death.
    """

    observing = False  # the death is supervision's to report; this only ends the debug session

    def __init__(self, mailbox: Mailbox, session: str, addr: str) -> None:
        self.mailbox, self.session, self.addr = mailbox, session, addr

    def deliver(self, msg: SendToPort) -> bool:
        return False

    def proc_died(self, addr: str, error: SupervisionError) -> tuple[bool, bool]:
        if addr != self.addr:
            return False, False
        _on_end(self.mailbox, DebugEnd(self.session, str(error)))
        return True, True


_watches: dict[str, int] = {}  # session -> the port of its _DeathWatch, in this process


def _on_register(mailbox: Mailbox, msg: DebugRegister) -> None:
    from ..runtime._proc import current_runtime

    if msg.session not in _watches:  # (a rank that stops again at a `b` breakpoint registers again)
        _watches[msg.session] = mailbox.open_port(_DeathWatch(mailbox, msg.session, msg.port.addr)).port_id
    rt = current_runtime()
    if rt is not None:  # a proc that spawned procs: pass up to our own client
        mailbox.send(rt.client_addr, msg)
    else:
        controller().register(msg)
        from . import _server as _debug_server

        _debug_server.on_breakpoint()
    # A proc that died before its watch opened was not seen by it: end its session now. Checked after
    # registering, so that a watch that fires meanwhile cannot end the session before it is registered.
    death = mailbox.death_of(msg.port.addr)
    if death is not None:
        _on_end(mailbox, DebugEnd(msg.session, str(death)))


def _on_end(mailbox: Mailbox, msg: DebugEnd) -> None:
    from ..runtime._proc import current_runtime

    port_id = _watches.pop(msg.session, None)
    if port_id is not None:
        mailbox.close_port(port_id)
    rt = current_runtime()
    if rt is not None:
        mailbox.send(rt.client_addr, msg)
    else:
        controller().end(msg)


def _relay_or(fn):
    def handle(mailbox: Mailbox, msg) -> None:
        from ..runtime._proc import current_runtime

        rt = current_runtime()
        if rt is not None:
            mailbox.send(rt.client_addr, msg)
        else:
            fn(msg)
    return handle


# The messages of paused ranks and their handlers, in every process (a proc passes them on to its client): the
# debugger's registry entry names them (``runtime/_hooks.py``), and ``monarch_tensor/__init__.py`` installs them.
HANDLERS = {
    DebugRegister: _on_register,
    DebugOutput: _relay_or(lambda m: controller().output(m)),
    DebugEnd: _on_end,
}


# ---- rank selections ------------------------------------------------------------------------
class _Refused(ValueError):
    """A selection that reads but means nothing here (said as it is, not as a usage line)."""


def _index(text: str) -> int:
    """A rank or coordinate. Only the paused ranks are known here, not a dimension's size, so a negative one
    (Python's count from the end) cannot be resolved: it is refused rather than match nothing."""
    value = int(text)
    if value < 0:
        raise _Refused(f"{value} is negative: ranks and coordinates count from 0 (no counting from the end)")
    return value


def _parse_sel(text: str):
    text = text.strip()
    if text.startswith("(") and text.endswith(")"):
        return {_index(x) for x in text[1:-1].split(",") if x.strip()}
    if ":" in text:
        parts = text.split(":")
        if len(parts) > 3:
            raise ValueError(f"bad range {text!r}")
        step_text = parts.pop() if len(parts) == 3 else ""
        step = int(step_text) if step_text.strip() else None
        if step is not None and step <= 0:
            raise _Refused(f"{text}: a range's step must be positive")
        return slice(*[_index(p) if p.strip() else None for p in parts], step)
    return _index(text)


def _matches(sel, value: int) -> bool:
    if isinstance(sel, slice):
        start, stop, step = sel.start or 0, sel.stop, sel.step or 1
        return value >= start and (stop is None or value < stop) and (value - start) % step == 0
    if isinstance(sel, set):
        return value in sel
    return value == sel


def parse_ranks(spec: str):
    """``ranks(...)`` contents -> a predicate on sessions. Raises ``ValueError`` with what was wrong.

    >>> pred = parse_ranks("gpus=0:2")
    """
    spec = spec.strip()
    if spec in ("", "*"):
        return lambda s: True
    try:
        if "=" in spec:
            dims = {}
            for part in re.split(r",(?![^()]*\))", spec):
                name, _, sel = part.partition("=")
                dims[name.strip()] = _parse_sel(sel)
            return lambda s: all(d in s.coords and _matches(sel, s.coords[d]) for d, sel in dims.items())
        if ":" in spec and "," not in spec:
            sel = _parse_sel(spec)
        else:
            sel = {_index(x) for x in spec.split(",") if x.strip()}
    except _Refused as e:
        raise ValueError(f"cannot read ranks({spec}): {e}") from None
    except ValueError:
        raise ValueError(f"cannot read ranks({spec}): use ranks(1), ranks(0,1,2), ranks(0:4) or ranks(gpus=0:2)") from None
    return lambda s: _matches(sel, s.rank)


# ---- the prompt -----------------------------------------------------------------------------------
def table(sessions: list[Session]) -> str:
    """A grid of the paused ranks."""
    rows = [("Actor Name", "Rank", "Coords", "Hostname", "Function", "Line No.")]
    rows += [(s.actor, str(s.rank), str(s.coords), s.hostname, s.function, str(s.lineno)) for s in sessions]
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    sep = "+" + "+".join("-" * (w + 2) for w in widths) + "+"
    lines = [sep]
    for i, r in enumerate(rows):
        lines.append("| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |")
        lines.append(sep.replace("-", "=") if i == 0 else sep)
    return "\n".join(lines) + "\n"


def _strip_prompt(text: str) -> str:
    return text[:-len("(Pdb) ")] if text.endswith("(Pdb) ") else text


class Repl:
    """``monarch_dbg>``: reads commands from ``io.readline()`` (None at the end), writes to ``io.write``."""

    def __init__(self, io, ctl: Controller | None = None) -> None:
        self.io, self.ctl = io, ctl or controller()

    def run(self) -> None:
        w = self.io.write
        w("\n************************ MONARCH-TENSOR DEBUGGER ************************\n"
          "Enter 'help' for a list of commands.\nEnter 'list' to show all active breakpoints.\n\n")
        while True:
            w("monarch_dbg> ")
            line = self.io.readline()
            if line is None:
                return
            try:
                if self.command(line.strip()):
                    return
            except ValueError as e:
                w(f"error: {e}\n")

    def command(self, line: str) -> bool:
        """Run one command; True when the prompt should close."""
        w = self.io.write
        cmd, _, rest = line.partition(" ")
        if not cmd:
            return False
        if cmd == "help":
            w(HELP)
        elif cmd == "list":
            paused = self.ctl.paused()
            w(table(paused) if paused else "no rank is paused at a breakpoint\n")
        elif cmd == "attach":
            parts = rest.split()
            if len(parts) != 2 or not parts[1].lstrip("-").isdigit():
                raise ValueError("usage: attach <actor name> <rank>")
            self.attach(parts[0], int(parts[1]))
        elif cmd == "cast":
            m = re.match(r"^(\S+)\s+(?:ranks\((.*?)\)|(\*))\s+(.+)$", rest)
            if not m:
                raise ValueError("usage: cast <actor name> ranks(...) <pdb command>")
            self.cast(m.group(1), parse_ranks(m.group(2) or "*"), m.group(4))
        elif cmd in ("continue", "c"):
            paused = self.ctl.paused()
            for s in paused:
                self.ctl.send(s, "c")
            if not self.ctl.wait_all_ended(paused, REPLY_TIMEOUT):
                w("some ranks did not acknowledge 'continue' in time\n")
            w(f"released {len(paused)} paused rank(s)\n")
            return True
        elif cmd in ("quit", "exit"):
            return True
        else:
            raise ValueError(f"unknown command {cmd!r}; 'help' lists them")
        return False

    def attach(self, actor: str, rank: int) -> None:
        w = self.io.write
        s = self.ctl.find(actor, rank)
        if s is None:
            names = sorted({f"{p.actor} {p.rank}" for p in self.ctl.paused()}) or ["none"]
            raise ValueError(f"no paused rank {rank} of actor {actor!r}; paused: {', '.join(names)}")
        w(f"Attached to debug session for rank {rank} ({s.hostname})\n")
        text = self.ctl.read(s)
        if not _LOCATION.search(text):  # pdb said it at an earlier attach or cast: say it again
            text = s.location + (text or "(Pdb) ")
        w(text)
        while True:
            line = self.io.readline()
            if line is None:
                return
            if line.strip() == "detach":
                w(f"Detached from rank {rank}\n")
                return
            self.ctl.send(s, line.rstrip("\n"))
            w(self.ctl.read(s))
            if s.ended:
                w(f"rank {rank} of {actor!r} died ({s.died})\n" if s.died else
                  f"rank {rank} of {actor!r} quit: its call raises BdbQuit\n" if s.quit else
                  f"rank {rank} of {actor!r} continued\n")
                return

    def cast(self, actor: str, pred, command: str) -> None:
        chosen = [s for s in self.ctl.paused() if s.actor == actor and pred(s)]
        if not chosen:
            raise ValueError(f"no paused rank of actor {actor!r} matches")
        for s in chosen:
            self.ctl.read(s, timeout=0.5)  # drop what it printed before (its location and prompt)
            self.ctl.send(s, command)
        for s in chosen:
            text = _strip_prompt(self.ctl.read(s)).rstrip("\n")
            for ln in text.splitlines() or [""]:
                self.io.write(f"[{actor} rank {s.rank}] {ln}\n")
