"""The controller's side of host agents: host meshes over many agents.

>>> hosts = attach_to_workers(workers=["tcp://10.0.0.1:26600", "tcp://10.0.0.2:26600"],
...                           key_file="job.key")
>>> procs = hosts.spawn_procs(per_host={"gpus": 8})      # shape {"hosts": 2, "gpus": 8}
>>> hosts.workdirs                                       # each host's working directory
['/scratch/run', '/scratch/run']

Each agent gets one control socket (CURVE client, see ``_curve.py``) with a
socket monitor: the agent's TCP connection dropping (the agent died, its host
went away) fails every proc on it with a ``SupervisionError`` at once, and
zmq heartbeats catch a silent peer. Procs on agents reply to this process
through a CURVE gateway (a TCP listener relaying into the mailbox), one per job key.
"""

from __future__ import annotations

import atexit
import itertools
import json
import logging
import os
import socket
import threading
import time
import uuid
from typing import Mapping

import zmq

from ..config import setting
from ..errors import HostUnreachableError, JobKeyError, SupervisionError
from ..future import CoroutineFuture, Future
from ..runtime import _context, _hooks
from ..shape import Shape
from ..transport import _curve, _fanout, _wire
from ..transport._fanout import ROUTE_SEP
from ..transport._net import ip_towards
from ..transport.mailbox import current_mailbox
from ..transport.messages import PortRef, SendToPort, StopProc
from . import _spawn_tree
from ._address import split_agent_address
from ._failures import _proc_exited
from ._spawn import HOST_PYTHON_ENV, _procs_shape, check_procs_per_host, local_procs, per_host_sizes, share_peers
from .agent_messages import EndSession, KeepSession, KillProcs, OpenSession, ReportExit, ShutdownAgent, SpawnProcs
from .bootstrap import bootstrap_plan, check_bootstrap, run_bootstrap
from .host_mesh import HostMesh
from .local import ProcInfo, forget_earlier_proc
from .proc_mesh import ProcMesh, _live_meshes

log = logging.getLogger("monarch_tensor.hosts.remote_hosts")

MONITOR_EVENTS = (zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED | zmq.EVENT_HANDSHAKE_SUCCEEDED
                  | zmq.EVENT_HANDSHAKE_FAILED_AUTH | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL)
_ctx: zmq.Context | None = None
_ctx_lock = threading.Lock()


def _agents_context() -> zmq.Context:
    """The context of the connections to host agents (this library's own, not the process-wide instance)."""
    global _ctx
    with _ctx_lock:
        if _ctx is None or _ctx.closed:
            _ctx = zmq.Context()
        return _ctx


CONNECT_TIMEOUT = setting("MONARCH_TENSOR_CONNECT_TIMEOUT")
KEEPALIVE_S = 1.0
LOST_AFTER_S = 0.5  # a dropped connection not re-established within this is a lost agent

SESSION = f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"


