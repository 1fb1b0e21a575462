"""Who and where a process is: host identity, process start time, liveness."""

from __future__ import annotations

import functools
import os
import socket


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
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except OSError:
        return -1
    return int(data[data.rindex(b")") + 2:].split()[19])


_own: tuple[int, int] = (0, 0)


def own_start_time() -> int:
    """``start_time`` of this process, read once per process (a registration needs it each time)."""
    global _own
    pid = os.getpid()
    if _own[0] != pid:
        _own = (pid, start_time(pid))
    return _own[1]


def alive(pid: int, started: int) -> bool:
    """Whether the process ``pid`` that started at ``started`` still runs (same host only)."""
    return start_time(pid) == started
