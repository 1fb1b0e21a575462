"""Prepared programs: a compiled function's recording, kept on the worker and run whole by one instruction.

``DefineProgram`` arrives once; each of its instructions becomes a step with
its function and argument slots resolved (an aten op's overload looked up once,
its tensor arguments' places and refs listed once). ``RunProgram`` then binds
the call's input refs to the program's input slots, runs the steps in order on
the program's stream, drops each temporary after its last use, and moves the
results to the call's output refs. Errors stay values, as for single
instructions: a step that fails stores a ``RemoteException`` naming the user's
line of the recorded op, and steps that read it pass it on.
"""

from __future__ import annotations

import functools

import torch

from . import messages as m
from .collectives import restore_names
from .errors import RemoteException

_MISSING = object()


class Program:
    """The prepared form of a ``DefineProgram``; lives in the worker's ref table at its ref, so the controller's
    delete of that ref frees it."""

    __slots__ = ("steps", "inputs", "outputs")

    def __init__(self, worker, msg: m.DefineProgram, resolve_op, propagate: type) -> None:
        """``resolve_op``: an op's name to its overload; ``propagate``: the exception ``worker._get`` raises for
        a ref that holds a failure."""
        self.inputs, self.outputs = msg.inputs, msg.outputs
        self.steps = tuple((_prepare(worker, instr, resolve_op, propagate), frees)
                           for instr, frees in zip(msg.instrs, msg.frees))

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
        for step, frees in self.steps:
            step()
            for r in frees:
                pop(r, None)
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
    refs, outs, store = worker.refs, msg.outs, worker._store
    rank = worker.rank

    def get(r):
        v = refs.get(r, _MISSING)
        if v is _MISSING:
            raise RuntimeError(f"tensor ref {r} does not exist on rank {rank} (deleted, or never created)")
        if type(v) is RemoteException:
            raise propagate(v)
        return v

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
