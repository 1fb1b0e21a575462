"""The host-agent protocol: controller <-> agent requests, agent -> controller reports.

Requests travel on the controller's control socket to an agent (CURVE, see
``_curve.py``) as ``(request_id, message)``; the agent answers
``(request_id, value_or_error)`` unless ``request_id`` is None (one-way).
Reports travel to a port of the controller's mailbox. ``HostAgent.handle_X``
(``agent.py``) handles request ``X``; ``remote._Events.deliver`` handles the reports.
"""

from __future__ import annotations

from dataclasses import dataclass

from .messages import PortRef, _fast_reduce


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
    ``python_exe``: the interpreter the procs run (a path on the host; None: the agent's).
    """

    session: str
    ranks: tuple
    envs: tuple
    client_addr: str
    gateway: str
    events: PortRef
    python_exe: str | None = None


@_fast_reduce
@dataclass(frozen=True, slots=True)
class ReportSpawned:
    """Agent -> controller (reply): the routed addresses and pids of the procs just forked."""

    addrs: tuple
    pids: tuple


@_fast_reduce
@dataclass(frozen=True, slots=True)
class KillProcs:
    """Controller -> agent: send signal ``sig`` to these procs of the session."""

    session: str
    pids: tuple
    sig: int


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


REQUESTS = (OpenSession, SpawnProcs, KillProcs, KeepSession, EndSession, ShutdownAgent)
REPORTS = (DescribeHost, ReportSpawned, ReportExit)
