"""Broadcasts to procs behind host agents go down a tree: bounded fan-out per hop.

A message for many procs of many hosts leaves the sender once per root of the
tree (at most ``FANOUT``), not once per proc. Its first frame is
``TREE_MAGIC`` + a JSON plan ``{"t": [proc ids of this agent], "c": [[agent
address, plan], ...]}``; each agent delivers the payload to its own procs and
passes it on to its children, each child carrying its own sub-plan. With
fan-out F, N hosts are reached in about log_F(N) agent hops.

>>> build_tree([("tcp://a:1", ["1"]), ("tcp://b:1", ["1", "2"])], fanout=8)
[('tcp://a:1', {'t': ['1'], 'c': []}), ('tcp://b:1', {'t': ['1', '2'], 'c': []})]
"""

from __future__ import annotations

import json
import os
from typing import Callable

from .mailbox import ROUTE_SEP

TREE_MAGIC = b"MTTR"
FANOUT = int(os.environ.get("MONARCH_TENSOR_FANOUT", "8"))


def build_tree(items: list[tuple[str, list[str]]], fanout: int = FANOUT) -> list[tuple[str, dict]]:
    """Split ``(agent, proc ids)`` pairs into at most ``fanout`` subtrees, recursively."""
    if fanout < 1:
        raise ValueError(f"fan-out must be at least 1, got {fanout}")
    n = len(items)
    groups = min(fanout, n)
    out = []
    start = 0
    for g in range(groups):
        end = start + (n - start) // (groups - g)
        head, rest = items[start], items[start + 1:end]
        out.append((head[0], {"t": list(head[1]), "c": [[a, p] for a, p in build_tree(rest, fanout)]}))
        start = end
    return out


def send_many(mailbox, addrs: list[str], frames: list) -> None:
    """Send encoded ``frames`` to every address: direct ones one by one, routed ones down a tree."""
    by_agent: dict[str, list[str]] = {}
    for a in addrs:
        agent, sep, inner = a.partition(ROUTE_SEP)
        if sep:
            by_agent.setdefault(agent, []).append(inner)
        else:
            mailbox.send_frames(a, frames)
    if not by_agent:
        return
    if len(by_agent) == 1 and len(next(iter(by_agent.values()))) == 1:
        mailbox.send_frames(next(a for a in addrs if ROUTE_SEP in a), frames)
        return
    for agent, plan in build_tree(list(by_agent.items()), FANOUT):
        mailbox.send_frames(agent, [TREE_MAGIC + json.dumps(plan).encode(), *frames])


def forward(first: bytes, payload: list, deliver: Callable[[str, list], None],
            send: Callable[[str, list], None]) -> None:
    """An agent's part of a tree broadcast: its own procs, then each child with its sub-plan."""
    plan = json.loads(first[len(TREE_MAGIC):])
    for child, sub in plan.get("c", ()):
        send(child, [TREE_MAGIC + json.dumps(sub).encode(), *payload])
    for proc_id in plan.get("t", ()):
        deliver(proc_id, payload)
