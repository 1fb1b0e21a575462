"""The host agent: one per machine, serving controllers over CURVE-encrypted TCP.

It forks the procs of its host from a zygote (``host.LocalHost``), reaps them
and reports each exit to the controller that asked for it, relays messages to
its procs (they listen on ipc only, in a 0700 directory, so nothing off the
host reaches a proc except through an authenticated agent), and forwards
broadcasts down a fan-out tree of agents (``_fanout.py``). It outlives the
controllers: a controller that goes away (even SIGKILLed) only loses its own
procs, once its keep-alives stop; the agent itself serves until ``ttl`` seconds
pass with no controller at all, or until ``ShutdownAgent``.

    monarch-tensor host --bind tcp://0.0.0.0:26600 --key-file job.key

or, Monarch's form, from Python:

>>> run_worker_loop_forever(address="tcp://0.0.0.0:26600")   # keys from MONARCH_TENSOR_KEY_FILE
"""

from __future__ import annotations

import logging
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field

import zmq

from ..config import setting
from ..errors import AddressInUseError, JobKeyError
from ..future import Future
from ..runtime import _hooks
from ..transport import _curve, _fanout, _wire
from ..transport._fanout import ROUTE_MAGIC, UP_MAGIC
from ..transport.mailbox import _EVENTS, _POLLIN, new_ipc_address
from ..transport.messages import ForwardLogs, SendToPort
from ._address import split_agent_address
from ._gather import Gathers
from ._spawn_tree import SpawnTrees
from .agent_messages import (
    DescribeHost,
    EndSession,
    KeepSession,
    KillProcs,
    OpenSession,
    ReportExit,
    ReportSpawned,
    ReportSpawnedTree,
    ShutdownAgent,
    SpawnProcs,
    SpawnTree,
)
from .local import LocalHost, ProcInfo, _gpu_count

log = logging.getLogger("monarch_tensor.hosts.agent")

SESSION_TIMEOUT = setting("MONARCH_TENSOR_SESSION_TIMEOUT")
DEFAULT_TTL = setting("MONARCH_TENSOR_AGENT_TTL")
# Replies up the tree (_gather.py): a gather sends what it holds this long after its first entry at the
# latest; one that saw nothing for GATHER_TTL_S is dropped (what comes for it later goes up as it is).
GATHER_WINDOW_S = setting("MONARCH_TENSOR_GATHER_WINDOW_MS") * 1e-3
GATHER_TTL_S = 600.0


@dataclass
class _Session:
    last_seen: float
    procs: dict = field(default_factory=dict)  # pid -> (ProcInfo, events PortRef)
    clients: set = field(default_factory=set)  # its controllers' addresses (their procs' workspace roots)
    spawns: dict = field(default_factory=dict)  # spawn id -> the pids it forked here
    cancelled: set = field(default_factory=set)  # spawn ids killed (KillProcs): procs forked for them later die


