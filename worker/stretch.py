"""Stretches of a prepared program run through ``torch.compile`` (``MONARCH_TENSOR_COMPILE_STRETCHES``, off by default).

A straight-line run of aten ops (``program.py``) is, on its first replay, analysed on meta tensors shaped like
its inputs and cut into *units* at the ops ``torch.compile`` must not see: random ops, ops whose output shape
depends on values, ops returning anything but tensors. Each unit of at least ``MONARCH_TENSOR_STRETCH_MIN_OPS``
ops becomes a pure function of the tensors it reads from before it, returning those it leaves behind
(``def stretch(i0, i1): v0 = mm(i0, i1); ...; return (v0, v3)``), compiled with inductor (on CUDA tensors with
``mode="reduce-overhead"``, CUDA graphs). Until every unit of the run is compiled the run stays straight-line;
compiling happens on one background thread per proc (``=1``) or at that first replay (``=wait``).

Rules kept:
* A unit whose compile fails (any exception: dynamo, inductor, no C++ compiler) is logged once and runs
  straight-line from then on.
* An exception from compiled code re-runs the unit's straight-line source, so an op's error becomes the same
  value, naming the user's line, as without this setting. For that re-run to see the tensors as they were,
  a unit that writes memory it did not allocate and holds an op that may raise on values (anything but
  pointwise and matmul-like ops on floating tensors) copies that memory before each call and restores it on
  an exception. A unit that writes such memory but holds only ops that cannot raise on values does not; if
  it raises anyway (out of memory), what it wrote holds an error saying so rather than a value written twice.
* Results agree with the straight-line replay to rounding, not bit for bit: inductor fuses and reorders
  float arithmetic.
"""

from __future__ import annotations

import concurrent.futures
import itertools
import logging
import math
import threading
import weakref

import torch

from monarch_tensor.config import setting

from .errors import RemoteException

log = logging.getLogger("monarch_tensor.worker")

FILE = "<monarch_tensor stretch>"
_MISSING = object()
_EXCLUDED_TAGS = tuple(getattr(torch.Tag, t) for t in ("nondeterministic_seeded", "dynamic_output_shape",
                                                        "data_dependent_output") if hasattr(torch.Tag, t))
# Ops that cannot raise on their values when their tensors are floating point (shapes are fixed per recording).
_CANNOT_RAISE = frozenset("""mm addmm bmm baddbmm matmul sum mean amax amin view _unsafe_view reshape t transpose
permute expand unsqueeze squeeze slice select as_strided alias detach clone copy_ zero_ fill_ _to_copy
empty_like zeros_like ones_like full_like cat stack _softmax _log_softmax _softmax_backward_data
_log_softmax_backward_data native_layer_norm native_layer_norm_backward split split_with_sizes unbind
""".split())
stats = {"compiled_runs": 0, "fallbacks": 0, "compiles": 0, "compile_failures": 0}
_executor: concurrent.futures.ThreadPoolExecutor | None = None
_executor_lock = threading.Lock()


def mode() -> str:
    """``""`` (off), ``"background"`` or ``"wait"``, from ``MONARCH_TENSOR_COMPILE_STRETCHES``."""
    v = setting("MONARCH_TENSOR_COMPILE_STRETCHES")
    return {"": "", "0": "", "1": "background", "wait": "wait"}[v]


def counts() -> torch.Tensor:
    """This proc's stretch counters as an int64 tensor: compiled runs, fallbacks to straight-line after an
    exception in compiled code, compiles finished, compiles failed (for ``remote`` in tests and benchmarks)."""
    return torch.tensor([stats[k] for k in ("compiled_runs", "fallbacks", "compiles", "compile_failures")])


def eligible(op) -> bool:
    """Whether ``op`` (an OpOverload) may sit inside a compiled unit: not random, its output shapes known
    from its input shapes, and returning tensors (or one list of them, unpacked into its outputs)."""
    if any(t in op.tags for t in _EXCLUDED_TAGS):
        return False
    returns = [str(r.type) for r in op._schema.returns]
    return all(t == "Tensor" for t in returns) or returns == ["List[Tensor]"]


