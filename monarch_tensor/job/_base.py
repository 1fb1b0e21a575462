"""What every job shares: ``apply()``, ``state()``, ``kill()``, ``dump()`` / ``job_load()``.

A job owns host agents (``agent.py``) grouped into named meshes and one CURVE
key pair. ``state()`` connects to the agents and returns one ``HostMesh``
attribute per mesh. ``dump(path)`` writes a 0600 job file (agents' addresses
and the key) from which ``job_load(path).state()`` reattaches, from another
script or after the controller died, without going back to the scheduler.

A job that holds a scheduler's allocation (``SlurmJob``) also keeps its file at
``state()``'s ``cached_path`` (Monarch's: ``.monarch/job_state.json`` in the
working directory by default): running the script again with the same job
reattaches to that allocation if it still runs, instead of queueing again; a
job of another spec found there is cancelled first (the spec changed).

A job that is not ``reusable`` (``LocalJob``) and that this script started is
killed when the script exits unless a job file names it (``dump``, ``dumps``,
the job commands): nothing could ever reattach to its agents, which ran on
until their ttl, one more set each run.
"""

from __future__ import annotations

import atexit
import base64
import json
import logging
import os
import pickle
from typing import Any

from ..config import setting
from ..errors import HostUnreachableError, JobKeyError
from ..hosts.remote_hosts import AgentClient, RemoteHostMesh, connect_agents, reachable_agents, shutdown_agents
from ..transport import _curve

log = logging.getLogger("monarch_tensor.job")

# Set for a script that a job runs as its controller (``LocalJob.apply(client_script=...)``): the job file its
# own ``job.state()`` of the same spec reattaches from.
BATCH_JOB_ENV = "MONARCH_TENSOR_BATCH_JOB"
DEFAULT_STATE = os.path.join(".monarch", "job_state.json")  # state()'s cached_path, and job_load()'s default


class JobState:
    """One ``HostMesh`` attribute per named mesh: ``state.mesh0.spawn_procs(per_host={"gpus": 8})``."""

    def __init__(self, meshes: dict[str, RemoteHostMesh]) -> None:
        self._meshes = dict(meshes)
        for name, mesh in meshes.items():
            setattr(self, name, mesh)

    @property
    def _hosts(self) -> dict:
        """The meshes by name (Monarch's name for them)."""
        return self._meshes

    def __getattr__(self, name: str):
        raise AttributeError(f"this job has no mesh named {name!r}; its meshes are {sorted(self._meshes)}")

    def __repr__(self) -> str:
        return f"JobState({', '.join(f'{k}={v!r}' for k, v in self._meshes.items())})"


