"""``exec_command``: run a command on a host mesh's procs, as ``monarch-tensor exec`` does (Monarch 0.7's).

>>> from monarch_tensor.job import exec_command, load_current_job
>>> hosts = load_current_job().state().trainers
>>> exec_command(hosts, ["python", "train.py", "--steps", "10"], rank=0).get()   # streams its output here
0

Each targeted proc runs the command as a child process (in a process group of
its own, ended with the proc however the proc ends: a small watchdog process
ends the group when the proc dies outright), with ``MONARCH_RANK_<DIM>`` and
``MONARCH_SIZE_<DIM>`` set for every dimension of the proc's rank (and for the
host dims that ``rank`` or ``point`` picked one host along, which Monarch leaves
out), ``env`` added, the procs' interpreter's directory first on ``PATH``, in
``workdir`` or else in the client's working directory where the host has it. A
command whose first word ends in ``.py``, or ``-m MODULE``, runs with the procs'
Python. Its output streams back to the client as it comes (labelled by rank when
several ranks stream), or goes to ``stdout.txt``/``stderr.txt`` in
``output_dir`` on each host (``$SUBDIR`` in it becomes the rank's coordinates,
``hosts_0_gpus_1``). The Future holds the largest exit status (a signal's as
128 + its number).

(Monarch runs a ``.py`` command inside its worker process with ``exec``; here it
is a child of the proc, so it cannot touch the proc's state, and its output
streams while it runs instead of arriving at the end.)
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import ctypes
import os
import shlex
import signal
import subprocess
import sys
import threading
import time
from typing import Any

from ..actor import Actor, Channel, endpoint
from ..future import Future
from ..hosts import bootstrap as _bootstrap
from ..runtime._context import current as _own  # the running actor (its rank and sizes in the mesh spawned)

CHUNK = 64 << 10
STOP_TIMEOUT = 30.0


def rank_env(fixed: dict[str, tuple[int, int]] | None = None) -> dict[str, str]:
    """``MONARCH_RANK_<DIM>`` and ``MONARCH_SIZE_<DIM>`` of the running actor's rank (Monarch's variables),
    after those of ``fixed`` (``{dim: (coordinate, size)}``: the dims the host mesh was sliced on)."""
    fixed = fixed or {}
    return {**{f"MONARCH_RANK_{k}": str(c) for k, (c, _) in fixed.items()},
            **{f"MONARCH_SIZE_{k}": str(n) for k, (_, n) in fixed.items()},
            **{f"MONARCH_RANK_{k}": str(v) for k, v in dict(_own().rank).items()},
            **{f"MONARCH_SIZE_{k}": str(v) for k, v in _own().sizes.items()}}


def rank_label(fixed: dict[str, tuple[int, int]] | None = None) -> str:
    """``hosts_0_gpus_1``: the running actor's coordinates, ``fixed``'s first (``rank_0`` without any)."""
    point = {**{k: c for k, (c, _) in (fixed or {}).items()}, **dict(_own().rank)}
    return "_".join(f"{k}_{v}" for k, v in point.items()) or f"rank_{_own().rank.rank}"


def sliced_coords(host_mesh, rank: int | None = None, point: dict[str, int] | None = None) -> dict:
    """``{dim: (coordinate, size)}`` of the host mesh's dims that ``rank`` (a flat index) or ``point`` picks
    one host along: the slice drops them, and the procs are told them all the same."""
    sizes = dict(host_mesh.sizes)
    if rank is not None:
        return {k: (v, sizes[k]) for k, v in dict(host_mesh._shape.point(rank)).items()}
    return {k: (v % sizes[k], sizes[k]) for k, v in (point or {}).items() if k in sizes}


def returncode(code: int) -> int:
    """A child's exit status as a shell reports it: killed by signal N is 128 + N."""
    return code if code >= 0 else min(128 - code, 255)


