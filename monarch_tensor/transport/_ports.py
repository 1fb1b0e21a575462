"""Port handlers that turn replies from many ranks into futures."""

from __future__ import annotations

import asyncio
import collections
import logging
import threading
from typing import Callable

from ..errors import ActorFailedError, ProtocolError, SupervisionError
from ..future import _FAILED, Future, wait_limit
from .messages import SendToPort

log = logging.getLogger("monarch_tensor")

# A call that killed an actor on one rank (``ActorFailedError``) raises once every rank answered, or this long
# after that death at most: a call that kills all its actors raises once each death is in, so their owner's
# __supervise__ has seen them all (each dying actor answers once its owner has the failure: _proc._FaultAck),
# as Monarch's call, which collects every rank's reply, does.
DEATH_GRACE_S = 2.0


class Collector:
    """Waits for one reply from each of ``addrs``; the reply of rank ``ranks[i]`` goes to slot i.

    ``finish(values)`` builds the future's value once every reply is in; the
    first error (an ``ActorError`` or a dead proc) fails the future. After an
    error it goes on listening until every rank answered or died: the death of
    a rank that had not answered is this call's, seen by its caller (a proc
    dying mid-collective fails its peers' calls first), not an unhandled fault.
    An actor's death (``ActorFailedError``) fails it once the other ranks answered too, or
    ``DEATH_GRACE_S`` after it, whichever is first.
    """

    _held: BaseException | None = None  # an actor's death, the future's error once the others answered
    _grace: threading.Timer | None = None

    def __init__(self, addrs: list[str], ranks: list[int], finish: Callable[[list], object],
                 what: str = "reply", observing: bool = True) -> None:
        self.future: Future = Future(what)
        self.observing = observing  # a user's call: its failure counts as seen by the user
        self._by_rank = dict(zip(ranks, range(len(ranks))))
        self._ranks, self._addrs = ranks, addrs  # (read only where a proc died or failed: see addr_of)
        self._values: list = [None] * len(addrs)
        self._left = len(addrs)
        self._finish = finish
        self._lock = threading.Lock()

    def deliver(self, msg: SendToPort) -> bool:
        with self._lock:
            slot = self._by_rank.pop(msg.rank, None)  # each rank's first reply counts
            if slot is not None:
                self._left -= 1
            done = self._left == 0
        if msg.error is not None:
            if not done and slot is not None and isinstance(msg.error, ActorFailedError):
                self._hold(msg.error)  # (the first death is held; a later one's is not the error)
            else:
                self._fail(msg.error)  # (the first error wins)
            return done or slot is None  # (an error not from a rank of the call: nothing more to wait for)
        if slot is None:
            log.warning("%s: dropped a reply from rank %s, which answered already or was not called",
                        self.future._what, msg.rank)
            return False
        self._values[slot] = msg.value
        return self._settle(done)

    def _hold(self, error: BaseException) -> None:
        with self._lock:
            if self._held is not None or self.future.done():
                return
            self._held = error
            self._grace = threading.Timer(DEATH_GRACE_S, self._fail, (error,))
            self._grace.daemon = True
            self._grace.start()

    def _fail(self, error: BaseException) -> None:
        """The future fails: with a death held back, that first; else with ``error``."""
        if self._grace is not None:
            self._grace.cancel()
        if self._held is not None:
            self.future._set_exception(self._held)
        self.future._set_exception(error)  # (a no-op once failed)

    def _settle(self, done: bool) -> bool:
        """Once every rank answered: the Future gets the finished values (or what finishing them raised)."""
        if done and self._held is not None:
            self._fail(self._held)
            return done
        if done and not self.future.done():
            try:
                self.future._set_result(self._finish(self._values))
            except BaseException as e:  # noqa: BLE001
                self.future._set_exception(e)
        return done

    def deliver_values(self, ranks: list, values: list) -> bool:
        """Plain values of several ranks at once (a chunk of gathered replies): as ``deliver`` of each."""
        if type(self).deliver is not Collector.deliver:  # (a subclass's own deliver sees each)
            done = False
            for rank, value in zip(ranks, values):
                done = self.deliver(SendToPort(-1, value, None, rank))
            return done
        with self._lock:
            by_rank, slots = self._by_rank, self._values
            dropped = []
            for rank, value in zip(ranks, values):
                slot = by_rank.pop(rank, None)
                if slot is None:
                    dropped.append(rank)
                    continue
                slots[slot] = value
            self._left -= len(ranks) - len(dropped)
            done = self._left == 0
        if dropped:
            log.warning("%s: dropped replies from ranks %s, which answered already or were not called",
                        self.future._what, dropped[:10])
        return self._settle(done)

    def addr_of(self, rank: int) -> str:
        """The address ``rank`` was called at ("" if it was not)."""
        return next((a for r, a in zip(self._ranks, self._addrs) if r == rank), "")

    def proc_died(self, addr: str, error: SupervisionError) -> tuple[bool, bool]:
        with self._lock:  # (a rank still waited on is one not yet popped from _by_rank)
            gone = [r for r, a in zip(self._ranks, self._addrs) if a == addr and r in self._by_rank]
            if not gone:
                return False, False
            for rank in gone:
                del self._by_rank[rank]  # (it answers no more: the port is finished once the others did)
                self._left -= 1
            done = self._left == 0
        self._fail(error)  # (a no-op where an error came first: the death is seen all the same)
        return True, done