class Stretches:
    """The step of one straight-line run with the setting on: the run's straight-line source until its units
    are compiled, then each unit (compiled, or straight-line where it could not be)."""

    def __init__(self, worker, instrs, steps, ops, straight, make_straight, how: str) -> None:
        """``ops``: each instruction's OpOverload; ``straight``: the whole run's straight-line step;
        ``make_straight(lo, hi)``: the straight-line step of instructions ``lo:hi``."""
        self.worker, self.instrs, self.steps, self.ops = worker, instrs, steps, ops
        self.straight, self.make_straight, self.how = straight, make_straight, how
        self.units = None  # the units, once all are compiled or given up
        self.state = "new"  # new -> compiling -> ready | off
        self.inputs = _outside(instrs, steps)

    def __call__(self) -> None:
        units = self.units
        if units is not None:
            for u in units:
                u()
            return
        if self.state == "new":
            try:
                self._start()
            except Exception:  # a bug or no memory for the copies: the run stays straight-line
                log.exception("tensor worker: preparing a stretch's compile failed; it runs straight-line")
                self.state = "off"
        self.straight()

    def _start(self) -> None:
        refs = self.worker.refs
        values = {}
        for r in self.inputs:
            v = refs.get(r, _MISSING)
            if v is _MISSING or type(v) is RemoteException:
                return  # try at the next replay, with every input present
            if type(v) is not torch.Tensor:
                self.state = "off"  # (DTensors, Python values): straight-line for good
                return
            values[r] = v
        try:
            plans = _plan(self, values)
        except Exception as e:  # noqa: BLE001 - an op without a meta kernel, say: straight-line, as before
            log.debug("stretch: cannot analyse a run of %d ops (%r); it stays straight-line", len(self.instrs), e)
            self.state = "off"
            return
        if not any(p.compilable for p in plans):
            self.state = "off"
            return
        self.state = "compiling"
        units = [_Unit(self, p) for p in plans]
        job = _job(weakref.ref(self), units, values, torch.is_grad_enabled())
        if self.how == "wait":
            job()
        else:
            _submit(job)


class _Plan:
    __slots__ = ("lo", "hi", "compilable", "inputs", "outputs", "drops", "source", "consts", "backup", "guarded")


class _Unit:
    """One unit: its compiled function once ready, else its straight-line step."""

    def __init__(self, owner: Stretches, plan: _Plan) -> None:
        self.worker, self.plan = owner.worker, plan
        self.straight = owner.make_straight(plan.lo, plan.hi)
        self.fn = None
        self.first_loc = owner.instrs[plan.lo].loc
        self.instrs = owner.instrs[plan.lo:plan.hi]

    def __call__(self) -> None:
        fn = self.fn
        if fn is None:
            return self.straight()
        refs, plan = self.worker.refs, self.plan
        vals = []
        for r in plan.inputs:
            v = refs.get(r, _MISSING)
            if type(v) is not torch.Tensor:
                return self.straight()  # missing, failed or not a tensor: the steps say what is wrong
            vals.append(v)
        saved = [(t, _bytes(t).clone()) for t in (vals[i] for i in plan.backup)] if plan.backup else ()
        try:
            out = fn(*vals)
        except Exception as e:  # noqa: BLE001 - an op's error in compiled code: the straight-line source says which
            stats["fallbacks"] += 1
            for t, copy in saved:
                _bytes(t).copy_(copy)
            if plan.guarded:
                return self._fail_written(e)
            return self.straight()
        stats["compiled_runs"] += 1
        pop = refs.pop
        for r in plan.drops:
            pop(r, None)
        if vals and vals[0].device.type == "cuda":
            out = _own_outputs(out, vals)
        for r, v in zip(plan.outputs, out):
            refs[r] = v

    def _fail_written(self, e: BaseException) -> None:
        """The unit raised after it may have written tensors it did not allocate: everything it writes or
        produces holds the error (running its ops again could apply a write twice)."""
        failure = self.worker._failure("compiled stretch", self.first_loc, RuntimeError(
            f"a compiled stretch of {len(self.instrs)} ops raised after it may have written its inputs, which "
            f"therefore hold this error: {e!r}. Unset MONARCH_TENSOR_COMPILE_STRETCHES to run these ops one by one"))
        outs = tuple(r for i in self.instrs for r in i.outs) + tuple(r for i in self.instrs for r in i.mutates)
        self.worker._fail(outs + self.worker._sharing_memory(tuple(r for i in self.instrs for r in i.mutates)),
                          failure)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """The whole of ``t``'s storage as a flat uint8 tensor."""
    return torch.empty(0, dtype=torch.uint8, device=t.device).set_(t.untyped_storage())


