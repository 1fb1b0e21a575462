"""``OpaqueModule``: a ``torch.nn.Module`` made and run on the workers, differentiable from the controller
(Monarch's ``monarch.opaque_module``).

>>> with mesh.activate():
...     linear = OpaqueModule("torch.nn.Linear", 3, 4)          # built on every rank
...     y = linear(x, propagator=lambda self, x: x.new_empty(x.shape[0], 4))
...     y.sum().backward()                                       # gradients flow through the workers' module
...     opt = torch.optim.SGD(linear.parameters(), lr=0.1)
...     opt.step()                                               # updates the workers' parameters in place

``parameters()`` are mesh tensors that are the workers' parameters (the same
storage), so an optimizer on the controller updates the module itself. A call
runs the module's forward on each rank with autograd on, keeps that rank's
graph there (held by an ``OpaqueRef`` to its backward), and returns mesh tensors;
the controller's autograd sees one node whose backward asks the workers for the
gradients of the inputs and parameters. ``propagator(self, *args, **kwargs)``
says what the forward returns, in shapes (it runs on fake tensors); non-tensor
parts of the result come from it too.
"""

from __future__ import annotations

import torch
import torch.utils._pytree as pytree
from monarch_tensor.worker.opaque import OpaqueRef

from .opaque import OpaqueObject
from .remote_functions import call_on_shard_and_fetch, remote
from .tensor import Tensor


# ---- on the workers --------------------------------------------------------------------------------------------
def _parameter_metas(module: OpaqueRef) -> list:
    return [(tuple(p.shape), p.dtype) for p in module.value.parameters()]


def _parameters(module: OpaqueRef) -> list:
    # detached: the mesh tensors alias the parameters without recording graphs on the workers
    return [p.detach() for p in module.value.parameters()]


def _module_forward(requires_grad: list, module: OpaqueRef, args, kwargs):
    """Run the module with autograd on; return an ``OpaqueRef`` to the backward of this call and the result's
    tensors (detached). ``requires_grad`` has a flag per tensor of (args, kwargs), then per parameter."""
    mod = module.value
    params = list(mod.parameters())
    leaves, spec = pytree.tree_flatten((args, kwargs))
    where = [i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor)]
    if len(requires_grad) != len(where) + len(params):
        raise ValueError(f"OpaqueModule: {len(requires_grad)} gradient flags for {len(where)} input tensors and "
                         f"{len(params)} parameters (did the module's parameters change?)")
    inputs: list = [leaves[i] for i in where] + params
    with torch.enable_grad():
        for k, i in enumerate(where):
            if requires_grad[k]:
                leaves[i] = inputs[k] = leaves[i].detach().requires_grad_(True)
        # a flag for a parameter that does not require grad here gets zeros (as does an unused input)
        wanted = [rg and t.requires_grad for rg, t in zip(requires_grad, inputs)]
        shapes = [(t.shape, t.dtype, t.device) for t in inputs]
        in_edges = [torch.autograd.graph.get_gradient_edge(t) for t, w in zip(inputs, wanted) if w]
        args, kwargs = pytree.tree_unflatten(leaves, spec)
        result = mod(*args, **kwargs)
    outs = [x for x in pytree.tree_leaves(result) if isinstance(x, torch.Tensor)]
    live = [t.requires_grad for t in outs]
    out_edges = [torch.autograd.graph.get_gradient_edge(t) for t, lv in zip(outs, live) if lv]
    out_shapes = [(t.shape, t.dtype, t.device) for t in outs]
    del inputs, leaves, args, kwargs  # the closure keeps graph edges only, not tensors

    def backward(grad_outputs: list) -> list:
        # None: the controller's graph did not use that output
        grads = [g if g is not None else torch.zeros(shape, dtype=dtype, device=device)
                 for g, lv, (shape, dtype, device) in zip(grad_outputs, live, out_shapes) if lv]
        got = iter(torch.autograd.grad(out_edges, in_edges, grads, allow_unused=True)
                   if in_edges and out_edges else [None] * len(in_edges))
        out = []  # a gradient per flagged input: zeros where the result does not depend on it
        for rg, w, (shape, dtype, device) in zip(requires_grad, wanted, shapes):
            g = next(got) if w else None
            if rg:
                out.append(g if g is not None else torch.zeros(shape, dtype=dtype, device=device))
        return out

    return OpaqueRef(backward), [t.detach() for t in outs]


