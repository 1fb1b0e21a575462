"""``remote_autograd_function`` (Monarch's ``monarch.cached_remote_function``): a ``torch.autograd.Function`` whose
``forward`` and ``backward`` each run on the workers as one remote function.

>>> class Scale(torch.autograd.Function):
...     @staticmethod
...     def forward(ctx, x, k):
...         ctx.k = k
...         return custom_kernel(x, k)           # anything: numpy, triton, C extensions
...     @staticmethod
...     def backward(ctx, g):
...         return g * ctx.k, None
>>> RemoteScale = remote_autograd_function(Scale)
>>> y = RemoteScale.apply(x, 3.0)               # x a mesh tensor; y.sum().backward() runs Scale.backward there

A mesh tensor op by op is recorded by the engine already; this is for a
function whose body the engine cannot record (it does not go through torch's
dispatch). The controller learns shapes and ``ctx``'s plain attributes by
running ``forward`` and ``backward`` on fake tensors, so they must work on
those; tensors for the backward go through ``ctx.save_for_backward``. A
``RemoteProcessGroup`` argument kept on ``ctx`` reaches the backward as that
rank's group.
"""

from __future__ import annotations

import logging

import torch
from monarch_tensor.worker.dummy_group import DummyProcessGroup
from torch import autograd

from .process_group import RemoteProcessGroup
from .remote_functions import remote
from .tensor import Tensor

log = logging.getLogger(__name__)

_OWN = ("to_save", "saved_tensors", "needs_input_grad")


class _WireCtx:
    """The ``ctx`` that ``forward`` and ``backward`` see on the workers (and in the controller's fake runs)."""

    def __init__(self, needs_input_grad: tuple, attrs: dict | None = None, saved: tuple = ()) -> None:
        self.__dict__.update(attrs or {})
        self.needs_input_grad = needs_input_grad
        self.saved_tensors = tuple(saved)
        self.to_save: tuple = ()

    def save_for_backward(self, *tensors) -> None:
        self.to_save = tensors

    def mark_non_differentiable(self, *tensors) -> None:
        pass

    def mark_dirty(self, *tensors) -> None:
        pass

    def set_materialize_grads(self, value: bool) -> None:
        pass


def _forward(cls, needs_input_grad: tuple, args: tuple):
    ctx = _WireCtx(needs_input_grad)
    with torch.no_grad():
        out = cls.forward(ctx, *args)
    attrs = {k: v for k, v in vars(ctx).items() if k not in _OWN}
    for k, v in attrs.items():
        if isinstance(v, torch.Tensor):
            raise TypeError(f"{cls.__name__}.forward kept a tensor on ctx.{k}: keep tensors for the backward with "
                            f"ctx.save_for_backward(...), which a remote autograd function carries to the workers")
    outs = out if isinstance(out, tuple) else (out,)
    attrs["__outputs__"] = [(tuple(t.shape), t.dtype) if isinstance(t, torch.Tensor) else None for t in outs]
    return out, attrs, list(ctx.to_save)


def _backward(cls, needs_input_grad: tuple, attrs: dict, saved: list, grads: list):
    device = next(g.device for g in grads if g is not None)
    grads = [g if g is not None else torch.zeros(meta[0], dtype=meta[1], device=device)  # an unused output
             for g, meta in zip(grads, attrs["__outputs__"])]
    ctx = _WireCtx(needs_input_grad, {k: v for k, v in attrs.items() if k != "__outputs__"}, tuple(saved))
    with torch.no_grad():
        out = cls.backward(ctx, *grads)
    return tuple(out) if isinstance(out, (tuple, list)) else (out,)


_forward_remote = remote(_forward)    # no propagate: the controller runs them on fake tensors for the shapes
_backward_remote = remote(_backward)


class RemoteAutogradFunction(autograd.Function):
    """The base of the classes ``remote_autograd_function`` makes."""

    @staticmethod
    def forward(ctx, *args):
        raise NotImplementedError("use remote_autograd_function(cls)")

    @staticmethod
    def backward(ctx, *grads):
        raise NotImplementedError("use remote_autograd_function(cls)")


def remote_autograd_function(target_class: type, name: str | None = None) -> type:
    """A ``torch.autograd.Function`` (``.apply(...)``) that runs ``target_class``'s forward and backward on the
    workers of its mesh tensor arguments."""
    if isinstance(target_class, type) and issubclass(target_class, RemoteAutogradFunction):
        log.warning("%s is a remote autograd function already", target_class)
        return target_class
    if not (isinstance(target_class, type) and issubclass(target_class, autograd.Function)):
        raise TypeError(f"remote_autograd_function needs a torch.autograd.Function subclass, got {target_class!r}")
    cls = target_class

    def forward(ctx, *args):
        out, attrs, saved = _forward_remote(cls, tuple(ctx.needs_input_grad), args)
        ctx.save_for_backward(*saved)
        groups = {a.dims: a for a in args if type(a) is RemoteProcessGroup}
        attrs = {k: groups.get(v.dims, v) if isinstance(v, DummyProcessGroup) else v for k, v in attrs.items()}
        for k, v in attrs.items():
            if k != "__outputs__":
                setattr(ctx, k, v)
        ctx.remote_attrs = attrs
        ctx.set_materialize_grads(False)  # an unused output's gradient stays None (zeros made on the workers)
        return out

    def backward(ctx, *grads):
        grads = [g if type(g) is Tensor else None for g in grads]
        return _backward_remote(cls, tuple(ctx.needs_input_grad), ctx.remote_attrs, list(ctx.saved_tensors), grads)

    return type(name or f"Remote_{cls.__name__}", (RemoteAutogradFunction,),
                {"forward": staticmethod(forward), "backward": staticmethod(backward),
                 "__doc__": f"{cls.__name__}, its forward and backward run on the workers."})
