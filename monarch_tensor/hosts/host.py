"""Hosts and proc meshes: ``this_host().spawn_procs(per_host={"gpus": 4})``.

Here: the supervision of the client's procs (their exits, faults nobody awaited), ``ProcMesh`` and
``HostMesh``, and the script's side (``this_host()``, ``this_proc()``, shutdown). The template process that
forks local procs is driven from ``local.py``; how procs start (``BootstrapCommand``, ``bootstrap=``) is
``bootstrap.py``; host agents are ``agent.py`` and ``remote_hosts.py``.
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import inspect
import itertools
import logging
import os
import queue
import shutil
import signal
import sys
import threading
import time
from typing import Mapping

from .. import config
from ..config import setting
from ..env import check_env
from ..errors import MeshStoppedError, SupervisionError
from ..future import CoroutineFuture, Future, in_event_loop
from ..runtime import _context, _exit_status
from ..shape import MeshTrait, Shape
from ..transport import _wire
from ..transport._fanout import send_many
from ..transport.mailbox import SYSTEM_HANDLERS, current_mailbox, local_mailboxes, new_ipc_address
from ..transport.messages import ActorFault, ReportProcGone, SetLogging, StopProc
from . import local as _local
from .bootstrap import BOOTSTRAP_TIMEOUT, bootstrap_plan, check_bootstrap, run_bootstrap
from .local import LocalHost, ProcInfo, _gpu_count

log = logging.getLogger("monarch_tensor.hosts.host")

_local_host: LocalHost | None = None
_other_hosts: dict[str, LocalHost] = {}  # templates of other interpreters (with_python_executable)
_local_lock = threading.Lock()


def local_host(python_exe: str | None = None) -> LocalHost:
    """This machine's template process for ``python_exe`` (default: this interpreter), started on first use."""
    global _local_host
    with _local_lock:
        if python_exe is not None:
            host = _other_hosts.get(python_exe)
            if host is None or host.dead:
                host = _other_hosts[python_exe] = LocalHost(python_exe=python_exe)
            return host
        if _local_host is None or _local_host.dead:  # (none yet, or it died: killed, out of memory)
            _local_host = LocalHost()
    return _local_host


def _proc_exited(info: ProcInfo, status: str) -> None:
    from ..transport import _shm

    _shm.remove_files_of(info.pid)
    _shm.release_reader(info.addr)  # what it held of our messages (killed before it let go)
    info.alive = False
    info.exit_status = status
    mesh = info.owner
    if info.stopping:  # calls still waiting on it fail (not a supervision event: its mesh was stopped)
        why = getattr(getattr(mesh, "_alloc", None), "_stop_reason", "") or "stopped"
        stopped = MeshStoppedError(f"proc {info.addr} (rank {info.rank}) was stopped ({why}) before it answered")
        for mailbox in local_mailboxes():
            mailbox.proc_died(info.addr, stopped)
        _tell_holders(info.addr, stopped, up=True)
        return
    where = f"rank {info.rank} of proc mesh {mesh._shape if mesh else '?'}"
    died = "died during its start" if info.starting else "died"
    err = SupervisionError(f"proc {info.addr} ({where}, pid {info.pid}) {died}: {status}",
                           proc=info.addr, rank=info.rank, exit_status=status)
    observed = sum(mailbox.proc_died(info.addr, err) for mailbox in local_mailboxes())
    # Then its tensor workers' groups with it stop waiting for it (to form, or for a collective it broke:
    # Collectives._wait). After the calls above failed: a fetch that waits on such a group gets this death,
    # not the group's failure that the workers reply with once told.
    client = getattr(getattr(mesh, "_alloc", None), "_tensor_client", None)
    if client is not None:
        client.peers_died(info.rank)
    _tell_holders(info.addr, err, up=True)
    # A waiting caller got the error: that is handling it. One that died during its start (before it said
    # it serves) is no fault of a running mesh: the first call on it (spawning actors on the mesh, its
    # bootstrap) raises this error, which a fault would also have sent to the script that caught it.
    if mesh is not None and not observed and not info.starting:
        mesh._failed(err)


def _tell_holders(addr: str, error: BaseException, up: bool) -> None:
    """Tell every other process of the tree that the proc at ``addr`` died or was stopped (``error``): any of
    them may hold a mesh of it (an actor mesh passed to an actor, or returned to the script), and its calls to
    the proc would never be answered. Only the process that spawned the proc learns of it first hand, so the
    notice goes up to the script, as forwarded logs do, and from there down to every proc each process spawned
    (``_on_proc_gone``): one small message per proc per death, nothing on the call path. ``up``: from a proc,
    to its client; else (the script, or a notice on its way down) to this process's own live procs."""
    mailbox = current_mailbox()
    # A proc's runtime; None in the script, which need not import _proc for it (this may run at its exit).
    proc = sys.modules.get("monarch_tensor.runtime._proc")
    rt = proc.current_runtime() if proc is not None else None
    try:
        if up and rt is not None:
            mailbox.send(rt.client_addr, ReportProcGone(addr, error, True))
            return
        # (procs being stopped are left out: at exit every mesh stops at once; so are procs behind a lost host
        # agent, which nothing reaches)
        addrs = [p.addr for mesh in list(_live_meshes) for p in mesh._procs
                 if p.alive and not p.stopping and not getattr(getattr(p, "agent", None), "lost", "")]
        if addrs:
            send_many(mailbox, addrs, _wire.encode(ReportProcGone(addr, error, False)))
    except Exception as e:  # noqa: BLE001 - this process is stopping (its mailbox closed), or its client is gone
        log.debug("could not pass on that proc %s is gone: %r", addr, e)


def _on_proc_gone(mailbox, msg: ReportProcGone) -> None:
    """Another process learnt that the proc ``msg.proc`` died or was stopped: calls here waiting on it fail,
    and later ones are refused (``ActorMesh._check`` asks ``death_of``), with the error its owner's calls get.
    Not a supervision event here: its owner (the process that spawned it) supervises it. Passed on up to the
    script, or down to this process's own procs."""
    for mb in {mailbox, *local_mailboxes()}:  # (a script's in-process runtime's too: its actors' calls)
        if mb.death_of(msg.proc) is None:  # (its owner, and the processes the notice passed on its way up, know)
            mb.proc_died(msg.proc, msg.error)
    _tell_holders(msg.proc, msg.error, msg.up)


