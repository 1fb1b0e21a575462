"""Spawns down the tree of host agents: the controller sends one ``SpawnTree`` per root agent, not one request per
agent, and hears one ``ReportSpawnedTree`` per root.

The tree is the one broadcasts take (``_fanout.path``): each agent forks its own procs and, at once, passes
each child agent its part (a one-way ``SpawnTree`` naming itself and its id of the spawn in ``reply_to``); a
child answers the same way, with the results of its whole subtree. An agent answers when its own spawn and
every child have; a child that has not answered ``timeout`` seconds after the request came fails each agent
of its subtree with a ``HostUnreachableError`` naming both (a dead or unreachable agent holds nobody else's
answer back). Every result is per agent: ``(address, ReportSpawned or None, error or None)``, so the
controller fails exactly the ranks of the agents that failed. The controller also watches each agent's
connection (``remote_hosts``): one that drops fails the spawn within a second, not at the timeout.

>>> roots = plan("s", {"tcp://a:1": spawn_a, "tcp://b:1": spawn_b}, timeout=60)  # doctest: +SKIP
>>> [(addr, sorted(agents)) for addr, _, agents in roots]                           # doctest: +SKIP
[('tcp://a:1', ['tcp://a:1']), ('tcp://b:1', ['tcp://b:1'])]
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from typing import Callable

from ..errors import HostUnreachableError
from ..transport import _fanout
from .agent_messages import SpawnProcs, SpawnTree

# Each level of the tree waits this much longer for its children than they may take themselves (one hop's
# answer on top of the spawns below it).
SLACK_S = 2.0


def depth_of(node: dict) -> int:
    return 1 + max((depth_of(n) for n in node.values()), default=0)


def plan(session: str, parts: dict[str, SpawnProcs], timeout: float, slack: float = SLACK_S,
         fanout: int | None = None) -> list[tuple[str, SpawnTree, list[str]]]:
    """``parts``: each agent's spawn (by address). The ``SpawnTree`` to send to each root agent, with the agents of
    its subtree that spawn something: ``[(root address, SpawnTree, [agent addresses]), ...]``; ``fanout``: the
    tree's (None: ``_fanout.FANOUT``, as broadcasts take it). An agent at depth
    ``k`` of a tree of depth ``D`` waits ``timeout + (D - k) * slack`` seconds for its children."""
    root: dict = {}
    for addr in parts:
        level = root
        for hop in _fanout.path(addr, fanout):
            level = level.setdefault(hop, {})
    d = depth_of(root) - 1

    def make(addr: str, node: dict, k: int) -> tuple[SpawnTree, list[str]]:
        below, agents = [], [addr] if addr in parts else []
        for child, sub in node.items():
            tree, under = make(child, sub, k + 1)
            below.append((child, tree))
            agents += under
        return SpawnTree(session, addr, parts.get(addr), tuple(below), timeout + (d - k) * slack), agents

    out = []
    for addr, node in root.items():
        tree, agents = make(addr, node, 1)
        out.append((addr, tree, agents))
    return out


def request_timeout(roots: list, timeout: float, slack: float = SLACK_S) -> float:
    """How long the controller waits for a root's answer: its children's wait, and one hop more."""
    return max((t.timeout for _, t, _ in roots), default=timeout) + slack


def nodes_of(tree: SpawnTree) -> list[str]:
    """Every agent of a subtree, those that only pass the spawn on included."""
    out = [tree.agent]
    for _, sub in tree.below:
        out += nodes_of(sub)
    return out


def agents_of(tree: SpawnTree) -> list[str]:
    """The agents of a subtree that spawn something."""
    out = [tree.agent] if tree.spawn is not None else []
    for _, sub in tree.below:
        out += agents_of(sub)
    return out


@dataclasses.dataclass
class _Pending:
    name: str
    answer: Callable[[tuple], None]
    left: dict  # child address -> its SpawnTree, until it answers
    own: bool  # this agent's own spawn is still running
    deadline: float
    timeout: float
    results: list = dataclasses.field(default_factory=list)


class SpawnTrees:
    """An agent's spawns in flight down the tree (its loop's thread only). ``send(child, tree)``: pass a child its
    part; ``me``: this agent's address, where children answer."""

    def __init__(self, me: str, send: Callable[[str, SpawnTree], None]) -> None:
        self.me, self.send = me, send
        self.pending: dict[int, _Pending] = {}
        self._ids = itertools.count(1)

    def start(self, tree: SpawnTree, answer: Callable[[tuple], None]) -> int:
        """Pass ``tree``'s children their parts; ``answer(results)`` once its own spawn (``own_done``, where it
        has one) and every child answered, or timed out. Its id, which children's answers name."""
        tid = next(self._ids)
        p = self.pending[tid] = _Pending(tree.agent, answer, dict(tree.below), tree.spawn is not None,
                                         time.monotonic() + tree.timeout, tree.timeout)
        for child, sub in tree.below:
            try:
                self.send(child, dataclasses.replace(sub, reply_to=(self.me, tid)))
            except Exception as e:  # noqa: BLE001 - that subtree's agents fail, the others go on
                p.left.pop(child, None)
                p.results += [(a, None, HostUnreachableError(f"host agent {self.me} could not pass the spawn on "
                                                             f"to {child}: {e!r}")) for a in agents_of(sub)]
        self._done_yet(tid)
        return tid

    def own_done(self, tid: int, report, error) -> None:
        p = self.pending.get(tid)
        if p is not None:
            p.results.append((p.name, report, error))
            p.own = False
            self._done_yet(tid)

    def child_done(self, tid: int, child: str, results: tuple) -> None:
        """A child's answer; one that comes after its subtree timed out is dropped (the controller fails the
        spawn, and cancels it on every agent: its procs are killed there)."""
        p = self.pending.get(tid)
        if p is None or p.left.pop(child, None) is None:
            return
        p.results += results
        self._done_yet(tid)

    def expire(self, now: float) -> None:
        """Fail the subtrees of children that did not answer in time."""
        for tid, p in list(self.pending.items()):
            if p.left and now >= p.deadline:
                for child, sub in p.left.items():
                    p.results += [(a, None, HostUnreachableError(
                        f"host agent {a} did not answer the spawn within {p.timeout:.0f} s through {child} (down, "
                        f"hung, or unreachable from host agent {self.me})")) for a in agents_of(sub)]
                p.left.clear()
                self._done_yet(tid)

    def _done_yet(self, tid: int) -> None:
        p = self.pending[tid]
        if not p.own and not p.left:
            del self.pending[tid]
            p.answer(tuple(p.results))
