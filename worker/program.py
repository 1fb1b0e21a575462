"""Prepared programs: a compiled function's recording, kept on the worker and run whole by one instruction.

``DefineProgram`` arrives once; each of its instructions becomes a step with
its function and argument slots resolved (an aten op's overload looked up once,
its tensor arguments' places and refs listed once). ``RunProgram`` then binds
the call's input refs to the program's input slots, runs the steps in order on
the program's stream, drops each temporary after its last use, and moves the
results to the call's output refs. Errors stay values, as for single
instructions: a step that fails stores a ``RemoteException`` naming the user's
line of the recorded op, and steps that read it pass it on.

A run of consecutive aten ops (most of a training step: a 32-layer GPT's step is
~5,000 of them, most tiny) is also turned into straight-line Python source, one
line per op (``refs[17] = mm(refs[12], refs[15])``), compiled once: a replay
then pays for the op's own call and two dict operations per tensor, not for a
closure, an argument list rebuilt and a store per op. That source is only a
faster spelling of the steps: it runs when every tensor it reads from before
it is present and not a failure; otherwise, and from the op on where one
raises, the steps run one by one as above, so errors are the same values.
"""

from __future__ import annotations

import functools
import keyword

import torch

from . import messages as m
from . import stretch
from .collectives import restore_names
from .errors import RemoteException
from .shm_reduce import STEP_BITS, current

_MISSING = object()
_STEP_MASK = (1 << STEP_BITS) - 1


class Program:
    """The prepared form of a ``DefineProgram``; lives in the worker's ref table at its ref, so the controller's
    delete of that ref frees it."""

    __slots__ = ("steps", "inputs", "outputs")

    def __init__(self, worker, msg: m.DefineProgram, resolve_op, propagate: type) -> None:
        """``resolve_op``: an op's name to its overload; ``propagate``: the exception ``worker._get`` raises for
        a ref that holds a failure."""
        self.inputs, self.outputs = msg.inputs, msg.outputs
        steps = [(_prepare(worker, instr, resolve_op, propagate), frees)
                 for instr, frees in zip(msg.instrs, msg.frees)]
        ops = [_straight_op(instr, resolve_op) for instr in msg.instrs]
        self.steps = tuple(_with_straight_runs(worker, msg.instrs, steps, ops, propagate, resolve_op))

    def run(self, worker, msg: m.RunProgram) -> None:
        refs = worker.refs
        restore_names()
        for slot, ref in zip(self.inputs, msg.inputs):
            v = refs.get(ref, _MISSING)
            if v is _MISSING:
                v = RemoteException("compiled call", msg.loc, worker.rank,
                                    f"its input tensor ref {ref} does not exist on rank {worker.rank}", "")
            refs[slot] = v
        pop = refs.pop
        cur = current
        base = cur.tag  # each step's collectives say which step they belong to (shm_reduce's tags)
        for k, (step, frees) in enumerate(self.steps, 1):
            if base:
                cur.tag = base | (k & _STEP_MASK)
            step()
            for r in frees:
                pop(r, None)
        cur.tag = base
        for slot, ref in zip(self.inputs, msg.inputs):
            v = pop(slot, _MISSING)
            if v is not _MISSING and v is not refs.get(ref):  # a failure written into an input
                refs[ref] = v
        for slot, ref in zip(self.outputs, msg.outputs):
            v = pop(slot, _MISSING)
            refs[ref] = v if v is not _MISSING else RemoteException(
                "compiled call", msg.loc, worker.rank, "the program did not produce this result", "")


def _prepare(worker, instr, resolve_op, propagate):
    """One instruction as a function of no arguments that runs it on ``worker``."""
    if type(instr) is m.CallOp:
        fast = _call_op(worker, instr, resolve_op, propagate)
        if fast is not None:
            return fast
    if type(instr) is m.CallOp:
        return functools.partial(_call_op_copy, worker, instr)
    if type(instr) is m.CreateValue:
        return functools.partial(_create_value, worker, instr)
    return functools.partial(worker._handlers[type(instr)], instr)


def _create_value(worker, msg: m.CreateValue) -> None:
    """A constant of the program, as a new tensor each run (a step may write it in place)."""
    v = msg.value
    worker.refs[msg.ref] = v.to(worker.device, copy=True) if isinstance(v, torch.Tensor) else v


def _call_op_copy(worker, msg: m.CallOp) -> None:
    """``handle_CallOp`` on a copy of ``msg`` whose list arguments are new lists (it fills them in place)."""
    worker.handle_CallOp(m.CallOp(msg.op, tuple(list(a) if type(a) is list else a for a in msg.args), msg.kwargs,
                                  msg.tpos, msg.outs, msg.mutates, msg.stream, msg.loc))