SYSTEM_HANDLERS[ReportProcGone] = _on_proc_gone


_to_supervise: queue.SimpleQueue = queue.SimpleQueue()  # (owner, failure), for the supervision thread
_supervisor: threading.Thread | None = None
_supervisor_lock = threading.Lock()


def _supervise_later(owner, err: SupervisionError) -> None:
    """``_supervise(owner, err)`` on the supervision thread, one failure at a time in the order they came.
    Not on the thread that reports them: a hook or ``__supervise__`` may block (``heal_mesh`` waits for a
    spawn, whose reply that thread reads), and procs' exits must still be reported meanwhile."""
    global _supervisor
    _to_supervise.put((owner, err))
    with _supervisor_lock:
        if _supervisor is None or not _supervisor.is_alive():  # (not started, or not in this forked child)
            _supervisor = threading.Thread(target=_supervision_loop, daemon=True, name="monarch-tensor-supervise")
            _supervisor.start()


def _supervision_loop() -> None:
    while True:
        owner, err = _to_supervise.get()
        _supervise(owner, err)


def _supervise(owner, err: SupervisionError) -> None:
    """A failure for ``owner`` (an actor's context, None for the script): its ``__supervise__(err)`` may
    handle it by returning True; else ``unhandled_fault_hook`` runs (Monarch's order)."""
    from .. import actor

    handler = getattr(owner.instance, "__supervise__", None) if owner is not None else None
    if handler is not None:
        try:
            handled = handler(err)
            if inspect.iscoroutine(handled):  # an async __supervise__: on its actor's loop, as its endpoints
                handled = _await_on_actor_loop(owner, handled)
            if handled:
                return
        except Exception as e:  # noqa: BLE001
            err2 = SupervisionError(f"{err} (and __supervise__ raised {e!r})", proc=err.proc, rank=err.rank,
                                    exit_status=err.exit_status)
            err2.mesh, err2.__cause__, err = err.mesh, e, err2
    try:
        actor.unhandled_fault_hook(err)
    except BaseException as e:  # noqa: BLE001 - the supervision thread goes on to the next failure
        _unhandled_fault(err, e)


# How long an async ``__supervise__`` may take before its failure counts as unhandled.
SUPERVISE_TIMEOUT_S = 300.0


def _await_on_actor_loop(owner, coro):
    """The result of an async ``__supervise__``'s coroutine, run on its actor's event loop (from the supervision
    thread); an error when the actor has no running loop or the coroutine does not finish in time."""
    loop = getattr(owner, "loop", None)
    if loop is None or loop.is_closed():
        coro.close()
        raise RuntimeError("its actor's event loop is gone")
    future = asyncio.run_coroutine_threadsafe(coro, loop)
    try:
        return future.result(timeout=SUPERVISE_TIMEOUT_S)
    except concurrent.futures.TimeoutError:
        future.cancel()
        raise TimeoutError(f"the async __supervise__ did not finish within {SUPERVISE_TIMEOUT_S:g} s") from None


def _on_actor_fault(mailbox, msg: ActorFault) -> None:
    """An endpoint nobody awaited (called with ``broadcast``) raised, on an actor this process spawned: a
    supervision event for the actor mesh's owner (its ``__supervise__``, else ``unhandled_fault_hook``), as
    Monarch's, rather than a line in the proc's output only. The actor goes on serving. Handled on the
    supervision thread, in order with procs' deaths: a hook may block."""
    from ..actor import _mesh_owners

    name = getattr(msg.error, "actor", "?")
    owner = _mesh_owners.get((msg.proc, name))
    if isinstance(msg.error, SupervisionError):  # the actor aborted itself (ActorAbortedError)
        err = msg.error
    else:
        what = getattr(msg.error, "message", None) or repr(msg.error)
        rank = getattr(msg.error, "rank", None)
        err = SupervisionError(f"{what} (in a call nobody awaited: a broadcast)", proc=msg.proc, rank=rank)
    err.mesh = next((m for m in [*_live_meshes, _script_mesh] if m is not None and any(
        p.addr == msg.proc for p in m._procs)), None)
    _supervise_later(owner, err)


SYSTEM_HANDLERS[ActorFault] = _on_actor_fault


# The proc meshes whose unhandled faults interrupted the script's main thread (None: faults of no known mesh).
_interrupted_for: set[ProcMesh | None] = set()
_interrupted_lock = threading.Lock()


def _unhandled_fault(err: SupervisionError, raised: BaseException) -> None:
    """The fault hook raised (the default one does, with ``SystemExit``): the fault is unhandled. The script's
    main thread gets a ``KeyboardInterrupt`` (Monarch's), so that it ends running its ``finally`` blocks and
    ``atexit`` hooks; a proc ends at once, and its owner is told. Where no Python handler takes SIGINT (a
    script started with it ignored), the process ends at once too.

    One interrupt per proc mesh: a broadcast that raises on every proc, or a host that dies with all its procs,
    is several faults at once, each on a thread of its own, and a second interrupt would cut off the
    ``finally`` blocks and ``atexit`` hooks the first one started. The later faults are only printed (by the
    hook). A script that catches the interrupt and goes on is interrupted again by a fault of another mesh."""
    # A proc's runtime; None in the script, which need not import _proc for it (this may run at its exit,
    # when an import that registers an atexit hook fails).
    proc = sys.modules.get("monarch_tensor.runtime._proc")
    rt = proc.current_runtime() if proc is not None else None
    if not isinstance(raised, SystemExit):
        log.error("unhandled_fault_hook raised %r handling %s", raised, err)
    if rt is None and callable(signal.getsignal(signal.SIGINT)):
        mesh = getattr(err.mesh, "_alloc", None)
        with _interrupted_lock:
            if mesh in _interrupted_for:  # its first fault ends the script already (maybe in its atexit hooks)
                return
            _interrupted_for.add(mesh)
        main = threading.main_thread()
        if main.is_alive():
            print("monarch_tensor: delivering KeyboardInterrupt to the main thread to end the script",
                  file=sys.stderr, flush=True)
            signal.pthread_kill(main.ident, signal.SIGINT)
            return
        # The script is exiting (its main thread ended): its atexit hooks run on, stopping its procs, and it
        # then ends with status 1, not 0.
        _exit_status.fail_at_exit()
        return
    sys.stderr.flush()
    os._exit(1)


