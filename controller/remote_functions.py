"""Remote functions: ``remote(fn)`` runs a function on every rank of a mesh as an instruction of its stream,
its results mesh tensors shaped by ``propagate``; ``call_on_shard_and_fetch`` runs one on one rank.

>>> @remote(propagate=lambda x: x)
... def double(x):
...     return x * 2
"""

from __future__ import annotations

import functools

import torch
from monarch_tensor.worker import messages as m
from monarch_tensor.worker.containers import rebuild
from monarch_tensor.worker.dummy_group import DummyProcessGroup
from monarch_tensor.worker.interface import flat_leaves, resolve_function
from monarch_tensor.worker.opaque import OpaqueRef
from torch.utils import _pytree as pytree

from monarch_tensor.future import Future

# activation imports torch_patches, which imports this module: its siblings in that cycle are imported as
# modules (their names are looked up at the call)
from . import activation, fetching
from .client import Ctx, user_loc
from .errors import MeshTensorError
from .process_group import RemoteProcessGroup
from .tensor import Tensor, forget_value, intern_meta, state


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
        leaves, ctx = fetching._leaves_ctx((args, kwargs), f"remote({getattr(self.fn, '__name__', self.fn)!r})")
        if ctx is None:
            pm = state.ctx_mesh
            if pm is None:
                raise MeshTensorError("calling a remote function needs an active mesh (with mesh.activate():) "
                                      "or mesh tensor arguments")
            ctx = activation.ctx_for(pm)
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
            value = fetching._to_wire((args, kwargs))
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


def _process_groups(tree) -> list[RemoteProcessGroup]:
    return [x for x in pytree.tree_leaves(tree) if type(x) is RemoteProcessGroup]


def _refuse_process_groups(tree, what: str) -> None:
    if _process_groups(tree):
        raise TypeError(f"{what}: a RemoteProcessGroup is an argument of remote functions, not of actor endpoints; "
                        f"an actor makes its own groups (see monarch_tensor.spmd.setup_torch_elastic_env)")


def _stand_in(pg: RemoteProcessGroup):
    """What a propagating run on the controller sees in place of ``pg``."""
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
    leaves, ctx = fetching._leaves_ctx((args, kwargs))
    if ctx is None:
        pm = state.ctx_mesh
        if pm is None:
            raise MeshTensorError("call_on_shard_and_fetch needs an active mesh or mesh tensor arguments")
        ctx = activation.ctx_for(pm)
    rank = fetching._rank_of(ctx, shard, {})
    value, loc = fetching._to_wire((args, kwargs)), user_loc()
    return ctx.client.request(rank, lambda port: m.FetchValue(value, target, port, ctx.sid, loc), mesh=ctx.ranks)
