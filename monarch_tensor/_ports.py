"""Port handlers that turn replies from many ranks into futures."""

from __future__ import annotations

import collections
import queue
import threading
from typing import Callable

from .errors import SupervisionError
from .future import Future
from .messages import SendToPort


class Collector:
    """Waits for one reply from each of ``addrs``; the reply of rank ``ranks[i]`` goes to slot i.

    ``finish(values)`` builds the future's value once every reply is in; the
    first error (an ``ActorError`` or a dead proc) fails the future.
    """

    def __init__(self, addrs: list[str], ranks: list[int], finish: Callable[[list], object],
                 what: str = "reply", observing: bool = True) -> None:
        self.future: Future = Future(what)
        self.observing = observing  # a user's call: its failure counts as seen by the user
        self._by_rank = {r: i for i, r in enumerate(ranks)}
        self._values: list = [None] * len(addrs)
        self._left = len(addrs)
        self._finish = finish
        self._lock = threading.Lock()
        self._waiting = set(addrs)

    def deliver(self, msg: SendToPort) -> bool:
        if msg.error is not None:
            self.future._set_exception(msg.error)
            return True
        with self._lock:
            self._values[self._by_rank[msg.rank]] = msg.value
            self._left -= 1
            done = self._left == 0
        if done:
            try:
                self.future._set_result(self._finish(self._values))
            except BaseException as e:  # noqa: BLE001
                self.future._set_exception(e)
        return done

    def proc_died(self, addr: str, error: SupervisionError) -> bool:
        if addr in self._waiting and not self.future.done():
            self.future._set_exception(error)
            return True
        return False


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

    def proc_died(self, addr: str, error: SupervisionError) -> bool:
        if addr == self._addr and not self.future.done():
            self.future._set_exception(error)
            return True
        return False


class StreamCollector:
    """Replies in arrival order, as a queue of ready futures."""

    def __init__(self, addrs: list[str]) -> None:
        self.q: queue.Queue = queue.Queue()
        self._left = len(addrs)
        self._waiting = set(addrs)

    def deliver(self, msg: SendToPort) -> bool:
        self.q.put(Future.failed(msg.error) if msg.error is not None else Future.ready(msg.value))
        self._left -= 1
        return self._left == 0

    def proc_died(self, addr: str, error: SupervisionError) -> bool:
        if addr in self._waiting:
            self._waiting.discard(addr)
            self.q.put(Future.failed(error))
            self._left -= 1
        return self._left <= 0


class Receiver:
    """An open channel's receiving end: values in order, each to the oldest waiting ``recv()``."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._values: collections.deque = collections.deque()
        self._waiters: collections.deque = collections.deque()

    def recv(self) -> Future:
        with self._lock:
            if self._values:
                msg = self._values.popleft()
            else:
                fut = Future("channel value")
                self._waiters.append(fut)
                return fut
        return Future.failed(msg.error) if msg.error is not None else Future.ready(msg.value)

    def deliver(self, msg: SendToPort) -> bool:
        with self._lock:
            if not self._waiters:
                self._values.append(msg)
                return False
            fut = self._waiters.popleft()
        if msg.error is not None:
            fut._set_exception(msg.error)
        else:
            fut._set_result(msg.value)
        return False

    def proc_died(self, addr: str, error: SupervisionError) -> bool:
        return False