class HostAgent:
    """Serve controllers on ``bind`` until ``ttl`` idle seconds or a ``ShutdownAgent``.

    >>> agent = HostAgent("tcp://127.0.0.1:0", JobKeys.load("job.key"))
    >>> agent.addr                  # the address to give controllers
    'tcp://127.0.0.1:41234'
    >>> agent.serve_forever()
    """

    def __init__(self, bind: str, keys: _curve.JobKeys, *, ttl: float = DEFAULT_TTL,
                 advertise: str | None = None) -> None:
        dial, bind = split_agent_address(bind)  # (an alias: listen on bind, be reached and named by dial)
        host, _, port = bind[len("tcp://"):].rpartition(":")
        if not host or not (port in ("*", "0") or (port.isdigit() and 0 < int(port) < 65536)):
            raise ValueError(f"a host agent listens on tcp://HOST:PORT with a port of 1-65535 (or 0: any free "
                             f"one), got {bind!r}")
        self.keys = keys.checked()
        # Procs inherit the job key from the zygote's environment: they need it to reach the controller.
        os.environ.update(keys.to_env())
        _curve._env_keys[:] = [keys]
        self.ttl = ttl
        self.ctx = zmq.Context()
        self.router = self.ctx.socket(zmq.ROUTER)
        self.router.setsockopt(zmq.LINGER, 0)
        self.router.setsockopt(zmq.ROUTER_HANDOVER, 1)
        _curve.serve_curve(self.ctx, self.router, keys)
        host, _, port = bind[len("tcp://"):].rpartition(":")
        try:
            self.router.bind(f"tcp://{host}:{'*' if port in ('0', '*') else port}")
        except zmq.ZMQError as e:
            self.router.close(0)
            _curve.stop_serving(self.ctx)
            if e.errno == zmq.EADDRINUSE:
                raise AddressInUseError(f"cannot listen on {bind}: the address is already in use "
                                        f"(another agent, or pick another port)") from e
            raise ValueError(f"cannot listen on {bind}: {e.strerror} (HOST must be an address or name of this "
                             f"machine, or 0.0.0.0 for all of them)") from e
        bound_port = self.router.getsockopt(zmq.LAST_ENDPOINT).decode().rpartition(":")[2]
        dial_host, _, dial_port = dial[len("tcp://"):].rpartition(":")
        if dial != bind:
            if not dial_host or not dial_port.isdigit() or not 0 <= int(dial_port) < 65536:
                raise ValueError(f"a host agent's alias is tcp://DIAL_HOST:PORT@tcp://BIND_HOST:PORT, got the "
                                 f"dial address {dial!r}")
            advertise = advertise or dial_host
            bound_port = bound_port if dial_port == "0" else dial_port  # (NAT: the port peers dial)
        if advertise is None:
            advertise = host if host not in ("*", "0.0.0.0", "") else _my_ip()
        self.addr = f"tcp://{advertise}:{bound_port}"
        self.workdir = os.getcwd()
        # Its procs' messages for their callers come up on this socket (identity: the proc's id here).
        self.up = self.ctx.socket(zmq.ROUTER)
        self.up.setsockopt(zmq.LINGER, 0)
        self.up_addr = new_ipc_address("agent-up")
        self.up.bind(self.up_addr)
        self.gathers = Gathers(self._send_raw, GATHER_WINDOW_S, GATHER_TTL_S)
        self.spawn_trees = SpawnTrees(self.addr, lambda child, tree: self._send_raw(child, _wire.encode((None, tree))))
        self.sessions: dict[str, _Session] = {}
        self.local_addrs: dict[str, str] = {}  # short proc id -> ipc address
        self._next_id = 0
        self._out: dict[str, zmq.Socket] = {}
        self._inbox: queue.Queue = queue.Queue()  # (ident or None, frames) from worker threads
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_w, False)
        self._last_contact = time.monotonic()
        self._stopping = False
        self.terminated = False  # SIGTERM: its scheduler ends the job (see on_sigterm)
        self.host = LocalHost(on_exit=self._proc_exited, on_output=self._proc_output)
        self._other_hosts: dict[str, LocalHost] = {}  # templates of other interpreters (SpawnProcs.python_exe)
        self._spawner = _Worker(self)

    def host_for(self, python_exe: str | None) -> LocalHost:
        """The template that forks procs running ``python_exe`` (None: the agent's interpreter), started on
        first use; a path this host cannot run is a clear error (the spawn's reply)."""
        if python_exe is None:
            return self.host
        host = self._other_hosts.get(python_exe)
        if host is None:
            if not (os.path.isfile(python_exe) and os.access(python_exe, os.X_OK)):
                raise FileNotFoundError(f"with_python_executable({python_exe!r}): no such executable on "
                                        f"{socket.gethostname()}")
            host = self._other_hosts[python_exe] = LocalHost(on_exit=self._proc_exited, python_exe=python_exe,
                                                             on_output=self._proc_output)
        return host

    # ---- the loop ------------------------------------------------------------------
    def serve_forever(self) -> None:
        poller = zmq.Poller()
        poller.register(self.router, zmq.POLLIN)
        poller.register(self._wake_r, zmq.POLLIN)
        poller.register(self.up, zmq.POLLIN)
        wait_ms = 250
        try:
            while not self._stopping:
                events = dict(poller.poll(wait_ms))
                if self.up in events:
                    while self.up.getsockopt(_EVENTS) & _POLLIN:
                        frames = self.up.recv_multipart(copy=False)
                        self._from_proc(frames[0].bytes.decode(), frames[1:])
                if self.router in events:
                    while self.router.getsockopt(_EVENTS) & _POLLIN:
                        self._on_frames(self.router.recv_multipart(copy=False))
                if self._wake_r in events:
                    os.read(self._wake_r, 4096)
                self._drain_inbox()
                self._expire()
                self.spawn_trees.expire(time.monotonic())
                now = time.monotonic()
                nxt = self.gathers.due(now)
                wait_ms = 250 if nxt is None else max(1, min(250, int((nxt - now) * 1000) + 1))
        finally:
            self.close()

    def _wake(self) -> None:
        try:
            os.write(self._wake_w, b"x")
        except BlockingIOError:
            pass

    def _on_frames(self, frames: list) -> None:
        ident, first = frames[0], frames[1].bytes
        magic = first[:4]
        if magic == ROUTE_MAGIC:
            self._relay(first[4:].decode(), frames[2:])
        elif magic == _fanout.TREE_MAGIC:
            _fanout.forward(first, frames[2:], self._relay, self._send_raw, self.gathers.start, self.addr)
        elif magic == UP_MAGIC:  # a child agent's, up the tree
            self._up_take(ident.bytes, frames[1:])
        else:
            try:
                req_id, msg = _wire.decode(frames[1:])
            except Exception as e:  # noqa: BLE001 - authenticated, yet malformed: drop it
                log.warning("agent dropped a malformed request: %s", e)
                return
            self._last_contact = time.monotonic()
            handler = getattr(self, f"handle_{type(msg).__name__}", None)
            if handler is None:
                self._answer(ident, req_id, None, ValueError(f"host agent has no request {type(msg).__name__}"))
                return
            try:
                handler(ident, req_id, msg)
            except Exception as e:  # noqa: BLE001 - a failed request is an error reply (a one-way one's is logged)
                if req_id is None:
                    log.warning("agent failed to handle %s: %r", type(msg).__name__, e)
                self._answer(ident, req_id, None, e)

    def _answer(self, ident, req_id, value, error=None) -> None:
        if req_id is not None:
            self.router.send_multipart([ident, *_wire.encode((req_id, value, error))])

    def _from_proc(self, proc_id: str, frames: list) -> None:
        if frames and frames[0].buffer[:4] == UP_MAGIC:
            self._up_take(proc_id, frames)
        else:
            log.warning("agent dropped a malformed message from its proc %s", proc_id)

    def _up_take(self, sender, frames: list) -> None:
        try:
            self.gathers.take(sender, frames)
        except Exception as e:  # noqa: BLE001 - authenticated, yet malformed: drop it
            log.warning("agent dropped a malformed message up the tree: %r", e)

    def _relay(self, proc_id: str, frames: list) -> None:
        addr = self.local_addrs.get(proc_id)
        if addr is None:
            log.debug("message for unknown proc %s dropped", proc_id)
            return
        self._send_raw(addr, frames)

    def _send_raw(self, addr: str, frames: list) -> None:
        s = self._out.get(addr)
        if s is None:
            s = self.ctx.socket(zmq.DEALER)
            s.setsockopt(zmq.LINGER, 1000)
            s.setsockopt(zmq.SNDHWM, 0)
            s.setsockopt(zmq.RECONNECT_IVL, 5)
            if addr.startswith("tcp://"):
                _curve.connect_curve(s, self.keys)
            s.connect(addr)
            self._out[addr] = s
        s.send_multipart(frames, copy=False)

    def _drain_inbox(self) -> None:
        while True:
            try:
                ident, frames = self._inbox.get_nowait()
            except queue.Empty:
                return
            if ident is None:
                self._send_raw(frames[0], frames[1:])
            elif ident == "up":  # a message of one of our procs for its caller: behind what it sent (_gather)
                proc_id, gateway, msg_frames, exited = frames
                self.gathers.pass_up(proc_id, gateway, msg_frames)
                if exited:
                    self.gathers.proc_exited(proc_id)
            elif ident == "call":  # a worker thread's result, for the loop's thread
                frames()
            elif ident == "forget":  # a proc exited: close our socket to it
                s = self._out.pop(frames, None)
                if s is not None:
                    s.close(linger=0)
            else:
                self.router.send_multipart([ident, *frames])

    def _expire(self) -> None:
        now = time.monotonic()
        for sid, s in list(self.sessions.items()):
            if now - s.last_seen > SESSION_TIMEOUT:
                log.info("session %s went quiet: killing its %d procs", sid, len(s.procs))
                self._end(sid)
        if not self.sessions and now - self._last_contact > self.ttl:
            log.info("no controller for %.0f s (ttl): exiting", self.ttl)
            self._stopping = True

    # ---- requests ---------------------------------------------------------------------
    def _session(self, sid: str) -> _Session:
        s = self.sessions.get(sid)
        if s is None:
            s = self.sessions[sid] = _Session(time.monotonic())
        s.last_seen = time.monotonic()
        return s

    def handle_OpenSession(self, ident, req_id, msg: OpenSession) -> None:
        self._session(msg.session)
        live = sum(len(s.procs) for s in self.sessions.values())
        self._answer(ident, req_id, DescribeHost(socket.gethostname(), self.addr, os.getpid(), self.workdir,
                                                 _gpu_count(), live))

    def handle_KeepSession(self, ident, req_id, msg: KeepSession) -> None:
        self._session(msg.session)

    def handle_SpawnProcs(self, ident, req_id, msg: SpawnProcs) -> None:
        self._spawn(msg, lambda reply, error: self._answer(ident, req_id, reply, error))

    def handle_SpawnTree(self, ident, req_id, msg: SpawnTree) -> None:
        if msg.reply_to is None:
            def answer(results: tuple) -> None:
                self._answer(ident, req_id, ReportSpawnedTree(0, results, msg.agent))
        else:
            parent, parent_tid = msg.reply_to

            def answer(results: tuple) -> None:
                self._send_raw(parent, _wire.encode((None, ReportSpawnedTree(parent_tid, results, msg.agent))))
        mine = self.spawn_trees.start(msg, answer)
        if msg.spawn is not None:
            try:
                self._spawn(msg.spawn, lambda reply, error: self.spawn_trees.own_done(mine, reply, error))
            except Exception as e:  # noqa: BLE001 - this agent's ranks fail, its children's go on
                self.spawn_trees.own_done(mine, None, e)

    def handle_ReportSpawnedTree(self, ident, req_id, msg: ReportSpawnedTree) -> None:
        self.spawn_trees.child_done(msg.tid, msg.agent, msg.results)

    def _spawn(self, msg: SpawnProcs, done) -> None:
        """Fork ``msg``'s procs (on the spawner's thread); ``done(ReportSpawned or None, error or None)`` on the
        loop's thread."""
        session = self._session(msg.session)
        session.clients.add(msg.client_addr)
        infos, envs = [], []
        gpus = _gpu_count()
        for rank, env in zip(msg.ranks, msg.envs):
            self._next_id += 1
            pid_key = str(self._next_id)
            info = ProcInfo(new_ipc_address("proc"), rank)
            self.local_addrs[pid_key] = info.addr
            env = dict(env)
            local_gpu = env.pop("MONARCH_TENSOR_LOCAL_GPU", None)
            if gpus and local_gpu is not None:
                env["CUDA_VISIBLE_DEVICES"] = str(int(local_gpu) % gpus)
            env["MONARCH_TENSOR_ALIASES"] = f'{{"{msg.client_addr}": "{msg.gateway}"}}'
            env["MONARCH_TENSOR_GATEWAY"] = msg.gateway  # also the way to the controller's own procs
            env["MONARCH_TENSOR_PUBLIC_ADDR"] = f"{info.addr}={self.addr}|{pid_key}"
            env["MONARCH_TENSOR_AGENT_UP"] = self.up_addr
            info.owner = (msg.session, msg.events, pid_key, msg.gateway)
            infos.append(info)
            envs.append(env)
        self._spawner.submit(session, infos, msg.client_addr, envs, msg.python_exe, msg.spawn_id, done)

    def handle_KillProcs(self, ident, req_id, msg: KillProcs) -> None:
        s = self._session(msg.session)
        pids = list(msg.pids)
        if msg.spawn_id:
            s.cancelled.add(msg.spawn_id)
            pids += s.spawns.get(msg.spawn_id, ())
        for pid in pids:
            if pid in s.procs:
                _signal(pid, msg.sig)
        self._answer(ident, req_id, None)

    def handle_EndSession(self, ident, req_id, msg: EndSession) -> None:
        self._end(msg.session)
        self._answer(ident, req_id, None)

    def handle_ShutdownAgent(self, ident, req_id, msg: ShutdownAgent) -> None:
        log.info("shutting down: %s", msg.reason)
        self._answer(ident, req_id, None)
        self._stopping = True

    def _end(self, sid: str) -> None:
        s = self.sessions.pop(sid, None)
        if s is not None:
            for pid in list(s.procs):
                _signal(pid, signal.SIGKILL)
            _remove_roots(s)

    # ---- proc exits (the zygote's reader thread) ----------------------------------------
    def _proc_output(self, info: ProcInfo, stream: int, data: bytes) -> None:
        """What a proc of ours left unread in its stdout or stderr when it exited (its last lines before an
        os._exit or a crash): to its client, as the proc's own forwarded lines."""
        lines = data.decode(errors="replace").split("\n")
        if lines and lines[-1] == "":
            lines.pop()
        if not lines or stream not in (1, 2):
            return
        gateway = info.owner[3]
        self._inbox.put(("up", (info.owner[2], gateway, _wire.encode(ForwardLogs(info.rank, stream, tuple(lines))),
                                False)))
        self._wake()

    def on_sigterm(self, *_) -> None:
        """SIGTERM: stop, and tell each client that its procs went with this host agent. (A scheduler ending
        the job, scancel or its time limit, signals every process of it: the template and the procs die too,
        and would be reported lost with it, which does not say why.)"""
        self.terminated = True
        self._stopping = True

    def _terminated_why(self) -> str:
        """Why this host is going away where a SIGTERM says so: to the agent, or to a template (which the
        agent stops with a request or SIGKILL, never SIGTERM): the reason given for its procs' exits."""
        if not self.terminated:
            for host in [self.host, *list(self._other_hosts.values())]:
                try:  # (a dead template closed its pipe as it exited: its status follows at once)
                    self.terminated = host.dead and host.proc.wait(timeout=1) == -signal.SIGTERM
                except subprocess.TimeoutExpired:
                    continue
                if self.terminated:
                    break
        if not self.terminated:
            return ""
        return (f"its host agent {self.addr} was terminated (SIGTERM: its scheduler ended the job, e.g. scancel "
                f"or a time limit, or someone stopped the agent)")

    def _proc_exited(self, info: ProcInfo, status: str) -> None:
        sid, events, pid_key, gateway = info.owner
        why = self._terminated_why()
        if why:
            status = f"{why}; {status}"
        self.local_addrs.pop(pid_key, None)
        s = self.sessions.get(sid)
        if s is not None:
            s.procs.pop(info.pid, None)
        frames = _wire.encode(SendToPort(events.port_id, ReportExit(info.pid, status), None, -1))
        self._inbox.put(("up", (pid_key, gateway, frames, True)))
        self._inbox.put(("forget", info.addr))
        self._wake()

    def close(self) -> None:
        self._stopping = True
        self._spawner.stop()
        self._close_zygote()
        for s in self.sessions.values():
            _remove_roots(s)
        self._drain_inbox()
        for s in self._out.values():
            s.close(linger=500)
        self.router.close(linger=0)
        self.up.close(linger=0)
        if os.path.exists(self.up_addr[len("ipc://"):]):
            os.unlink(self.up_addr[len("ipc://"):])
        _curve.stop_serving(self.ctx)
        self.ctx.term()


    def _close_zygote(self) -> None:
        """Ask each zygote to kill its procs and exit; SIGKILL one (its procs die with it) if it is busy."""
        for host in [self.host, *self._other_hosts.values()]:
            try:
                with host._lock:
                    _zygote_exit(host._req_fd)
                host.proc.wait(timeout=2)
            except Exception:  # noqa: BLE001 - busy importing, or gone
                host.proc.kill()
                host.proc.wait(timeout=5)


