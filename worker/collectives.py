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

import threading
from datetime import timedelta

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import AllgatherOptions as _AllgatherOptions  # (not in torch.distributed)
from torch._C._distributed_c10d import _create_work_from_future, _register_process_group, _resolve_process_group
from torch.utils._pytree import tree_leaves, tree_map

from monarch_tensor.config import setting
from monarch_tensor.transport._net import ip_towards

from .dummy_group import _Done
from .shm_reduce import CrossHostTags, SameHostReduce

TIMEOUT = setting("MONARCH_TENSOR_COLLECTIVE_TIMEOUT")
dead_procs: set[int] = set()  # this proc's mesh's procs that died: the TensorWorker's Collectives.dead (worker.py)
# How long a worker whose collective failed waits for the controller to say a member's proc died (see
# Collectives._wait): a peer that died breaks the collective at once, its death report follows shortly.
DEATH_REPORT_WAIT_S = 5.0

_OPS = {
    "sum": dist.ReduceOp.SUM, "avg": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX,
    "min": dist.ReduceOp.MIN, "product": dist.ReduceOp.PRODUCT,
}
# The flag element each member adds to an all-reduce, (input there, input failed): reduced with the
# same op, the result stays the first only when every member had its input.
_FLAGS = {"sum": (0, 1), "avg": (0, 1), "max": (0, 1), "min": (1, 0), "product": (1, 0)}


class _Waited(_Done):
    """A send's or recv's gloo ``Work`` that ``_staged`` waited for already: torch's ``send``/``recv`` (and a
    user's ``isend(...).wait()``) wait again on what they get, and a second ``wait()`` of a gloo send or
    recv never returns."""

    def __init__(self, work) -> None:
        super().__init__(None)
        self._work = work

    def result(self):
        return self._work.result()

    def __getattr__(self, name: str):
        return getattr(self._work, name)  # (recv_anysource's _source_rank(), say)