class ProcMesh(MeshTrait):
    """Procs with a named shape; ``spawn`` actors on them, ``slice`` them like arrays.

    >>> procs = this_host().spawn_procs(per_host={"gpus": 2})
    >>> counters = procs.spawn("counter", Counter, 0)
    >>> procs.slice(gpus=1).size()
    1
    """

    def __init__(self, procs: list[ProcInfo], shape: Shape, alloc: ProcMesh | None = None) -> None:
        self._procs = procs
        self._shape = shape
        self._alloc = alloc or self
        if alloc is None:
            self._owner = _context.current()
            self._stopped, self._stop_reason = False, ""
            self._stop_pending = False  # stop() began, its procs may not have exited yet (a Ctrl-C ended it)
            self._failures: list[SupervisionError] = []
            self._seq = next(_mesh_seq)  # names it in errors (``_label``)

    # ---- shape (slice, split, rename, flatten, size, sizes, extent: MeshTrait) ----------------------------
    def _new_with_shape(self, shape: Shape) -> ProcMesh:
        return ProcMesh(self._procs, shape, self._alloc)

    _PORTABLE = ("_procs", "_shape", "_seq", "_stopped", "_stop_reason", "_python_exe", "_host_dims", "_proc_bind",
                 "_threads", "_rank_envs", "_extra_env")

    def _portable(self) -> bytes:
        """This mesh pickled for its actors' ``context().actor_instance.proc_mesh``: the allocation's procs,
        shape and how to start more like them, not what only this process uses (its owner, the tensor engine's
        client, its runners)."""
        import pickle

        alloc = self._alloc
        copy = type(alloc).__new__(type(alloc))
        copy.__dict__.update({k: v for k, v in alloc.__dict__.items() if k in self._PORTABLE})
        copy._alloc, copy._owner, copy._stop_pending, copy._failures = copy, None, False, []
        return pickle.dumps(copy if self is alloc else ProcMesh(alloc._procs, self._shape, copy))

    def _what(self) -> str:
        return f"proc mesh {self._shape}"

    def _label(self) -> str:
        """How errors name it, so that two meshes of the same sizes read apart: its shape, the allocation
        (the n-th ``spawn_procs`` of this process) and, for a slice, which of its procs."""
        alloc = self._alloc
        label = f"{self._shape} of proc mesh #{alloc._seq}"
        ranks = self._shape.ranks()
        if ranks != list(range(len(alloc._procs))):
            label += f" (its procs {ranks})" if len(ranks) <= 8 else f" ({len(ranks)} of its procs)"
        return label

    def _members(self) -> list[ProcInfo]:
        return [self._procs[r] for r in self._shape.ranks()]

    def __repr__(self) -> str:
        return f"<ProcMesh {self._shape}>"

    def _repr_html_(self) -> str:
        """Jupyter's display: a row per proc, its coordinates, address and state."""
        from ..actor import _display

        procs = self._members()
        rows = [[*_display.coords(self._shape, i), p.addr, "alive" if p.alive else f"gone: {p.exit_status}"]
                for i, p in enumerate(procs)]
        stopped = " (stopped)" if self._alloc._stopped else ""
        return _display.table(f"ProcMesh {self._shape}{stopped}", [*self._shape.names, "proc", "state"], rows)

    def __await__(self):  # the seeds' `await proc_mesh(...)` form
        if False:
            yield
        return self

    @property
    def initialized(self) -> Future:
        """Resolves to True once the procs are up and ``spawn_procs``' ``bootstrap`` ran on all of them; raises
        the ``ActorError`` of a bootstrap that failed."""
        ran = getattr(self._alloc, "_init", None)
        if ran is None:
            return Future.ready(True)
        out = Future("the proc mesh's bootstrap")

        def settle(f: Future) -> None:
            err = f.exception(0)
            if err is None:
                out._set_result(True)
            else:
                out._set_exception(err)

        ran.add_done_callback(settle)
        return out

    def __getstate__(self):
        state = dict(self.__dict__)
        state.pop("_init", None)  # (this process's Future of the bootstrap: its waiters, its callbacks)
        return state

    def _await_init(self) -> None:
        """Wait for ``spawn_procs``' ``bootstrap`` (``BOOTSTRAP_TIMEOUT``); raise its error if it failed."""
        ran = getattr(self._alloc, "_init", None)
        if ran is not None:
            ran.get(timeout=BOOTSTRAP_TIMEOUT)

    @property
    def host_mesh(self) -> HostMesh:
        """The hosts this mesh's procs run on: this machine, or the job's hosts that hold them (in rank
        order, one each)."""
        agents = _agents_of(self._members())
        if not agents:
            return HostMesh()
        if any(getattr(p, "agent", None) is None for p in self._members()):
            raise ValueError(f"{self._what()} has procs on this machine and on a job's hosts: it has no one host mesh")
        from .remote_hosts import RemoteHostMesh

        return RemoteHostMesh(agents, handle=getattr(self._alloc, "_host_handle", None))

    # ---- actors -----------------------------------------------------------------
    def spawn(self, name: str, actor_class: type, *args, **kwargs):
        """Construct ``actor_class(*args, **kwargs)`` on every proc; returns an ``ActorMesh``."""
        from ..actor import _spawn_actor_mesh

        return _spawn_actor_mesh(self, name, actor_class, args, kwargs)

    def _spawn_named(self, name: str, actor_class: type, *args, **kwargs):
        """``spawn`` for the runtime's own actors, reached by their name: a name in use is an error, not a
        second mesh under another name."""
        from ..actor import _spawn_actor_mesh

        return _spawn_actor_mesh(self, name, actor_class, args, kwargs, rename=False)

    def execute(self, fn, *args, timeout: float | None = 60.0, **kwargs):
        """Run ``fn(*args, **kwargs)`` on every proc of this mesh and wait: a ``ValueMesh`` of the results (the
        seeds' ``mesh.execute(fn, batch)``). ``fn`` may be a lambda; mesh tensors among the arguments arrive as
        each rank's own tensor. ``fn``'s exception raises ``ActorError``; a lost proc ``SupervisionError`` (a
        ``DeviceMeshError``)."""
        return self.execute_async(fn, *args, **kwargs).get(timeout=timeout)

    def execute_async(self, fn, *args, **kwargs) -> Future:
        """``execute`` without the wait: a ``Future`` of the ``ValueMesh``, as every actor call returns
        (``.get()``, ``await``, or Ctrl-C during either, which stops ``fn`` on the procs).

        >>> fut = procs.execute_async(load_shard, path)   # runs now on every proc
        >>> shards = await fut                             # or fut.get(timeout=60)
        """
        if not callable(fn):
            raise TypeError(f"execute() takes a function to run on every proc, got {fn!r}")
        self._await_init()
        return self._runner().run.call(fn, args, kwargs)

    def _runner(self):
        """The actor mesh, one per proc, that runs functions for ``execute`` (and remote functions' ``call``),
        shaped as this mesh."""
        alloc = self._alloc
        runner = getattr(alloc, "_executor", None)
        if runner is None:
            from ..actor import _Executor

            runner = alloc._executor = alloc._spawn_named("_mt_execute", _Executor)
        return runner._new_with_shape(self._shape)

    def _check_alive(self) -> None:
        self._await_init()
        if self._alloc._stopped:
            raise MeshStoppedError(f"proc mesh {self._shape} was stopped ({self._alloc._stop_reason})")
        for p in self._members():
            if not p.alive:
                raise SupervisionError(
                    f"proc {p.addr} (rank {p.rank}) of this mesh died: {p.exit_status}",
                    proc=p.addr, rank=p.rank, exit_status=p.exit_status)

    # ---- lifecycle ----------------------------------------------------------------
    def stop(self, reason: str = "stopped by client") -> Future:
        """Stop every proc of this mesh's allocation; the returned future resolves when they exited (a proc
        gets 5 s to finish what it runs, then is killed). ``reason`` (Monarch's) is what later calls on the
        mesh are told, and calls still waiting on its procs (``MeshStoppedError``). Called on a thread that
        runs an asyncio loop (``await procs.stop()``), it returns at once and the waiting happens on another
        thread; elsewhere it returns once the procs exited. A Ctrl-C while it waits kills the procs at once;
        stop() again then waits for them to have exited."""
        if not isinstance(reason, str):
            raise TypeError(f"stop(reason=...) takes a string, got {reason!r}")
        alloc = self._alloc
        if alloc._stopped and not alloc._stop_pending:
            return Future.ready(None)
        if not alloc._stopped:  # (else a stop that was interrupted: this one finishes it)
            alloc._stopped, alloc._stop_reason, alloc._stop_pending = True, reason, True
            mailbox = current_mailbox()
            for p in alloc._procs:
                p.stopping = True
                stopped_addrs.add(p.addr)
                if p.alive:
                    try:
                        mailbox.send(p.addr, StopProc(reason))
                    except Exception:  # noqa: BLE001
                        pass
        if not in_event_loop():  # wait here
            self._finish_stop()
            return Future.ready(None)
        done: Future = Future(f"stop of proc mesh {self._shape}")

        def finish() -> None:
            try:
                self._finish_stop()
            except BaseException as e:  # noqa: BLE001 - the waiter hears of it
                done._set_exception(e)
            else:
                done._set_result(None)

        threading.Thread(target=finish, daemon=True, name="monarch-tensor-stop").start()
        return done

    async def __aenter__(self) -> ProcMesh:
        """``async with procs:`` (Monarch's): the mesh stops when the block ends, however it ends."""
        return self

    async def __aexit__(self, *exc) -> None:
        await self.stop()

    def _finish_stop(self) -> None:
        """``stop``'s wait: the procs get 5 s (the ``stop_timeout`` setting) to exit, then are killed. A Ctrl-C cuts the 5 s short, not the
        stop: the procs are killed before it goes on up (they ran on, a busy one spinning a core, with calls
        waiting on them for ever)."""
        alloc = self._alloc
        deadline = time.monotonic() + config.get("stop_timeout")
        try:
            while any(p.alive for p in alloc._procs) and time.monotonic() < deadline:
                time.sleep(0.01)
        finally:
            for p in alloc._procs:
                if p.alive:
                    alloc._kill(p)
        deadline = time.monotonic() + 5
        while any(p.alive for p in alloc._procs) and time.monotonic() < deadline:
            time.sleep(0.01)
        alloc._stop_pending = False
        _live_meshes.discard(alloc)
        from ..transport import logs

        logs.flush()  # lines an aggregation window still holds: their procs said all they will

    def _kill(self, p: ProcInfo) -> None:
        """SIGKILL a proc that did not stop (a mesh on host agents overrides this)."""
        local_host(getattr(self, "_python_exe", None)).kill(p.pid, 9)

    def logging_option(self, stream_to_client: bool = True, aggregate_window_sec: float | None = None,
                       level: int = logging.INFO) -> Future:
        """Forward procs' stdout/stderr to the client, folding repeats within a window; ``level`` (Monarch's)
        is the procs' root logger level."""
        from ..transport import logs
        from ..transport._ports import Collector

        if not isinstance(stream_to_client, bool):
            raise TypeError(f"logging_option(stream_to_client=...) must be True or False, got {stream_to_client!r}")
        if not isinstance(level, int) or isinstance(level, bool) or level < 0:
            raise TypeError(f"logging_option(level=...) takes a logging level such as logging.INFO, got {level!r}")
        self._check_alive()  # (a stopped mesh, or one with a dead proc: no proc would answer)
        logs.configure(aggregate_window_sec)
        members = [p for p in self._members() if p.alive]
        addrs = [p.addr for p in members]
        mailbox = current_mailbox()
        col = Collector(addrs, [p.rank for p in members], lambda v: None, "logging_option ack",
                        observing=False)
        port = mailbox.open_port(col)
        for a in addrs:
            mailbox.send(a, SetLogging(stream_to_client, port, level))
        return CoroutineFuture.of(col.future)  # async def in Monarch: asyncio.run() takes it

    def _failed(self, err: SupervisionError) -> None:
        """A proc of this allocation died unexpectedly: tell the owner, or the fault hook (soon after, on the
        supervision thread)."""
        if err.mesh is None:
            err.mesh = self
        self._failures.append(err)
        _supervise_later(self._owner, err)

    # ---- interactive tools (workspace_sync.py, env.py) ---------------------------------
    def sync_workspace(self, workspace, conda: bool = False, auto_reload: bool = False) -> CoroutineFuture:
        """Mirror ``workspace``'s dirs onto the hosts of this mesh; ``auto_reload`` re-imports changed modules;
        ``conda`` first mirrors the conda environment onto each host's ``$CONDA_PREFIX`` (``sync_env``). A
        Future that is a coroutine too (``async def`` in Monarch: ``asyncio.run()`` takes it).

        >>> await procs.sync_workspace(Workspace(dirs=["./proj"]), auto_reload=True)  # doctest: +SKIP
        """
        from ..workspace_sync import sync_workspace

        self._check_alive()
        return CoroutineFuture.of(sync_workspace(self._members(), workspace, auto_reload, conda=conda))

    @property
    def env(self):
        """Environment variables of the procs: ``procs.env.get("NCCL_DEBUG").get()`` -> ValueMesh."""
        from ..env import ProcEnv

        return ProcEnv(self)

    # ---- tensor engine (see controller/) ---------------------------------------------
    def activate(self):
        """``with procs.activate():`` factories make mesh tensors on this mesh; ops on them run here."""
        from .. import _seams

        return _seams.get("activate")(self)

    def rank_tensor(self, dim: str):
        """Each rank's coordinate along ``dim``, as a 0-dim int64 mesh tensor."""
        from .. import _seams

        return _seams.get("rank_tensor")(self, dim)

    def rank(self, dims):
        """Monarch's name for ``rank_tensor``: ``mesh.rank("gpus")``; of several dims, ``mesh.rank(("hosts",
        "gpus"))``, the rank within them, row-major (``hosts * gpus_size + gpus``)."""
        if isinstance(dims, str):
            return self.rank_tensor(dims)
        if not isinstance(dims, (list, tuple)):  # (rank(0): a rank number is not a dim)
            raise TypeError(f"rank() takes a dim name or a sequence of them, got {dims!r}")
        dims = list(dims)
        if not dims or not all(isinstance(d, str) for d in dims):
            raise TypeError(f"rank() takes a dim name or a sequence of them, got {dims!r}")
        sizes = self._shape.sizes
        unknown = [d for d in dims if d not in sizes]
        if unknown:
            from ..shape import DimensionError

            raise DimensionError(f"mesh has no dimension {unknown[0]!r}; its dimensions are {list(sizes)}")
        out = self.rank_tensor(dims[0])
        for d in dims[1:]:
            out = out * sizes[d] + self.rank_tensor(d)
        return out

    def process_group(self, dims):
        """The process groups along ``dims`` (a name or a list of them), to pass to ``remote`` functions that
        call ``torch.distributed`` collectives: ``pg = procs.process_group("gpus")`` (see
        controller/process_group.py)."""
        from .. import _seams

        return _seams.get("RemoteProcessGroup")(dims, self)

    def to_table(self) -> str:
        """A table of the mesh's procs: rank, coordinates, pid, address (Monarch's ``to_table``)."""
        rows = [("rank", *self._shape.names, "pid", "address")]
        for i, p in enumerate(self._members()):
            point = self._shape.point(i)
            rows.append((str(i), *(str(point[n]) for n in self._shape.names), str(p.pid or "?"), p.addr))
        widths = [max(len(r[c]) for r in rows) for c in range(len(rows[0]))]
        lines = ["  ".join(v.ljust(w) for v, w in zip(r, widths)).rstrip() for r in rows]
        return "\n".join([lines[0], "  ".join("-" * w for w in widths), *lines[1:]])

    def rank_tensors(self) -> dict:
        """Every dim's ``rank_tensor``: ``procs.rank_tensors()["gpus"]`` (Monarch's method)."""
        return {dim: self.rank_tensor(dim) for dim in self._shape.names}