def _zygote_exit(fd: int) -> None:
    from ..runtime import _zygote

    _zygote.write_msg(fd, ("exit",))


class _Worker:
    """Spawns on its own thread: forking waits for the zygote, and the agent's loop must not."""

    def __init__(self, agent: HostAgent) -> None:
        self.agent = agent
        self.q: queue.Queue = queue.Queue()
        self.t = threading.Thread(target=self._run, daemon=True, name="agent-spawner")
        self.t.start()

    def submit(self, *job) -> None:
        self.q.put(job)

    def stop(self) -> None:
        self.q.put(None)

    def _run(self) -> None:
        while True:
            job = self.q.get()
            if job is None:
                return
            session, infos, client_addr, envs, python_exe, spawn_id, done = job
            reply, error = None, None
            try:
                self.agent.host_for(python_exe).spawn(infos, client_addr, envs)
                session.last_seen = time.monotonic()
                for info in infos:
                    session.procs[info.pid] = info
                if spawn_id:
                    session.spawns.setdefault(spawn_id, []).extend(i.pid for i in infos)
                # it ended, or the spawn was cancelled, while we forked
                if self.agent.sessions.get(info.owner[0]) is not session or spawn_id in session.cancelled:
                    for info in infos:
                        _signal(info.pid, signal.SIGKILL)
                reply = ReportSpawned(tuple(f"{self.agent.addr}|{i.owner[2]}" for i in infos),
                                      tuple(i.pid for i in infos))
            except Exception as e:  # noqa: BLE001
                error = e
            self.agent._inbox.put(("call", lambda done=done, reply=reply, error=error: done(reply, error)))
            self.agent._wake()


