"""CPU and NUMA binding of procs: ``spawn_procs(per_host={"gpus": 2}, proc_bind=[{"cpunodebind": "0"},
{"cpunodebind": "1"}])`` (Monarch's).

One dict per proc of a host (the same list for every host), keys as numactl's:
``cpus`` or ``physcpubind`` (a CPU list such as ``"0-3,8"``), ``cpunodebind``
(NUMA nodes whose CPUs the proc may run on) and ``membind`` (NUMA nodes its
memory comes from). Procs are forked, not exec'd, so no numactl runs: a new
proc applies its binding to its only thread before it starts any other
(``sched_setaffinity``, ``set_mempolicy(MPOL_BIND)``), and every thread it
starts later inherits it.
"""

from __future__ import annotations

import ctypes
import json
import os
import platform

from ..config import take

KEYS = ("cpus", "physcpubind", "cpunodebind", "membind")
ENV = "MONARCH_TENSOR_PROC_BIND"
_MPOL_BIND = 2
_SYS_SET_MEMPOLICY = {"x86_64": 238, "aarch64": 237, "arm64": 237, "ppc64le": 260}


def parse_list(text: str, what: str) -> list[int]:
    """``"0-3,8"`` -> ``[0, 1, 2, 3, 8]``."""
    out: list[int] = []
    try:
        for part in text.split(","):
            lo, sep, hi = part.strip().partition("-")
            first, last = int(lo), int(hi) if sep else int(lo)
            if first < 0 or last < first:
                raise ValueError(part)
            out.extend(range(first, last + 1))
    except ValueError:
        raise ValueError(f"proc_bind {what}={text!r}: expected a list such as '0-3,8'") from None
    return out


def check(proc_bind, procs_per_host: int) -> list[dict[str, str]] | None:
    """``proc_bind`` validated (one dict per proc of a host, known keys, parsable values), or None."""
    if proc_bind is None:
        return None
    if not isinstance(proc_bind, (list, tuple)) or len(proc_bind) != procs_per_host:
        raise ValueError(f"proc_bind must be a list of one dict per proc of a host ({procs_per_host}), got "
                         f"{proc_bind!r}")
    out = []
    for binding in proc_bind:
        if not isinstance(binding, dict):
            raise TypeError(f"each proc_bind entry is a dict such as {{'cpunodebind': '0'}}, got {binding!r}")
        unknown = set(binding) - set(KEYS)
        if unknown:
            raise ValueError(f"proc_bind keys are {list(KEYS)}; unknown: {sorted(unknown)}")
        if "cpus" in binding and "physcpubind" in binding:
            raise ValueError("proc_bind: give cpus or physcpubind (the same thing), not both")
        for key, value in binding.items():
            if not isinstance(value, str):
                raise TypeError(f"proc_bind {key} takes a string such as '0-3', got {value!r}")
            parse_list(value, key)
        out.append(dict(binding))
    return out


def check_here(proc_bind: list[dict[str, str]] | None) -> None:
    """For procs of this machine: every CPU and node named exists here (a proc would fail at its start)."""
    for binding in proc_bind or ():
        listed = binding.get("cpus") or binding.get("physcpubind")
        if listed:
            missing = sorted(set(parse_list(listed, "cpus")) - set(range(os.cpu_count() or 1)))
            if missing:
                raise ValueError(f"proc_bind {binding}: this machine has no CPU {missing} "
                                 f"(it has {os.cpu_count()})")
        for key in ("cpunodebind", "membind"):
            if binding.get(key):
                node_cpus(parse_list(binding[key], key))


def node_cpus(nodes: list[int]) -> set[int]:
    cpus: set[int] = set()
    for n in nodes:
        path = f"/sys/devices/system/node/node{n}/cpulist"
        try:
            with open(path) as f:
                text = f.read().strip()
        except OSError:
            raise ValueError(f"proc_bind: this machine has no NUMA node {n} ({path} is missing)") from None
        if text:
            cpus.update(parse_list(text, f"node {n}'s cpulist"))
    return cpus


def apply(binding: dict[str, str]) -> None:
    """Bind this process's current thread (and the threads it starts later)."""
    cpus: set[int] = set()
    listed = binding.get("cpus") or binding.get("physcpubind")
    if listed:
        cpus = set(parse_list(listed, "cpus"))
    if binding.get("cpunodebind"):
        on_nodes = node_cpus(parse_list(binding["cpunodebind"], "cpunodebind"))
        cpus = cpus & on_nodes if cpus else on_nodes
        if not cpus:
            raise ValueError(f"proc_bind {binding}: no CPU is both listed and on the nodes")
    if cpus:
        try:
            os.sched_setaffinity(0, cpus)
        except OSError as e:
            raise ValueError(f"proc_bind {binding}: cannot run on CPUs {sorted(cpus)} here: {e}") from None
    if binding.get("membind"):
        nodes = parse_list(binding["membind"], "membind")
        node_cpus(nodes)  # every node exists
        _set_mempolicy_bind(nodes)


def _set_mempolicy_bind(nodes: list[int]) -> None:
    number = _SYS_SET_MEMPOLICY.get(platform.machine())
    if number is None:
        raise ValueError(f"proc_bind membind is not supported on {platform.machine()}")
    bits = 64 * (max(nodes) // 64 + 1)
    mask = (ctypes.c_ulong * (bits // 64))()
    for n in nodes:
        mask[n // 64] |= 1 << (n % 64)
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.syscall(ctypes.c_long(number), ctypes.c_int(_MPOL_BIND), mask, ctypes.c_ulong(bits + 1)) != 0:
        err = ctypes.get_errno()
        raise ValueError(f"proc_bind membind={nodes}: set_mempolicy failed: {os.strerror(err)}")


def env_for(proc_bind: list[dict[str, str]] | None, local_index: int) -> dict[str, str]:
    """The variable that carries a proc's binding to it (``apply_from_env`` reads it at its start)."""
    if not proc_bind or not proc_bind[local_index]:
        return {}
    return {ENV: json.dumps(proc_bind[local_index])}


def _cpu_key(binding: dict[str, str] | None) -> tuple | None:
    if not binding:
        return None
    key = (binding.get("cpus") or binding.get("physcpubind"), binding.get("cpunodebind"))
    return key if any(key) else None


def restricts_cpus(proc_bind: list[dict[str, str]] | None) -> bool:
    return any(_cpu_key(b) is not None for b in proc_bind or ())


def sharing(proc_bind: list[dict[str, str]] | None, local_index: int, unbound: int) -> int:
    """How many procs share the CPUs of a host's proc ``local_index``: those of ``proc_bind`` bound to the
    same CPUs, or ``unbound`` where its binding leaves its CPUs alone."""
    if not proc_bind:
        return unbound
    key = _cpu_key(proc_bind[local_index])
    if key is None:
        return unbound
    return len([b for b in proc_bind if _cpu_key(b) == key])


def apply_from_env() -> None:
    raw = take(ENV)
    if raw:
        apply(json.loads(raw))
