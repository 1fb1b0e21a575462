"""Spawning procs on this machine: ``per_host`` sizes and their limit, ``_spawn_procs`` (the template forks
them), the keys and addresses they are told (``share_peers``), the older ``proc_mesh(gpus=4)``, and
``heal_mesh`` (new procs in place of lost ones)."""

from __future__ import annotations

from typing import Mapping

from ..config import setting
from ..runtime import _context
from ..shape import Shape
from ..transport.mailbox import current_mailbox, new_ipc_address
from .bootstrap import check_bootstrap, check_env, run_bootstrap
from .local import ProcInfo, _gpu_count
from .proc_mesh import ProcMesh, _agents_of, _live_meshes, local_host


def per_host_sizes(per_host: Mapping[str, int] | None) -> dict[str, int]:
    """``spawn_procs``' ``per_host`` as a dict; None is one proc per host, of the hosts' dims. Anything but a
    mapping is refused by name: ``per_host=2`` (a torchrun user's "2 procs per host") failed with "'int'
    object is not iterable", a list of names with a ``dict()`` error about update sequences."""
    if per_host is None:
        return {}
    if not isinstance(per_host, Mapping):
        raise TypeError(f"per_host must be a dict of dimension sizes, e.g. {{'gpus': 2}}, got {per_host!r}")
    return dict(per_host)


# The most procs one ``spawn_procs`` starts on each host unless the environment says otherwise: a guard
# against a typo such as ``{"gpus": 10**6}`` forking until the machine gives out.
def check_procs_per_host(per_host: dict, n: int) -> None:
    """Refuse ``n`` procs on each host above ``MONARCH_TENSOR_MAX_PROCS_PER_HOST`` (default 1024)."""
    limit = setting("MONARCH_TENSOR_MAX_PROCS_PER_HOST")
    if n > limit:
        raise ValueError(f"spawn_procs(per_host={per_host}) asks for {n} procs on each host, more than the limit of "
                         f"{limit}; set MONARCH_TENSOR_MAX_PROCS_PER_HOST to allow more")


def _spawn_procs(shape: Shape, proc_bind: list | None = None, per: int = 1,
                 python_exe: str | None = None, extra_env: dict[str, str] | None = None,
                 threads: int | None = None, rank_envs: list[dict] | None = None) -> ProcMesh:
    """Procs of ``shape`` on this machine; ``proc_bind`` (``_bind.check``ed) binds the ``per`` procs of
    each host; ``python_exe`` runs them (default: this interpreter); ``extra_env`` is added to their
    environment from the start, and ``rank_envs[r]`` to rank r's (``bootstrap_command``); ``threads``:
    torch's intra-op threads in each (``_threads``)."""
    mailbox = current_mailbox()
    n = len(shape)
    infos = [ProcInfo(new_ipc_address("proc"), r) for r in range(n)]
    gpus = _gpu_count()
    envs = []
    from .. import config
    from ..runtime import _bind, _threads

    settings = config.proc_env()  # configure()'s settings that procs act on
    live = len(local_procs())
    if threads is None and not _threads.user_set(extra_env) and not _bind.restricts_cpus(proc_bind):
        _threads.notice(n, live + n)
    for point in (shape.point(i) for i in range(n)):
        sharing = _bind.sharing(proc_bind, point.rank % per, live + n)
        env = {"MONARCH_TENSOR_RANK": str(point.rank), **settings, **_bind.env_for(proc_bind, point.rank % per),
               **_threads.env_for(threads, sharing)}
        if gpus and "gpus" in shape.names:
            env["CUDA_VISIBLE_DEVICES"] = str(point["gpus"] % gpus)
        if python_exe is not None:
            env[HOST_PYTHON_ENV] = python_exe
        envs.append({**env, **(extra_env or {}), **(rank_envs[point.rank] if rank_envs else {})})
    mesh = ProcMesh(infos, shape)
    _context.own(mesh)  # (spawned by an actor: its procs stop with it)
    mesh._python_exe = python_exe
    mesh._extra_env, mesh._rank_envs = extra_env, rank_envs  # heal_mesh starts the new procs alike
    for info in infos:
        info.owner = mesh
    local_host(python_exe).spawn(infos, mailbox.addr, envs)
    _live_meshes.add(mesh)
    share_peers(infos)
    return mesh


def local_procs() -> list[ProcInfo]:
    """The live procs this process spawned on its own host (not behind a host agent)."""
    return [p for mesh in list(_live_meshes) for p in mesh._procs
            if p.alive and getattr(p, "agent", None) is None]


