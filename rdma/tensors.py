"""Moving whole tensors between procs on the data plane (for ``to_mesh`` / ``fetch_shard``).

>>> h = publish_tensor(t)              # in the proc that has ``t``; ``h`` is small and picklable
>>> # ... send ``h`` in any message; in the proc that wants the tensor:
>>> x = h.fetch(device="cpu")          # a new tensor with t's shape, dtype and bytes
>>> h.drop()                           # (or ``h.fetch(drop=True)``) ends the registration
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .buffer import DEFAULT_TIMEOUT, RDMABuffer


@dataclass(frozen=True)
class TensorHandle:
    """A published tensor: its buffer, shape and dtype."""

    buf: RDMABuffer
    shape: tuple[int, ...]
    dtype: Any

    def fetch(self, device: str = "cpu", *, out: Any = None, drop: bool = False,
              timeout: float = DEFAULT_TIMEOUT):
        """Read the tensor into ``out`` (or a new tensor on ``device``); return it."""
        import torch

        if out is None:
            out = torch.empty(self.shape, dtype=self.dtype, device=device)
        elif tuple(out.shape) != tuple(self.shape) or out.dtype != self.dtype:
            raise ValueError(f"out has shape {tuple(out.shape)} and dtype {out.dtype}; the published tensor "
                             f"has {self.shape} and {self.dtype}")
        if out.numel():
            self.buf.read_into(_flat_bytes(out), timeout=timeout).get(timeout)
        if drop:
            self.drop()
        return out

    def drop(self) -> None:
        if self.buf is not None:
            self.buf.drop()


def publish_tensor(t: Any) -> TensorHandle:
    """Register ``t`` (made contiguous) for other procs to ``fetch``; keep the handle to ``drop`` it later."""

    src = t.detach().contiguous()
    if src.numel() == 0:
        return TensorHandle(_EmptyBuffer(), tuple(src.shape), src.dtype)
    return TensorHandle(RDMABuffer(_flat_bytes(src)), tuple(src.shape), src.dtype)


def _flat_bytes(t: Any) -> Any:
    """A contiguous tensor's bytes as a 1-D uint8 tensor (its size-1 dims may have any stride: no reshape)."""
    import torch

    return t.as_strided((t.numel(),), (1,)).view(torch.uint8)


class _EmptyBuffer:
    def drop(self) -> None:
        pass