def _module_backward(backward: OpaqueRef, grad_outputs: list) -> list:
    return backward.value(grad_outputs)


# ---- on the controller -----------------------------------------------------------------------------------------
class OpaqueModule:
    """A module made on every rank of the active mesh by ``constructor(*args, **kwargs)`` (a dotted path such as
    ``"torch.nn.Linear"``, or a function), called with mesh tensors and differentiable from the controller."""

    def __init__(self, *args, **kwargs) -> None:
        self._object = OpaqueObject(*args, **kwargs)
        self._parameters: list | None = None

    def parameters(self) -> list:
        """The module's parameters as mesh tensors that require grad (the workers' own storage)."""
        if self._parameters is None:
            metas = call_on_shard_and_fetch(remote(_parameter_metas), self._object).result()
            if not metas:
                self._parameters = []
            else:
                got = remote(_parameters, propagate=lambda _m: [torch.empty(s, dtype=d) for s, d in metas])(
                    self._object)
                self._parameters = [p.requires_grad_(True) for p in got]
        return self._parameters

    def call_method(self, method_name: str, propagation, *args, **kwargs):
        """Another method of each rank's module (no autograd); see ``OpaqueObject.call_method``."""
        return self._object.call_method(method_name, propagation, *args, **kwargs)

    def __call__(self, *args, propagator=None, propagate=None, **kwargs):
        if propagator is None:
            propagator = propagate
        if not callable(propagator):
            raise TypeError("OpaqueModule(...)(*args, propagator=fn): fn(self, *args, **kwargs) must say what the "
                            f"forward returns, in shapes (it runs on fake tensors); got {propagator!r}")
        params = self.parameters()
        leaves, spec = pytree.tree_flatten((args, kwargs))
        where = [i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor)]
        tensors = [leaves[i] for i in where] + params
        requires_grad = [t.requires_grad for t in tensors]
        if not (torch.is_grad_enabled() and any(requires_grad)):  # no graph to keep: a plain call
            return self._object.call_method("__call__", propagator, *args, **kwargs)
        obj, n_in = self._object, len(where)
        made: dict = {}

        def rebuild(flat) -> tuple:
            xs = list(leaves)
            for k, i in enumerate(where):
                xs[i] = flat[k]
            return pytree.tree_unflatten(xs, spec)

        def shapes(_rg, module, a, k):  # runs once per call (a fresh remote): it records the result's layout
            out = propagator(module, *a, **k)
            made["leaves"], made["spec"] = pytree.tree_flatten(out)
            return OpaqueRef(), [x for x in made["leaves"] if isinstance(x, torch.Tensor)]

        class _Call(torch.autograd.Function):
            @staticmethod
            def forward(ctx, *flat):
                a, k = rebuild(flat[:n_in])
                made["backward"], outs = remote(_module_forward, propagate=shapes)(requires_grad, obj, a, k)
                ctx.set_materialize_grads(False)  # an unused output's gradient stays None, not local zeros
                ctx.mark_non_differentiable(*(t for t in outs if not (t.is_floating_point() or t.is_complex())))
                return tuple(outs)

            @staticmethod
            def backward(ctx, *grad_outputs):
                fn = made.pop("backward", None)  # the workers' graph of this call is used up by its backward
                if fn is None:
                    raise RuntimeError("OpaqueModule: backward through the same call twice (the workers' graph "
                                       "of a call is freed by its first backward)")
                metas = [(t.shape, t.dtype) for t, rg in zip(tensors, requires_grad) if rg]
                grads = remote(_module_backward, propagate=lambda _b, _g: [torch.empty(s, dtype=d) for s, d in metas])(
                    fn, [g if type(g) is Tensor else None for g in grad_outputs])
                it = iter(grads)
                return tuple(next(it) if rg else None for rg in requires_grad)

        outs = iter(_Call.apply(*tensors))
        return pytree.tree_unflatten([next(outs) if isinstance(x, torch.Tensor) else x for x in made["leaves"]],
                                     made["spec"])
