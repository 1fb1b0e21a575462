"""DTensor materialisation on a worker: torch ``DeviceMesh``es built from the proc mesh's process groups.

A global sharded tensor lives on each proc of its mesh as a
``torch.distributed.tensor.DTensor``. Its ``DeviceMesh`` is built here from one
process group per mesh dim (the ranks along that dim through this proc), made
by the same factory the engine's ``reduce`` uses, so torch's own sharding
propagation and redistribution run their collectives over those groups. No
default (world) process group is needed: a sliced mesh only involves its own
procs, and each group is created by its members alone.

The functions here are what the controller's ``distribute``, ``redistribute``,
``to_local`` and ``from_local`` run on every proc (as ``CallFunction``), and
what the tests call directly inside actors::

    groups = StoreGroups(rank, ("127.0.0.1", port))
    mesh = device_mesh(((0, 1), (2, 3)), ("dp", "tp"), rank, groups.backend)
    dt = distribute(torch.randn(8, 8), mesh, [Shard(0), Replicate()])
    (dt @ dt.T).full_tensor()
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Replicate, distribute_tensor

from monarch_tensor.config import setting
from monarch_tensor.transport._net import ip_towards

from . import collectives as _collectives
from .collectives import connect_store, is_nccl, new_group, register_name, user_group
from .shm_reduce import CrossHostTags, SameHostReduce

BackendFactory = Callable[[tuple], object]
"""``factory(ranks) -> c10d Backend`` for the group of proc ranks ``ranks`` (this proc among them)."""

_lock = threading.Lock()
_groups: dict[tuple, dist.ProcessGroup] = {}   # proc ranks -> registered ProcessGroup
_meshes: dict[tuple, DeviceMesh] = {}          # (grid, names) -> DeviceMesh


class StoreGroups:
    """Gloo (CPU) or NCCL (GPU) backends rendezvousing through a TCPStore.

    The tensor engine's DTensor meshes use one (``engine_mesh``), with ``lost``: then a gloo group whose
    members share a host also gets their shared-memory collectives (``same_host``), as the engine's own
    reduces do (``Collectives.group``). Tests and benchmarks that run DTensor inside plain actors use one
    without: no proc death would be reported to a shared-memory wait, while gloo's sockets see it.

    >>> groups = StoreGroups(rank, ("127.0.0.1", store.port))
    >>> mesh = device_mesh((0, 1), ("dp",), rank, groups.backend)
    """

    def __init__(self, rank: int, store_addr: tuple[str, int], device: torch.device | None = None,
                 prefix: str = "dt", lost: Callable[[tuple], list] | None = None) -> None:
        self.rank, self.prefix = rank, prefix
        self.device = device or torch.device("cpu")
        self.store_host = store_addr[0]
        self.store = connect_store(store_addr)
        self.lost = lost  # lost(ranks): those of ``ranks`` whose procs died

    def _store_of(self, ranks: tuple):
        return dist.PrefixStore(f"{self.prefix}/" + "_".join(map(str, ranks)) + "/", self.store)

    def backend(self, ranks: tuple):
        return new_group(self._store_of(ranks), ranks.index(self.rank), len(ranks), self.device, self.store_host)

    def same_host(self, ranks: tuple, backend) -> tuple | None:
        """For ``user_group``: (the group's ``SameHostReduce``, None, its ``lost()``) where ``backend`` is gloo's,
        every member runs on this host and they could map each other's files; (None, its ``CrossHostTags``, its
        ``lost()``) for another gloo group; else None. Every member calls it right after ``backend(ranks)`` and
        gets the same answer."""
        if self.lost is None or is_nccl(backend):
            return None
        me, n, lost = ranks.index(self.rank), len(ranks), self.lost
        shm = None if setting("MONARCH_TENSOR_NO_SHM_REDUCE") else \
            SameHostReduce.rendezvous(self._store_of(ranks), me, n)
        if shm is not None:
            return shm, None, lambda: lost(ranks)
        tags = CrossHostTags.rendezvous(self._store_of(ranks), me, n, ip_towards(self.store_host))
        return (None, tags, lambda: lost(ranks)) if tags is not None else None


class ProcDeviceMesh(DeviceMesh):
    """A ``DeviceMesh`` that takes this proc's ranks from itself, never from a default process group.

    torch's own asks the default (world) group for "my global rank" (``get_rank()``; ``get_local_rank``
    through ``dist.get_rank(group)``). On a mesh proc that group is the script's own, made by
    ``init_process_group`` in an actor or remote function, or none: the engine must neither make one
    (it would take ``init_process_group`` and ``is_initialized()`` away from user code) nor trust the
    script's to number ranks as the procs are. So this mesh answers from the proc rank it was built with
    and from its dim groups' own ranks.
    """

    def get_rank(self) -> int:
        return self._rank

    def get_local_rank(self, mesh_dim: int | str | None = None) -> int:
        return self.get_group(mesh_dim).rank()


def process_group(ranks: tuple, rank: int, factory: BackendFactory, device_type: str = "cpu",
                  same_host: Callable | None = None) -> dist.ProcessGroup:
    """The registered ``ProcessGroup`` over proc ranks ``ranks``, wrapping ``factory(ranks)`` (made once);
    ``same_host(ranks, backend)``: its shared-memory collectives, if any (``StoreGroups.same_host``)."""
    with _lock:
        pg = _groups.get(ranks)
        if pg is not None:
            return pg
        backend = factory(ranks)
        me, n = ranks.index(rank), len(ranks)
        shm, tags, lost = (same_host(ranks, backend) if same_host is not None else None) or (None, None, None)
        pg = user_group(backend, me, n, torch.device(device_type), same_host=shm, tags=tags, lost=lost)
        name = "monarch_tensor:" + "_".join(map(str, ranks))
        pg._set_group_name(name)
        register_name(name, pg)  # (by name only: ProcDeviceMesh needs none of c10d's tables of the script's groups)
        _groups[ranks] = pg
        return pg


def dim_groups(grid: torch.Tensor, rank: int) -> list[tuple]:
    """Per mesh dim, the proc ranks along that dim through ``rank`` (``grid``: proc ranks, one per mesh point)."""
    out = []
    for d in range(grid.ndim):
        rows = grid.movedim(d, -1).reshape(-1, grid.shape[d]).tolist()
        out.append(next(tuple(r) for r in rows if rank in r))
    return out


def device_mesh(grid: Sequence, names: Sequence[str], rank: int, factory: BackendFactory,
                device_type: str = "cpu", same_host: Callable | None = None) -> DeviceMesh:
    """The torch ``DeviceMesh`` of a proc mesh: ``grid`` nests its proc ranks in mesh order, ``names`` its dims
    (``same_host``: see ``process_group``).

    >>> mesh = device_mesh(((0, 1), (2, 3)), ("dp", "tp"), rank, groups.backend)
    """
    grid_t = torch.tensor(grid, dtype=torch.int, device="cpu")  # (DeviceMesh wants it there, on GPU workers too)
    key = (tuple(grid_t.flatten().tolist()), tuple(grid_t.shape), tuple(names), device_type)
    mesh = _meshes.get(key)
    if mesh is not None:
        return mesh
    if rank not in key[0]:
        raise ValueError(f"proc rank {rank} is not in the mesh {grid_t.tolist()}")
    if len(names) != grid_t.ndim:
        raise ValueError(f"{len(names)} dim names {tuple(names)} for a {grid_t.ndim}-dim mesh")
    _install_strided_cost_estimate()
    pgs = [process_group(g, rank, factory, device_type, same_host) for g in dim_groups(grid_t, rank)]
    mesh = ProcDeviceMesh(device_type, grid_t, mesh_dim_names=tuple(names), _init_backend=False, _rank=rank)
    mesh._dim_group_names = [pg.group_name for pg in pgs]
    for pg in pgs:
        mesh._pg_registry[pg.group_name] = pg
    _meshes[key] = mesh
    return mesh


def distribute(value: torch.Tensor, mesh: DeviceMesh, placements: Sequence[Placement],
               requires_grad: bool = False) -> DTensor:
    """``value`` (the whole tensor, the same on every rank) as a DTensor; each rank keeps its shard, no traffic."""
    dt = distribute_tensor(value.detach(), mesh, list(placements), src_data_rank=None)
    return dt.requires_grad_(requires_grad) if requires_grad else dt


def redistribute(dt: DTensor, placements: Sequence[Placement]) -> DTensor:
    """``dt`` with other placements (torch performs the collectives)."""
    return dt.redistribute(dt.device_mesh, list(placements))


def replicate_over(dt: DTensor, dim: int) -> DTensor:
    """``dt`` with ``Replicate()`` on mesh dim ``dim``, its other placements as they are: always a new,
    contiguous tensor (the controller holds the result as one, with a contiguous layout, so it must not share
    memory with ``dt``, nor have other strides)."""
    places = list(dt.placements)
    if isinstance(places[dim], Replicate):
        out = DTensor.from_local(dt.to_local().clone(memory_format=torch.contiguous_format), dt.device_mesh,
                                 places, run_check=False, shape=dt.shape, stride=_contiguous(dt.shape))
    else:
        places[dim] = Replicate()
        out = dt.redistribute(dt.device_mesh, places)
    return out if out.is_contiguous() else out.contiguous()


def _contiguous(shape) -> tuple:
    stride, step = [], 1
    for n in reversed(tuple(shape)):
        stride.append(step)
        step *= max(n, 1)
    return tuple(reversed(stride))


def to_local(dt: DTensor) -> torch.Tensor:
    """This rank's shard of ``dt`` as a plain tensor."""
    return dt.to_local()


