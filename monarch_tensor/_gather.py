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
* A chunk of one-frame entries (small replies) travels as one batch frame (``_wire.pack_batch``; a parent's
  batch holds its children's batches), so the caller receives two frames, not one per reply.
"""

from __future__ import annotations

import time
from typing import Callable

from ._fanout import count, read_up, up_header
from ._wire import pack_batch


class _Gather:
    __slots__ = ("key", "up", "w", "left", "procs", "frames", "counts", "accounted", "senders", "deadline",
                 "touched")

    def __init__(self, key: tuple, up: str | None, w: str, left: int, procs: set) -> None:
        self.key, self.up, self.w, self.left, self.procs = key, up, w, left, procs
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
        self.open[key] = _Gather(key, plan.get("u") or None, plan["w"], count(plan), set(plan.get("t", ())))

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
            if len(frames) > 1 and len(counts) == len(frames):  # one-frame entries only: one batch frame
                frames, counts = [pack_batch([f.buffer if hasattr(f, "buffer") else f for f in frames])], [1]
            head = {"k": list(g.key), "a": g.accounted, "n": counts, "u": int(urgent), "w": g.w}
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
