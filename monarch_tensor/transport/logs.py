"""Procs' stdout and stderr, printed by the client with a rank prefix.

``proc_mesh.logging_option(stream_to_client=True, aggregate_window_sec=3)``
folds identical lines from many ranks within the window into one line:
``[4 similar lines] [rank 0-3] loss 1.23``. Folding never reorders one rank's lines (see ``_Group``).
Without it, output to a terminal or a notebook is folded within ``DEFAULT_WINDOW_S`` (the warning every rank
prints once shows once); ``configure(fold_repeated_lines=False)`` prints every line as it comes.
"""

from __future__ import annotations

import math
import sys
import threading
import time

from .. import config
from .. import future as _future
from ._at_exit import at_exit
from .messages import ForwardLogs

_lock = threading.Lock()
_window: float | None = None
_explicit = False  # logging_option(aggregate_window_sec=...) chose the window; else the default (effective_window)
_flusher: threading.Thread | None = None
# The window of the default folding: in a terminal or a notebook, the same line from several ranks within it
# prints once (``configure(fold_repeated_lines=False)`` turns it off). Output to a file or a pipe is not folded.
DEFAULT_WINDOW_S = 0.25


def configure(aggregate_window_sec: float | None) -> None:
    """Fold repeated lines within ``aggregate_window_sec`` seconds (None or 0: print each at once)."""
    global _window, _explicit
    w, what = aggregate_window_sec, "logging_option(aggregate_window_sec=...) takes None or a number of seconds"
    if w is not None and (isinstance(w, bool) or not isinstance(w, (int, float))):
        raise TypeError(f"{what}, got {w!r}")
    if w is not None and not 0 <= w < math.inf:  # (a negative one was taken as None, silently)
        raise ValueError(f"{what} >= 0, got {w!r}")
    with _lock:
        _window = aggregate_window_sec if aggregate_window_sec and aggregate_window_sec > 0 else None
        _explicit = True
        _start_flusher(_window)
    if _window is None:
        flush()


def _start_flusher(window: float | None) -> None:
    global _flusher
    if window is not None and _flusher is None:
        _flusher = threading.Thread(target=_flush_loop, daemon=True, name="monarch-tensor-logs")
        _flusher.start()


def _interactive() -> bool:
    """Whether the script's output goes to a person: a terminal, or a Jupyter notebook (ipykernel's streams)."""
    out = sys.stdout
    try:
        if out.isatty():
            return True
    except (AttributeError, ValueError):  # (a closed or replaced stream)
        return False
    return type(out).__module__.startswith("ipykernel")


def effective_window() -> float | None:
    """The window in force: logging_option's, else the default folding's where it applies."""
    if _explicit:
        return _window
    return DEFAULT_WINDOW_S if config.get("fold_repeated_lines") and _interactive() else None


def _out(stream: int):
    return sys.stdout if stream == 1 else sys.stderr


class StreamLines:
    """One output stream of a proc, cut into lines, with the switches that ``logging_option`` writes into it
    (``MARK_OF``): a switch applies to the lines after it in the stream, however late they are read."""

    MARKS = {b"\0monarch-tensor logs off\0": False, b"\0monarch-tensor logs on\0": True}
    MARK_OF = {on: mark + b"\n" for mark, on in MARKS.items()}

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled  # forwarded, or left on the proc's own terminal
        self.pending = b""  # a partial last line

    def feed(self, chunk: bytes) -> list[tuple[bool, list[bytes]]]:
        """The whole lines ``chunk`` completes, in runs of one switch state: ``[(forwarded, lines), ...]``."""
        data = self.pending + chunk
        *lines, self.pending = data.split(b"\n")
        if b"\0" not in data:  # (a switch starts with one; output rarely holds any)
            return [(self.enabled, lines)] if lines else []
        runs, start = [], 0
        for i, ln in enumerate(lines):
            mark = next((m for m in self.MARKS if ln.endswith(m)), None)
            if mark is None:
                continue
            before = lines[start:i] + ([ln[:-len(mark)]] if len(ln) > len(mark) else [])
            if before:  # (a partial line the switch came behind ends here)
                runs.append((self.enabled, before))
            self.enabled = self.MARKS[mark]
            start = i + 1
        if lines[start:]:
            runs.append((self.enabled, lines[start:]))
        return runs

    def end(self) -> list[tuple[bool, list[bytes]]]:
        """The partial last line, once the stream has ended."""
        last, self.pending = self.pending, b""
        return [(self.enabled, [last])] if last else []


# The longest a reply waits for its proc's output to be printed first (see OutputHandled, and
# _proc._LogForwarder.before_reply): a proc whose output is stuck on its way delays its replies no longer.
OUTPUT_WAIT_S = 1.0


