"""Distributed checkpoints (monarch_tensor.checkpoint): save a sharded model and its AdamW state with
torch.distributed.checkpoint on the workers, resume on a fresh mesh of the same or another dp size, full
(unsharded) state dicts, full optimizer state into a sharded model, and the errors.

One proc mesh {"dp": 2} for the module; its slice at dp=0 is the 1-proc mesh (resharding 2 -> 1 -> 2).
Every value is compared with local torch trained on the same batches.
"""

from __future__ import annotations

import copy
import os

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict as torch_optim_sd

from monarch_tensor import (
    MeshTensorError,
    RemoteException,
    Replicate,
    Shard,
    ShardingError,
    call_on_shard_and_fetch,
    distribute,
    inspect,
    module_to_mesh,
    this_host,
)
from monarch_tensor import checkpoint as dcp
from monarch_tensor.checkpoint import StateDictOptions

pytestmark = pytest.mark.timeout(240)  # (the first test pays for the mesh's first DTensor step)
T = 60
LR = 0.1
FULL = StateDictOptions(full_state_dict=True)


@pytest.fixture(scope="module")
def procs():
    procs = this_host().spawn_procs({"dp": 2})
    yield procs
    procs.stop().get(timeout=T)


def _model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))


def _batches() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randn(8, 4, generator=g) for _ in range(4)]


def _step(model, opt, x, mesh=None) -> float:
    opt.zero_grad()
    loss = model(distribute(x, mesh, sharding_spec=["dp", None]) if mesh is not None else x).pow(2).mean()
    loss.backward()
    opt.step()
    return float(loss.detach().full_tensor()) if mesh is not None else float(loss.detach())


@pytest.fixture(scope="module")
def local_run():
    """The uninterrupted local run: its 4 losses, and its model and optimizer after 2 and after 4 steps."""
    model = _model(0)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    losses, at2 = [], None
    for i, x in enumerate(_batches()):
        losses.append(_step(model, opt, x))
        if i == 1:
            at2 = copy.deepcopy((model, opt))
    return losses, at2, (model, opt)


def _fresh(mesh, seed: int = 7):
    """A model of other weights and an optimizer of another lr, on ``mesh``: a load must replace both."""
    model = module_to_mesh(_model(seed), mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=0.5)


def _resume(path, mesh):
    model, opt = _fresh(mesh)
    model_sd, optim_sd = dcp.get_state_dict(model, opt)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=path)
    dcp.set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    return model, opt


def _assert_state_equal(model, opt, ref_model, ref_opt, tol=1e-6):
    got_m, got_o = dcp.get_state_dict(model, opt, options=FULL)
    for k, v in ref_model.state_dict().items():
        torch.testing.assert_close(got_m[k], v, rtol=0, atol=tol)
    want_o = torch_optim_sd(ref_model, ref_opt)
    assert got_o["param_groups"] == want_o["param_groups"]
    assert got_o["state"].keys() == want_o["state"].keys()
    for fqn, s in want_o["state"].items():
        assert got_o["state"][fqn].keys() == s.keys()
        for k, v in s.items():
            assert type(got_o["state"][fqn][k]) is torch.Tensor, (fqn, k)
            torch.testing.assert_close(got_o["state"][fqn][k], v, rtol=0, atol=tol)


def test_save_resume_and_reshard(procs, local_run, tmp_path, monkeypatch):
    """Save after 2 AdamW steps on dp=2; resume on a fresh dp=2 model and on a fresh dp=1 one: the next 2
    losses are the uninterrupted run's. The dp=1 run saves again, and a fresh dp=2 model loads that (1 -> 2):
    its whole state is the local run's after 4 steps. The save fetched nothing but DCP's plans."""
    from monarch_tensor.controller.client import MeshClient

    losses, _, (ref_model, ref_opt) = local_run
    xs = _batches()
    model = module_to_mesh(_model(0), procs)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    got = [_step(model, opt, x, procs) for x in xs[:2]]
    assert got == pytest.approx(losses[:2], abs=1e-6)

    asked = []
    request = MeshClient.request

    def spy(self, rank, make_instr, *args, **kwargs):
        def record(port):
            instr = make_instr(port)
            asked.append(getattr(instr, "fn", type(instr).__name__))
            return instr
        return request(self, rank, record, *args, **kwargs)

    monkeypatch.setattr(MeshClient, "request", spy)
    path = tmp_path / "step2"
    model_sd, optim_sd = dcp.get_state_dict(model, opt)
    metadata = dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
    monkeypatch.undo()
    assert asked and all(isinstance(a, str) and a.startswith("monarch_tensor.worker.checkpoint.save_") for a in asked), asked
    assert sorted(os.listdir(path)) == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    assert "model.0.weight" in metadata.state_dict_metadata and "optim.state.0.weight.exp_avg" in \
        metadata.state_dict_metadata

    one = procs.slice(dp=slice(0, 1))
    for mesh in (procs, one):
        model2, opt2 = _resume(path, mesh)
        assert opt2.param_groups[0]["lr"] == LR
        more = [_step(model2, opt2, x, mesh) for x in xs[2:]]
        assert more == pytest.approx(losses[2:], abs=1e-6), mesh

    dcp.save(dict(zip(("model", "optim"), dcp.get_state_dict(model2, opt2))), checkpoint_id=tmp_path / "dp1")
    assert sorted(os.listdir(tmp_path / "dp1")) == [".metadata", "__0_0.distcp"]
    model3, opt3 = _resume(tmp_path / "dp1", procs)
    _assert_state_equal(model3, opt3, ref_model, ref_opt)
    assert model3[0].weight.placements == model[0].weight.placements


