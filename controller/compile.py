"""``compile`` (Monarch's): record a function's instructions once, then replay them with one message per mesh.

>>> @compile
... def step(x, y):
...     opt.zero_grad()
...     loss = F.cross_entropy(model(x), y)
...     loss.backward()
...     opt.step()
...     return loss.detach()

A call runs ``fn`` as usual while the instructions it issues are recorded (a
*trace*). A trace becomes a *program*, sent to the workers once and kept there
(``worker/program.py``), when replaying it does what running ``fn`` would:

* it leaves no new tensors behind but its results, and drops none the caller
  had (a pure function, or in-place updates of captured tensors), or
* it equals the previous call's trace and, of the tensors the caller had, it
  dropped exactly those the previous call left behind: the steady state of a
  training step, whose gradients ``zero_grad()`` drops and ``backward()``
  makes anew. Its program writes the new ones into the tensors the last
  recorded call left (``p.grad``), which stay bound where that call bound them.

A later call whose arguments match (tensors: metadata, mesh, stream, aliasing;
anything else: equal values) and whose guards hold is one ``RunProgram``: the
controller does not run ``fn``, it makes the result tensors and sends the
input and output refs. The key includes the grad mode. Guards: the tensors
the trace used from outside (captured: globals, closures, parameters,
optimizer state) keep their refs, metadata, mesh and ``requires_grad``;
parameters' ``.grad`` are the tensors the trace left, with their refs; no one
else holds those; no module the trace called had a parameter, buffer or
submodule assigned, and no captured tensor was replaced in a module;
optimizers stepped inside keep their hyperparameters (``lr`` changed by a
scheduler); local tensors the trace uploaded keep their values. The
per-tensor guards are checked only when the guards' epoch
(``controller/tensor.py``) moved since they last held, and the reference
counts of the gradients it left only after that or a read of a ``.grad``, so
a replay's cost does not grow with the number of parameters (the counts of
other tensors it left, an optimizer's state, are compared on every call). A call that fails a guard records again (at most ``CACHE_SIZE``
programs per function). ``verify=True`` records once more the first time a
program would be reused and raises, naming the line, where the two traces
differ.

Not replayable (the function then runs uncompiled, with one warning): a trace
that read a value on the controller (``t.item()`` of a known value, as
``torch.optim.Adam`` does without ``fused=True``), changed a captured tensor's
metadata or ref (``t.t_()``, ``t.data = ...``), stored an argument, used
streams, borrows, actors or two meshes; or one that still differs from the
previous call after ``MAX_RECORDINGS`` calls. A fetch inside is an error at
its line. Python state the function changes other than tensors (a counter, a
scheduler stepped inside) is not replayed: step schedulers outside it.
"""

from __future__ import annotations

import collections
import functools
import gc
import operator
import sys
import warnings
import weakref

import torch
from monarch_tensor.worker import messages as m
from monarch_tensor.worker.interface import flat_leaves
from monarch_tensor.worker.opaque import OpaqueRef
from torch.nn.modules import module as _module
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.utils import _pytree as pytree

from . import tensor as _t
from .client import _flusher, coalescing, user_loc
from .dtensor import placements_of
from .dtensor_methods import ACTIVE, DistInfo
from .errors import MeshTensorError
from .tensor import Tensor, forget_value, memory_of, new_tensor, record
from .torch_patches import _FactoryMode

CACHE_SIZE = 8       # programs kept per compiled function (least recently used dropped)
OFFSET_KEYS_WARN = 3  # keys differing only by storage offsets before compile warns (_look_for_moving_views)
MAX_RECORDINGS = 4   # recordings in a row that cannot be replayed before a key runs uncompiled
_SUPPORTED = (m.CallOp, m.CallFunction, m.CreateValue, m.CreateRank, m.Reduce, m.ReduceMany)
_HOST_READS = ("aten::_local_scalar_dense", "aten::is_nonzero", "aten::equal")

_active: list = []  # the recorder of the call being recorded (at most one)
stats = {"recordings": 0, "replays": 0}


# ---- refs inside instructions --------------------------------------------------------------------------
def _deep(a, f):
    t = type(a)
    if t is m.Ref:
        return m.Ref(f(a.id))
    if t is tuple or t is list:
        return t(_deep(x, f) for x in a)
    if t is dict:
        return {k: _deep(v, f) for k, v in a.items()}
    if isinstance(a, OpaqueRef):
        return OpaqueRef._create(_deep(a._key, f))
    if isinstance(a, tuple) and hasattr(t, "_fields"):
        return t(*(_deep(x, f) for x in a))
    return a


def _opt(f):
    return lambda r: None if r is None else f(r)


def rename(instr, f):
    """``instr`` with every tensor ref ``r`` in it replaced by ``f(r)``."""
    t = type(instr)
    if t is m.CallOp:
        args, kwargs, deep = list(instr.args), dict(instr.kwargs), False
        for p in instr.tpos:
            if type(p) is int:
                args[p] = f(args[p])
            elif type(p) is tuple:
                i, j = p
                sub = list(args[i])
                sub[j] = f(sub[j])
                args[i] = sub
            elif p == m.DEEP:
                deep = True
            else:
                kwargs[p] = f(kwargs[p])
        if deep:
            args, kwargs = _deep(args, f), _deep(kwargs, f)
        return m.CallOp(instr.op, tuple(args), kwargs, instr.tpos, tuple(map(_opt(f), instr.outs)),
                        tuple(map(f, instr.mutates)), instr.stream, instr.loc)
    if t is m.CallFunction:
        return m.CallFunction(instr.fn, _deep(instr.args, f), _deep(instr.kwargs, f), tuple(map(_opt(f), instr.outs)),
                              tuple(map(f, instr.mutates)), instr.stream, instr.loc, instr.metas)
    if t is m.CreateValue:
        return m.CreateValue(f(instr.ref), instr.value, instr.stream)
    if t is m.CreateRank:
        return m.CreateRank(f(instr.ref), instr.coords, instr.stream)
    if t is m.Reduce:
        return m.Reduce(f(instr.out), f(instr.src), instr.groups, instr.reduction, instr.scatter, instr.inplace,
                        instr.numel, instr.dtype, instr.stream, instr.loc)
    if t is m.ReduceMany:
        return m.ReduceMany(tuple(map(f, instr.outs)), tuple(map(f, instr.srcs)), instr.groups, instr.reduction,
                            instr.inplace, instr.numels, instr.dtype, instr.stream, instr.locs)
    raise TypeError(type(instr).__name__)