_live_meshes: set[ProcMesh] = set()
_mesh_seq = itertools.count(1)
# Procs this process stopped (ProcMesh.stop()): an actor mesh that came back through pickling has lost its
# proc mesh, and checks these.
stopped_addrs: set[str] = set()

# The most procs one ``spawn_procs`` starts on each host unless the environment says otherwise: a guard
# against a typo such as ``{"gpus": 10**6}`` forking until the machine gives out.


def per_host_sizes(per_host: Mapping[str, int] | None) -> dict[str, int]:
    """``spawn_procs``' ``per_host`` as a dict; None is one proc per host, of the hosts' dims. Anything but a
    mapping is refused by name: ``per_host=2`` (a torchrun user's "2 procs per host") failed with "'int'
    object is not iterable", a list of names with a ``dict()`` error about update sequences."""
    if per_host is None:
        return {}
    if not isinstance(per_host, Mapping):
        raise TypeError(f"per_host must be a dict of dimension sizes, e.g. {{'gpus': 2}}, got {per_host!r}")
    return dict(per_host)


def check_procs_per_host(per_host: dict, n: int) -> None:
    """Refuse ``n`` procs on each host above ``MONARCH_TENSOR_MAX_PROCS_PER_HOST`` (default 1024)."""
    limit = setting("MONARCH_TENSOR_MAX_PROCS_PER_HOST")
    if n > limit:
        raise ValueError(f"spawn_procs(per_host={per_host}) asks for {n} procs on each host, more than the limit of "
                         f"{limit}; set MONARCH_TENSOR_MAX_PROCS_PER_HOST to allow more")