def test_checkpoint_is_torch_dcp(procs, local_run, tmp_path):
    """The files are DCP's: torch's own dcp_to_torch_save reads them into the local run's tensors."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    _, (ref_model, ref_opt), _ = local_run
    model = module_to_mesh(_model(0), procs)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    for x in _batches()[:2]:
        _step(model, opt, x, procs)
    dcp.save({"model": model}, checkpoint_id=tmp_path / "ck")  # a Stateful value: its state_dict(), as DCP
    dcp_to_torch_save(tmp_path / "ck", tmp_path / "whole.pt")
    whole = torch.load(tmp_path / "whole.pt")["model"]
    for k, v in ref_model.state_dict().items():
        torch.testing.assert_close(whole[k], v, rtol=0, atol=1e-6)
    fresh, _ = _fresh(procs)
    dcp.load({"model": fresh}, checkpoint_id=tmp_path / "ck")  # and its load_state_dict()
    for k, v in dcp.get_model_state_dict(fresh, options=FULL).items():
        torch.testing.assert_close(v, whole[k], rtol=0, atol=0)


_PLACEMENTS = st.sampled_from([Replicate(), Shard(0), Shard(1)])


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(rows=st.integers(1, 5), cols=st.integers(1, 4), saved=_PLACEMENTS, loaded=_PLACEMENTS,
       to_one=st.booleans())
def test_tensor_round_trips_across_placements_and_mesh_sizes(procs, tmp_path_factory, rows, cols, saved, loaded,
                                                            to_one):
    """Any tensor saved with any placement (uneven shards too) loads into any other placement, on the same
    mesh or on one proc, with the saved value; plain values come back as saved."""
    value = torch.randn(rows, cols)
    path = tmp_path_factory.mktemp("prop")
    dcp.save({"t": distribute(value, procs, [saved]), "meta": {"rows": rows, "tag": ("a", 1)}}, checkpoint_id=path)
    mesh = procs.slice(dp=slice(0, 1)) if to_one else procs
    state = {"t": distribute(torch.zeros(rows, cols), mesh, [loaded]), "meta": {"rows": -1, "tag": None}}
    dcp.load(state, checkpoint_id=path)
    assert state["meta"] == {"rows": rows, "tag": ("a", 1)}
    torch.testing.assert_close(state["t"].full_tensor(), value, rtol=0, atol=0)
    assert state["t"].placements == (loaded,)


def test_full_state_dicts_into_a_sharded_model(procs, local_run):
    """A full (CPU) state dict after the same training equals local torch's; local torch's full model and
    optimizer state dicts go into a fresh sharded model, each state tensor placed like its parameter, and
    training continues as the local run."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict as torch_model_sd

    losses, (ref_model, ref_opt), _ = local_run
    model, opt = _fresh(procs)
    dcp.set_model_state_dict(model, torch_model_sd(ref_model))
    dcp.set_optimizer_state_dict(model, opt, torch_optim_sd(ref_model, ref_opt))
    for fqn, p in model.named_parameters():
        for k in ("exp_avg", "exp_avg_sq"):
            assert opt.state[p][k].placements == p.placements, (fqn, k)
    _assert_state_equal(model, opt, ref_model, ref_opt)
    more = [_step(model, opt, x, procs) for x in _batches()[2:]]
    assert more == pytest.approx(losses[2:], abs=1e-6)

    # torch's own load_state_dict (ids, not FQNs) places them too
    model, opt = _fresh(procs)
    model.load_state_dict(ref_model.state_dict())
    opt.load_state_dict(copy.deepcopy(ref_opt.state_dict()))  # (torch's keeps the given step tensors)
    for p in model.parameters():
        assert opt.state[p]["exp_avg"].placements == p.placements
    more = [_step(model, opt, x, procs) for x in _batches()[2:]]
    assert more == pytest.approx(losses[2:], abs=1e-6)