def _own_outputs(out, vals):
    """CUDA graphs' outputs live in their pool and are overwritten by the next replay: clone those that are not
    views of inputs (kept refs outlive the replay)."""
    mine = {v.untyped_storage().data_ptr() for v in vals}
    return tuple(o if not isinstance(o, torch.Tensor) or o.untyped_storage().data_ptr() in mine else o.clone()
                 for o in out)


def _outside(instrs, steps) -> tuple:
    """The refs the run reads before it writes them, in order of first read."""
    seen, written, out = set(), set(), []
    for instr, (_, frees) in zip(instrs, steps):
        for r in _reads(instr):
            if r not in written and r not in seen:
                seen.add(r)
                out.append(r)
        written.update(r for r in instr.outs if r is not None)
        written.update(frees)
    return tuple(out)


def _reads(instr):
    for p in instr.tpos:
        yield instr.args[p] if type(p) is int else instr.kwargs[p] if type(p) is str else instr.args[p[0]][p[1]]


# ---- analysis on meta tensors --------------------------------------------------------------------

def _meta_inputs(values: dict) -> dict:
    """Meta tensors with ``values``' metadata and aliasing (one meta storage per real storage)."""
    bases, out = {}, {}
    for r, v in values.items():
        key = v.untyped_storage()._cdata
        base = bases.get(key)
        if base is None:
            base = bases[key] = torch.empty(v.untyped_storage().nbytes(), dtype=torch.uint8, device="meta")
        out[r] = torch.empty(0, dtype=v.dtype, device="meta").set_(base.untyped_storage(), v.storage_offset(),
                                                                   v.size(), v.stride())
    return out


def _plan(owner: Stretches, values: dict) -> list:
    """The run cut into units, each with what it reads, leaves behind, drops and (where compilable) its
    source; the cut falls at every op that may not be compiled."""
    minimum = setting("MONARCH_TENSOR_STRETCH_MIN_OPS")
    env = _meta_inputs(values)
    keep = list(env.values())  # every meta tensor stays alive: a storage's key is its address
    born = {_storage(v): -1 for v in env.values()}  # a storage's key -> the op that made it
    facts = []  # per op: (may be compiled, may raise on values, storages written, {ref read: its storage})
    for k, (instr, op) in enumerate(zip(owner.instrs, owner.ops)):
        args, kwargs = _with_values(instr, env)
        flat = [a for a in list(args) + list(kwargs.values()) for a in (a if isinstance(a, list) else [a])]
        ints = any(isinstance(a, torch.Tensor) and not (a.is_floating_point() or a.dtype == torch.bool)
                   for a in flat)
        written = frozenset(_storage(a) for a in _written_args(op, args, kwargs))
        read = {r: _storage(env[r]) for r in _reads(instr)}
        result = op(*args, **kwargs)
        if isinstance(result, torch.Tensor) and len(instr.outs) == 1:
            leaves = [result]
        else:
            leaves = list(result) if isinstance(result, (tuple, list)) else [result]
        ok = eligible(op) and (len(leaves) == len(instr.outs) or not instr.outs)
        for r, v in zip(instr.outs, leaves):
            if r is not None and isinstance(v, torch.Tensor):
                env[r] = v
                keep.append(v)
                born.setdefault(_storage(v), k)
        for r in owner.steps[k][1]:
            env.pop(r, None)
        may_raise = ints or (op._opname not in _CANNOT_RAISE and torch.Tag.pointwise not in op.tags)
        facts.append((ok, may_raise, written, read))
    plans, k, n = [], 0, len(owner.instrs)
    while k < n:
        ok, hi = facts[k][0], k
        while hi < n and facts[hi][0] == ok:
            hi += 1
        plans.append(_unit_plan(owner, k, hi, ok and hi - k >= minimum, facts, born))
        k = hi
    return plans


class _NotPure(Exception):
    pass


def _ref(instr, p):
    return instr.args[p] if type(p) is int else instr.kwargs[p] if type(p) is str else instr.args[p[0]][p[1]]


def _storage(t) -> int:
    return t.untyped_storage()._cdata