def refs_in(instr) -> list:
    """The tensor refs ``instr`` reads or writes, in order."""
    out: list = []
    rename(instr, lambda r: out.append(r) or r)
    return out


class _Value:
    """A constant in a trace, compared by dtype, shape and value (a tensor's ``==`` is elementwise)."""

    __slots__ = ("v",)

    def __init__(self, v) -> None:
        self.v = v

    def __eq__(self, other) -> bool:
        a, b = self.v, other.v if type(other) is _Value else other
        if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
            return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype
                    and a.shape == b.shape and bool(torch.equal(a, b)))
        return a == b

    __hash__ = None

    def __repr__(self) -> str:
        return repr(self.v)


def _loc_str(loc) -> str:
    return f"{loc[0]}:{loc[1]} in {loc[2]}" if loc else "an unknown line"


def _instr_loc(instr):
    loc = getattr(instr, "loc", None)
    if loc is None and type(instr) is m.ReduceMany:
        loc = instr.locs[0]
    return loc


def _what(instr) -> str:
    t = type(instr)
    if t is m.CallOp:
        return instr.op
    if t is m.CallFunction:
        return f"remote function {getattr(instr.fn, '__qualname__', instr.fn)}"
    return t.__name__


# ---- recording ------------------------------------------------------------------------------------------
class _Recorder:
    """Captures what one call issues: every batch sent, every ref deleted, the tensor objects its ops used."""

    def __init__(self) -> None:
        self.clients = list(_flusher._clients)
        self.start: dict = {}
        self.batches: list = []
        self.deleted: set = set()
        self.seen: dict = {}        # ref -> (tensor, mid, ctx, known value) of tensors from before the call
        self.created: dict = {}     # ref -> weakref of tensors made during the call
        self.locals: list = []      # (local tensor, its value) the call's ops uploaded
        self.refusal = None         # (why the trace cannot be replayed, where)
        self.optimizers: dict = {}  # id -> optimizer stepped during the call
        self.modules: set = set()   # ids of the modules called during the call

    def refuse(self, why: str, loc=None) -> None:
        if self.refusal is None:
            self.refusal = (why, loc if loc is not None else user_loc())

    def install(self) -> None:
        for c in self.clients:
            c.flush()
            self.start[c] = next(c.refs)
            c._send = functools.partial(self._send, c)
            c.delete = functools.partial(self._delete, c)
            c.request = self._request
            c.issue_later = functools.partial(self._issue_later, c)
        self._hook = register_optimizer_step_pre_hook(self._opt_hook)
        self._mhook = _module.register_module_forward_pre_hook(self._module_hook)
        Tensor.__torch_dispatch__ = classmethod(_recording_dispatch)
        _FactoryMode.__torch_dispatch__ = _recording_factory

    def uninstall(self) -> None:
        Tensor.__torch_dispatch__ = _ORIG_DISPATCH
        _FactoryMode.__torch_dispatch__ = _ORIG_FACTORY
        self._hook.remove()
        self._mhook.remove()
        for c in self.clients:
            for name in ("_send", "delete", "request", "issue_later"):
                c.__dict__.pop(name, None)

    def _send(self, client, batch: list, ranks: tuple) -> None:
        type(client)._send(client, batch, ranks)
        kept = [instr for instr in batch if type(instr) is not m.DeleteRefs]  # (deletes: see _delete)
        if kept:
            self.batches.append((client, kept, ranks))

    def _delete(self, client, ref: int, sid: int) -> None:
        self.deleted.add(ref)
        type(client).delete(client, ref, sid)

    def _issue_later(self, client, instr, ranks) -> None:
        self.refuse("a borrow was dropped inside the compiled function")
        type(client).issue_later(client, instr, ranks)

    def _request(self, *args, **kwargs):
        raise MeshTensorError(f"fetching a value inside a compiled function is not possible (at "
                              f"{_loc_str(user_loc())}): a replay does not run the function's Python code, so it "
                              f"could not wait for the value; return the tensor from the function and fetch it after "
                              f"the call")

    def _opt_hook(self, opt, args, kwargs) -> None:
        if id(opt) not in self.optimizers:  # (the hyperparameters it steps with, and which tensors)
            self.optimizers[id(opt)] = (opt, _settings(opt), _stepped(opt))

    def _module_hook(self, module, args) -> None:
        self.modules.add(id(module))

    def note(self, func, args, kwargs) -> None:
        if func is not None and func.name() in _HOST_READS:
            self.refuse(f"the function reads a tensor's value on the controller ({func.name()}: t.item(), "
                        f"float(t), if t: ...), which a replay could not follow (torch.optim's Adam and AdamW do "
                        f"that without fused=True)")
        for a in (*args, *kwargs.values()):
            t = type(a)
            if t is Tensor:
                self._see(a)
            elif t is list or t is tuple:
                for x in a:
                    if type(x) is Tensor:
                        self._see(x)
                    elif isinstance(x, torch.Tensor):
                        self.locals.append((x, x.detach().clone()))
            elif isinstance(a, torch.Tensor):
                self.locals.append((a, a.detach().clone()))

    def _see(self, t: Tensor) -> None:
        r = t._ref
        if r in self.seen or r in self.created:
            return
        start = self.start.get(t._ctx.client)
        if start is None or r < start:
            val = getattr(t, "_val", None)
            self.seen[r] = (t, t._mid, t._ctx, None if val is None else val.clone())

    def made(self, out) -> None:
        for o in flat_leaves(out) if type(out) is not Tensor else (out,):
            if type(o) is Tensor:
                self.created.setdefault(o._ref, weakref.ref(o))


_ORIG_DISPATCH = Tensor.__dict__["__torch_dispatch__"]