def _spawn_procs(shape: Shape, proc_bind: list | None = None, per: int = 1,
                 python_exe: str | None = None, extra_env: dict[str, str] | None = None,
                 threads: int | None = None, rank_envs: list[dict] | None = None) -> ProcMesh:
    """Procs of ``shape`` on this machine; ``proc_bind`` (``_bind.check``ed) binds the ``per`` procs of
    each host; ``python_exe`` runs them (default: this interpreter); ``extra_env`` is added to their
    environment from the start, and ``rank_envs[r]`` to rank r's (``bootstrap_command``); ``threads``:
    torch's intra-op threads in each (``_threads``)."""
    mailbox = current_mailbox()
    n = len(shape)
    infos = [ProcInfo(new_ipc_address("proc"), r) for r in range(n)]
    gpus = _gpu_count()
    envs = []
    from .. import config
    from ..runtime import _bind, _threads

    settings = config.proc_env()  # configure()'s settings that procs act on
    live = len(local_procs())
    if threads is None and not _threads.user_set(extra_env) and not _bind.restricts_cpus(proc_bind):
        _threads.notice(n, live + n)
    for point in (shape.point(i) for i in range(n)):
        sharing = _bind.sharing(proc_bind, point.rank % per, live + n)
        env = {"MONARCH_TENSOR_RANK": str(point.rank), **settings, **_bind.env_for(proc_bind, point.rank % per),
               **_threads.env_for(threads, sharing)}
        if gpus and "gpus" in shape.names:
            env["CUDA_VISIBLE_DEVICES"] = str(point["gpus"] % gpus)
        if python_exe is not None:
            env[HOST_PYTHON_ENV] = python_exe
        envs.append({**env, **(extra_env or {}), **(rank_envs[point.rank] if rank_envs else {})})
    mesh = ProcMesh(infos, shape)
    mesh._python_exe = python_exe
    mesh._extra_env, mesh._rank_envs = extra_env, rank_envs  # heal_mesh starts the new procs alike
    for info in infos:
        info.owner = mesh
    local_host(python_exe).spawn(infos, mailbox.addr, envs)
    _live_meshes.add(mesh)
    share_peers(infos)
    return mesh


