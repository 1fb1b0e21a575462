"""An optimizer of mesh tensors takes torch's grouped (foreach) version unless told otherwise, as one of tensors
on a GPU does, and its results equal the single-tensor version's (what local CPU torch runs) bit for bit."""

import sys

import pytest
import torch

from monarch_tensor import MeshTensorError, Stream, fetch_shard

pytestmark = pytest.mark.timeout(120)

OPTIMIZERS = [
    (torch.optim.AdamW, dict(lr=3e-2), "adam"),
    (torch.optim.Adam, dict(lr=3e-2, weight_decay=0.1), "adam"),
    (torch.optim.SGD, dict(lr=0.1, momentum=0.9), "sgd"),
]


def _model() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))


def _train(model, opt, x, y, steps: int = 3) -> None:
    for _ in range(steps):
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()


@pytest.mark.parametrize("cls,kw,module", OPTIMIZERS, ids=[c.__name__ for c, _, _ in OPTIMIZERS])
def test_mesh_parameters_take_the_foreach_version_with_the_single_tensor_versions_results(procs, monkeypatch, cls,
                                                                                         kw, module):
    mod = sys.modules[f"torch.optim.{module}"]
    ran = []
    for which in ("_single_tensor", "_multi_tensor"):
        real = getattr(mod, f"{which}_{module}")
        monkeypatch.setattr(mod, f"{which}_{module}",
                            lambda *a, _real=real, _which=which, **k: (ran.append(_which), _real(*a, **k))[1])
    torch.manual_seed(0)
    local = _model()
    start = {k: v.clone() for k, v in local.state_dict().items()}
    x, y = torch.randn(6, 8), torch.randn(6, 4)
    _train(local, cls(local.parameters(), **kw), x, y)
    assert ran == ["_single_tensor"] * 3  # (local CPU tensors: torch's own default, unchanged)
    for choice in ({}, {"foreach": False}):
        ran.clear()
        with procs.activate():
            model = _model()
            model.load_state_dict(start)
            _train(model, cls(model.parameters(), **choice, **kw), x, y)
            got = [fetch_shard(p.detach(), gpus=1).result(60) for p in model.parameters()]
        # mesh parameters: the foreach version, unless the user chose (the user's choice wins)
        assert ran == ["_multi_tensor" if not choice else "_single_tensor"] * 3
        for g, e in zip(got, local.parameters()):
            assert torch.equal(g, e.detach()), (choice, (g - e).abs().max())


# ---- item() of a value the controller knows (the foreach Adam reads each step count with it) ----------------
def test_item_of_a_known_value_follows_every_write_and_skips_torchs_dispatcher(procs, monkeypatch):
    import monarch_tensor.controller.tensor as ct

    record = ct.record
    through_torch = []  # the reads that reached the engine's recording through torch's dispatcher
    monkeypatch.setattr(ct, "record", lambda func, *a: (
        through_torch.append(1) if func is torch.ops.aten._local_scalar_dense.default else None, record(func, *a))[1])
    with procs.activate():
        unknown = torch.full((), 5.0) + procs.rank_tensor("gpus") * 0  # computed on the workers
        step = torch.zeros(())
        step += 1
        assert step.item() == 1.0
        step.mul_(3)
        assert step.item() == 3.0
        assert through_torch == []  # (known values: read here, not dispatched through torch)
        step.copy_(unknown)  # a write the controller does not compute: the value is fetched
        assert step.item() == 5.0 and through_torch == [1]
        step.add_(1)
        assert step.item() == 6.0
        step.reduce_("gpus", "sum")
        assert step.item() == 12.0
        base = torch.zeros(2)
        view = base[0]
        assert view.item() == 0.0
        base.add_(unknown)  # written through its base: the view's known value is stale
        assert view.item() == 5.0
        base = torch.zeros(2)
        view = base[1]
        assert view.item() == 0.0
        base[1:].fill_(4.0)  # a known write through another view of the same memory
        assert view.item() == 4.0


def test_item_of_a_known_value_raises_what_torch_raises_and_shows_to_modes(procs):
    from torch.utils._python_dispatch import TorchDispatchMode

    class Seen(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.append((func, "local" if type(args[0]) is torch.Tensor else "mesh"))
            return func(*args, **(kwargs or {}))

    with procs.activate():
        two = torch.zeros(2)
        with pytest.raises(RuntimeError, match="a Tensor with 2 elements cannot be converted to Scalar"):
            two.item()
        step = torch.ones(())
        with Seen() as seen:  # a user's dispatch mode sees the read of the mesh tensor, as torch's own item() shows it
            assert step.item() == 1.0
        assert seen.ops == [(torch.ops.aten._local_scalar_dense.default, "mesh")], seen.ops
        side = Stream("known_side")
        with side.activate():  # a tensor of the main stream, read while another is active: refused as any use
            with pytest.raises(MeshTensorError, match="used while stream 'known_side' is active"):
                step.item()
        lent, borrow = side.borrow(step, mutable=True)
        with pytest.raises(MeshTensorError, match="lent to stream.*mutable=True"):
            step.item()  # (the other stream may be writing it)
        borrow.drop()
        assert step.item() == 1.0


def test_a_compiled_function_reading_a_known_value_still_runs_uncompiled(procs):
    import warnings

    from monarch_tensor import compile

    with procs.activate():
        step = torch.zeros(())

        @compile
        def bump(x):
            step.add_(1)
            return x * step.item()

        x = torch.ones(2)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            got = [fetch_shard(bump(x), gpus=0).result(60).tolist() for _ in range(3)]
    assert got == [[1.0, 1.0], [2.0, 2.0], [3.0, 3.0]]  # (each call ran the Python code: item() saw the new value)
    assert any("runs uncompiled" in str(w.message) and "_local_scalar_dense" in str(w.message) for w in caught), \
        [str(w.message) for w in caught]
