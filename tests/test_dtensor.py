"""Global sharded tensors through the tensor engine: distribute, ops, autograd, redistribute, errors.

One proc mesh {"dp": 2, "tp": 2} is shared by the module; a 1-D view of it is
its slice at tp=0 ({"dp": 2} over procs 0 and 2). Every value is compared with
local torch. Hypothesis draws shapes, placements and op chains.
"""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist
from _dt_chains import OPS, run_chain
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from monarch_tensor import (
    Partial,
    RemoteException,
    Replicate,
    Shard,
    ShardingError,
    call_on_shard_and_fetch,
    distribute,
    fetch_shard,
    from_local,
    inspect,
    remote,
    this_host,
)
from monarch_tensor.actor import Actor, endpoint
from monarch_tensor.utils import setup_env_for_distributed

pytestmark = pytest.mark.timeout(120)
T = 60


@pytest.fixture(scope="module")
def mesh2d():
    procs = this_host().spawn_procs({"dp": 2, "tp": 2})
    yield procs
    procs.stop().get(timeout=T)


@pytest.fixture(scope="module")
def mesh1d(mesh2d):
    return mesh2d.slice(tp=0)


def _close(a, b):
    torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


# ---- metadata, the seed's example ---------------------------------------------------------------
def test_metadata_without_moving_data(mesh2d):
    x = torch.randn(1024, 64)
    dt = distribute(x, mesh2d, sharding_spec=["dp", None])
    assert dt.shape == (1024, 64)
    assert dt.placements == (Shard(0), Replicate())
    assert dt.device_mesh is mesh2d
    assert repr(dt) == "DTensor(shape=(1024, 64), dtype=torch.float32, placements={dp: S(0), tp: R}, " \
                       "mesh={'dp': 2, 'tp': 2})"
    assert distribute(x, mesh2d, [Shard(0), Replicate()]).placements == dt.placements
    # mesh dim names per tensor dim given as placements: read as the sharding spec they are
    assert distribute(x, mesh2d, ["dp", None]).placements == dt.placements
    assert distribute(x, mesh2d, [None, ("dp", "tp")]).placements == (Shard(1), Shard(1))


def test_fetch_shard_of_a_dtensor_is_that_ranks_plain_shard(mesh1d, capfd):
    x = torch.arange(16.0).reshape(4, 4)
    dt = distribute(x, mesh1d, sharding_spec=["dp", None])
    got = fetch_shard(dt, dp=1).result()
    assert type(got) is torch.Tensor and torch.equal(got, x[2:])
    assert torch.equal(inspect(dt), x[:2])
    assert "DeviceMesh" not in capfd.readouterr().err  # (torch warned about its mesh's pickling at every fetch)


def test_seed_dt_matmul_dt_T(mesh2d):
    x = torch.randn(64, 32)
    dt = distribute(x, mesh2d, sharding_spec=["dp", None])
    result = dt @ dt.T
    assert result.shape == (64, 64)
    _close(result.full_tensor(), x @ x.T)
    assert result.placements[0] == Shard(0)


def test_seed_train_step_loss_item(mesh2d):
    """Seed 004's train_step returns ``loss.item()`` of a DTensor loss: the global value, as upstream DTensor
    gives it (and ``float(loss)``); a mesh tensor that is not distributed still refuses (a value per rank)."""
    import monarch_tensor
    from monarch_tensor import MeshTensorError

    torch.manual_seed(0)
    model, x, y = torch.nn.Linear(4, 4), torch.randn(8, 4), torch.randn(8, 4)
    want = torch.nn.MSELoss()(model(x), y).item()
    dist_model = monarch_tensor.module_to_mesh(model, mesh2d)
    loss = torch.nn.MSELoss()(dist_model(distribute(x, mesh2d, sharding_spec=["dp", None])),
                              distribute(y, mesh2d, sharding_spec=["dp", None]))
    loss.backward()
    assert loss.item() == pytest.approx(want, rel=1e-5) and float(loss) == pytest.approx(want, rel=1e-5)
    with mesh2d.activate(), pytest.raises(MeshTensorError, match="ranks hold different values"):
        torch.ones(()).sum().add(mesh2d.rank_tensor("dp")).item()  # a mesh tensor: a value per rank


