"""``shell``: an interactive shell on one host of a mesh, as ``monarch-tensor shell`` opens (Monarch 0.7's).

>>> from monarch_tensor.job import load_current_job, shell
>>> shell(load_current_job().state().trainers.slice(hosts=1))   # doctest: +SKIP
0

A proc spawned on the host runs ``$SHELL`` (else bash) on a pseudo-terminal,
with ``MONARCH_RANK_*``/``MONARCH_SIZE_*`` and ``env`` set, in ``workdir`` or
else the client's working directory where the host has it. Keystrokes go to
it as endpoint calls, in order; its output comes back on a port. The client's
terminal is in raw mode meanwhile (so Ctrl-C, tab completion and full-screen
programs work there), and its size follows the client's. Input from a pipe is
typed as keys; where it ends, the session is hung up at once (Monarch's), as a
terminal's hang-up ends one. Returns the shell's exit status (129 for a
hang-up); the proc is stopped after it.
"""

from __future__ import annotations

import contextlib
import contextvars
import fcntl
import os
import select
import signal
import struct
import subprocess
import sys
import termios
import threading
import time
import tty

from ..actor import Actor, Channel, endpoint
from ..errors import SupervisionError
from .exec import STOP_TIMEOUT, check_env, die_with_parent, rank_env, returncode, stop_group

CHUNK = 16 << 10
GRACE_S = 1.0
START_TIMEOUT = 60.0


def _set_size(fd: int, rows: int, cols: int) -> None:
    fcntl.ioctl(fd, termios.TIOCSWINSZ, struct.pack("HHHH", rows, cols, 0, 0))


def _size(fd: int) -> tuple[int, int]:
    try:
        size = os.get_terminal_size(fd)
    except OSError:
        return 24, 80
    return size.lines, size.columns


def _take_terminal() -> None:
    """In the shell's child, after ``setsid``: make the pty (its stdin) the controlling terminal, and end
    with the proc."""
    fcntl.ioctl(0, termios.TIOCSCTTY, 0)
    die_with_parent()


class ShellActor(Actor):
    """A shell on a pseudo-terminal of its proc's host (``shell``'s remote end)."""

    def __init__(self) -> None:
        self._master: int | None = None
        self._proc: subprocess.Popen | None = None
        self._hung_up = threading.Event()

    @endpoint
    def start(self, port, env: dict[str, str] | None, workdir: str | None, client_cwd: str | None, term: str,
              rows: int, cols: int) -> int:
        """Start the shell; its output goes to ``port`` as ``("data", bytes)``, then ``("exit", status)``.
        Returns its pid."""
        if self._proc is not None:
            raise RuntimeError("this shell already started")
        if workdir and not os.path.isdir(workdir):
            raise FileNotFoundError(f"the working directory {workdir!r} does not exist on {os.uname().nodename}")
        cwd = workdir or (client_cwd if client_cwd and os.path.isdir(client_cwd) else None)
        master, slave = os.openpty()
        _set_size(slave, rows, cols)
        sh = os.environ.get("SHELL") or "/bin/bash"
        if not os.access(sh, os.X_OK):
            sh = "/bin/sh"
        full_env = {**os.environ, **rank_env(), "TERM": term or "xterm-256color", **(env or {})}
        try:
            self._proc = subprocess.Popen([sh], stdin=slave, stdout=slave, stderr=slave, env=full_env, cwd=cwd,
                                          start_new_session=True, preexec_fn=_take_terminal, close_fds=True)
        finally:
            os.close(slave)
        self._master = master
        threading.Thread(target=contextvars.copy_context().run, args=(self._pump, port), daemon=True,
                         name="mt-shell-out").start()
        return self._proc.pid

    def _pump(self, port) -> None:
        master, proc = self._master, self._proc
        while True:
            if not select.select([master], [], [], 0.2)[0]:
                # Hung up and the shell gone: done, even where something it started (that ignored the hang-up,
                # or left the shell's groups) still holds the terminal open.
                if self._hung_up.is_set() and proc.poll() is not None:
                    break
                continue
            try:
                data = os.read(master, CHUNK)
            except OSError:  # EIO: every end of the terminal closed (the shell and its children exited)
                data = b""
            if not data:
                break
            port.send(("data", data))
        port.send(("exit", returncode(proc.wait())))

    @endpoint
    def write(self, data: bytes) -> None:
        """Type ``data`` into the shell's terminal."""
        view = memoryview(data)
        while view:
            view = view[os.write(self._master, view):]

    @endpoint
    def resize(self, rows: int, cols: int) -> None:
        if self._master is not None:
            _set_size(self._master, rows, cols)  # (the kernel sends SIGWINCH to the shell's foreground job)

    @endpoint
    def close(self) -> None:
        """Hang up the shell and whatever it started: SIGHUP, then SIGTERM and SIGKILL to what is left."""
        self._hang_up()

    def __cleanup__(self) -> None:  # (the proc stops: the client went away without closing)
        self._hang_up()

    def _hang_up(self) -> None:
        proc = self._proc
        if proc is None:
            return
        groups = set()
        with contextlib.suppress(OSError):
            groups.add(os.tcgetpgrp(self._master))  # (the job in the shell's foreground)
        groups.discard(os.getpgrp())
        stop_group(proc, (signal.SIGHUP, signal.SIGTERM, signal.SIGKILL), groups, GRACE_S)
        self._hung_up.set()