def _remove_roots(session: _Session) -> None:
    """What the tools keep on this host for a session that ended (its procs are gone): its default workspace
    roots (``_hooks.session_end``)."""
    _hooks.session_end(session.clients)


def _signal(pid: int, sig: int) -> None:
    """Signal a proc directly: its zygote may be busy importing, and it still reaps and reports the exit."""
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def _my_ip() -> str:
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


def _start_agent(address: str, ca: str | None, key_file: str | None, ttl: float,
                 address_file: str | None) -> HostAgent:
    if ca not in (None, "trust_all_connections") and not isinstance(ca, (str, bytes, os.PathLike)):
        raise TypeError(f"ca must be a path, bytes or 'trust_all_connections', got {ca!r}")
    keys = _curve.JobKeys.for_ca(key_file, ca)
    if keys is None:
        raise JobKeyError("a host agent needs the job's key: pass --key-file, or set MONARCH_TENSOR_KEY_FILE "
                          "or MONARCH_TENSOR_CURVE_PUBLIC/SECRET (or, to accept any peer, "
                          "ca='trust_all_connections' here and in attach_to_workers)")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s agent %(process)d %(levelname)s %(message)s")
    agent = HostAgent(address, keys, ttl=ttl)
    if address_file:
        try:
            _curve.write_private(address_file, agent.addr + "\n")
        except OSError as e:
            agent.close()
            raise ValueError(f"cannot write the address file {address_file}: {e.strerror or e}") from None
    print(f"monarch-tensor host agent {os.getpid()} serving on {agent.addr} (workdir {agent.workdir})",
          file=sys.stderr, flush=True)
    return agent