def test_seed_mesh_by_shape_and_dim_names():
    import monarch_tensor
    from monarch_tensor.distributed import Mesh

    device_mesh = Mesh(shape=(2, 1), mesh_dim_names=("data_parallel", "model_parallel"))  # the seed's form
    try:
        assert device_mesh.size() == 2 and device_mesh.sizes == {"data_parallel": 2, "model_parallel": 1}
        x = torch.randn(16, 8)
        dt = monarch_tensor.distribute(x, device_mesh, sharding_spec=["data_parallel", None])
        _close((dt @ dt.T).full_tensor(), x @ x.T)
    finally:
        device_mesh.stop()
    with pytest.raises(ValueError, match="2 sizes .* but 1 mesh_dim_names"):
        Mesh(shape=(2, 1), mesh_dim_names=("dp",))
    with pytest.raises(ValueError, match="positive int sizes"):
        Mesh(shape=(2, 0))


# ---- random chains and gradients ------------------------------------------------------------------
PLACEMENT = st.sampled_from([Shard(0), Shard(1), Replicate()])


@settings(max_examples=20, deadline=None, suppress_health_check=list(HealthCheck))
@given(two_d=st.booleans(), m=st.integers(1, 7), n=st.integers(1, 7), data=st.data(),
       ops=st.lists(st.sampled_from(OPS), min_size=1, max_size=4), grad=st.booleans())
def test_random_chains_and_grads_match_local(mesh1d, mesh2d, two_d, m, n, data, ops, grad):
    mesh = mesh2d if two_d else mesh1d
    placements = [data.draw(PLACEMENT) for _ in mesh._shape.names]
    x = torch.randn(m, n, generator=torch.Generator().manual_seed(m * 10 + n))
    ref_x = x.clone().requires_grad_(grad)
    ref = run_chain(ref_x, ops)
    dt = distribute(x, mesh, placements)
    if grad:
        dt.requires_grad_(True)
    out = run_chain(dt, ops)
    _close(out.full_tensor(), ref.detach())
    if grad:
        ref.sum().backward()
        out.sum().backward()
        assert dt.grad.shape == dt.shape  # (its placements may differ from the input's: a chain can leave it Partial)
        _close(dt.grad.full_tensor(), ref_x.grad)


# ---- redistribute ---------------------------------------------------------------------------------
TARGETS = [Shard(0), Shard(1), Replicate()]


@pytest.mark.parametrize("src", TARGETS, ids=str)
@pytest.mark.parametrize("dst", TARGETS, ids=str)
def test_redistribute_every_pair_with_autograd(mesh1d, src, dst):
    x = torch.randn(5, 6)
    dt = distribute(x, mesh1d, [src])
    dt.requires_grad_(True)
    y = dt.redistribute(placements=[dst])
    assert y.placements == (dst,)
    _close(y.full_tensor(), x)
    (y * y).sum().backward()
    assert dt.grad.placements == (src,)
    _close(dt.grad.full_tensor(), 2 * x)


@settings(max_examples=10, deadline=None, suppress_health_check=list(HealthCheck))
@given(src=st.tuples(PLACEMENT, PLACEMENT), dst=st.tuples(PLACEMENT, PLACEMENT))
def test_redistribute_pairs_2d(mesh2d, src, dst):
    x = torch.arange(42, dtype=torch.float32).reshape(7, 6)
    y = distribute(x, mesh2d, list(src)).redistribute(placements=list(dst))
    assert y.placements == dst
    _close(y.full_tensor(), x)


def test_partial_from_local_redistributes_to_replicate(mesh1d):
    with mesh1d.activate():
        ones = torch.ones(3, 4)
    dt = from_local(ones, mesh1d, [Partial()], shape=(3, 4))
    assert dt.placements == (Partial(),)
    _close(dt.redistribute(placements=[Replicate()]).full_tensor(), torch.full((3, 4), 2.0))


def _shared_memory_groups(dt) -> list:
    """On a worker: per dim of ``dt``'s DeviceMesh, whether its group's collectives go through shared memory."""
    mesh = dt.device_mesh
    return [getattr(mesh.get_group(i), "_shm", None) is not None for i in range(mesh.ndim)]


