"""``ProcMesh``: procs with a named shape, that actors are spawned on; the proc meshes this process spawned and
still runs, and this machine's template processes that fork their procs.

>>> procs = this_host().spawn_procs(per_host={"gpus": 2})  # doctest: +SKIP
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from typing import TYPE_CHECKING

from .. import config
from ..errors import MeshStoppedError, SupervisionError
from ..future import CoroutineFuture, Future, in_event_loop
from ..runtime import _context, _hooks
from ..shape import MeshTrait, Shape
from ..transport.mailbox import current_mailbox
from ..transport.messages import SetLogging, StopProc
from ._supervision import _supervise_later
from .bootstrap import BOOTSTRAP_TIMEOUT
from .local import LocalHost, ProcInfo

if TYPE_CHECKING:
    from .host_mesh import HostMesh

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


def forget_local_hosts() -> None:
    """Forget this machine's template processes (``shutdown_context``): a later spawn starts a new one."""
    global _local_host
    with _local_lock:
        _local_host = None
        _other_hosts.clear()


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
            from .host_mesh import HostMesh

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

    def _spawn_named(self, name: str, actor_class: type, *args, implementation: str | None = None, **kwargs):
        """``spawn`` for the runtime's own actors, reached by their name: a name in use is an error, not a
        second mesh under another name. ``implementation``: ``"package.module:Class"``, the class the procs
        construct, when ``actor_class`` only declares its endpoints (the tensor engine's worker: this process
        then never imports the class)."""
        from ..actor import _spawn_actor_mesh

        return _spawn_actor_mesh(self, name, actor_class, args, kwargs, rename=False, implementation=implementation)

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
        self._check_alive()
        sync = _hooks.api("workspace_sync", "sync_workspace")
        return CoroutineFuture.of(sync(self._members(), workspace, auto_reload, conda=conda))

    @property
    def env(self):
        """Environment variables of the procs: ``procs.env.get("NCCL_DEBUG").get()`` -> ValueMesh."""
        return _hooks.api("env", "ProcEnv")(self)

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


def _agents_of(procs: list[ProcInfo]) -> list:
    """The host agents (of a job) that run ``procs``, in rank order, one each; none for this machine's."""
    agents: list = []
    for p in procs:
        agent = getattr(p, "agent", None)
        if agent is not None and agent not in agents:
            agents.append(agent)
    return agents