class JobTrait:
    """Base of every job. Subclasses implement ``_start()`` (returns mesh name -> agent addresses) and ``_release()``.

    A subclass written the Monarch way works too: ``super().__init__()`` with no meshes, and it overrides
    ``_create(client_script)`` (start the job's resources), ``_state()`` (a ``JobState`` of its host meshes),
    ``_kill()`` (stop them) and, for reattaching through ``state(cached_path)``, ``can_run(spec)``. Its job
    file holds the job pickled, as Monarch's do.

    >>> job = LocalJob(meshes={"mesh0": 2})
    >>> state = job.state()                  # applies the job if needed, waits for its agents
    >>> state.mesh0.spawn_procs(per_host={"gpus": 2}).sizes
    {'hosts': 2, 'gpus': 2}
    >>> job.dump("job.json"); job.kill()
    """

    kind = "base"
    reusable = False  # whether state() reattaches to a running job of the same spec found at its cached_path

    def __init__(self, meshes: dict[str, int] | None = None) -> None:
        if meshes is None and self._monarch_style():
            self.meshes, self.keys, self.addrs = {}, None, None
            self._agents, self._job_state = {}, None
            self._monarch_running = False
            return
        if not isinstance(meshes, dict) or not meshes or any(
                not isinstance(n, int) or isinstance(n, bool) or n < 1 for n in meshes.values()):
            raise ValueError(f"meshes must map names to host counts >= 1, e.g. {{'mesh0': 2}}, got {meshes!r}")
        for name in meshes:  # (a name is an attribute of the job's state, and a file name in its directory)
            if not isinstance(name, str) or not name.isidentifier() or name.startswith("_"):
                raise ValueError(f"mesh names must be Python identifiers not starting with '_', got {name!r}")
        self.meshes = dict(meshes)
        self.keys = _curve.JobKeys.generate()
        self.addrs: dict[str, list[str]] | None = None
        self._agents: dict[str, list[AgentClient]] = {}
        self._job_state: JobState | None = None

    # ---- what subclasses provide ---------------------------------------------------
    def _start(self) -> dict[str, list[str]]:
        raise NotImplementedError

    # (Monarch's way: a subclass overrides these three instead of _start and _release)
    def _create(self, client_script: str | None) -> None:
        raise NotImplementedError

    def _kill(self) -> None:
        raise NotImplementedError

    @classmethod
    def _monarch_style(cls) -> bool:
        """Whether this kind is written the Monarch way (overrides ``_create``, not ``_start``)."""
        return cls._create is not JobTrait._create and cls._start is JobTrait._start

    def _release(self) -> None:
        pass

    def _extra(self) -> dict[str, Any]:
        """Kind-specific fields of the job file."""
        return {}

    def _spec(self) -> dict[str, Any]:
        """The options that must match for a running job to serve another (``can_run``)."""
        return {}

    def _running(self) -> bool:
        """Whether the job's allocation still runs, all of it (asked of the scheduler)."""
        return self.active

    def _live_addrs(self) -> list[str]:
        """The addresses of the agents that ``kill()`` asks to shut down when it is not connected to them:
        all of them, unless the kind knows which are gone (each dead one costs a wait)."""
        return [a for name in self.meshes for a in (self.addrs or {}).get(name, [])]

    def _gone(self) -> str:
        """What says the allocation ended (for errors)."""
        return "its host agents exited"

    def _adopt(self, running: JobTrait) -> None:
        """Take over ``running``'s allocation (kind-specific fields; keys and addresses are done)."""

    # ---- the interface ----------------------------------------------------------------
    def apply(self, client_script: str | None = None) -> None:
        """Start the job's hosts (idempotent). ``client_script`` (Monarch's batch mode) is for jobs of a
        scheduler: see ``SlurmJob.apply``."""
        if self._monarch_style():
            if not self._monarch_running:
                self._create(client_script)
                self._monarch_running = True
            return
        if client_script is not None:
            raise TypeError(f"{type(self).__name__}.apply(client_script=...): running the script inside the job is "
                            f"for scheduler jobs (SlurmJob); run it here, it attaches with job.state()")
        if self.addrs is None:
            self.addrs = self._start()
            if not self.reusable:  # (unless a job file names it by then: see dumps())
                self._started_pid = os.getpid()
                atexit.register(self._kill_unrecorded)

    def _kill_unrecorded(self) -> None:
        """At the script's exit: kill this job, started here and named by no job file (nothing could reattach
        to its agents). Not in a forked child of the script (its exit is not the script's)."""
        if self.active and getattr(self, "_started_pid", None) == os.getpid():
            try:
                self.kill()
            except Exception as e:  # noqa: BLE001 - the interpreter is going: say why they may be left
                log.warning("stopping the job at exit: %r", e)

    def remote_mount(self, source: str, mntpoint: str | None = None, meshes: list[str] | None = None,
                     python_exe: str | None = ".venv/bin/python", **options) -> None:
        """Mirror the local directory ``source`` onto the hosts of ``meshes`` (default: all) at ``mntpoint``
        (default: the same path) each time ``state()`` connects; where ``source/python_exe`` exists, those
        meshes' procs run ``mntpoint/python_exe``. Monarch's; a copy here, not a FUSE mount (``mounts.py``)."""
        from . import mounts

        mount = mounts.check(self, source, mntpoint, meshes, python_exe, options)
        self._mounts = [*getattr(self, "_mounts", ()), mount]
        self._job_state = None  # the next state() applies it

    def can_run(self, spec: JobTrait) -> bool:
        """Whether this job, running, can serve ``spec`` (Monarch's): same kind, meshes and options."""
        return (type(spec) is type(self) and spec.meshes == self.meshes and spec._spec() == self._spec()
                and self._running())

    def state(self, cached_path: str | None = DEFAULT_STATE) -> JobState:
        """Connect to the job's agents; one ``HostMesh`` attribute per mesh. A job that is not applied yet and
        holds an allocation (``reusable``) first looks at ``cached_path`` (None: not at all) for a running
        job of the same spec to reattach to, and keeps its own file there once it runs."""
        if self._monarch_style():
            return self._monarch_state(cached_path)
        if self._job_state is None:
            reuse = self.reusable or getattr(self, "_reuse_cached", False)  # (load_current_job's: any kind)
            batch = setting(BATCH_JOB_ENV)
            if batch and self.addrs is None:  # a batch job's script (LocalJob.apply(client_script=...)): its job
                cached_path, reuse = batch, True
            if self.addrs is None and cached_path and reuse and self._adopt_cached(cached_path):
                try:
                    self._connect()
                except Exception as e:  # noqa: BLE001 - its agents are gone: start afresh
                    log.warning("the cached job at %s did not answer (%r): starting a new one", cached_path, e)
                    self._abandon()  # (what is left of it: agents, a LocalJob's directory)
            if self._job_state is None:
                fresh = self.addrs is None
                if not fresh and not self._running():  # (a job file's, whose allocation ended: its agents
                    # would each be waited for until the connect timeout, and the error blame the network)
                    raise HostUnreachableError(f"this {type(self).__name__}'s allocation no longer runs "
                                               f"({self._gone()}); kill() it and start it again")
                try:
                    self.apply()
                    self._connect()
                    if fresh and cached_path and reuse:
                        self.dump(cached_path)
                except BaseException:
                    if fresh:  # (started here, then unusable or unrecorded: an interrupt, an agent that did
                        self._abandon()  # not answer; nobody could find its agents to kill them)
                    raise
            if getattr(self, "_mounts", None):
                from . import mounts

                try:
                    mounts.apply(self, self._job_state)
                except BaseException:
                    self._job_state = None  # (the next state() tries again)
                    raise
        # Each state() is a handle of its own on the job's hosts, as Monarch's: its stop() stops what was
        # spawned through it.
        return JobState({name: mesh._another_handle() for name, mesh in self._job_state._meshes.items()})

    def _monarch_state(self, cached_path: str | None) -> JobState:
        """``state()`` of a job written the Monarch way: a running job's ``_state()``; else the job at
        ``cached_path`` if it ``can_run`` this one (one that cannot is killed and its file removed), else
        ``apply()`` and keep this job's file there."""
        if self._monarch_running:
            return self._checked_state(self)
        if cached_path and os.path.exists(cached_path):
            try:
                cached = job_load(cached_path)
            except (ValueError, OSError, JobKeyError) as e:
                log.warning("ignoring the job file at %s: %s", cached_path, e)
                cached = None
            if cached is not None and cached.active:
                if cached.can_run(self):
                    return self._checked_state(cached)
                try:
                    cached.kill()
                except Exception as e:  # noqa: BLE001 - best effort: this job starts all the same
                    log.warning("cancelling the cached job: %r", e)
            try:
                os.remove(os.path.realpath(cached_path))
            except FileNotFoundError:
                pass
        self.apply()
        state = self._checked_state(self)
        if cached_path:
            self.dump(cached_path)
        return state

    @staticmethod
    def _checked_state(job: JobTrait) -> JobState:
        state = job._state()
        if not isinstance(state, JobState):
            raise TypeError(f"{type(job).__name__}._state() must return a JobState({{name: host mesh}}), got "
                            f"{state!r}")
        return state

    def __getstate__(self):
        state = dict(self.__dict__)
        if self._monarch_style():  # (a pickled job file: what only this process holds stays here)
            state["_job_state"], state["_agents"] = None, {}
        return state

    def _connect(self) -> None:
        assert self.addrs is not None
        flat = [a for name in self.meshes for a in self.addrs[name]]
        agents = connect_agents(flat, self.keys)
        it = iter(agents)
        self._agents = {name: [next(it) for _ in self.addrs[name]] for name in self.meshes}
        self._job_state = JobState({name: RemoteHostMesh(a) for name, a in self._agents.items()})

    def _abandon(self) -> None:
        """Kill a job that ``state()`` started and could not hand over, and forget it: the job is as before
        ``apply()`` (a later ``state()`` starts it again; ``kill()`` has nothing to do)."""
        if self.addrs is not None:
            try:
                self.kill()
            except Exception as e:  # noqa: BLE001 - best effort: what failed is the error to report
                log.warning("stopping the job that did not start: %r", e)
        self.addrs, self._agents, self._job_state, self._killed = None, {}, None, False

    def _adopt_cached(self, path: str) -> bool:
        """Reattach to the running job of this spec at ``path``; cancel one of another spec found there."""
        if not os.path.exists(path):
            return False
        try:
            cached = job_load(path)
        except (ValueError, OSError, JobKeyError) as e:
            log.warning("ignoring the job file at %s: %s", path, e)
            return False
        if cached.can_run(self):
            self.keys, self.addrs = cached.keys, cached.addrs
            self._adopt(cached)
            log.info("reattached to the running job of %s", path)
            return True
        if cached.active:  # another spec, or one that no longer runs (all of it): what is left of it goes
            if cached._running():
                log.warning("the job at %s runs another spec than this one: cancelling it", path)
            else:
                log.info("the job at %s no longer runs: cleaning up after it", path)
            try:
                cached.kill()
            except Exception as e:  # noqa: BLE001 - best effort: the new job starts all the same
                log.warning("cancelling the cached job: %r", e)
        try:
            os.remove(os.path.realpath(path))
        except FileNotFoundError:
            pass
        return False

    def kill(self) -> None:
        """Stop every agent (and its procs) and release the allocation."""
        if self._monarch_style():
            if self._monarch_running:
                self._kill()
            self._monarch_running = False
            return
        agents = [a for lst in self._agents.values() for a in lst]
        connected = []
        if not agents and self.addrs is not None:
            # Each agent that still answers, in parallel and briefly: connecting the job (state()) waited 30 s
            # for a dead one, and then shut down none of them.
            agents = connected = reachable_agents(self._live_addrs(), self.keys)
        atexit.unregister(self._kill_unrecorded)
        shutdown_agents(agents, "job killed")
        for a in connected:  # (not watched: nothing else closes them)
            a.close()
        self._release()
        self._job_state = None
        self._killed = True

    @property
    def active(self) -> bool:
        """Whether the job's hosts were started (``apply()``, or a job file's) and not killed since."""
        if self._monarch_style():
            return self._monarch_running
        return self.addrs is not None and not getattr(self, "_killed", False)

    def dumps(self) -> bytes:
        """The job file's contents (Monarch's ``dumps``; ``job_loads`` reattaches). It holds the job's secret
        key: keep it as private as the file. A job written the Monarch way is pickled into it."""
        if self._monarch_style():
            data = {"kind": "pickled", "pickle": base64.b64encode(pickle.dumps(self)).decode()}
            return json.dumps(data).encode()
        self.apply()
        data = {"kind": self.kind, "meshes": self.meshes, "addrs": self.addrs,
                "keys": {"public": self.keys.public, "secret": self.keys.secret}, **self._extra()}
        atexit.unregister(self._kill_unrecorded)  # (its agents outlive the script: the file reattaches)
        return json.dumps(data, indent=1).encode()

    def dump(self, filename: str) -> None:
        """Write the job file (0600: it holds the job's secret key); a symlink there is followed, and a
        missing parent directory made."""
        path = os.path.realpath(filename) if os.path.islink(filename) else filename
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        _curve.write_private(path, self.dumps().decode())


