"""The controller's mesh ``Tensor``: records aten ops below autograd, with cached shape propagation.

A mesh tensor is a ``torch.Tensor`` wrapper subclass holding metadata (shape,
strides, dtype) and a ref id; its ``__torch_dispatch__`` records every aten op
as a ``CallOp`` instruction. Because that happens below autograd,
``loss.backward()``, ``torch.no_grad()`` and ``torch.optim`` work unchanged.

Shape propagation is cached: the key is the op and, per argument, the interned
metadata id of tensors and the type and value of everything else; only a miss
runs the op under ``FakeTensorMode`` (and a shape error raises right there, at
the user's line). A hit costs a dict lookup and building the outputs.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import os
import sys
import threading
import weakref

import torch
from monarch_tensor.worker import messages as m
from monarch_tensor.worker.containers import is_dataclass_instance
from monarch_tensor.worker.interface import flat_leaves
from monarch_tensor.worker.opaque import OpaqueRef
from torch._subclasses.fake_tensor import DataDependentOutputException, DynamicOutputShapeException, FakeTensorMode

from .client import Ctx, user_loc
from .dtensor_methods import ACTIVE as _DIST
from .dtensor_methods import DistributedMethods, after_record
from .errors import MeshTensorError
from .process_group import RemoteProcessGroup


class _State(threading.local):
    def __init__(self) -> None:
        self.ctx_mesh = None      # the active ProcMesh (activate())
        self.stream = None        # the active Stream (stream.activate()), None: the default stream
        self.internal = False     # inside the engine (propagation): factories stay local


state = _State()

# ---- interned metadata -----------------------------------------------------------------------------
_meta_ids: dict = {}
_dense_mids: set = set()  # the ids of contiguous metadata at offset 0 (``contiguous_meta``): see new_tensor


def intern_meta(meta: tuple) -> int:
    mid = _meta_ids.get(meta)
    if mid is None:
        mid = _meta_ids[meta] = len(_meta_ids) + 1
        if len(meta) == 4 and meta == contiguous_meta(meta[0], meta[3]):
            _dense_mids.add(mid)
    return mid


def contiguous_meta(shape: tuple, dtype: torch.dtype) -> tuple:
    stride, acc = [], 1
    for d in reversed(shape):
        stride.append(acc)
        acc *= max(d, 1)
    return (tuple(shape), tuple(reversed(stride)), 0, dtype)


def _cpu_for_cuda(a):
    """A CUDA device named to ``Tensor.to`` as the controller records it (the workers' device, see ``Tensor``)."""
    if isinstance(a, (str, torch.device)) and torch.device(a).type == "cuda":
        return "cpu"
    return a


# ---- the guards' epoch ---------------------------------------------------------------------------------
# ``epoch`` changes whenever something a compiled program's guards read may have changed (controller/compile.py):
# a mesh tensor's ref, metadata, mesh or stream (``t.data = ...``, in-place metadata ops, ``drop()``), its
# ``grad`` (set or deleted from Python, or written by autograd: every op recorded inside a backward pass counts,
# and autograd sets a ``.grad`` only after an op made it), its ``requires_grad``, or the object as a whole
# (``torch.utils.swap_tensors`` swaps ``__dict__`` and ``__class__``). A program whose guards held at an epoch
# still holds them while it is unchanged, so a replay checks its per-tensor guards only after a change. Every
# write of one of these attributes goes through ``Tensor.__setattr__``; only ``new_tensor`` writes a new
# tensor's own ``__dict__`` (no program can hold a tensor not yet made).
epoch = 0
_GUARDED = frozenset(("_ref", "_mid", "_ctx", "grad", "_grad", "data", "requires_grad", "__dict__", "__class__"))
# ``grad_reads`` changes on every read of a mesh tensor's ``grad`` (or ``_grad``) from Python: the one way to a new
# reference to a gradient only its parameter holds. A program checks that no one else took one of the gradients it
# left (their reference counts) only after a read or a move of ``epoch`` (controller/compile.py).
grad_reads = 0
_BASE_GRAD = torch._C.TensorBase.grad  # (the getter and setter behind ``Tensor.grad``: they do not count a read)
_BASE_GRAD_ = torch._C.TensorBase._grad
_graph_task_id = torch._C._current_graph_task_id  # -1 outside a backward pass


def _counted(base, doc: str | None = None) -> property:
    """``base`` (torch's ``grad`` or ``_grad``), its reads counted in ``grad_reads``."""
    def read(self):
        global grad_reads
        grad_reads += 1
        return base.__get__(self)

    return property(read, base.__set__, base.__delete__, doc)


class Tensor(DistributedMethods, torch.Tensor):
    """One local tensor per rank of a mesh, all of one shape; ops on it run on the workers.

    >>> with procs.activate():
    ...     x = torch.ones(4) + procs.rank_tensor("gpus")
    ...     print(fetch_shard(x.reduce("gpus", "sum"), gpus=0).result())
    """

    __torch_function__ = torch._C._disabled_torch_function_impl
    _ctx: Ctx  # where it lives (a ``streams._Dropped`` once dropped)
    _origin: Tensor | None  # a borrowed tensor's lender, while the borrow lasts (streams.Borrow)

    @staticmethod
    def __new__(cls, meta: tuple, mid: int, ctx: Ctx, ref: int):
        return new_tensor(meta, mid, ctx, ref)

    def __init__(self, *args, **kwargs) -> None:
        pass

    def __setattr__(self, name: str, value) -> None:
        global epoch
        if name in _GUARDED:
            epoch += 1
        object.__setattr__(self, name, value)

    def __delattr__(self, name: str) -> None:
        global epoch
        if name in _GUARDED:
            epoch += 1
        object.__delattr__(self, name)

    def requires_grad_(self, requires_grad: bool = True):
        global epoch
        epoch += 1
        return torch.Tensor.requires_grad_(self, requires_grad)

    # (written through ``__setattr__``, which moves ``epoch``)
    grad = _counted(_BASE_GRAD, torch.Tensor.grad.__doc__)
    _grad = _counted(_BASE_GRAD_)

    def __del__(self) -> None:
        try:
            self._ctx.client.delete(self._ref, self._ctx.sid)
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        try:
            return record(func, args, kwargs, None)
        except Exception as e:
            if isinstance(e, MeshTensorError) or getattr(e, "_at_user_line", False):
                __tracebackhide__ = True  # IPython and pytest leave this frame out
                raise _user_facing(e) from None
            raise

    def __repr__(self, **kwargs) -> str:
        if self._dist is not None:
            return self.dist_repr()
        c = self._ctx
        stream = "" if c.sid == 0 else f", stream={c.stream.name!r}"
        return f"MeshTensor(shape={tuple(self.shape)}, dtype={self.dtype}, mesh={c.pm._shape}{stream})"

    # A mesh tensor lives on its workers' device: the GPU where their procs have one, else the CPU (factories'
    # ``device=`` names it the same way). So ``cuda()`` and ``to("cuda")`` ask for where it already is, on a
    # controller with no GPU (or no CUDA build of torch) too.
    def cuda(self, device=None, non_blocking: bool = False, memory_format=torch.preserve_format):
        return self

    def to(self, *args, **kwargs):
        args = tuple(_cpu_for_cuda(a) for a in args)
        if "device" in kwargs:
            kwargs["device"] = _cpu_for_cuda(kwargs["device"])
        return super().to(*args, **kwargs)

    def __reduce_ex__(self, proto):
        whole = "t.full_tensor() (the whole value)" if getattr(self, "_dist", None) is not None else \
            "fetch_shard(t).result() (one rank's value)"
        raise MeshTensorError(
            "a mesh tensor cannot be pickled on the controller (torch.save, pickle). To checkpoint a model and "
            "optimizer on a mesh, each rank writing its own shards: model_sd, optim_sd = "
            "monarch_tensor.checkpoint.get_state_dict(model, opt); monarch_tensor.checkpoint.save({'model': "
            "model_sd, 'optim': optim_sd}, checkpoint_id=path) (and checkpoint.load, checkpoint.set_state_dict). "
            "For one file of whole CPU tensors: torch.save(checkpoint.get_model_state_dict(model, options="
            f"checkpoint.StateDictOptions(full_state_dict=True)), path). For this tensor's value: {whole}")

    def __deepcopy__(self, memo):
        """A new mesh tensor with a copy of the value on every rank (``copy.deepcopy(model)`` of a model on the
        mesh); its gradient is copied too, ``requires_grad`` and parameterhood are kept."""
        if id(self) in memo:
            return memo[id(self)]
        with torch.no_grad():
            new = self.clone()
        if self.requires_grad:
            new.requires_grad_(True)
        if getattr(self, "_is_param", False):
            new._is_param = True
        memo[id(self)] = new
        if self.grad is not None:
            new.grad = self.grad.__deepcopy__(memo)
        return new

    @property
    def data(self):
        return _base_data.__get__(self, type(self))

    @data.setter
    def data(self, new) -> None:
        """``t.data = new``: ``t`` becomes an alias of ``new`` (its shape, dtype and values), keeping its identity,
        as torch's does; this is how ``module.double()``, ``.half()`` and ``.to(dtype)`` convert parameters."""
        set_data(self, new)

    def item(self):
        """The value of a one-element tensor: one the controller knows (an optimizer's step count) is read here,
        with no fetch; else fetched from the workers, where every rank holds the same (a global tensor: its
        whole value)."""
        val = self.__dict__.get("_val")
        if val is not None and self._dist is None and _reads_here(self, val):
            return val.item()
        return DistributedMethods.item(self)

    def tolist(self):
        """The value, fetched (a synchronisation), as ``item()`` reads it: a global (DTensor) tensor's whole
        value; a mesh tensor's where every rank holds the same (else an error with the one-line fetch)."""
        if self._dist is not None:
            return self.full_tensor().tolist()
        return agreed_value(self, "t.tolist()").tolist()

    def numpy(self, *, force: bool = False):
        """As ``tolist``, a numpy array."""
        if self._dist is not None:
            return self.full_tensor().numpy()
        return agreed_value(self, "t.numpy()").numpy()

    def preview(self):
        """Every rank's value, fetched (a synchronisation): ``monarch_tensor.preview(self)``."""
        from .fetching import preview

        return preview(self)

    # Methods that reach the tensor's memory directly rather than through an aten op: the controller's
    # tensor is a wrapper with no memory (its values live on the workers), and torch's own code for these
    # crashed the controller (SIGSEGV: ``apply_``, ``share_memory_``) or read a dangling pointer (``__dlpack__``).
    def apply_(self, callable):
        _no_memory("t.apply_(fn)", "calls a Python function on each element here; write the computation with "
                                   "tensor ops, or run it on the workers in a remote() function")

    def map_(self, tensor, callable):
        _no_memory("t.map_(other, fn)", "calls a Python function on each element here; write the computation "
                                        "with tensor ops, or run it on the workers in a remote() function")

    def map2_(self, x, y, callable):
        _no_memory("t.map2_(x, y, fn)", "calls a Python function on each element here; write the computation "
                                        "with tensor ops, or run it on the workers in a remote() function")

    def share_memory_(self):
        _no_memory("t.share_memory_()", "moves memory the controller does not have; fetch the value with "
                                        "fetch_shard(t).result() and share that")

    def is_shared(self):
        _no_memory("t.is_shared()", "fetch the value with fetch_shard(t).result()")

    def pin_memory(self, device=None):
        """Pinning is for copies from the host to a GPU: a mesh tensor is on its workers' device already (as
        ``cuda()`` says)."""
        return self

    def untyped_storage(self):
        _no_memory("t.untyped_storage()", "fetch the value with fetch_shard(t).result()")

    def storage(self):
        _no_memory("t.storage()", "fetch the value with fetch_shard(t).result()")

    def __array__(self, dtype=None, copy=None):
        _no_memory("numpy.asarray(t)", "fetch the value with fetch_shard(t).result().numpy()")

    def __dlpack__(self, *args, **kwargs):
        _no_memory("DLPack export of a mesh tensor", "fetch the value with fetch_shard(t).result()")

    def __format__(self, format_spec: str) -> str:
        """``f"{loss:.4f}"`` of a 0-dim tensor formats ``loss.item()``, as torch's does (whose ``__format__``
        does that only for ``torch.Tensor`` itself): a value the controller knows, else the clear error of
        ``item()``. With no format spec it is ``str(t)``, as ``print(t)`` shows it, and never reads the value."""
        if format_spec and self.dim() == 0:
            return self.item().__format__(format_spec)
        return object.__format__(self, format_spec)

    # ---- Monarch's tensor methods ---------------------------------------------------------------
    @property
    def mesh(self):
        """The proc mesh this tensor lives on."""
        return self._ctx.pm

    @property
    def stream(self):
        return self._ctx.stream

    def reduce(self, dims, reduction: str = "sum", scatter: bool = False, mesh=None, out=None):
        """Collective over the ranks of ``dims``: ``t.reduce("gpus", "sum")`` (see ``monarch_tensor.reduce``)."""
        from .collectives import reduce

        return reduce(self, dims, reduction, scatter, mesh, out=out)

    def reduce_(self, dims, reduction: str = "sum", scatter: bool = False, mesh=None):
        """In-place ``reduce``: every rank's tensor becomes the reduced value."""
        from .collectives import reduce_

        return reduce_(self, dims, reduction, scatter, mesh)

    def to_mesh(self, mesh, stream=None):
        """This tensor's data on another mesh of the same shape (rank i sends to rank i)."""
        from .moving import _to_mesh

        return _to_mesh(self, mesh, stream)

    def slice_mesh(self, **kwargs):
        """This tensor on a slice of its mesh: ``t.slice_mesh(gpus=0)``."""
        from .moving import _slice_mesh

        return _slice_mesh(self, **kwargs)

    def drop(self) -> None:
        """Free this tensor on the workers now, rather than when the script lets go of it (Monarch's); any
        later use of it is a clear error. Dropping it twice does nothing."""
        ctx = self._ctx
        if ctx.sid < 0:
            return
        lent = getattr(self, "_lent", None)
        if lent:
            from .errors import BorrowError

            raise BorrowError(f"this tensor is lent to stream(s) {sorted(lent)}: drop their borrows before the tensor")
        if hasattr(self, "_val"):  # a value the controller knew: not readable either
            del self._val
        ctx.client.issue(m.DeleteRefs((self._ref,), ctx.sid), ctx.ranks)  # in order after its last use
        ctx.client.flush()
        from .streams import _Dropped

        self._ctx = _Dropped(ctx, "t.drop()")

    @property
    def dropped(self) -> bool:
        """Whether ``drop()`` freed this tensor (or, for a borrowed one, ``borrow.drop()``)."""
        return self._ctx.sid < 0


_PLAIN_DISPATCH = Tensor.__dict__["__torch_dispatch__"]  # (compile's recording replaces it while it records)
_dispatch_modes = torch._C._len_torch_dispatch_stack
_function_modes = torch._C._is_torch_function_mode_enabled


def _user_facing(e: Exception) -> Exception:
    """``e``, an error of the script's call (torch's own for a wrong shape, or a ``MeshTensorError``), as local
    torch shows it: raised at the user's line without the engine's frames or the meta kernel's error it came
    from. Those stay on ``e.engine_traceback`` (text) for debugging the library."""
    import traceback

    e.engine_traceback = "".join(traceback.format_exception(e))
    e.__cause__, e.__context__ = None, None
    if sys.excepthook is not _trimming_excepthook and not hasattr(_trimming_excepthook, "prev"):
        _trimming_excepthook.prev = sys.excepthook
        sys.excepthook = _trimming_excepthook
        _trim_in_ipython()
    return e.with_traceback(None)


def _without_engine_frames(tb):
    """``tb`` without the entries of the engine's own files (the rest relinked); ``tb`` where none is left."""
    frames = []
    while tb is not None:
        if not tb.tb_frame.f_code.co_filename.startswith(_ENGINE_DIRS):
            frames.append(tb)
        tb = tb.tb_next
    if not frames:
        return None
    for a, b in zip(frames, frames[1:] + [None]):
        a.tb_next = b
    return frames[0]


def _trim_in_ipython() -> None:
    """In IPython and Jupyter (which print tracebacks themselves, always with the frame that raised), the same
    trimming as ``_trimming_excepthook``, through IPython's custom exception handler, where none is set."""
    get_ipython = getattr(sys.modules.get("IPython"), "get_ipython", None)
    shell = get_ipython() if get_ipython is not None else None
    if shell is None or getattr(shell, "custom_exceptions", None) != ():
        return

    def show(shell, etype, value, tb, tb_offset=None):
        if getattr(value, "engine_traceback", None) is not None and tb is not None:
            tb = _without_engine_frames(tb) or tb
        shell.showtraceback((etype, value, tb), tb_offset=tb_offset)  # (shown here: it returns nothing to show)

    shell.set_custom_exc((Exception,), show)


_ENGINE_DIRS = tuple(os.path.dirname(os.path.abspath(mod.__file__)) + os.sep  # (installed: one folder in another)
                     for mod in (sys.modules["monarch_tensor"], sys.modules["monarch_tensor.controller"],
                                 sys.modules["monarch_tensor.worker"]))


def _trimming_excepthook(exc_type, exc, tb) -> None:
    """``sys.excepthook`` once the engine raised an error at a user's line: such an error, uncaught, prints
    without the engine's dispatch frame (every other exception prints as before)."""
    if getattr(exc, "engine_traceback", None) is not None and tb is not None:
        tb = _without_engine_frames(tb) or tb
        exc = exc.with_traceback(tb)
    _trimming_excepthook.prev(exc_type, exc, tb)


def _no_memory(what: str, instead: str):
    raise MeshTensorError(f"{what} is not possible on the controller: a mesh tensor's memory lives on the "
                          f"workers; {instead}")


_wrap = torch.Tensor._make_wrapper_subclass
_CPU = torch.device("cpu")


def _NO_PYTHON_KEY():
    return torch._C._ExcludeDispatchKeyGuard(torch._C.DispatchKeySet(torch._C.DispatchKey.Python))
_base_data = torch.Tensor.data


def set_data(t: Tensor, new) -> None:
    """``t.data = new`` for a mesh tensor: the workers make a new ref aliasing ``new`` (``aten.alias``), ``t``
    takes it and ``new``'s metadata, and the alias object takes ``t``'s old ref, which it frees when it goes.
    (Torch's own setter changed only the controller's metadata: the workers kept the old tensor.)"""
    if type(new) is not Tensor:
        raise MeshTensorError(f"t.data = {type(new).__name__}: a mesh tensor's data can only be another mesh tensor "
                              f"of its mesh (make it inside activate())")
    if t._ctx is not new._ctx:
        _mismatch("t.data = new", t._ctx, new._ctx)
    if getattr(t, "_dist", None) is not None or getattr(new, "_dist", None) is not None:
        raise MeshTensorError("t.data = new of a distributed (DTensor) mesh tensor is not supported; assign to the "
                              "DTensor itself")
    old_memory = memory_of(t)
    alias = record(torch.ops.aten.alias.default, (new,), {}, None)
    _base_data.__set__(t, alias)  # the controller's metadata: shape, strides, dtype
    t._meta, alias._meta = alias._meta, t._meta
    t._mid, alias._mid = alias._mid, t._mid
    t._ref, alias._ref = alias._ref, t._ref
    # ``t`` now uses ``new``'s memory; the alias object, with ``t``'s old ref, uses ``t``'s old memory.
    t._memory, alias._memory = alias._memory, old_memory
    if hasattr(t, "_val"):
        del t._val
    if hasattr(alias, "_val"):
        t._val = alias._val
    # Known values (``_val``) of aliases go stale together: ``t`` joins ``new``'s group. (It stays in its old
    # one, if any, and the alias object in this one until it goes: that only forgets values more often.
    # Removing a tensor from a WeakSet would compare tensors, an op.)
    group = getattr(alias, "_aliases", None)
    if group is not None and getattr(t, "_aliases", None) is not group:
        group.add(t)
        t._aliases = group
    elif group is None and hasattr(t, "_aliases"):
        del t._aliases


def _set_meta(t: Tensor, meta: tuple, mid: int) -> None:
    """An in-place op changed ``t``'s metadata on the workers (``t.t_()``, ``unsqueeze_``, ``resize_``,
    ``set_``): the controller's tensor takes the same shape, strides, offset and dtype, keeping its identity."""
    new = _wrap(Tensor, meta[0], strides=meta[1], storage_offset=meta[2], dtype=meta[3], device=_CPU)
    with _NO_PYTHON_KEY():  # inside __torch_dispatch__, the setter's checks would come back here
        _base_data.__set__(t, new)
    if t.is_conj() or t.is_neg() or len(meta) > 4:
        _set_bits(t, meta[4] if len(meta) > 4 else 0)
    t._meta, t._mid = meta, mid


def new_tensor(meta: tuple, mid: int, ctx: Ctx, ref: int) -> Tensor:
    """A mesh tensor with metadata ``meta`` (interned as ``mid``) for worker ref ``ref``."""
    if mid in _dense_mids:  # (torch's default strides and offset: fewer arguments for torch to parse)
        t = _wrap(Tensor, meta[0], dtype=meta[3], device=_CPU)
    else:
        t = _wrap(Tensor, meta[0], strides=meta[1], storage_offset=meta[2], dtype=meta[3], device=_CPU)
    if len(meta) > 4:  # a lazily conjugated or negated view: torch's own fallbacks resolve it where ops need it
        _set_bits(t, meta[4])
    d = t.__dict__  # (a new tensor: not ``Tensor.__setattr__``, which moves the guards' epoch for these names)
    d["_meta"] = meta
    d["_mid"] = mid
    d["_ctx"] = ctx
    d["_ref"] = ref
    return t


# ---- argument scanning -------------------------------------------------------------------------------
_SCALARS = (int, float, bool, complex)


def _scan(a, key: list, tensors: list, local: list):
    """Append ``a``'s cache key parts; return its wire form (mesh tensors -> Ref)."""
    t = type(a)
    if t is Tensor:
        tensors.append(a)
        key.append(a._mid)
        return m.Ref(a._ref)
    if t is int or t is float or t is bool:
        key.append(t)
        key.append(a)
        return a
    if t is list or t is tuple:
        key.append(t)
        key.append(len(a))
        return t([_scan(x, key, tensors, local) for x in a])
    if t is dict:
        key.append(dict)
        out = {}
        for k, v in a.items():
            key.append(k)
            out[k] = _scan(v, key, tensors, local)
        return out
    if isinstance(a, OpaqueRef):  # its key is a mesh tensor (a subclass travels as the plain reference)
        key.append(OpaqueRef)
        return OpaqueRef._create(_scan(a._key, key, tensors, local))
    if isinstance(a, tuple) and hasattr(t, "_fields"):  # a named tuple (torch's pytrees look inside them too)
        key.append(t)
        return t(*(_scan(x, key, tensors, local) for x in a))
    if isinstance(a, dict):  # a subclass (OrderedDict, defaultdict): a copy of its type, as containers.rebuild
        key.append(t)
        key.append(getattr(a, "default_factory", None))
        out = copy.copy(a)
        for k, v in a.items():
            key.append(k)
            dict.__setitem__(out, k, _scan(v, key, tensors, local))
        return out
    if is_dataclass_instance(a):  # its fields, in order, as containers.rebuild
        key.append(t)
        out = copy.copy(a)
        for name in t.__dataclass_fields__:
            if hasattr(a, name):
                key.append(name)
                object.__setattr__(out, name, _scan(getattr(a, name), key, tensors, local))
        return out
    if t is torch.Generator:  # its state travels (see _draw); the op's shapes do not depend on it
        key.append(t)
        key.append(a.device)
        return _copy_generator(a)
    if t is RemoteProcessGroup:
        key.append(t)
        key.append(a.dims)
        key.append(a._groups)
        return a._wire()
    if isinstance(a, Tensor):
        raise MeshTensorError(f"mesh tensors of type {t.__name__} are not supported")
    if isinstance(a, torch.Tensor):
        if a.device.type == "meta" or type(a) is not torch.Tensor:
            raise MeshTensorError(f"cannot mix a {type(a).__name__} on {a.device} with mesh tensors")
        meta = (tuple(a.shape), tuple(a.stride()), a.storage_offset(), a.dtype)
        key.append("local")
        key.append(intern_meta(meta))
        local.append(a)
        tensors.append(a)
        return a  # replaced by an uploaded ref in record()
    key.append(t)
    key.append(a)
    return a


# ---- the propagation cache ------------------------------------------------------------------------------
class _Template:
    """What a (op, input metadata) key produces: per output leaf, a new tensor, an alias or a value."""

    __slots__ = ("name", "leaves", "struct", "single", "mutates", "fold", "view")

    def __init__(self, name, leaves, struct, single, mutates, fold, view=False) -> None:
        self.name, self.leaves, self.struct = name, leaves, struct
        self.single, self.mutates, self.fold, self.view = single, mutates, fold, view


_cache: dict = {}
_fake_mode: FakeTensorMode | None = None
_mutated_args: dict = {}

stats = {"hits": 0, "misses": 0}


def _mutated(func) -> tuple:
    """(positions, kwarg names) of the arguments ``func`` writes in place."""
    r = _mutated_args.get(func)
    if r is None:
        pos, names = [], []
        for i, a in enumerate(func._schema.arguments):
            if a.alias_info is not None and a.alias_info.is_write:
                (names if a.kwarg_only else pos).append(i if not a.kwarg_only else a.name)
        r = _mutated_args[func] = (tuple(pos), tuple(names))
    return r


def fake_mode() -> FakeTensorMode:
    global _fake_mode
    if _fake_mode is None:
        _fake_mode = FakeTensorMode(allow_non_fake_inputs=False)
    return _fake_mode


def _extent(meta: tuple) -> int:
    """How many elements of storage a tensor of this metadata spans, from its storage's start."""
    shape, stride, offset = meta[:3]
    if any(s == 0 for s in shape):
        return offset
    return offset + 1 + sum((s - 1) * st for s, st in zip(shape, stride) if s > 0)


def to_fake(meta: tuple):
    shape, stride, offset, dtype = meta[:4]
    base = torch.empty(max(_extent(meta), 1), dtype=dtype)
    view = base.as_strided(shape, stride, offset)
    if len(meta) > 4:  # torch's lazy conjugate / negative bits
        _set_bits(view, meta[4])
    return view


def meta_of(t) -> tuple:
    """(shape, strides, offset, dtype), and a fifth element where torch's lazy conjugate or negative bit is set
    (``z.conj()``, ``_neg_view()``): 1 for conjugate, 2 for negative, 3 for both."""
    meta = (tuple(t.shape), tuple(t.stride()), t.storage_offset(), t.dtype)
    bits = (1 if t.is_conj() else 0) | (2 if t.is_neg() else 0)
    return meta + (bits,) if bits else meta


def _set_bits(t, bits: int) -> None:
    """Set (or clear) ``t``'s conjugate and negative bits as a meta's fifth element says (see ``meta_of``)."""
    torch._C._set_conj(t, bool(bits & 1))
    torch._C._set_neg(t, bool(bits & 2))


def describe_outputs(out, fake_inputs: list, metas_before: list | None = None) -> tuple:
    """(leaves, struct, single) for a fake result: the template of a call's outputs. An input returned whose
    metadata the call changed (``t.t_()``, ``unsqueeze_``, ``resize_``, ``set_``: ``metas_before`` had it
    before) is ``("alias", idx, meta, mid)``: the controller's tensor takes the new metadata too."""
    leaves = []
    for leaf in flat_leaves(out):
        if isinstance(leaf, torch.Tensor):
            idx = next((i for i, f in enumerate(fake_inputs) if f is leaf), None)
            if idx is not None:
                meta = meta_of(leaf)
                if metas_before is not None and meta != metas_before[idx]:
                    leaves.append(("alias", idx, meta, intern_meta(meta)))
                else:
                    leaves.append(("alias", idx))
            else:
                meta = meta_of(leaf)
                leaves.append(("new", meta, intern_meta(meta)))
        else:
            leaves.append(("value", leaf))
    return leaves, _struct(out), isinstance(out, torch.Tensor)


def _struct(out):
    if isinstance(out, (tuple, list)):
        return (type(out), tuple(_struct(x) for x in out))
    if isinstance(out, dict):  # (its keys, then its values' structures, in its order)
        return (dict, (tuple(out), tuple(_struct(x) for x in out.values())))
    if isinstance(out, OpaqueRef):
        return (OpaqueRef, (None,))
    return None


def _rebuild(struct, it):
    if struct is None:
        return next(it)
    typ, kids = struct
    if typ is dict:
        keys, subs = kids
        return {k: _rebuild(sub, it) for k, sub in zip(keys, subs)}
    items = [_rebuild(k, it) for k in kids]
    if typ is tuple or typ is list:
        return typ(items)
    if typ is OpaqueRef:
        return OpaqueRef._create(items[0])
    if hasattr(typ, "_make"):  # a namedtuple
        return typ._make(items)
    return typ(items)  # torch.return_types (structseq) and list subclasses


_fake_log = logging.getLogger("torch._subclasses.fake_tensor")


def _propagate(func, args, kwargs, tensors) -> _Template:
    with _propagate_lock:  # one FakeTensorMode for the process, which is not thread-safe
        return _propagate_locked(func, args, kwargs, tensors)


_propagate_lock = threading.RLock()


def _propagate_locked(func, args, kwargs, tensors) -> _Template:
    mode = fake_mode()
    state.internal = True
    quiet, _fake_log.disabled = _fake_log.disabled, True  # a shape error is raised to the user, not logged
    try:
        with mode:
            fakes = [to_fake(t._meta) if type(t) is Tensor else mode.from_tensor(t) for t in tensors]
            fargs, fkwargs = _substituted(args, kwargs, fakes)
            before = [meta_of(f) for f in fakes]
            if func.name() in _INDEX_PUTS:
                _check_indices_broadcast(fargs[1] if len(fargs) > 1 else fkwargs["indices"])
            fake_error = None
            try:
                out = func(*fargs, **fkwargs)
            except DynamicOutputShapeException:
                raise MeshTensorError(
                    f"{func} has an output shape that depends on the data, which the controller cannot know; "
                    f"compute it in a remote() function with propagate=... instead") from None
            except DataDependentOutputException:
                raise MeshTensorError(
                    f"{func} returns a Python value computed from the data (as torch.allclose and torch.equal do), "
                    f"which lives on the workers; compute a tensor instead (e.g. (a - b).abs().max()) and fetch it "
                    f"with fetch_shard(t).result() or inspect(t)") from None
            except _META_ERRORS as e:
                fake_error = e  # raised below, outside the fake mode, as torch would raise it
        if fake_error is not None:
            _raise_torch_error(func, args, kwargs, tensors, fake_error)
        pos, names = _mutated(func)
        if (pos or names) and any(torch._debug_has_internal_overlap(t) == 1 for t in _written(pos, names, fargs, fkwargs)
                                  if isinstance(t, torch.Tensor)):
            _raise_as_torch(func, args, kwargs, tensors)
        if pos == (0,) and not names and len(tensors) == 1 and torch.Tag.nondeterministic_seeded in func.tags \
                and func.namespace == "aten":
            _check_random_fill(func, args, kwargs, tensors[0])
    finally:
        state.internal = False
        _fake_log.disabled = quiet
    for leaf in flat_leaves(out):
        if isinstance(leaf, torch.Tensor) and leaf.layout is not torch.strided:
            raise MeshTensorError(f"{func} returns a tensor of layout {leaf.layout}: sparse (and other non-strided) "
                                  f"layouts are not supported on mesh tensors; keep them dense, or use them inside "
                                  f"a remote() function")
    leaves, struct, single = describe_outputs(out, fakes, before)
    # A view shares its input's memory on the workers (see _view_made).
    view = any(r.alias_info is not None and not r.alias_info.is_write for r in func._schema.returns)
    if not view and func.name().startswith("aten::set_."):
        view = "set"  # a.set_(b): a shares b's memory from now on (see _join_aliases)
    fold = (torch.Tag.nondeterministic_seeded not in func.tags
            and all(_numel(leaf[1][0]) <= FOLD_NUMEL for leaf in leaves if leaf[0] == "new"))
    return _Template(func.name(), leaves, struct, single, (pos, names), fold, view)


# The reads of a mesh tensor's value that fetch it (a synchronisation), where every rank holds the same value.
_READS = {"aten::_local_scalar_dense": "t.item()", "aten::is_nonzero": "bool(t)"}


def agreed_value(t: Tensor, what: str) -> torch.Tensor:
    """The value of mesh tensor ``t``, fetched from every rank (a synchronisation), where they all hold the same
    one (a loss already averaged over the ranks, a replicated parameter); else a ``MeshTensorError`` with the
    ranks' values and the one-line fetch of one of them. A value the controller knows needs no fetch."""
    if hasattr(t, "_val"):
        return t._val
    from .fetching import preview

    values = preview(t).values()
    first = values[0]
    if all(v.shape == first.shape and (torch.equal(v, first) or (v.is_floating_point() and torch.allclose(
            v, first, rtol=0, atol=0, equal_nan=True))) for v in values[1:]):
        return first
    shape = t._ctx.pm._shape
    shown = "; ".join(f"{dict(shape.point(i))}: {v.flatten()[:4].tolist()}" for i, v in enumerate(values[:4]))
    raise MeshTensorError(f"{what} of a mesh tensor whose ranks hold different values ({shown}"
                          f"{'; ...' if len(values) > 4 else ''}): fetch the one you want, "
                          f"{_fetch_hint([t])}, or reduce it first (t.reduce(dims, 'avg'))")


def _fetch_hint(tensors, then: str = "") -> str:
    """``fetch_shard(t, gpus=0).result()...``: the one-line fetch of a rank's value, in the mesh's own dims."""
    t = next((x for x in tensors if type(x) is Tensor), None)
    names = t._ctx.pm._shape.names if t is not None else ()
    where = ", ".join(f"{n}=0" for n in names)
    return f"fetch_shard(t{', ' + where if where else ''}).result(){then}"


_INDEX_PUTS = {"aten::index_put_", "aten::index_put", "aten::_index_put_impl_"}


def _check_indices_broadcast(indices) -> None:
    """torch's ``index_put_`` refuses integer index tensors that do not broadcast together (``x[[0, 0], [0, 0, 0]]
    = v``) at the call; its meta kernel does not check, and the workers' error came only at a fetch. (A boolean
    mask stands for as many indices as it has true elements: a shape only the workers know.)"""
    indices = [i for i in indices if i is not None]
    if any(i.dtype in (torch.bool, torch.uint8) for i in indices):
        return
    try:
        torch.broadcast_shapes(*(i.shape for i in indices))
    except RuntimeError:
        shapes = ", ".join(str(list(i.shape)) for i in indices)
        raise IndexError(f"shape mismatch: indexing tensors could not be broadcast together with shapes {shapes}") \
            from None


def _written(pos, names, args, kwargs) -> list:
    """The arguments at ``pos``/``names`` (what an op writes in place), lists of them flattened."""
    written = [args[p] for p in pos if p < len(args)] + [kwargs[n] for n in names if n in kwargs]
    return [t for a in written for t in (a if type(a) in (list, tuple) else (a,))]


def _stand_ins(how: str, tensors) -> list:
    """Tensors with the metadata of ``tensors``, for running a call again to raise torch's own error: "zeros"
    (real memory, zeroed), "empty" (memory never touched: for a view, which reads no element, or a call that
    writes its inputs, which torch checks before it writes) or "broadcast" (one zero broadcast to each shape,
    no memory: torch checks shapes before it reads an element)."""
    metas = [t._meta if type(t) is Tensor else meta_of(t) for t in tensors]
    if how == "broadcast":
        return [torch.zeros((), dtype=m[3]).expand(m[0]) for m in metas]
    made = [to_fake(m) for m in metas]
    return [t.zero_() for t in made] if how == "zeros" else made


def _raise_as_torch(func, args, kwargs, tensors) -> None:
    """Run ``func`` here, outside the fake mode, on zeros of its tensors' metadata, to raise torch's own
    error: torch refuses most in-place writes to a tensor whose elements overlap (``x.expand(2, 3).mul_(2)``)
    at the call, and the meta kernels that propagation runs do not check it (the workers' error came only at a
    fetch). An op that allows it (``fill_``) passes. A local tensor argument is replaced by zeros too: the call
    must not write to the script's own tensor."""
    zeros = _stand_ins("zeros", tensors)
    zargs, zkwargs = _substituted(args, kwargs, zeros)
    func(*zargs, **zkwargs)


def _substituted(args, kwargs, replacements: list) -> tuple[tuple, dict]:
    """``args`` and ``kwargs`` with their tensors (also those in lists and tuples), in order, replaced by
    ``replacements``."""
    it = iter(replacements)

    def sub(a):
        if isinstance(a, torch.Tensor):
            return next(it)
        if type(a) in (list, tuple):
            return type(a)(sub(x) for x in a)
        return a

    return tuple(sub(a) for a in args), {k: sub(v) for k, v in kwargs.items()}


def _returns_alias(func) -> bool:
    return any(r.alias_info is not None for r in func._schema.returns)


# The exception types torch's meta kernels raise for a wrong call (torch._check and its kin). The fake mode's
# own exceptions (an op without a fake kernel, ...) are subclasses, and are left as they are.
_META_ERRORS = (RuntimeError, ValueError, IndexError, TypeError, NotImplementedError)

RERUN_NUMEL = 1 << 20


def _check_random_fill(func, args, kwargs, t) -> None:
    """A random fill (``uniform_``, ``normal_``, ``bernoulli_(p)``, ``random_``, ...): torch checks its numbers
    (``uniform_(2, 1)``: "expects to return a [from, to) range") before it draws, and the meta kernel that
    propagation runs does not, so the workers' error came only at a fetch. Run it here on an empty tensor of
    ``t``'s dtype, which draws nothing (``_rng_kept``), and raise torch's error for the numbers ("... expects
    ...") at the user's line. Any other error is the workers' to find: their device may take a dtype that
    the CPU here does not."""
    meta = t._meta if type(t) is Tensor else meta_of(t)
    zargs, zkwargs = _substituted(args, kwargs, [torch.empty(0, dtype=meta[3])])
    try:
        with _rng_kept(zkwargs):
            func(*zargs, **zkwargs)
    except RuntimeError as real:
        if " expects " in str(real):
            real._at_user_line = True
            raise real from None


@contextlib.contextmanager
def _rng_kept(kwargs: dict):
    """A rerun here of a random op draws from no generator the script has: the default one's state is put back
    after it, and a ``generator=`` argument is left out (the check that raises does not depend on it)."""
    if kwargs.get("generator") is not None:
        kwargs["generator"] = None
    with torch.random.fork_rng(devices=[]):
        yield


def _raise_torch_error(func, args, kwargs, tensors, error: Exception) -> None:
    """Raise torch's own error for a call whose fake run raised ``error``. A meta kernel checks what torch's
    kernel checks, but some raise another exception type: ``x.t().view(12)`` and ``x.clamp()`` a ValueError
    (torch: RuntimeError, with its "use .reshape" hint), ``x[[0, 0], [0, 0, 0]]`` and ``torch.empty(0).argmax()``
    a RuntimeError (torch: IndexError), which an ``except`` written for local torch misses, and others another
    message (``a @ b``: "a and b must have same reduction dim", torch: "mat1 and mat2 shapes cannot be
    multiplied"). So the call runs again on zeros of its inputs' metadata (see _raise_as_torch), and what torch
    raises there is raised, from ``error``. Only where that is harmless (an aten op; a random one draws from
    none of the script's generators: ``_rng_kept``) and cheap: at most RERUN_NUMEL elements in all, or else
    on stand-ins that cost no time (see _stand_ins). Else, or where the real call passes (a meta kernel's
    own limit), ``error`` is."""
    if type(error) in _META_ERRORS and func.namespace == "aten":
        small = sum(_extent(t._meta if type(t) is Tensor else meta_of(t)) for t in tensors) <= RERUN_NUMEL
        pos, names = _mutated(func)
        how = "zeros" if small else "empty" if pos or names or func.is_view or _returns_alias(func) else "broadcast"
        try:
            inputs = how and _stand_ins(how, tensors)
        except RuntimeError:  # (no memory for the stand-ins)
            inputs = None
        if inputs is None:
            error._at_user_line = True
            raise error
        try:
            zargs, zkwargs = _substituted(args, kwargs, inputs)
            with _rng_kept(zkwargs):  # (a random op: the script's generators are not drawn from)
                func(*zargs, **zkwargs)
        except Exception as real:
            real._at_user_line = True  # (torch's own error for this call: shown at the user's line)
            raise real from error
    error._at_user_line = True
    raise error


FOLD_NUMEL = 64


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


_UNSUPPORTED = {
    "aten::_local_scalar_dense": "reading a mesh tensor's value on the controller (t.item(), float(t), if t: ...)",
    "aten::is_nonzero": "using a mesh tensor as a Python bool",
    "aten::equal": "torch.equal on mesh tensors (it returns a Python bool)",
}


def record(func, args: tuple, kwargs: dict | None, ctx: Ctx | None):
    """Record ``func(*args, **kwargs)`` on the mesh; return mesh tensors shaped like its result.

    Tensors travel as their ref ids; ``tpos`` lists where they are (an index,
    an ``(index, item)`` pair inside a list argument, or a kwarg name), so a
    batch pickles as plain tuples and ints.
    """
    global epoch
    if _graph_task_id() != -1:  # inside a backward pass: autograd may bind a .grad to this op's result
        epoch += 1
    fid = id(func)  # (``OpOverload.__hash__`` is a Python method: the keys name an op by its id, see _floats_free)
    free = _floats_free.get(fid)
    if free is None:
        free = _op_seen(func)
    dd = _default_dtype()
    key = [fid] if dd is _F32 else [fid, dd]  # (factories and type promotion depend on it)
    tensors: list = []
    local: list = []
    tpos: list = []
    wargs = []
    deep = False
    for i, a in enumerate(args):
        t = type(a)
        if t is Tensor:
            tensors.append(a)
            key.append(a._mid)
            wargs.append(a._ref)
            tpos.append(i)
        elif (t is float or t is int) and free:  # a step size, a counter: new every step, no new propagation
            key.append(t)
            wargs.append(a)
        elif t is int or t is float or t is bool:
            key.append(t)
            key.append(a)
            wargs.append(a)
        elif t is list or t is tuple:
            key.append(t)
            key.append(len(a))
            sub = []
            for j, x in enumerate(a):
                if type(x) is Tensor:
                    tensors.append(x)
                    key.append(x._mid)
                    sub.append(x._ref)
                    tpos.append((i, j))
                elif (type(x) is float or type(x) is int) and free:  # a _foreach_ op's scalars (Adam's step sizes)
                    key.append(type(x))
                    sub.append(x)
                elif type(x) is int:  # a size (view, reshape, permute): as _scan keys it
                    key.append(int)
                    key.append(x)
                    sub.append(x)
                else:
                    w = _scan(x, key, tensors, local)
                    deep = deep or w is not x
                    sub.append(w)
            wargs.append(sub)
        else:
            w = _scan(a, key, tensors, local)
            deep = deep or w is not a
            wargs.append(w)
    if kwargs:
        wkwargs = {}
        for k, v in kwargs.items():
            key.append(k)
            if type(v) is Tensor:
                tensors.append(v)
                key.append(v._mid)
                wkwargs[k] = v._ref
                tpos.append(k)
            elif (type(v) is float or type(v) is int) and free:
                key.append(type(v))
                wkwargs[k] = v
            else:
                w = _scan(v, key, tensors, local)
                deep = deep or w is not v
                wkwargs[k] = w
    else:
        wkwargs = _EMPTY
        kwargs = _EMPTY
    # Where the op runs: its mesh tensors' mesh and stream, all the same.
    for t in tensors:
        if type(t) is Tensor:
            c = t._ctx
            if ctx is None:
                ctx = c
            elif c is not ctx:
                _mismatch(func, ctx, c)
    if ctx is None:
        raise MeshTensorError(f"{func} has no mesh tensor argument and no mesh is active")
    active = state.stream
    if (active.id if active is not None else 0) != ctx.sid:
        _wrong_stream(func, ctx, active)
    if mutable_loans:
        check_readable(func, tensors)
    if dd is not ctx.client.default_dtype:  # torch.set_default_dtype() was called: the workers follow
        ctx.client.default_dtype = dd
        ctx.client.issue(m.CallFunction("torch.set_default_dtype", (dd,), {}, (), (), ctx.sid, user_loc()),
                         ctx.client.all_ranks)
    tkey = tuple(key)
    try:
        tpl = _cache.get(tkey)
    except TypeError:  # an unhashable argument: propagate without caching
        tpl, tkey = None, None
    if tpl is None:
        name = func.name()
        if name in _UNSUPPORTED:
            if all(hasattr(t, "_val") or type(t) is not Tensor for t in tensors):
                return _fold(func, args, kwargs)  # e.g. Adam's step counter: its value is known here
            if name in _READS:  # t.item(), float(t), if t: the value, fetched (the same on every rank)
                return func(agreed_value(tensors[0], _READS[name]))
            raise MeshTensorError(f"{_UNSUPPORTED[name]} is not possible: the value lives on the workers. "
                                  f"Fetch one rank's with {_fetch_hint(tensors)} (or inspect(t)), every "
                                  f"rank's with preview(t); code whose control flow "
                                  f"depends on the values (a loop until a condition holds) runs on the workers in a "
                                  f"remote() function")
        tpl = _propagate(func, args, kwargs, tensors)
        if tkey is not None:
            _cache[tkey] = tpl
        stats["misses"] += 1
    pos, names = tpl.mutates
    if pos or names:  # checked before anything is issued
        written = _mutated_tensors(pos, names, args, kwargs, func)
        mutates = tuple([t._ref for t in written])
        if len(tensors) > 1 and _checks_overlap(fid, func) and _partial_overlap(written, tensors):
            _raise_overlap_as_torch(func, args, kwargs, tensors)
    else:
        written, mutates = (), ()
    if deep and type(kwargs.get("generator")) is torch.Generator:  # (its copy made the call deep: _scan)
        _draw(func, args, kwargs)
    client = ctx.client
    loc = user_loc()
    if local:
        wargs, wkwargs, uploaded = _upload(client, ctx, local, wargs, wkwargs)
    if deep or local:
        tpos.append(DEEP)
    if tpl.single:
        leaf = tpl.leaves[0]
        if leaf[0] == "new":
            ref = next(client.refs)
            out = new_tensor(leaf[1], leaf[2], ctx, ref)
            outs = (ref,)
        else:
            out = tensors[leaf[1]]
            outs = (out._ref,)
            if len(leaf) > 2:
                _set_meta(out, leaf[2], leaf[3])
    else:
        out, outs = _outputs(tpl, tensors, ctx)
    if tpl.view:
        if tpl.view is True:
            _view_made(tensors, out)
        elif len(tensors) > 1:
            _join_aliases(tensors)
            _share_memory(tensors[1:], tensors[0])
    if tpl.fold:
        if written:
            _forget_aliases(written)
        _fold_into(func, args, kwargs, tensors, out, written)
    elif written:  # (the controller does not compute the result: the known values written over are stale)
        _forget_aliases(written)
        _forget_values(written)
    client.issue(m.CallOp(tpl.name, tuple(wargs), wkwargs, tuple(tpos), outs, mutates, ctx.sid, loc), ctx.ranks)
    if local:  # deleted only after the op that reads them is queued (a flush may come in between)
        for ref in uploaded:
            client.delete(ref, ctx.sid)
    if _DIST.n:
        after_record(tensors, out)
    return out


_EMPTY: dict = {}
DEEP = m.DEEP
# Per op seen, by ``id(op)``: whether its shapes ignore number arguments (``_shape_ignores_floats``). ``_ops`` holds
# every op whose id keys this table or the propagation cache, so that no other op takes that id.
_floats_free: dict = {}
_ops: list = []


def _op_seen(func) -> bool:
    _ops.append(func)
    free = _floats_free[id(func)] = _shape_ignores_floats(func)
    return free


_default_dtype = torch.get_default_dtype
_F32 = torch.float32


def _shape_ignores_floats(func) -> bool:
    """Whether no number argument's value can change ``func``'s output metadata: pointwise ops and the
    ``_foreach_`` ops (a float or int scalar there is a value, never a size; type promotion looks at its
    kind). Such numbers stay out of the propagation cache's key: ``x + i`` in a loop over ``i`` made an
    entry per value (2 KB each, never freed)."""
    return torch.Tag.pointwise in func.tags or func.name().startswith("aten::_foreach_")


def _outputs(tpl: _Template, tensors: list, ctx: Ctx):
    refs = ctx.client.refs
    vals, outl = [], []
    for leaf in tpl.leaves:
        kind = leaf[0]
        if kind == "new":
            ref = next(refs)
            vals.append(new_tensor(leaf[1], leaf[2], ctx, ref))
            outl.append(ref)
        elif kind == "alias":
            vals.append(tensors[leaf[1]])
            outl.append(tensors[leaf[1]]._ref)
            if len(leaf) > 2:
                _set_meta(tensors[leaf[1]], leaf[2], leaf[3])
        else:
            vals.append(leaf[1])
            outl.append(None)
    return _rebuild(tpl.struct, iter(vals)), tuple(outl)


_overlap_ops: dict = {}  # by ``id(op)`` (see _floats_free, whose ``_ops`` keeps the ids taken): _checks_overlap


def _checks_overlap(fid: int, func) -> bool:
    """Whether torch refuses ``func`` where a tensor it writes and another of its tensors share memory in part:
    ``copy_`` and the pointwise ops (TensorIterator's check), ``w[1:].copy_(w[:-1])``, ``w[1:].add_(w[:-1])``."""
    c = _overlap_ops.get(fid)
    if c is None:
        c = _overlap_ops[fid] = func.name() == "aten::copy_" or torch.Tag.pointwise in func.tags
    return c


def _partial_overlap(written: list, tensors: list) -> bool:
    """Whether a tensor of ``written`` and another of ``tensors`` share memory in part, as torch's
    ``get_overlap_status`` sees it: both dense (no gaps, no element twice), their bytes intersecting and not
    the same bytes."""
    mems: dict = {}
    for w in written:
        mems.setdefault(memory_of(w), []).append(w)
    for t in tensors:
        if type(t) is not Tensor:
            continue
        ws = mems.get(memory_of(t))
        if not ws:
            continue
        for w in ws:
            if w is t or not (_dense(w._meta) and _dense(t._meta)):
                continue
            _, a0, a1 = memory_span(w)
            _, b0, b1 = memory_span(t)
            if a0 < b1 and b0 < a1 and (a0, a1) != (b0, b1):
                return True
    return False


def _dense(meta: tuple) -> bool:
    """torch's ``is_non_overlapping_and_dense`` of a tensor with this metadata."""
    shape, stride = meta[0], meta[1]
    expected = 1
    for d in sorted((i for i in range(len(shape)) if shape[i] != 1), key=lambda i: stride[i]):
        if stride[d] != expected:
            return False
        expected *= shape[d]
    return True


def _raise_overlap_as_torch(func, args, kwargs, tensors) -> None:
    """A write that partly overlaps another argument (``_partial_overlap``): run ``func`` here on zeros laid
    out as the workers' tensors are, those sharing memory on one buffer, and raise torch's own error for
    that overlap, at the user's line (the workers refused it, and the error came only at a fetch). Where
    torch takes the call, or the memory is too large to lay out here, nothing is raised."""
    ends: dict = {}
    for t in tensors:
        if type(t) is Tensor:
            mem, _, end = memory_span(t)
            ends[mem] = max(ends.get(mem, 0), end)
    if sum(ends.values()) > 8 * RERUN_NUMEL:
        return
    internal, state.internal = state.internal, True  # (local tensors here, not mesh tensors: see _propagate)
    try:
        buffers = {mem: torch.zeros(end, dtype=torch.uint8).untyped_storage() for mem, end in ends.items()}
        ins = []
        for t in tensors:
            if type(t) is Tensor:
                shape, stride, offset, dtype = t._meta[:4]
                ins.append(torch.empty(0, dtype=dtype).set_(buffers[memory_of(t)], offset, shape, stride))
            else:
                ins.append(_stand_ins("zeros", [t])[0])
        zargs, zkwargs = _substituted(args, kwargs, ins)
        func(*zargs, **zkwargs)
    except RuntimeError as e:
        if "single memory location" in str(e):
            e._at_user_line = True
            raise e from None
    finally:
        state.internal = internal


def _mutated_tensors(pos, names, args, kwargs, func) -> list:
    """The mesh tensors ``func`` writes in place (at ``pos``/``names``), each checked to be writable."""
    mut: list = []
    n = len(args)
    for p in pos:
        if p < n:
            _add_mutated(args[p], mut, func)
    for k in names:
        if k in kwargs:
            _add_mutated(kwargs[k], mut, func)
    return mut


def _add_mutated(a, mut: list, func) -> None:
    for t in (a if type(a) is list or type(a) is tuple else (a,)):
        if type(t) is Tensor:
            if borrowing[0]:
                check_writable(func, t)
            mut.append(t)
        elif isinstance(t, torch.Tensor):
            raise MeshTensorError(f"{func}: a local tensor cannot receive the result of an op on mesh tensors "
                                  f"(its value lives on the workers); fetch it with fetch_shard(t).result(), "
                                  f"or make the target inside activate()")


borrowing = [False]  # set by the first Stream.borrow (controller/streams.py)
mutable_loans: set = set()  # the ids of the live mutable borrows (controller/streams.py): while any, reads are checked


class Loans(list):
    """The names of the streams a tensor's memory is lent to (``Stream.borrow``), one list shared by the lent
    tensor and the root of its memory (torch's ``_base``). ``mutable``: the loan is a mutable borrow, which has
    the memory to itself: the lender's stream may neither write nor read it until the drop, for the other
    stream may be writing it meanwhile and the lender's stream waits for that only at the drop."""

    __slots__ = ("mutable",)

    def __init__(self) -> None:
        super().__init__()
        self.mutable = False


def loans_of(t) -> Loans | None:
    """The loans of ``t``'s memory: its own, or those of its root (a view made before or after the loan)."""
    lent = getattr(t, "_lent", None)
    if lent is None:
        root = t._base
        if root is not None:
            lent = getattr(root, "_lent", None)
    return lent


def check_readable(func, tensors) -> None:
    """Refuse a use of a mesh tensor whose memory is lent to another stream with ``mutable=True`` (Monarch's
    BORROWED): the lender's stream would read it while the other stream writes it, and see the old value or
    the new one at random."""
    if not mutable_loans:  # (no mutable borrow is live: nothing to check, per tensor of every op)
        return
    for t in tensors:
        if type(t) is not Tensor:
            continue
        lent = loans_of(t)
        if lent is not None and lent.mutable:
            from .errors import BorrowError

            raise BorrowError(f"{func}: this tensor is lent to stream(s) {sorted(lent)} with mutable=True "
                              f"(stream.borrow(t, mutable=True)); it cannot be read (nor written) until the borrow is "
                              f"dropped, as the other stream may be writing it")


def check_writable(func, t) -> None:
    """Refuse a write to ``t`` while it is lent to another stream, or when it is a read-only borrow; the same
    for a write through a view, whose root (torch's ``_base``) says it for the memory they share."""
    if not borrowing[0]:  # (no borrow yet in this process: nothing to check, per written tensor of every op)
        return
    if not (hasattr(t, "_lent") or hasattr(t, "_read_only")):
        root = t._base
        if root is None or not (hasattr(root, "_lent") or hasattr(root, "_read_only")):
            return
        t = root
    from .errors import BorrowError

    lent = getattr(t, "_lent", None)
    if lent:
        raise BorrowError(f"{func}: this tensor is lent to stream(s) {sorted(lent)} (stream.borrow(t)); it cannot be "
                          f"written until the borrow is dropped")
    if getattr(t, "_read_only", False):
        raise BorrowError(f"{func}: this tensor was borrowed with mutable=False; borrow it with "
                          f"stream.borrow(t, mutable=True) to write it")


# ---- known values --------------------------------------------------------------------------------
# A small tensor computed only from constants holds the same value on every rank,
# so the controller computes it too (``t._val``): ``t.item()`` then needs no fetch.
# This is what lets torch.optim's step counters (``step_t += 1; step_t.item()``) work.
def _local(a):
    t = type(a)
    if t is Tensor:
        return a._val
    if t is list or t is tuple:
        return t(_local(x) for x in a)
    return a


def _reads_here(t: Tensor, val: torch.Tensor) -> bool:
    """Whether ``t.item()`` may return its known value ``val`` without torch's dispatcher, which would bring the
    read to ``record`` only to return the same value there. Not where that trip does more: a dispatch or function
    mode of the user's sees it, compile's recording (``Tensor.__torch_dispatch__`` replaced) refuses to replay
    it, a backward pass counts it (``epoch``), and ``record``'s checks raise for a tensor of another stream or
    lent with ``mutable=True``, and issue a changed default dtype; torch's item() refuses more than one element."""
    active = state.stream
    return (Tensor.__dict__["__torch_dispatch__"] is _PLAIN_DISPATCH and not _dispatch_modes()
            and not _function_modes() and _graph_task_id() == -1
            and (active.id if active is not None else 0) == t._ctx.sid and not mutable_loans
            and _default_dtype() is t._ctx.client.default_dtype and val.numel() == 1)


def _fold(func, args, kwargs):
    state.internal = True
    try:
        return func(*_local(args), **{k: _local(v) for k, v in kwargs.items()})
    finally:
        state.internal = False


def _fold_into(func, args, kwargs, tensors, out, written: list) -> None:
    """Compute ``out``'s value here when every input's value is known (``written``: the mesh tensors ``func``
    writes in place, whose known values go where it cannot be computed)."""
    for t in tensors:
        if type(t) is Tensor and not hasattr(t, "_val"):
            _forget_values(written)
            return
    try:
        res = _fold(func, args, kwargs)
    except Exception:  # noqa: BLE001 - folding is an optimisation; the workers have the value
        _forget_values(written)
        return
    locs = [x for x in tensors if type(x) is not Tensor]
    for o, r in zip(flat_leaves(out), flat_leaves(res)):
        if type(o) is Tensor and isinstance(r, torch.Tensor):
            if not hasattr(o, "_val"):
                o._val = r.clone() if any(r is x for x in locs) else r


# A view shares its base's memory on the workers, so a write through either changes both. A view of a
# tensor that has a known value (or of another such view) joins its alias group (``_aliases``, a WeakSet
# shared by the group), and a write to any member drops the others' known values.
def _view_made(tensors, out) -> None:
    """``out`` is a view of the op's mesh tensor inputs: it uses the first one's memory (``memory_of``), and joins
    the alias group of the first one that has a known value or a group."""
    src = group = None
    for t in tensors:
        if type(t) is Tensor:
            if src is None:
                src = t
            if hasattr(t, "_val") or hasattr(t, "_aliases"):
                group = getattr(t, "_aliases", None)
                if group is None:
                    group = t._aliases = weakref.WeakSet((t,))
                break
    if src is None:
        return
    mem = getattr(src, "_memory", src._ref)  # (memory_of)
    for o in (out,) if type(out) is Tensor else flat_leaves(out):
        if type(o) is Tensor:
            if group is not None and not hasattr(o, "_aliases"):
                o._aliases = group
                group.add(o)
            if o is not src:
                o.__dict__["_memory"] = mem  # (not a name the guards read: Tensor.__setattr__ has nothing to do)


def memory_of(t: Tensor) -> int:
    """Which memory ``t`` uses on the workers, as the ref of the tensor that allocated it: a view (``t[:2]``,
    ``detach()``, ``.data``) or ``a.set_(b)`` uses its input's. Equal answers may overlap; different ones do
    not, as far as the controller saw (a remote function may still return a view of its argument)."""
    return getattr(t, "_memory", t._ref)


def memory_span(t: Tensor) -> tuple:
    """``(memory_of(t), first byte, end byte)``: the bytes of that memory which ``t``'s elements lie within
    (its metadata's offset and strides count in that memory, as torch's views do)."""
    shape, stride, offset, dtype = t._meta[:4]
    size = dtype.itemsize
    if any(d == 0 for d in shape):
        return (memory_of(t), offset * size, offset * size)
    last = offset + sum((d - 1) * abs(st) for d, st in zip(shape, stride))
    return (memory_of(t), offset * size, (last + 1) * size)


def _share_memory(tensors: list, out) -> None:
    """A view's outputs (or ``set_``'s target) use the memory of the op's first mesh tensor input (see
    ``memory_of``): ``MeshClient._fuse`` must not put in-place reduces of one memory in one collective."""
    for src in tensors:
        if type(src) is Tensor:
            break
    else:
        return
    mem = getattr(src, "_memory", src._ref)  # (memory_of)
    for o in (out,) if type(out) is Tensor else flat_leaves(out):
        if type(o) is Tensor and o is not src:
            o.__dict__["_memory"] = mem  # (not a name the guards read: Tensor.__setattr__ has nothing to do)


def _join_aliases(tensors: list) -> None:
    """``a.set_(b)``: ``a`` now shares ``b``'s memory on the workers; their alias groups become one, so that a
    write to either (or to a view of either) drops the other's known value."""
    mesh = [t for t in tensors if type(t) is Tensor]
    group = next((t._aliases for t in mesh if hasattr(t, "_aliases")), None)
    if group is None:
        group = weakref.WeakSet()
    for t in mesh:
        old = getattr(t, "_aliases", None)
        if old is group:  # (adding a member again would compare tensors: an op)
            continue
        for member in list(old) if old is not None else (t,):
            member._aliases = group
            if not any(x is member for x in group):  # (set_data may have left it in this group)
                group.add(member)


def _forget_aliases(written: list) -> None:
    """Tensors were written in place: their views' and bases' known values are stale."""
    for t in written:
        group = getattr(t, "_aliases", None)
        if group is not None:
            for other in list(group):
                if other is not t and hasattr(other, "_val"):
                    del other._val


def forget_value(obj) -> None:
    """The mesh tensors in ``obj`` (a tensor, or tuples, lists and dicts of them) may be written where the
    controller cannot follow (a remote function, an actor, a collective, a borrow): their known values,
    and those of their views and bases, are dropped, and reading one fetches it again."""
    t = type(obj)
    if t is Tensor:
        if hasattr(obj, "_val"):
            del obj._val
        for other in list(getattr(obj, "_aliases", ())):
            if hasattr(other, "_val"):
                del other._val
    elif t in (list, tuple):
        for x in obj:
            forget_value(x)
    elif t is dict:
        for x in obj.values():
            forget_value(x)


def _forget_values(written: list) -> None:
    for t in written:
        if hasattr(t, "_val"):
            del t._val


# A torch.Generator passed to a random op (``torch.randn(3, generator=g)``) stays the script's: each op
# takes a copy of its state to the workers (every rank draws what a local run would), and the controller
# draws the same numbers from ``g`` itself, so that ``g`` moves on as it would locally: the next op, the
# next batch or a local use after activate() continue the stream rather than repeat it.
def _copy_generator(g: torch.Generator) -> torch.Generator:
    copy = torch.Generator(device=g.device)
    copy.set_state(g.get_state())
    return copy


def _draw(func, args, kwargs) -> None:
    """Run ``func`` here on stand-ins of its mesh tensors (ones of their shapes and dtypes), on its generator's
    device, to advance that generator as much as the workers' copies advance. (A sampler that draws as many
    numbers as the values ask for, as ``torch.poisson``, may advance it differently; the workers' numbers
    are right all the same.)"""
    device = kwargs["generator"].device

    def stand_in(a):
        if type(a) is Tensor:
            return torch.ones(a.shape, dtype=a.dtype, device=device)
        if type(a) is list or type(a) is tuple:
            return type(a)(stand_in(x) for x in a)
        return a

    kwargs = {k: stand_in(v) for k, v in kwargs.items()}
    if "device" in kwargs:  # a factory (recorded for the CPU: the workers make it on theirs)
        kwargs["device"] = device
    state.internal = True
    try:
        func(*stand_in(args), **kwargs)
    finally:
        state.internal = False


def _upload(client, ctx: Ctx, local: list, wargs, wkwargs):
    """Local (controller) tensors used by a mesh op travel as constants, then are deleted."""
    subst, uploaded = {}, []
    for t in local:
        ref = next(client.refs)
        client.issue(m.CreateValue(ref, t.detach().clone(), ctx.sid), ctx.ranks)
        uploaded.append(ref)
        subst[id(t)] = m.Ref(ref)

    def sub(a):
        if isinstance(a, torch.Tensor):
            return subst.get(id(a), a)
        if type(a) in (list, tuple):
            return type(a)(sub(x) for x in a)
        return a

    return [sub(a) for a in wargs], {k: sub(v) for k, v in wkwargs.items()}, uploaded


def _mismatch(func, a: Ctx, b: Ctx):
    if a.client is not b.client or a.ranks != b.ranks:
        raise MeshTensorError(f"{func}: its tensors live on different meshes ({a.pm._label()} and {b.pm._label()}); "
                              f"move one with t.to_mesh(mesh)")
    raise MeshTensorError(f"{func}: its tensors live on different streams ({a.stream.name!r} and "
                          f"{b.stream.name!r}); borrow one with stream.borrow(t)")


def check_live(ctx: Ctx, what) -> None:
    """A dropped tensor (its context's stream is -1: ``t.drop()``, or a borrowed one after ``borrow.drop()``)
    is refused."""
    if ctx.sid < 0:
        from .errors import BorrowError

        if getattr(ctx, "dropped_by", None) == "t.drop()":
            raise MeshTensorError(f"{what}: this tensor was dropped (t.drop()); it cannot be used any more")
        raise BorrowError(f"{what}: this borrowed tensor was dropped (borrow.drop()); it cannot be used any more")


def _wrong_stream(func, ctx: Ctx, active):
    name = active.name if active is not None else "main"
    check_live(ctx, func)
    raise MeshTensorError(f"{func}: a tensor of stream {ctx.stream.name!r} used while stream {name!r} is active; "
                          f"borrow it with stream.borrow(t)")
