"""The tensor engine's public functions: activate, fetch, collectives, remote, streams, moving tensors.

>>> procs = this_host().spawn_procs(per_host={"gpus": 2})
>>> with procs.activate():
...     x = torch.ones(4) + procs.rank_tensor("gpus")
...     y = x.reduce("gpus", "sum")
...     print(fetch_shard(y, gpus=0).result())
tensor([3., 3., 3., 3.])
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import sys
import threading
import warnings
from collections.abc import Mapping
from typing import Any

import torch
from monarch_tensor.worker import messages as m
from monarch_tensor.worker.containers import rebuild
from monarch_tensor.worker.opaque import OpaqueRef
from torch.overrides import _get_current_function_mode_stack
from torch.utils import _pytree as pytree
from torch.utils._device import DeviceContext, _device_constructors

from monarch_tensor import _wire
from monarch_tensor.future import Future

from .arguments import mesh_leaves, to_wire
from .client import Ctx, MeshClient, user_loc
from .errors import BorrowError, MeshTensorError
from .process_group import RemoteProcessGroup
from .tensor import (
    Loans,
    Tensor,
    borrowing,
    check_live,
    check_readable,
    check_writable,
    contiguous_meta,
    forget_value,
    intern_meta,
    loans_of,
    memory_span,
    mutable_loans,
    record,
    state,
)

RECV_TIMEOUT = 300.0
EXECUTOR = "_mt_execute"  # the actors of ProcMesh.execute (host.ProcMesh._runner)


# ---- meshes ------------------------------------------------------------------------------------------
def client_for(pm) -> MeshClient:
    alloc = pm._alloc
    c = getattr(alloc, "_tensor_client", None)
    if alloc._stopped:
        pm._check_alive()  # raises MeshStoppedError
    if c is None:
        with _client_lock:  # (two threads activating a fresh mesh at once: one client, one worker actor)
            c = getattr(alloc, "_tensor_client", None)
            if c is None:
                pm._check_alive()
                c = alloc._tensor_client = MeshClient(alloc)
                _install_optimizer_hook()
    return c


_client_lock = threading.Lock()


def ctx_for(pm, stream: Stream | None = None) -> Ctx:
    return client_for(pm).ctx(pm, stream or state.stream or _MAIN)


@contextlib.contextmanager
def activate(pm):
    """``with proc_mesh.activate():`` factories (``torch.zeros``, modules...) make tensors on ``pm``."""
    _install_factories()
    client_for(pm)
    prev = state.ctx_mesh
    state.ctx_mesh = pm
    try:
        yield pm
    finally:
        state.ctx_mesh = prev


class _NoMesh:
    """``with no_mesh():`` (or ``no_mesh.activate()``): factories make ordinary local tensors again."""

    @contextlib.contextmanager
    def activate(self):
        prev = state.ctx_mesh
        state.ctx_mesh = None
        try:
            yield
        finally:
            state.ctx_mesh = prev

    def __call__(self):
        return self.activate()


no_mesh = _NoMesh()


def get_active_mesh():
    """The proc mesh of the innermost ``with procs.activate():`` (Monarch's); a ValueError outside one."""
    if state.ctx_mesh is None:
        raise ValueError("no mesh is active: get_active_mesh() works inside `with procs.activate():`")
    return state.ctx_mesh


def rank_tensor(pm, dim: str) -> Tensor:
    """Each rank's coordinate along ``dim`` as a 0-dim int64 mesh tensor: ``procs.rank_tensor("gpus")``."""
    if dim not in pm._shape.names:
        raise KeyError(f"mesh has no dimension {dim!r}; its dimensions are {list(pm._shape.names)}")
    ctx = ctx_for(pm)
    shape = pm._shape
    coords = {r: shape.point(i)[dim] for i, r in enumerate(shape.ranks())}
    ref = next(ctx.client.refs)
    ctx.client.issue(m.CreateRank(ref, coords, ctx.sid), ctx.ranks)
    meta = contiguous_meta((), torch.int64)
    return Tensor(meta, intern_meta(meta), ctx, ref)


def shard_batch(batch, dims, mesh=None):
    """Each rank's own slice of a global batch: ``x, y = shard_batch((x, y), "dp")`` inside ``activate()``.

    ``batch``: a tensor or a pytree of them (a DataLoader's ``(inputs, targets)``) holding the whole global
    batch; each one's dim 0 is split in equal chunks over the ranks of the named ``dims`` (a name or a list
    of names), rank ``i`` along them getting chunk ``i``, as ``torch.chunk`` and ``DistributedSampler`` with
    ``shuffle=False`` order them; ranks that differ only along other dims get the same chunk. A local
    tensor's chunks travel to their ranks only; a mesh tensor (the same global batch on every rank) is
    sliced where it lives. ``mesh``: the mesh to put local tensors on (default: the active one).

    >>> for x, y in DataLoader(data, batch_size=64):  # doctest: +SKIP
    ...     x, y = shard_batch((x, y), "dp")          # 64 // dp rows on each dp rank
    """
    if isinstance(dims, str):
        dims = (dims,)
    elif not (isinstance(dims, (tuple, list)) and dims and all(isinstance(d, str) for d in dims)):
        raise TypeError(f"shard_batch's dims must be a dimension name or a list of them, such as 'dp', not {dims!r}")
    leaves, spec = pytree.tree_flatten(batch)
    if not leaves or not all(isinstance(x, torch.Tensor) for x in leaves):
        raise TypeError(f"shard_batch takes a tensor or tuples, lists and dicts of tensors, got {type(batch).__name__}")
    return pytree.tree_unflatten([_shard_one(x, tuple(dims), mesh) for x in leaves], spec)


def _shard_one(x, dims: tuple, mesh) -> Tensor:
    if type(x) is Tensor:
        if mesh is not None and mesh is not x._ctx.pm:
            raise MeshTensorError("shard_batch(mesh=...) places local tensors; this one is a mesh tensor already "
                                  "(move it with to_mesh)")
        pm = x._ctx.pm
    else:
        pm = mesh if mesh is not None else state.ctx_mesh
        if pm is None:
            raise MeshTensorError("shard_batch: no mesh to put the batch on: call it inside `with procs.activate():` "
                                  "or pass mesh=procs")
        if isinstance(x, Tensor) or x.device.type == "meta" or type(x) not in (torch.Tensor, torch.nn.Parameter):
            raise MeshTensorError(f"shard_batch takes plain local tensors or mesh tensors, not {type(x).__name__} "
                                  f"on {x.device}")
    shape = pm._shape
    groups = _groups(shape, dims)
    n = len(groups[0])
    if x.dim() == 0 or x.shape[0] % n:
        raise ValueError(f"shard_batch over {dims} ({n} ranks) needs tensors whose dim 0 divides by {n}, got shape "
                         f"{tuple(x.shape)}: pick a batch size that is a multiple of {n} (drop_last=True drops a "
                         f"short last batch)")
    index = {r: j for g in groups for j, r in enumerate(g)}  # each rank's chunk
    ctx = ctx_for(pm)
    client = ctx.client
    rows = x.shape[0] // n
    if type(x) is Tensor:
        ref = next(client.refs)
        client.issue(m.CreateRank(ref, index, ctx.sid), ctx.ranks)
        meta = contiguous_meta((), torch.int64)
        which = Tensor(meta, intern_meta(meta), ctx, ref)
        return x.reshape(n, rows, *x.shape[1:]).index_select(0, which.reshape(1)).reshape(rows, *x.shape[1:])
    chunks = x.detach().reshape(n, rows, *x.shape[1:])
    ref = next(client.refs)
    for r in ctx.ranks:  # one upload per rank, each its own chunk (a message each)
        client.issue(m.CreateValue(ref, chunks[index[r]].clone(), ctx.sid), (r,))
    meta = contiguous_meta((rows, *x.shape[1:]), x.dtype)
    return Tensor(meta, intern_meta(meta), ctx, ref)


# ---- factories inside activate() -------------------------------------------------------------------
_FACTORIES = ("zeros", "ones", "empty", "full", "rand", "randn", "randint", "randperm", "arange", "linspace",
              "logspace", "eye", "tensor", "as_tensor", "scalar_tensor", "empty_strided", "normal", "zeros_like",
              "ones_like", "empty_like", "full_like", "rand_like", "randn_like")
_installed = False


class _FactoryMode(torch.utils._python_dispatch.TorchDispatchMode):
    def __init__(self, ctx: Ctx) -> None:
        super().__init__()
        self.ctx = ctx

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return record(func, args, kwargs or {}, self.ctx)


def _device_context() -> bool:
    """Whether a default device is in force here (``with torch.device(d):``, ``torch.set_default_device``)."""
    return any(isinstance(m, DeviceContext) for m in _get_current_function_mode_stack())


def _holds_mesh_tensor(data) -> bool:
    return any(type(x) is Tensor or (type(x) in (list, tuple) and _holds_mesh_tensor(x)) for x in data)


def _called_by_data_loading() -> bool:
    """Whether the factory wrapper calling this was called by ``torch.utils.data``: a DataLoader's seed
    (``torch.empty((), dtype=torch.int64).random_().item()``), a sampler's permutation, a collate's
    ``torch.tensor(numbers)``. That is the script's own bookkeeping, local as in a plain run."""
    return sys._getframe(2).f_globals.get("__name__", "").startswith("torch.utils.data")


# The factories with which torch.utils.data draws from the global generator: a DataLoader's seed and a
# RandomSampler's are ``torch.empty((), dtype=torch.int64).random_()``, a SubsetRandomSampler's permutation
# and random_split's are ``torch.randperm``. (A collate's ``torch.tensor(numbers)`` draws nothing.)
_LOADER_DRAWS = frozenset(("empty", "rand", "randn", "randint", "randperm", "normal"))


def _lend_generator(pm) -> None:
    """torch.utils.data is about to draw from the global generator. In a local run that generator is the one
    the model's random ops draw from too; inside activate() those draw on the workers, whose generators the
    controller's does not follow. So the controller's takes the workers' state now (rank 0's: a fetch from
    each rank, after the ops issued so far), the loader draws from it here, and if every rank had that state,
    the state the loader leaves goes back to every rank before the next instruction to the mesh: the same
    numbers as a local run, both ways. Ranks with different states (``set_manual_seed_remote(s,
    process_idx=...)``) keep theirs: the loader draws from rank 0's, and theirs do not move.
    Nothing issued to the mesh since the last fetch: the controller's state is the workers' already."""
    client = client_for(pm)
    if client.on_next_issue is not None:
        return
    ctx = client.ctx(pm, _MAIN)
    loc = user_loc()
    replies = [client.request(r, lambda port: m.FetchValue(((), {}), "torch.get_rng_state", port, ctx.sid, loc),
                              "the workers' generator state", mesh=ctx.ranks) for r in ctx.ranks]
    states = [f.result(RECV_TIMEOUT) for f in replies]
    torch.default_generator.set_state(states[0])
    if all(torch.equal(s, states[0]) for s in states[1:]):
        client.on_next_issue = functools.partial(_give_back_generator, ctx)
    else:
        client.on_next_issue = _keep_generators


def _give_back_generator(ctx: Ctx) -> None:
    """The controller's generator state, as the loader left it, to every rank (see ``_lend_generator``)."""
    state = torch.default_generator.get_state()
    ctx.client.issue(m.CallFunction("torch.set_rng_state", (state,), {}, (), (), ctx.sid, user_loc()), ctx.ranks)


def _keep_generators() -> None:
    """The ranks' generators had different states (see ``_lend_generator``): they keep them."""


_optimizer_hooked = False


def _install_optimizer_hook() -> None:
    """Wrap ``Optimizer._process_value_according_to_param_policy`` (once; every mesh client's first use)."""
    global _optimizer_hooked
    if _optimizer_hooked:
        return
    _optimizer_hooked = True
    # optimizer.load_state_dict() moves each state tensor to its parameter with ``value.to(device=param.device)``;
    # a mesh tensor names the CPU as its device, so a local checkpoint's state stayed local and the next step()
    # failed. Here it goes to the parameter's mesh, as a module's load_state_dict copies local values there; a
    # distributed parameter's state is distributed like it (a scalar such as ``step`` stays local, as the
    # optimizer makes it), and state of another shape than such a parameter's fails here, naming it.
    optimizer = torch.optim.Optimizer
    process = optimizer._process_value_according_to_param_policy

    @functools.wraps(process)
    def process_value(param, value, param_id=None, param_groups=None, key=None):
        # (imported here: torch.distributed.tensor costs a second or two, which the first spawn's warm-up pays
        # in the background; a script that imports the engine must not pay it up front)
        from .dtensor import distribute, placements_of
        from .placements import ShardingError

        out = process(param, value, param_id, param_groups, key)
        if type(param) is not Tensor or type(out) is not torch.Tensor:
            return out
        if param._dist is None:
            return record(torch.ops.aten.clone.default, (out,), {}, param._ctx)  # (a local tensor is uploaded)
        if out.dim() == 0 and param.dim() > 0:
            return out
        if out.shape != param.shape:
            raise ShardingError(f"optimizer.load_state_dict: the state {key!r} of parameter {param_id} has shape "
                                f"{tuple(out.shape)}, but the parameter is distributed with shape "
                                f"{tuple(param.shape)}, so it cannot be placed like it; load a state made for this "
                                f"model (monarch_tensor.checkpoint.set_optimizer_state_dict names parameters by FQN)")
        return distribute(out, param._dist.mesh, placements_of(param))

    optimizer._process_value_according_to_param_policy = staticmethod(process_value)


def _install_factories() -> None:
    """Wrap torch's factory functions: inside ``activate()`` they create mesh tensors.

    Only factories pay for a dispatch mode; ops on mesh tensors dispatch on the
    tensor subclass directly, which is several times cheaper than a mode on every op.
    """
    global _installed
    if _installed:
        return
    _installed = True
    # ``with torch.device(d):`` (torch's DeviceContext) recognises factories by identity, in a set it builds on
    # first use: build it now, of torch's own functions, or it would hold these wrappers and miss the calls.
    _device_constructors()
    for name in _FACTORIES:
        orig = getattr(torch, name)

        def make(orig):
            @functools.wraps(orig)
            def factory(*args, **kwargs):
                pm = state.ctx_mesh
                if pm is None or state.internal or _wire.decoding():  # (a message's tensors being rebuilt)
                    return orig(*args, **kwargs)
                if _called_by_data_loading():
                    if orig.__name__ in _LOADER_DRAWS and kwargs.get("generator") in (None, torch.default_generator):
                        _lend_generator(pm)
                    return orig(*args, **kwargs)
                if any(type(a) is Tensor for a in args):  # *_like of a mesh tensor: dispatches already
                    return orig(*args, **kwargs)
                if args and type(args[0]) in (list, tuple) and _holds_mesh_tensor(args[0]):
                    raise MeshTensorError(f"torch.{orig.__name__}() of a list holding mesh tensors would read their "
                                          f"values here, but they live on the workers; torch.stack(list) makes the "
                                          f"tensor there")
                # The workers put it on their device; the controller needs no GPU (nor a CUDA build) to record it,
                # whether the device is named or comes from ``with torch.device("cuda"):``.
                if kwargs.get("device") is not None or _device_context():
                    kwargs = {**kwargs, "device": "cpu"}
                with _FactoryMode(ctx_for(pm)):
                    return orig(*args, **kwargs)
            return factory

        setattr(torch, name, make(orig))
    # random_split draws with the torch.randperm its module imported by name: it draws through the wrapper too.
    from torch.utils.data import dataset

    dataset.randperm = torch.randperm
    seed = torch.manual_seed

    @functools.wraps(seed)
    def manual_seed(value):
        """Inside ``activate()``, also seeds every worker of the mesh (same random numbers as a local run)."""
        pm = state.ctx_mesh
        if pm is None or state.internal:
            return seed(value)
        try:  # here first: a seed torch refuses must not reach the workers
            gen = seed(value)
        except (TypeError, ValueError, RuntimeError) as e:
            raise type(e)(f"torch.manual_seed({value!r}) inside activate(): the seed must be an int in "
                          f"[-2**63, 2**64) ({e})") from None
        ctx = ctx_for(pm)
        ctx.client.issue(m.CallFunction("torch.manual_seed", (int(value),), {}, (), (), ctx.sid, user_loc()),
                         ctx.ranks)
        return gen

    # The generator's state, saved and restored: inside activate(), the workers' (torch.utils.checkpoint saves
    # it at the forward and restores it to recompute: a dropout there drew another mask on the workers, and
    # the gradients were wrong). A mesh tensor of states goes back to its workers, wherever it is restored.
    from monarch_tensor.builtins import random as _random  # (imported before the wrappers: it reads a state)

    get_state, set_state = torch.get_rng_state, torch.set_rng_state

    @functools.wraps(get_state)
    def get_rng_state():
        """Inside ``activate()``, each worker's CPU generator state, as a mesh tensor."""
        if state.ctx_mesh is None or state.internal:
            return get_state()
        return _random.get_rng_state_remote()

    @functools.wraps(set_state)
    def set_rng_state(new_state):
        """A mesh tensor of states (from ``torch.get_rng_state()`` inside ``activate()``) sets the workers'."""
        if type(new_state) is Tensor:
            _random.set_rng_state_remote(new_state)
            return None
        return set_state(new_state)

    torch.manual_seed = torch.random.manual_seed = manual_seed
    torch.get_rng_state = torch.random.get_rng_state = get_rng_state
    torch.set_rng_state = torch.random.set_rng_state = set_rng_state


    # F.one_hot(t) without num_classes sizes its result by t.max().item() + 1, a read of the value that torch
    # makes inside the op: refused, it named an .item() the script never called. It is an op whose output
    # shape depends on the data, and says so as the others do. Torch checks the class values only for a
    # tensor of its own (not a subclass's), so recorded as aten ops a class value out of range gave a wrong
    # result and no error: a value only the workers know runs torch's own one_hot there (its error comes at
    # a fetch, as other workers' errors do), and a value the controller knows is checked here.
    one_hot = torch.nn.functional.one_hot
    one_hot_on_workers = Remote("torch.nn.functional.one_hot", propagate=one_hot)

    @functools.wraps(one_hot)
    def one_hot_(tensor, num_classes=-1):
        if type(tensor) is not Tensor or tensor._dist is not None:
            return one_hot(tensor, num_classes)
        if hasattr(tensor, "_val"):
            one_hot(tensor._val, num_classes)  # (torch's error, at the line)
            return one_hot(tensor, num_classes)
        if num_classes < 0:
            raise MeshTensorError("torch.nn.functional.one_hot(t) without num_classes has an output shape that "
                                  "depends on the data (t.max() + 1), which the controller cannot know; pass "
                                  "num_classes, or compute it in a remote() function with propagate=... instead")
        return one_hot_on_workers(tensor, num_classes)

    torch.nn.functional.one_hot = one_hot_

    # nn.init.trunc_normal_ (GPT-2's, ViT's init) draws by rejection: it redraws the values out of [a, b] until
    # none is left, a loop on `mask.any()` that reads the data, which the controller cannot. It runs on the
    # workers instead, whole, so each rank's generator draws and advances as a local run's would. A
    # torch.Generator passed travels as a copy of its state (as to any random op on mesh tensors), and the
    # script's own moves on as much: the draws depend only on the tensor's shape and dtype and the generator,
    # not on the values, so the same call here on a stand-in of that shape draws what the workers draw.
    trunc_normal = torch.nn.init.trunc_normal_
    trunc_normal_on_workers = Remote(_trunc_normal_on_workers, propagate=_none)

    @functools.wraps(trunc_normal)
    def trunc_normal_(tensor, mean=0.0, std=1.0, a=-2.0, b=2.0, generator=None):
        if type(tensor) is not Tensor or tensor._dist is not None:
            return trunc_normal(tensor, mean, std, a, b, generator=generator)
        trunc_normal_on_workers(tensor, mean, std, a, b, generator)
        if generator is not None:
            with no_mesh.activate():  # (its factories, torch.empty_like..., make local tensors)
                stand_in = torch.empty(tensor.shape, dtype=tensor.dtype, device=generator.device)
                trunc_normal(stand_in, mean, std, a, b, generator=generator)
        return tensor

    torch.nn.init.trunc_normal_ = trunc_normal_

    # torch.compile (Dynamo) compiles each Python frame that a compiled function calls, the engine's recording
    # of an op on a mesh tensor too: it broke its graph at every other line there and ended in a RecursionError
    # after a minute. Dynamo leaves the engine's packages alone: an op on mesh tensors in a compiled function
    # is a graph break (as for any tensor subclass Dynamo cannot trace) and is recorded as without compile.
    # (torch._dynamo is imported already, or soon: the fake-tensor mode imports it.)
    from torch._dynamo import trace_rules

    for package in ("controller", "worker", "monarch_tensor"):
        trace_rules.add(package)


# ---- fetching ----------------------------------------------------------------------------------------
def _leaves_ctx(obj, what: str = "fetch_shard") -> tuple[list, Ctx | None]:
    leaves = mesh_leaves(obj, what)
    ctx = leaves[0]._ctx if leaves else None
    for t in leaves:
        check_live(t._ctx, what)
        if t._ctx.client is not ctx.client or t._ctx.ranks != ctx.ranks:
            raise MeshTensorError(f"{what}: the tensors live on different meshes ({ctx.pm._label()} and "
                                  f"{t._ctx.pm._label()}); move one with t.to_mesh(mesh)")
        if t._ctx.sid != ctx.sid:
            raise MeshTensorError(f"{what}: the tensors live on different streams ({ctx.stream.name!r} and "
                                  f"{t._ctx.stream.name!r}); borrow one with stream.borrow(t)")
    check_readable(what, leaves)
    return leaves, ctx


def _to_wire(obj, what: str = ""):
    return to_wire(obj, what)


def _rank_of(ctx: Ctx, shard: dict | None, kwargs: dict) -> int:
    if shard is not None and not isinstance(shard, Mapping):
        raise TypeError(f"shard must be a dict of coordinates such as {{'gpus': 1}} (or keywords: gpus=1), "
                        f"not {type(shard).__name__} {shard!r}")
    coords = dict(shard or {})
    coords.update(kwargs)
    shape = ctx.pm._shape
    unknown = set(coords) - set(shape.names)
    if unknown:
        raise KeyError(f"mesh {shape} has no dimension(s) {sorted(unknown)}")
    full = {n: coords.get(n, 0) for n in shape.names}
    return shape.slice(**full).offset


def fetch_shard(obj: Any, shard: dict[str, int] | None = None, **kwargs: int) -> Future:
    """The value of ``obj``'s mesh tensors on one rank, as CPU tensors: ``fetch_shard(t, gpus=1).result()``.

    Unnamed dims default to coordinate 0. Raises ``RemoteException`` (on
    ``.result()``) if the value depends on an op that failed.
    """
    leaves, ctx = _leaves_ctx(obj)
    if ctx is None:
        return Future.ready(obj)
    rank = _rank_of(ctx, shard, kwargs)
    value, sid, loc = _to_wire(obj), ctx.sid, user_loc()
    return ctx.client.request(rank, lambda port: m.FetchValue(value, None, port, sid, loc), mesh=ctx.ranks)


def call_actor(actors, ranks: list[int], method: str, args: tuple, kwargs: dict, port) -> None:
    """An actor call whose arguments hold mesh tensors: each rank's actor gets its own local tensors.

    The call goes down the tensor engine's instruction stream of the tensors' mesh, so it runs after the
    ops issued before it, and the stream waits for the endpoint to return (the actor borrows the tensors
    while it runs); calls sent to the actor later still run after it. The actor must live on procs of
    the tensors' mesh.
    """
    from monarch_tensor import _wire

    what = f"{actors._name}.{method}"
    if actors._name == EXECUTOR and len(args) == 3:  # procs.execute(fn, *a, **kw): errors name fn's arguments
        what = f"execute({getattr(args[0], '__name__', 'fn')})"
        mesh_leaves(args[1:], what)
    _refuse_process_groups((args, kwargs), what)
    leaves, ctx = _leaves_ctx((args, kwargs), what)
    if ctx is None:
        raise MeshTensorError(f"{what}: mesh tensors inside objects other than lists, tuples, dicts, named tuples "
                              "and dataclasses cannot be passed to an actor")
    client = ctx.client
    index = {a: i for i, a in enumerate(client.addrs)}
    targets = [index.get(actors._procs[r].addr) for r in ranks]
    if None in targets or not set(targets) <= set(ctx.ranks):
        raise MeshTensorError(f"{what}: the mesh tensors passed live on {ctx.pm._label()}, not on the procs of actor "
                              f"mesh {actors._name!r}; move them with to_mesh() or fetch them with fetch_shard()")
    instr = m.CallActor(actors._name, method, *_to_wire((args, kwargs), what), port, ctx.sid, user_loc())
    try:
        _wire.encode(instr)  # before it joins a batch: a mesh tensor hidden in another object must not sink one
    except MeshTensorError:
        raise MeshTensorError(f"{what}: mesh tensors inside objects other than tuples, lists and dicts cannot be "
                              "passed to an actor") from None
    client.issue(instr, tuple(sorted(targets)))
    forget_value(leaves)  # the actor may write the tensors it is lent
    client.flush()


def actor_rref(actors, method: str, wire_method: str, propagate, args: tuple, kwargs: dict):
    """``actors.method.rref(*args)`` (Monarch's): call the endpoint on every rank of the tensor engine's mesh as
    an instruction of its stream, and give its tensor results back as mesh tensors, shaped by the endpoint's
    ``propagate`` (called on fake tensors of the arguments' shapes). The mesh is the arguments' mesh, else the
    active one, else the actors' own procs; every proc of it must hold one of the actors."""
    from monarch_tensor import _wire

    what = f"{actors._name}.{method}.rref"
    if not callable(propagate):
        raise MeshTensorError(f"{what}: rref needs the shapes of the endpoint's results before it runs: declare "
                              f"@endpoint(propagate=fn), where fn takes the endpoint's arguments (fake tensors) and "
                              f"returns tensors of the result's shapes" +
                              ("" if propagate is None else f" (got propagate={propagate!r})"))
    leaves, ctx = _leaves_ctx((args, kwargs), what)
    if ctx is None:
        pm = state.ctx_mesh or actors._proc_mesh
        if pm is None:
            raise MeshTensorError(f"{what}: no mesh to make the results on: activate one (with procs.activate():)")
        ctx = ctx_for(pm)
    client = ctx.client
    index = {a: i for i, a in enumerate(client.addrs)}
    targets = sorted(i for i in (index.get(actors._procs[r].addr) for r in actors._rank_list) if i is not None)
    if targets != sorted(ctx.ranks):
        raise MeshTensorError(f"{what}: its results would live on {ctx.pm._label()}, but actor mesh "
                              f"{actors._name!r} is not on exactly those procs: slice the actors (or the mesh) "
                              f"so that every proc holds one actor")
    from .tensor import _rebuild, _scan, describe_outputs, meta_of, to_fake

    _refuse_process_groups((args, kwargs), what)
    key: list = []
    tensors: list = []
    local: list = []
    _scan((args, kwargs), key, tensors, local)
    if local:
        raise MeshTensorError(f"{what}: pass mesh tensors, not local tensors (create them inside activate())")
    leaves_spec, struct = Remote(method, propagate)._describe(args, kwargs, tensors, ctx, to_fake, describe_outputs,
                                                              meta_of)
    for leaf in leaves_spec:
        if leaf[0] != "new":
            raise MeshTensorError(f"{what}: propagate must return only new tensors (each result is a tensor the "
                                  f"endpoint makes), got {leaf[0]} {leaf[1]!r}")
    vals, outs, metas = _outputs(leaves_spec, tensors, ctx)
    if not outs:
        raise MeshTensorError(f"{what}: propagate returned no tensor; call endpoints without tensor results "
                              f"with call() or broadcast()")
    instr = m.CallActor(actors._name, wire_method, *_to_wire((args, kwargs), what), None, ctx.sid, user_loc(),
                        tuple(outs), tuple(metas))
    try:
        _wire.encode(instr)
    except MeshTensorError:
        raise MeshTensorError(f"{what}: mesh tensors inside objects other than tuples, lists and dicts cannot be "
                              "passed to an actor") from None
    client.issue(instr, tuple(ctx.ranks))
    forget_value(leaves)  # the actor may write the tensors it is lent
    return _rebuild(struct, iter(vals))


def inspect(obj: Any, shard: dict[str, int] | None = None, **kwargs: int) -> Any:
    """``fetch_shard(obj, ...).result()``: the value on one rank, now."""
    return fetch_shard(obj, shard, **kwargs).result()


def preview(t: Tensor):
    """Every rank's value of mesh tensor ``t``, fetched now (a synchronisation): a ``ValueMesh`` of CPU tensors,
    which prints each rank's value as torch prints a tensor (and shows as a table in Jupyter). A global
    (DTensor) tensor has one value: ``t.full_tensor()``."""
    from monarch_tensor.actor import ValueMesh

    if type(t) is not Tensor:
        raise TypeError(f"preview() takes a mesh tensor, got {type(t).__name__}")
    if t._dist is not None:
        return t.full_tensor()
    shape = t._ctx.pm._shape
    futures = [fetch_shard(t, dict(shape.point(i))) for i in range(len(shape))]
    return ValueMesh(shape, [f.result() for f in futures])


def show(obj: Any, shard: dict[str, int] | None = None, **kwargs: int) -> Any:
    """``inspect`` one rank's value, then draw it with ``torchshow.show`` (Monarch's; torchshow is optional)."""
    try:
        from torchshow import show as draw
    except ImportError:
        raise ImportError("show() draws tensors with torchshow, which is not installed: pip install torchshow "
                          "(or use inspect() for the value)") from None
    value = inspect(obj, shard, **kwargs)
    with no_mesh.activate():
        return draw(value)


# ---- collectives --------------------------------------------------------------------------------------
@functools.lru_cache(maxsize=1024)
def _groups(shape, dims: tuple) -> tuple:
    names = shape.names
    for d in dims:
        if d not in names:
            raise KeyError(f"mesh {shape} has no dimension {d!r}")
    other = [n for n in names if n not in dims]
    stride = dict(zip(names, shape.strides))
    size = shape.sizes
    groups = []
    for oc in itertools.product(*(range(size[n]) for n in other)):
        base = shape.offset + sum(c * stride[n] for c, n in zip(oc, other))
        red = [n for n in names if n in dims]
        groups.append(tuple(base + sum(c * stride[n] for c, n in zip(rc, red))
                            for rc in itertools.product(*(range(size[n]) for n in red))))
    return tuple(groups)


_REDUCTIONS = ("sum", "avg", "max", "min", "product", "stack")


def _reduce_tree(tensors, dims, reduction: str, scatter: bool, inplace: bool):
    """Every mesh tensor of a pytree reduced, the structure kept. The leaves go out in one held batch, those
    of one mesh and dtype one after another, so that the client folds each such run into one collective
    (``MeshClient._fuse``: a ``ReduceMany``, one buffer as DDP's buckets; not for "stack" or ``scatter``)."""
    from .client import coalescing

    leaves, spec = pytree.tree_flatten(tensors)
    runs: dict = {}
    for i, t in enumerate(leaves):
        runs.setdefault((id(getattr(t, "_ctx", None)), getattr(t, "dtype", None)), []).append(i)
    out: list = [None] * len(leaves)
    with coalescing():
        for run in runs.values():
            for i in run:
                out[i] = _reduce(leaves[i], dims, reduction, scatter, inplace)
    return pytree.tree_unflatten(out, spec)


def _reduce(t: Tensor, dims, reduction: str, scatter: bool, inplace: bool) -> Tensor:
    if type(t) is not Tensor:
        raise TypeError(f"reduce needs a mesh tensor, got {type(t).__name__}")
    check_live(t._ctx, "reduce")
    check_readable("reduce", (t,))
    if reduction not in _REDUCTIONS:
        raise ValueError(f"unknown reduction {reduction!r}; use one of {list(_REDUCTIONS)}")
    if isinstance(dims, str):
        dims = (dims,)
    elif isinstance(dims, (tuple, list)) and all(isinstance(d, str) for d in dims):
        dims = tuple(dims)
    else:
        raise TypeError(f"reduce's dims must be a dimension name or a list of them, such as 'gpus', not {dims!r}")
    ctx = t._ctx
    active = state.stream
    if (active.id if active else 0) != ctx.sid:
        raise MeshTensorError(f"reduce: the tensor lives on stream {ctx.stream.name!r}, not the active one")
    groups = _groups(ctx.pm._shape, dims)
    n = len(groups[0])
    shape = tuple(t.shape)
    if reduction == "stack":
        if scatter or inplace:
            raise ValueError("reduction 'stack' (all-gather) cannot be combined with scatter=True or reduce_")
        out_shape = (n,) + shape
    elif scatter:
        if inplace:
            raise ValueError("reduce_ cannot scatter (the result has a different shape); use reduce(scatter=True)")
        if not shape or shape[0] % n:
            raise ValueError(f"reduce(scatter=True) over {n} ranks needs a first dimension divisible by {n}, "
                             f"got shape {shape}")
        out_shape = (shape[0] // n,) + shape[1:]
    else:
        out_shape = shape
    client = ctx.client
    if inplace:
        check_writable("reduce_", t)
        forget_value(t)
        client.issue(m.Reduce(t._ref, t._ref, groups, reduction, scatter, True, t.numel(), t.dtype, ctx.sid,
                              user_loc()), ctx.ranks, memory=memory_span(t))
        return t
    ref = next(client.refs)
    meta = contiguous_meta(out_shape, t.dtype)
    client.issue(m.Reduce(ref, t._ref, groups, reduction, scatter, False, t.numel(), t.dtype, ctx.sid, user_loc()),
                 ctx.ranks)
    return Tensor(meta, intern_meta(meta), ctx, ref)


def _refuse_mesh(mesh, what: str) -> None:
    """``reduce(..., mesh=m)`` was accepted and ignored (the result stayed on the tensor's mesh): refused, as
    Monarch's reduce refuses it."""
    if mesh is not None:
        raise NotImplementedError(f"{what}(mesh=...) is not supported (a reduce's result lives on its tensor's "
                                  f"mesh): move the result with to_mesh(mesh), or keep some ranks' with slice_mesh(...)")


def reduce(tensors, dims, reduction: str = "sum", scatter: bool = False, mesh=None, out=None):
    """Collective over the ranks of the named ``dims`` (gloo on CPU, NCCL on GPU).

    ``reduce(t, "gpus", "sum")`` all-reduces; ``"avg"``, ``"max"``, ``"min"``,
    ``"product"`` likewise; ``"stack"`` all-gathers into a new first dim;
    ``scatter=True`` reduce-scatters along the first dim. ``tensors`` may be a
    pytree of mesh tensors (Monarch's): each leaf is reduced (each must be one), the structure kept; the
    leaves of one dtype go in one collective. ``mesh`` (placing the result on another mesh) is not supported, as
    in Monarch: move the result with ``to_mesh`` or ``slice_mesh``.
    """
    _refuse_mesh(mesh, "reduce")
    if type(tensors) is not Tensor:
        if out is not None:
            raise TypeError("reduce(out=...) takes one tensor, not a pytree of them")
        return _reduce_tree(tensors, dims, reduction, scatter, False)
    r = _reduce(tensors, dims, reduction, scatter, False)
    if out is not None:
        out.copy_(r)
        return out
    return r


def reduce_(tensors, dims, reduction: str = "sum", scatter: bool = False, mesh=None):
    """In-place ``reduce``: ``grad.reduce_("dp", "avg")``; or each mesh tensor of a pytree
    (``reduce_([g1, g2], "dp", "avg")``)."""
    _refuse_mesh(mesh, "reduce_")
    if type(tensors) is not Tensor:
        return _reduce_tree(tensors, dims, reduction, scatter, True)
    return _reduce(tensors, dims, reduction, scatter, True)


# ---- moving tensors between meshes -------------------------------------------------------------------------
_xfers = itertools.count(1)


def _tree_of_mesh_tensors(fn, tensors, what: str):
    """``fn`` applied to every mesh tensor of a pytree (a tensor, or lists, tuples and dicts of them, as
    Monarch's ``to_mesh`` and ``slice_mesh`` take); other leaves stay, but a local torch tensor is an error."""
    def one(leaf):
        if type(leaf) is Tensor:
            return fn(leaf)
        if isinstance(leaf, torch.Tensor):
            raise TypeError(f"{what} moves mesh tensors; this one is a local torch tensor (of shape "
                            f"{tuple(leaf.shape)}): make it inside `with procs.activate():`")
        return leaf

    return pytree.tree_map(one, tensors)


def slice_mesh(tensors, **kwargs):
    """Each mesh tensor of ``tensors`` (a tensor or a pytree of them) on a slice of its mesh (the ranks of the
    slice keep their data): ``slice_mesh(t, gpus=0)``, ``slice_mesh({"w": w, "b": b}, hosts=1)``."""
    return _tree_of_mesh_tensors(lambda t: _slice_mesh(t, **kwargs), tensors, "slice_mesh")


def to_mesh(tensors, mesh, stream: Stream | None = None):
    """Copy each mesh tensor of ``tensors`` (a tensor or a pytree of them) to ``mesh`` (same sizes): rank i of
    a tensor's mesh sends to rank i of ``mesh``; ``stream`` (default: the tensor's) orders it there."""
    return _tree_of_mesh_tensors(lambda t: _to_mesh(t, mesh, stream), tensors, "to_mesh")


def _slice_mesh(t: Tensor, **kwargs) -> Tensor:
    """``t`` on a slice of its mesh (the ranks of the slice keep their data)."""
    check_live(t._ctx, "slice_mesh")
    check_readable("slice_mesh", (t,))
    ctx = t._ctx
    sub = ctx.pm.slice(**kwargs)
    forget_value(t)  # the slice shares its memory
    sctx = sub._alloc._tensor_client.ctx(sub, ctx.stream)
    ref = next(ctx.client.refs)
    ctx.client.issue(m.CallOp("aten::alias", (t._ref,), {}, (0,), (ref,), (), ctx.sid, user_loc()), sctx.ranks)
    return Tensor(t._meta, t._mid, sctx, ref)


def _to_mesh(t: Tensor, mesh, stream: Stream | None = None) -> Tensor:
    """Copy ``t`` to ``mesh``: rank i of ``t``'s mesh sends to rank i of ``mesh`` (same sizes), or each rank of
    ``mesh`` gets the value of the rank of ``t``'s mesh at its coordinates on their shared dims (``mesh`` has
    more dims: a broadcast, see ``_to_mesh_pairs``). The gradient of a ``t`` that requires grad goes back the
    same way (``_ToMesh``)."""
    if type(t) is not Tensor:
        raise TypeError(f"to_mesh needs a mesh tensor, got {type(t).__name__}")
    from monarch_tensor.host import ProcMesh

    if not isinstance(mesh, ProcMesh):
        raise TypeError(f"to_mesh needs a proc mesh to copy to, such as this_host().spawn_procs(...), "
                        f"not {type(mesh).__name__} {mesh!r}")
    check_live(t._ctx, "to_mesh")
    check_readable("to_mesh", (t,))
    src = t._ctx
    pairs = _to_mesh_pairs(src.pm._shape, mesh._shape)
    if stream is not None and not isinstance(stream, Stream):
        raise TypeError(f"to_mesh(stream=...) takes a Stream, got {stream!r}")
    dst = ctx_for(mesh, stream or src.stream)
    if not (t.requires_grad and torch.is_grad_enabled()):
        return _send_to_mesh(t, dst, pairs)
    if len(pairs) > 1:
        raise MeshTensorError(f"to_mesh from {src.pm._shape} to {mesh._shape} broadcasts along the dims the source "
                              f"lacks, which does not work with autograd, and this tensor requires grad: move "
                              f"t.detach() (a broadcast is meant for initialization), or to a mesh of the same sizes")
    return _ToMesh.apply(t, dst)


def _to_mesh_pairs(src, dst) -> list[list[tuple[int, int]]]:
    """Which rank of shape ``src`` sends to which rank of shape ``dst`` (each a position in its shape's
    row-major order), in rounds in which every source rank sends once.

    Meshes of the same sizes pair position i with position i (one round). Otherwise each dim of ``src`` must be
    a dim of ``dst`` of the same size, and ``dst``'s other dims are broadcast along, as Monarch's ``to_mesh``
    does (to initialize every host from one, say): a destination rank gets the value of the source rank at its
    coordinates on the shared dims, one round per coordinate of the broadcast dims.
    """
    if tuple(src.dims) == tuple(dst.dims):
        return [[(i, i) for i in range(len(src))]]
    sizes = dst.sizes
    for name, size in src.sizes.items():
        if sizes.get(name) != size:
            raise ValueError(f"to_mesh needs meshes of the same sizes, or a destination with every dim of the source "
                             f"at the same size (it broadcasts along its other dims): {src} vs {dst}")
    index = {tuple(c.values()): i for i, c in enumerate(src.coordinates())}
    rounds: dict = {}
    for i, c in enumerate(dst.coordinates()):
        key = tuple(v for n, v in c.items() if n not in src.names)
        rounds.setdefault(key, []).append((index[tuple(c[n] for n in src.names)], i))
    return list(rounds.values())


def _send_to_mesh(t: Tensor, dst: Ctx, pairs: list) -> Tensor:
    """Issue the transfer of ``t`` to ``dst``'s ranks (``pairs``: see ``_to_mesh_pairs``); its new tensor there."""
    src = t._ctx
    # Data goes proc to proc: the receiving workers must exist before the senders' messages arrive.
    dst.client.workers.initialized.get(timeout=60)
    xfer = next(_xfers)  # (one transfer id for every round: each destination proc receives once)
    loc = user_loc()
    for round_ in pairs:
        dests = {src.ranks[s]: dst.client.addrs[dst.ranks[d]] for s, d in round_}
        src.client.issue(m.SendTensor(t._ref, xfer, dests, src.sid, loc), src.ranks)
    src.client.flush()
    ref = next(dst.client.refs)
    dst.client.issue(m.RecvTensor(ref, xfer, RECV_TIMEOUT, dst.sid, loc), dst.ranks)
    meta = contiguous_meta(tuple(t.shape), t.dtype)
    return Tensor(meta, intern_meta(meta), dst, ref)


class _ToMesh(torch.autograd.Function):
    """``to_mesh`` of a tensor that requires grad: its gradient goes back to the source mesh (and stream) the
    same way, so a model split over meshes (a pipeline's stages) trains as one graph, as it would locally."""

    @staticmethod
    def forward(ctx_, t: Tensor, dst: Ctx) -> Tensor:
        ctx_.src = t._ctx
        return _send_to_mesh(t, dst, _to_mesh_pairs(t._ctx.pm._shape, dst.pm._shape))

    @staticmethod
    def backward(ctx_, grad):
        src = ctx_.src
        return _to_mesh(grad, src.pm, src.stream), None


# ---- streams ---------------------------------------------------------------------------------------------
_stream_ids = itertools.count(1)
_borrow_ids = itertools.count(1)


class Stream:
    """A second instruction stream on every worker: work on it may overlap the main stream.

    >>> comms = Stream("comms")
    >>> g, borrow = comms.borrow(grad)
    >>> with comms.activate():
    ...     g.reduce_("gpus", "sum")
    >>> borrow.drop()
    """

    def __init__(self, name: str, _id: int | None = None) -> None:
        self.name = name
        self.id = next(_stream_ids) if _id is None else _id

    @contextlib.contextmanager
    def activate(self):
        prev = state.stream
        state.stream = None if self.id == 0 else self
        try:
            yield self
        finally:
            state.stream = prev

    def borrow(self, t: Tensor, mutable: bool = False) -> tuple[Tensor, Borrow]:
        """``t`` (of another stream) usable on this one until ``borrow.drop()``. Until then ``t`` cannot be
        written, and the borrowed tensor only with ``mutable=True``; a mutable borrow has the memory to itself:
        ``t`` cannot be read either (nor borrowed again), and a tensor lent already cannot be borrowed mutably.
        A borrow the script lets go of without ``drop()`` is dropped then, with a warning."""
        if type(t) is not Tensor:
            raise TypeError(f"borrow needs a mesh tensor, got {type(t).__name__}")
        check_live(t._ctx, "borrow")
        check_readable("borrow", (t,))
        src = t._ctx
        if src.sid == self.id:
            raise BorrowError(f"the tensor already lives on stream {self.name!r}")
        if mutable and loans_of(t):
            raise BorrowError(f"borrow(mutable=True): this tensor (or a view of its memory) is lent to stream(s) "
                              f"{sorted(loans_of(t))} already, which may read it meanwhile; drop those borrows first")
        dst = src.client.ctx(src.pm, self)
        bid = next(_borrow_ids)
        ref = next(src.client.refs)
        src.client.issue(m.BorrowCreate(bid, t._ref, ref, src.sid, self.id), src.ranks)
        forget_value(t)  # the other stream shares its memory
        bt = Tensor(t._meta, t._mid, dst, ref)
        borrowing[0] = True
        if not mutable:
            bt._read_only = True
        # Writes through a view of it, or to its base and the base's other views, are refused too: the root
        # tensor of its memory (torch's ``_base``) shares the list (check_writable looks at both).
        root = t._base
        lent = getattr(t, "_lent", None)
        if lent is None:
            lent = getattr(root, "_lent", None) if root is not None else None
            if lent is None:
                lent = Loans()
            t._lent = lent
        if root is not None and getattr(root, "_lent", None) is not lent:
            root._lent = lent
        lent.append(self.name)
        if mutable:
            lent.mutable = True
            mutable_loans.add(bid)
        return bt, Borrow(bid, bt, src, dst, mutable, t)

    def __repr__(self) -> str:
        return f"Stream({self.name!r})"


_MAIN = Stream("main", 0)


def get_active_stream() -> Stream:
    return state.stream or _MAIN


class _Dropped:
    """The context of a dropped tensor (``t.drop()``, or a borrowed one after ``borrow.drop()``): any use
    fails with a clear error."""

    sid = -1
    client = None
    ranks = ()

    def __init__(self, ctx: Ctx, dropped_by: str = "borrow.drop()") -> None:
        self.pm, self.stream, self.client = ctx.pm, ctx.stream, ctx.client
        self.dropped_by = dropped_by


class Borrow:
    """A lent tensor; ``drop()`` ends the loan (also ``with borrow:``). A borrow the script lets go of without
    ``drop()`` drops itself then, with a warning (Monarch's): the lender's stream waits for the other stream's
    work on it from that point."""

    def __init__(self, bid: int, tensor: Tensor, src: Ctx, dst: Ctx, mutable: bool, origin: Tensor) -> None:
        self.id, self._tensor, self._src, self._dst, self.mutable = bid, tensor, src, dst, mutable
        self._dropped = False
        # The lent tensor stays alive while the borrow lasts, even if the script lets go of it: the other
        # stream reads it when it gets there.
        self._origin = tensor._origin = origin

    def drop(self) -> None:
        if self._dropped:
            raise BorrowError(f"borrow {self.id} was already dropped")
        self._dropped = True
        self._src.client.issue(self._drop_instruction(), self._src.ranks)
        self._end()

    def _drop_instruction(self) -> m.BorrowDrop:
        return m.BorrowDrop(self.id, self._tensor._ref, self._src.sid, self._dst.sid)

    def _end(self) -> None:
        """The controller's side of the drop: the borrowed tensor is refused from now on, the lender usable."""
        t = self._tensor
        t._ctx = _Dropped(self._dst)
        self._tensor = None
        lent = getattr(self._origin, "_lent", None)
        if lent is not None:
            lent.remove(self._dst.stream.name)  # (the list is shared with its root, which sees it empty too)
            if self.mutable:
                lent.mutable = False
            if not lent:
                del self._origin._lent
        mutable_loans.discard(self.id)
        self._origin = t._origin = None

    def __del__(self) -> None:
        """Garbage-collected before ``drop()``: drop it now, as ``drop()`` would here. This runs at any time, on
        any thread (inside the client's lock, or a lock of the flusher's, too): the drop joins the batch without
        taking a lock (``issue_later``), before the next instruction; nothing is sent once the mesh stopped."""
        try:
            if self._dropped:
                return
            self._dropped = True
            client = self._src.client
            if not client.alloc._stopped:
                client.issue_later(self._drop_instruction(), self._src.ranks)
            self._end()
            warnings.warn(f"borrow {self.id} of a tensor lent to stream {self._dst.stream.name!r} was garbage-"
                          f"collected before borrow.drop(): it is dropped now, so the lender's stream waits here "
                          f"for that stream's work on it; call borrow.drop() (or use `with borrow:`) to say where",
                          stacklevel=2)
        except Exception:  # noqa: BLE001 - interpreter shutdown, or a warning filter that raises
            pass

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        if not self._dropped:
            self.drop()


# ---- remote functions ------------------------------------------------------------------------------------
class Remote:
    """A function that runs on every rank of the active mesh: ``remote("torch.linalg.qr")(t)``.

    ``propagate`` tells the controller the result's shapes: a function called
    with fake tensors, ``"inspect"`` (run it once on a rank and look; cached per
    input shapes), or None (run the function itself on fake tensors).
    """

    def __init__(self, fn, propagate=None) -> None:
        self.fn, self.propagate = fn, propagate
        self._cache: dict = {}

    def _local_fn(self):
        from monarch_tensor.worker.worker import resolve_function

        return resolve_function(self.fn)

    # ---- Monarch's endpoint forms: the function on every proc of the active mesh, its results to the caller --
    def _endpoint(self):
        pm = state.ctx_mesh
        if pm is None:
            raise MeshTensorError(f"{getattr(self.fn, '__name__', self.fn)}.call() runs on the active mesh: call it "
                                  f"inside `with mesh.activate():`")
        return pm._runner().run

    def call(self, *args, **kwargs):
        """A Future of a ``ValueMesh``: the function's result on every proc of the active mesh (Monarch's
        ``check_memory.call()``). Its arguments and results are plain values, not mesh tensors."""
        return self._endpoint().call(self._local_fn(), args, kwargs)

    def call_one(self, *args, **kwargs):
        """Its result on the one proc of the active mesh."""
        return self._endpoint().call_one(self._local_fn(), args, kwargs)

    def broadcast(self, *args, **kwargs) -> None:
        """Run it on every proc of the active mesh, results dropped."""
        self._endpoint().broadcast(self._local_fn(), args, kwargs)

    def send(self, args: tuple = (), kwargs: dict | None = None, port=None) -> None:
        """Run it on every proc of the active mesh; with ``port``, each result goes there (``send(fn, ...)``)."""
        self._endpoint().send((self._local_fn(), tuple(args), dict(kwargs or {})), {}, port)

    def __call__(self, *args, **kwargs):
        leaves, ctx = _leaves_ctx((args, kwargs), f"remote({getattr(self.fn, '__name__', self.fn)!r})")
        if ctx is None:
            pm = state.ctx_mesh
            if pm is None:
                raise MeshTensorError("calling a remote function needs an active mesh (with mesh.activate():) "
                                      "or mesh tensor arguments")
            ctx = ctx_for(pm)
        from .tensor import _scan, describe_outputs, meta_of, to_fake

        key: list = []
        tensors: list = []
        local: list = []
        wire = _scan((args, kwargs), key, tensors, local)
        if local:
            raise MeshTensorError("remote(): pass mesh tensors, not local tensors (create them inside activate())")
        for pg in _process_groups((args, kwargs)):
            pg._check_used_on(ctx)
        tkey = tuple(key)
        try:
            tpl = self._cache.get(tkey)
        except TypeError:  # an unhashable argument: describe without caching
            tpl, tkey = None, None
        if tpl is None:
            tpl = self._describe(args, kwargs, tensors, ctx, to_fake, describe_outputs, meta_of)
            if tkey is not None:
                self._cache[tkey] = tpl
        leaves_spec, struct = tpl
        client = ctx.client
        vals, outs, metas = _outputs(leaves_spec, tensors, ctx)
        from .tensor import _rebuild

        client.issue(m.CallFunction(self.fn, wire[0], wire[1], tuple(outs), (), ctx.sid, user_loc(), tuple(metas)),
                     ctx.ranks)
        forget_value(tensors)  # the function may write its arguments
        return _rebuild(struct, iter(vals))

    def _describe(self, args, kwargs, tensors, ctx, to_fake, describe_outputs, meta_of):
        from .tensor import _struct, fake_mode

        if self.propagate in ("inspect", "cached", "mocked"):
            value = _to_wire((args, kwargs))
            fn = functools.partial(_describe_call, self.fn)
            metas = ctx.client.request(ctx.ranks[0], lambda port: m.FetchValue(value, fn, port, ctx.sid,
                                                                                   user_loc())).result()
            leaves = []
            for kind, v in metas[0]:
                leaves.append(("new", v, intern_meta(v)) if kind == "new" else (kind, v))
            return leaves, metas[1]
        fn = self.propagate if callable(self.propagate) else self._local_fn()
        mode = fake_mode()
        state.internal = True
        try:
            with mode:
                fakes = [to_fake(t._meta) for t in tensors]
                it = iter(fakes)
                def sub(x):
                    if type(x) is Tensor:
                        return next(it)
                    if isinstance(x, OpaqueRef):  # (_scan took its key as the next tensor)
                        return OpaqueRef._create(next(it)) if type(x._key) is Tensor else x
                    return _stand_in(x) if type(x) is RemoteProcessGroup else x

                fargs, fkwargs = rebuild((args, kwargs), sub)  # (in _scan's order of the tensors)
                out = fn(*fargs, **fkwargs)
        finally:
            state.internal = False
        leaves, struct, _ = describe_outputs(out, fakes)
        # A propagator returning its input describes a new tensor of that shape, not an alias.
        leaves = [("new", tensors[leaf[1]]._meta, tensors[leaf[1]]._mid) if leaf[0] == "alias" else leaf
                  for leaf in leaves]
        return leaves, _struct(out) if not isinstance(out, torch.Tensor) else None

    def call_on_shard_and_fetch(self, *args, shard: dict[str, int] | None = None, **kwargs) -> Future:
        """Run the function on one rank only and fetch its result: ``f.call_on_shard_and_fetch(t, shard={"gpus": 0})``."""
        return call_on_shard_and_fetch(self, *args, shard=shard, **kwargs)


def _none(*args, **kwargs) -> None:
    return None


def _trunc_normal_on_workers(tensor, mean, std, a, b, generator) -> None:
    """Worker side of ``torch.nn.init.trunc_normal_`` of a mesh tensor (see ``_install_factories``)."""
    torch.nn.init.trunc_normal_(tensor, mean, std, a, b, generator=generator)


def _process_groups(tree) -> list[RemoteProcessGroup]:
    return [x for x in pytree.tree_leaves(tree) if type(x) is RemoteProcessGroup]


def _refuse_process_groups(tree, what: str) -> None:
    if _process_groups(tree):
        raise TypeError(f"{what}: a RemoteProcessGroup is an argument of remote functions, not of actor endpoints; "
                        f"an actor makes its own groups (see monarch_tensor.spmd.setup_torch_elastic_env)")


def _stand_in(pg: RemoteProcessGroup):
    """What a propagating run on the controller sees in place of ``pg``."""
    from monarch_tensor.worker.collectives import DummyProcessGroup

    return DummyProcessGroup(pg.dims, pg.size())


def _outputs(leaves_spec: list, tensors: list, ctx: Ctx) -> tuple[list, list, list]:
    """A described call's results (``Remote._describe``): the values to give back (new mesh tensors, the
    argument tensors it returns, plain values), the refs the workers store them at, and for each new tensor
    its ``(shape, dtype)``, which the worker checks the result against."""
    vals, outs, metas = [], [], []
    for leaf in leaves_spec:
        if leaf[0] == "new":
            ref = next(ctx.client.refs)
            vals.append(Tensor(leaf[1], leaf[2], ctx, ref))
            outs.append(ref)
            metas.append((leaf[1][0], leaf[1][3]))
        elif leaf[0] == "alias":
            vals.append(tensors[leaf[1]])
            outs.append(tensors[leaf[1]]._ref)
            metas.append(None)
        else:
            vals.append(leaf[1])
            outs.append(None)
            metas.append(None)
    return vals, outs, metas


def _describe_call(fn, *args, **kwargs):
    """Worker side of ``propagate="inspect"``: run ``fn`` and describe its outputs."""
    from monarch_tensor.worker.worker import flat_leaves, resolve_function

    out = resolve_function(fn)(*args, **kwargs)
    leaves = []
    for leaf in flat_leaves(out):
        if isinstance(leaf, torch.Tensor):
            leaves.append(("new", (tuple(leaf.shape), tuple(leaf.contiguous().stride()), 0, leaf.dtype)))
        else:
            leaves.append(("value", leaf))
    from .tensor import _struct

    return leaves, _struct(out) if not isinstance(out, torch.Tensor) else None


def remote(fn=None, *, propagate=None):
    """Make ``fn`` (a function, or a dotted path like ``"torch.linalg.qr"``) run on the workers.

    >>> @remote(propagate=lambda x: x)
    ... def double(x):
    ...     return x * 2
    >>> with procs.activate():
    ...     y = double(torch.ones(3))
    """
    if fn is None:
        return functools.partial(remote, propagate=propagate)
    if isinstance(fn, str):
        module, _, name = fn.rpartition(".")
        if not module or not name:
            raise ValueError(f"remote({fn!r}): a function's dotted path needs a module and a name, "
                             f"such as 'torch.linalg.qr'")
    elif not callable(fn):
        raise TypeError(f"remote() needs a function or a dotted path such as 'torch.linalg.qr', got "
                        f"{type(fn).__name__} {fn!r}")
    if not (propagate is None or propagate == "inspect" or callable(propagate)):
        raise ValueError(f"remote(propagate=...) must be a function of the same arguments, 'inspect', or None; "
                         f"got {propagate!r}")
    return Remote(fn, propagate)


def call_on_shard_and_fetch(fn, *args, shard: dict[str, int] | None = None, **kwargs) -> Future:
    """Run ``fn`` (a ``remote`` function, a function or a dotted path) on one rank; a future of its result."""
    target = fn.fn if isinstance(fn, Remote) else fn
    leaves, ctx = _leaves_ctx((args, kwargs))
    if ctx is None:
        pm = state.ctx_mesh
        if pm is None:
            raise MeshTensorError("call_on_shard_and_fetch needs an active mesh or mesh tensor arguments")
        ctx = ctx_for(pm)
    rank = _rank_of(ctx, shard, {})
    value, loc = _to_wire((args, kwargs)), user_loc()
    return ctx.client.request(rank, lambda port: m.FetchValue(value, target, port, ctx.sid, loc), mesh=ctx.ranks)


def worker_stats(pm, rank: int = 0) -> dict:
    """Counts of live refs, streams and borrows on one worker (a debugging and test aid)."""
    ctx = ctx_for(pm)
    return ctx.client.request(ctx.ranks[rank], lambda port: m.ReportRefs(port, ctx.sid), "worker stats").result(60)