class StagedGroup(dist.ProcessGroup):
    """A gloo group that takes tensors on any device: a CUDA tensor is copied to the CPU, the collective runs
    there, and the result is copied back. It stands for gloo wherever user code or DTensor may hand it CUDA
    tensors (procs sharing a GPU, where NCCL refuses them): gloo's own CUDA support covers a few collectives,
    and DTensor's collectives handed to it as CUDA tensors crashed the procs (SIGSEGV; torch 2.11, H100).
    CPU tensors go to gloo as they are. Each call completes before it returns (the ``Work`` it gives is gloo's, done).
    Where the group's procs share a host (``same_host``), its all-reduce, all-gather and reduce-scatter of
    contiguous CPU tensors by sum, max, min or product, its all-to-all in equal parts and its broadcast go
    through shared memory instead (``SameHostReduce``; the same choice on every member: it depends on the
    call's arguments only). Its collectives that go through gloo are tagged first (``_staged``), through shared
    memory on one host and through connections of their own across hosts (``CrossHostTags``), so that a member
    that skipped one fails it rather than pairs it with its next."""

    def __init__(self, backend, rank: int, size: int, same_host=None, tags=None, lost=None) -> None:
        super().__init__(rank, size)
        self.backend, self._name = backend, ""
        self._shm, self._lost = same_host, lost
        self._tags = same_host if same_host is not None else tags  # what tags each collective (see _staged)

    def getBackendName(self) -> str:
        return "gloo"

    def _set_group_name(self, name: str) -> None:  # kept here too: the C++ side asks Python for it
        super()._set_group_name(name)
        self._name = name

    @property
    def group_name(self) -> str:
        return self._name

    def _staged(self, method: str, outs: list, ins: list, *rest):
        """``backend.method(*outs-and-ins staged, *rest)``: ``outs`` and ``ins`` are the call's tensor
        arguments in order, pytree-nested (lists of tensors); ``outs`` are copied back after it. A collective
        of a same-host group first checks through shared memory that every member is in it (``sync``):
        gloo would pair it with whatever collective a member that skipped it runs next. A group across hosts
        checks the same through connections of its own (``CrossHostTags``)."""
        if self._tags is not None and method not in _P2P:
            self._tags.sync(method, self._lost, TIMEOUT)
        staged_outs = tree_map(_to_host, outs)
        staged_ins = tree_map(_to_host, ins)
        work = getattr(self.backend, method)(*staged_outs, *staged_ins, *rest)
        work.wait()
        for t, h in zip(tree_leaves(outs), tree_leaves(staged_outs)):
            if t is not h:
                t.copy_(h)
        return work

    def allreduce(self, tensors, opts=None):
        opts = opts or dist.AllreduceOptions()
        how = _shm_op(opts.reduceOp) if self._shm is not None and len(tensors) == 1 else None
        if how is not None and self._shm.takes(tensors[0]):
            self._shm.allreduce(tensors[0], how, self._lost, TIMEOUT)
            return _done(tensors)
        return self._staged("allreduce", [tensors], [], opts)

    def allreduce_coalesced(self, tensors, opts=None):
        return self._staged("allreduce_coalesced", [tensors], [], opts or dist.AllreduceCoalescedOptions())

    def allgather(self, outputs, inputs, opts=None):
        return self._staged("allgather", [outputs], [inputs], opts or _AllgatherOptions())

    def _allgather_base(self, output, input, opts=None):
        if self._shm is not None and self._shm.takes(output, input) and output.dtype == input.dtype \
                and output.numel() == input.numel() * self.size():
            self._shm.allgather(output, input, self._lost, TIMEOUT)
            return _done([output])
        return self._staged("_allgather_base", [output], [input], opts or _AllgatherOptions())

    def allgather_into_tensor_coalesced(self, outputs, inputs, opts=None):
        return _each(self._allgather_base, outputs, inputs, opts)

    def reduce_scatter(self, outputs, inputs, opts=None):
        return self._staged("reduce_scatter", [outputs], [inputs], opts or dist.ReduceScatterOptions())

    def _reduce_scatter_base(self, output, input, opts=None):
        opts = opts or dist.ReduceScatterOptions()
        how = _shm_op(opts.reduceOp) if self._shm is not None else None
        if how is not None and self._shm.takes(output, input) and output.dtype == input.dtype \
                and input.numel() == output.numel() * self.size():
            self._shm.reduce_scatter(output, input, how, self._lost, TIMEOUT)
            return _done([output])
        return self._staged("_reduce_scatter_base", [output], [input], opts)

    def reduce_scatter_tensor_coalesced(self, outputs, inputs, opts=None):
        return _each(self._reduce_scatter_base, outputs, inputs, opts)

    # torch 2.13's names of the two above (dist.all_gather_into_tensor and reduce_scatter_tensor call these)
    def all_gather_single(self, output, input, opts=None):
        return self._allgather_base(output, input, opts)

    def reduce_scatter_single(self, output, input, opts=None):
        return self._reduce_scatter_base(output, input, opts)

    def monitored_barrier(self, timeout=None, wait_all_ranks: bool = False):
        if hasattr(self.backend, "monitored_barrier"):
            return self.backend.monitored_barrier(timeout, wait_all_ranks=wait_all_ranks)
        return self.barrier()

    def alltoall_base(self, output, input, output_split_sizes, input_split_sizes, opts=None):
        # Through shared memory only with no split sizes given (equal parts): sizes may differ between members,
        # and each member's choice must be the same.
        if self._shm is not None and not output_split_sizes and not input_split_sizes \
                and self._shm.takes(output, input) and output.dtype == input.dtype \
                and output.numel() == input.numel() and input.numel() % self.size() == 0:
            self._shm.alltoall(output, input, self._lost, TIMEOUT)
            return _done([output])
        return self._staged("alltoall_base", [output], [input], output_split_sizes, input_split_sizes,
                            opts or dist.AllToAllOptions())

    def alltoall(self, outputs, inputs, opts=None):
        return self._staged("alltoall", [outputs], [inputs], opts or dist.AllToAllOptions())

    def broadcast(self, tensors, opts=None):
        opts = opts or dist.BroadcastOptions()
        if self._shm is not None and len(tensors) == 1 and opts.rootTensor == 0 and self._shm.takes(tensors[0]):
            self._shm.broadcast(tensors[0], opts.rootRank, self._lost, TIMEOUT)
            return _done(tensors)
        return self._staged("broadcast", [tensors], [], opts)

    def reduce(self, tensors, opts=None):
        return self._staged("reduce", [tensors], [], opts or dist.ReduceOptions())

    def gather(self, outputs, inputs, opts=None):
        return self._staged("gather", [outputs], [inputs], opts or dist.GatherOptions())

    def scatter(self, outputs, inputs, opts=None):
        return self._staged("scatter", [outputs], [inputs], opts or dist.ScatterOptions())

    def send(self, tensors, dst, tag=0):
        return _Waited(self._staged("send", [], [tensors], dst, tag))

    def recv(self, tensors, src, tag=0):
        return _Waited(self._staged("recv", [tensors], [], src, tag))

    def recv_anysource(self, tensors, tag=0):
        return _Waited(self._staged("recv_anysource", [tensors], [], tag))

    def barrier(self, opts=None):
        return self.backend.barrier(opts or dist.BarrierOptions())


