"""Process groups and collectives of the tensor engine's workers.

One process group per group of proc ranks and stream, created the first time a
``Reduce`` over it runs on that stream. Every member creates it when it executes
that same instruction, and each stream's instructions are totally ordered, so a
stream's groups are created, and used, in the same order on every rank. Streams
run on threads of their own: two streams sharing a group would interleave their
collectives differently on different ranks (one rank's tensor of one stream
summed with another rank's of the other). Rendezvous goes through the TCPStore
the controller started; each group gets its own key prefix. Gloo on CPU, NCCL on GPU.

A member whose input failed (an op before the collective failed there) takes
part all the same, and each member's data carries a flag saying whether its
input failed: a failure on one rank fails the collective's result on every
rank, instead of leaving the others waiting for it until the timeout.
"""

from __future__ import annotations

import os
from datetime import timedelta

import torch
import torch.distributed as dist

from monarch_tensor._net import ip_towards

TIMEOUT = float(os.environ.get("MONARCH_TENSOR_COLLECTIVE_TIMEOUT", "300"))

_OPS = {
    "sum": dist.ReduceOp.SUM, "avg": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX,
    "min": dist.ReduceOp.MIN, "product": dist.ReduceOp.PRODUCT,
}
# The flag element each member adds to an all-reduce, (input there, input failed): reduced with the
# same op, the result stays the first only when every member had its input.
_FLAGS = {"sum": (0, 1), "avg": (0, 1), "max": (0, 1), "min": (1, 0), "product": (1, 0)}


def connect_store(store_addr: tuple[str, int]) -> dist.TCPStore:
    """A client of the controller's rendezvous store."""
    host, port = store_addr
    return dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=TIMEOUT))


def new_group(store, me: int, n: int, device: torch.device, store_host: str) -> dist.ProcessGroup:
    """The process group of ``n`` ranks (this one ``me``) meeting in ``store``: NCCL on GPU, else gloo bound
    to this host's address on the route to the store's host (the one the other hosts can reach)."""
    if device.type == "cuda":
        return dist.ProcessGroupNCCL(store, me, n)
    opts = dist.ProcessGroupGloo._Options()
    opts._devices = [dist.ProcessGroupGloo.create_device(hostname=ip_towards(store_host))]
    opts._timeout = timedelta(seconds=TIMEOUT)
    return dist.ProcessGroupGloo(store, me, n, opts)


class Collectives:
    """The process groups of one worker, keyed by their member ranks."""

    def __init__(self, rank: int, store_addr: tuple[str, int] | None, device: torch.device) -> None:
        self.rank, self.store_addr, self.device = rank, store_addr, device
        self._store = None
        self._groups: dict[tuple, object] = {}
        self._flags: dict[tuple, torch.Tensor] = {}

    def _base_store(self):
        if self._store is None:
            if self.store_addr is None:
                raise RuntimeError("no rendezvous store was given to this worker")
            self._store = connect_store(self.store_addr)
        return self._store

    def group(self, ranks: tuple[int, ...], stream: int = 0):
        """The group of ``ranks`` for ``stream`` (only that stream's thread uses it)."""
        key = (ranks, stream)
        pg = self._groups.get(key)
        if pg is None:
            store = dist.PrefixStore(f"pg/{stream}/" + "_".join(map(str, ranks)) + "/", self._base_store())
            pg = self._groups[key] = new_group(store, ranks.index(self.rank), len(ranks), self.device,
                                               self.store_addr[0])
        return pg

    def _flagged(self, t: torch.Tensor | None, numel: int, dtype: torch.dtype, ok: int, failed: int) -> torch.Tensor:
        """``t`` flattened, one flag element after it: ``ok``; or, for a failed input (None), zeros and ``failed``."""
        if t is None:
            buf = torch.zeros(numel + 1, dtype=dtype, device=self.device)
            buf[numel] = failed
            return buf
        key = (dtype, ok)
        flag = self._flags.get(key)
        if flag is None:
            flag = self._flags[key] = torch.full((1,), ok, dtype=dtype, device=self.device)
        return torch.cat((t.reshape(-1), flag))

    def reduce(self, t: torch.Tensor | None, ranks: tuple[int, ...], reduction: str, scatter: bool,
               inplace: bool, stream: int, numel: int, dtype: torch.dtype) -> torch.Tensor | None:
        """Reduce ``t`` (``numel`` elements of ``dtype``) over the procs ``ranks`` (this proc among them) on
        ``stream``'s group; this rank's result, or None when a member's input failed.

        ``t`` None: this rank's input failed. It takes part all the same, so that no member waits for it:
        every member sends one element more, a flag that says whether its input failed, in the same
        collective (a second one to agree first doubled a small reduce's time).
        """
        n = len(ranks)
        me = ranks.index(self.rank)
        if t is None:
            if n == 1:
                return None
            shape = (numel,)
        else:
            shape = t.shape
        if reduction == "stack":
            buf = self._flagged(t, numel, dtype, 0, 1)
            if n == 1:
                return buf[:numel].view(shape).unsqueeze(0)
            outs = [torch.empty_like(buf) for _ in range(n)]
            self.group(ranks, stream).allgather([outs], [buf]).wait()
            gathered = torch.stack(outs)
            if bool(gathered[:, numel].any()):
                return None
            return gathered[:, :numel].reshape((n, *shape))
        op = _OPS.get(reduction)
        if op is None:
            raise ValueError(f"unknown reduction {reduction!r}; use one of {sorted(_OPS) + ['stack']}")
        ok, failed = _FLAGS[reduction]
        work = self._flagged(t, numel, dtype, ok, failed)
        if n > 1:
            opts = dist.AllreduceOptions()
            opts.reduceOp = op
            self.group(ranks, stream).allreduce([work], opts).wait()
            if work[numel].item() != ok:
                return None
        out = work[:numel].view(shape)
        if reduction == "avg":
            out.div_(n) if out.is_floating_point() else out.floor_divide_(n)
        if scatter:
            return out.chunk(n)[me].clone()
        if inplace:
            t.copy_(out)
            return t
        return out
