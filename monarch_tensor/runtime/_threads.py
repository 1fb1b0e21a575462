"""Torch's intra-op thread count in procs, chosen as torchrun does: each proc one share of its host's cores.

A proc's count, first that applies:

1. ``spawn_procs(threads=N)``;
2. ``OMP_NUM_THREADS`` in the procs' environment (the script's at the spawn, or ``proc_mesh(env=...)``,
   or a host agent's own);
3. its host's cores (``os.sched_getaffinity``: those it may run on, after any ``proc_bind``) divided by
   the procs sharing them, at least 1. The procs sharing a host's cores are this script's live procs on
   that host at the spawn, the new ones included (a proc bound to CPUs with ``proc_bind``: the new procs
   bound alike); procs spawned earlier keep their count.

The count is applied in the proc at its start (``torch.set_num_threads``, and ``OMP_NUM_THREADS`` and
``MKL_NUM_THREADS`` for its own child processes); a later ``torch.set_num_threads`` on the proc (in a
``bootstrap``, say) wins. Where rule 3 sets fewer threads than torch would use, the spawn prints one line
saying so on the script's stderr.

>>> procs = this_host().spawn_procs(per_host={"procs": 4}, threads=2)  # doctest: +SKIP
"""

from __future__ import annotations

import os
import sys

from ..config import take

ENV = "MONARCH_TENSOR_THREADS"  # in a proc's environment: "N" (chosen) or "share:K" (its cores / K)


def check(threads) -> int | None:
    """``spawn_procs(threads=...)`` validated: None (the default) or a positive int."""
    if threads is None:
        return None
    if isinstance(threads, bool) or not isinstance(threads, int):
        raise TypeError(f"spawn_procs(threads=...) takes a positive number of torch threads per proc (or None for "
                        f"its share of the host's cores), got {type(threads).__name__} {threads!r}")
    if threads < 1:
        raise ValueError(f"spawn_procs(threads={threads}): each proc needs at least 1 torch thread")
    return threads


def cores() -> int:
    """The CPUs this process may run on."""
    try:
        return len(os.sched_getaffinity(0)) or 1
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def user_set(extra_env: dict | None = None) -> bool:
    """Whether the procs' environment chooses their thread count (``OMP_NUM_THREADS``)."""
    return bool(os.environ.get("OMP_NUM_THREADS") or (extra_env or {}).get("OMP_NUM_THREADS"))


def env_for(threads: int | None, sharing: int) -> dict[str, str]:
    """What carries a proc's count to it: ``threads`` chosen, or its share among ``sharing`` procs. The
    script's ``OMP_NUM_THREADS`` goes along (the procs' template started with the script's environment of
    that time)."""
    env = {ENV: str(threads) if threads is not None else f"share:{max(1, sharing)}"}
    if os.environ.get("OMP_NUM_THREADS"):
        env["OMP_NUM_THREADS"] = os.environ["OMP_NUM_THREADS"]
    return env


def notice(n_procs: int, sharing: int, host: str = "this host") -> None:
    """The spawn's one line where the default share is fewer threads than torch's own default."""
    here = cores()
    each = max(1, here // max(1, sharing))
    if each >= here:
        return
    sys.stderr.write(f"monarch_tensor: torch in each of the {n_procs} new procs uses {each} intra-op thread"
                     f"{'s' if each != 1 else ''} ({here} cores / {sharing} procs on {host}); choose with "
                     f"spawn_procs(threads=N) or OMP_NUM_THREADS\n")


def remote_notice(n_procs: int, sharing: int) -> None:
    """The spawn's one line for procs behind host agents, whose cores this script does not know."""
    if sharing > 1:
        sys.stderr.write(f"monarch_tensor: torch in each of the {n_procs} new procs uses its host's cores / "
                         f"{sharing} intra-op threads (at least 1); choose with spawn_procs(threads=N) or "
                         f"OMP_NUM_THREADS\n")


def from_env() -> int | None:
    """This proc's count, from its environment (None: nothing to set)."""
    raw = take(ENV)
    if not raw:
        return None
    if raw.startswith("share:"):
        user = os.environ.get("OMP_NUM_THREADS", "")
        if user.strip().isdigit() and int(user) > 0:
            return int(user)
        return max(1, cores() // int(raw[len("share:"):]))
    return int(raw)


def apply_from_env() -> None:
    """At a proc's start (after its CPU binding): set torch's intra-op threads, and the variables its
    children read. torch may be imported already (the template imports it before forking)."""
    n = from_env()
    if n is None:
        return
    os.environ["OMP_NUM_THREADS"] = str(n)
    os.environ.setdefault("MKL_NUM_THREADS", str(n))
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.set_num_threads(n)


def adopt() -> None:
    """In a thread a proc starts that runs torch ops (a tensor engine stream, an actor's constructor): the
    proc's intra-op thread count for this thread too. ``torch.set_num_threads`` sets MKL's count for its own
    thread only; a new thread whose first op is a matrix product computes it with MKL's default, every core,
    and keeps it while its ops are too small to make torch look at its own count (a 256-256-10 MLP's never
    are): each of two procs on two cores then held a second OpenMP thread for its products."""
    torch = sys.modules.get("torch")
    if torch is None:
        return
    try:
        torch.set_num_threads(torch.get_num_threads())  # (the proc's count: torch's own, read in this thread)
    except Exception as e:  # noqa: BLE001 - a torch without these: the thread computes as torch chooses
        sys.stderr.write(f"monarch_tensor: could not set this thread's torch thread count: {e!r}\n")