# ---- the gateway: tcp (CURVE) -> this process's mailbox ------------------------------------
class _Gateway:
    """A CURVE TCP listener whose messages are relayed into the mailbox (one per job key), or, those that
    start with a route frame (``_fanout.ROUTE_MAGIC`` + an address), to that address: a proc of this host
    this process spawned and still alive (``host.local_procs``), whose ipc socket the job's hosts do not
    see, or a proc behind the agent of another job this process attached to, whose key the job's hosts
    do not hold."""

    def __init__(self, keys: _curve.JobKeys, ip: str) -> None:
        mailbox = current_mailbox()
        self.ctx = zmq.Context()
        self.router = self.ctx.socket(zmq.ROUTER)
        self.router.setsockopt(zmq.LINGER, 0)
        _curve.serve_curve(self.ctx, self.router, keys)
        self.router.bind(f"tcp://{ip}:*")
        self.addr = self.router.getsockopt(zmq.LAST_ENDPOINT).decode()
        self.out = self.ctx.socket(zmq.DEALER)
        self.out.setsockopt(zmq.SNDHWM, 0)
        self.out.connect(mailbox.addr)
        self.mailbox_addr = mailbox.addr
        self.procs: dict[str, tuple] = {}  # ipc address -> (ProcInfo, socket): where messages were relayed
        threading.Thread(target=self._run, daemon=True, name="monarch-tensor-gateway").start()

    def _run(self) -> None:
        r, out = self.router, self.out
        while True:
            try:
                frames = r.recv_multipart(copy=False)
            except zmq.ZMQError:
                return
            if len(frames) > 2 and frames[1].buffer[:4] == _fanout.ROUTE_MAGIC:
                self._relay(bytes(frames[1].buffer[4:]).decode(errors="replace"), frames[2:])
            else:
                out.send_multipart(frames[1:], copy=False)

    def _relay(self, addr: str, frames: list) -> None:
        agent = addr.partition(ROUTE_SEP)[0]
        if agent.startswith("tcp://"):  # another job's agent, or a proc behind it: with that job's key, from here
            if agent not in _curve.peers():
                self._undeliverable(addr, frames, "it is not behind a host agent this process attached to")
                return
            try:
                if ROUTE_SEP in addr:
                    current_mailbox().send_frames(addr, frames)
                elif frames and frames[0].buffer[:4] == _fanout.TREE_MAGIC:  # for several of its procs
                    plan = json.loads(bytes(frames[0].buffer[4:]))
                    current_mailbox().send_frames(*_fanout.tree_frames(addr, plan, frames[1:]))
                else:
                    self._undeliverable(addr, frames, "a message for a host agent itself is not relayed")
            except Exception as e:  # noqa: BLE001 - the gateway serves on
                self._undeliverable(addr, frames, repr(e))
            return
        got = self.procs.get(addr)
        if got is None or not got[0].alive:
            live = {p.addr: p for p in local_procs()}
            for gone in [a for a in self.procs if a not in live]:  # stopped procs: close their sockets
                self.procs.pop(gone)[1].close(linger=0)
            if addr not in live:
                self._undeliverable(addr, frames, "it is not a live proc of this process")
                return
            s = self.ctx.socket(zmq.DEALER)
            s.setsockopt(zmq.LINGER, 1000)
            s.setsockopt(zmq.SNDHWM, 0)
            s.connect(addr)
            got = self.procs[addr] = (live[addr], s)
        got[1].send_multipart(frames, copy=False)

    def _undeliverable(self, addr: str, frames: list, why: str) -> None:
        """Drop a message the gateway cannot pass on, failing the reply port of each call in it (the
        caller would otherwise wait for its timeout, or for ever)."""
        log.warning("gateway dropped a message for %s: %s", addr, why)
        if frames and frames[0].buffer[:4] == _fanout.TREE_MAGIC:
            frames = frames[1:]
        if not frames:
            return
        for msg in _wire.envelopes(frames):
            reply = getattr(msg, "reply", None)
            if type(reply) is not PortRef:
                continue
            error = HostUnreachableError(f"the controller's gateway could not pass a message on to {addr}: {why}")
            try:  # rank -1: from no rank of the call, it fails the whole call
                current_mailbox().send(reply.addr, SendToPort(reply.port_id, None, error, -1))
            except Exception as e:  # noqa: BLE001
                log.warning("gateway could not tell %s that its message was dropped: %r", reply.addr, e)


_gateways: dict[str, _Gateway] = {}


def _gateway_for(keys: _curve.JobKeys, agent_addr: str) -> _Gateway:
    g = _gateways.get(keys.public)
    if g is None:
        g = _gateways[keys.public] = _Gateway(keys, ip_towards(agent_addr))
    return g


def _speaks_zmtp(addr: str, timeout: float = 2.0) -> bool:
    """Whether the server at ``addr`` greets as zmq does (ZMTP: 0xFF, 8 bytes, 0x7F, sent on accepting): a
    CURVE handshake that failed there was refused for its key; anything else (an HTTP server at a mistyped
    port) is no host agent. (zmq's client sees both as a connection dropped during the handshake.)"""
    host, _, port = addr[len("tcp://"):].rpartition(":")
    greeting = b""
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout) as s:
            while len(greeting) < 10:
                data = s.recv(10 - len(greeting))
                if not data:
                    break
                greeting += data
    except OSError:
        pass
    return len(greeting) == 10 and greeting[0] == 0xFF and greeting[9] == 0x7F


