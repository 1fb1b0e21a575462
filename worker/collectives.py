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


class _Done:
    """A collective of ``DummyProcessGroup``: complete at once."""

    def __init__(self, value) -> None:
        self._value = value

    def wait(self, timeout=None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True

    def is_success(self) -> bool:
        return True

    def result(self):
        return self._value


class DummyProcessGroup(dist.ProcessGroup):
    """Stands in for a mesh's process group where a function runs once to learn its output shapes (on fake
    tensors on the controller, or on one rank for ``propagate="inspect"``): its collectives return at once
    and leave their tensors as they are, so shapes come out right and nothing waits for ranks that are not
    there. ``size()`` and ``rank()`` are the real group's (rank 0 on the controller). It is not registered
    with torch, so calls that name global ranks (``dist.broadcast(t, src=r, group=pg)``) fail on it: give
    such a function a ``propagate``."""

    def __init__(self, dims: tuple, world_size: int, rank: int = 0) -> None:
        super().__init__(rank, world_size)
        self.dims, self.world_size = dims, world_size

    def allreduce(self, tensors, opts=None):
        return _Done(tensors)

    def allreduce_coalesced(self, tensors, opts=None):
        return _Done(tensors)

    def allgather(self, outputs, inputs, opts=None):
        return _Done(outputs)

    def _allgather_base(self, output, input, opts=None):
        return _Done(output)

    def allgather_into_tensor_coalesced(self, outputs, inputs, opts=None):
        return _Done(outputs)

    def reduce_scatter(self, outputs, inputs, opts=None):
        return _Done(outputs)

    def _reduce_scatter_base(self, output, input, opts=None):
        return _Done(output)

    def reduce_scatter_tensor_coalesced(self, outputs, inputs, opts=None):
        return _Done(outputs)

    def alltoall_base(self, output, input, output_split_sizes, input_split_sizes, opts=None):
        return _Done(output)

    def broadcast(self, tensors, opts=None):
        return _Done(tensors)

    def reduce(self, tensors, opts=None):
        return _Done(tensors)

    def barrier(self, opts=None):
        return _Done(None)

    def __repr__(self) -> str:
        return f"DummyProcessGroup(dims={self.dims}, size={self.world_size})"

    def __reduce__(self):
        return (DummyProcessGroup, (self.dims, self.world_size, self.rank()))


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


def _register(pg, name: str, backend: str, store, ranks: tuple[int, ...]) -> None:
    """Enter ``pg`` in torch.distributed's registry of groups, as ``new_group`` does (the part that lets
    calls map global ranks to the group's). Best effort: a torch whose registry differs still runs the
    group's collectives."""
    world = getattr(dist.distributed_c10d, "_world", None)
    try:
        world.pg_map[pg] = (backend, store)
        world.pg_names[pg] = name
        world.pg_group_ranks[pg] = {r: i for i, r in enumerate(ranks)}
        world.pg_backend_config[pg] = backend
    except (AttributeError, TypeError):
        _unregister(pg)


def _unregister(pg) -> None:
    world = getattr(dist.distributed_c10d, "_world", None)
    for table in ("pg_map", "pg_names", "pg_group_ranks", "pg_backend_config"):
        getattr(world, table, {}).pop(pg, None)


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

    def process_group(self, ranks: tuple[int, ...], stream: int = 0) -> dist.ProcessGroup:
        """The group of ``ranks`` for ``stream`` as ``torch.distributed`` takes it from user code: a
        ``ProcessGroup`` around the same backend ``group`` makes, registered with torch so that calls that
        name global ranks work (``dist.broadcast(t, src=r, group=pg)``, ``dist.send(t, dst=r, group=pg)``,
        ``get_process_group_ranks``): a global rank is a proc's rank in its mesh."""
        key = ("pg", ranks, stream)
        pg = self._groups.get(key)
        if pg is None:
            backend = self.group(ranks, stream)
            store = dist.PrefixStore(f"pg/{stream}/" + "_".join(map(str, ranks)) + "/user/", self._base_store())
            pg = dist.ProcessGroup(store, ranks.index(self.rank), len(ranks))
            kind = dist.ProcessGroup.BackendType.NCCL if self.device.type == "cuda" else \
                dist.ProcessGroup.BackendType.GLOO
            pg._set_default_backend(kind)
            pg._register_backend(self.device, kind, backend)
            name = f"monarch_tensor/{stream}/" + "_".join(map(str, ranks))
            pg._set_group_name(name)
            _register(pg, name, "nccl" if self.device.type == "cuda" else "gloo", store, ranks)
            self._groups[key] = pg
        return pg

    def close(self) -> None:
        """Forget the groups made for user code (torch's registry keeps them otherwise)."""
        for key, pg in list(self._groups.items()):
            if key[0] == "pg":
                _unregister(pg)
                del self._groups[key]

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

    def reduce_many(self, ts: list, ranks: tuple[int, ...], reduction: str, inplace: bool, stream: int,
                    numels: tuple, dtype: torch.dtype) -> list:
        """``reduce`` of several tensors of one ``dtype`` in one collective (not "stack", no scatter): copied side
        by side into one buffer, a flag per tensor after them. ``ts[i]`` None: this rank's input i failed (it
        takes part with zeros). The results: per tensor, its result (a view of the buffer, or ``ts[i]``
        written in place), or None where some member's input i failed."""
        op = _OPS.get(reduction)
        if op is None:
            raise ValueError(f"reduce of several tensors at once: unknown reduction {reduction!r}; use one of "
                             f"{sorted(_OPS)}")
        n, k = len(ranks), len(numels)
        total = sum(numels)
        ok, failed = _FLAGS[reduction]
        work = torch.empty(total + k, dtype=dtype, device=self.device)
        parts = list(work[:total].split(list(numels)))
        flags = work[total:]
        for i, t in enumerate(ts):
            if t is None:
                parts[i].zero_()
            else:
                parts[i].copy_(t.reshape(-1))
        flags.copy_(torch.tensor([ok if t is not None else failed for t in ts], dtype=dtype))  # one copy on GPU
        if n > 1:
            opts = dist.AllreduceOptions()
            opts.reduceOp = op
            self.group(ranks, stream).allreduce([work], opts).wait()
        good = (flags == ok).tolist()
        if reduction == "avg":
            flat = work[:total]
            flat.div_(n) if flat.is_floating_point() else flat.floor_divide_(n)
        out: list = []
        for t, p, fine in zip(ts, parts, good):
            if not fine or t is None:
                out.append(None)
            elif inplace:
                out.append(t.copy_(p.view(t.shape)))
            else:
                out.append(p.view(t.shape))
        return out

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