def run_worker_loop_until_shutdown(address: str, ca: str | None = None, *, key_file: str | None = None,
                                   ttl: float = DEFAULT_TTL, address_file: str | None = None) -> None:
    """Monarch's: run a host agent in this process until its host mesh shuts it down (``hosts.shutdown()``,
    a killed job) or its ``ttl`` passes with no controller, then return.

    Keys: ``key_file``, else the environment (``MONARCH_TENSOR_CURVE_*`` or
    ``MONARCH_TENSOR_KEY_FILE``). ``ca`` is accepted for Monarch compatibility;
    CURVE keys replace TLS certificates here, so only ``None``/``"trust_all_connections"``
    are meaningful: with a job key, that key authenticates every peer; with none,
    ``"trust_all_connections"`` accepts any peer (a well-known pair, with a warning).

    >>> run_worker_loop_until_shutdown(address="tcp://0.0.0.0:26600", key_file="job.key")
    """
    agent = _start_agent(address, ca, key_file, ttl, address_file)
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, agent.on_sigterm)
    try:
        agent.serve_forever()
    finally:
        _remove_address_file(address_file, agent.addr)


def _remove_address_file(path: str | None, addr: str) -> None:
    """An agent that stops takes back the address it wrote (unless another agent has written its own there
    since): nothing serves there any more."""
    if path:
        try:
            with open(path) as f:
                if f.read().strip() == addr:
                    os.remove(path)
        except OSError:
            pass


