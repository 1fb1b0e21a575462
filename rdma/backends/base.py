"""The base class of data-plane backends: checks inputs, stages GPU memory, times transfers.

A backend overrides ``usable`` (can it serve this owner/reader pair?) and the
two primitives ``_read`` / ``_write`` that move ``local.nbytes`` bytes
between the remote buffer at ``offset`` and ``local``. The base class has
already checked bounds and writability, stages CUDA memory through the CPU
for backends that only reach CPU memory (``cpu_only``), and records stats.
"""

from __future__ import annotations

import threading
import time

from .._memory import Mem, as_mem
from .._registry import Descriptor
from ..errors import TransferTimeoutError


class Backend:
    name = "?"
    cpu_only = True  # the local side must be CPU memory (CUDA memory is staged)
    remote_cpu_only = True  # the remote buffer must be CPU memory

    def __init__(self) -> None:
        self.stats = {"reads": 0, "writes": 0, "atomics": 0, "bytes": 0, "seconds": 0.0}
        self._stats_lock = threading.Lock()

    # ---- to override -------------------------------------------------------------
    def available(self) -> bool:
        """Whether this process can use the backend at all."""
        return True

    def unavailable_reason(self) -> str | None:
        """None where ``available()``; else why not, in words a user can act on."""
        return None if self.available() else "not available in this process"

    def usable(self, desc: Descriptor, local: Mem) -> bool:
        """Whether the backend can move bytes between ``desc``'s buffer and ``local`` from here."""
        raise NotImplementedError

    def _read(self, desc: Descriptor, offset: int, local: Mem, deadline: float) -> None:
        raise NotImplementedError

    def _write(self, desc: Descriptor, offset: int, local: Mem, deadline: float) -> None:
        raise NotImplementedError

    # ---- called by RDMABuffer ----------------------------------------------------------
    def can_serve(self, desc: Descriptor, local: Mem) -> bool:
        if self.remote_cpu_only and desc.device != "cpu":
            return False
        return self.usable(desc, local) and self.available()  # usable: a few comparisons, cheaper

    def read(self, desc: Descriptor, offset: int, local: Mem, timeout: float) -> None:
        self._transfer("reads", self._read, desc, offset, local, timeout)

    def write(self, desc: Descriptor, offset: int, local: Mem, timeout: float) -> None:
        self._transfer("writes", self._write, desc, offset, local, timeout)

    def _transfer(self, kind: str, fn, desc: Descriptor, offset: int, local: Mem, timeout: float) -> None:
        t0 = time.monotonic()
        deadline = t0 + timeout
        if self.cpu_only and local.is_cuda:
            import torch

            staging = as_mem(torch.empty(local.nbytes, dtype=torch.uint8, pin_memory=True))
            if kind == "writes":
                staging.flat.copy_(local.flat)
                fn(desc, offset, staging, deadline)
            else:
                fn(desc, offset, staging, deadline)
                local.flat.copy_(staging.flat)
        else:
            fn(desc, offset, local, deadline)
        dt = time.monotonic() - t0
        with self._stats_lock:
            self.stats[kind] += 1
            self.stats["bytes"] += local.nbytes
            self.stats["seconds"] += dt


def check_deadline(deadline: float, what: str) -> float:
    """Seconds left before ``deadline``; raise ``TransferTimeoutError`` when none are."""
    left = deadline - time.monotonic()
    if left <= 0:
        raise TransferTimeoutError(f"{what} did not finish within its timeout")
    return left
