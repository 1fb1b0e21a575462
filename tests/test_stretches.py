"""MONARCH_TENSOR_COMPILE_STRETCHES: a compiled step's stretches of aten ops run through torch.compile on the
workers; results close to the uncompiled step's, a failed compile or an error inside compiled code handled as
without the setting. Inductor compiles are slow: tiny graphs, few of them (=wait: compiled at the first replay)."""

import shutil

import pytest
import torch
import torch.nn.functional as F
from monarch_tensor.controller.api import remote
from monarch_tensor.controller.errors import RemoteException

from monarch_tensor import compile, fetch_shard, proc_mesh

pytestmark = pytest.mark.skipif(shutil.which("g++") is None and shutil.which("cc") is None,
                                reason="inductor on CPU needs a C++ compiler (g++ or cc)")
ON = {"MONARCH_TENSOR_COMPILE_STRETCHES": "wait", "MONARCH_TENSOR_STRETCH_MIN_OPS": "3"}


@pytest.fixture(scope="module")
def mesh():
    m = proc_mesh(gpus=1, env=ON)
    yield m
    m.stop()


def value(t):
    return fetch_shard(t, gpus=0).result(300)  # (a cold inductor compile on a loaded 2-core machine: a minute or more)


def counts():
    """This proc's (compiled runs, fallbacks, compiles, compile failures)."""
    c = remote("monarch_tensor.worker.stretch.counts", propagate=lambda: torch.zeros(4, dtype=torch.int64))()
    return value(c).tolist()


def _losses(fn_wrap):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    x, y = torch.randn(6, 8), torch.randint(0, 4, (6,))

    def step():
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        return loss.detach()

    step = fn_wrap(step)
    losses = [step() for _ in range(5)]
    return [value(t) for t in losses], [value(p) for p in model.parameters()]


@pytest.mark.timeout(600)
def test_training_step_runs_compiled_and_matches_uncompiled(mesh):
    with mesh.activate():
        before = counts()
        comp = _losses(compile)
        after = counts()
        eager = _losses(lambda f: f)
    assert after[2] > before[2] and after[0] > before[0], (before, after)  # compiled, and ran compiled
    assert after[3] == before[3]
    for a, c in zip(eager[0] + eager[1], comp[0] + comp[1]):
        torch.testing.assert_close(c, a, rtol=1e-5, atol=1e-6)


@pytest.mark.timeout(600)
def test_an_error_inside_compiled_code_names_the_line_and_writes_once(mesh):
    """index_select out of range inside a compiled stretch that also writes its input in place: the error names
    the user's line, the input is written once (the compiled attempt leaves it as it was)."""
    with mesh.activate():
        table = torch.arange(10.0)

        @compile(verify=False)
        def f(w, i):
            w.add_(1)
            a = w * 2 + 1
            b = torch.index_select(table, 0, i) * a[0]  # the line the error names
            return (b - 1).relu()

        w, good = torch.zeros(3), torch.tensor([1, 2])
        for _ in range(3):
            r = f(w, good)
        assert torch.equal(value(w), torch.full((3,), 3.0))
        before = counts()
        bad = f(w, torch.tensor([1, 99]))
        with pytest.raises(RemoteException, match=r"test_stretches.py:\d+") as e:
            value(bad)
        assert "index_select" in e.value.op
        assert torch.equal(value(w), torch.full((3,), 4.0))  # written once
        after = counts()
        assert after[1] > before[1], (before, after)  # the compiled code raised, the straight-line source ran
        r = f(w, good)
        torch.testing.assert_close(value(r), (torch.tensor([1.0, 2.0]) * 11 - 1).relu())


def _break_inductor():
    """No working C++ compiler on this proc, and no cache to get around it."""
    import torch._inductor.config as cfg

    cfg.cpp.cxx = ("/bin/false",)
    cfg.fx_graph_cache = False
    return torch.zeros(())


@pytest.mark.timeout(600)
def test_a_failed_compile_runs_straight_line():
    """The compile fails (no C++ compiler): it is counted, and the steps are the straight-line ones, bit for bit."""
    m = proc_mesh(gpus=1, env=ON)
    try:
        with m.activate():
            value(remote(_break_inductor, propagate=lambda: torch.zeros(()))())
            w = torch.ones(4)

            @compile(verify=False)
            def f(x):
                return ((x * w + 1).exp() - 2).abs()

            x = torch.arange(4.0)
            results = [f(x) for _ in range(3)]
            c = counts()
            for r in results:
                assert torch.equal(value(r), ((torch.arange(4.0) + 1).exp() - 2).abs())
    finally:
        m.stop()
    assert c[3] >= 1 and c[0] == 0, c


def test_which_ops_may_be_compiled():
    """Random ops, ops whose output shape depends on values and ops returning anything but tensors (or one list
    of tensors) end a stretch."""
    from monarch_tensor.worker.stretch import eligible

    aten = torch.ops.aten
    assert eligible(aten.addmm.default) and eligible(aten.native_layer_norm.default) and eligible(aten.add_.Tensor)
    assert eligible(aten.split.Tensor)
    for op in (aten.bernoulli_.float, aten.randn.default, aten.nonzero.default, aten._local_scalar_dense.default,
               aten.masked_select.default, aten.sym_size.int):
        assert not eligible(op), op