def _recording_dispatch(cls, func, types, args=(), kwargs=None):
    rec = _active[0] if _active else None
    if rec is not None:
        rec.note(func, args, kwargs or {})
    out = record(func, args, kwargs, None)
    if rec is not None:
        rec.made(out)
    return out


_ORIG_FACTORY = _FactoryMode.__dict__["__torch_dispatch__"]


def _recording_factory(self, func, types, args=(), kwargs=None):
    out = _ORIG_FACTORY(self, func, types, args, kwargs)
    if _active:
        _active[0].made(out)
    return out


def _value(v):
    """A hyperparameter, comparable: a local tensor by value, a mesh tensor by identity (its value lives on the
    workers, which read it)."""
    if type(v) is Tensor:
        return ("mesh tensor", id(v))
    if isinstance(v, torch.Tensor):
        return ("tensor", v.dtype, tuple(v.shape), tuple(v.detach().flatten().tolist()) if v.numel() <= 64 else id(v))
    return v


def _settings(opt) -> tuple:
    """An optimizer's param groups' settings (``lr``, ``betas``...), comparable; not which tensors they step."""
    return tuple(tuple((k, _value(v)) for k, v in g.items() if k != "params") for g in opt.param_groups)


def _stepped(opt) -> tuple:
    """Which tensors each of an optimizer's param groups steps (``param_groups[0]["params"][i] = p`` changes it);
    a program holds them, so their ids are unique."""
    return tuple(tuple(map(id, g["params"])) for g in opt.param_groups)


class _WatchedParams(list):
    """A param group's ``params`` list once a compiled function stepped its optimizer: a list whose every change
    moves the guards' epoch (``controller/tensor.py``), so that a replay compares which tensors the groups step,
    one id per parameter, only after a change, as it does its other per-tensor guards."""

    __slots__ = ()


def _moves_epoch(name: str):
    method = getattr(list, name)

    def changed(self, *args, **kwargs):
        _t.epoch += 1
        return method(self, *args, **kwargs)

    changed.__name__ = name
    return changed


for _name in ("__setitem__", "__delitem__", "__iadd__", "__imul__", "append", "extend", "insert", "pop", "remove",
              "clear", "sort", "reverse"):
    setattr(_WatchedParams, _name, _moves_epoch(_name))


_ONLY_THE_GROUP = 3  # a list's references when only its param group holds it (and the two of the look)


def _watch(opt) -> tuple:
    """Make each of ``opt``'s param groups' ``params`` a ``_WatchedParams`` (same items) where nothing else holds
    that list: a list the script holds too (``plist = opt.param_groups[0]["params"]``) stays, since its changes
    through ``plist`` must reach the optimizer, and is compared item by item every call. The groups and their
    lists, for a replay's identity checks."""
    for g in opt.param_groups:
        lst = g.get("params")
        if type(lst) is list and sys.getrefcount(lst) <= _ONLY_THE_GROUP:
            g["params"] = _WatchedParams(lst)
        del lst
    return tuple(opt.param_groups), tuple(g["params"] for g in opt.param_groups)


class _OptimizerGuard:
    """What a program assumes of an optimizer it steps: the same settings, stepping the same tensors. A replay
    compares the settings (per group) and the groups' and their lists' identities; which tensors each list holds
    only after the guards' epoch moved (a ``_WatchedParams`` changed, or a tensor's guarded attribute), or when a
    group or its list was replaced."""

    __slots__ = ("opt", "settings", "stepped", "groups", "lists", "unwatched")

    def __init__(self, opt, settings: tuple, stepped: tuple) -> None:
        self.opt, self.settings, self.stepped = opt, settings, stepped
        self._watch()

    def _watch(self) -> None:
        self.groups, self.lists = _watch(self.opt)
        # (a group's params the script holds too, or of another type than a list or a tuple, could change
        # unseen: compared every call)
        self.unwatched = any(type(lst) is not _WatchedParams and type(lst) is not tuple for lst in self.lists)

    def same(self, full: bool) -> bool:
        """Whether ``opt`` still steps as recorded; ``full``: compare which tensors it steps too."""
        opt = self.opt
        if _settings(opt) != self.settings:
            return False
        pg = opt.param_groups
        if len(pg) != len(self.groups) or not all(map(operator.is_, pg, self.groups)) or \
                not all(g.get("params") is lst for g, lst in zip(pg, self.lists)):  # a group or its list replaced
            if _stepped(opt) != self.stepped:
                return False
            self._watch()  # the same tensors: watched again, checked by identity after
            return True
        return not (full or self.unwatched) or _stepped(opt) == self.stepped


def _autocast() -> tuple:
    """The autocast state a recording depends on (``with torch.autocast(...)``: casts recorded inside)."""
    return tuple((torch.is_autocast_enabled(d), torch.get_autocast_dtype(d)) if torch.is_autocast_enabled(d) else False
                 for d in _AUTOCAST_DEVICES)


_AUTOCAST_DEVICES = ("cpu", "cuda")


# ---- arguments -----------------------------------------------------------------------------------------
def _flatten(a, leaves: list, spec: list) -> None:
    t = type(a)
    if t is tuple or t is list:
        spec.append((t, len(a)))
        for x in a:
            _flatten(x, leaves, spec)
    elif t is dict:
        spec.append((dict, tuple(a)))
        for x in a.values():
            _flatten(x, leaves, spec)
    elif isinstance(a, tuple) and hasattr(t, "_fields"):  # a named tuple
        spec.append((t, len(a)))
        for x in a:
            _flatten(x, leaves, spec)
    else:
        spec.append(None)
        leaves.append(a)


def _unflatten(spec: tuple, leaves) -> object:
    return _build(iter(spec), iter(leaves))


def _build(sit, it):
    s = next(sit)
    if s is None:
        return next(it)
    t, n = s
    if t is dict:
        return {k: _build(sit, it) for k in n}
    items = [_build(sit, it) for _ in range(n)]
    return t(items) if t is tuple or t is list else t(*items)