def share_peers(procs: list[ProcInfo] | None = None) -> None:
    """Tell ``procs`` (default: every live proc this process spawned) of the host agents it attached to:
    those on this host get each agent's job key, so they reach the procs behind it and answer them; those
    behind an agent get the addresses of the other jobs' agents, whose procs they reach through this
    process's gateway (``remote_hosts._Gateway``). In order with this process's other messages to them:
    ahead of any call made after."""
    from ..transport import _curve
    from ..transport.messages import KnowPeers

    peers = _curve.peers()
    if not peers:
        return
    mailbox = current_mailbox()
    keys = KnowPeers(tuple((addr, k.public, k.secret) for addr, k in peers.items()))
    if procs is None:
        procs = [p for mesh in list(_live_meshes) for p in mesh._procs if p.alive]
    for p in procs:
        agent = getattr(p, "agent", None)
        if agent is None:
            mailbox.send(p.addr, keys)
            continue
        others = tuple(addr for addr, k in peers.items() if k.public != agent.keys.public)
        if others:
            mailbox.send(p.addr, KnowPeers((), others))


def _procs_shape(hosts: Shape, per_host: Mapping[str, int]) -> Shape:
    """The shape of procs spawned ``per_host`` on a host mesh of shape ``hosts``: its dims, then theirs."""
    for n in per_host:
        if n in hosts.names:
            raise ValueError(f"per_host cannot have a {n!r} dimension: the host mesh {hosts} has it")
    return Shape((*hosts.names, *per_host), (*hosts.dims, *per_host.values()))


# The interpreter a proc was started with by ``with_python_executable``: its own ``this_host()`` runs the procs
# it spawns with it too (as Monarch's host mesh keeps its bootstrap command), a wrapper script included.
HOST_PYTHON_ENV = "MONARCH_TENSOR_HOST_PYTHON"


def proc_mesh(*, gpus: int | None = None, hosts: int | None = None, env: dict[str, str] | None = None,
              setup=None, **dims: int) -> ProcMesh:
    """The older form: ``proc_mesh(gpus=4)`` (also awaitable: ``await proc_mesh(gpus=4)``). Monarch's ``env``
    is added to the procs' environment from their start; ``setup`` (a function) runs on every proc before
    the mesh is handed back, as ``spawn_procs(bootstrap=...)`` does."""
    check_env(env, "proc_mesh(env=...)")
    check_bootstrap(setup)
    sizes = {}
    if hosts is not None:
        sizes["hosts"] = hosts
    if gpus is not None:
        sizes["gpus"] = gpus
    sizes.update(dims)
    if not sizes:
        raise ValueError("proc_mesh needs at least one dimension, e.g. proc_mesh(gpus=4)")
    return run_bootstrap(_spawn_procs(Shape.from_sizes(sizes), extra_env=env), setup)


def heal_mesh(mesh: ProcMesh) -> ProcMesh:
    """A working mesh of the same sizes on the same hosts, in place of one that lost procs (the seeds'
    ``monarch.heal_mesh``): what is left of the old allocation is stopped, and new procs start (running the
    old mesh's ``bootstrap``). Actors and
    tensors of the old mesh are gone with it: spawn and make them again (from a checkpoint). A slice gives
    the same slice of the new mesh. A lost host is not replaced: ``HostUnreachableError`` says which."""
    if not isinstance(mesh, ProcMesh):
        raise TypeError(f"heal_mesh() takes a ProcMesh, got {type(mesh).__name__} {mesh!r}")
    alloc = mesh._alloc
    shape = alloc._shape
    agents = _agents_of(alloc._procs)
    bootstrap, proc_bind = getattr(alloc, "_bootstrap", None), getattr(alloc, "_proc_bind", None)
    threads = getattr(alloc, "_threads", None)
    alloc.stop()
    if not agents:
        per = len(proc_bind) if proc_bind else 1
        new = run_bootstrap(_spawn_procs(Shape(shape.names, shape.dims), proc_bind, per,
                                         getattr(alloc, "_python_exe", None), getattr(alloc, "_extra_env", None),
                                         threads=threads, rank_envs=getattr(alloc, "_rank_envs", None)), bootstrap)
    else:
        from ..errors import HostUnreachableError
        from .remote_hosts import RemoteHostMesh

        lost = [a.addr for a in agents if a.lost]
        if lost:
            raise HostUnreachableError(f"heal_mesh: the host agent(s) {lost} are lost, and this mesh cannot move "
                                       f"to other hosts by itself; start a job with spare hosts and spawn there")
        k = getattr(alloc, "_host_dims", 1)  # a job's procs: the hosts' dims, then the per-host dims
        new = RemoteHostMesh(agents, Shape(shape.names[:k], shape.dims[:k]), getattr(alloc, "_python_exe", None),
                             getattr(alloc, "_host_handle", None)).spawn_procs(
            dict(zip(shape.names[k:], shape.dims[k:])), bootstrap, proc_bind=proc_bind, threads=threads,
            _rank_envs=getattr(alloc, "_rank_envs", None))
    return new if mesh is alloc else ProcMesh(new._procs, mesh._shape, new)