class FoldCollector:
    """Waits for one reply from each of ``addrs``, as a ``Collector`` does, and folds them (``Accumulator``): its
    future's value is ``combine`` applied from ``identity`` over the replies in the order of ``ranks``. Replies
    come one by one, or as runs ``(lo, hi, value)`` that host agents folded (``_gather``): ``value`` stands for
    the replies at places ``lo..hi`` of the call and is combined in at ``lo`` in their stead. Its bookkeeping
    is per run, not per rank, until a reply of its own or a death comes. The first error (an ``ActorError`` or
    a dead proc) fails the future; ``runs_seen``: how many runs came; ``folded``: ranks in runs of two or more.
    """

    observing = True

    def __init__(self, addrs: list[str], ranks: list[int], identity, combine: Callable, what: str = "reply") -> None:
        self.future: Future = Future(what)
        self._addrs, self._ranks = addrs, ranks
        self._identity, self._combine = identity, combine
        self._answered = bytearray(len(ranks))  # 1: a place answered (or dead)
        self._left = len(ranks)
        self._runs: dict[int, tuple[int, object]] = {}  # lo -> (hi, its folded value)
        self._values: dict[int, object] = {}  # place -> a value that came on its own
        self._place: dict[int, int] | None = None  # rank -> place, made for the first reply on its own
        self._lock = threading.Lock()
        self.runs_seen = self.folded = 0

    def _place_of(self, rank) -> int | None:
        if self._place is None:
            self._place = {r: i for i, r in enumerate(self._ranks)}
        return self._place.get(rank)

    def deliver(self, msg: SendToPort) -> bool:
        with self._lock:
            pos = self._place_of(msg.rank)
            first = pos is not None and not self._answered[pos]  # each rank's first reply counts
            if first and pos is not None:
                self._answered[pos] = 1
                self._left -= 1
                if msg.error is None:
                    self._values[pos] = msg.value
            done = self._left == 0
        if msg.error is not None:
            self.future._set_exception(msg.error)  # (the first error wins)
            return done or pos is None
        if not first:
            log.warning("%s: dropped a reply from rank %s, which answered already or was not called",
                        self.future._what, msg.rank)
            return False
        return self._settle(done)

    def deliver_values(self, ranks: list, values: list) -> bool:
        """Plain values of several ranks at once (a chunk of gathered replies): as ``deliver`` of each."""
        done = False
        for rank, value in zip(ranks, values):
            done = self.deliver(SendToPort(-1, value, None, rank))
        return done

    def deliver_runs(self, runs) -> bool:
        """Runs of replies folded by agents (``FoldedReplies``); a run over a place already answered, or out of
        the call, fails the call (a protocol error), never a fold that counts a rank twice."""
        bad = None
        with self._lock:
            n, answered = len(self._ranks), self._answered
            for lo, hi, value in runs:
                if not (type(lo) is int and type(hi) is int and 0 <= lo <= hi < n):
                    bad = f"places {lo!r}..{hi!r} of a call to {n} ranks"
                    break
                if answered.find(1, lo, hi + 1) != -1:
                    bad = f"rank {self._ranks[answered.index(1, lo, hi + 1)]}, which answered already"
                    break
                answered[lo:hi + 1] = b"\x01" * (hi + 1 - lo)
                self._left -= hi + 1 - lo
                self._runs[lo] = (hi, value)
                self.runs_seen += 1
                if hi > lo:
                    self.folded += hi + 1 - lo
            done = self._left == 0
        if bad is not None:
            self.future._set_exception(ProtocolError(f"{self.future._what}: host agents sent a folded reply for "
                                                     f"{bad} (a protocol error; the fold is not returned)"))
            return True
        return self._settle(done)

    def _settle(self, done: bool) -> bool:
        """Once every rank answered: the Future gets the fold (or what ``combine`` raised)."""
        if done and not self.future.done():
            try:
                self.future._set_result(self._fold())
            except BaseException as e:  # noqa: BLE001
                self.future._set_exception(e)
        return done

    def _fold(self):
        acc, pos, n, runs, values, combine = self._identity, 0, len(self._ranks), self._runs, self._values, \
            self._combine
        while pos < n:
            run = runs.get(pos)
            if run is not None:
                acc = combine(acc, run[1])
                pos = run[0] + 1
            else:
                acc = combine(acc, values[pos])
                pos += 1
        return acc

    def proc_died(self, addr: str, error: SupervisionError) -> tuple[bool, bool]:
        with self._lock:
            lost = [i for i, a in enumerate(self._addrs) if a == addr and not self._answered[i]]
            if not lost:
                return False, False
            for i in lost:  # (it answers no more: the port is finished once the others did)
                self._answered[i] = 1
            self._left -= len(lost)
            done = self._left == 0
        self.future._set_exception(error)  # (a no-op where an error came first: the death is seen all the same)
        return True, done