def test_mismatched_full_state_fails_at_the_load(procs, local_run):
    _, (ref_model, ref_opt), _ = local_run
    model, opt = _fresh(procs)
    bad = torch_optim_sd(ref_model, ref_opt)
    bad["state"]["2.weight"]["exp_avg"] = torch.zeros(3, 8)
    with pytest.raises(ShardingError, match=r"'exp_avg' of parameter '2.weight'.*\(3, 8\).*\(2, 8\)"):
        dcp.set_optimizer_state_dict(model, opt, bad)
    bad_model = dict(ref_model.state_dict(), **{"0.bias": torch.zeros(5)})
    with pytest.raises(ShardingError, match=r"model state '0.bias'.*\(5,\).*\(8,\)"):
        dcp.set_model_state_dict(model, bad_model)
    ids = ref_opt.state_dict()
    ids["state"][2] = dict(ids["state"][2], exp_avg=torch.zeros(3, 8))
    with pytest.raises(ShardingError, match=r"'exp_avg' of parameter 2 has shape \(3, 8\).*\(2, 8\)"):
        opt.load_state_dict(ids)
    other = {"state": {"9.weight": {}}, "param_groups": []}
    with pytest.raises(ValueError, match="9.weight"):
        dcp.set_optimizer_state_dict(model, opt, other)


def test_failures_leave_the_mesh_usable(procs, tmp_path):
    """A failed load (no checkpoint; a key the checkpoint lacks) or save (one rank fails to write) raises the
    worker's error and leaves nothing behind on any rank; a later load works, and the values the controller
    knew of the tensors it writes are dropped."""
    model, opt = _fresh(procs)
    with procs.activate():
        count = torch.zeros(()) + 3  # a value the controller knows too
    with pytest.raises(RemoteException, match="No such file|FileNotFoundError"):
        dcp.load({"model": model.state_dict()}, checkpoint_id=tmp_path / "missing")
    dcp.save({"model": model.state_dict(), "count": count}, checkpoint_id=tmp_path / "m")
    with pytest.raises(RemoteException, match="optim"):
        dcp.load({"model": model.state_dict(), "optim": dcp.get_optimizer_state_dict(model, opt)},
                 checkpoint_id=tmp_path / "m")
    from torch.distributed.checkpoint import DefaultSavePlanner

    class FailsOnRank1(DefaultSavePlanner):  # (a local class: its code travels to the workers)
        def finish_plan(self, plan):
            if not self.is_coordinator:
                raise OSError("disk full on this rank")
            return super().finish_plan(plan)

    with pytest.raises(RemoteException, match="disk full"):  # the coordinator wrote and waits for .metadata
        dcp.save({"model": model.state_dict()}, checkpoint_id=tmp_path / "f", planner=FailsOnRank1())
    assert ".metadata" not in os.listdir(tmp_path / "f")
    with pytest.raises(MeshTensorError, match="no mesh tensor"):
        dcp.save({"x": torch.ones(2)}, checkpoint_id=tmp_path / "local")
    count.add_(1)
    with torch.no_grad():
        model[0].weight.zero_()
    state = {"model": model.state_dict(), "count": count}
    dcp.load(state, checkpoint_id=tmp_path / "m")
    with procs.activate():  # the failed ones left nothing behind
        assert [call_on_shard_and_fetch("monarch_tensor.worker.checkpoint.pending", shard={"dp": r}).result() for r in (0, 1)] \
            == [0, 0]
    assert state["count"] is count and float(inspect(count)) == 3
    assert not hasattr(count, "_val") and count.item() == 3  # the controller's known value (4) was stale: dropped
    torch.testing.assert_close(model[0].weight.full_tensor(), _model(7)[0].weight.detach())


def test_torch_save_of_a_mesh_model_points_to_checkpoints(procs, tmp_path):
    model = module_to_mesh(_model(0), procs)
    with pytest.raises(MeshTensorError, match=r"checkpoint\.get_state_dict.*checkpoint\.save.*full_state_dict=True"
                                              r".*t\.full_tensor\(\)"):
        torch.save(model.state_dict(), tmp_path / "model.pt")
