"""``cuda_ipc``: GPU memory of another process on the same host, through CUDA IPC handles.

The owner exports the buffer's storage once, at registration, with torch's
own CUDA IPC reduction (``torch.multiprocessing.reductions.reduce_tensor``:
``storage._share_cuda_()``, plus torch's reference counting so the owner's
allocator keeps the block while readers have it open); the reader rebuilds
a tensor over the same device memory (cached per buffer) and copies with
``copy_`` (device-to-device on NVLink/PCIe, or to a CPU destination). The
registration check reads the owner's slot with cross-memory attach where
the kernel allows it. Needs a CUDA build of torch and a GPU: the tests skip
without one.
"""

from __future__ import annotations

import sys
import threading

from .._host import host_id
from .._memory import Mem
from .._registry import Descriptor
from ..errors import BackendRefusedError, TransferError
from .base import Backend


class CudaIpcBackend(Backend):
    name = "cuda_ipc"
    cpu_only = False
    remote_cpu_only = False

    def __init__(self) -> None:
        super().__init__()
        self._opened: dict[tuple[int, int, int], object] = {}
        self._lock = threading.Lock()

    def available(self) -> bool:
        torch = sys.modules.get("torch")
        return torch is not None and torch.cuda.is_available()

    def unavailable_reason(self) -> str | None:
        torch = sys.modules.get("torch")
        if torch is None:
            return "torch is not imported in this process"
        if not torch.cuda.is_available():
            return ("no CUDA device" if torch.version.cuda else "this torch is a CPU-only build") + \
                " (CUDA IPC moves GPU memory between processes of one host)"
        return None

    def register(self, mem: Mem, extras: dict) -> None:
        if not mem.is_cuda:
            return
        from torch.multiprocessing.reductions import reduce_tensor

        _rebuild, args = reduce_tensor(mem.flat)
        extras["cuda_ipc"] = args

    def usable(self, desc: Descriptor, local: Mem) -> bool:
        return desc.device != "cpu" and "cuda_ipc" in desc.extras and desc.host == host_id()

    def _remote(self, desc: Descriptor):
        key = (desc.pid, desc.started, desc.buf_id)
        with self._lock:
            t = self._opened.get(key)
            if t is None:
                from torch.multiprocessing.reductions import rebuild_cuda_tensor

                try:
                    t = rebuild_cuda_tensor(*desc.extras["cuda_ipc"])
                except RuntimeError as e:
                    raise BackendRefusedError(f"cannot open the CUDA IPC handle of buffer {desc.buf_id}: {e}") from e
                self._opened[key] = t
            return t

    def _check_slot(self, desc: Descriptor) -> None:
        from .cma import CmaBackend

        cma = CmaBackend()
        try:
            cma._check_slot(desc)
        except BackendRefusedError:
            pass  # cannot look: the copy below still fails cleanly if the owner died

    def forget(self, desc: Descriptor) -> None:
        with self._lock:
            self._opened.pop((desc.pid, desc.started, desc.buf_id), None)

    def _copy(self, desc: Descriptor, offset: int, local: Mem, read: bool) -> None:
        import torch

        self._check_slot(desc)
        remote = self._remote(desc)[offset:offset + local.nbytes]
        try:
            if read:
                local.flat.copy_(remote, non_blocking=False)
            else:
                remote.copy_(local.flat)
            torch.cuda.synchronize(remote.device)
        except RuntimeError as e:
            raise TransferError(f"CUDA IPC copy of buffer {desc.buf_id} failed: {e}") from e

    def _read(self, desc: Descriptor, offset: int, local: Mem, deadline: float) -> None:
        self._copy(desc, offset, local, True)

    def _write(self, desc: Descriptor, offset: int, local: Mem, deadline: float) -> None:
        self._copy(desc, offset, local, False)