# ---- one agent --------------------------------------------------------------------------------
class AgentClient:
    """The control connection to one host agent; ``request`` is a round trip with a timeout."""

    def __init__(self, addr: str, keys: _curve.JobKeys, timeout: float = CONNECT_TIMEOUT) -> None:
        addr = split_agent_address(addr)[0]  # (an alias's dial address: where the agent is reached)
        port = addr.rpartition(":")[2]
        if not (port.isdigit() and 1 <= int(port) <= 65535):
            raise ValueError(f"a host agent's address is tcp://HOST:PORT with PORT in 1-65535, got {addr!r}")
        self.addr, self.keys = addr, keys
        self.ctx = _agents_context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.HEARTBEAT_IVL, 1000)
        from .. import config

        self.sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, int(config.get("agent_heartbeat_timeout") * 1000))
        _curve.connect_curve(self.sock, keys)
        # Only the events we act on: libzmq's monitor send blocks the context's I/O thread once the
        # monitor's pipe is full, so a socket retrying a dead peer must not emit an event per retry.
        self.monitor = self.sock.get_monitor_socket(events=MONITOR_EVENTS)
        # Keep-alives on their own socket: a long request (a spawn) holds the control socket.
        self.keep = self.ctx.socket(zmq.DEALER)
        self.keep.setsockopt(zmq.LINGER, 0)
        self.keep.setsockopt(zmq.SNDHWM, 4)
        _curve.connect_curve(self.keep, keys)
        self.keep.connect(addr)
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        self.lost: str = ""
        self.procs: dict[int, ProcInfo] = {}
        self.sock.connect(addr)
        _curve.remember_peer(addr, keys)
        self.info = self._handshake(timeout)
        _fanout.register(addr, keys.public)  # its place in the job's tree of agents
        # Its procs' addresses name the address it advertises, which may not be the one dialled here.
        _curve.remember_peer(self.info.addr, keys)
        # The procs this process spawned reach the procs of this agent, and answer them.
        share_peers()

    def _handshake(self, timeout: float):
        deadline = time.monotonic() + timeout
        connected = failed = False
        while time.monotonic() < deadline:
            if not self.monitor.poll(max(1, int((deadline - time.monotonic()) * 1000))):
                break
            ev = _event(self.monitor)
            if ev == zmq.EVENT_CONNECTED:
                connected = True
            elif ev in (zmq.EVENT_HANDSHAKE_FAILED_AUTH, zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL):
                failed = True
                break
            elif ev == zmq.EVENT_DISCONNECTED and connected:
                failed = True  # the server hung up during the CURVE handshake: it holds another key
                break
            elif ev == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                return self.request(OpenSession(SESSION), timeout=max(1.0, deadline - time.monotonic()))
        self.close()
        if failed and not _speaks_zmtp(self.addr):
            raise HostUnreachableError(f"{self.addr} is not a host agent (protocol mismatch): something else "
                                       f"listens there (check the address and port)")
        if failed:
            raise JobKeyError(f"the host agent at {self.addr} refused this controller's key: it serves another "
                              f"job (use that job's key file, or job_load() its job file)")
        if connected:
            raise HostUnreachableError(f"connected to {self.addr} but no host agent answered within {timeout:.0f} s")
        raise HostUnreachableError(f"no host agent reachable at {self.addr} within {timeout:.0f} s "
                                   f"(nothing listens there, the host is down, or a firewall drops it)")

    def request(self, msg, timeout: float = 30.0, watch: list[AgentClient] = ()):
        """Send ``msg`` and wait for its answer; one of the ``watch`` agents lost meanwhile fails it too (the
        request was passed on to them)."""
        with self._lock:
            if self.lost:
                raise SupervisionError(f"host agent {self.addr} was lost: {self.lost}")
            req_id = next(self._ids)
            self.sock.send_multipart(_wire.encode((req_id, msg)))
            deadline = time.monotonic() + timeout
            while True:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise HostUnreachableError(f"host agent {self.addr} did not answer "
                                               f"{type(msg).__name__} within {timeout:.0f} s")
                # In slices of 0.2 s: the watcher may find the agent lost meanwhile (it died mid-request),
                # which this wait would otherwise learn only at its timeout.
                if not self.sock.poll(int(min(left, 0.2) * 1000) + 1):
                    if self.lost:
                        raise SupervisionError(f"host agent {self.addr} was lost while it handled "
                                               f"{type(msg).__name__}: {self.lost}")
                    gone = next((a for a in watch if a.lost), None)
                    if gone is not None:
                        raise SupervisionError(f"host agent {gone.addr} was lost while {self.addr} passed it "
                                               f"{type(msg).__name__}: {gone.lost}")
                    continue
                rid, value, error = _wire.decode(self.sock.recv_multipart())
                if rid == req_id:
                    break
        if error is not None:
            raise error
        return value

    def tell(self, msg) -> None:
        """Send ``msg`` one-way (no answer, no wait); nothing if the agent is lost."""
        with self._lock:
            if not self.lost:
                try:
                    self.sock.send_multipart(_wire.encode((None, msg)), zmq.NOBLOCK)
                except zmq.ZMQError:
                    pass

    def keep_alive(self) -> None:
        """Tell the agent this controller lives (the watcher thread's socket; never blocks)."""
        if not self.lost:
            try:
                self.keep.send_multipart(_wire.encode((None, KeepSession(SESSION))), zmq.NOBLOCK)
            except zmq.Again:
                pass

    def close(self) -> None:
        """Stop monitoring and close the sockets (they stop reconnecting to the agent)."""
        if self.sock.closed:
            return
        try:
            self.sock.disable_monitor()
        except zmq.ZMQError:
            pass
        self.monitor.close(0)
        self.sock.close(0)
        self.keep.close(0)


