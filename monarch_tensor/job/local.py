"""``LocalJob``: N host agents on this machine acting as N hosts (tests, laptops).

Each agent is its own process, started in a new session so it outlives the
controller (reattach with ``job_load``; a job no job file names is killed when
the script exits: see ``_base.py``), in its own working directory
``<root>/<mesh>-<i>/`` so that file sync between "hosts" is real.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

from ..errors import JobStartError
from ..hosts.bootstrap import check_env
from ..hosts.local import python_path
from ._base import BATCH_JOB_ENV, DEFAULT_STATE, JobTrait, agent_command, log_tail, private_dir, read_address

START_TIMEOUT = 60.0  # (the job_start_timeout setting, where set, replaces it)


def _start_timeout() -> float:
    from .. import config

    return config.get("job_start_timeout") or START_TIMEOUT


class LocalJob(JobTrait):
    """Host agents as local processes: ``LocalJob(meshes={"mesh0": 2}).state().mesh0``.

    >>> job = LocalJob(meshes={"trainers": 2}, ttl=600)
    >>> hosts = job.state().trainers
    >>> hosts.workdirs                       # one working directory per "host"
    ['/tmp/monarch-tensor-job-x/trainers-0', '/tmp/monarch-tensor-job-x/trainers-1']
    >>> job.kill()

    Each agent's ``$WORKSPACE_DIR`` (the root that ``sync_workspace`` writes its procs' files to) is
    ``workspace`` in its working directory, unless the script's environment sets one.
    """

    kind = "local"

    def __init__(self, meshes: dict[str, int] | None = None, env: dict[str, str] | None = None, *,
                 hosts=None, root_dir: str | None = None, ttl: float = 600.0, python_exe: str | None = None,
                 start_timeout: float | None = None) -> None:
        """``meshes`` maps names to host counts; Monarch's ``LocalJob(hosts=["trainers", "gen"])`` (names of
        one-host meshes, also as the first argument) works too. ``env`` (``ProcessJob``'s) is added to the
        agents' environment, so to their procs'."""
        if hosts is not None:
            if meshes is not None:
                raise TypeError("LocalJob takes meshes={name: hosts} or hosts=[names], not both")
            if not (isinstance(hosts, (list, tuple)) and hosts and all(isinstance(n, str) for n in hosts)):
                raise ValueError(f"LocalJob(hosts=...) takes names of host meshes, such as ['trainers'], "
                                 f"got {hosts!r}")
            meshes = hosts
        if isinstance(meshes, (list, tuple)) and meshes and all(isinstance(n, str) for n in meshes):
            meshes = {name: 1 for name in meshes}
        check_env(env, "LocalJob(env=...)")  # here, not when state() starts the agents and subprocess refuses it
        super().__init__(meshes or {"hosts": 1})
        self.env = dict(env or {})
        self.root_dir = root_dir
        start_timeout = _start_timeout() if start_timeout is None else start_timeout
        self.ttl, self.python_exe, self.start_timeout = ttl, python_exe or sys.executable, start_timeout
        self.pids: list[int] = []
        self.starts: dict[int, int] = {}  # pid -> its start time (_start_time): the agent, not a pid reused since

    def apply(self, client_script: str | None = None) -> None:
        """Start the agents (idempotent). With ``client_script`` (Monarch's batch mode), also run that script as
        the job's controller, in the background in a session of its own (``job.process`` is its ``Popen``; its
        output goes to ``job.log_dir``'s ``stdout.log`` and ``stderr.log``): the job file is written to
        ``.monarch/job_state.json`` and the script's own ``job.state()`` of the same spec reattaches to these
        agents. The job lasts until it is killed (``job.kill()``, in the script or here, or ``monarch-tensor
        kill``) or its agents' ``ttl`` ends."""
        if client_script is None:
            super().apply()
            return
        path = os.path.abspath(client_script)
        if not os.path.isfile(path):
            raise FileNotFoundError(f"apply(client_script={client_script!r}): no such file")
        super().apply()
        state_file = os.path.abspath(DEFAULT_STATE)
        self.dump(state_file)
        os.makedirs(os.path.join(".monarch", "logs"), exist_ok=True)
        self.log_dir = tempfile.mkdtemp(prefix="job_", dir=os.path.join(".monarch", "logs"))
        env = dict(os.environ, **{BATCH_JOB_ENV: state_file})
        with open(os.path.join(self.log_dir, "stdout.log"), "wb") as out, \
                open(os.path.join(self.log_dir, "stderr.log"), "wb") as err:
            self._proc = subprocess.Popen([sys.executable, path], env=env, stdout=out, stderr=err,
                                          stdin=subprocess.DEVNULL, start_new_session=True)

    @property
    def process(self) -> subprocess.Popen:
        """The batch script ``apply(client_script=...)`` started (Monarch's)."""
        proc = getattr(self, "_proc", None)
        if proc is None:
            raise ValueError("no local batch job: apply(client_script=...) starts one")
        return proc

    def __getstate__(self):
        state = super().__getstate__()
        state.pop("_proc", None)  # (a Popen is this process's)
        return state

    def _start(self) -> dict[str, list[str]]:
        if not self.root_dir:
            self.made_root = True  # kill() removes it
        root = private_dir(self.root_dir or tempfile.mkdtemp(prefix="monarch-tensor-job-"))
        self.root_dir = root
        key_file = os.path.join(root, "job.key")
        self.keys.save(key_file)
        env = dict(os.environ)
        env["PYTHONPATH"] = python_path()
        env.update(getattr(self, "env", {}))
        started = []
        for name, n in self.meshes.items():
            for i in range(n):
                workdir = os.path.join(root, f"{name}-{i}")
                os.makedirs(workdir, exist_ok=True)
                addr_file = os.path.join(root, f"{name}-{i}.addr")
                try:  # (one of an earlier start in this directory would be read as this agent's)
                    os.remove(addr_file)
                except FileNotFoundError:
                    pass
                log = os.path.join(root, f"{name}-{i}.log")
                # Each "host" has a workspace root of its own (Monarch's variable; the script's wins if it has one).
                agent_env = env if "WORKSPACE_DIR" in env else {**env, "WORKSPACE_DIR": os.path.join(workdir, "workspace")}
                with open(log, "ab") as out:
                    p = subprocess.Popen(agent_command(self.python_exe, "tcp://127.0.0.1:0", addr_file, self.ttl,
                                                       key_file), cwd=workdir, env=agent_env, stdout=out, stderr=out,
                                         stdin=subprocess.DEVNULL, start_new_session=True)
                self.pids.append(p.pid)
                start = _start_time(p.pid)
                if start is not None:
                    self.starts[p.pid] = start
                started.append((name, p, addr_file, log))
        addrs: dict[str, list[str]] = {name: [] for name in self.meshes}
        deadline = time.monotonic() + self.start_timeout
        try:
            for name, p, addr_file, log in started:
                while (a := read_address(addr_file)) is None:
                    if p.poll() is not None:
                        raise JobStartError(f"host agent {name} exited with code {p.returncode} before serving; "
                                            f"its log ({log}):\n{log_tail(log)}")
                    if time.monotonic() > deadline:
                        raise JobStartError(f"host agent {name} did not start within {self.start_timeout:.0f} s; "
                                            f"its log ({log}):\n{log_tail(log)}")
                    time.sleep(0.02)
                addrs[name].append(a)
        except BaseException as e:
            # Interrupted too (Ctrl-C): the agents are not recorded anywhere yet, and would run until their ttl.
            for _, p, _, _ in started:
                p.terminate()  # (an agent exits on SIGTERM as on a shutdown)
            self._release()
            if not isinstance(e, JobStartError):  # (a failed start keeps its logs: the error names one)
                self._remove_root()
            raise
        return addrs

    def _release(self) -> None:
        """Wait for the agents to exit (5 s), then kill those left: only processes that are this job's agents
        (their start time as recorded), never another process that got a dead agent's pid since. The job
        then has no agents: a new start records its own."""
        deadline = time.monotonic() + 5
        for pid in self.pids:
            while self._agent_alive(pid) and time.monotonic() < deadline:
                time.sleep(0.02)
            if self._agent_alive(pid):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        for pid in self.pids:
            try:
                os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:
                pass
        self.pids, self.starts = [], {}

    def kill(self) -> None:
        """Stop the agents; then remove the job's directory when it made one (its key, logs and workspaces:
        ``root_dir=`` given, only the key file goes)."""
        super().kill()
        self._remove_root()

    def _remove_root(self) -> None:
        root = self.root_dir
        if not root:
            return
        if getattr(self, "made_root", False):
            shutil.rmtree(root, ignore_errors=True)
            self.root_dir = None
        else:
            try:
                os.remove(os.path.join(root, "job.key"))
            except FileNotFoundError:
                pass

    def _agent_alive(self, pid: int) -> bool:
        return _alive(pid) and (pid not in self.starts or _start_time(pid) == self.starts[pid])

    def _extra(self) -> dict:
        return {"pids": self.pids, "starts": {str(p): t for p, t in self.starts.items()}, "root_dir": self.root_dir,
                "made_root": getattr(self, "made_root", False), "env": self.env}

    def _spec(self) -> dict:
        return {"env": self.env}

    def _running(self) -> bool:
        """Whether every agent runs: one that died cannot serve its host (connecting would wait for it)."""
        return self.active and bool(self.pids) and all(self._agent_alive(pid) for pid in self.pids)

    def _gone(self) -> str:
        dead = [pid for pid in self.pids if not self._agent_alive(pid)]
        if not dead or len(dead) == len(self.pids):
            return "its host agents exited"
        return f"its host agent(s) {dead} of {len(self.pids)} exited"

    def _live_addrs(self) -> list[str]:
        addrs = super()._live_addrs()
        if len(addrs) != len(self.pids):  # (started in mesh order, as the addresses are)
            return addrs
        return [a for a, pid in zip(addrs, self.pids) if self._agent_alive(pid)]

    def _adopt(self, running: JobTrait) -> None:
        self.pids, self.root_dir = list(running.pids), running.root_dir
        self.made_root = getattr(running, "made_root", False)
        self.starts = dict(getattr(running, "starts", {}))

    def _restore(self, data: dict) -> None:
        self.pids, self.root_dir = list(data.get("pids", [])), data.get("root_dir")
        self.made_root = bool(data.get("made_root"))
        self.starts = {int(p): t for p, t in (data.get("starts") or {}).items()}
        self.env = dict(data.get("env") or {})
        self.ttl, self.python_exe, self.start_timeout = 600.0, sys.executable, _start_timeout()


def _start_time(pid: int) -> int | None:
    """When process ``pid`` started (clock ticks after boot, /proc/<pid>/stat), or None."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rpartition(")")[2].split()[19])
    except (OSError, IndexError, ValueError):
        return None


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs: reaped here if it is our child, and not a zombie waiting for another parent (an
    agent whose starter exited belongs to init, which may be slow to reap it, or never do so in a container)."""
    try:
        done, _ = os.waitpid(pid, os.WNOHANG)
        if done:
            return False
    except ChildProcessError:
        pass
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] != "Z"
    except (OSError, IndexError):
        return True


ProcessJob = LocalJob