# ---- traces -------------------------------------------------------------------------------------------
class _Trace:
    """What one recorded call did, in the terms a program needs (see the module docstring)."""

    def __init__(self) -> None:
        self.refusal = None      # (why, loc): cannot be replayed
        self.client = self.ranks = self.sid = None
        self.instrs: list = []   # as issued (absolute refs)
        self.canon: list = []    # refs as tokens: ("i", k) input, ("o", j) result, ("e", n) left behind,
        #                          ("t", n) temporary, ("c", ref) captured
        self.tokens: dict = {}   # ref -> token
        self.formal_refs: tuple = ()
        self.out_desc: tuple = ()  # per result leaf: ("in", k) | ("new", j) | ("obj", weakref) | ("val", v)
        self.out_new: list = []    # per new result j: (meta, mid, ctx, memory link)
        self.out_dist: list = []   # per new result j: its DistInfo (a global tensor's layout), or None
        self.spec: tuple = ()
        self.escapees: list = []   # weakrefs, in token order
        self.esc_refs: list = []
        self.captured: list = []   # (weakref, ref, mid, ctx)
        self.params: list = []     # (weakref of a captured leaf that requires grad, its .grad or None)
        self.forget: list = []     # weakrefs of captured tensors whose known value the call changed
        self.deleted_pre: set = set()
        self.optimizers: list = []  # (optimizer, hyperparameters)
        self.locals: list = []
        self.modules: frozenset = frozenset()  # ids of the modules it called

    @property
    def standalone(self) -> bool:
        return not self.escapees and not self.deleted_pre

    def same_as(self, other: _Trace) -> bool:
        return (other is not None and self.client is other.client and self.ranks == other.ranks
                and self.spec == other.spec and self.out_desc_key() == other.out_desc_key()
                and len(self.canon) == len(other.canon) and self.canon == other.canon)

    def out_desc_key(self) -> tuple:
        return tuple(("obj", id(d[1]())) if d[0] == "obj" else d for d in self.out_desc) + \
            tuple((n[1], id(n[2])) for n in self.out_new)

    def first_difference(self, other: _Trace) -> str:
        for i, (a, b) in enumerate(zip(self.canon, other.canon)):
            if a != b:
                return (f"instruction {i} differs: {_what(self.instrs[i])} at {_loc_str(_instr_loc(self.instrs[i]))}"
                        f" (the earlier recording: {_what(other.instrs[i])} at "
                        f"{_loc_str(_instr_loc(other.instrs[i]))})")
        if len(self.canon) != len(other.canon):
            n = min(len(self.canon), len(other.canon))
            longer = self if len(self.canon) > n else other
            return (f"one recording has {len(self.canon)} instructions, the other {len(other.canon)}; the first extra "
                    f"one: {_what(longer.instrs[n])} at {_loc_str(_instr_loc(longer.instrs[n]))}")
        return "the function's results differ (their structure, metadata or non-tensor values)"


def _canonical(instr, token):
    c = rename(instr, token)
    return ("CreateValue", c.ref, _Value(c.value)) if type(c) is m.CreateValue else c


def _find(refs: set, client) -> dict:
    """ref -> mesh tensor object of ``client``, for ``refs``, searching every tensor the script holds (for tensors
    that reached the instructions other than through an op's dispatch: a reduce, a remote function)."""
    found = {}
    for o in gc.get_objects():
        if type(o) is Tensor and o._ref in refs and o._ctx.client is client:
            found[o._ref] = o
    return found