def _event(monitor: zmq.Socket) -> int:
    from zmq.utils.monitor import recv_monitor_message

    return recv_monitor_message(monitor)["event"]


# ---- supervision of agents: keep-alives out, lost connections in -----------------------------------
class _Watcher:
    def __init__(self) -> None:
        self.agents: list[AgentClient] = []
        self.lock = threading.Lock()
        self.thread: threading.Thread | None = None

    def add(self, agent: AgentClient) -> None:
        with self.lock:
            self.agents.append(agent)
            if self.thread is None:
                self.thread = threading.Thread(target=self._run, daemon=True, name="monarch-tensor-agents")
                self.thread.start()

    def _run(self) -> None:
        down_since: dict[AgentClient, float] = {}
        last_keep = 0.0
        while True:
            with self.lock:
                for a in [a for a in self.agents if a.lost]:
                    # A lost or shut-down agent's sockets are closed here, by the thread that polls its
                    # monitor, once no request holds them; until then they stay out of the poll.
                    if a._lock.acquire(blocking=False):
                        try:
                            a.close()
                        finally:
                            a._lock.release()
                        self.agents.remove(a)
                # (an agent whose sockets were closed elsewhere leaves the poll: one such made the poll raise,
                # which ended this thread, and no agent's loss was noticed after)
                agents = [a for a in self.agents if not a.lost and not a.monitor.closed]
            poller = zmq.Poller()
            for a in agents:
                poller.register(a.monitor, zmq.POLLIN)
            try:
                ready = dict(poller.poll(100)) if agents else (time.sleep(0.1) or {})
            except zmq.ZMQError:  # closed meanwhile: the next round leaves it out
                time.sleep(0.01)
                continue
            now = time.monotonic()
            for a in agents:
                if a.monitor in ready:
                    while a.monitor.poll(0):
                        ev = _event(a.monitor)
                        if ev == zmq.EVENT_DISCONNECTED:
                            down_since.setdefault(a, now)
                        elif ev == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                            down_since.pop(a, None)
                if a in down_since and now - down_since[a] > LOST_AFTER_S:
                    down_since.pop(a)
                    _agent_lost(a, "its connection dropped and did not come back")
            if now - last_keep > KEEPALIVE_S:
                last_keep = now
                for a in agents:
                    a.keep_alive()


_watcher = _Watcher()


def _agent_lost(agent: AgentClient, why: str) -> None:
    agent.lost = why
    _fanout.forget(agent.addr)
    for info in list(agent.procs.values()):
        if info.alive:
            _proc_exited(info, f"its host agent {agent.addr} was lost ({why})")


class _Events:
    """The port agents report proc exits to."""

    observing = False

    def __init__(self, agent: AgentClient) -> None:
        self.agent = agent

    def deliver(self, msg: SendToPort) -> bool:
        report = msg.value
        if isinstance(report, ReportExit):
            info = self.agent.procs.pop(report.pid, None)
            if info is not None and info.alive:
                _proc_exited(info, report.status)
        return False

    def proc_died(self, addr: str, error: SupervisionError) -> tuple[bool, bool]:
        return False, False


# ---- meshes -------------------------------------------------------------------------------------
_handles = itertools.count(1)


def _attached(addrs: list[str], keys: tuple | None, shape: Shape, python_exe: str | None) -> RemoteHostMesh:
    """A host mesh unpickled here (passed to an actor, say): over this process's connections to those agents
    where it has them, else new ones. It is a handle of its own, which cannot shut the hosts down."""
    known = {a.addr: a for a in list(_watcher.agents) if not a.lost}
    missing = [a for a in addrs if a not in known]
    if missing:
        if keys is None:
            raise RuntimeError(f"a host mesh of agents {missing} came without the job's keys")
        for a in connect_agents(missing, _curve.JobKeys(*keys)):
            known[a.addr] = a
    mesh = RemoteHostMesh([known[a] for a in addrs], shape, python_exe)
    mesh._borrowed = True
    return mesh