def test_dtensor_collectives_on_one_host_go_through_shared_memory(mesh2d):
    # DTensor's all-reduces, all-gathers and reduce-scatters of a mesh on one host (tensor parallelism's
    # activations, FSDP's gathers) went over gloo's TCP sockets, while the engine's own reduces used the
    # procs' shared memory: the same groups now take both.
    x = torch.arange(48.0).reshape(6, 8)
    dt = distribute(x, mesh2d, [Shard(0), Shard(1)])
    for r in ({"dp": 0, "tp": 0}, {"dp": 1, "tp": 1}):
        assert call_on_shard_and_fetch(remote(_shared_memory_groups), dt, shard=r).result(timeout=T) == [True, True]
    _close(dt.redistribute(placements=[Replicate(), Replicate()]).full_tensor(), x)
    summed = from_local(dt.to_local(), mesh2d, [Partial(), Partial()], shape=(3, 4))  # each rank's block
    _close(summed.redistribute(placements=[Replicate(), Shard(0)]).full_tensor(),
           x[:3, :4] + x[:3, 4:] + x[3:, :4] + x[3:, 4:])


def test_no_shm_reduce_keeps_dtensor_collectives_on_gloo():
    # MONARCH_TENSOR_NO_SHM_REDUCE=1 in the procs turns every shared-memory collective off, DTensor's too.
    from monarch_tensor.actor import proc_mesh

    procs = proc_mesh(dp=2, env={"MONARCH_TENSOR_NO_SHM_REDUCE": "1"})
    try:
        x = torch.arange(12.0).reshape(4, 3)
        dt = distribute(x, procs, [Shard(0)])
        with procs.activate():
            assert call_on_shard_and_fetch(remote(_shared_memory_groups), dt, shard={"dp": 1}).result(timeout=T) \
                == [False]
        _close(dt.redistribute(placements=[Replicate()]).full_tensor(), x)
    finally:
        procs.stop().get(timeout=T)


@pytest.mark.timeout(120)
def test_a_dtensor_collective_that_waits_on_a_dead_proc_fails_and_frees_the_survivor(faults):
    # Rank 0 waits in an all-gather through shared memory for rank 1, which is stopped, then killed: the
    # controller's report of the death ends the wait (a shared-memory wait sees no closed socket), so the
    # fetch fails and rank 0's stream runs what comes next.
    import os
    import signal

    from monarch_tensor import SupervisionError

    procs = this_host().spawn_procs({"dp": 2})
    try:
        with procs.activate():
            pids = [call_on_shard_and_fetch("os.getpid", shard={"dp": r}).result(timeout=T) for r in (0, 1)]
        dt = distribute(torch.ones(64, 4), procs, [Shard(0)])
        dt.redistribute(placements=[Replicate()]).full_tensor()  # (the group is formed)
        os.kill(pids[1], signal.SIGSTOP)
        gathered = dt.redistribute(placements=[Replicate()])
        pending = fetch_shard(gathered.to_local(), dp=0)
        time.sleep(0.5)  # (rank 0 is in the all-gather)
        os.kill(pids[1], signal.SIGKILL)
        with pytest.raises(SupervisionError, match="rank 1"):
            pending.result(timeout=30)
        with procs.slice(dp=0).activate():
            y = torch.ones(3) * 2
        assert fetch_shard(y).result(timeout=30).tolist() == [2.0] * 3  # (rank 0's stream was stuck: a timeout)
    finally:
        procs.stop().get(timeout=T)


def test_to_local_and_from_local_round_trip_with_grads(mesh1d):
    x = torch.randn(6, 4)
    dt = distribute(x, mesh1d, [Shard(0)])
    dt.requires_grad_(True)
    local = dt.to_local()
    assert local.shape == (3, 4) and not local.is_distributed
    back = from_local(local * 3, mesh1d, [Shard(0)])
    assert back.shape == (6, 4)
    _close(back.full_tensor(), 3 * x)
    back.sum().backward()
    _close(dt.grad.full_tensor(), torch.full((6, 4), 3.0))


# ---- optimizers on distributed parameters ---------------------------------------------------------
@pytest.mark.parametrize("opt_cls", [torch.optim.SGD, torch.optim.Adam], ids=["sgd", "adam"])
def test_optimizer_steps_match_local(mesh2d, opt_cls):
    torch.manual_seed(3)
    x, w = torch.randn(8, 6), torch.randn(6, 4)
    ref_w = w.clone().requires_grad_(True)
    dw = distribute(w, mesh2d, [Replicate(), Shard(1)])
    dw.requires_grad_(True)
    dx = distribute(x, mesh2d, [Shard(0), Replicate()])
    ref_opt, opt = opt_cls([ref_w], lr=0.05), opt_cls([dw], lr=0.05)
    for _ in range(3):
        for o, xx, ww in ((ref_opt, x, ref_w), (opt, dx, dw)):
            o.zero_grad()
            ((xx @ ww).tanh() ** 2).mean().backward()
            o.step()
    _close(dw.full_tensor(), ref_w.detach())
    assert dw.placements == (Replicate(), Shard(1))