def job_load(filename: str = DEFAULT_STATE) -> JobTrait:
    """Reattach to a job from its job file: ``job_load("job.json").state().mesh0``."""
    return _job_from_text(_curve.read_private(filename), filename)


def job_loads(data: bytes | str) -> JobTrait:
    """Reattach to a job from ``job.dumps()`` (Monarch's ``job_loads``)."""
    if not isinstance(data, (bytes, str)):
        raise TypeError(f"job_loads() takes what job.dumps() returned (bytes), got {type(data).__name__}")
    what = "the data given to job_loads()"
    if isinstance(data, bytes):
        try:
            data = data.decode()
        except UnicodeDecodeError as e:
            raise ValueError(f"{what} is not a monarch-tensor job file (not UTF-8 text: {e})") from None
    return _job_from_text(data, what)


def _job_from_text(text: str, path: str) -> JobTrait:
    try:
        data = json.loads(text)
    except ValueError as e:
        raise ValueError(f"{path} is not a monarch-tensor job file (not JSON: {e})") from None
    from .hosts import HostListJob
    from .local import LocalJob
    from .slurm import SlurmJob

    if isinstance(data, dict) and data.get("kind") == "pickled":  # a job written the Monarch way
        try:
            job = pickle.loads(base64.b64decode(data["pickle"]))
        except Exception as e:  # noqa: BLE001 - a class that no longer imports, a damaged file
            raise ValueError(f"{path} holds a pickled job that does not load here: {e!r}") from None
        if not isinstance(job, JobTrait):
            raise ValueError(f"{path} holds a pickled {type(job).__name__}, not a job")
        return job
    kinds = {c.kind: c for c in (LocalJob, SlurmJob, HostListJob)}
    cls = kinds.get(data.get("kind")) if isinstance(data, dict) else None
    if cls is None:
        kind = data.get("kind") if isinstance(data, dict) else None
        raise ValueError(f"{path} is not a monarch-tensor job file (kind {kind!r})")
    job = cls.__new__(cls)
    try:
        JobTrait.__init__(job, data["meshes"])
        job.keys = _curve.JobKeys(data["keys"]["public"], data["keys"]["secret"]).checked()
        job.addrs = {k: list(v) for k, v in data["addrs"].items()}
        job._restore(data)
    except (KeyError, TypeError, AttributeError) as e:
        raise ValueError(f"{path} is a damaged {cls.kind} job file: {type(e).__name__}: {e}") from None
    return job


def agent_command(python_exe: str, bind: str, address_file: str, ttl: float, key_file: str | None = None) -> list[str]:
    cmd = [python_exe, "-m", "monarch_tensor.cli", "host", "--bind", bind, "--address-file", address_file,
           "--ttl", str(ttl)]
    if key_file:
        cmd += ["--key-file", key_file]
    return cmd


def read_address(path: str) -> str | None:
    try:
        with open(path) as f:
            text = f.read().strip()
    except OSError:
        return None
    return text or None


def log_tail(path: str, n: int = 15) -> str:
    """The last ``n`` lines of a log; before them, the host agents' own error lines that they would leave out
    (a scheduler may write many lines of its own after them)."""
    try:
        with open(path, errors="replace") as f:
            lines = f.readlines()
    except OSError:
        return "(no log)"
    tail = lines[-n:]
    ours = [ln for ln in lines[:-n] if ln.startswith("monarch-tensor host:")][-5:]
    return "".join([*ours, *(["...\n"] if ours else []), *tail])


def private_dir(path: str) -> str:
    os.makedirs(path, mode=0o700, exist_ok=True)
    os.chmod(path, 0o700)
    return path