class RemoteHostMesh(HostMesh):
    """Hosts served by agents: ``spawn_procs(per_host={"gpus": 8})`` -> shape {"hosts": N, "gpus": 8}.

    ``workdirs[i]`` is host i's working directory (where its procs start).
    """

    def __init__(self, agents: list[AgentClient], shape: Shape | None = None, python_exe: str | None = None,
                 handle: int | None = None) -> None:
        shape = shape or Shape(("hosts",), (len(agents),))
        if len(shape) != len(agents):
            raise ValueError(f"a host mesh of shape {shape} needs {len(shape)} agents, got {len(agents)}")
        super().__init__(Shape(shape.names, shape.dims), python_exe)
        self._agents = agents
        # Which handle of the job's hosts this is (shared by its slices, renames, with_python_executable):
        # stop() stops the proc meshes spawned through it, as Monarch's, not those of another handle (a second
        # job.state()) on the same hosts.
        self._handle = next(_handles) if handle is None else handle
        self._borrowed = False  # unpickled in this process (``_attached``)

    @property
    def stream_logs(self) -> bool:
        """Whether procs spawned on these hosts stream their stdout and stderr to this script from their start.
        As Monarch's job and ``attach_to_workers`` host meshes: not unless log forwarding was turned on
        explicitly (``configure(enable_log_forwarding=True)`` or ``MONARCH_TENSOR_ENABLE_LOG_FORWARDING=1``);
        their output goes to their host agent's. ``procs.logging_option(stream_to_client=True)`` turns it on
        for a running mesh."""
        from .. import config

        explicit = "enable_log_forwarding" in config.get_runtime_config() or \
            "MONARCH_TENSOR_ENABLE_LOG_FORWARDING" in os.environ
        return explicit and bool(config.get("enable_log_forwarding"))

    def _new_with_shape(self, shape: Shape) -> RemoteHostMesh:
        """A slice, split, rename or flatten: ``hosts.slice(hosts=0)`` is one host (no dim left)."""
        mesh = RemoteHostMesh([self._agents[r] for r in shape.ranks()], shape, self._python_exe, self._handle)
        mesh._borrowed = self._borrowed
        return mesh

    def __reduce__(self):
        """Pickled by the agents' addresses and the job's keys (the processes of a job hold its keys already):
        an actor it is passed to reaches the same hosts (``_attached``)."""
        keys = self._agents[0].keys if self._agents else None
        return (_attached, ([a.addr for a in self._agents], None if keys is None else (keys.public, keys.secret),
                            Shape(self._shape.names, self._shape.dims), self._python_exe))

    def _another_handle(self) -> RemoteHostMesh:
        """The same hosts as a handle of its own (``job.state()`` gives one per call)."""
        return RemoteHostMesh(self._agents, self._shape, self._python_exe)

    def stop(self) -> Future:
        """Stop every proc mesh spawned through this handle (or its slices) on these hosts; the hosts stay
        usable, and procs spawned there through another handle of the job go on."""
        for mesh in [m for m in list(_live_meshes) if getattr(m, "_host_handle", None) == self._handle and
                     any(self._runs_here(p) for p in m._procs)]:
            mesh.stop()
        return Future.ready(None)

    def _runs_here(self, p) -> bool:
        return getattr(p, "agent", None) in self._agents

    def with_python_executable(self, python_exe: str) -> HostMesh:
        """The same hosts, whose procs run ``python_exe``, a path on those hosts (a virtual environment
        synced there, say): each agent checks it at the first spawn, and a host without it fails the spawn
        with its name. The interpreter must import this ``monarch_tensor`` and its dependencies (the agent's
        ``sys.path`` is on its ``PYTHONPATH``)."""
        if not isinstance(python_exe, str) or not python_exe:
            raise TypeError(f"with_python_executable() takes the path of a Python interpreter, got {python_exe!r}")
        if not os.path.isabs(python_exe):
            raise ValueError(f"with_python_executable({python_exe!r}) on a job's hosts takes an absolute path (the "
                             f"hosts' working directories differ from this one)")
        mesh = RemoteHostMesh(self._agents, self._shape, python_exe, self._handle)
        mesh._borrowed = self._borrowed
        return mesh

    @property
    def workdirs(self) -> list[str]:
        return [a.info.workdir for a in self._agents]

    @property
    def addresses(self) -> list[str]:
        return [a.addr for a in self._agents]

    def spawn_procs(self, per_host: Mapping[str, int] | None = None, bootstrap=None, name: str | None = None,
                    proc_bind: list[dict[str, str]] | None = None, threads: int | None = None,
                    bootstrap_command=None, _rank_envs: list[dict] | None = None) -> ProcMesh:
        from ..runtime import _bind, _threads

        check_bootstrap(bootstrap)
        threads = _threads.check(threads)
        per_host = per_host_sizes(per_host)
        shape = _procs_shape(self._shape, per_host)  # the hosts' dims first: host h has ranks [h * per, ...)
        python_exe, rank_envs = self._python_exe, _rank_envs
        if bootstrap_command is not None:
            python_exe, rank_envs = bootstrap_plan(bootstrap_command, shape, self._python_exe, local=False)
        per = len(shape) // len(self._agents)
        check_procs_per_host(per_host, per)
        proc_bind = _bind.check(proc_bind, per)
        mailbox = current_mailbox()
        infos: list[ProcInfo] = []
        pending = []
        spawn_id = uuid.uuid4().hex[:16]
        from .. import config

        settings = config.proc_env()  # configure()'s settings that procs act on
        settings["MONARCH_TENSOR_ENABLE_LOG_FORWARDING"] = "1" if self.stream_logs else "0"
        running: dict[int, int] = {}  # id of an agent -> its live procs
        for p in [p for mesh in list(_live_meshes) for p in mesh._procs if p.alive]:
            key = id(getattr(p, "agent", None))
            running[key] = running.get(key, 0) + 1
        most = max((per + running.get(id(a), 0) for a in self._agents), default=per)
        if threads is None and not _threads.user_set() and not _bind.restricts_cpus(proc_bind):
            _threads.remote_notice(per * len(self._agents), most)
        for h, agent in enumerate(self._agents):
            gateway = _gateway_for(agent.keys, agent.addr)
            _fanout.set_gateway(agent.addr, gateway.addr)  # (gathered replies of its procs come through it)
            events = mailbox.open_port(_Events(agent))
            ranks, envs = [], []
            sharing = per + running.get(id(agent), 0)
            for r in range(h * per, (h + 1) * per):
                point = shape.point(r)
                env = {"MONARCH_TENSOR_RANK": str(r), **settings, **_bind.env_for(proc_bind, r - h * per),
                       **_threads.env_for(threads, _bind.sharing(proc_bind, r - h * per, sharing))}
                if "gpus" in shape.names:
                    env["MONARCH_TENSOR_LOCAL_GPU"] = str(point["gpus"])
                if python_exe is not None:
                    env[HOST_PYTHON_ENV] = python_exe
                if rank_envs:
                    env.update(rank_envs[r])
                ranks.append(r)
                envs.append(env)
            pending.append((agent, ranks, SpawnProcs(SESSION, tuple(ranks), tuple(envs), mailbox.addr,
                                                      gateway.addr, events, python_exe, spawn_id)))
        try:
            results = _spawn_down_tree(pending, spawn_id, config.get("spawn_timeout"))
        except BaseException:
            for _, _, m in pending:
                mailbox.close_port(m.events.port_id)
            raise
        mesh = RemoteProcMesh([], shape)
        _context.own(mesh)  # (spawned by an actor: its procs stop with it)
        mesh._host_handle = self._handle
        mesh._host_dims = len(self._shape.names)  # (heal_mesh spawns the same again)
        mesh._python_exe, mesh._rank_envs = python_exe, rank_envs
        for (agent, ranks, _), rep in zip(pending, results):
            for r, addr, pid in zip(ranks, rep.addrs, rep.pids):
                info = ProcInfo(addr, r, pid)
                forget_earlier_proc(info)
                info.owner = mesh
                info.agent = agent
                agent.procs[pid] = info
                infos.append(info)
        mesh._procs = infos
        mesh._proc_bind = proc_bind  # heal_mesh binds the new procs alike
        mesh._threads = threads  # and gives them as many threads
        _live_meshes.add(mesh)
        share_peers(infos)  # (of other jobs' agents)
        return run_bootstrap(mesh, bootstrap)

    def sync_workspace(self, workspace, conda: bool = False, auto_reload: bool = False) -> CoroutineFuture:
        """Mirror ``workspace`` onto these hosts' workspace roots and reload the procs running there. A host
        where no proc runs yet gets one for the sync, stopped after it; procs spawned there later start
        with the synced dirs on ``sys.path``. A Future that is a coroutine too, as ``ProcMesh.sync_workspace``.

        >>> await job.state().trainers.sync_workspace(Workspace(dirs=["./proj"]))  # doctest: +SKIP
        """
        procs = [p for mesh in list(_live_meshes) for p in mesh._procs if p.alive and self._runs_here(p)]
        idle = [a for a in self._agents if not any(p.agent is a for p in procs)]
        spawn = (lambda: RemoteHostMesh(idle).spawn_procs(name="workspace-sync")) if idle else None
        sync = _hooks.api("workspace_sync", "sync_workspace")
        return CoroutineFuture.of(sync(procs, workspace, auto_reload, spawn, conda=conda))

    def shutdown(self) -> Future:
        """Stop the procs on these hosts, then their agents: the hosts take no new procs afterwards."""
        if self._borrowed:
            raise RuntimeError("this host mesh was passed here (unpickled): only the process that holds the job "
                               "shuts its hosts down (job.kill(), or shutdown() there); stop() stops what was "
                               "spawned here")
        self.stop()
        shutdown_agents(self._agents, "shutdown() called")
        return Future.ready(None)

    def __repr__(self) -> str:
        return f"<HostMesh {self._shape} on {len(self._agents)} agents>"