def _with_values(instr, env):
    args = [list(a) if isinstance(a, (list, tuple)) else a for a in instr.args]
    kwargs = dict(instr.kwargs)
    for p in instr.tpos:
        if type(p) is int:
            args[p] = env[args[p]]
        elif type(p) is str:
            kwargs[p] = env[kwargs[p]]
        else:
            args[p[0]][p[1]] = env[args[p[0]][p[1]]]
    return args, kwargs


def _written_args(op, args, kwargs):
    """The tensors ``op`` writes in place (its schema's ``(a!)`` arguments)."""
    for i, a in enumerate(op._schema.arguments):
        if a.alias_info is None or not a.alias_info.is_write:
            continue
        v = args[i] if i < len(args) and not a.kwarg_only else kwargs.get(a.name)
        for t in v if isinstance(v, (list, tuple)) else [v]:
            if isinstance(t, torch.Tensor):
                yield t


def _unit_plan(owner: Stretches, lo: int, hi: int, compilable: bool, facts, born) -> _Plan:
    p = _Plan()
    p.lo, p.hi, p.compilable = lo, hi, compilable
    p.inputs = p.outputs = p.drops = p.backup = ()
    p.source, p.consts, p.guarded = "", {}, False
    if not compilable:
        return p
    instrs, steps = owner.instrs[lo:hi], owner.steps[lo:hi]
    names: dict = {}  # ref -> its variable in the source
    fresh = itertools.count()
    inputs: list = []
    dropped: set = set()
    consts: dict = {}
    body = []

    def read(r) -> str:
        if r not in names:
            if r in dropped:
                raise _NotPure(f"ref {r} is read after this run freed it")
            names[r] = f"i{len(inputs)}"
            inputs.append(r)
        return names[r]

    def const(v) -> str:
        if v is None or type(v) in (bool, int) or type(v) is float and math.isfinite(v):
            return repr(v)
        if type(v) in (list, tuple) and all(type(x) in (bool, int) for x in v):
            return repr(list(v)) if type(v) is list else repr(tuple(v))
        if isinstance(v, torch.Tensor):
            raise _NotPure("a tensor constant")
        name = f"c{len(consts)}"
        consts[name] = v
        return name

    try:
        for k, instr in enumerate(instrs):
            fname = f"f{k}"
            consts[fname] = owner.ops[lo + k]
            tpos = {pp: r for pp, r in ((pp, _ref(instr, pp)) for pp in instr.tpos)}
            args = []
            for i, a in enumerate(instr.args):
                if i in tpos:
                    args.append(read(tpos[i]))
                elif isinstance(a, (list, tuple)) and any((i, j) in tpos for j in range(len(a))):
                    args.append("[" + ", ".join(read(tpos[(i, j)]) if (i, j) in tpos else const(x)
                                                for j, x in enumerate(a)) + "]")
                else:
                    args.append(const(a))
            args += [f"{key}={read(tpos[key]) if key in tpos else const(a)}" for key, a in instr.kwargs.items()]
            call = f"{fname}({', '.join(args)})"
            targets = []
            for r in instr.outs:
                if r is None:
                    targets.append("_")
                    continue
                names[r] = f"v{next(fresh)}"
                dropped.discard(r)
                targets.append(names[r])
            returns = owner.ops[lo + k]._schema.returns
            if not targets or not returns:
                body.append(call)
            elif len(returns) == 1 and len(targets) == 1 and str(returns[0].type) == "Tensor":
                body.append(f"{targets[0]} = {call}")
            else:
                body.append(f"{', '.join(targets) + (',' if len(targets) == 1 else '')} = {call}")
            for r in steps[k][1]:
                names.pop(r, None)
                dropped.add(r)
    except _NotPure as e:
        log.debug("stretch: ops %d-%d stay straight-line: %s", lo, hi, e)
        p.compilable = False
        return p
    written = {r for i in instrs for r in i.outs if r is not None}
    p.outputs = tuple(r for r in names if r in written)
    p.inputs, p.drops = tuple(inputs), tuple(dropped)
    ret = ", ".join(names[r] for r in p.outputs) + ("," if len(p.outputs) == 1 else "")
    p.source = f"def stretch({', '.join(f'i{n}' for n in range(len(inputs)))}):\n" \
        + "".join(f"    {line}\n" for line in body) + f"    return ({ret})\n"
    p.consts = consts
    unit = facts[lo:hi]
    writes_old = {s for f in unit for s in f[2] if born.get(s, -1) < lo}
    if writes_old:
        if any(f[1] for f in unit):
            key_of = {}  # an input's storage, at its first read
            for f in unit:
                for r, key in f[3].items():
                    key_of.setdefault(r, key)
            first = {}
            for i, r in enumerate(inputs):
                if key_of.get(r) in writes_old:
                    first.setdefault(key_of[r], i)
            p.backup = tuple(sorted(first.values()))
        else:
            p.guarded = True
    return p


