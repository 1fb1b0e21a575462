"""OpaqueModule (Monarch's): a module made on the workers, called with mesh tensors, differentiable from the
controller; its gradients and optimizer steps are checked against the same module run locally."""

import gc

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from monarch_tensor import RemoteException, call_on_shard_and_fetch, inspect, no_mesh, remote
from monarch_tensor.opaque_module import OpaqueModule

pytestmark = pytest.mark.timeout(180)


def _local_copy(module: OpaqueModule, rank: int, make):
    """The same module made here, with rank ``rank``'s parameters."""
    values = [inspect(p, gpus=rank) for p in module.parameters()]
    with no_mesh():
        local = make()
        with torch.no_grad():
            for p, v in zip(local.parameters(), values):
                p.copy_(v)
    return local


def test_monarchs_module_paths():
    from monarch_tensor.controller.opaque import OpaqueObject, opaque_method

    from monarch_tensor.opaque_object import OpaqueObject as O2
    from monarch_tensor.opaque_object import opaque_method as om2

    assert (O2, om2) == (OpaqueObject, opaque_method)


def _linear_out(self, x):
    return x.new_empty(*x.shape[:-1], 4)


def test_gradients_and_an_optimizer_step_match_the_module_run_locally(mesh):
    with mesh.activate():
        lin = OpaqueModule("torch.nn.Linear", 3, 4)
        params = lin.parameters()
        assert [tuple(p.shape) for p in params] == [(4, 3), (4,)] and all(p.requires_grad for p in params)
        assert lin.parameters() is params  # asked once
        locals_ = [_local_copy(lin, r, lambda: torch.nn.Linear(3, 4)) for r in range(2)]
        x = (torch.arange(6.0).reshape(2, 3) + mesh.rank("gpus")).requires_grad_(True)
        y = lin(x, propagator=_linear_out)
        (y * y).sum().backward()
        opt = torch.optim.SGD(params, lr=0.1)
        opt.step()
        after = lin(x.detach(), propagator=_linear_out)  # no graph: a plain call of the updated module
        for r, local in enumerate(locals_):
            with no_mesh():
                xr = (torch.arange(6.0).reshape(2, 3) + r).requires_grad_(True)
                yr = local(xr)
                (yr * yr).sum().backward()
                torch.optim.SGD(local.parameters(), lr=0.1).step()
                after_r = local(xr.detach())
            torch.testing.assert_close(inspect(y, gpus=r), yr.detach())
            torch.testing.assert_close(inspect(x.grad, gpus=r), xr.grad)
            torch.testing.assert_close(inspect(params[0].grad, gpus=r), local.weight.grad)
            torch.testing.assert_close(inspect(params[1].grad, gpus=r), local.bias.grad)
            torch.testing.assert_close(inspect(params[0], gpus=r), local.weight.detach())  # the step reached the module
            torch.testing.assert_close(inspect(after, gpus=r), after_r.detach())