class RemoteProcMesh(ProcMesh):
    """Procs forked by host agents; ``stop()`` asks each proc to exit, then the agent to kill leftovers."""

    def _kill(self, p: ProcInfo) -> None:
        agent: AgentClient = p.agent
        try:
            agent.request(KillProcs(SESSION, (p.pid,), 9), timeout=5)
        except Exception:  # noqa: BLE001 - a lost agent's procs are gone with it
            p.alive = False


def _spawn_down_tree(pending: list, spawn_id: str, timeout: float) -> list:
    """Each ``(agent, ranks, SpawnProcs)`` of ``pending`` down the tree of agents (``_spawn_tree``): one request
    per root agent, each watched for the loss of any agent of its subtree. Every agent's ``ReportSpawned``, in
    order; if any agent failed, the spawn is cancelled on every agent (its procs killed there) and the first
    failure is raised, its message naming that agent and its ranks (and the others that failed)."""
    by_addr = {a.addr: a for a, _, _ in pending}
    if len(by_addr) < len(pending):  # (an agent twice in one host mesh: a spawn of its own each)
        return _parallel([(a.request, (m, timeout)) for a, _, m in pending])
    roots = _spawn_tree.plan(SESSION, {a.addr: m for a, _, m in pending}, timeout)
    clients = {a.addr: a for a in list(_watcher.agents)}
    clients.update(by_addr)
    wait = _spawn_tree.request_timeout(roots, timeout)

    def ask(root: str, tree, agents: list[str]) -> dict:
        client = clients.get(root)
        try:
            if client is None:
                raise HostUnreachableError(f"host agent {root}, on the way to {agents}, is not connected here")
            watch = [clients[a] for a in _spawn_tree.nodes_of(tree) if a in clients]
            rep = client.request(tree, wait, watch=watch)
            return {addr: (report, error) for addr, report, error in rep.results}
        except Exception as e:  # noqa: BLE001 - the subtree's agents fail with it
            return {addr: (None, e) for addr in agents}

    got: dict = {}
    for part in _parallel([(ask, r) for r in roots]):
        got.update(part)
    failed = []
    for agent, ranks, _ in pending:
        report, error = got.get(agent.addr, (None, None))
        if report is None and error is None:
            error = HostUnreachableError(f"host agent {agent.addr} was left out of the spawn's answers")
        if error is None and len(report.pids) != len(ranks):
            error = HostUnreachableError(f"host agent {agent.addr} spawned {len(report.pids)} procs of {len(ranks)}")
        if error is not None:
            failed.append((agent, ranks, error))
    if not failed:
        return [got[a.addr][0] for a, _, _ in pending]
    for agent, _, _ in pending:  # (those that did spawn, and any whose spawn comes late, kill its procs)
        agent.tell(KillProcs(SESSION, (), 9, spawn_id))
    agent, ranks, error = failed[0]
    where = [f"host agent {a.addr} (ranks {_span(r)})" for a, r, _ in failed]
    others = "; ".join(f"{w}: {e!r}" for w, (_, _, e) in zip(where[1:], failed[1:]))
    if error.args and isinstance(error.args[0], str):
        error.args = (f"spawn_procs failed on {where[0]}: {error.args[0]}" + (f"; and on {others}" if others else ""),
                      *error.args[1:])
    raise error