def command_line(cmd: list[str], python: str = sys.executable) -> list[str]:
    """What runs for ``cmd``: ``x.py args`` and ``-m mod args`` with ``python``, else the command itself."""
    if cmd[0] == "-m" or cmd[0].endswith(".py"):
        return [python, *cmd]
    return list(cmd)


_prctl = getattr(ctypes.CDLL(None), "prctl", None) if sys.platform.startswith("linux") else None
PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """In a child, before it runs its command: SIGTERM when the proc that started it dies, however it died
    (a proc killed outright runs no ``__cleanup__``). Its own children are reached by ``stop_group`` or, when
    the proc was killed outright, by the ``Watchdog``."""
    if _prctl is not None:
        _prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


# The watchdog's program: it reads "+PGID" and "-PGID" lines (the groups to end) until the proc that started it
# is gone (end of file: only that proc holds the pipe's other end), then ends the groups left.
_WATCHDOG = """
import os, signal, sys, time
groups = set()
for line in sys.stdin:
    (groups.add if line[0] == "+" else groups.discard)(int(line[1:]))
def alive(g):
    try:
        os.killpg(g, 0)
        return True
    except (ProcessLookupError, PermissionError):
        return False
for sig in (signal.SIGTERM, signal.SIGKILL):
    for g in [g for g in groups if alive(g)]:
        os.killpg(g, sig)
    deadline = time.monotonic() + %r
    while any(alive(g) for g in groups) and time.monotonic() < deadline:
        time.sleep(0.05)
"""


class Watchdog:
    """A small process, started on first use, that ends the commands' process groups when their proc dies
    without ending them itself (killed outright: no ``__cleanup__`` runs). A command's own children are in
    its group, which ``PR_SET_PDEATHSIG`` alone does not reach. It learns of the proc's death from the end of
    its standard input, whose other end only the proc holds."""

    def __init__(self, grace: float = 1.0) -> None:
        self._grace = grace
        self._proc: subprocess.Popen | None = None
        self._lock = threading.Lock()

    def _send(self, line: str) -> None:
        with self._lock:
            if self._proc is None or self._proc.poll() is not None:
                self._proc = subprocess.Popen([sys.executable, "-I", "-S", "-c", _WATCHDOG % self._grace],
                                              stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
                                              stderr=subprocess.DEVNULL, start_new_session=True, text=True)
            with contextlib.suppress(OSError):
                self._proc.stdin.write(line)
                self._proc.stdin.flush()

    def watch(self, pgid: int) -> None:
        self._send(f"+{pgid}\n")

    def forget(self, pgid: int) -> None:
        if self._proc is not None:
            self._send(f"-{pgid}\n")

    def close(self) -> None:
        """Let the watchdog go (it ends the groups still watched, which ``stop_group`` ended already)."""
        with self._lock:
            if self._proc is not None:
                with contextlib.suppress(OSError):
                    self._proc.stdin.close()
                with contextlib.suppress(subprocess.TimeoutExpired):
                    self._proc.wait(timeout=self._grace * 2 + 1)


def stop_group(proc: subprocess.Popen, signals=(signal.SIGTERM, signal.SIGKILL), groups=(), grace: float = 1.0
               ) -> None:
    """End ``proc`` and whatever it started in its process group (and in ``groups``): each of ``signals`` in
    turn, ``grace`` seconds apart, until ``proc`` has exited and the groups are empty (a member that outlived
    ``proc``, one that ignores the first signal, gets the next)."""
    groups = {proc.pid, *groups}
    for sig in signals:
        if proc.poll() is not None:
            groups = {g for g in groups if group_alive(g)}
            if not groups:
                return
        for g in groups:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(g, sig)
        deadline = time.monotonic() + grace
        try:
            proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            continue
        while any(group_alive(g) for g in groups) and time.monotonic() < deadline:
            time.sleep(0.02)


