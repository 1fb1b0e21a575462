"""grad_generator / grad_function / gradient_execution_order (Monarch's monarch.gradient_generator): gradients
one at a time, equal to torch.autograd.grad's, handed out while the backward pass is paused."""

import os
import subprocess
import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from monarch_tensor import Stream, grad_function, grad_generator, inspect, no_mesh
from monarch_tensor.gradient_generator import gradient_execution_order

pytestmark = pytest.mark.timeout(120)


def _model(n_layers: int, width: int = 4, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(width, width, generator=g).requires_grad_(True),
             torch.randn(width, generator=g).requires_grad_(True)) for _ in range(n_layers)]


def _forward(layers, x, log=None):
    h = x
    for i, (w, b) in enumerate(layers):
        h = torch.tanh(h @ w + b)
        if log is not None:
            h.register_hook(lambda g, i=i: log.append(("backward", i)))
    return h.sum()


def test_gradients_come_in_execution_order_while_the_backward_pass_waits():
    layers = _model(3)
    params = [p for layer in layers for p in layer]
    log: list = []
    loss = _forward(layers, torch.ones(2, 4), log)
    order = gradient_execution_order([loss], params)
    assert order == [5, 4, 3, 2, 1, 0]  # the last layer's bias first
    ref = torch.autograd.grad(loss, params, retain_graph=True)
    log.clear()
    for i, g in zip(order, grad_generator(loss, [params[i] for i in order])):
        log.append(("got", i))
        torch.testing.assert_close(g, ref[i])
    # the last layer's gradients were handed out before the backward pass went past the layers below
    assert log.index(("got", 5)) < log.index(("backward", 1)) < log.index(("got", 3)) < log.index(("backward", 0))


@settings(max_examples=20, deadline=None)
@given(n_layers=st.integers(1, 4), perm_seed=st.integers(0, 1000), unused=st.booleans())
def test_any_order_matches_autograd_grad(n_layers, perm_seed, unused):
    layers = _model(n_layers, seed=perm_seed)
    params = [p for layer in layers for p in layer]
    extra = torch.zeros(3, requires_grad=True)  # the loss does not depend on it: its gradient is None
    wrt = params + ([extra] if unused else [])
    perm = torch.randperm(len(wrt), generator=torch.Generator().manual_seed(perm_seed)).tolist()
    loss = _forward(layers, torch.ones(2, 4))
    ref = torch.autograd.grad(loss, [wrt[i] for i in perm], retain_graph=True, allow_unused=True)
    got = list(grad_generator([loss], [wrt[i] for i in perm]))
    assert len(got) == len(perm)
    for g, r in zip(got, ref):
        if r is None:
            assert g is None
        else:
            torch.testing.assert_close(g, r)


def test_leaving_the_loop_early_lets_the_backward_pass_finish():
    layers = _model(3)
    params = [p for layer in layers for p in layer]
    loss = _forward(layers, torch.ones(2, 4))
    gen = grad_generator(loss, list(reversed(params)))
    next(gen)
    gen.close()  # the thread runs to its end; nothing is left paused
    loss2 = _forward(layers, torch.ones(2, 4))
    loss2.backward()
    assert all(p.grad is not None for p in params)


def test_a_script_may_end_with_a_generator_not_exhausted():
    """Its backward thread is paused inside autograd's engine: it is let finish at exit (a thread left there
    crashed the interpreter's shutdown)."""
    code = (
        "import torch\n"
        "from monarch_tensor import grad_generator\n"
        "w = [torch.randn(4, 4, requires_grad=True) for _ in range(3)]\n"
        "h = torch.ones(2, 4)\n"
        "for x in w:\n"
        "    h = torch.tanh(h @ x)\n"
        "gen = grad_generator(h.sum(), list(reversed(w)))\n"
        "next(gen)\n"
        "print('one taken', flush=True)\n")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=root,
                          env=dict(os.environ, PYTHONPATH=root))
    assert proc.returncode == 0 and proc.stdout == "one taken\n", (proc.returncode, proc.stderr[-2000:])


def test_bad_input_says_what_was_wrong():
    x = torch.ones(3, requires_grad=True)
    with pytest.raises(ValueError, match="at least one root"):
        grad_generator([], [x])
    with pytest.raises(ValueError, match=r"with_respect_to\[1\] does not require grad"):
        grad_generator((x * 2).sum(), [x, torch.ones(3)])
    with pytest.raises(ValueError, match="1 grad_roots for 2 roots"):
        grad_generator([x.sum(), x.sum()], [x], [None])
    with pytest.raises(RuntimeError, match="does not require grad"):  # torch's own error, raised in the loop
        next(grad_generator(torch.ones(3).sum(), [x]))