# torch's reduce ops that the shared-memory collectives take, with their names there.
_SHM_OPS = ((dist.ReduceOp.SUM, "sum"), (dist.ReduceOp.MAX, "max"), (dist.ReduceOp.MIN, "min"),
            (dist.ReduceOp.PRODUCT, "product"))


_P2P = frozenset({"send", "recv", "recv_anysource"})  # (two members of the group, not all)


def _shm_op(op) -> str | None:
    """The shared-memory collectives' name of torch's reduce op ``op``; None for one they do not take."""
    return next((name for red, name in _SHM_OPS if op == red), None)


def _done(tensors: list):
    """A ``Work`` that is complete, with ``tensors`` as its result."""
    fut = torch.futures.Future()
    fut.set_result(tensors)
    return _create_work_from_future(fut)


def _each(method, outputs, inputs, opts):
    """A coalesced collective as one ``method(output, input, opts)`` per pair, in order; the last one's Work
    (each is done when it returns)."""
    work = None
    for o, i in zip(outputs, inputs):
        work = method(o, i, opts)
    return work


def _to_host(t):
    return t.cpu() if isinstance(t, torch.Tensor) and t.is_cuda else t


def connect_store(store_addr: tuple[str, int]) -> dist.TCPStore:
    """A client of the controller's rendezvous store."""
    host, port = store_addr
    return dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=TIMEOUT))


def gpu_identity(device: torch.device) -> str:
    """Which GPU ``device`` is, as the members of a group compare them (its UUID; "" for the CPU)."""
    return str(torch.cuda.get_device_properties(device).uuid) if device.type == "cuda" else ""


def gpus_distinct(store, me: int, n: int, device: torch.device) -> bool:
    """Whether each of the ``n`` members (this one ``me``) has a GPU of its own: each tells ``store`` which
    GPU it has and reads the others'. NCCL refuses two ranks on one GPU ("Duplicate GPU detected"), which is
    what a mesh of more procs than the host has GPUs gives (procs of ``{"gpus": 4}`` on a one-GPU laptop)."""
    mine = gpu_identity(device)
    store.set(f"gpu/{me}", mine)
    ids = [mine if r == me else store.get(f"gpu/{r}").decode() for r in range(n)]
    return all(ids) and len(set(ids)) == n


def is_nccl(backend) -> bool:
    return type(backend).__name__ == "ProcessGroupNCCL"


def user_group(backend, me: int, n: int, device: torch.device, store=None, cpu_backend=None,
               same_host=None, tags=None, lost=None) -> dist.ProcessGroup:
    """``backend`` (``new_group``'s) as a ``ProcessGroup`` that user code and DTensor take: NCCL's registered
    for ``device`` (and ``cpu_backend``, if given, for CPU tensors), gloo's as a ``StagedGroup`` (CUDA tensors
    too, through the CPU; ``same_host``: the group's ``SameHostReduce``, for the collectives it takes, or
    ``tags``: its ``CrossHostTags``; ``lost()``: the ranks of members that died)."""
    if not is_nccl(backend):
        return StagedGroup(backend, me, n, same_host, tags, lost)
    pg = dist.ProcessGroup(store if store is not None else dist.HashStore(), me, n)  # (the backend has its own)
    nccl = dist.ProcessGroup.BackendType.NCCL
    pg._register_backend(device, nccl, backend)
    if cpu_backend is not None:
        pg._register_backend(_CPU, dist.ProcessGroup.BackendType.GLOO, cpu_backend)
    pg._set_default_backend(nccl)
    return pg


