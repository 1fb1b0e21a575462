"""Process groups and collectives of the tensor engine's workers.

One process group per group of proc ranks, created the first time a ``Reduce``
over it runs. Every member creates it when it executes that same instruction,
and the instruction stream is totally ordered per mesh, so groups are created
in the same order on every rank. Rendezvous goes through the TCPStore the
controller started; each group gets its own key prefix. Gloo on CPU, NCCL on GPU.
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

    def _base_store(self):
        if self._store is None:
            if self.store_addr is None:
                raise RuntimeError("no rendezvous store was given to this worker")
            self._store = connect_store(self.store_addr)
        return self._store

    def group(self, ranks: tuple[int, ...]):
        pg = self._groups.get(ranks)
        if pg is None:
            store = dist.PrefixStore("pg/" + "_".join(map(str, ranks)) + "/", self._base_store())
            pg = self._groups[ranks] = new_group(store, ranks.index(self.rank), len(ranks), self.device,
                                                 self.store_addr[0])
        return pg

    def reduce(self, t: torch.Tensor, ranks: tuple[int, ...], reduction: str, scatter: bool,
               inplace: bool) -> torch.Tensor:
        """Reduce ``t`` over the procs ``ranks`` (this proc among them); the result of this rank."""
        n = len(ranks)
        me = ranks.index(self.rank)
        if reduction == "stack":
            src = t.contiguous()
            if n == 1:
                return src.unsqueeze(0).clone()
            outs = [torch.empty_like(src) for _ in range(n)]
            self.group(ranks).allgather([outs], [src]).wait()
            return torch.stack(outs)
        op = _OPS.get(reduction)
        if op is None:
            raise ValueError(f"unknown reduction {reduction!r}; use one of {sorted(_OPS) + ['stack']}")
        work = t if (inplace and t.is_contiguous()) else t.contiguous().clone()
        if n > 1:
            opts = dist.AllreduceOptions()
            opts.reduceOp = op
            self.group(ranks).allreduce([work], opts).wait()
        if reduction == "avg":
            work.div_(n) if work.is_floating_point() else work.floor_divide_(n)
        if scatter:
            return work.chunk(n)[me].clone()
        if inplace and work is not t:
            t.copy_(work)
            return t
        return work
