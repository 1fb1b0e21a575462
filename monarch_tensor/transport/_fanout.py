"""Messages to procs behind host agents go down a tree of agents: bounded fan-out per hop, one path per agent.

The agents of one job (one key) form a fixed ``FANOUT``-ary tree in the order
this process met them: the first ``FANOUT`` are children of the sender, agent
``i`` (``i >= FANOUT``) is a child of agent ``i // FANOUT - 1``. Every message
to a proc of agent X, a broadcast or a single call, travels the same path to
X, hop by hop over FIFO links, so messages from one sender to one proc arrive
in the order sent. A message for many procs of many hosts leaves the sender at
most ``FANOUT`` times, not once per proc. Its first frame is ``TREE_MAGIC`` + a
JSON plan ``{"t": [proc ids of this agent], "c": [[agent address, plan],
...]}``; each agent delivers the payload to its own procs and passes it on to
its children, each child carrying its own sub-plan. With fan-out F, N hosts
are reached in about log_F(N) agent hops. ``FANOUT`` is read at every send:
change it only while nothing is in flight.

Replies come back up the same tree (``GATHER``). A ``call()`` to procs
behind agents names the reply port ``GATHER_PREFIX + address``, and each
root plan carries ``"g"`` (the port: ``[address, port id]``) and ``"w"`` (the
caller's gateway). Each agent on the way opens a gather for the port, expecting
one reply per proc of its subtree (``count``); its children's plans get
``"u"``, its own address, where their chunks go. A proc sends such a reply to
its agent (``UP_MAGIC``); the agent sends what it holds up in one chunk when its
whole subtree answered, at once when an entry is an error or a death, and after
a window otherwise (``agent.GATHER_WINDOW_S``), so a slow or dead subtree holds
nobody's values back. A proc behind an agent sends every other message for its
caller up through the agent too, which first sends up whatever it holds from
that proc, with the message as the chunk's last entry: messages from one sender
reach the caller in the order sent, replies before the sender's death.

A folded call (``Accumulator`` with an associative combine, ``_gather``) adds ``"r"`` (the fold: the pickled
combine) to every plan, and ``"p"`` (each proc's place in the call, beside ``"t"``): agents combine the
replies of consecutive places as they gather them and send up runs of folded values.

>>> register("tcp://a:1", "key"); register("tcp://b:1", "key")
>>> build_tree([("tcp://a:1", ["1"]), ("tcp://b:1", ["1", "2"])], fanout=8)
[('tcp://a:1', {'t': ['1'], 'c': []}), ('tcp://b:1', {'t': ['1', '2'], 'c': []})]
"""

from __future__ import annotations

import json
import threading
from typing import Callable

from ..config import setting

TREE_MAGIC = b"MTTR"
# A proc behind a host agent has the address "tcp://agent:port|ipc:///path": messages to it go to the
# agent with a first frame ROUTE_MAGIC + "ipc:///path" (or down the tree), and the agent relays them.
ROUTE_SEP = "|"
ROUTE_MAGIC = b"MTRT"
FANOUT = setting("MONARCH_TENSOR_FANOUT")
# Replies up the tree (module docstring); MONARCH_TENSOR_GATHER=0 sends each reply straight to its caller.
GATHER = setting("MONARCH_TENSOR_GATHER")
GATHER_PREFIX = "gather+"
# The first frame of a message up the tree: UP_MAGIC, a kind byte, JSON. Kind b"g", a chunk of gathered
# entries: {"k": [address, port id], "a": ranks it accounts for, "n": [frames of each entry], "u": urgent
# (an error or a death: every agent passes it on at once), "w": the caller's gateway}; the entries' frames
# follow. Kind b"p", one message passed up: {"w": gateway}, then its frames.
UP_MAGIC = b"MTUP"

_lock = threading.Lock()
_trees: dict[str, list[str]] = {}         # job key -> its agents, in the order met
_where: dict[str, tuple[str, int]] = {}   # agent address -> (job key, place in that list)
_gateways: dict[str, str] = {}            # job key (or agent address) -> the gateway its procs reach us through
_version = 0                              # bumped whenever a tree changes: the plans made before are stale
_plans: dict[tuple, tuple] = {}           # (addresses, fan-out, _version, folded) -> what send_many sends them


