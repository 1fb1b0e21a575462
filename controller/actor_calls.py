"""Actor endpoints called with mesh tensors: ``call_actor`` (each rank's actor gets its own local tensors, in
the order of the mesh's instruction stream) and ``actor_rref`` (Monarch's ``endpoint.rref()``: the results as
mesh tensors).
"""

from __future__ import annotations

from monarch_tensor.worker import messages as m

from monarch_tensor.transport import _wire

from .activation import ctx_for
from .arguments import mesh_leaves
from .client import user_loc
from .errors import MeshTensorError
from .fetching import _leaves_ctx, _to_wire
from .remote_functions import Remote, _outputs, _refuse_process_groups
from .tensor import forget_value, state

EXECUTOR = "_mt_execute"  # the actors of ProcMesh.execute (host.ProcMesh._runner)


def call_actor(actors, ranks: list[int], method: str, args: tuple, kwargs: dict, port) -> None:
    """An actor call whose arguments hold mesh tensors: each rank's actor gets its own local tensors.

    The call goes down the tensor engine's instruction stream of the tensors' mesh, so it runs after the
    ops issued before it, and the stream waits for the endpoint to return (the actor borrows the tensors
    while it runs); calls sent to the actor later still run after it. The actor must live on procs of
    the tensors' mesh.
    """

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
