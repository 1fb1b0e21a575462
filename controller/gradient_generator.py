"""Gradients one at a time, as the backward pass reaches them (Monarch's ``monarch.gradient_generator``).

>>> order = gradient_execution_order([loss], params)
>>> for i, g in zip(order, grad_generator(loss, [params[i] for i in order])):
...     on_comm, borrow = comm.borrow(g, mutable=True)    # comm = Stream("comm")
...     with comm.activate():
...         on_comm.reduce_("dp", "avg")     # issued before the backward ops of the layers below
...     borrows.append(borrow)              # drop() each before using the gradients

``grad_generator(roots, with_respect_to, grad_roots)`` yields the gradient of
``roots`` for each of ``with_respect_to`` in the order given. The backward pass
runs in a thread of its own and pauses as soon as the gradient the loop waits
for is ready, so what the loop does with it is recorded before the ops of the
rest of the backward pass. A worker runs each stream on a thread of its own, so
a reduction issued on a second stream, as above, runs while the default stream
computes the rest of the backward (on one stream, the two would take turns).
The thread records with the caller's active mesh and stream. Works for
ordinary tensors too.
"""

from __future__ import annotations

import atexit
import functools
import math
import threading
import weakref
from typing import Any, Iterable, Sequence

import torch
from torch.autograd.graph import GradientEdge, get_gradient_edge

from . import tensor as _tensor

WAIT_S = 1.0  # the loop checks on the backward thread this often while it waits
_live: weakref.WeakSet = weakref.WeakSet()  # backward passes whose thread may still be paused


@atexit.register
def _finish_all() -> None:
    """At exit, let every paused backward pass run to its end: a thread left inside autograd's engine while
    the interpreter shuts down crashes it (a generator kept, not exhausted, until the script ended)."""
    for run in list(_live):
        run.finish()


def _edge(x) -> GradientEdge:
    return x if isinstance(x, GradientEdge) else get_gradient_edge(x)


def _as_list(x, what: str, none_ok: bool = False) -> list:
    """``x`` as a list: one tensor or ``GradientEdge`` is a list of one, as ``torch.autograd.grad`` takes it
    (a tensor is iterable, and a ``GradientEdge`` is a tuple: ``list()`` would split either into pieces)."""
    if isinstance(x, (torch.Tensor, GradientEdge)):
        return [x]
    if x is None and none_ok:  # grad_roots=None: as torch.autograd.grad's grad_outputs=None
        return []
    if isinstance(x, (str, bytes)) or not isinstance(x, Iterable):
        raise TypeError(f"{what} must be a tensor or a list of tensors, got {type(x).__name__}")
    x = list(x)
    for i, t in enumerate(x):
        if not (isinstance(t, (torch.Tensor, GradientEdge)) or (none_ok and t is None)):
            raise TypeError(f"{what}[{i}] must be a tensor, got {type(t).__name__}")
    return x


