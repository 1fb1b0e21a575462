"""Helpers users import from ``monarch_tensor.utils``.

>>> from monarch_tensor.utils import setup_env_for_distributed
>>> setup_env_for_distributed(procs)   # then torch.distributed.init_process_group() works in actors
"""

from __future__ import annotations

from .future import Future, in_event_loop
from .spmd import TIMEOUT, _setup


def setup_env_for_distributed(proc_mesh, master_addr: str | None = None, master_port: int | None = None,
                              use_ipaddr: object = None) -> Future:
    """Set MASTER_ADDR, MASTER_PORT, RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE on every proc. Monarch's is
    ``async``: ``await setup_env_for_distributed(procs)`` (the seeds' form) works, and so does a plain call,
    which returns once the variables are set (a Future of None, done). The master is rank 0's host:
    ``MASTER_ADDR`` is ``127.0.0.1`` when every proc runs on that host, else its address on the route to the
    other hosts (so ``use_ipaddr``, Monarch's, changes nothing)."""
    fut = _setup(proc_mesh, master_addr, master_port, use_ipaddr)
    if not in_event_loop():  # wait here
        fut.get(timeout=TIMEOUT)
    return fut


__all__ = ["setup_env_for_distributed"]