def _call_op(worker, msg: m.CallOp, resolve_op, propagate):
    """A ``CallOp`` whose tensors sit at argument positions, in list arguments or at keyword names (the common
    case), as a closure; None for any other (handled by ``TensorWorker.handle_CallOp``, on a copy of its list
    arguments: the handler fills those in place)."""
    if any(p == m.DEEP for p in msg.tpos) or "device" in msg.kwargs or msg.kwargs.get("pin_memory"):
        return None
    fn = resolve_op(msg.op)
    args0 = list(msg.args)
    kw0 = dict(msg.kwargs)
    apos = tuple((p, msg.args[p]) for p in msg.tpos if type(p) is int)
    kpos = tuple((p, msg.kwargs[p]) for p in msg.tpos if type(p) is str)
    lpos = tuple((p[0], p[1], msg.args[p[0]][p[1]]) for p in msg.tpos if type(p) is tuple)
    lists = tuple(sorted({i for i, _, _ in lpos}))
    outs, store = msg.outs, worker._store
    get = _getter(worker, propagate)

    def step() -> None:
        args = args0.copy()
        try:
            for p, r in apos:
                args[p] = get(r)
            for i in lists:
                args[i] = list(args0[i])
            for i, j, r in lpos:
                args[i][j] = get(r)
            if kpos:
                kw = kw0.copy()
                for p, r in kpos:
                    kw[p] = get(r)
                result = fn(*args, **kw)
            else:
                result = fn(*args, **kw0)
        except propagate as e:
            worker._fail_op(msg, e.failure, own=False)
            return
        except Exception as e:  # noqa: BLE001 - user code failed: the error becomes the value
            worker._fail_op(msg, worker._failure(msg.op, msg.loc, e))
            return
        store(outs, result)

    return step


# ---- straight-line runs of aten ops ------------------------------------------------------------

STRAIGHT_FILE = "<monarch_tensor program>"  # the generated source's file name (left out of error tracebacks)
STRAIGHT_MIN = 2  # shorter runs keep their closures


def _straight_op(instr, resolve_op):
    """The callable that runs ``instr`` in generated source, and whether it returns exactly one tensor; None
    for an instruction that is not a plain aten op (those run as their steps)."""
    if type(instr) is not m.CallOp or any(p == m.DEEP for p in instr.tpos) or "device" in instr.kwargs \
            or instr.kwargs.get("pin_memory") or any(keyword.iskeyword(k) for k in instr.kwargs) \
            or not all(_placed(instr, p) for p in instr.tpos):
        return None
    fn = resolve_op(instr.op)
    if type(fn) is not torch._ops.OpOverload:
        return None
    returns = fn._schema.returns
    one = len(returns) == 1 and str(returns[0].type) == "Tensor"
    return fn._op, one  # the overload's C++ callable: OpOverload.__call__ only forwards to it


def _with_straight_runs(worker, instrs, steps, ops, propagate, resolve_op):
    """``steps`` with each run of at least STRAIGHT_MIN consecutive aten ops replaced by one step (frees ())
    that runs the run's generated source, falling back to the run's own steps."""
    how = stretch.mode()
    i, n = 0, len(steps)
    while i < n:
        if ops[i] is None:
            yield steps[i]
            i += 1
            continue
        j = i
        while j < n and ops[j] is not None:
            j += 1
        if j - i < STRAIGHT_MIN:
            yield from steps[i:j]
        elif how:
            yield _stretches(worker, instrs[i:j], steps[i:j], ops[i:j], propagate, how, resolve_op), ()
        else:
            yield _straight_run(worker, instrs[i:j], steps[i:j], ops[i:j], propagate), ()
        i = j


def _stretches(worker, instrs, steps, ops, propagate, how: str, resolve_op):
    """A run's step with ``MONARCH_TENSOR_COMPILE_STRETCHES`` on (``stretch.py``): its straight-line source
    until its stretches are compiled; a part of it as straight-line source where needed."""
    def make_straight(lo: int, hi: int):
        if hi - lo >= STRAIGHT_MIN:
            return _straight_run(worker, instrs[lo:hi], steps[lo:hi], ops[lo:hi], propagate)
        return functools.partial(_slowly, worker.refs, steps[lo:hi], 0)

    overloads = tuple(resolve_op(instr.op) for instr in instrs)  # (dynamo traces OpOverloads, not their _op)
    return stretch.Stretches(worker, instrs, steps, overloads, _straight_run(worker, instrs, steps, ops, propagate),
                             make_straight, how)


