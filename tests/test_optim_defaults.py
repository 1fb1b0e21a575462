"""An optimizer of mesh tensors takes torch's grouped (foreach) version unless told otherwise, as one of tensors
on a GPU does, and its results equal the single-tensor version's (what local CPU torch runs) bit for bit."""

import sys

import pytest
import torch

from monarch_tensor import fetch_shard

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
