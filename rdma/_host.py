"""Who and where a process is: host identity, process start time, liveness."""

from __future__ import annotations

import functools
import os
import socket
import threading
from typing import Callable, TypeVar

T = TypeVar("T")
_pid = os.getpid()


def _forked() -> None:
    global _pid
    _pid = os.getpid()


os.register_at_fork(after_in_child=_forked)


def my_pid() -> int:
    """``os.getpid()``, kept up to date across forks: ``os.getpid`` is a system call (0.18 µs on this
    project's VM), and a transfer asked it twice."""
    return _pid


def per_process(make: Callable[[], T]) -> Callable[[], T]:
    """A getter of ``make()``'s result, made on first use in each process: a forked child makes its own
    (its parent's threads, sockets and registrations are not its own)."""
    lock = threading.Lock()
    held: list = [0, None]  # (pid, value)

    @functools.wraps(make)
    def get() -> T:
        pid = _pid
        if held[0] != pid:
            with lock:
                if held[0] != pid:
                    held[1], held[0] = make(), pid
        return held[1]

    return get


@functools.lru_cache(maxsize=1)
def host_id() -> str:
    """Same value for every process of one kernel and PID namespace (cross-memory attach works)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = "?"
    try:
        ns = os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        ns = 0
    return f"{socket.gethostname()}/{boot}/{ns}"


def start_time(pid: int) -> int:
    """The process's start time in clock ticks (tells a reused pid apart); -1 if there is no such process."""
    fields = _stat(pid)
    return -1 if fields is None else int(fields[19])


@per_process
def own_start_time() -> int:
    """``start_time`` of this process, read once per process (a registration needs it each time)."""
    return start_time(os.getpid())


def alive(pid: int, started: int) -> bool:
    """Whether the process ``pid`` that started at ``started`` still runs (same host only): not gone, not
    another process with its pid, and not a zombie (dead, its memory released, its parent yet to reap it)."""
    fields = _stat(pid)
    return fields is not None and fields[0] not in (b"Z", b"X") and int(fields[19]) == started


def _stat(pid: int) -> list[bytes] | None:
    """The fields of ``/proc/PID/stat`` after the command's name (state first), or None if there is no such pid."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except OSError:
        return None
    return data[data.rindex(b")") + 2:].split()
