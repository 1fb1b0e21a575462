"""The host-agent protocol: controller <-> agent requests, agent -> controller reports.

Requests travel on the controller's control socket to an agent (CURVE, see
``_curve.py``) as ``(request_id, message)``; the agent answers
``(request_id, value_or_error)`` unless ``request_id`` is None (one-way).
A spawn goes down the tree of agents (``SpawnTree``): each agent passes its children their parts as one-way
requests on its connection to them, and they answer it the same way (``ReportSpawnedTree``).
Reports travel to a port of the controller's mailbox. ``HostAgent.handle_X``
(``agent.py``) handles request ``X``; ``remote._Events.deliver`` handles the reports.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..transport.messages import PortRef, _fast_reduce


@_fast_reduce
@dataclass(frozen=True, slots=True)
class OpenSession:
    """Controller -> agent: start (or resume) session ``session``; answered with ``DescribeHost``."""

    session: str


@_fast_reduce
@dataclass(frozen=True, slots=True)
class DescribeHost:
    """Agent -> controller (reply): who the host is and where its procs run."""

    hostname: str
    addr: str
    pid: int
    workdir: str
    gpus: int
    procs: int


@_fast_reduce
@dataclass(frozen=True, slots=True)
class SpawnProcs:
    """Controller -> agent: fork one proc per entry of ``envs``; answered with ``ReportSpawned``.

    ``client_addr`` is the controller's mailbox, reached through ``gateway`` (tcp); exits go to ``events``.
    ``python_exe``: the interpreter the procs run (a path on the host; None: the agent's). ``spawn_id``: the
    spawn it is part of (``KillProcs`` of that id kills its procs, even those forked after the kill came).
    """

    session: str
    ranks: tuple
    envs: tuple
    client_addr: str
    gateway: str
    events: PortRef
    python_exe: str | None = None
    spawn_id: str = ""


@_fast_reduce
@dataclass(frozen=True, slots=True)
class SpawnTree:
    """Controller -> agent, agent -> child agent: fork ``spawn``'s procs here (None: none here) and pass each
    ``below`` entry, ``(address, SpawnTree)``, to that child agent, all at once; answered with one
    ``ReportSpawnedTree`` for the whole subtree (``_spawn_tree.py``). ``agent``: this agent's address as the
    controller names it. A child that has not answered ``timeout`` seconds after the request came fails its
    subtree's agents. ``reply_to``: ``(parent agent's address, the parent's id of this spawn)``, where a child
    agent's answer goes (None: the requester's reply)."""

    session: str
    agent: str
    spawn: SpawnProcs | None
    below: tuple
    timeout: float
    reply_to: tuple | None = None


@_fast_reduce
@dataclass(frozen=True, slots=True)
class ReportSpawnedTree:
    """Agent -> controller (reply) or parent agent (one-way, ``tid``: the parent's id of the spawn; ``agent``: the
    answering agent, as its ``SpawnTree`` named it): for each agent of its subtree with procs to spawn,
    ``(address, ReportSpawned or None, error or None)``."""

    tid: int
    results: tuple
    agent: str


@_fast_reduce
@dataclass(frozen=True, slots=True)
class ReportSpawned:
    """Agent -> controller (reply): the routed addresses and pids of the procs just forked."""

    addrs: tuple
    pids: tuple


@_fast_reduce
@dataclass(frozen=True, slots=True)
class KillProcs:
    """Controller -> agent: send signal ``sig`` to these procs of the session, and, with a ``spawn_id``, to every
    proc of that spawn (those forked after this came too: the spawn is cancelled)."""

    session: str
    pids: tuple
    sig: int
    spawn_id: str = ""


@_fast_reduce
@dataclass(frozen=True, slots=True)
class KeepSession:
    """Controller -> agent (one-way): the controller is alive; keep its procs."""

    session: str


@_fast_reduce
@dataclass(frozen=True, slots=True)
class EndSession:
    """Controller -> agent: the controller is done; kill the session's procs (the agent keeps serving)."""

    session: str


@_fast_reduce
@dataclass(frozen=True, slots=True)
class ShutdownAgent:
    """Controller -> agent: kill every proc and exit (the job is being released)."""

    reason: str


@_fast_reduce
@dataclass(frozen=True, slots=True)
class ReportExit:
    """Agent -> controller's events port: proc ``pid`` exited with ``status``."""

    pid: int
    status: str


REQUESTS = (OpenSession, SpawnProcs, SpawnTree, ReportSpawnedTree, KillProcs, KeepSession, EndSession, ShutdownAgent)
REPORTS = (DescribeHost, ReportSpawned, ReportExit)