def _analyse(rec: _Recorder, formals: list, inputs: list, leaves: list, spec: tuple, loc) -> _Trace:
    tr = _Trace()
    tr.spec = spec
    tr.locals = rec.locals
    tr.modules = frozenset(rec.modules)
    if rec.refusal is not None:
        tr.refusal = rec.refusal
        return tr
    if set(_flusher._clients) - set(rec.clients):
        tr.refusal = ("the function used a mesh for the first time; call it once before compiling", loc)
        return tr
    batches = rec.batches
    clients = {id(c) for c, _, _ in batches}
    if len(clients) > 1 or len({r for _, _, r in batches}) > 1:
        tr.refusal = ("the function's instructions went to more than one mesh (or mesh slice)", loc)
        return tr
    instrs = [i for _, b, _ in batches for i in b]
    if not instrs:
        tr.refusal = ("the function issued nothing to a mesh", loc)
        return tr
    client, ranks = batches[0][0], batches[0][2]
    tr.client, tr.ranks, tr.instrs = client, ranks, instrs
    for i in instrs:
        if type(i) not in _SUPPORTED:
            tr.refusal = (f"{type(i).__name__} (streams, borrows, actors, fetches, moves between meshes) is not "
                          f"supported in a compiled function", _instr_loc(i) or loc)
            return tr
        if type(i) is m.CallFunction and any(isinstance(x, torch.Tensor) for x in pytree.tree_leaves((i.args, i.kwargs))):
            tr.refusal = ("a remote function inside a compiled function was passed a local tensor", i.loc)
            return tr
    sids = {getattr(i, "stream", None) for i in instrs}
    if len(sids) != 1:
        tr.refusal = ("the function's instructions ran on more than one stream", loc)
        return tr
    tr.sid = sids.pop()
    start = rec.start[client]
    # Results: inputs returned as they are, tensors made by the call, tensors from before, values.
    tr.formal_refs = tuple(f._ref for f in formals)
    out_refs: dict = {}
    desc = []
    for leaf in leaves:
        if type(leaf) is Tensor:
            k = next((j for j, x in enumerate(inputs) if x is leaf), None)
            if k is not None:
                desc.append(("in", k))
            elif leaf._ref >= start:
                j = out_refs.setdefault(leaf._ref, len(out_refs))
                if j == len(tr.out_new):
                    tr.out_new.append((leaf._meta, leaf._mid, leaf._ctx, memory_of(leaf)))
                    tr.out_dist.append(getattr(leaf, "_dist", None))
                desc.append(("new", j))
            else:
                desc.append(("obj", weakref.ref(leaf)))
        elif isinstance(leaf, torch.Tensor):
            tr.refusal = ("the function returned a local tensor", loc)
            return tr
        else:
            desc.append(("val", _Value(leaf)))
    tr.out_desc = tuple(desc)
    # Which memory each new result uses (``memory_of``), as the replay's results will name it.
    in_mems = [memory_of(x) for x in inputs]
    first_of: dict = {}
    for j, (meta, mid, ctx, mem) in enumerate(tr.out_new):
        if mem in out_refs and out_refs[mem] != j:
            link = ("out", out_refs[mem])
        elif mem in out_refs:
            link = None
        elif mem in in_mems:
            link = ("in", in_mems.index(mem))
        elif mem < start:
            link = ("mem", mem)
        else:
            link = ("out", first_of[mem]) if mem in first_of else None
            first_of.setdefault(mem, j)
        tr.out_new[j] = (meta, mid, ctx, link)
    # Tokens, in order of first use.
    formal_tok = {r: ("i", k) for k, r in enumerate(tr.formal_refs)}
    used = []
    seen_refs: set = set()
    for i in instrs:
        for r in refs_in(i):
            if r not in seen_refs:
                seen_refs.add(r)
                used.append(r)
    made = [r for r in used if r >= start and r not in formal_tok]
    alive = [r for r in made if r not in rec.deleted and r not in out_refs]
    if alive:  # (a tensor in a recent reference cycle is deleted only by the collector: its young generations)
        gc.collect(1)
        alive = [r for r in alive if r not in rec.deleted]
    tokens = dict(formal_tok)
    for r, j in out_refs.items():
        tokens[r] = ("o", j)
    esc = {r: ("e", n) for n, r in enumerate(alive)}
    tokens.update(esc)
    nt = 0
    for r in made:
        if r not in tokens:
            tokens[r] = ("t", nt)
            nt += 1
    captured = [r for r in used if r < start and r not in tokens]
    for r in captured:
        tokens[r] = ("c", r)
    tr.tokens = tokens
    tr.canon = [_canonical(i, tokens.__getitem__) for i in instrs]
    # The objects behind the refs.
    objs = {r: w() for r, w in rec.created.items() if r in esc}
    objs.update((r, rec.seen[r][0]) for r in captured if r in rec.seen)
    missing = {r for r in (*alive, *captured) if objs.get(r) is None}
    if missing:
        objs.update(_find(missing, client))
        missing = {r for r in missing if objs.get(r) is None}
        if missing:
            tr.refusal = (f"the tensors of refs {sorted(missing)[:5]} that the function used or left could not be "
                          f"found on the controller", loc)
            return tr
    tr.esc_refs = list(alive)
    tr.escapees = [weakref.ref(objs[r]) for r in alive]
    for r in captured:
        o = objs[r]
        before = rec.seen.get(r)
        if before is not None and (o._ref != r or o._mid != before[1] or o._ctx is not before[2]):
            tr.refusal = ("the function changed a tensor it uses from outside in a way a replay cannot follow (its "
                          "metadata in place, t.data = ..., t.drop())", loc)
            return tr
        tr.captured.append((weakref.ref(o), r, o._mid, o._ctx))
        if before is not None and not _same_value(before[3], getattr(o, "_val", None)):
            tr.forget.append(weakref.ref(o))
        if o.requires_grad and o.is_leaf:
            g = o.grad
            if g is not None and any(d[0] == "new" and g._ref in out_refs for d in desc):
                tr.refusal = ("the function returns a parameter's .grad; return a copy (p.grad.clone())", loc)
                return tr
            tr.params.append((weakref.ref(o), None if g is None else weakref.ref(g)))
    for r in alive:
        if hasattr(objs[r], "_val"):
            tr.forget.append(weakref.ref(objs[r]))
    tr.deleted_pre = {r for r in rec.deleted if r < start}
    for opt, settings, stepped in rec.optimizers.values():
        if _settings(opt) != settings or _stepped(opt) != stepped:
            tr.refusal = ("an optimizer's hyperparameters changed inside the compiled function (a learning-rate "
                          "scheduler stepped inside it?): step schedulers outside it", loc)
            return tr
        tr.optimizers.append((opt, settings, stepped))
    return tr


def _same_value(a, b) -> bool:
    if a is None or b is None:
        return a is None and b is None
    return a.dtype == b.dtype and a.shape == b.shape and bool(torch.equal(a, b))


# ---- programs -----------------------------------------------------------------------------------------
OK, MISS, DEAD = 0, 1, 2
_IDS = operator.attrgetter("_ref", "_mid", "_ctx")
_GRAD = _t._BASE_GRAD.__get__  # (not ``Tensor.grad``, which counts a read: ``_t.grad_reads``)
_RG = operator.attrgetter("requires_grad")
_live: weakref.WeakSet = weakref.WeakSet()  # every program, for _registered
_hooks: list = []


def _registered(module, name: str, value):
    """A module's parameter, buffer or submodule is (re)assigned (``module.weight = ...``; torch's global
    registration hooks): the programs that called that module, or that use what the assignment replaces, no
    longer replay what their function does; they are dropped at their next call, which records anew."""
    d = module.__dict__
    old = [x for x in (d.get(k, {}).get(name) for k in ("_parameters", "_buffers", "_modules")) if x is not None]
    if any(x is value for x in old):  # (the same object again: nothing changed)
        return
    tensors: set = set()
    modules = {id(module)}
    for x in old:
        if isinstance(x, torch.nn.Module):
            modules.update(map(id, x.modules()))
            tensors.update(map(id, x.parameters()))
            tensors.update(map(id, x.buffers()))
        else:
            tensors.add(id(x))
    for prog in list(_live):
        if not modules.isdisjoint(prog.modules) or not tensors.isdisjoint(prog.cap_id_set):
            prog.stale = True


def _watch_modules() -> None:
    if not _hooks:
        _hooks.extend((_module.register_module_parameter_registration_hook(_registered),
                       _module.register_module_buffer_registration_hook(_registered),
                       _module.register_module_module_registration_hook(_registered)))
        # torch has no hook for ``del module.weight``: Module.__delattr__ is wrapped (once, for every module) to
        # report it as _registered does an assignment.
        delattr_ = torch.nn.Module.__delattr__

        def __delattr__(module, name):
            d = module.__dict__
            if any(name in d.get(k, ()) for k in ("_parameters", "_buffers", "_modules")):
                _registered(module, name, None)
            delattr_(module, name)

        __delattr__.__wrapped__ = delattr_
        torch.nn.Module.__delattr__ = __delattr__