def new_group(store, me: int, n: int, device: torch.device, store_host: str) -> dist.ProcessGroup:
    """The process group of ``n`` ranks (this one ``me``) meeting in ``store``: NCCL where every member has a
    GPU of its own, else gloo bound to this host's address on the route to the store's host (the one the
    other hosts can reach). The members of one group are alike (every proc of a host sees its GPUs or none),
    so all of them take the same branch."""
    if device.type == "cuda" and gpus_distinct(store, me, n, device):
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
    try:  # by name too, for the functional collectives (torch.distributed._functional_collectives)
        from torch._C._distributed_c10d import _register_process_group

        _register_process_group(name, pg)
    except (ImportError, RuntimeError):  # (a torch without it; the name taken already)
        pass


def _registered(pg) -> bool:
    return pg in getattr(getattr(dist.distributed_c10d, "_world", None), "pg_map", {})


def _unregister(pg) -> None:
    world = getattr(dist.distributed_c10d, "_world", None)
    for table in ("pg_map", "pg_names", "pg_group_ranks", "pg_backend_config"):
        getattr(world, table, {}).pop(pg, None)


_named: list[tuple[str, dist.ProcessGroup]] = []  # what register_name entered, in order
_named_lock = threading.Lock()


def register_name(name: str, pg: dist.ProcessGroup) -> None:
    """Enter ``pg`` in torch's registry of groups by name only (the functional collectives, and so DTensor,
    look a mesh's groups up by name), not in ``torch.distributed``'s tables of the script's groups: the
    script's ``destroy_process_group()`` shuts down every group in those. ``restore_names`` enters it again
    where that emptied the registry of names."""
    with _named_lock:
        _register_process_group(name, pg)
        _named.append((name, pg))


def restore_names() -> None:
    """Enter the groups of ``register_name`` again if torch's registry of names lost them: the script's own
    ``dist.destroy_process_group()`` (an actor's or remote function's cleanup on these procs) empties it,
    and DTensors made before still name their groups there. The tensor worker calls this before each op
    (one look-up, or nothing on a proc without such groups)."""
    if not _named:
        return
    try:
        _resolve_process_group(_named[0][0])  # all of them leave together, so the first tells
        return
    except RuntimeError:
        pass
    with _named_lock:
        for name, pg in _named:
            try:
                _register_process_group(name, pg)
            except RuntimeError:  # (entered again meanwhile, by another stream's thread)
                pass


