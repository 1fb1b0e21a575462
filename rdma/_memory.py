"""Memory the data plane moves: a tensor (CPU or CUDA), an ndarray, or a Python buffer, as bytes.

``as_mem(obj)`` checks the input (contiguous, not empty) and returns a ``Mem``:
its address, length, device, whether it may be written, and a flat uint8
view of it (a torch tensor or numpy array) that backends copy with.
"""

from __future__ import annotations

import ctypes
import sys
from dataclasses import dataclass
from typing import Any

import numpy as np


@dataclass
class Mem:
    ptr: int
    nbytes: int
    device: str  # "cpu" or "cuda:N"
    writable: bool
    flat: Any  # 1-D uint8 torch.Tensor or np.ndarray over exactly these bytes
    obj: Any  # what the user gave (kept alive)

    @property
    def is_cuda(self) -> bool:
        return self.device.startswith("cuda")

    def view(self, offset: int, n: int) -> memoryview:
        """A writable memoryview of CPU bytes [offset, offset + n)."""
        assert not self.is_cuda
        return memoryview((ctypes.c_char * n).from_address(self.ptr + offset)).cast("B")

    def slice(self, offset: int, n: int):
        return self.flat[offset:offset + n]


def _torch():
    return sys.modules.get("torch")


def as_mem(obj: Any, what: str = "data") -> Mem:
    """Check ``obj`` and describe its bytes; raise ``TypeError``/``ValueError`` saying what is wrong."""
    torch = _torch()
    if torch is not None and isinstance(obj, torch.Tensor):
        if obj.is_sparse or obj.layout != torch.strided:
            raise ValueError(f"{what} must be a dense tensor, got layout {obj.layout}")
        if not obj.is_contiguous():
            raise ValueError(f"{what} must be contiguous (got strides {tuple(obj.stride())} for shape "
                             f"{tuple(obj.shape)}); call .contiguous() first")
        if obj.numel() == 0:
            raise ValueError(f"{what} is empty (shape {tuple(obj.shape)}): nothing to transfer")
        t = obj.detach()
        flat = t.reshape(-1).view(torch.uint8)
        dev = "cpu" if t.device.type == "cpu" else f"{t.device.type}:{t.device.index or 0}"
        if t.device.type not in ("cpu", "cuda"):
            raise ValueError(f"{what} lives on {t.device}; only CPU and CUDA memory can be transferred")
        return Mem(flat.data_ptr(), flat.numel(), dev, True, flat, obj)
    if isinstance(obj, np.ndarray):
        if not obj.flags.c_contiguous:
            raise ValueError(f"{what} must be C-contiguous (got strides {obj.strides}); use np.ascontiguousarray")
        arr = obj
    else:
        try:
            mv = memoryview(obj)
        except TypeError:
            raise TypeError(f"{what} must be a tensor, an ndarray, a memoryview or a bytearray; "
                            f"got {type(obj).__name__}") from None
        if not mv.c_contiguous:
            raise ValueError(f"{what} must be a contiguous buffer")
        arr = np.frombuffer(mv, dtype=np.uint8) if mv.nbytes else np.empty(0, np.uint8)
    if arr.nbytes == 0:
        raise ValueError(f"{what} is empty: nothing to transfer")
    flat = arr.reshape(-1).view(np.uint8)
    return Mem(flat.ctypes.data, flat.nbytes, "cpu", bool(flat.flags.writeable), flat, obj)


def copy(dst, src) -> None:
    """Copy between two flat uint8 views of equal length (torch or numpy, any device)."""
    torch = _torch()
    if torch is not None and (isinstance(dst, torch.Tensor) or isinstance(src, torch.Tensor)):
        d = dst if isinstance(dst, torch.Tensor) else torch.from_numpy(dst)
        s = src if isinstance(src, torch.Tensor) else torch.from_numpy(src)
        d.copy_(s)
    else:
        np.copyto(dst, src)
