"""Memory the data plane moves: a tensor (CPU or CUDA), an ndarray, or a Python buffer, as bytes.

``as_mem(obj)`` checks the input (contiguous, not empty) and returns a ``Mem``:
its address, length, device, whether it may be written, and a flat uint8
view of it (a torch tensor or numpy array) that backends copy with.
"""

from __future__ import annotations

import ctypes
import sys
from typing import Any

import numpy as np

# A memoryview over raw memory in one C call. (A ctypes array type per length, as before, took 10 µs for
# each length not seen yet: every transfer of a new size paid it on both sides.)
_memory_view = ctypes.pythonapi.PyMemoryView_FromMemory
_memory_view.restype = ctypes.py_object
_memory_view.argtypes = [ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int]
_PYBUF_WRITE = 0x200


class Mem:
    """Where the bytes are: ``ptr`` and ``nbytes``, on ``device`` ("cpu" or "cuda:N"), whether they may be
    written; ``flat`` is a 1-D uint8 torch.Tensor or np.ndarray over exactly these bytes, made on first use
    (a CPU transfer over a socket or cross-memory attach needs only the address); ``obj`` is what the user
    gave (kept alive)."""

    __slots__ = ("ptr", "nbytes", "device", "is_cuda", "writable", "_flat", "obj")

    def __init__(self, ptr: int, nbytes: int, device: str, writable: bool, flat: Any, obj: Any) -> None:
        self.ptr, self.nbytes, self.device, self.writable, self._flat, self.obj = ptr, nbytes, device, writable, flat, obj
        self.is_cuda = device.startswith("cuda")

    def __repr__(self) -> str:
        return f"Mem({self.nbytes} bytes at {self.ptr:#x} on {self.device})"

    @property
    def flat(self) -> Any:
        if self._flat is None and self.obj is not None:
            self._flat = _flatten(self.obj)
        return self._flat

    def view(self, offset: int, n: int) -> memoryview:
        """A writable memoryview of CPU bytes [offset, offset + n) (it does not keep them alive: ``obj`` does)."""
        assert not self.is_cuda
        return _memory_view(self.ptr + offset, n, _PYBUF_WRITE)

    def head(self, n: int) -> Mem:
        """The first ``n`` bytes (of a destination larger than what is read into it)."""
        if n == self.nbytes:
            return self
        return Mem(self.ptr, n, self.device, self.writable, None, self.flat[:n])

    def slice(self, offset: int, n: int):
        return self.flat[offset:offset + n]


def _torch():
    return sys.modules.get("torch")


def _flatten(obj: Any) -> Any:
    torch = _torch()
    if torch is not None and isinstance(obj, torch.Tensor):
        obj = obj.detach()
        if obj.is_contiguous():  # (its size-1 dims may have any stride, which reshape(-1) keeps)
            return obj.as_strided((obj.numel(),), (1,)).view(torch.uint8)
        return obj.reshape(-1).view(torch.uint8)
    if isinstance(obj, np.ndarray):
        return obj.reshape(-1).view(np.uint8)
    return np.frombuffer(memoryview(obj), dtype=np.uint8)


def as_mem(obj: Any, what: str = "data") -> Mem:
    """Check ``obj`` and describe its bytes; raise ``TypeError``/``ValueError`` saying what is wrong."""
    torch = _torch()
    if torch is not None and isinstance(obj, torch.Tensor):
        if obj.layout != torch.strided:
            raise ValueError(f"{what} must be a dense tensor, got layout {obj.layout}")
        if obj.is_conj() or obj.is_neg():  # its bytes are not its values
            raise ValueError(f"{what} is a lazily {'conjugated' if obj.is_conj() else 'negated'} view, whose bytes "
                             f"are not its values; call .resolve_conj() and .resolve_neg() first")
        if not obj.is_contiguous():
            raise ValueError(f"{what} must be contiguous (got strides {tuple(obj.stride())} for shape "
                             f"{tuple(obj.shape)}); call .contiguous() first")
        nbytes = obj.nbytes
        if nbytes == 0:
            raise ValueError(f"{what} is empty (shape {tuple(obj.shape)}): nothing to transfer")
        if obj.is_cpu:
            dev = "cpu"
        elif obj.is_cuda:
            dev = f"cuda:{obj.device.index or 0}"
        else:
            raise ValueError(f"{what} lives on {obj.device}; only CPU and CUDA memory can be transferred")
        return Mem(obj.data_ptr(), nbytes, dev, True, None, obj)
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
    return Mem(arr.ctypes.data, arr.nbytes, "cpu", bool(arr.flags.writeable), None, arr)


def copy(dst, src) -> None:
    """Copy between two flat uint8 views of equal length (torch or numpy, any device)."""
    torch = _torch()
    if torch is not None and (isinstance(dst, torch.Tensor) or isinstance(src, torch.Tensor)):
        d = dst if isinstance(dst, torch.Tensor) else torch.from_numpy(dst)
        s = src if isinstance(src, torch.Tensor) else torch.from_numpy(src)
        d.copy_(s)
    else:
        np.copyto(dst, src)