def local_procs() -> list[ProcInfo]:
    """The live procs this process spawned on its own host (not behind a host agent)."""
    return [p for mesh in list(_live_meshes) for p in mesh._procs
            if p.alive and getattr(p, "agent", None) is None]


def share_peers(procs: list[ProcInfo] | None = None) -> None:
    """Tell ``procs`` (default: every live proc this process spawned) of the host agents it attached to:
    those on this host get each agent's job key, so they reach the procs behind it and answer them; those
    behind an agent get the addresses of the other jobs' agents, whose procs they reach through this
    process's gateway (``remote_hosts._Gateway``). In order with this process's other messages to them:
    ahead of any call made after."""
    from ..transport import _curve
    from ..transport.messages import KnowPeers

    peers = _curve.peers()
    if not peers:
        return
    mailbox = current_mailbox()
    keys = KnowPeers(tuple((addr, k.public, k.secret) for addr, k in peers.items()))
    if procs is None:
        procs = [p for mesh in list(_live_meshes) for p in mesh._procs if p.alive]
    for p in procs:
        agent = getattr(p, "agent", None)
        if agent is None:
            mailbox.send(p.addr, keys)
            continue
        others = tuple(addr for addr, k in peers.items() if k.public != agent.keys.public)
        if others:
            mailbox.send(p.addr, KnowPeers((), others))


class HostMesh(MeshTrait):
    """Hosts you can spawn procs on. ``this_host()`` is the local machine (a mesh of one host, no dims);
    a job's hosts have a ``hosts`` dim, and slice, split and rename like any mesh."""

    def __init__(self, shape: Shape | None = None, python_exe: str | None = None) -> None:
        self._shape = shape or Shape((), ())
        self._python_exe = python_exe

    def _new_with_shape(self, shape: Shape) -> HostMesh:
        return HostMesh(shape, self._python_exe)

    def with_python_executable(self, python_exe: str) -> HostMesh:
        """The same hosts, whose procs run ``python_exe`` (Monarch's): another virtual environment, say.
        It must import this ``monarch_tensor`` and its dependencies (the script's ``sys.path`` is on its
        ``PYTHONPATH``); procs those procs spawn on their own host run it too."""
        if not isinstance(python_exe, str) or not python_exe:
            raise TypeError(f"with_python_executable() takes the path of a Python interpreter, got {python_exe!r}")
        path = shutil.which(python_exe)
        if path is None:
            raise FileNotFoundError(f"with_python_executable({python_exe!r}): no such executable")
        return HostMesh(self._shape, os.path.abspath(path))

    def _what(self) -> str:
        return f"host mesh {self._shape}"

    def spawn_procs(self, per_host: Mapping[str, int] | None = None, bootstrap=None, name: str | None = None,
                    proc_bind: list[dict[str, str]] | None = None, threads: int | None = None,
                    bootstrap_command=None) -> ProcMesh:
        """``spawn_procs(per_host={"gpus": 4})`` -> ProcMesh of shape {hosts..., "gpus": 4}; ``bootstrap``
        (a function of no arguments, or an async one) runs on every proc before this returns; ``proc_bind``
        binds each proc of a host to CPUs or NUMA nodes (see ``_bind.py``); ``threads``: torch's intra-op
        threads in each proc (default: ``OMP_NUM_THREADS``, else its share of the host's cores: see
        ``_threads.py``); ``bootstrap_command`` (Monarch's): a ``BootstrapCommand``, or a function of each
        proc's ``Point`` returning one: its program runs the procs, its env is added to theirs (see
        ``BootstrapCommand`` for what cannot be honoured here)."""
        from ..runtime import _bind, _threads

        check_bootstrap(bootstrap)
        threads = _threads.check(threads)
        per_host = per_host_sizes(per_host)
        shape = _procs_shape(self._shape, per_host)
        check_procs_per_host(per_host, len(shape))
        per = len(shape) // max(1, len(self._shape))
        proc_bind = _bind.check(proc_bind, per)
        _bind.check_here(proc_bind)
        python_exe, rank_envs = bootstrap_plan(bootstrap_command, shape, self._python_exe)
        mesh = _spawn_procs(shape, proc_bind, per, python_exe, threads=threads, rank_envs=rank_envs)
        mesh._proc_bind = proc_bind  # heal_mesh binds the new procs alike
        mesh._threads = threads  # and gives them as many threads
        return run_bootstrap(mesh, bootstrap)

    def _runs_here(self, p: ProcInfo) -> bool:
        return getattr(p, "agent", None) is None  # (a host agent's procs are on its host)

    def sync_workspace(self, workspace, conda: bool = False, auto_reload: bool = False) -> CoroutineFuture:
        """Mirror ``workspace`` onto these hosts' workspace roots and reload the procs running there (a Future
        that is a coroutine too, as ``ProcMesh.sync_workspace``).

        >>> await this_host().sync_workspace(Workspace(dirs=["./proj"]))  # doctest: +SKIP
        """
        return CoroutineFuture.of(self._sync_workspace(workspace, conda, auto_reload))

    def _sync_workspace(self, workspace, conda: bool, auto_reload: bool) -> Future:
        from ..workspace_sync import SyncResult, check_workspace, conda_prefix, sync_local, sync_workspace

        check_workspace(workspace)  # on every path, as sync_workspace checks it: a path is no Workspace
        procs = [p for mesh in list(_live_meshes) for p in mesh._procs if p.alive and self._runs_here(p)]
        if not procs:  # nothing runs yet: write this host's root directly
            try:
                prefix = conda_prefix(workspace) if conda else None
                active = os.environ.get("CONDA_PREFIX")
                if prefix is not None and not (active and os.path.samefile(prefix, active)):
                    raise ValueError(f"sync_workspace(conda=True): no proc runs on this host yet to receive {prefix} "
                                     f"(procs spawned here run in this script's environment, {active}); spawn "
                                     "procs with CONDA_PREFIX set where it should go, then sync")
                result = sync_local(workspace)
                if prefix is not None:  # (the procs spawned here later inherit this very environment)
                    result.conda = SyncResult(roots=[prefix])
                return Future.ready(result)
            except Exception as e:  # noqa: BLE001
                return Future.failed(e)
        return sync_workspace(procs, workspace, auto_reload, conda=conda)

    @property
    def is_fake_in_process(self) -> bool:
        """Monarch's: whether these hosts are the script's own process standing in for hosts. Always False
        here: every host mesh has real procs (there is no in-process fake)."""
        return False

    @property
    def stream_logs(self) -> bool:
        """Whether procs spawned on these hosts stream their stdout and stderr to this script (Monarch's;
        ``configure(enable_log_forwarding=...)`` sets it, ``procs.logging_option`` switches running procs)."""
        from .. import config

        return bool(config.get("enable_log_forwarding"))

    @property
    def initialized(self) -> Future:
        """Resolves to True once the hosts are up (they are, once the mesh exists)."""
        return Future.ready(True)

    def stop(self) -> Future:
        """Stop every proc mesh this script spawned on these hosts; the hosts stay usable."""
        for mesh in [m for m in list(_live_meshes) if any(self._runs_here(p) for p in m._procs)]:
            mesh.stop()
        return Future.ready(None)

    def shutdown(self) -> Future:
        """Stop the procs on these hosts, and the hosts' agents where a job started them (the local
        machine itself stays, of course). Also what leaving ``async with hosts:`` does."""
        return self.stop()

    async def __aenter__(self) -> HostMesh:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.shutdown()

    def __repr__(self) -> str:
        return f"<HostMesh {self._shape}>"

    def _repr_html_(self) -> str:
        """Jupyter's display: a row per host and its coordinates."""
        from ..actor import _display

        n = len(self._shape)
        return _display.table(f"HostMesh {self._shape}", [*self._shape.names, "rank"],
                              [[*_display.coords(self._shape, i), i] for i in range(n)])