def test_module_to_mesh_adamw_with_params_smaller_than_dp(mesh2d):
    """An ``nn.Linear(4, 1)``'s weight and bias have a dim 0 (1) smaller than dp (2): module_to_mesh replicates
    them (torch would refuse AdamW's in-place ``lerp_`` of their Partial gradients into a ``Shard(0)`` state),
    and AdamW updates them as local training does."""
    import copy

    from monarch_tensor import module_to_mesh

    torch.manual_seed(0)
    ref, x = torch.nn.Linear(4, 1), torch.randn(8, 4)
    model = module_to_mesh(copy.deepcopy(ref), mesh2d)
    assert model.weight.placements == (Replicate(), Replicate()) == model.bias.placements
    ref_opt, opt = torch.optim.AdamW(ref.parameters(), lr=0.1), torch.optim.AdamW(model.parameters(), lr=0.1)
    dx = distribute(x, mesh2d, sharding_spec=["dp", None])
    for _ in range(2):
        for o, m_, xx in ((ref_opt, ref, x), (opt, model, dx)):
            o.zero_grad()
            m_(xx).pow(2).mean().backward()
            o.step()
    _close(model.weight.full_tensor(), ref.weight.detach())
    _close(model.bias.full_tensor(), ref.bias.detach())


# ---- errors ---------------------------------------------------------------------------------------
def test_errors_name_what_was_wrong(mesh2d):
    x = torch.randn(4, 4)
    with pytest.raises(ShardingError, match="names mesh dim 'model'.*has dims \\['dp', 'tp'\\]"):
        distribute(x, mesh2d, sharding_spec=["model", None])
    with pytest.raises(ShardingError, match="1 placement\\(s\\).*mesh with 2 dim"):
        distribute(x, mesh2d, [Shard(0)])
    with pytest.raises(ShardingError, match="names tensor dim 2, but the tensor has 2 dim"):
        distribute(x, mesh2d, [Shard(2), Replicate()])
    with pytest.raises(ShardingError, match="3 entries but the tensor has only 2"):
        distribute(x, mesh2d, sharding_spec=["dp", None, "tp"])
    with pytest.raises(ShardingError, match="Partial"):
        distribute(x, mesh2d, [Partial(), Replicate()])
    with pytest.raises(ShardingError, match="None is not a placement.*pass sharding_spec="):
        distribute(x, mesh2d, [Shard(0), None])
    dt = distribute(x, mesh2d, [Shard(0), Replicate()])
    with pytest.raises(ShardingError, match="mesh dim\\(s\\) \\['pp'\\]"):
        dt.redistribute(placements={"pp": Shard(0)})
    with pytest.raises(ShardingError, match="different shapes"):
        distribute(torch.randn(3, 4), mesh2d, [Shard(0), Replicate()]).to_local()
    with pytest.raises(ShardingError, match="needs a distributed tensor"):
        with mesh2d.activate():
            torch.ones(2).full_tensor()


def test_inplace_op_torch_refuses_raises_at_the_fetch(mesh1d):
    """torch runs no in-place op whose result would need another placement than its target's: here the
    Partial argument cannot be reduce-scattered onto a Shard(0) of a dim (size 1) smaller than the mesh dim.
    The error reaches the script at the next fetch of the target and of a view of it (a DTensor's memory is
    its shard's: finding the view must not lose the error, leaving the old values to be fetched)."""
    with mesh1d.activate():
        ones = torch.ones(1, 4)
    g = from_local(ones, mesh1d, [Partial()], shape=(1, 4))
    a = distribute(torch.zeros(1, 4), mesh1d, [Shard(0)])
    view = a[:, 1:]
    a.lerp_(g, 0.5)
    for t in (a, view):
        with pytest.raises(RemoteException, match="in-place operations that require placement changes"):
            t.full_tensor()


def test_error_is_raised_at_the_users_line(mesh2d):
    import traceback

    try:
        distribute(torch.randn(4, 4), mesh2d, sharding_spec=["dp", "dp"])
    except ShardingError as e:
        frames = traceback.extract_tb(e.__traceback__)
        assert frames[0].filename == __file__ and "sharding_spec=[\"dp\", \"dp\"]" in frames[0].line
        assert "same mesh dim 'dp'" in str(e)
    else:
        pytest.fail("no error")


