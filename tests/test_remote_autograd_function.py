"""remote_autograd_function (Monarch's monarch.cached_remote_function): an autograd.Function whose forward and
backward run on the workers, its gradients checked against the same Function run locally."""

import pytest
import torch
import torch.distributed as dist

from monarch_tensor import inspect, no_mesh
from monarch_tensor.cached_remote_function import RemoteAutogradFunction, remote_autograd_function

pytestmark = pytest.mark.timeout(120)


class SinScale(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, k):
        ctx.k = k
        ctx.save_for_backward(x)
        return x.sin() * k, x.cos()  # a second output the loss may leave unused

    @staticmethod
    def backward(ctx, g, g2):
        (x,) = ctx.saved_tensors
        return g * x.cos() * ctx.k - g2 * x.sin(), None


class SummedOverRanks(torch.autograd.Function):
    """y = sum over the group's ranks of x * 2; its backward sums the incoming gradients the same way."""

    @staticmethod
    def forward(ctx, x, pg):
        ctx.pg = pg
        y = x * 2
        dist.all_reduce(y, group=pg)
        return y

    @staticmethod
    def backward(ctx, g):
        g = g * 2
        dist.all_reduce(g, group=ctx.pg)
        return g, None


class KeepsATensor(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.x = x
        return x * 1

    @staticmethod
    def backward(ctx, g):
        return g


def test_forward_and_backward_run_remotely_and_match_local(mesh):
    remote_sin = remote_autograd_function(SinScale)
    assert issubclass(remote_sin, RemoteAutogradFunction) and remote_sin.__name__ == "Remote_SinScale"
    assert remote_autograd_function(remote_sin) is remote_sin
    with mesh.activate():
        x = (torch.linspace(-1, 1, 5) + mesh.rank("gpus")).requires_grad_(True)
        y, c = remote_sin.apply(x, 3.0)
        (y * y).sum().backward()  # c unused: its gradient is zeros on the workers
        got = [(inspect(y, gpus=r), inspect(x.grad, gpus=r)) for r in range(2)]
        x2 = (torch.linspace(-1, 1, 5) + mesh.rank("gpus")).requires_grad_(True)
        y2, c2 = remote_sin.apply(x2, 3.0)
        (y2.sum() + c2.sum()).backward()
        got2 = [inspect(x2.grad, gpus=r) for r in range(2)]
    with no_mesh():
        for r in range(2):
            xr = (torch.linspace(-1, 1, 5) + r).requires_grad_(True)
            yr, _ = SinScale.apply(xr, 3.0)
            (yr * yr).sum().backward()
            torch.testing.assert_close(got[r][0], yr.detach())
            torch.testing.assert_close(got[r][1], xr.grad)
            xr2 = (torch.linspace(-1, 1, 5) + r).requires_grad_(True)
            yr2, cr2 = SinScale.apply(xr2, 3.0)
            (yr2.sum() + cr2.sum()).backward()
            torch.testing.assert_close(got2[r], xr2.grad)


def test_a_process_group_kept_on_ctx_is_the_ranks_group_in_backward(mesh):
    fn = remote_autograd_function(SummedOverRanks)
    with mesh.activate():
        pg = mesh.process_group("gpus")
        x = (torch.ones(3) * (1 + mesh.rank("gpus"))).requires_grad_(True)
        y = fn.apply(x, pg)
        (y * (1 + mesh.rank("gpus"))).sum().backward()  # rank r's incoming gradient is r + 1
        assert inspect(y, gpus=0).tolist() == [6.0] * 3  # (1 + 2) * 2
        assert inspect(x.grad, gpus=1).tolist() == [6.0] * 3  # (1 + 2) * 2, summed over the ranks


def test_bad_input_says_what_was_wrong(mesh):
    with pytest.raises(TypeError, match="autograd.Function subclass"):
        remote_autograd_function(int)
    with mesh.activate():
        with pytest.raises(TypeError, match="ctx.save_for_backward"):
            remote_autograd_function(KeepsATensor).apply(torch.ones(2, requires_grad=True))
