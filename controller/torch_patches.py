"""Where the tensor engine patches torch, and why: every replacement of a torch function is here.

Inside ``procs.activate()`` a script's plain torch code must make and draw mesh tensors, as it would make and
draw local ones in a local run. Ops on mesh tensors need no patch (they dispatch on the tensor subclass); the
calls that take no mesh tensor do. Installed on first use of a mesh (``install_factories`` at ``activate()``,
``install_optimizer_hook`` at a mesh's first client), each wrapper calls torch's own function outside
``activate()``:

* torch's factories (``_FACTORIES``: ``torch.zeros``, ``torch.randn``, ``*_like`` ...; ``random_split``'s
  ``randperm``): record on the active mesh (a dispatch mode, ``_FactoryMode``, for these calls only); what
  ``torch.utils.data`` draws stays local and draws from the workers' generator state (``_lend_generator``);
* ``torch.manual_seed``, ``torch.get_rng_state``, ``torch.set_rng_state``: seed and save the workers' generators;
* ``torch.nn.functional.one_hot``: an output shape that depends on the data, refused or run on the workers;
* ``torch.nn.init.trunc_normal_``: a loop on the values, run whole on the workers;
* ``Optimizer._process_value_according_to_param_policy``: ``load_state_dict`` places state like its parameter;
* ``torch.optim``'s ``_default_to_fused_or_foreach``: an optimizer of mesh tensors takes its grouped (foreach)
  version unless told otherwise, as one of tensors on a GPU does (``_install_foreach_default``);
* Dynamo's ``trace_rules``: ``torch.compile`` leaves the engine's packages alone;
* ``torch._library.simple_registry.find_torch_dispatch_rule`` (on import, ``_install_rule_lookup``): torch asks it
  for a rule registered for (op, subclass) before every ``__torch_dispatch__`` call; the same answer, in one
  Python call instead of three.

Two more patches live with their features: ``Module.__delattr__`` (``controller/compile.py``: ``del module.attr``
invalidates compiled steps, which torch has no hook for), and on the workers DTensor's ``redistribute_cost``
(``worker/dtensor.py``, ``_install_strided_cost_estimate``: torch rates a move of a ``_StridedShard`` input with
a graph search that takes seconds per op; the workers rate it as the same move of plain shards plus a gather).
"""

from __future__ import annotations

import functools
import sys

import torch
from monarch_tensor.worker import messages as m
from torch._library import simple_registry
from torch.overrides import _get_current_function_mode_stack
from torch.utils._device import DeviceContext, _device_constructors

from monarch_tensor.transport import _wire

from . import activation, moving, remote_functions, streams
from .client import Ctx, user_loc
from .errors import MeshTensorError
from .tensor import Tensor, record, state

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
    client = activation.client_for(pm)
    if client.on_next_issue is not None:
        return
    ctx = client.ctx(pm, streams._MAIN)
    loc = user_loc()
    replies = [client.request(r, lambda port: m.FetchValue(((), {}), "torch.get_rng_state", port, ctx.sid, loc),
                              "the workers' generator state", mesh=ctx.ranks) for r in ctx.ranks]
    states = [f.result(moving.RECV_TIMEOUT) for f in replies]
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


def install_optimizer_hook() -> None:
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
    _install_foreach_default()


def _install_foreach_default() -> None:
    """torch's optimizers take their ``foreach`` (grouped) version, when the user chose none, only for the
    parameters of the devices that have its kernels (CUDA, not the CPU), and only for plain tensors: mesh
    tensors got the single-tensor version, one op per parameter per update (AdamW's is half a small GPT's
    step), each recorded here and run on every worker. For parameters that are all mesh tensors the default is
    the foreach version, as torch's for parameters on a GPU; the user's ``foreach=``/``fused=`` wins. On the CPU
    its results are the single-tensor version's bit for bit (tests/test_optim_defaults.py checks AdamW's, Adam's
    and SGD's)."""
    import torch.optim  # noqa: F401 - imports every optimizer's module, each holding its own binding of it

    default = sys.modules["torch.optim.optimizer"]._default_to_fused_or_foreach

    @functools.wraps(default)
    def default_to_fused_or_foreach(params, differentiable, use_fused=False):
        fused, foreach = default(params, differentiable, use_fused)
        if not (fused or foreach or differentiable) and any(p is not None for p in params) and \
                all(p is None or type(p) is Tensor for p in params):
            return False, True
        return fused, foreach

    for name, mod in list(sys.modules.items()):
        if name.startswith("torch.optim") and getattr(mod, "_default_to_fused_or_foreach", None) is default:
            mod._default_to_fused_or_foreach = default_to_fused_or_foreach


def install_factories() -> None:
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
                with _FactoryMode(activation.ctx_for(pm)):
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
        ctx = activation.ctx_for(pm)
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
    one_hot_on_workers = remote_functions.Remote("torch.nn.functional.one_hot", propagate=one_hot)

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
    trunc_normal_on_workers = remote_functions.Remote(_trunc_normal_on_workers, propagate=_none)

    @functools.wraps(trunc_normal)
    def trunc_normal_(tensor, mean=0.0, std=1.0, a=-2.0, b=2.0, generator=None):
        if type(tensor) is not Tensor or tensor._dist is not None:
            return trunc_normal(tensor, mean, std, a, b, generator=generator)
        trunc_normal_on_workers(tensor, mean, std, a, b, generator)
        if generator is not None:
            with activation.no_mesh.activate():  # (its factories, torch.empty_like..., make local tensors)
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

    for package in ("monarch_tensor.controller", "monarch_tensor.worker", "monarch_tensor"):
        trace_rules.add(package)



# ---- torch's lookup of registered __torch_dispatch__ rules -----------------------------------------------
def _install_rule_lookup() -> None:
    """Replace ``find_torch_dispatch_rule`` (``torch.library.register_torch_dispatch``'s registry, asked before
    every ``__torch_dispatch__`` call, to a mesh tensor's or a mode's) by one that gives the same answer: the
    rule registered for the op and class, or None. torch's builds an entry for every op it is asked about; this
    one reads the registry's table, and asks torch's for an op with no entry yet.

    torch reads the function once, at the first dispatch to a subclass or mode in the process: the engine's
    import installs it (after a dispatch elsewhere, torch keeps its own, which gives the same answers). A torch
    whose registry is not laid out as this one reads keeps its own too."""
    registry = simple_registry
    original = registry.find_torch_dispatch_rule
    table = getattr(registry.singleton, "_data", None)
    holder = getattr(registry, "GenericTorchDispatchRuleHolder", None)
    if original.__module__ != registry.__name__ or type(table) is not dict or holder is None or \
            type(getattr(holder("check"), "_data", None)) is not dict:
        return

    def find_torch_dispatch_rule(op, torch_dispatch_class):
        entry = table.get(op.__qualname__)
        if entry is None:
            return original(op, torch_dispatch_class)
        return entry.torch_dispatch_rules._data.get(torch_dispatch_class)

    registry.find_torch_dispatch_rule = find_torch_dispatch_rule


_install_rule_lookup()


def _none(*args, **kwargs) -> None:
    return None


def _trunc_normal_on_workers(tensor, mean, std, a, b, generator) -> None:
    """Worker side of ``torch.nn.init.trunc_normal_`` of a mesh tensor (see ``install_factories``)."""
    torch.nn.init.trunc_normal_(tensor, mean, std, a, b, generator=generator)