@contextlib.contextmanager
def _raw(fd: int):
    """The client's terminal in raw mode (keys go through as typed), restored after; nothing for a pipe."""
    if not os.isatty(fd):
        yield
        return
    saved = termios.tcgetattr(fd)
    try:
        tty.setraw(fd, termios.TCSANOW)  # (not TCSAFLUSH: what was typed ahead while the shell started counts)
        yield
    finally:
        termios.tcsetattr(fd, termios.TCSADRAIN, saved)


def shell(host_mesh, *, env: dict[str, str] | None = None, workdir: str | None = None) -> int:
    """Run an interactive shell on ``host_mesh`` (one host: slice it first) with this process's terminal;
    returns its exit status."""
    if host_mesh.size() != 1:
        raise ValueError(f"shell() needs a host mesh of one host, got {host_mesh.size()} hosts "
                         f"({dict(host_mesh.sizes)}): slice it first, e.g. hosts.slice(hosts=0)")
    check_env(env)
    stdin, stdout = sys.stdin.fileno(), sys.stdout.fileno()
    port, receiver = Channel.open()
    procs = host_mesh.spawn_procs()
    try:
        sh = procs.spawn("shell", ShellActor)
        rows, cols = _size(stdin)
        sh.start.call_one(port, env, workdir, os.getcwd(), os.environ.get("TERM", "xterm-256color"), rows,
                          cols).get(timeout=START_TIMEOUT)
        return _forward(sh, procs, receiver, stdin, stdout)
    finally:
        procs.stop().get(timeout=STOP_TIMEOUT)


def _forward(sh, procs, receiver, stdin: int, stdout: int) -> int:
    """Keys to the shell and its output here, until it exits (its status) or its proc dies (an error)."""
    errors: list[BaseException] = []

    def check(fut) -> None:
        e = fut.exception()
        if e is not None:
            errors.append(e)

    resized = threading.Event()
    old_winch = None
    if os.isatty(stdin) and threading.current_thread() is threading.main_thread():
        old_winch = signal.signal(signal.SIGWINCH, lambda *_: resized.set())
    reading = True
    item = receiver.recv()
    try:
        with _raw(stdin):
            while True:
                dead = [p for p in procs._procs if not p.alive]
                if dead:  # (first: a call to it that failed by its death says so less plainly)
                    raise SupervisionError(f"the remote shell's proc (pid {dead[0].pid}) died", proc=dead[0].addr,
                                           rank=dead[0].rank)
                if errors:
                    raise errors[0]
                while item.done():
                    kind, value = item.get()
                    if kind == "exit":
                        return value
                    view = memoryview(value)
                    while view:  # (a pipe takes part of a large write)
                        view = view[os.write(stdout, view):]
                    item = receiver.recv()
                if resized.is_set():
                    resized.clear()
                    sh.resize.call_one(*_size(stdin)).add_done_callback(check)
                ready = select.select([stdin], [], [], 0.02)[0] if reading else []
                if ready:
                    data = os.read(stdin, CHUNK)
                    if data:
                        sh.write.call_one(data).add_done_callback(check)
                    else:
                        # Our input ended (a pipe): the session ends at once, as Monarch's does and as a
                        # terminal's hang-up would, what was typed having been typed: the shell and its
                        # foreground job are hung up (``close``, after the writes), whatever they were doing.
                        reading = False
                        sh.close.call_one().add_done_callback(check)
                elif not reading:
                    time.sleep(0.02)
    finally:
        if old_winch is not None:
            signal.signal(signal.SIGWINCH, old_winch)
        with contextlib.suppress(Exception):
            sh.close.call_one().get(timeout=STOP_TIMEOUT)