class OneReply:
    """Waits for the reply of the one proc at ``addr`` (``call_one``, ``choose``): a Collector
    without the bookkeeping for many."""

    observing = True

    def __init__(self, addr: str, what: str = "reply") -> None:
        self.future: Future = Future(what)
        self._addr = addr

    def deliver(self, msg: SendToPort) -> bool:
        if msg.error is not None:
            self.future._set_exception(msg.error)
        else:
            self.future._set_result(msg.value)
        return True

    def proc_died(self, addr: str, error: SupervisionError) -> tuple[bool, bool]:
        if addr == self._addr and not self.future.done():
            self.future._set_exception(error)
            return True, True
        return False, False


class Receiver:
    """An open channel's receiving end: values in order, each to the oldest waiting ``recv()``.

    A ``recv()`` whose wait times out (``get(timeout=)``) or is cancelled (``asyncio.wait_for``) gives
    its place back, so the next value goes to the next ``recv()`` instead of to a future nobody waits
    on; waited on again, it queues again. With ``once``, the port closes after its first value (later
    ones are dropped, as values for any closed port are)."""

    def __init__(self, once: bool = False) -> None:
        self._lock = threading.Lock()
        self._values: collections.deque = collections.deque()
        self._waiters: collections.deque = collections.deque()
        self._once = once
        self._received = False  # once: its value was handed to a recv()

    def recv(self, ranked: bool = False) -> Future:
        """The next value; with ``ranked``, ``(rank of its sender, value)``."""
        with self._lock:
            if self._once and (self._received or self._waiters):
                return Future.failed(ValueError(
                    "recv() of a channel opened with once=True, whose one value was received (or is waited "
                    "for) already; open another channel for another value"))
            if self._values:
                msg = self._values.popleft()
                self._received = True
            else:
                fut = _ChannelValue(self, ranked)
                self._waiters.append(fut)
                return fut
        if msg.error is not None:
            return Future.failed(msg.error)
        return Future.ready((msg.rank, msg.value) if ranked else msg.value)

    def deliver(self, msg: SendToPort) -> bool:
        with self._lock:
            if not self._waiters:
                self._values.append(msg)
                return self._once
            fut = self._waiters.popleft()
            self._received = True
        _settle(fut, msg)
        return self._once

    def proc_died(self, addr: str, error: SupervisionError) -> tuple[bool, bool]:
        return False, False

    def _withdraw(self, fut: Future) -> bool:
        """Take back a waiting ``recv()``; False when a value was handed to it already."""
        with self._lock:
            try:
                self._waiters.remove(fut)
                return True
            except ValueError:
                return False

    def _rearm(self, fut: Future) -> None:
        """A withdrawn ``recv()`` waited on again: it takes the next value, or waits in line for one."""
        with self._lock:
            if fut.done() or fut in self._waiters:
                return
            if not self._values:
                self._waiters.append(fut)
                return
            msg = self._values.popleft()
            self._received = True
        _settle(fut, msg)

    def _give_back(self, fut: Future) -> None:
        """The value handed to a ``recv()`` whose waiter was cancelled meanwhile: first in line again."""
        if fut._state == _FAILED:
            msg = SendToPort(-1, None, fut._value, -1)
        else:
            rank, value = fut._value if getattr(fut, "_ranked", False) else (-1, fut._value)
            msg = SendToPort(-1, value, None, rank)
        with self._lock:
            if not self._waiters:
                self._values.appendleft(msg)
                self._received = False
                return
            nxt = self._waiters.popleft()
        _settle(nxt, msg)