def _procs_shape(hosts: Shape, per_host: Mapping[str, int]) -> Shape:
    """The shape of procs spawned ``per_host`` on a host mesh of shape ``hosts``: its dims, then theirs."""
    for n in per_host:
        if n in hosts.names:
            raise ValueError(f"per_host cannot have a {n!r} dimension: the host mesh {hosts} has it")
    return Shape((*hosts.names, *per_host), (*hosts.dims, *per_host.values()))


# The interpreter a proc was started with by ``with_python_executable``: its own ``this_host()`` runs the procs
# it spawns with it too (as Monarch's host mesh keeps its bootstrap command), a wrapper script included.
HOST_PYTHON_ENV = "MONARCH_TENSOR_HOST_PYTHON"


def this_host() -> HostMesh:
    """The machine this script runs on, as a host mesh of one host (in a proc started by a host mesh's
    ``with_python_executable``, of that interpreter)."""
    python_exe = setting(HOST_PYTHON_ENV) or None
    local_host(python_exe)  # start the template process early: it imports torch while the script goes on
    return HostMesh(python_exe=python_exe)


def this_proc() -> ProcMesh:
    """The current process as a mesh of one proc (no dims): in a proc, that proc; in the script (its actors
    running in it included), the script's own process, whose actors run on an actor runtime of its own
    (``ScriptProc``), sharing the script's memory."""
    proc = sys.modules.get("monarch_tensor.runtime._proc")
    if proc is None or proc._runtime is None:  # the script
        return _script_proc()
    mailbox = current_mailbox()
    ctx = _context.current()
    return ProcMesh([ProcInfo(mailbox.addr, ctx.proc_rank)], Shape((), ()))


_context.this_proc_hook = this_proc


class ScriptProc(ProcMesh):
    """The script's own process as a proc mesh of one (``this_proc()`` in the script), as Monarch's: actors
    spawned on it run in the script's process, on an actor runtime (``_proc.start_in_script``) started on
    first use, on a thread of its own, with its own mailbox and event loop. They share the script's memory
    (its modules, their globals), and run as on any proc: their endpoints, constructors, supervision and
    ``context()`` alike; the script's own threads keep the script's mailbox. Stopping the mesh (and the
    script's exit) runs their ``__cleanup__`` and ends the runtime; a later ``this_proc()`` gives a new one."""

    def __init__(self) -> None:
        info = ProcInfo(new_ipc_address("inproc"), 0, os.getpid())
        super().__init__([info], Shape((), ()))
        info.owner = self
        self._runtime = None
        self._start_lock = threading.Lock()

    def _start(self) -> None:
        """Start the runtime, unless it runs (or this mesh was stopped: its calls say so)."""
        if self._runtime is not None or self._stopped:
            return
        from ..runtime import _proc

        with self._start_lock:
            if self._runtime is None:
                self._runtime = _proc.start_in_script(self._procs[0].addr, self._runtime_ended)

    def _check_alive(self) -> None:
        super()._check_alive()
        self._start()  # (whatever is sent to it next needs its address served)

    def _runtime_ended(self) -> None:
        """On the runtime's thread, once it stopped: calls still waiting on it fail, as for a stopped proc."""
        info = self._procs[0]
        if not info.alive:
            return
        info.alive = False
        info.exit_status = "stopped"
        why = self._stop_reason or "stopped"
        err = MeshStoppedError(f"the script's own proc {info.addr} was stopped ({why}) before it answered")
        for mailbox in local_mailboxes():
            mailbox.proc_died(info.addr, err)

    def _kill(self, p: ProcInfo) -> None:
        """A thread cannot be killed: one of its actors still runs a call after the stop's wait (its ``__cleanup__``
        did not run); the runtime is abandoned, its calls fail, and the thread ends with the script."""
        log.warning("the script's in-process actors did not stop within the stop timeout (an endpoint still "
                    "runs); they are abandoned")
        self._runtime_ended()

    def stop(self, reason: str = "stopped by client") -> Future:
        if self._runtime is None and not self._stopped:  # never started: nothing runs to stop
            if not isinstance(reason, str):
                raise TypeError(f"stop(reason=...) takes a string, got {reason!r}")
            self._stopped, self._stop_reason = True, reason
            self._runtime_ended()
            return Future.ready(None)
        return super().stop(reason)

    def __reduce__(self):
        # In this process it stays this very mesh (an actor's ``context().actor_instance.proc_mesh``, a mesh
        # sent back by an actor); elsewhere it is a plain mesh of one proc at its address. (``_portable``
        # pickles a copy: the live mesh is found by its address.)
        info = self._procs[0]
        live = _script_mesh
        if live is not None and live._procs[0].addr == info.addr:
            live._start()  # (who gets it may spawn on it: its address must be served)
        return _script_proc_at, (info.addr, info.pid, self._stopped, self._stop_reason)


