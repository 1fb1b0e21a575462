"""Helpers users import from ``monarch_tensor.utils``.

>>> from monarch_tensor.utils import setup_env_for_distributed
>>> setup_env_for_distributed(procs)   # then torch.distributed.init_process_group() works in actors
"""

from __future__ import annotations

from .spmd import setup_torch_elastic_env


def setup_env_for_distributed(proc_mesh, master_addr: str | None = None, master_port: int | None = None) -> None:
    """Set MASTER_ADDR, MASTER_PORT, RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE on every proc."""
    setup_torch_elastic_env(proc_mesh, master_addr, master_port)


__all__ = ["setup_env_for_distributed"]