class OutputHandled:
    """How many bytes of each relayed proc's stdout and stderr this process has handled (printed, folded into
    the aggregation window, or sent on to its own client), as ``host.LocalHost``'s reader takes them from the
    template; a reply that says how much its proc had written (``SendToPort.output_before``) waits for that
    much here (``wait_for``), so that a call's result comes after what its endpoint printed, as with a local
    function. The output and the reply travel apart (template and pipe; the mailbox), and the output often
    came second.

    A relay that let a reply wait ``OUTPUT_WAIT_S`` (its template busy, its pipe stuck) lags: replies do not
    wait for it again until it relays more."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._bytes: dict[int, list[int]] = {}  # pid -> [0, stdout bytes, stderr bytes]
        self._lagging = False
        self._readers: set[int] = set()  # the threads that count (they never wait on themselves)

    def begin(self, pid: int) -> None:
        """(A reader) proc ``pid`` was forked: nothing of its output handled yet."""
        with self._cond:
            self._readers.add(threading.get_ident())
            self._bytes[pid] = [0, 0, 0]

    def add(self, pid: int, stream: int, n: int) -> None:
        """(A reader) ``n`` more bytes of ``pid``'s ``stream`` (1, 2) handled."""
        with self._cond:
            counts = self._bytes.get(pid)
            if counts is not None:
                counts[stream] += n
            self._lagging = False
            self._cond.notify_all()

    def end(self, pid: int) -> None:
        """(A reader) proc ``pid`` exited and all its output was handled."""
        with self._cond:
            self._bytes.pop(pid, None)
            self._cond.notify_all()

    def wait_for(self, pid: int, stdout: int, stderr: int) -> None:
        """Until ``stdout`` and ``stderr`` bytes of proc ``pid``'s output are handled (``OUTPUT_WAIT_S`` at most);
        at once for a proc this process does not relay, or one that exited."""
        if threading.get_ident() in self._readers:
            return

        def handled() -> bool:
            counts = self._bytes.get(pid)
            return counts is None or (counts[1] >= stdout and counts[2] >= stderr)

        with self._cond:
            if not self._lagging and not self._cond.wait_for(handled, OUTPUT_WAIT_S):
                self._lagging = True


output_handled = OutputHandled()


class _Group:
    """One line the aggregation window holds, and the ranks that printed it (folded into one line when printed).

    Groups are printed by ``depth``, then in the order they were made. A rank's line joins the group of an
    identical line only where that keeps the rank's order: the group must come after the rank's previous line
    (a deeper group, or one no line followed yet, which can be moved deeper); else the line starts a group of
    its own one deeper than the rank's previous line. So every rank's lines print in the order it wrote them:
    ranks that print "start", a line of their own, "end" show one "start", their own lines, then one "end"."""

    __slots__ = ("stream", "line", "seen", "depth", "ranks", "followed")

    def __init__(self, stream: int, line: str, seen: float, depth: int) -> None:
        self.stream, self.line, self.seen, self.depth = stream, line, seen, depth
        self.ranks: list[int] = []
        self.followed = False  # a rank printed a line after this one


_groups: list[_Group] = []  # every group held, in the order they were made
_latest: dict[tuple[int, str], _Group] = {}  # (stream, line) -> the latest group of that line
_last: dict[int, _Group] = {}  # rank -> the group of its latest line, while held


def client_log_sink(msg: ForwardLogs) -> None:
    """Called on the client's I/O thread for every batch of lines from a proc."""
    window = effective_window()
    with _lock:
        if window is None:
            out = _out(msg.stream)
            prefix = f"[{msg.rank}] " if config.get("prefix_with_rank") else ""
            out.write("".join(f"{prefix}{line}\n" for line in msg.lines))
            out.flush()
            return
        if not _explicit:
            _start_flusher(window)  # (the default folding's; configure starts logging_option's)
        now = time.monotonic()
        for line in msg.lines:
            prev, group = _last.get(msg.rank), _latest.get((msg.stream, line))
            if group is not None and prev is not None and group is not prev and group.depth <= prev.depth:
                if group.followed:  # (it may hold this rank's earlier lines: it cannot move after them)
                    group = None
                else:
                    group.depth = prev.depth + 1
            if group is None:
                group = _latest[(msg.stream, line)] = _Group(msg.stream, line, now, prev.depth + 1 if prev else 0)
                _groups.append(group)
            if prev is not None and prev is not group:
                prev.followed = True
            group.ranks.append(msg.rank)
            _last[msg.rank] = group
        if not _explicit:  # (the default folding: a wait that returns prints what it holds, see future.py)
            _future._held_output = _print_held


def _print_held() -> None:
    """What the default folding holds, printed now: a wait returned (``future._held_output``)."""
    if not _explicit:
        flush()


def _ranks_text(ranks: list[int]) -> str:
    rs = sorted(set(ranks))
    if len(rs) > 1 and rs == list(range(rs[0], rs[-1] + 1)):
        return f"{rs[0]}-{rs[-1]}"
    return ",".join(map(str, rs))


def flush(older_than: float | None = None) -> None:
    """Print folded lines; with ``older_than``, only groups first seen that many seconds ago, and the groups
    printed before them (``_Group``'s order: the lines their ranks printed earlier)."""
    global _groups
    with _lock:
        now = time.monotonic()
        order = sorted(_groups, key=lambda g: g.depth)  # (stable: made first, printed first)
        n = len(order) if older_than is None else max(
            (i + 1 for i, g in enumerate(order) if now - g.seen >= older_than), default=0)
        items, _groups = order[:n], order[n:]
        if not _groups:
            _future._held_output = None
        for g in items:
            if _latest.get((g.stream, g.line)) is g:
                del _latest[(g.stream, g.line)]
            for r in g.ranks:
                if _last.get(r) is g:
                    del _last[r]
    if not items:
        return
    prefixed = config.get("prefix_with_rank")
    for g in items:
        out, ranks = _out(g.stream), g.ranks
        if len(ranks) > 1:
            where = f"[rank {_ranks_text(ranks)}] " if prefixed else ""
            out.write(f"[{len(ranks)} similar lines] {where}{g.line}\n")
        else:
            out.write(f"[{ranks[0]}] {g.line}\n" if prefixed else f"{g.line}\n")
        out.flush()


at_exit(flush)  # what the last window folded (procs stopped at exit flush first: host.ProcMesh.stop)


def _flush_loop() -> None:
    while True:
        w = effective_window()
        time.sleep(min(w, 0.1) if w else 0.5)
        flush(older_than=w)