def _straight_run(worker, instrs, steps, ops, propagate):
    """One step running ``instrs`` (aten ops whose prepared ``steps`` and ``ops`` are given) as generated source:
    each op's line reads its tensors from the ref table (``refs[r]``; through the checked ``get(r)`` where an
    earlier op of the run may not have stored ``r``), calls the op and stores its result; its frees follow."""
    refs = worker.refs
    ns: dict = {"refs": refs, "pop": refs.pop, "store": worker._store}
    consts: dict = {}

    def const(v) -> str:
        name = f"c{len(consts)}"
        consts[name] = v
        return name

    sure: set = set()  # refs an earlier op of the run stored for certain (a single tensor result)
    produced: set = set()  # refs an earlier op of the run stored, or freed: read through get()
    outside: list = []  # refs read from before the run: checked before the source runs
    lines = ["def run():"]
    line_of: dict = {}  # a source line -> the op's index in the run

    def read(r) -> str:
        if r in sure:
            return f"refs[{r!r}]"
        if r in produced:
            return f"get({r!r})"
        if r not in outside:
            outside.append(r)
        return f"refs[{r!r}]"

    for k, (instr, (fn, one)) in enumerate(zip(instrs, ops)):
        fname = f"f{k}"
        ns[fname] = fn
        tpos = {p: r for p, r in ((p, _ref_at(instr, p)) for p in instr.tpos)}
        args = []
        for i, a in enumerate(instr.args):
            if i in tpos:
                args.append(read(tpos[i]))
            elif any((i, j) in tpos for j in range(len(a) if isinstance(a, (list, tuple)) else 0)):  # (as a list)
                items = [read(tpos[(i, j)]) if (i, j) in tpos else const(x) for j, x in enumerate(a)]
                args.append("[" + ", ".join(items) + "]")
            else:
                args.append(const(a))
        for key, a in instr.kwargs.items():
            args.append(f"{key}={read(tpos[key]) if key in tpos else const(a)}")
        call = f"{fname}({', '.join(args)})"
        if one and len(instr.outs) == 1:
            out = instr.outs[0]
            code = call if out is None else f"refs[{out!r}] = {call}"
            if out is not None:
                sure.add(out)
        else:
            code = f"store({const(instr.outs)}, {call})"
            produced.update(r for r in instr.outs if r is not None)
            sure.difference_update(instr.outs)
        lines.append("    " + code)
        line_of[len(lines)] = k
        for r in steps[k][1]:
            lines.append(f"    pop({r!r}, None)")
            sure.discard(r)
            produced.add(r)
    ns.update(consts)
    ns["get"] = _getter(worker, propagate)
    exec(compile("\n".join(lines) + "\n", STRAIGHT_FILE, "exec"), ns)  # the source is ours, from the program
    run = ns["run"]
    outside_refs = tuple(outside)

    def step() -> None:
        for r in outside_refs:
            v = refs.get(r, _MISSING)
            if v is _MISSING or type(v) is RemoteException:
                return _slowly(refs, steps, 0)
        try:
            run()
        except Exception as e:  # the failing op's error becomes its value, as in its step
            tb = e.__traceback__
            while tb is not None and tb.tb_frame.f_code.co_filename != STRAIGHT_FILE:
                tb = tb.tb_next
            if tb is None:  # not from the source (a bug here): not an op's error
                raise
            k = line_of[tb.tb_lineno]
            msg = instrs[k]
            if isinstance(e, propagate):
                worker._fail_op(msg, e.failure, own=False)
            else:
                worker._fail_op(msg, worker._failure(msg.op, msg.loc, e))
            for r in steps[k][1]:
                refs.pop(r, None)
            _slowly(refs, steps, k + 1)

    return step


def _placed(instr, p) -> bool:
    """Whether the generated source puts a tensor at ``tpos`` place ``p``: an argument, a keyword argument, or
    an item of a list or tuple argument (anything else runs as its step)."""
    if type(p) is int:
        return p < len(instr.args)
    if type(p) is str:
        return p in instr.kwargs
    return type(p) is tuple and len(p) == 2 and type(p[0]) is int and p[0] < len(instr.args) \
        and isinstance(instr.args[p[0]], (list, tuple)) and type(p[1]) is int and p[1] < len(instr.args[p[0]])


def _ref_at(instr, p):
    """The ref id at a ``tpos`` place of a ``CallOp``."""
    if type(p) is int:
        return instr.args[p]
    if type(p) is str:
        return instr.kwargs[p]
    return instr.args[p[0]][p[1]]


def _slowly(refs: dict, steps, start: int) -> None:
    """Steps ``start`` on, one by one, each followed by its frees."""
    for step, frees in steps[start:]:
        step()
        for r in frees:
            refs.pop(r, None)


def _getter(worker, propagate):
    """``get(ref)``: the ref's value; a missing ref raises, and one holding a failure raises ``propagate``."""
    refs, rank = worker.refs, worker.rank

    def get(r):
        v = refs.get(r, _MISSING)
        if v is _MISSING:
            raise RuntimeError(f"tensor ref {r} does not exist on rank {rank} (deleted, or never created)")
        if type(v) is RemoteException:
            raise propagate(v)
        return v

    return get