# ---- compiling -------------------------------------------------------------------------------------

def _submit(job) -> None:
    global _executor
    with _executor_lock:
        if _executor is None:
            _executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="monarch-stretch-compile")
    _executor.submit(job)


def _copies(values: dict) -> dict:
    """Copies of ``values`` with their aliasing (one new storage per storage), taken now, for compiling."""
    storages, out = {}, {}
    for r, v in values.items():
        key = v.untyped_storage()._cdata
        if key not in storages:
            storages[key] = _bytes(v).clone()
        out[r] = torch.empty(0, dtype=v.dtype, device=v.device).set_(
            storages[key].untyped_storage(), v.storage_offset(), v.size(), v.stride())
    return out


def _compiler(device_type: str):
    if device_type == "cuda":
        return lambda fn: torch.compile(fn, backend="inductor", mode="reduce-overhead", fullgraph=True,
                                        dynamic=False)
    return lambda fn: torch.compile(fn, backend="inductor", fullgraph=True, dynamic=False)


def _job(owner_ref, units: list, values: dict, grad: bool):
    """The compile of a run's units, on copies of its inputs: units in order, the uncompiled ones run op by
    op, each compiled one compiled by its first call; then the run switches to its units."""
    env = _copies(values)
    device = next(iter(values.values())).device.type if values else "cpu"
    compile_fn = _compiler(device)

    def job() -> None:
        owner = owner_ref()
        if owner is None:
            return  # the program was freed
        if device == "cuda":
            torch.cuda.synchronize()  # the copies were made on the worker's stream
        try:
            with torch.set_grad_enabled(grad):
                done = _compile_units(owner, units, env, compile_fn)
        except Exception:  # a bug here: the run stays straight-line
            log.exception("tensor worker: compiling a run's stretches failed; it runs straight-line")
            done = False
        if any(u.fn is not None for u in units) and done:
            owner.units, owner.state = tuple(units), "ready"
        else:
            owner.state = "off"

    return job


def _compile_units(owner: Stretches, units: list, env: dict, compile_fn) -> bool:
    """Each compilable unit compiled (False: the run's ops failed on the copies, so none is used)."""
    for u in units:
        p = u.plan
        if p.compilable:
            ns = dict(p.consts)
            try:
                exec(compile(p.source, FILE, "exec"), ns)  # the source is ours, from the program
                fn = compile_fn(ns["stretch"])
                out = fn(*(env[r] for r in p.inputs))
            except Exception as e:  # noqa: BLE001 - dynamo, inductor, no C++ compiler...: straight-line for good
                stats["compile_failures"] += 1
                text = str(e).strip()
                log.warning("tensor worker: compiling a stretch of %d ops (from %s) failed; it runs straight-line: "
                            "%s", p.hi - p.lo, u.first_loc, text.splitlines()[0] if text else repr(e))
            else:
                stats["compiles"] += 1
                for r in p.drops:
                    env.pop(r, None)
                env.update(zip(p.outputs, out))
                u.fn = fn
                continue
        try:
            _run_eagerly(owner, p.lo, p.hi, env)
        except Exception as e:  # noqa: BLE001 - the run fails on these values: it stays straight-line
            log.debug("stretch: a run's ops failed on copies of its inputs (%r); it stays straight-line", e)
            return False
    return True


def _run_eagerly(owner: Stretches, lo: int, hi: int, env: dict) -> None:
    for k in range(lo, hi):
        instr = owner.instrs[k]
        args, kwargs = _with_values(instr, env)
        result = owner.ops[k](*args, **kwargs)
        leaves = [result] if isinstance(result, torch.Tensor) and len(instr.outs) == 1 else \
            list(result) if isinstance(result, (tuple, list)) else [result]
        env.update((r, v) for r, v in zip(instr.outs, leaves) if r is not None)
        for r in owner.steps[k][1]:
            env.pop(r, None)