def run_worker_loop_forever(address: str, ca: str | None = None, *, key_file: str | None = None,
                            ttl: float = DEFAULT_TTL, address_file: str | None = None) -> None:
    """Monarch's: ``run_worker_loop_until_shutdown``, then end this process (exit status 0).

    >>> run_worker_loop_forever(address="tcp://0.0.0.0:26600", key_file="job.key")
    """
    run_worker_loop_until_shutdown(address, ca, key_file=key_file, ttl=ttl, address_file=address_file)
    sys.exit(0)


def start_worker_loop_forever(address: str, ca: str | None = None, *, key_file: str | None = None,
                              ttl: float = DEFAULT_TTL, address_file: str | None = None) -> Future[None]:
    """Monarch's: start a host agent on a thread of this process and return at once (it serves, and has
    written ``address_file``, by then); the Future resolves when the agent is shut down, or fails with
    what stopped it. Procs are forked from the agent's own template process, never from this one."""
    agent = _start_agent(address, ca, key_file, ttl, address_file)
    done: Future[None] = Future("host agent")

    def serve() -> None:
        try:
            agent.serve_forever()
        except BaseException as e:  # noqa: BLE001 - the observer learns why
            done._set_exception(e)
            return
        done._set_result(None)

    threading.Thread(target=serve, daemon=True, name="monarch-tensor-host-agent").start()
    return done