class Collectives:
    """The process groups of one worker, keyed by their member ranks."""

    def __init__(self, rank: int, store_addr: tuple[str, int] | None, device: torch.device) -> None:
        self.rank, self.store_addr, self.device = rank, store_addr, device
        self._store = None
        self._groups: dict[tuple, object] = {}
        self._registrations: dict[tuple, tuple] = {}  # a user group's key -> _register's arguments for it
        self._flags: dict[tuple, torch.Tensor] = {}
        self._shm: dict[tuple, SameHostReduce] = {}  # a gloo group's shared-memory all-reduce, where it has one
        self._tags: dict[tuple, CrossHostTags] = {}  # a gloo group's tags where it has no shared memory (across hosts)
        self.dead: set[int] = set()  # ranks of this mesh whose procs died (the controller tells: peers_died)
        self._dead_cv = threading.Condition()

    def peers_died(self, ranks) -> None:
        """Procs of these ranks died: a group of theirs still forming fails now, later ones at once."""
        with self._dead_cv:
            self.dead.update(ranks)
            self._dead_cv.notify_all()

    def _wait(self, work, ranks: tuple[int, ...]) -> None:
        """``work.wait()``, a collective of the group of ``ranks``. A member whose proc died breaks it at once
        (gloo: "Connection reset by peer"), before the controller has seen the death: this waits, up to
        ``DEATH_REPORT_WAIT_S``, for the controller's report (``peers_died``), so that the failure names the
        dead ranks and reaches the script after the death. The controller fails the script's waiting fetch
        with the death's ``SupervisionError`` before it tells the workers (``host._proc_exited``), so the
        script sees the death, not the broken collective, and the death counts as seen there."""
        try:
            work.wait()
        except Exception as e:
            with self._dead_cv:
                self._dead_cv.wait_for(lambda: self.dead.intersection(ranks), timeout=DEATH_REPORT_WAIT_S)
                lost = sorted(self.dead.intersection(ranks))
            if lost:
                raise RuntimeError(f"the procs of rank(s) {lost} of this group died during the collective") from e
            raise

    def _form(self, ranks: tuple[int, ...], make):
        """``make()``, a new group's rendezvous, on a thread of its own while this one waits for it or for the
        death of a member: a proc that died before the group formed left the others in the rendezvous for
        ``TIMEOUT`` (300 s), their stream (so their later work, on slices without the dead proc too) with them.
        The abandoned rendezvous ends on its own timeout."""
        def lost():
            return sorted(self.dead.intersection(ranks))

        if lost():
            raise RuntimeError(f"the procs of rank(s) {lost()} of this group died: it cannot form")
        out: dict = {}

        def run() -> None:
            try:
                out["group"] = make()
            except BaseException as e:  # noqa: BLE001 - raised on the waiting thread
                out["error"] = e
            finally:
                with self._dead_cv:
                    self._dead_cv.notify_all()

        threading.Thread(target=run, daemon=True, name="monarch-tensor-rendezvous").start()
        with self._dead_cv:
            while not out and not lost():
                self._dead_cv.wait()
        if "group" in out:
            return out["group"]
        if "error" in out:
            raise out["error"]
        raise RuntimeError(f"the procs of rank(s) {lost()} of this group died while it formed")

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
            prefix = f"pg/{stream}/" + "_".join(map(str, ranks)) + "/"

            def make():
                # A connection to the store of its own: a rendezvous abandoned for a dead member keeps waiting
                # on its connection (until its timeout), which later groups' rendezvous would queue behind.
                self._base_store()  # (its errors, on this thread)
                store = dist.PrefixStore(prefix, connect_store(self.store_addr))
                me, n = ranks.index(self.rank), len(ranks)
                made = new_group(store, me, n, self.device, self.store_addr[0])
                if not is_nccl(made):
                    shm = None if setting("MONARCH_TENSOR_NO_SHM_REDUCE") else SameHostReduce.rendezvous(store, me, n)
                    if shm is not None:
                        self._shm[key] = shm
                    else:  # (the user's collectives on it are tagged through connections of their own)
                        tags = CrossHostTags.rendezvous(store, me, n, ip_towards(self.store_addr[0]))
                        if tags is not None:
                            self._tags[key] = tags
                return made

            pg = self._groups[key] = self._form(ranks, make)
        return pg

    def process_group(self, ranks: tuple[int, ...], stream: int = 0) -> dist.ProcessGroup:
        """The group of ``ranks`` for ``stream`` as ``torch.distributed`` takes it from user code: a
        ``ProcessGroup`` around the same backend ``group`` makes, registered with torch so that calls that
        name global ranks work (``dist.broadcast(t, src=r, group=pg)``, ``dist.send(t, dst=r, group=pg)``,
        ``get_process_group_ranks``): a global rank is a proc's rank in its mesh."""
        key = ("pg", ranks, stream)
        pg = self._groups.get(key)
        if pg is not None and not _registered(pg):
            # The script's own dist.destroy_process_group() (an actor's torchrun-style cleanup on these procs)
            # empties torch's registry, this group's entry too: enter it again.
            _register(pg, *self._registrations[key])
        if pg is None:
            backend = self.group(ranks, stream)
            prefix = f"pg/{stream}/" + "_".join(map(str, ranks)) + "/user/"
            store = dist.PrefixStore(prefix, self._base_store())
            me, n = ranks.index(self.rank), len(ranks)
            cpu = None
            if is_nccl(backend):  # CPU tensors on a gloo group of their own (torch's default)
                cpu = new_group(dist.PrefixStore(prefix + "cpu/", self._base_store()), me, n, _CPU,
                                self.store_addr[0])
            pg = user_group(backend, me, n, self.device, store, cpu, self._shm.get((ranks, stream)),
                            self._tags.get((ranks, stream)), lambda: sorted(self.dead.intersection(ranks)))
            name = f"monarch_tensor/{stream}/" + "_".join(map(str, ranks))
            pg._set_group_name(name)
            self._registrations[key] = (name, "nccl" if is_nccl(backend) else "gloo", store, ranks)
            _register(pg, *self._registrations[key])
            self._groups[key] = pg
        return pg

    def close(self) -> None:
        """Forget the groups made for user code (torch's registry keeps them otherwise)."""
        for key, pg in list(self._groups.items()):
            if key[0] == "pg":
                _unregister(pg)
                del self._groups[key]

    def _flagged(self, t: torch.Tensor | None, numel: int, dtype: torch.dtype, ok: int, failed: int,
                 device: torch.device) -> torch.Tensor:
        """``t`` flattened, one flag element after it: ``ok``; or, for a failed input (None), zeros and ``failed``;
        on ``device``."""
        if t is None:
            buf = torch.zeros(numel + 1, dtype=dtype, device=device)
            buf[numel] = failed
            return buf
        key = (dtype, ok, device)
        flag = self._flags.get(key)
        if flag is None:
            flag = self._flags[key] = torch.full((1,), ok, dtype=dtype, device=device)
        return torch.cat((t.reshape(-1).to(device), flag))

    def _on(self, ranks: tuple[int, ...], stream: int, t: torch.Tensor | None):
        """The group of ``ranks`` (None for one rank) and the device its collectives take: the GPU for NCCL,
        the CPU for gloo (a tensor elsewhere is copied there and its result back), ``t``'s own for one rank."""
        if len(ranks) == 1:
            return None, (t.device if t is not None else self.device)
        pg = self.group(ranks, stream)
        return pg, (self.device if is_nccl(pg) else _CPU)

    def _allreduce(self, pg, work: torch.Tensor, reduction: str, ranks: tuple[int, ...], stream: int) -> None:
        """``work`` all-reduced in place over ``pg``, the group of ``ranks`` on ``stream``: through shared memory
        where the group has it and it takes ``work`` (the same choice on every member), else ``pg``'s."""
        shm = self._shm.get((ranks, stream))
        if shm is not None and shm.takes(work):
            shm.allreduce(work, reduction, lambda: sorted(self.dead.intersection(ranks)), TIMEOUT)
            return
        opts = dist.AllreduceOptions()
        opts.reduceOp = _OPS[reduction]
        self._wait(pg.allreduce([work], opts), ranks)

    def reduce_many(self, ts: list, ranks: tuple[int, ...], reduction: str, inplace: bool, stream: int,
                    numels: tuple, dtype: torch.dtype) -> list:
        """``reduce`` of several tensors of one ``dtype`` in one collective (not "stack", no scatter): a flag per
        tensor, then the tensors side by side, in one buffer (through a same-host group's shared memory, written
        straight from the tensors: ``SameHostReduce.allreduce_many``). ``ts[i]`` None: this rank's input i failed (it
        takes part with zeros). The results: per tensor, its result (a view of the buffer, or ``ts[i]``
        written in place), or None where some member's input i failed."""
        if reduction not in _OPS:
            raise ValueError(f"reduce of several tensors at once: unknown reduction {reduction!r}; use one of "
                             f"{sorted(_OPS)}")
        n, k = len(ranks), len(numels)
        total = sum(numels)
        ok, failed = _FLAGS[reduction]
        pg, device = self._on(ranks, stream, next((t for t in ts if t is not None), None))
        shm = self._shm.get((ranks, stream)) if n > 1 else None
        if shm is not None and _direct(shm, ts, dtype, numels):
            # Straight from the tensors into the shared slot: no buffer of them all to fill first.
            flags = torch.tensor([ok if t is not None else failed for t in ts], dtype=dtype)
            good, outs = shm.allreduce_many(ts, numels, flags, ok, reduction,
                                            lambda: sorted(self.dead.intersection(ranks)), TIMEOUT,
                                            into=ts if inplace else None)
            return [None if t is None or o is None else t if inplace else o.view(t.shape) for t, o in zip(ts, outs)]
        # The flags first, as the direct path above lays them out in the slots: a member that takes this path
        # (its input failed, say, where others take that one) exchanges the same bytes at the same places.
        work = torch.empty(k + total, dtype=dtype, device=device)
        flags = work[:k]
        parts = list(work[k:].split(list(numels)))
        for i, t in enumerate(ts):
            if t is None:
                parts[i].zero_()
            else:
                parts[i].copy_(t.reshape(-1))
        flags.copy_(torch.tensor([ok if t is not None else failed for t in ts], dtype=dtype))  # one copy on GPU
        if n > 1:
            self._allreduce(pg, work, reduction, ranks, stream)
        good = (flags == ok).tolist()
        if reduction == "avg":
            flat = work[k:]
            flat.div_(n) if flat.is_floating_point() else flat.floor_divide_(n)
        out: list = []
        for t, p, fine in zip(ts, parts, good):
            if not fine or t is None:
                out.append(None)
            elif inplace:
                out.append(t.copy_(p.view(t.shape)))
            else:
                out.append(_home(p.view(t.shape), t.device))
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
        pg, device = self._on(ranks, stream, t)
        home = t.device if t is not None else device
        if reduction == "stack":
            buf = self._flagged(t, numel, dtype, 0, 1, device)
            if n == 1:
                return buf[:numel].view(shape).unsqueeze(0)
            shm = self._shm.get((ranks, stream))
            if shm is not None and shm.takes(buf):  # (the same choice on every member: buf is a CPU tensor)
                gathered = torch.empty((n, buf.numel()), dtype=buf.dtype)
                shm.allgather(gathered, buf, lambda: sorted(self.dead.intersection(ranks)), TIMEOUT)
            else:
                outs = [torch.empty_like(buf) for _ in range(n)]
                self._wait(pg.allgather([outs], [buf]), ranks)
                gathered = torch.stack(outs)
            if bool(gathered[:, numel].any()):
                return None
            return _home(gathered[:, :numel].reshape((n, *shape)), home)
        if reduction not in _OPS:
            raise ValueError(f"unknown reduction {reduction!r}; use one of {sorted(_OPS) + ['stack']}")
        ok, failed = _FLAGS[reduction]
        work = self._flagged(t, numel, dtype, ok, failed, device)
        if n > 1:
            self._allreduce(pg, work, reduction, ranks, stream)
            if work[numel].item() != ok:
                return None
        out = work[:numel].view(shape)
        if reduction == "avg":
            out.div_(n) if out.is_floating_point() else out.floor_divide_(n)
        if scatter:
            part = out.chunk(n)[me]
            return part.clone() if part.device == home else part.to(home)
        if inplace:
            t.copy_(out)
            return t
        return _home(out, home)


_CPU = torch.device("cpu")


def _home(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``t`` on ``device`` (a collective's result back where its input was)."""
    return t if t.device == device else t.to(device)


def _direct(shm: SameHostReduce, ts: list, dtype: torch.dtype, numels) -> bool:
    """Whether ``reduce_many`` can go straight through ``shm``'s slots: the inputs present (None: failed) are
    contiguous CPU tensors of ``dtype`` and of their ``numels`` that it takes (else the other path, which
    raises for a size that differs). Members may choose differently (one whose input failed sees fewer
    tensors): both paths put the same bytes at the same places of the slots."""
    return all(t is None or (t.dtype == dtype and t.numel() == k) for t, k in zip(ts, numels)) \
        and shm.takes(*(t for t in ts if t is not None))