# ---- torch.distributed of user code on the same procs ---------------------------------------------
class UserDist(Actor):
    """What a training actor does with torch.distributed on procs the tensor engine also runs DTensors on."""

    @endpoint
    def step(self):
        """The common idiom: init the default group unless there is one; then two collectives over it."""
        was = dist.is_initialized()
        if not was:
            dist.init_process_group("gloo")
        t = torch.tensor([float(dist.get_rank() + 1)])
        dist.all_reduce(t)
        gathered = [torch.zeros(1) for _ in range(dist.get_world_size())]
        dist.all_gather(gathered, torch.tensor([float(dist.get_rank())]))
        return was, dist.get_backend(), t.item(), [g.item() for g in gathered]

    @endpoint
    def destroy(self) -> bool:
        dist.destroy_process_group()
        return dist.is_initialized()


def _engine_matmul(procs, dt=None) -> bool:
    """``dt @ dt.T`` by the tensor engine, for ``dt`` (default: a new one) sharded by rows over ``procs``."""
    x = torch.arange(16.0).reshape(4, 4)
    with procs.activate():
        dt = _distributed(procs) if dt is None else dt
        return torch.equal((dt @ dt.T).full_tensor(), x @ x.T)


def _distributed(procs):
    with procs.activate():
        return distribute(torch.arange(16.0).reshape(4, 4), procs, [Shard(0)])


@pytest.mark.parametrize("engine_first", [True, False], ids=["engine_first", "actors_first"])
def test_user_default_process_group_is_the_users(engine_first):
    """The engine's DTensors leave the procs' default process group to user code, in either order: an actor's
    init_process_group("gloo") makes a real one (is_initialized() was False), its collectives sum over both
    procs, and the engine's DTensors, old and new, keep working beside it and after the actor destroys it."""
    procs = this_host().spawn_procs(per_host={"gpus": 2})
    try:
        setup_env_for_distributed(procs)
        user = procs.spawn("user", UserDist)
        if engine_first:
            kept = _distributed(procs)
            assert _engine_matmul(procs, kept)
        assert user.step.call().get(timeout=T).values() == [(False, "gloo", 3.0, [0.0, 1.0])] * 2
        if not engine_first:
            kept = _distributed(procs)
        assert _engine_matmul(procs) and _engine_matmul(procs, kept)
        assert user.step.call().get(timeout=T).values() == [(True, "gloo", 3.0, [0.0, 1.0])] * 2
        assert user.destroy.call().get(timeout=T).values() == [False, False]
        assert _engine_matmul(procs) and _engine_matmul(procs, kept)
    finally:
        procs.stop().get(timeout=T)


def test_jupyter_displays_show_a_row_per_rank_without_reading_values(mesh2d):
    import re

    from monarch_tensor.actor import ValueMesh

    def rows(html):
        return [re.findall(r"<code>(.*?)</code>", r) for r in re.findall(r"<tr>(.*?)</tr>", html)[1:]]

    dt = distribute(torch.randn(5, 4), mesh2d, sharding_spec=["dp", None])
    got = rows(dt._repr_html_())
    assert got == [["0", "0", "(3, 4)"], ["0", "1", "(3, 4)"], ["1", "0", "(2, 4)"], ["1", "1", "(2, 4)"]]
    assert [tuple(s.shape) for s in (fetch_shard(dt, dp=0, tp=0).result(), fetch_shard(dt, dp=1, tp=1).result())] \
        == [(3, 4), (2, 4)]  # the shard shapes shown are the workers'
    with mesh2d.activate():
        known, unknown = torch.ones(3), torch.ones(3) * mesh2d.rank_tensor("dp")
    assert {r[-1] for r in rows(known._repr_html_())} == {"known here"}
    assert {r[-1] for r in rows(unknown._repr_html_())} == {"on the workers"}
    assert len(rows(mesh2d._repr_html_())) == 4 and "alive" in mesh2d._repr_html_()
    vm = ValueMesh(mesh2d._shape, ["<b>x</b>", 1, 2, 3])
    html = vm._repr_html_()
    assert rows(html)[0] == ["0", "0", "&lt;b&gt;x&lt;/b&gt;"]  # values are escaped