def _settle(fut: Future, msg: SendToPort) -> None:
    if msg.error is not None:
        fut._set_exception(msg.error)
    else:
        fut._set_result((msg.rank, msg.value) if getattr(fut, "_ranked", False) else msg.value)


class _ChannelValue(Future):
    """A ``recv()`` still waiting for its value (see ``Receiver``)."""

    __slots__ = ("_receiver", "_withdrawn", "_ranked", "_lifetime")

    def __init__(self, receiver: Receiver, ranked: bool = False) -> None:
        super().__init__("channel value")
        self._receiver, self._withdrawn, self._ranked = receiver, False, ranked
        self._lifetime = None  # (a waiting recv() keeps its channel open: see actor.Channel.open)

    def _rejoin(self) -> None:
        """Waited on again after a timeout or a cancellation: in line for a value again."""
        if self._withdrawn:
            self._withdrawn = False
            self._receiver._rearm(self)

    def get(self, timeout: float | None = None):
        timeout = wait_limit(timeout)  # (checked before it rejoins the line for a value)
        self._rejoin()
        try:
            return Future.get(self, timeout)
        except TimeoutError:
            if self.done() or not self._receiver._withdraw(self):
                # The value is a TimeoutError, or one was handed over as the wait ended (being set now).
                return Future.get(self, 5.0)
            self._withdrawn = True
            raise

    result = get

    def __await__(self):
        self._rejoin()
        try:
            return (yield from Future.__await__(self))
        except asyncio.CancelledError as e:  # asyncio.wait_for gave up: give the place, or the value, back
            if e is self._value:
                raise  # the value itself
            if not self.done() and self._receiver._withdraw(self):
                self._withdrawn = True
            else:
                self.add_done_callback(self._receiver._give_back)
            raise

    def as_asyncio(self) -> asyncio.Future:
        """An asyncio future of the value; cancelled (``asyncio.wait_for`` gave up, a task was cancelled),
        it gives its place in line, or the value, back, as an ``await`` does."""
        self._rejoin()
        out = Future.as_asyncio(self)

        def cancelled(f: asyncio.Future) -> None:
            if f.cancelled():
                if not self.done() and self._receiver._withdraw(self):
                    self._withdrawn = True
                else:
                    self.add_done_callback(self._receiver._give_back)

        out.add_done_callback(cancelled)
        return out


class StreamCollector(Receiver):
    """``stream()``'s replies: one value per rank, each to the oldest waiting ``recv()`` (arrival order);
    a rank whose proc dies before it replied delivers the proc's failure."""

    def __init__(self, addrs: list[str], ranks: list[int]) -> None:
        super().__init__()
        self._waiting = dict(zip(ranks, addrs))  # rank -> addr, until its reply comes

    def deliver(self, msg: SendToPort) -> bool:
        self._waiting.pop(msg.rank, None)
        super().deliver(msg)
        return not self._waiting

    def proc_died(self, addr: str, error: SupervisionError) -> tuple[bool, bool]:
        ranks = [r for r, a in self._waiting.items() if a == addr]
        for rank in ranks:
            del self._waiting[rank]
            super().deliver(SendToPort(-1, None, error, rank))
        return bool(ranks), not self._waiting  # (its recv() gets the failure: the death is seen)