def test_grad_function_uses_the_given_backward():
    def double(x):
        return x * 2, lambda g: g * 3  # a deliberately different backward: it is the one used

    x = torch.ones(4, requires_grad=True)
    grad_function(double)(x).sum().backward()
    assert x.grad.tolist() == [3.0] * 4


def test_a_ddp_step_on_a_mesh_reduces_each_gradient_as_it_comes(mesh):
    with no_mesh():
        local = _model(2)
    with mesh.activate(), Stream("ddp").activate():  # the backward thread records on the caller's stream
        layers = [(w.detach().clone().requires_grad_(True), b.detach().clone().requires_grad_(True))
                  for w, b in local]  # (made here: mesh tensors, the same on every rank)
        params = [p for layer in layers for p in layer]
        x = torch.ones(2, 4) * (1 + mesh.rank("gpus"))  # each rank's own data
        loss = _forward(layers, x)
        order = gradient_execution_order([loss], params)
        for i, g in zip(order, grad_generator(loss, [params[i] for i in order])):
            params[i].grad = g.reduce_("gpus", "avg")
        grads = [inspect(p.grad, gpus=1) for p in params]
    with no_mesh():
        lparams = [p for layer in local for p in layer]
        per_rank = [torch.autograd.grad(_forward(local, torch.ones(2, 4) * (1 + r)), lparams) for r in range(2)]
        for k, g in enumerate(grads):
            torch.testing.assert_close(g, (per_rank[0][k] + per_rank[1][k]) / 2)
    with mesh.activate():
        y = grad_function(lambda t: (t * 2, lambda g: g * 2))(torch.ones(3, requires_grad=True))
        assert y.requires_grad and inspect(y, gpus=0).tolist() == [2.0] * 3


def test_reductions_on_a_comm_stream_while_the_backward_goes_on(mesh):
    """The overlapping form: each gradient, as it comes, is borrowed by a second stream and reduced there (a
    worker runs each stream on its own thread), while the default stream computes the rest of the backward."""
    with no_mesh():
        local = _model(3, seed=5)
    comm = Stream("comm")
    with mesh.activate():
        layers = [(w.detach().clone().requires_grad_(True), b.detach().clone().requires_grad_(True))
                  for w, b in local]
        params = [p for layer in layers for p in layer]
        loss = _forward(layers, torch.ones(2, 4) * (1 + mesh.rank("gpus")))
        order = gradient_execution_order([loss], params)
        borrows = []
        for i, g in zip(order, grad_generator(loss, [params[i] for i in order])):
            on_comm, borrow = comm.borrow(g, mutable=True)
            with comm.activate():
                on_comm.reduce_("gpus", "avg")
            borrows.append((i, g, borrow))
        for i, g, borrow in borrows:
            borrow.drop()  # the default stream may use g again once the reduction is done
            params[i].grad = g
        grads = [inspect(p.grad, gpus=0) for p in params]
    with no_mesh():
        lparams = [p for layer in local for p in layer]
        per_rank = [torch.autograd.grad(_forward(local, torch.ones(2, 4) * (1 + r)), lparams) for r in range(2)]
        for k, g in enumerate(grads):
            torch.testing.assert_close(g, (per_rank[0][k] + per_rank[1][k]) / 2)


def test_one_tensor_is_a_list_of_one_and_a_root_that_is_no_tensor_is_a_type_error():
    # grad_generator(loss, w) iterated w's elements and yielded None for each; grad_generator(5, [x]) said
    # "'int' object is not iterable".
    w = torch.ones(3, requires_grad=True)
    (g,) = list(grad_generator((w * 2).sum(), w))
    assert g.tolist() == [2.0, 2.0, 2.0]
    y = w * 3
    (g,) = list(grad_generator(y, [w], torch.ones(3)))  # one grad_root for one root
    assert g.tolist() == [3.0, 3.0, 3.0]
    assert gradient_execution_order((w * 2).sum(), w) == [0]
    with pytest.raises(TypeError, match="grad_generator: roots must be a tensor or a list of tensors, got int"):
        grad_generator(5, [w])
    with pytest.raises(TypeError, match=r"grad_generator: with_respect_to\[1\] must be a tensor, got str"):
        grad_generator(w.sum(), [w, "b"])
    with pytest.raises(TypeError, match="with_respect_to must be a tensor or a list of tensors, got str"):
        grad_generator(w.sum(), "w")