class _Program:
    """A trace kept on the workers (``DefineProgram``) and the guards under which replaying it is running the
    function. It holds the captured tensors and those the trace left behind (their refs stay valid); when it is
    garbage-collected, its delete frees the program on the workers."""

    def __init__(self, tr: _Trace, verified: bool) -> None:
        client = tr.client
        self.client, self.ranks, self.sid, self.verified, self.trace = client, tr.ranks, tr.sid, verified, tr
        self.pid = pid = next(client.refs)
        base = -(pid << 24)
        slots: dict = {}
        for r, tok in tr.tokens.items():
            if tok[0] in ("i", "o", "t"):
                slots[r] = base - len(slots) - 1
        ins = tuple(slots[r] for r in tr.formal_refs)
        outs = [None] * len(tr.out_new)
        for r, tok in tr.tokens.items():
            if tok[0] == "o":
                outs[tok[1]] = slots[r]

        def fixed(r):
            return slots.get(r, r)

        instrs = [rename(i, fixed) for i in tr.instrs]
        last: dict = {}
        for n, i in enumerate(instrs):
            for r in refs_in(i):
                last[r] = n
        temps = {slots[r] for r, tok in tr.tokens.items() if tok[0] == "t"}
        frees: list = [[] for _ in instrs]
        for r, n in last.items():
            if r in temps:
                frees[n].append(r)
        client.issue(m.DefineProgram(pid, tuple(instrs), ins, tuple(outs), tuple(map(tuple, frees)), tr.sid),
                     tr.ranks)
        self.captured = [(w(), r, mid, ctx) for w, r, mid, ctx in tr.captured]
        self.cap_objs = [o for o, _, _, _ in self.captured]
        self.cap_ids = [(r, mid, ctx) for _, r, mid, ctx in self.captured]
        self.params = [(w(), None if g is None else g()) for w, g in tr.params]
        self.param_objs = [p for p, _ in self.params]
        self.grads = [g for _, g in self.params]
        self.escapees = [w() for w in tr.escapees]
        self.forget = [w() for w in tr.forget]
        self.optimizers = [_OptimizerGuard(*o) for o in tr.optimizers]
        self.locals = tr.locals
        self.cap_memories = {memory_of(o) for o, _, _, _ in self.captured if o is not None}
        self.out_desc = tuple(("obj", d[1]()) if d[0] == "obj" else d for d in tr.out_desc)
        self.out_new = tr.out_new
        self.out_dist = tr.out_dist
        self.spec = tr.spec
        self.esc_ids = list(map(_IDS, self.escapees))
        self.cap_rg = list(map(_RG, self.cap_objs))
        self.cap_id_set = frozenset(map(id, self.cap_objs))
        self.modules = tr.modules
        self.stale = False   # a module it uses changed (_registered)
        self.epoch = -1      # the guards' epoch (controller/tensor.py) at which its per-tensor guards last held
        _watch_modules()
        _live.add(self)
        # The tensors it left that are its parameters' gradients (``p.grad``, a mesh tensor): a new reference to
        # one is taken by reading ``p.grad`` first (``_t.grad_reads``), or after the epoch moved (``p.grad`` set
        # anew); their counts are compared only then. The others it left (an optimizer's state in its dicts, which
        # a script reads without a trace) on every call.
        grads = {id(g) for g in self.grads if g is not None and type(g) is _t.Tensor}
        grads = set(map(id, _held_by_us_alone([e for e in self.escapees if id(e) in grads],
                                              [self.escapees, self.grads, *self.params])))
        self.esc_grads = [e for e in self.escapees if id(e) in grads]
        self.esc_others = [e for e in self.escapees if id(e) not in grads]
        self.grad_counts = list(map(sys.getrefcount, self.esc_grads))
        self.other_counts = list(map(sys.getrefcount, self.esc_others))
        self.reads = _t.grad_reads  # the count of grad reads at which the gradients' counts last held

    def complete(self) -> bool:
        """Whether every tensor it holds was still alive when it was made."""
        return all(o is not None for o, _, _, _ in self.captured) and all(p is not None for p, _ in self.params) \
            and all(e is not None for e in self.escapees) and all(d[1] is not None for d in self.out_desc
                                                                  if d[0] == "obj")

    def holds(self, inputs: list) -> int:
        # Reference counts first: the loops below hold some.
        if self.stale or list(map(sys.getrefcount, self.esc_others)) != self.other_counts:
            return DEAD
        now = _t.epoch
        reads = _t.grad_reads
        if now != self.epoch or reads != self.reads:
            if list(map(sys.getrefcount, self.esc_grads)) != self.grad_counts:
                return DEAD
            self.reads = reads
        # The per-tensor guards (refs, metadata, mesh, requires_grad of the tensors it uses and leaves, the
        # parameters' .grad) can only have changed if the guards' epoch moved since they last held (see
        # controller/tensor.py): a replay's cost does not grow with the number of parameters. (C loops; ``is`` and
        # tuples of ints and contexts, never a tensor's ``==``, which would be an op.)
        if now != self.epoch:
            if not (all(map(operator.eq, map(_IDS, self.cap_objs), self.cap_ids))
                    and all(map(operator.eq, map(_IDS, self.escapees), self.esc_ids))
                    and all(map(operator.is_, map(_GRAD, self.param_objs), self.grads))):
                return DEAD
            if list(map(_RG, self.cap_objs)) != self.cap_rg:
                return MISS
            for guard in self.optimizers:
                if not guard.same(full=True):
                    return MISS
            self.epoch = now
        else:
            for guard in self.optimizers:
                if not guard.same(full=False):
                    return MISS
        for t, v in self.locals:
            if t.shape != v.shape or t.dtype != v.dtype or not torch.equal(t, v):
                return MISS
        mems = self.cap_memories
        for t in inputs:
            if memory_of(t) in mems:
                return MISS
        return OK

    def run(self, inputs: list, loc):
        client = self.client
        refs = client.refs
        new = []
        out_refs = []
        for meta, mid, ctx, _ in self.out_new:
            r = next(refs)
            out_refs.append(r)
            new.append(new_tensor(meta, mid, ctx, r))
        client.issue_now(m.RunProgram(self.pid, tuple(t._ref for t in inputs), tuple(out_refs), self.sid, loc),
                         self.ranks)
        for t, info in zip(new, self.out_dist):  # a global (DTensor) result stays one, laid out as recorded
            if info is not None:
                t._dist = DistInfo(info.mesh, info.names, info.sizes, info.grid, info.placements)
                ACTIVE.n += 1
        for j, (_, _, _, link) in enumerate(self.out_new):
            if link is not None:
                kind, x = link
                new[j]._memory = memory_of(inputs[x]) if kind == "in" else x if kind == "mem" else new[x]._ref
        for o in self.forget:
            forget_value(o)
        leaves = [inputs[d[1]] if d[0] == "in" else new[d[1]] if d[0] == "new" else d[1] if d[0] == "obj"
                  else d[1].v for d in self.out_desc]
        stats["replays"] += 1
        return _unflatten(self.spec, leaves)

    def __del__(self) -> None:
        try:
            self.client.delete(self.pid, self.sid)
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass


def _held_by_us_alone(objs: list, ours: list) -> list:
    """Those of ``objs`` (gradients of parameters) that no object but ``ours`` (the caller's containers) refers
    to from Python: the script can reach one of them only through ``.grad``. The others (a gradient the function
    also stored in a list or dict) it may copy from there without reading ``.grad``. Each of ``objs`` is held by
    each of ``ours`` alike, so those with the lowest reference count are held by one set of objects: the
    referrers of one of them (one pass of the collector over the heap, when a program is made) tell which;
    when they are not ``ours`` alone, none is."""
    if not objs:
        return []
    counts = list(map(sys.getrefcount, objs))
    low = min(counts)
    skip = {id(c) for c in ours} | {id(objs), id(sys._getframe())}
    if any(id(r) not in skip for r in gc.get_referrers(objs[counts.index(low)])):
        return []
    return [o for o, c in zip(objs, counts) if c == low]


# ---- compiled functions ---------------------------------------------------------------------------------
class _Entry:
    """The programs and the last trace of one key (argument metadata and values) of a compiled function."""

    __slots__ = ("programs", "last", "attempts", "eager")

    def __init__(self) -> None:
        self.programs: list = []
        self.last: _Trace | None = None
        self.attempts = 0
        self.eager = False


class Compiled:
    """A function wrapped by ``compile``: calls replay its programs where they hold, and record otherwise."""

    def __init__(self, fn, verify: bool) -> None:
        functools.update_wrapper(self, fn)
        self.fn, self.verify = fn, verify
        self.entries: collections.OrderedDict = collections.OrderedDict()
        self.offset_keys: dict = {}  # keys with their tensors' storage offsets left out: how many keys each
        self.offsets_warned = False

    def __get__(self, obj, objtype=None):  # a method: bound like a function
        return self if obj is None else functools.partial(self, obj)

    def _key(self, args, kwargs) -> tuple:
        leaves: list = []
        spec: list = []
        _flatten((args, kwargs), leaves, spec)
        inputs, key, mems = [], [], []
        for x in leaves:
            t = type(x)
            if t is Tensor:
                if x.requires_grad:
                    raise MeshTensorError(f"compile: argument {len(inputs)} requires grad; a compiled call cannot be "
                                          f"differentiated through. Pass it detached (t.detach()), or use it from "
                                          f"outside the function (a parameter)")
                mem = memory_of(x)
                info = getattr(x, "_dist", None)
                if info is not None:  # a global tensor: its layout is part of what the trace did with it
                    key.append((id(info.mesh), info.names, info.sizes, placements_of(x)))
                if mem in mems:  # shares memory with an earlier argument: which, and where (see MeshClient._fuse)
                    key.append((x._mid, id(x._ctx), mems.index(mem), _t.memory_span(x)[1:]))
                else:
                    key.append((x._mid, id(x._ctx)))
                mems.append(mem)
                inputs.append(x)
            elif isinstance(x, torch.Tensor):
                raise MeshTensorError("compile: a local (controller) tensor argument is not supported; make it a "
                                      "mesh tensor, or pass its values as Python numbers")
            else:
                key.append((t, x))
        spec = tuple(spec)
        key.append(spec)
        key.append(torch.is_grad_enabled())  # (under torch.no_grad() the function records no backward)
        key.append(_autocast())
        return tuple(key), inputs, spec, leaves

    def __call__(self, *args, **kwargs):
        if _active:  # inside another compiled function's recording: part of it
            return self.fn(*args, **kwargs)
        key, inputs, spec, leaves = self._key(args, kwargs)
        try:
            entry = self.entries.get(key)
        except TypeError:
            raise MeshTensorError("compile: an argument that is not a tensor is not hashable; compiled functions key "
                                  "their recordings by the values of such arguments") from None
        if entry is None:
            entry = self.entries[key] = _Entry()
            if len(self.entries) > CACHE_SIZE:
                self.entries.popitem(last=False)
            self._look_for_moving_views(key, inputs)
        else:
            self.entries.move_to_end(key)
        if entry.eager:
            return self.fn(*args, **kwargs)
        loc = user_loc()
        progs = entry.programs
        for prog in list(progs):
            verdict = prog.holds(inputs)
            if verdict == DEAD:
                progs.remove(prog)
            elif verdict == OK and prog.verified:
                progs.remove(prog)
                progs.insert(0, prog)
                return prog.run(inputs, loc)
            elif verdict == OK:  # verify=True: record once more and compare
                tr, result = self._record(args, kwargs, inputs, leaves, spec, loc)
                if tr.refusal is not None or not tr.same_as(prog.trace):
                    progs.remove(prog)
                    why = tr.refusal[0] if tr.refusal is not None else tr.first_difference(prog.trace)
                    raise MeshTensorError(f"compile({self.__name__}) failed to verify its recording: the second call "
                                          f"recorded differently: {why}. A value the function reads from outside its "
                                          f"arguments (a global, an attribute) changed between calls; pass it as an "
                                          f"argument")
                prog.verified = True
                return result
        tr, result = self._record(args, kwargs, inputs, leaves, spec, loc)
        self._learn(entry, tr)
        return result

    def _look_for_moving_views(self, key: tuple, inputs: list) -> None:
        """On a new key: warn once when keys keep differing only by where tensor arguments start in their memory
        (``step(xs[i])`` over the rows of one tensor), which records every call anew: the offset is part of a
        recording (its views' metadata)."""
        if self.offsets_warned or not inputs:
            return
        metas = {t._mid: t._meta for t in inputs}

        def without_offset(k):
            if type(k) is tuple and len(k) in (2, 4) and type(k[0]) is int and k[0] in metas:
                meta = metas[k[0]]
                return (meta[:2] + meta[3:], *k[1:])
            return k

        loose = tuple(without_offset(k) for k in key)
        n = self.offset_keys[loose] = self.offset_keys.get(loose, 0) + 1
        if n == OFFSET_KEYS_WARN:
            self.offsets_warned = True
            warnings.warn(f"compile({self.__name__}) records anew on every call: its tensor arguments start at a "
                          f"different place in their memory each time (views such as xs[i] of one tensor), and "
                          f"where they start is part of a recording. Pass whole tensors (index inside the "
                          f"function), or contiguous copies (xs[i].clone())", stacklevel=3)

    def _learn(self, entry: _Entry, tr: _Trace) -> None:
        """Make a program of ``tr`` if it is replayable (see the module docstring), else remember it."""
        if tr.refusal is not None:
            entry.eager = True
            why, where = tr.refusal
            warnings.warn(f"compile({self.__name__}) runs uncompiled: {why} (at {_loc_str(where)})", stacklevel=3)
            return
        prev, entry.last = entry.last, tr
        if tr.standalone:
            prog = _Program(tr, verified=not self.verify)
        elif tr.same_as(prev) and tr.deleted_pre == set(prev.esc_refs):
            prog = _Program(tr, verified=True)
        else:
            entry.attempts += 1
            if entry.attempts >= MAX_RECORDINGS:
                entry.eager = True
                what = tr.first_difference(prev) if prev is not None else "it leaves new tensors behind"
                warnings.warn(f"compile({self.__name__}) runs uncompiled: {MAX_RECORDINGS} calls in a row recorded "
                              f"differently from the call before ({what})", stacklevel=3)
            return
        if not prog.complete():
            return
        entry.attempts = 0
        entry.programs.insert(0, prog)
        del entry.programs[CACHE_SIZE:]

    def _record(self, args, kwargs, inputs: list, leaves: list, spec: tuple, loc):
        """Run the function, recording what it issues; its trace and its result."""
        stats["recordings"] += 1
        rec = _Recorder()
        rec.install()
        _active.append(rec)
        formals = []
        try:
            for x in inputs:  # stand-ins, so that the trace tells the arguments from the same tensors captured
                f = record(torch.ops.aten.alias.default, (x,), {}, None)
                f._memory = memory_of(x)
                formals.append(f)
            f = None
            for c in rec.clients:  # (the stand-ins are not part of the trace)
                c.flush()
            del rec.batches[:]
            ids = {id(x): f for x, f in zip(inputs, formals)}
            fa, fk = _unflatten(spec, [ids.get(id(x), x) for x in leaves])
            del ids
            with coalescing():
                out = self.fn(*fa, **fk)
            del fa, fk
            out_leaves: list = []
            out_spec: list = []
            _flatten(out, out_leaves, out_spec)
            del out
            back = {id(f): x for f, x in zip(formals, inputs)}
            for i, x in enumerate(out_leaves):
                if type(x) is Tensor:
                    if id(x) in back:  # an argument returned: the caller's tensor
                        out_leaves[i] = back[id(x)]
                    elif x.requires_grad:  # (a replay's results are not differentiable either)
                        with torch.no_grad():
                            out_leaves[i] = x.detach()
            x = None
            for c in rec.clients:
                c.flush()
        finally:
            _active.pop()
            rec.uninstall()
        bad = [k for k, (x, f) in enumerate(zip(inputs, formals)) if f._mid != x._mid]
        if bad:
            raise MeshTensorError(f"compile({self.__name__}): the function changed the shape or strides of its "
                                  f"argument {bad[0]} in place (t.t_(), unsqueeze_, resize_, t.data = ...), which "
                                  f"compiled functions do not support; work on a view or a copy")
        refs = [weakref.ref(f) for f in formals]
        formal_refs = [f._ref for f in formals]
        formals = [_Formal(r) for r in formal_refs]
        gc_needed = any(w() is not None for w in refs)
        tr = _analyse(rec, formals, inputs, out_leaves, tuple(out_spec), loc)
        if tr.refusal is None and gc_needed and any(w() is not None for w in refs):
            tr.refusal = ("the function stored an argument (or a view of one) somewhere", loc)
        return tr, _unflatten(tuple(out_spec), out_leaves)


class _Formal:
    """A stand-in's ref, once the stand-in itself is gone."""

    __slots__ = ("_ref",)

    def __init__(self, ref: int) -> None:
        self._ref = ref


def compile(fn=None, *, verify: bool = True):
    """Record ``fn``'s instructions on its first calls and replay them as one message per mesh afterwards
    (Monarch's ``compile``; the rules are in ``controller/compile.py``'s docstring and the README).

    >>> @compile
    ... def step(x, y):
    ...     opt.zero_grad()
    ...     loss = F.cross_entropy(model(x), y)
    ...     loss.backward()
    ...     opt.step()
    ...     return loss
    >>> losses = [step(x, y) for x, y in batches]  # mesh tensors; fetch them when needed

    ``@compile``, ``@compile(verify=False)`` and ``compile(fn)`` all work. ``verify=True`` records once more the
    first time a recording would be reused and raises, naming the line, where the two differ.
    """
    if fn is None:
        return lambda f: Compiled(f, verify)
    return Compiled(fn, verify)