class TwoHeads(torch.nn.Module):
    """Uses only its first input; returns a dict with a differentiable tensor, an integer tensor and a str."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.arange(1.0, 4.0))
        self.frozen = torch.nn.Parameter(torch.ones(3), requires_grad=False)

    def forward(self, a, b, scale=1.0):
        y = (a * self.w * self.frozen) * scale
        return {"y": y, "top": y.argmax(-1), "tag": "heads"}


def _two_heads_out(self, a, b, scale=1.0):
    return {"y": torch.empty_like(a), "top": torch.empty(a.shape[:-1], dtype=torch.int64), "tag": "heads"}


def test_unused_inputs_frozen_parameters_and_structured_results(mesh):
    with mesh.activate():
        m = OpaqueModule(TwoHeads)
        a = torch.ones(2, 3).requires_grad_(True)
        b = torch.ones(5).requires_grad_(True)  # the forward ignores it: its gradient is zeros
        c = torch.ones(2, 3)  # does not require grad
        out = m(a, b, scale=2.0, propagator=_two_heads_out)
        assert out["tag"] == "heads" and out["top"].dtype == torch.int64
        (out["y"].sum() + m(c, b, propagator=_two_heads_out)["y"].sum()).backward()
        assert inspect(a.grad, gpus=1).tolist() == [[2.0, 4.0, 6.0]] * 2
        assert inspect(b.grad, gpus=0).tolist() == [0.0] * 5
        w, frozen = m.parameters()
        assert inspect(w.grad, gpus=0).tolist() == [6.0, 6.0, 6.0]  # scale 2 * 2 rows of a, 1 * 2 rows of c
        assert inspect(frozen.grad, gpus=0).tolist() == [0.0] * 3  # frozen on the workers: no gradient there
        assert inspect(out["top"], gpus=0).tolist() == [2, 2]


def _graphs_held():
    """The backward closures of OpaqueModule calls that this worker holds."""
    from monarch_tensor.worker import opaque

    return sum(1 for v in opaque._table.values() if getattr(v, "__qualname__", "") == "_module_forward.<locals>.backward")


def test_a_calls_graph_on_the_workers_is_freed_and_not_reused(mesh):
    with mesh.activate():
        lin = OpaqueModule("torch.nn.Linear", 3, 4)
        held = lambda: call_on_shard_and_fetch(remote(_graphs_held), shard={"gpus": 0}).result(timeout=30)
        gc.collect()
        assert held() == 0
        with torch.no_grad():  # no graph on the controller: none kept on the workers either
            y = lin(torch.ones(2, 3).requires_grad_(True), propagator=_linear_out)
        assert not y.requires_grad and held() == 0
        for _ in range(3):
            x = torch.ones(2, 3).requires_grad_(True)
            lin(x, propagator=_linear_out).sum().backward()
        y = lin(torch.ones(2, 3).requires_grad_(True), propagator=_linear_out)
        loss = y.sum()
        assert held() == 1  # this call's graph, kept on the workers for its backward
        loss.backward(retain_graph=True)
        with pytest.raises(RuntimeError, match="backward through the same call twice"):
            loss.backward()
        del x, y, loss
        gc.collect()
        inspect(torch.ones(1), gpus=0)  # (deletes leave with the next batch)
        assert held() == 0


def test_bad_calls_say_what_was_wrong(mesh):
    with mesh.activate():
        lin = OpaqueModule("torch.nn.Linear", 3, 4)
        with pytest.raises(TypeError, match="propagator=fn"):
            lin(torch.ones(2, 3))
        with pytest.raises(RemoteException, match=r"shape \(2, 4\).*propagate said a tensor of shape \(2, 5\)"):
            y = lin(torch.ones(2, 3).requires_grad_(True), propagator=lambda self, x: x.new_empty(2, 5))
            inspect(y, gpus=0)


@settings(max_examples=5, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(batch=st.integers(1, 4), n_in=st.integers(1, 5), n_out=st.integers(1, 5), bias=st.booleans())
def test_linear_gradients_match_local_torch_for_any_shape(mesh, batch, n_in, n_out, bias):
    with mesh.activate():
        lin = OpaqueModule("torch.nn.Linear", n_in, n_out, bias=bias)
        local = _local_copy(lin, 1, lambda: torch.nn.Linear(n_in, n_out, bias=bias))
        x = (torch.linspace(-1, 1, batch * n_in).reshape(batch, n_in) * (1 + mesh.rank("gpus"))).requires_grad_(True)
        y = lin(x, propagator=lambda self, x: x.new_empty(x.shape[0], n_out))
        (y.tanh() * 3).sum().backward()
        with no_mesh():
            xr = (torch.linspace(-1, 1, batch * n_in).reshape(batch, n_in) * 2).requires_grad_(True)
            (local(xr).tanh() * 3).sum().backward()
        torch.testing.assert_close(inspect(x.grad, gpus=1), xr.grad)
        for p, pr in zip(lin.parameters(), local.parameters()):
            torch.testing.assert_close(inspect(p.grad, gpus=1), pr.grad)