def group_alive(pgrp: int) -> bool:
    """Whether process group ``pgrp`` has a member this process may signal."""
    try:
        os.killpg(pgrp, 0)
    except (ProcessLookupError, PermissionError):
        return False
    return True


def check_env(env) -> None:
    """The names and values ``proc_mesh(env=...)`` takes, checked here: the procs' subprocess would refuse
    a bad name or a NUL only after they started."""
    _bootstrap.check_env(env, "env")


class BashActor(Actor):
    """Runs commands on its proc's host (``exec_command``'s, and ``monarch-tensor apply``'s readiness check).
    A command runs in a process group of its own, ended with the proc (``__cleanup__``: when the client stops
    the procs, as an interrupted ``monarch-tensor exec`` does)."""

    def __init__(self) -> None:
        self._children: set[subprocess.Popen] = set()
        self._watchdog = Watchdog()

    def __cleanup__(self) -> None:
        for p in list(self._children):
            stop_group(p)
        self._watchdog.close()

    @endpoint
    async def run(self, cmd: list[str], env: dict[str, str] | None = None, workdir: str | None = None,
                  client_cwd: str | None = None, output_dir: str | None = None, port: Any = None,
                  fixed: dict | None = None) -> int:
        """Run ``cmd``; its output goes to ``output_dir`` or, in chunks ``(label, "out" | "err", bytes)``, to
        ``port``. Returns its exit status. ``fixed``: see ``rank_env``. (Async, so that the proc goes on
        receiving while the command runs: a stop reaches ``__cleanup__``.)"""
        full_env = {**os.environ, **rank_env(fixed)}
        # `python` is the procs' interpreter (a mounted virtual environment's, say), as Monarch's exec has it
        full_env["PATH"] = os.pathsep.join(filter(None, [os.path.dirname(sys.executable), full_env.get("PATH")]))
        full_env.update(env or {})
        cwd = workdir or (client_cwd if client_cwd and os.path.isdir(client_cwd) else None)
        if workdir and not os.path.isdir(workdir):
            raise FileNotFoundError(f"the working directory {workdir!r} does not exist on {os.uname().nodename}")
        argv = command_line(cmd)
        label = rank_label(fixed)
        if output_dir is not None:
            out_dir = output_dir.replace("$SUBDIR", label)
            try:
                os.makedirs(out_dir, exist_ok=True)
            except OSError as e:  # (its own message names no path: "Not a directory")
                raise OSError(e.errno, f"cannot make the output directory {out_dir!r} on {os.uname().nodename}: "
                                       f"{e.strerror}") from None
            with open(os.path.join(out_dir, "stdout.txt"), "wb") as out, \
                    open(os.path.join(out_dir, "stderr.txt"), "wb") as err:
                try:
                    p = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=err, env=full_env,
                                         cwd=cwd, start_new_session=True, preexec_fn=die_with_parent)
                except OSError as e:
                    message, code = _not_started(argv, e)
                    err.write(message)
                    return code
                self._started(p)
                return await asyncio.to_thread(self._wait, p)
        try:
            p = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                 env=full_env, cwd=cwd, start_new_session=True, preexec_fn=die_with_parent)
        except OSError as e:
            message, code = _not_started(argv, e)
            if port is not None:
                port.send((label, "err", message))
            return code
        self._started(p)
        pumps = [threading.Thread(target=contextvars.copy_context().run, args=(_pump, pipe, kind, label, port),
                                  daemon=True, name=f"mt-exec-{kind}")
                 for pipe, kind in ((p.stdout, "out"), (p.stderr, "err"))]
        for t in pumps:
            t.start()
        code = await asyncio.to_thread(self._wait, p)
        for t in pumps:
            await asyncio.to_thread(t.join)
        return code

    def _started(self, p: subprocess.Popen) -> None:
        self._children.add(p)
        self._watchdog.watch(p.pid)  # its process group's id: it leads a session of its own

    def _wait(self, p: subprocess.Popen) -> int:
        try:
            return returncode(p.wait())
        finally:
            self._children.discard(p)
            self._watchdog.forget(p.pid)