def from_local(local: torch.Tensor, mesh: DeviceMesh, placements: Sequence[Placement],
               shape: Sequence[int] | None = None, stride: Sequence[int] | None = None) -> DTensor:
    """A DTensor whose shard on this rank is ``local`` (no traffic; ``shape`` the global shape if uneven)."""
    return DTensor.from_local(local, mesh, list(placements), run_check=False,
                              shape=torch.Size(shape) if shape is not None else None,
                              stride=tuple(stride) if stride is not None else None)


def full_tensor(dt: DTensor) -> torch.Tensor:
    """The whole value of ``dt`` on every rank (an all-gather / all-reduce as its placements need)."""
    return dt.full_tensor()


def describe(dt) -> tuple:
    """``(placements, local shape)`` of a DTensor (``None`` for a plain tensor): a test and debugging aid."""
    if isinstance(dt, DTensor):
        return tuple(dt.placements), tuple(dt.to_local().shape)
    return None


# ---- entry points of the tensor engine (run as CallFunction on every proc of the mesh) -----------------
MeshSpec = tuple  # (store_addr, grid, names): how the controller names a proc mesh
_store_groups: dict[tuple, StoreGroups] = {}


def _lost(ranks: tuple) -> list:
    return sorted(_collectives.dead_procs.intersection(ranks))


