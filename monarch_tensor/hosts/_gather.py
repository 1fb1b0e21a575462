"""A host agent's side of replies up the tree (see ``_fanout``): gathers, and messages passed up in order.

Rules the agent keeps:

* A gather expects one entry per proc of its subtree; it sends what it holds up (to its parent agent, or
  the caller's gateway at the root) as one chunk when the subtree has answered, at once when an entry is
  urgent (an error, a death, a message passed up behind held entries), and ``window`` seconds after its
  first held entry otherwise. A gather that saw nothing for ``ttl`` seconds is dropped; what comes for it
  later is passed up as it is (each chunk names its port, so the caller still gets it).
* Everything from one sender (a proc of this host, or a child agent) goes up the way its last entries
  went: a message passed up behind entries this agent holds from the same sender goes as the last entry
  of their chunk, flushed at once; otherwise along the sender's last way up. A link is FIFO, so the
  caller sees one sender's messages in the order sent, a reply before its sender's death.
* A proc that exits accounts for its entry in every gather that waits on it (the caller's supervision
  fails its rank).
* A gather (not folded) reads its own procs' plain replies whose values are made of builtin types only
  (``_wire.loads_builtin``: no class is looked up, so nothing of the sender's code runs on the agent, and the
  values pickle back the same), and its children's chunks that hold nothing else, and sends them up as one
  entry (``GatheredReplies``), its chunk's first: the caller unpickles one list per root agent, not one
  message per reply. A proc's later messages in the same chunk
  follow it, so one sender's order holds. Errors, values with buffers or of other types go up as they came.
* A chunk of one-frame entries (small replies) travels as one batch frame (``_wire.pack_batch``; a parent's
  batch holds its children's batches), so the caller receives two frames, not one per reply.
* A folded gather (plan key "r", ``Accumulator`` with an associative combine) keeps its plain replies (one
  frame, no error, no output to print first) as runs ``[lo, hi, value]`` over the call's places (plan key "p"),
  and combines two runs when they are adjacent (``hi + 1 == lo``), the earlier one on the left: each run is the
  fold of its places' values in the call's order, bracketed by the tree. Its chunk carries the runs as its first
  entry (``FoldedReplies``, header "f"), which a folding parent merges into its own. Everything else (errors,
  large values, a combine that raises or that this agent cannot unpickle, values of a type the fold is not
  exact for) goes up unfolded, and the caller folds it in in order.
"""

from __future__ import annotations

import base64
import bisect
import logging
import pickle
import time
from typing import Callable

from ..transport import _wire
from ..transport._fanout import count, read_up, up_header
from ..transport._wire import pack_batch
from ..transport.messages import FoldedReplies, GatheredReplies

log = logging.getLogger("monarch_tensor.hosts.agent")

# Types a known reduction is exact for (Accumulator's fold spec "e" names them).
_EXACT = {"int": int, "bool": bool, "str": str}


class Fold:
    """A folded call's combine, as an agent applies it: ``merge(a, b)`` is (True, combine(a, b)), or (False, None)
    where it must not fold them (a type the fold is not exact for) or the combine raised."""

    __slots__ = ("combine", "exact")

    def __init__(self, combine: Callable, exact: tuple | None) -> None:
        self.combine, self.exact = combine, exact

    def merge(self, a, b) -> tuple[bool, object]:
        if self.exact is not None and (type(a) not in self.exact or type(b) not in self.exact):
            return False, None
        try:
            return True, self.combine(a, b)
        except Exception:  # noqa: BLE001 - the caller folds these two itself, and sees what it raises
            return False, None


_folds: dict[str, Fold | None] = {}


def fold_of(spec: dict) -> Fold | None:
    """The ``Fold`` of a plan's spec ``{"f": base64 pickle of the combine, "e": [exact type names]}`` (cached),
    or None where this process cannot unpickle it (its replies then go up unfolded)."""
    key = spec.get("f", "") + "|" + ",".join(spec.get("e") or ())
    if key in _folds:
        return _folds[key]
    try:
        combine = pickle.loads(base64.b64decode(spec["f"]))
        if not callable(combine):
            raise TypeError(f"not callable: {combine!r}")
        exact = tuple(_EXACT[n] for n in spec["e"]) if spec.get("e") is not None else None
        fold = Fold(combine, exact)
    except Exception as e:  # noqa: BLE001 - e.g. a function of a module this host cannot import
        log.warning("cannot fold replies here (the caller folds them): %r", e)
        fold = None
    if len(_folds) >= 64:
        _folds.clear()
    _folds[key] = fold
    return fold


def _buf(f):
    return f.buffer if hasattr(f, "buffer") else f