def _not_started(argv: list[str], e: OSError) -> tuple[bytes, int]:
    """What a shell says and exits with when it cannot run ``argv``: 127 for no such command, 126 else."""
    missing = isinstance(e, FileNotFoundError)
    why = "command not found" if missing else (e.strerror or repr(e))
    return f"{argv[0]}: {why} (on {os.uname().nodename})\n".encode(), 127 if missing else 126


def _pump(pipe, kind: str, label: str, port) -> None:
    fd = pipe.fileno()
    try:
        while chunk := os.read(fd, CHUNK):
            if port is not None:
                port.send((label, kind, chunk))
    finally:
        pipe.close()


class _Printer:
    """Writes the chunks of several ranks to this process's stdout and stderr; with ``labels``, whole lines
    each behind ``[label] ``."""

    def __init__(self, labels: bool) -> None:
        self.labels = labels
        self.partial: dict[tuple[str, str], bytes] = {}

    def write(self, label: str, kind: str, data: bytes) -> None:
        stream = sys.stdout if kind == "out" else sys.stderr
        if self.labels:
            data = self.partial.pop((label, kind), b"") + data
            *lines, rest = data.split(b"\n")
            if rest:
                self.partial[(label, kind)] = rest
            data = b"".join(b"[%s] %s\n" % (label.encode(), line) for line in lines)
        self._out(stream, data)

    def flush(self) -> None:
        for (label, kind), rest in sorted(self.partial.items()):
            self._out(sys.stdout if kind == "out" else sys.stderr, b"[%s] %s\n" % (label.encode(), rest))
        self.partial.clear()

    @staticmethod
    def _out(stream, data: bytes) -> None:
        if not data:
            return
        buf = getattr(stream, "buffer", None)
        if buf is not None:
            stream.flush()
            buf.write(data)
            buf.flush()
        else:  # (a test's captured stream, a notebook's)
            stream.write(data.decode(errors="replace"))
            stream.flush()


def _check(cmd, env, workdir, output_dir, rank, point, per_host) -> list[str]:
    if isinstance(cmd, str):
        raise TypeError(f"exec_command takes the command as a list of words, e.g. {shlex.split(cmd)!r}, "
                        f"not one string")
    if not isinstance(cmd, (list, tuple)) or not cmd or not all(isinstance(w, str) for w in cmd):
        raise TypeError(f"exec_command needs a non-empty list of strings as its command, got {cmd!r}")
    if cmd[0] == "-m" and len(cmd) < 2:
        raise ValueError("exec_command(['-m', MODULE, ...]) needs the module's name")
    check_env(env)
    for what, v in (("workdir", workdir), ("output_dir", output_dir)):
        if v is not None and not isinstance(v, str):
            raise TypeError(f"{what} is a path (a string), got {v!r}")
    if rank is not None and point is not None:
        raise ValueError("exec_command takes rank= or point=, not both")
    if rank is not None and (not isinstance(rank, int) or isinstance(rank, bool) or rank < 0):
        raise ValueError(f"rank is a flat rank (an int >= 0), got {rank!r}")
    if point is not None and not (isinstance(point, dict) and all(
            isinstance(k, str) and isinstance(v, int) and not isinstance(v, bool) for k, v in point.items())):
        raise TypeError(f"point maps dimension names to coordinates, e.g. {{'hosts': 1}}, got {point!r}")
    if per_host is not None and not isinstance(per_host, dict):
        raise TypeError(f"per_host maps dimension names to sizes, e.g. {{'gpus': 4}}, got {per_host!r}")
    return list(cmd)