_strided_costs_installed = False


def _install_strided_cost_estimate() -> None:
    """Make DTensor's choice of a strategy quick for ops on ``_StridedShard`` inputs (once per process).

    DTensor rates each candidate sharding strategy of an op by the cost of redistributing its inputs to it.
    A view that merges a dim sharded on one mesh dim with one sharded on another (attention's batch and heads on
    {dp, tp}, reshaped for ``bmm``) gives a ``_StridedShard``, and torch rates moves from or to one with its
    graph search of redistribution plans: seconds per candidate, a minute for a small GPT's first step on a
    2-D mesh. Here such a move is rated as the same move of plain ``Shard``s plus gathering the input, so a
    candidate that keeps the inputs as they are (cost 0) wins as before, and one torch deems impossible (no
    shard order) stays impossible. Only the rating changes: the redistribution that runs is torch's own plan."""
    global _strided_costs_installed
    if _strided_costs_installed:
        return
    from torch.distributed.tensor import _collective_utils, _utils
    from torch.distributed.tensor._dtensor_spec import DTensorSpec
    from torch.distributed.tensor._ops import utils as _ops_utils
    from torch.distributed.tensor.placement_types import Shard, _StridedShard

    torch_cost = _collective_utils.redistribute_cost

    def plain(spec: DTensorSpec, gathered: bool = False) -> DTensorSpec:
        places = tuple(Replicate() if gathered else Shard(p.dim) if isinstance(p, _StridedShard) else p
                       for p in spec.placements)
        return DTensorSpec(spec.mesh, places, tensor_meta=spec.tensor_meta)

    def redistribute_cost(current: DTensorSpec, target: DTensorSpec) -> float:
        if current.placements == target.placements or not any(
                isinstance(p, _StridedShard) for p in (*current.placements, *target.placements)):
            return torch_cost(current, target)
        if current.mesh != target.mesh or current.shard_order is None or target.shard_order is None:
            return float("inf")
        if current.is_replicated():
            return 0.0
        return torch_cost(plain(current), plain(target)) + torch_cost(plain(current), plain(current, gathered=True))

    for module in (_collective_utils, _utils, _ops_utils):
        if getattr(module, "redistribute_cost", None) is torch_cost:
            module.redistribute_cost = redistribute_cost  # type: ignore[attr-defined]
    _strided_costs_installed = True


def engine_mesh(rank: torch.Tensor, spec: MeshSpec, device: torch.device) -> DeviceMesh:
    """The DeviceMesh of ``spec`` on this proc (``rank``: this proc's rank, a 0-dim tensor)."""
    store_addr, grid, names = spec
    r = int(rank)
    key = (tuple(store_addr), r, device.type)
    with _lock:
        groups = _store_groups.get(key)
        if groups is None:
            groups = _store_groups[key] = StoreGroups(r, tuple(store_addr), device, lost=_lost)
    mesh = device_mesh(grid, names, r, groups.backend, device.type, groups.same_host)
    # plain mesh tensors mixed into DTensor ops (constants, optimizer step counts) count as replicated
    DTensor._op_dispatcher._allow_implicit_replication = True
    return mesh


def engine_distribute(value: torch.Tensor, rank: torch.Tensor, spec: MeshSpec, placements) -> DTensor:
    """``distribute`` for the engine: ``value`` is the whole tensor (the same on every rank)."""
    return distribute(value, engine_mesh(rank, spec, value.device), placements)


def engine_from_local(local: torch.Tensor, rank: torch.Tensor, spec: MeshSpec, placements, shape, stride) -> DTensor:
    """``from_local`` for the engine: this rank's shard ``local`` of a tensor of global ``shape``."""
    return from_local(local, engine_mesh(rank, spec, local.device), placements, shape, stride)


def placements_of(dt) -> tuple:
    """The placements of a DTensor (what the controller asks when it does not know them)."""
    if not isinstance(dt, DTensor):
        raise TypeError(f"expected a DTensor on the worker, found a {type(dt).__name__}")
    return tuple(dt.placements)