def _span(ranks: list[int]) -> str:
    return f"{ranks[0]}-{ranks[-1]}" if len(ranks) > 1 else f"{ranks[0]}"


def _parallel(calls: list) -> list:
    """Run blocking calls on threads; results in order; the first error is raised."""
    results: list = [None] * len(calls)
    errors: list = [None] * len(calls)

    def run(i, fn, args):
        try:
            results[i] = fn(*args)
        except BaseException as e:  # noqa: BLE001
            errors[i] = e

    if len(calls) == 1:
        run(0, *calls[0])
    else:
        threads = [threading.Thread(target=run, args=(i, fn, args), daemon=True) for i, (fn, args) in enumerate(calls)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    for e in errors:
        if e is not None:
            raise e
    return results


def connect_agents(addrs: list[str], keys: _curve.JobKeys, timeout: float = CONNECT_TIMEOUT) -> list[AgentClient]:
    """Connect to every agent (in parallel); each is then watched for loss and kept alive."""
    agents = _parallel([(AgentClient, (a, keys, timeout)) for a in addrs])
    for a in agents:
        _watcher.add(a)
    return agents


def reachable_agents(addrs: list[str], keys: _curve.JobKeys, timeout: float = 5.0) -> list[AgentClient]:
    """Those of the agents at ``addrs`` that answer within ``timeout`` (in parallel; not watched): what a
    job's ``kill()`` can still shut down when some of its hosts are gone."""

    def connect(addr: str) -> AgentClient | None:
        try:
            return AgentClient(addr, keys, timeout)
        except Exception:  # noqa: BLE001 - gone: nothing to shut down there
            return None

    return [a for a in _parallel([(connect, (a,)) for a in addrs]) if a is not None]


def attach_to_workers(workers: list[str], name: str | None = None, ca: str | None = None, *,
                      key_file: str | None = None, timeout: float = CONNECT_TIMEOUT) -> RemoteHostMesh:
    """A host mesh over agents already running at ``workers`` (Monarch's name).

    Keys: ``key_file``, else the environment (``MONARCH_TENSOR_KEY_FILE`` or ``MONARCH_TENSOR_CURVE_*``), else,
    with ``ca="trust_all_connections"`` (Monarch's spelling, for agents started with it too), a well-known pair
    that authenticates nobody (with an ``InsecureConnectionWarning``).

    >>> hosts = attach_to_workers(workers=["tcp://h1:26600", "tcp://h2:26600"], key_file="job.key")
    >>> hosts.spawn_procs(per_host={"gpus": 2}).sizes
    {'hosts': 2, 'gpus': 2}
    """
    if isinstance(workers, str) or not isinstance(workers, (list, tuple)) or not all(
            isinstance(w, str) for w in workers):  # (a str would be split into one "address" per character)
        raise TypeError(f"attach_to_workers needs a list of address strings, e.g. ['tcp://h1:26600'], "
                        f"got {workers!r}")
    if not workers:
        raise ValueError("attach_to_workers needs at least one worker address")
    keys = _curve.JobKeys.for_ca(key_file, ca)
    if keys is None:
        raise JobKeyError("attach_to_workers needs the job's key: pass key_file=..., or set MONARCH_TENSOR_KEY_FILE "
                          "(or, to accept any peer, ca='trust_all_connections' on both sides)")
    return RemoteHostMesh(connect_agents(list(workers), keys, timeout))


def shutdown_agents(agents: list[AgentClient], reason: str) -> None:
    """Stop agents on purpose: their procs' exits are expected, not supervision failures."""
    for a in agents:
        for info in a.procs.values():
            info.stopping = True
        if info_mesh := next((i.owner for i in a.procs.values() if isinstance(i.owner, ProcMesh)), None):
            info_mesh._alloc._stopped, info_mesh._alloc._stop_reason = True, f"its hosts: {reason}"
    for a in agents:
        try:
            a.request(ShutdownAgent(reason), timeout=5)
        except Exception:  # noqa: BLE001 - already gone
            pass
        a.lost = a.lost or "shut down"
        _fanout.forget(a.addr)


@atexit.register
def _end_sessions() -> None:
    for mesh in [m for m in list(_live_meshes) if isinstance(m, RemoteProcMesh)]:
        mesh._stopped = True
        _live_meshes.discard(mesh)
        mailbox = current_mailbox()
        for p in mesh._procs:
            p.stopping = True
            if p.alive:
                try:
                    mailbox.send(p.addr, StopProc("the controller exited"))
                except Exception:  # noqa: BLE001
                    pass
    for a in list(_watcher.agents):
        if not a.lost:
            try:
                a.request(EndSession(SESSION), timeout=2)
            except Exception:  # noqa: BLE001
                pass
