"""``SlurmJob``: one sbatch allocation whose nodes each run a host agent (started by srun).

The job's key pair travels to the agents in the environment sbatch exports
(never on a command line); the agents write their addresses to ``log_dir``
(which must be shared by the nodes, as a cluster's home or scratch is).
``state()`` waits for every agent, ``kill()`` cancels the allocation.
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time

from ..errors import JobStartError
from ..hosts.local import python_path
from ._base import DEFAULT_STATE, JobTrait, agent_command, log_tail, private_dir, read_address

START_TIMEOUT = 120.0  # (the job_start_timeout setting, where set, replaces it)


def _start_timeout() -> float:
    from .. import config

    return config.get("job_start_timeout") or START_TIMEOUT


def slurm_available() -> str:
    """'' when sbatch/squeue/scancel are on PATH and a controller answers, else why not."""
    for tool in ("sbatch", "squeue", "scancel"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed"
    try:
        r = subprocess.run(["squeue", "-h", "-o", "%i"], capture_output=True, text=True, timeout=10)
    except subprocess.TimeoutExpired:
        return "squeue did not answer within 10 s"
    return "" if r.returncode == 0 else f"no SLURM controller answers: {r.stderr.strip()}"


class SlurmJob(JobTrait):
    """A SLURM allocation with one host agent per node.

    >>> job = SlurmJob(meshes={"mesh0": 2}, job_name="train", time_limit="00:30:00", partition="debug")
    >>> hosts = job.state().mesh0           # submits if needed, waits for both agents
    >>> job.kill()                          # scancel; the allocation is gone
    """

    kind = "slurm"
    reusable = True  # state() reattaches to the running allocation its cached_path names (see _base.py)
    _SPEC = {"job_name": "monarch_tensor", "time_limit": None, "partition": None, "gpus_per_node": None,
             "cpus_per_task": None, "mem": None, "slurm_args": [], "exclusive": True, "account": None, "qos": None,
             "bind": "tcp://0.0.0.0:0"}  # the options a running allocation must share to serve a job (defaults)

    def __init__(self, meshes: dict[str, int], *, job_name: str = "monarch_tensor", time_limit: str | None = None,
                 partition: str | None = None, gpus_per_node: int | None = None, cpus_per_task: int | None = None,
                 mem: str | None = None, python_exe: str | None = None, slurm_args: tuple | list = (),
                 log_dir: str | None = None, ttl: float = 3600.0, start_timeout: float | None = None,
                 bind: str = "tcp://0.0.0.0:0", exclusive: bool = True, account: str | None = None,
                 qos: str | None = None, job_start_timeout: float | None = None, monarch_port: int | None = None,
                 ntasks_per_node: int = 1) -> None:
        """Monarch's options keep their meaning: ``exclusive`` (whole nodes, the default), ``account`` and
        ``qos`` (sbatch's), ``job_start_timeout`` (seconds until the agents serve, queueing included; here
        ``start_timeout`` when None: a job never waits without end), ``monarch_port`` (the agents' port;
        default: any free one). One agent runs per node: ``ntasks_per_node`` is 1, and several procs per
        node come from ``spawn_procs(per_host=...)``."""
        super().__init__(meshes)
        if ntasks_per_node != 1:
            raise ValueError(f"SlurmJob(ntasks_per_node={ntasks_per_node!r}): one host agent runs per node here; "
                             f"start several procs on each with spawn_procs(per_host={{'gpus': N}})")
        if job_start_timeout is not None:
            start_timeout = job_start_timeout
        elif start_timeout is None:
            start_timeout = _start_timeout()
        if not (isinstance(start_timeout, (int, float)) and start_timeout > 0):
            raise ValueError(f"SlurmJob: the start timeout must be a positive number of seconds, got "
                             f"{start_timeout!r}")
        if monarch_port is not None:
            if not (isinstance(monarch_port, int) and 0 < monarch_port < 65536):
                raise ValueError(f"SlurmJob(monarch_port={monarch_port!r}): a TCP port is 1-65535")
            bind = f"tcp://0.0.0.0:{monarch_port}"
        if not (isinstance(job_name, str) and job_name and "/" not in job_name and "\n" not in job_name):
            raise ValueError(f"SlurmJob(job_name={job_name!r}): a job name is a non-empty string without '/' or "
                             f"line breaks (it names the job's files)")
        self.job_name, self.time_limit, self.partition = job_name, time_limit, partition
        self.gpus_per_node, self.cpus_per_task, self.mem = gpus_per_node, cpus_per_task, mem
        self.exclusive, self.account, self.qos = bool(exclusive), account, qos
        self.python_exe = python_exe or sys.executable
        if not isinstance(slurm_args, (list, tuple)) or not all(isinstance(a, str) for a in slurm_args):
            # (a str would be split into one "#SBATCH" line per character)
            raise TypeError(f"SlurmJob(slurm_args=...) takes a list of strings, e.g. ['--constraint=h100'], "
                            f"got {slurm_args!r}")
        self.slurm_args = list(slurm_args)
        self.log_dir = os.path.abspath(log_dir or os.path.join(os.getcwd(), ".monarch-tensor", "slurm"))
        self.ttl, self.start_timeout, self.bind = ttl, start_timeout, bind
        self.job_id: str | None = None

    def apply(self, client_script: str | None = None) -> None:
        """Start the job's hosts (idempotent). With ``client_script`` (Monarch's batch mode), submit the job
        so that it runs that script as its controller inside the allocation, once the agents serve, and
        return at once: the script's ``job.state()`` of the same spec (its default ``cached_path``, in the
        directory submitted from) reattaches to this allocation, which ends when the script does. Its
        output goes to ``log_dir``."""
        if client_script is None:
            super().apply()
            return
        if self.addrs is not None or self.job_id is not None:
            raise RuntimeError(f"SlurmJob {self.job_name!r} was already applied (SLURM job {self.job_id}); a "
                               f"batch job is a new one")
        path = os.path.abspath(client_script)
        if not os.path.isfile(path):
            raise FileNotFoundError(f"apply(client_script={client_script!r}): no such file")
        self._submit(sum(self.meshes.values()), client_script=path)

    def _script(self, nodes: int, client_script: str | None = None) -> str:
        opts = [f"--job-name={self.job_name}", f"--nodes={nodes}", "--ntasks-per-node=1",
                f"--output={self.log_dir}/%x-%j.out"]
        if self.time_limit:
            opts.append(f"--time={self.time_limit}")
        if self.partition:
            opts.append(f"--partition={self.partition}")
        if self.exclusive:
            opts.append("--exclusive")
        if self.account:
            opts.append(f"--account={self.account}")
        if self.qos:
            opts.append(f"--qos={self.qos}")
        if self.gpus_per_node:
            opts.append(f"--gpus-per-node={self.gpus_per_node}")
        if self.cpus_per_task:
            opts.append(f"--cpus-per-task={self.cpus_per_task}")
        if self.mem:
            opts.append(f"--mem={self.mem}")
        opts += self.slurm_args
        # (in double quotes: a log dir with spaces; the shell in the job expands the variables)
        addr = '"' + _dq(self.log_dir) + '/agent-$SLURM_JOB_ID-$SLURM_PROCID.addr"'
        cmd = " ".join(shlex.quote(c) for c in agent_command(self.python_exe, self.bind, "ADDR", self.ttl))
        cmd = cmd.replace("ADDR", addr)
        # (--kill-on-bad-exit: an agent that fails to start, its port taken say, ends the job, which the
        # client then reports with the job's output, rather than wait for it until its start timeout)
        srun = f"srun --ntasks-per-node=1 --kill-on-bad-exit=1 bash -c {shlex.quote('exec ' + cmd)}"
        n_ours = len(opts) - len(self.slurm_args)  # (the user's own slurm_args go as they were written)
        lines = ["#!/bin/bash", *(f"#SBATCH {_directive(o) if i < n_ours else o}" for i, o in enumerate(opts)),
                 "set -e", f"cd {shlex.quote(os.getcwd())}"]
        if client_script is None:
            lines.append(srun)
        else:  # the agents in the background; once they serve, the job file for the script, then the script
            spec = json.dumps({"meshes": self.meshes, "spec": self._spec(), "log_dir": self.log_dir,
                               "timeout": self.start_timeout, "path": os.path.abspath(DEFAULT_STATE)})
            py = shlex.quote(self.python_exe)
            lines += [f"{srun} &",
                      f"{py} -c 'import sys; from monarch_tensor.job.slurm import write_batch_state; "
                      f"write_batch_state(sys.argv[1])' {shlex.quote(spec)}",
                      f"{py} {shlex.quote(client_script)}"]
        return "\n".join(lines) + "\n"

    def _start(self) -> dict[str, list[str]]:
        nodes = sum(self.meshes.values())
        with _termination_raises():  # (a script killed while it waits cancels the allocation it asked for)
            self._submit(nodes)
            try:
                addrs = self._wait_agents(nodes)
            except BaseException:
                self._release()
                raise
        it = iter(addrs)
        return {name: [next(it) for _ in range(n)] for name, n in self.meshes.items()}

    def _submit(self, nodes: int, client_script: str | None = None) -> None:
        private_dir(self.log_dir)
        script = os.path.join(self.log_dir, f"{self.job_name}.sbatch")
        with open(script, "w") as f:
            f.write(self._script(nodes, client_script))
        env = dict(os.environ)
        env.update(self.keys.to_env())  # handed to the agents through the scheduler's environment
        env["PYTHONPATH"] = python_path()
        try:
            r = subprocess.run(["sbatch", "--parsable", script], capture_output=True, text=True, env=env, timeout=60)
        except FileNotFoundError as e:
            raise JobStartError("sbatch is not installed: SLURM jobs need a SLURM cluster") from e
        except subprocess.TimeoutExpired as e:
            raise JobStartError("sbatch did not answer within 60 s") from e
        if r.returncode != 0:
            raise JobStartError(f"sbatch refused the job: {r.stderr.strip() or r.stdout.strip()}")
        self.job_id = r.stdout.strip().split(";")[0]

    def _wait_agents(self, nodes: int) -> list[str]:
        deadline = time.monotonic() + self.start_timeout
        files = [f"{self.log_dir}/agent-{self.job_id}-{i}.addr" for i in range(nodes)]
        out = f"{self.log_dir}/{self.job_name}-{self.job_id}.out"
        last_check = 0.0
        while True:
            addrs = [read_address(f) for f in files]
            if all(addrs):
                return addrs  # type: ignore[return-value]
            now = time.monotonic()
            if now - last_check > 1.0:
                last_check = now
                st, reason = self.squeue_state()
                if st is None or st in ("FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "COMPLETED", "BOOT_FAIL"):
                    raise JobStartError(f"SLURM job {self.job_id} ended ({st or 'gone from the queue'}) before its "
                                        f"agents served; its output ({out}):\n{log_tail(out)}")
            if now > deadline:
                st, reason = self.squeue_state()
                tail = log_tail(out) if os.path.exists(out) else ""
                raise JobStartError(f"SLURM job {self.job_id} did not start its {nodes} agents within "
                                    f"{self.start_timeout:.0f} s (state {st}, reason {reason}); it was cancelled"
                                    + (f"; its output ({out}):\n{tail}" if tail.strip() else ""))
            time.sleep(0.1)

    def squeue_state(self) -> tuple[str | None, str]:
        """(state, reason) of the job in squeue, or (None, '') once it left the queue."""
        r = subprocess.run(["squeue", "-h", "-j", str(self.job_id), "-o", "%T|%r"], capture_output=True, text=True,
                           timeout=30)
        line = r.stdout.strip()
        if r.returncode != 0 or not line:
            return None, ""
        st, _, reason = line.partition("|")
        return st, reason

    def _release(self) -> None:
        if not self.job_id:
            return
        subprocess.run(["scancel", str(self.job_id)], capture_output=True, timeout=30)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and self.squeue_state()[0] not in (None, "COMPLETED", "CANCELLED"):
            time.sleep(0.2)

    def _extra(self) -> dict:
        return {"job_id": self.job_id, "log_dir": self.log_dir, "spec": self._spec()}

    def _restore(self, data: dict) -> None:
        self.job_id, self.log_dir = data.get("job_id"), data.get("log_dir")
        self.python_exe, self.ttl, self.start_timeout = sys.executable, 3600.0, _start_timeout()
        spec = data.get("spec") or {}
        for name, default in self._SPEC.items():
            setattr(self, name, spec.get(name, default))

    def _spec(self) -> dict:
        return {name: list(v) if isinstance(v := getattr(self, name, default), tuple) else v
                for name, default in self._SPEC.items()}

    def _running(self) -> bool:
        return bool(self.job_id) and self.squeue_state()[0] == "RUNNING"

    def _live_addrs(self) -> list[str]:
        return super()._live_addrs() if self._running() else []  # (an ended allocation's agents are gone)

    def _gone(self) -> str:
        st, reason = self.squeue_state() if self.job_id else (None, "")
        return f"SLURM job {self.job_id}: {st or 'ended, gone from the queue'}{f' ({reason})' if reason else ''}"

    def _adopt(self, running: JobTrait) -> None:
        self.job_id, self.log_dir = running.job_id, running.log_dir


def write_batch_state(args: str) -> None:
    """In a batch job's script (``apply(client_script=...)``): wait for the agents, then write the job file
    that the client script's ``job.state()`` reattaches from. The key comes from the job's environment."""
    from ..transport import _curve

    a = json.loads(args)
    job = SlurmJob.__new__(SlurmJob)
    JobTrait.__init__(job, a["meshes"])
    keys = _curve.JobKeys.from_env()
    if keys is None:
        raise SystemExit("write_batch_state: the job's key is not in the environment")
    job.keys = keys
    job._restore({"job_id": os.environ["SLURM_JOB_ID"], "log_dir": a["log_dir"], "spec": a["spec"]})
    job.start_timeout = a["timeout"]
    nodes = sum(job.meshes.values())
    addrs = job._wait_agents(nodes)
    it = iter(addrs)
    job.addrs = {name: [next(it) for _ in range(n)] for name, n in job.meshes.items()}
    job.dump(a["path"])


def _dq(s: str) -> str:
    """``s`` for the inside of a shell's double quotes."""
    return "".join("\\" + c if c in '\\"$`' else c for c in s)


def _directive(opt: str) -> str:
    """An ``#SBATCH`` option whose value has spaces or quotes, in double quotes (sbatch reads them so: a working
    directory or a job name with a space was refused as "Invalid directive")."""
    key, eq, value = opt.partition("=")
    if not eq or not any(c in value for c in ' \t"\''):
        return opt
    return key + '="' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'


@contextlib.contextmanager
def _termination_raises():
    """SIGTERM and SIGHUP raise ``SystemExit`` in the main thread while this holds, where they would end the
    process at once (their default): a script terminated (``timeout``, ``kill``, a closed terminal) while it
    waits for its allocation then cancels it, instead of leaving it queued or running with nobody to use it."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    old = {}

    def terminate(signum, frame):
        raise SystemExit(128 + signum)

    for sig in (signal.SIGTERM, signal.SIGHUP):
        if signal.getsignal(sig) == signal.SIG_DFL:
            old[sig] = signal.signal(sig, terminate)
    try:
        yield
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)