def set_gateway(agent: str, gateway: str) -> None:
    """Replies of the procs of ``agent``'s job reach this process through ``gateway`` (chunks go there)."""
    with _lock:
        _gateways[_where[agent][0] if agent in _where else agent] = gateway


def gateway_of(agent: str) -> str | None:
    """The gateway through which chunks from ``agent``'s tree reach this process (None: not known)."""
    with _lock:
        return _gateways.get(_where[agent][0] if agent in _where else agent)


def register(agent: str, key: str) -> None:
    """Give ``agent`` (of the job whose key is ``key``) its place in that job's tree (once)."""
    global _version
    if _where.get(agent, (key,))[0] != key:  # another job's agent had its address (its port handed out again)
        forget(agent)
    with _lock:
        if agent not in _where:
            _version += 1
            agents = _trees.setdefault(key, [])
            _where[agent] = (key, len(agents))
            agents.append(agent)


def forget(agent: str) -> None:
    """Take a lost or shut-down agent out of its tree (the agents after it move up)."""
    global _version
    with _lock:
        key, _ = _where.pop(agent, (None, 0))
        if key is not None:
            _version += 1
            agents = _trees[key]
            agents.remove(agent)
            for i, a in enumerate(agents):
                _where[a] = (key, i)


def path(agent: str, fanout: int | None = None) -> list[str]:
    """The agents a message to ``agent`` passes through, first hop first, ``agent`` last."""
    f = FANOUT if fanout is None else fanout
    if f < 1:
        raise ValueError(f"fan-out must be at least 1, got {f}")
    with _lock:
        w = _where.get(agent)
        if w is None:
            return [agent]  # an agent of no known job: straight to it
        agents = _trees[w[0]]
        hops = [w[1]]
        while hops[-1] >= f:
            hops.append(hops[-1] // f - 1)
        return [agents[i] for i in reversed(hops)]


def depth(hosts: int, fanout: int) -> int:
    """Agent hops from the sender to the farthest of ``hosts`` agents of one tree."""
    if hosts < 1:
        return 0
    i, d = hosts - 1, 1
    while i >= fanout:
        i, d = i // fanout - 1, d + 1
    return d


def build_tree(items: list[tuple[str, list[str]]], fanout: int | None = None,
               positions: dict[str, list[int]] | None = None) -> list[tuple[str, dict]]:
    """``(agent, proc ids)`` pairs as plans along each agent's path: ``[(first hop, plan), ...]``.
    ``positions``: agent -> the place of each of its procs in the call (a folded call's plans carry them, "p")."""
    root: dict = {}
    for agent, procs in items:
        level, node = root, None
        for hop in path(agent, fanout):
            node = level.setdefault(hop, {"t": [], "c": {}, "p": []})
            level = node["c"]
        assert node is not None  # (a path ends at its agent)
        node["t"].extend(procs)
        if positions is not None:
            node["p"].extend(positions[agent])

    def plan(node: dict) -> dict:
        if positions is not None:
            return {"t": node["t"], "p": node["p"], "c": [[a, plan(n)] for a, n in node["c"].items()]}
        return {"t": node["t"], "c": [[a, plan(n)] for a, n in node["c"].items()]}

    return [(a, plan(n)) for a, n in root.items()]


def routed_frames(agent: str, inner: str, frames: list) -> tuple[str, list]:
    """Where to send ``frames`` for proc ``inner`` of ``agent``, and what: straight to a child of this
    sender with a route frame, else to the first hop of its path with a one-branch plan."""
    if len(path(agent)) == 1:
        return agent, [ROUTE_MAGIC + inner.encode(), *frames]
    return tree_frames(agent, {"t": [inner], "c": []}, frames)


def tree_frames(agent: str, plan: dict, frames: list) -> tuple[str, list]:
    """Where to send ``frames`` with ``agent``'s ``plan`` (a tree message for ``agent``), and what: the first
    hop of its path, with the plan nested in one branch per hop."""
    hops = path(agent)
    for child in reversed(hops[1:]):
        plan = {"t": [], "c": [[child, plan]]}
    return hops[0], [TREE_MAGIC + json.dumps(plan).encode(), *frames]


def count(plan: dict) -> int:
    """The procs a plan reaches: its own and its children's."""
    return len(plan.get("t", ())) + sum(count(sub) for _, sub in plan.get("c", ()))


def up_header(kind: bytes, head: dict) -> bytes:
    return UP_MAGIC + kind + json.dumps(head, separators=(",", ":")).encode()


def read_up(first) -> tuple[bytes, dict]:
    """The kind and the header of a message up the tree (its first frame)."""
    view = bytes(first.buffer if hasattr(first, "buffer") else first)
    return view[4:5], json.loads(view[5:])


def send_many(mailbox, addrs: list[str], frames: list, gather: tuple[str, int] | None = None,
              fold: dict | None = None) -> None:
    """Send encoded ``frames`` to every address: direct ones one by one, routed ones down the tree.
    ``gather``: the caller's reply port (address, id), whose replies the agents gather on the way up; ``fold``
    (with ``gather``): the reduction the agents apply to them (``_gather``'s fold spec, plan key "r")."""
    folded = fold is not None and gather is not None
    key = (tuple(addrs), FANOUT, _version, folded)
    made = _plans.get(key)
    if made is None:
        made = _plans_for(addrs, folded)
        if len(_plans) >= 64:
            _plans.clear()
        _plans[key] = made
    direct, single, roots = made
    for a in direct:
        mailbox.send_frames(a, frames)
    if single is not None:
        mailbox.send_frames(single, frames)
        return
    extra = ""
    if gather is not None:
        extra = '"g":' + json.dumps(gather) + "," + ('"r":' + json.dumps(fold) + "," if folded else "")
    for agent, body in roots:  # body: the plan's JSON, "{" and all; the call's keys go in front of its own
        w = None if gather is None else gateway_of(agent)
        if w is not None:
            body = "{" + extra + '"w":' + json.dumps(w) + "," + body[1:]
        mailbox.send_frames(agent, [TREE_MAGIC + body.encode(), *frames])


def _plans_for(addrs: list[str], folded: bool) -> tuple[list[str], str | None, list[tuple[str, str]]]:
    """How ``send_many`` reaches ``addrs``: the direct ones, the one routed proc (sent to alone), or each root
    agent with its plan's JSON (with each proc's place in the call where ``folded``)."""
    by_agent: dict[str, list[str]] = {}
    direct: list[str] = []
    positions: dict[str, list[int]] | None = {} if folded else None
    for i, a in enumerate(addrs):
        agent, sep, inner = a.partition(ROUTE_SEP)
        if sep:
            by_agent.setdefault(agent, []).append(inner)
            if positions is not None:
                positions.setdefault(agent, []).append(i)
        else:
            direct.append(a)
    if not by_agent:
        return direct, None, []
    if len(by_agent) == 1 and len(next(iter(by_agent.values()))) == 1:
        return direct, next(a for a in addrs if ROUTE_SEP in a), []
    return direct, None, [(agent, json.dumps(plan)) for agent, plan in
                          build_tree(list(by_agent.items()), positions=positions)]


def forward(first: bytes, payload: list, deliver: Callable[[str, list], None],
            send: Callable[[str, list], None], gather: Callable[[dict], None] | None = None,
            me: str = "") -> None:
    """An agent's part of a tree broadcast: its own procs, then each child with its sub-plan. A plan with a
    gather (``"g"``): ``gather(plan)`` first, and each child's plan names this agent (``me``) as its way up."""
    plan = json.loads(first[len(TREE_MAGIC):])
    g = plan.get("g")
    if g is not None and gather is not None:
        gather(plan)
    for child, sub in plan.get("c", ()):
        if g is not None:
            sub["g"], sub["w"], sub["u"] = g, plan["w"], me
            if "r" in plan:
                sub["r"] = plan["r"]
        send(child, [TREE_MAGIC + json.dumps(sub).encode(), *payload])
    for proc_id in plan.get("t", ()):
        deliver(proc_id, payload)