class _Gather:
    __slots__ = ("key", "up", "w", "left", "procs", "frames", "counts", "accounted", "senders", "deadline",
                 "touched", "fold", "pos", "runs", "ranks", "values")

    def __init__(self, key: tuple, up: str | None, w: str, left: int, procs: set) -> None:
        self.key, self.up, self.w, self.left, self.procs = key, up, w, left, procs
        self.fold: Fold | None = None
        self.pos: dict = {}  # proc id -> its place in the call (a folded gather)
        self.runs: list = []  # [lo, hi, value], sorted by lo, none adjacent to the next unless they did not merge
        self.ranks: list = []  # its procs' plain replies read here (a gathered call): their ranks and values
        self.values: list = []
        self.frames: list = []
        self.counts: list[int] = []
        self.accounted = 0
        self.senders: set = set()
        self.deadline: float | None = None
        self.touched = time.monotonic()


class Gathers:
    """The open gathers of one agent. ``send(addr, frames)`` sends on the agent's links; ``me``: its address."""

    def __init__(self, send: Callable[[str, list], None], window: float, ttl: float) -> None:
        self.send = send
        self.window, self.ttl = window, ttl
        self.open: dict[tuple, _Gather] = {}
        self.holding: dict[object, dict[tuple, _Gather]] = {}  # sender -> gathers holding its entries, in order
        self.route: dict[object, str] = {}  # sender -> the way its last entries went up
        self.next_deadline: float | None = None
        self._swept = time.monotonic()

    # ---- from the tree ---------------------------------------------------------------------
    def start(self, plan: dict) -> None:
        """A tree message with a gather reached this agent: expect its subtree's replies."""
        key = tuple(plan["g"])
        if key in self.open:  # (the same port again: an odd caller; the first gather goes up as it is)
            self._flush(self.open[key], False)
        g = self.open[key] = _Gather(key, plan.get("u") or None, plan["w"], count(plan), set(plan.get("t", ())))
        if plan.get("r") is not None:
            g.fold = fold_of(plan["r"])
            g.pos = dict(zip(plan.get("t", ()), plan.get("p", ())))

    # ---- from procs and child agents -----------------------------------------------------------
    def take(self, sender, frames: list) -> None:
        """A message up the tree from ``sender`` (a proc's id, or a child agent's routing id)."""
        kind, head = read_up(frames[0])
        if kind == b"g":
            self._entries(sender, head, frames)
        else:
            self.pass_up(sender, head["w"], frames[1:])

    def _entries(self, sender, head: dict, frames: list) -> None:
        key = tuple(head["k"])
        g = self.open.get(key)
        if g is None:  # its gather is done or dropped: up as it is, the sender's way
            self._up(sender, head["w"], frames, wrapped=True)
            return
        a = head.get("a", 1)
        g.left -= a
        g.procs.discard(sender)
        g.accounted += a
        if g.fold is not None:
            rest, counts = self._fold_in(g, sender, head, frames)
            g.frames.extend(rest)
            g.counts.extend(counts)
        elif not self._read_plain(g, head, frames):
            g.frames.extend(frames[1:])
            g.counts.extend(head.get("n", (len(frames) - 1,)))
        g.senders.add(sender)
        self.holding.setdefault(sender, {})[key] = g
        g.touched = time.monotonic()
        if head.get("u") or g.left <= 0:
            self._flush(g, bool(head.get("u")))
        elif g.deadline is None:
            g.deadline = g.touched + self.window
            if self.next_deadline is None or g.deadline < self.next_deadline:
                self.next_deadline = g.deadline

    def _read_plain(self, g: _Gather, head: dict, frames: list) -> bool:
        """Keep a proc's plain reply of builtin values, or a child's chunk that is only its ``GatheredReplies``, in
        ``g.ranks``/``g.values`` (sent up as one entry)."""
        if head.get("u") or len(frames) != 2 or head.get("n", [1]) != [1]:  # (an error, buffers, several entries)
            return False
        try:
            t = _wire.loads_builtin(_buf(frames[1]))
        except Exception:  # noqa: BLE001 - not builtin values: up as it came
            return False
        if type(t) is not tuple or t[1:2] != (g.key[1],):
            return False
        if "n" not in head and len(t) == 6 and t[0] == "\0reply" and t[3] is None and t[5] is None:
            g.ranks.append(t[4])
            g.values.append(t[2])
            return True
        if "n" in head and len(t) == 4 and t[0] == "\0replies":
            g.ranks.extend(t[2])
            g.values.extend(t[3])
            return True
        return False

    def _fold_in(self, g: _Gather, sender, head: dict, frames: list) -> tuple[list, list]:
        """Fold what a message up brings into ``g``'s runs: a proc's plain reply, or a child's runs (its chunk's
        first entry); the entries it did not fold and their frame counts."""
        rest, counts = frames[1:], list(head.get("n", (len(frames) - 1,)))
        if head.get("f"):  # a child's chunk: its runs first
            try:
                msg = _wire.decode([_buf(f) for f in rest[:counts[0]]])
                runs = msg.runs if type(msg) is FoldedReplies else None
            except Exception:  # noqa: BLE001 - passed up as it is: the caller reads it (or reports it)
                runs = None
            if runs is None:
                return rest, counts
            for lo, hi, value in runs:
                self._add_run(g, lo, hi, value)
            return rest[counts[0]:], counts[1:]
        pos = g.pos.get(sender)
        if "n" in head or len(rest) != 1 or pos is None:
            return rest, counts
        try:
            t = _wire.loads_plain(_buf(rest[0]))
        except Exception:  # noqa: BLE001 - not a plain reply (buffers, or a value this host cannot unpickle)
            return rest, counts
        if type(t) is tuple and len(t) == 6 and t[0] == "\0reply" and t[1] == g.key[1] and t[3] is None \
                and t[5] is None:
            self._add_run(g, pos, pos, t[2])
            return [], []
        return rest, counts

    def _add_run(self, g: _Gather, lo: int, hi: int, value) -> None:
        """Insert a run into ``g``'s runs, merged with its neighbours where adjacent and the fold allows."""
        runs = g.runs
        i = bisect.bisect_left(runs, lo, key=lambda r: r[0])
        runs.insert(i, [lo, hi, value])
        if i + 1 < len(runs) and runs[i + 1][0] == hi + 1:
            self._merge(g, i)
        if i > 0 and runs[i - 1][1] + 1 == lo:
            self._merge(g, i - 1)

    def _merge(self, g: _Gather, i: int) -> None:
        a, b = g.runs[i], g.runs[i + 1]
        assert g.fold is not None  # (a gather has runs only where it folds: _fold_in)
        ok, value = g.fold.merge(a[2], b[2])
        if ok:
            a[1], a[2] = b[1], value
            del g.runs[i + 1]

    def pass_up(self, sender, w: str, frames: list) -> None:
        """One message of ``sender`` for its caller, behind everything it sent before."""
        held = self.holding.get(sender)
        if held:
            gs = list(held.values())
            for g in gs[:-1]:
                self._flush(g, True)
            last = gs[-1]
            last.frames.extend(frames)
            last.counts.append(len(frames))
            self._flush(last, True)
            return
        self._up(sender, w, frames, wrapped=False)

    def proc_exited(self, proc_id: str) -> None:
        """A proc of this agent exited (its last messages passed up already): it answers no gather any more."""
        self.route.pop(proc_id, None)
        for g in list(self.open.values()):
            if proc_id in g.procs:
                g.procs.discard(proc_id)
                g.left -= 1
                g.accounted += 1
                if g.left <= 0:
                    self._flush(g, True)

    # ---- up ----------------------------------------------------------------------------------
    def _up(self, sender, w: str, frames: list, wrapped: bool) -> None:
        """Send a message of ``sender`` up its way: to the gateway as it is, to a parent agent wrapped."""
        way = self.route.get(sender, w)
        if wrapped or way == w:  # (a chunk stays one: the caller reads it as such)
            self.send(way, frames)
        else:
            self.send(way, [up_header(b"p", {"w": w}), *frames])

    def _flush(self, g: _Gather, urgent: bool) -> None:
        if g.frames or g.accounted:
            frames, counts = g.frames, g.counts
            if g.ranks:  # its procs' plain replies first: each sender's later entries follow its reply
                read = _wire.encode(GatheredReplies(g.key[1], tuple(g.ranks), tuple(g.values)))
                frames, counts = [*read, *frames], [len(read), *counts]
                g.ranks, g.values = [], []
            if len(frames) > 1 and len(counts) == len(frames):  # one-frame entries only: one batch frame
                frames, counts = [pack_batch([f.buffer if hasattr(f, "buffer") else f for f in frames])], [1]
            head = {"k": list(g.key), "a": g.accounted, "n": counts, "u": int(urgent), "w": g.w}
            if g.runs:  # the runs first, an entry of their own (a folding parent takes them out)
                folded = _wire.encode(FoldedReplies(g.key[1], tuple(tuple(r) for r in g.runs)))
                frames, head["n"], head["f"] = [*folded, *frames], [len(folded), *counts], 1
                g.runs = []
            way = g.up or g.w
            self.send(way, [up_header(b"g", head), *frames])
            for s in g.senders:
                self.route[s] = way
                held = self.holding.get(s)
                if held is not None:
                    held.pop(g.key, None)
                    if not held:
                        del self.holding[s]
            g.frames, g.counts, g.accounted, g.senders = [], [], 0, set()
        g.deadline = None
        if g.left <= 0:
            self.open.pop(g.key, None)

    def due(self, now: float) -> float | None:
        """Flush the gathers whose window ended, drop the stale ones; the next deadline (None: none)."""
        if self.next_deadline is not None and now >= self.next_deadline:
            nxt = None
            for g in list(self.open.values()):
                if g.deadline is not None:
                    if g.deadline <= now:
                        self._flush(g, False)
                    elif nxt is None or g.deadline < nxt:
                        nxt = g.deadline
            self.next_deadline = nxt
        if now - self._swept > 1.0:
            self._swept = now
            for g in [g for g in self.open.values() if now - g.touched > self.ttl]:
                g.left = 0
                self._flush(g, False)
                self.open.pop(g.key, None)
        return self.next_deadline