_script_mesh: ScriptProc | None = None
_script_lock = threading.Lock()


def _script_proc() -> ScriptProc:
    global _script_mesh
    with _script_lock:
        if _script_mesh is None or _script_mesh._stopped:
            _script_mesh = ScriptProc()
        return _script_mesh


def _script_proc_at(addr: str, pid: int, stopped: bool, reason: str) -> ProcMesh:
    """Unpickles a ``ScriptProc``: in its script, the mesh itself."""
    mesh = _script_mesh
    if mesh is not None and mesh._procs[0].addr == addr:
        return mesh
    out = ProcMesh([ProcInfo(addr, 0, pid)], Shape((), ()))
    out._stopped, out._stop_reason = stopped, reason
    return out


def proc_mesh(*, gpus: int | None = None, hosts: int | None = None, env: dict[str, str] | None = None,
              setup=None, **dims: int) -> ProcMesh:
    """The older form: ``proc_mesh(gpus=4)`` (also awaitable: ``await proc_mesh(gpus=4)``). Monarch's ``env``
    is added to the procs' environment from their start; ``setup`` (a function) runs on every proc before
    the mesh is handed back, as ``spawn_procs(bootstrap=...)`` does."""
    check_env(env, "proc_mesh(env=...)")
    check_bootstrap(setup)
    sizes = {}
    if hosts is not None:
        sizes["hosts"] = hosts
    if gpus is not None:
        sizes["gpus"] = gpus
    sizes.update(dims)
    if not sizes:
        raise ValueError("proc_mesh needs at least one dimension, e.g. proc_mesh(gpus=4)")
    return run_bootstrap(_spawn_procs(Shape.from_sizes(sizes), extra_env=env), setup)


def _shutdown() -> None:
    mesh = _script_mesh  # first: its actors' __cleanup__ may still call actors on the procs
    if mesh is not None and mesh._runtime is not None:
        try:
            mesh.stop()
        except Exception:  # noqa: BLE001
            pass
    for mesh in list(_live_meshes):
        try:
            mesh.stop()
        except Exception:  # noqa: BLE001
            pass
    for host in [_local_host, *_other_hosts.values()]:
        if host is not None:
            host.close()


@atexit.register
def _shutdown_at_exit() -> None:
    """Stop this machine's procs; then remove this client session's default workspace root here, which its
    procs wrote and nothing reads any more (a killed script's goes with its template, ``_zygote``; a host
    agent's with the session, ``HostAgent._end``)."""
    _shutdown()
    sync = sys.modules.get("monarch_tensor.workspace_sync._proc")  # (imported by any sync from here)
    from ..transport import mailbox

    if sync is not None and mailbox._mailbox is not None:
        sync.remove_default_root(mailbox._mailbox.addr)


def _agents_of(procs: list[ProcInfo]) -> list:
    """The host agents (of a job) that run ``procs``, in rank order, one each; none for this machine's."""
    agents: list = []
    for p in procs:
        agent = getattr(p, "agent", None)
        if agent is not None and agent not in agents:
            agents.append(agent)
    return agents


def heal_mesh(mesh: ProcMesh) -> ProcMesh:
    """A working mesh of the same sizes on the same hosts, in place of one that lost procs (the seeds'
    ``monarch.heal_mesh``): what is left of the old allocation is stopped, and new procs start (running the
    old mesh's ``bootstrap``). Actors and
    tensors of the old mesh are gone with it: spawn and make them again (from a checkpoint). A slice gives
    the same slice of the new mesh. A lost host is not replaced: ``HostUnreachableError`` says which."""
    if not isinstance(mesh, ProcMesh):
        raise TypeError(f"heal_mesh() takes a ProcMesh, got {type(mesh).__name__} {mesh!r}")
    alloc = mesh._alloc
    shape = alloc._shape
    agents = _agents_of(alloc._procs)
    bootstrap, proc_bind = getattr(alloc, "_bootstrap", None), getattr(alloc, "_proc_bind", None)
    threads = getattr(alloc, "_threads", None)
    alloc.stop()
    if not agents:
        per = len(proc_bind) if proc_bind else 1
        new = run_bootstrap(_spawn_procs(Shape(shape.names, shape.dims), proc_bind, per,
                                         getattr(alloc, "_python_exe", None), getattr(alloc, "_extra_env", None),
                                         threads=threads, rank_envs=getattr(alloc, "_rank_envs", None)), bootstrap)
    else:
        from ..errors import HostUnreachableError
        from .remote_hosts import RemoteHostMesh

        lost = [a.addr for a in agents if a.lost]
        if lost:
            raise HostUnreachableError(f"heal_mesh: the host agent(s) {lost} are lost, and this mesh cannot move "
                                       f"to other hosts by itself; start a job with spare hosts and spawn there")
        k = getattr(alloc, "_host_dims", 1)  # a job's procs: the hosts' dims, then the per-host dims
        new = RemoteHostMesh(agents, Shape(shape.names[:k], shape.dims[:k]), getattr(alloc, "_python_exe", None),
                             getattr(alloc, "_host_handle", None)).spawn_procs(
            dict(zip(shape.names[k:], shape.dims[k:])), bootstrap, proc_bind=proc_bind, threads=threads,
            _rank_envs=getattr(alloc, "_rank_envs", None))
    return new if mesh is alloc else ProcMesh(new._procs, mesh._shape, new)


def shutdown_context(host_timeout: float | None = None) -> Future:
    """Stop every proc mesh this process spawned, and this machine's template process (Monarch's; it also
    runs at exit). The script goes on; a later ``spawn_procs`` starts a new template."""
    global _local_host
    _shutdown()
    with _local_lock:
        _local_host = None
        _other_hosts.clear()
    return Future.ready(None)


# The exits of this process's own procs (LocalHost's template reports them) go to its supervision.
_local.client_proc_exited = _proc_exited