def exec_command(host_mesh, cmd: list[str], env: dict[str, str] | None = None, workdir: str | None = None,
                 output_dir: str | None = None, rank: int | None = None, point: dict[str, int] | None = None,
                 per_host: dict[str, int] | None = None) -> Future[int]:
    """Run ``cmd`` on ``host_mesh`` (one proc per host, or ``per_host`` of them), on the flat ``rank`` or the
    host coordinates ``point`` only if given; a Future of the largest exit status. The procs are spawned for
    the command and stopped after it. Bad arguments and a rank or point the mesh does not have raise here;
    what fails after the procs start fails the Future."""
    cmd = _check(cmd, env, workdir, output_dir, rank, point, per_host)
    for name in per_host or {}:  # (here: the one host that rank or point picks has lost the mesh's dims)
        if name in dict(host_mesh.sizes):
            raise ValueError(f"per_host cannot have a {name!r} dimension: the host mesh {host_mesh} has it")
    fixed = {}
    if point is not None:
        target = host_mesh.slice(**point)
    elif rank is not None:
        flat = host_mesh.flatten("rank")
        if rank >= flat.size():
            raise ValueError(f"rank {rank} is not in this host mesh of {flat.size()} hosts")
        target = flat.slice(rank=rank)
    else:
        target = host_mesh
    if target is not host_mesh:
        fixed = sliced_coords(host_mesh, rank, point)
    out: Future[int] = Future("exec_command's exit status")
    client_cwd = os.getcwd()
    cancel = threading.Event()
    _running.add(cancel)

    def run() -> None:
        try:
            out._set_result(_run(target, cmd, env, workdir, client_cwd, output_dir, per_host, fixed, cancel))
        except BaseException as e:  # noqa: BLE001 - the observers get it
            out._set_exception(e)
        finally:
            _running.discard(cancel)

    # Not a daemon: the command runs to its end even when the caller drops the Future (as Monarch's).
    threading.Thread(target=contextvars.copy_context().run, args=(run,), name="mt-exec-command").start()
    return out


_running: set[threading.Event] = set()  # one per exec_command still running


def interrupt_commands() -> None:
    """End every ``exec_command`` of this process that still runs: its procs are stopped (their commands
    with them) and its Future fails with ``KeyboardInterrupt``. What ``monarch-tensor exec`` does at Ctrl-C."""
    for cancel in list(_running):
        cancel.set()


def _run(target, cmd, env, workdir, client_cwd, output_dir, per_host, fixed, cancel) -> int:
    # One proc per host unless told: a "procs" dim of 1, so that each has a label and MONARCH_RANK_procs
    # (hosts_0_procs_0) as before spawn_procs() took Monarch's default of no dims of its own.
    procs = target.spawn_procs(per_host=per_host or {"procs": 1})
    try:
        actors = procs.spawn("BashActor", BashActor)
        port = receiver = None
        if output_dir is None:
            port, receiver = Channel.open()
        pending = actors.run.call(cmd, env, workdir, client_cwd, output_dir, port, fixed)
        printer = _Printer(labels=len(procs) > 1)
        chunk = receiver.recv() if receiver is not None else None
        while True:
            if cancel.is_set():
                raise KeyboardInterrupt("exec_command interrupted: its procs were stopped")
            if chunk is None:
                if _settles(pending, 0.05):
                    break
            elif _settles(chunk, 0.05):
                printer.write(*chunk.get())
                chunk = receiver.recv()
            elif pending.done():
                # A rank's chunks all left before its reply, on the same connection: they are here.
                while _settles(chunk, 0.02):
                    printer.write(*chunk.get())
                    chunk = receiver.recv()
                printer.flush()
                break
        return max(pending.get().values(), default=0)
    finally:
        procs.stop().get(timeout=STOP_TIMEOUT)


def _settles(fut: Future, timeout: float) -> bool:
    """Whether ``fut`` settles within ``timeout`` seconds."""
    try:
        fut.get(timeout=timeout)
    except TimeoutError:
        return fut.done()
    except Exception:  # noqa: BLE001 - settled with an error: the caller's get raises it
        pass
    return True