class _Backward:
    """One backward pass in a thread, handing each wanted gradient to the loop that asks for it."""

    def __init__(self, roots: list, wrt: list, grad_roots: list) -> None:
        if not roots:
            raise ValueError("grad_generator needs at least one root (the tensor to differentiate)")
        for i, t in enumerate(wrt):
            if isinstance(t, torch.Tensor) and not t.requires_grad:
                raise ValueError(f"grad_generator: with_respect_to[{i}] does not require grad")
        if grad_roots and len(grad_roots) != len(roots):
            raise ValueError(f"grad_generator: {len(grad_roots)} grad_roots for {len(roots)} roots")
        self.roots, self.wrt, self.grad_roots = roots, wrt, grad_roots or [None] * len(roots)
        self.got: dict[int, Any] = {}
        self.waiting: int | None = None   # the index the loop waits for
        self.paused = False               # the thread waits for the loop to take a gradient and come back
        self.abandoned = False            # the loop is gone: run to the end without pausing
        self.done = False
        self.error: BaseException | None = None
        self.cv = threading.Condition()
        self.caller_state = (_tensor.state.ctx_mesh, _tensor.state.stream)
        self.thread: threading.Thread | None = None

    def _hook(self, i: int):
        def hook(grad):
            with self.cv:
                self.got.setdefault(i, grad)
                if self.waiting == i and not self.abandoned:
                    self.paused = True
                    self.cv.notify_all()
                    while self.paused and not self.abandoned:
                        self.cv.wait()
        return hook

    def _run(self) -> None:
        _tensor.state.ctx_mesh, _tensor.state.stream = self.caller_state
        handles = []
        try:
            tensors = [i for i, t in enumerate(self.wrt) if isinstance(t, torch.Tensor)]
            handles = [self.wrt[i].register_hook(self._hook(i)) for i in tensors]
            grads = torch.autograd.grad([_edge(r) for r in self.roots], [_edge(t) for t in self.wrt],
                                        self.grad_roots, allow_unused=True)
            with self.cv:
                for i, g in enumerate(grads):
                    self.got.setdefault(i, g)
        except BaseException as e:  # noqa: BLE001 - raised in the loop
            self.error = e
        finally:
            for h in handles:
                h.remove()
            with self.cv:
                self.done = True
                self.cv.notify_all()

    def take(self, i: int):
        with self.cv:
            if i in self.got:  # came already: the thread stays where it is
                return self.got.pop(i)
            if self.thread is None:
                self.thread = threading.Thread(target=self._run, daemon=True, name="monarch-tensor-backward")
                _live.add(self)
                self.thread.start()
            self.waiting, self.paused = i, False
            self.cv.notify_all()  # a paused thread goes on
            while i not in self.got and not self.done:
                self.cv.wait(WAIT_S)
                if not self.thread.is_alive() and not self.done:
                    raise RuntimeError("grad_generator: the backward thread ended without a result")
            if i not in self.got:
                raise self.error if self.error is not None else RuntimeError(
                    f"grad_generator: no gradient came for with_respect_to[{i}]")
            self.waiting = None
            return self.got.pop(i)

    def finish(self) -> None:
        """Let the thread run to its end without pausing, and wait for it (it holds the graph until then)."""
        with self.cv:
            self.abandoned = True
            self.cv.notify_all()
        if self.thread is not None:
            self.thread.join()


def grad_generator(roots: torch.Tensor | Sequence = (), with_respect_to: Sequence = (),
                   grad_roots: Sequence = ()):
    """Yield d(roots)/d(x) for each x of ``with_respect_to`` (tensors or ``GradientEdge``s), in that order;
    ``grad_roots`` are the roots' incoming gradients (None for a scalar root). A gradient the roots do not
    depend on comes as None."""
    run = _Backward(_as_list(roots, "grad_generator: roots"),
                    _as_list(with_respect_to, "grad_generator: with_respect_to"),
                    _as_list(grad_roots, "grad_generator: grad_roots", none_ok=True))

    def gen():
        try:
            for i in range(len(run.wrt)):
                yield run.take(i)
        finally:
            run.finish()

    return gen()


class _GradFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, fn, *args):
        result, ctx.continuation = fn(*args)
        return result

    @staticmethod
    def backward(ctx, *grads):
        continuation, ctx.continuation = ctx.continuation, None
        if continuation is None:
            raise RuntimeError("grad_function: backward through the same call twice")
        out = continuation(*grads)
        return (None, *out) if isinstance(out, tuple) else (None, out)


def grad_function(fn):
    """A differentiable function from ``fn(*args) -> (result, backward)``, where ``backward(*grads)`` returns
    the gradients of ``args`` (Monarch's): ``y = grad_function(f)(x)``."""
    return functools.partial(_GradFunction.apply, fn)


def gradient_execution_order(roots: Sequence, with_respect_to: Sequence) -> list[int]:
    """The indices of ``with_respect_to`` in the order a backward pass from ``roots`` produces their gradients
    (the reverse of each one's first use in the forward pass)."""
    roots = _as_list(roots, "gradient_execution_order: roots")
    with_respect_to = _as_list(with_respect_to, "gradient_execution_order: with_respect_to")
    keys = [(e.node, e.output_nr) for e in map(_edge, with_respect_to)]
    first: dict = {k: math.inf for k in keys}
    todo, seen = [_edge(r).node for r in roots], set()
    while todo:
        node = todo.pop()
        if node in seen:
            continue
        seen.add(node)
        for key in node.next_functions:
            if key[0] is None:
                continue
            todo.append(key[0])
            if key in first:
                first[key] = min(first[key], node._sequence_nr())
    return sorted(range(len(keys)), key=lambda i: first[keys[i]], reverse=True)
