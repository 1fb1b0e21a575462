"""The worker side of global sharded tensors, on real procs with real gloo groups.

Four procs ({"dp": 2, "tp": 2}) are shared by the module. An actor on each
builds torch DeviceMeshes from process groups made by ``worker.dtensor`` (no
default process group, exactly as the tensor worker does) and runs DTensor
work; every result is compared with local torch on the controller. Hypothesis
draws shapes, placements on 1-D and 2-D meshes, and op chains.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from _dt_chains import OPS, run_chain
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.distributed.tensor import Partial, Replicate, Shard

from monarch_tensor.actor import Actor, current_rank, endpoint, this_host

pytestmark = pytest.mark.timeout(120)
T = 60  # seconds any one call may take on a loaded 2-core machine

GRID_2D = ((0, 1), (2, 3))        # {"dp": 2, "tp": 2}, proc ranks in mesh order
GRID_1D = (0, 1, 2, 3)            # {"x": 4}
GRID_PAIR = (0, 1)                # {"x": 2}: a sub-mesh; procs 2 and 3 sit out


# ---- the actor -----------------------------------------------------------------------------------
class DTWorker(Actor):
    def __init__(self, store_addr) -> None:
        from monarch_tensor.worker.dtensor import StoreGroups

        torch.set_num_threads(1)
        self.rank = current_rank().rank
        self.groups = StoreGroups(self.rank, store_addr)

    def _mesh(self, grid, names):
        from monarch_tensor.worker.dtensor import device_mesh

        return device_mesh(grid, names, self.rank, self.groups.backend)

    def _in(self, grid) -> bool:
        return self.rank in torch.tensor(grid).flatten().tolist()

    @endpoint
    def chain(self, grid, names, x: torch.Tensor, placements, ops, grad: bool):
        """Distribute ``x``, run ``ops``; the full result (and the full gradient of its sum) on every rank."""
        from monarch_tensor.worker.dtensor import distribute

        if not self._in(grid):
            return None
        dt = distribute(x, self._mesh(grid, names), placements, requires_grad=grad)
        out = run_chain(dt, ops)
        result = {"out": out.full_tensor(), "placements": tuple(out.placements)}
        if grad:
            out.sum().backward()
            result["grad"] = dt.grad.full_tensor()
        return result

    @endpoint
    def redistribute(self, grid, names, x: torch.Tensor, src, dst):
        """``x`` placed as ``src``, redistributed to ``dst``: full value and local shape.

        A ``Partial`` source dim holds ``x``'s shard on coordinate 0 and zeros elsewhere.
        """
        from monarch_tensor.worker.dtensor import distribute, from_local, redistribute

        if not self._in(grid):
            return None
        mesh = self._mesh(grid, names)
        plain = [Replicate() if isinstance(p, Partial) else p for p in src]
        local = distribute(x, mesh, plain).to_local()
        coords = mesh.get_coordinate()
        if any(isinstance(p, Partial) and coords[i] != 0 for i, p in enumerate(src)):
            local = torch.zeros_like(local)
        dt = from_local(local, mesh, src, shape=x.shape, stride=x.stride())
        assert tuple(dt.placements) == tuple(src), (dt.placements, src)
        out = redistribute(dt, dst)
        return {"full": out.full_tensor(), "placements": tuple(out.placements),
                "local": tuple(out.to_local().shape)}

    @endpoint
    def matmul_train(self, grid, names, x, w, placements_x, placements_w, steps: int):
        """SGD on ``w`` for loss = mean((x @ w)^2) with torch.optim on DTensors; returns the final full ``w``."""
        from monarch_tensor.worker.dtensor import distribute

        if not self._in(grid):
            return None
        mesh = self._mesh(grid, names)
        xd = distribute(x, mesh, placements_x)
        wd = distribute(w, mesh, placements_w, requires_grad=True)
        opt = torch.optim.SGD([wd], lr=0.1)
        losses = []
        for _ in range(steps):
            opt.zero_grad()
            loss = ((xd @ wd) ** 2).mean()
            loss.backward()
            opt.step()
            losses.append(loss.full_tensor().item())
        return {"w": wd.full_tensor().detach(), "losses": losses}

    @endpoint
    def attention(self, q: torch.Tensor, k: torch.Tensor):
        """``q @ k^T`` of (batch, heads, T, hs) tensors with the batch sharded over dp and the heads over tp (a
        ``bmm`` of ``_StridedShard`` inputs), with its gradients; and how the rating of strategies prices moves
        of such an input."""
        from monarch_tensor.worker.dtensor import distribute
        from torch.distributed.tensor._collective_utils import redistribute_cost
        from torch.distributed.tensor._dtensor_spec import DTensorSpec

        mesh = self._mesh(GRID_2D, ("dp", "tp"))
        qd, kd = (distribute(t, mesh, [Shard(0), Shard(1)], requires_grad=True) for t in (q, k))
        att = qd @ kd.transpose(-2, -1)
        att.sum().backward()
        flat = qd.detach().reshape(-1, *q.shape[2:])  # (batch x heads, T, hs): (Shard(0), _StridedShard(0))
        spec = flat._spec
        gathered = DTensorSpec(mesh, (Replicate(), Replicate()), tensor_meta=spec.tensor_meta)
        return {"att": att.full_tensor(), "placements": tuple(att.placements),
                "q_grad": qd.grad.full_tensor(), "k_grad": kd.grad.full_tensor(),
                "flat": str(flat.placements),
                "to_itself": redistribute_cost(spec, spec), "to_replicate": redistribute_cost(spec, gathered),
                "from_replicate": redistribute_cost(gathered, spec)}

    @endpoint
    def rank_groups(self):
        from monarch_tensor.worker.dtensor import dim_groups

        return dim_groups(torch.tensor(GRID_2D), self.rank)


# ---- fixtures ------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def workers():
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    procs = this_host().spawn_procs({"dp": 2, "tp": 2})
    w = procs.spawn("dtworker", DTWorker, ("127.0.0.1", store.port))
    w.initialized.get(timeout=T)
    yield w
    procs.stop().get(timeout=T)
    del store


def _all(workers, method: str, *args):
    vals = [v for v in getattr(workers, method).call(*args).get(timeout=T).values() if v is not None]
    assert vals, "no rank of the mesh answered"
    return vals


# ---- tests ---------------------------------------------------------------------------------------
def test_dim_groups(workers):
    groups = workers.rank_groups.call().get(timeout=T).values()
    # dim 0 ("dp") varies the first index: procs (0, 2) and (1, 3); dim 1 ("tp"): (0, 1) and (2, 3)
    assert groups == [[(0, 2), (0, 1)], [(1, 3), (0, 1)], [(0, 2), (2, 3)], [(1, 3), (2, 3)]]


@pytest.mark.parametrize("grid,names,placements", [
    (GRID_PAIR, ("x",), [Shard(0)]),
    (GRID_1D, ("x",), [Shard(1)]),
    (GRID_2D, ("dp", "tp"), [Shard(0), Replicate()]),
    (GRID_2D, ("dp", "tp"), [Shard(0), Shard(1)]),
])
def test_dt_matmul_transpose(workers, grid, names, placements):
    torch.manual_seed(0)
    x = torch.randn(16, 12)
    for res in _all(workers, "chain", grid, names, x, placements, ["mm_t"], False):
        torch.testing.assert_close(res["out"], x @ x.T)


MESHES = st.sampled_from([(GRID_PAIR, ("x",)), (GRID_1D, ("x",)), (GRID_2D, ("dp", "tp"))])
PLACEMENT = st.sampled_from([Shard(0), Shard(1), Replicate()])


@settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
@given(mesh=MESHES, m=st.integers(1, 9), n=st.integers(1, 9), data=st.data(),
       ops=st.lists(st.sampled_from(OPS), min_size=1, max_size=4), grad=st.booleans())
def test_random_chains_match_local(workers, mesh, m, n, data, ops, grad):
    grid, names = mesh
    placements = [data.draw(PLACEMENT) for _ in names]
    x = torch.randn(m, n, generator=torch.Generator().manual_seed(m * 31 + n))
    ref_x = x.clone().requires_grad_(grad)
    ref = run_chain(ref_x, ops)
    if grad:
        ref.sum().backward()
    for res in _all(workers, "chain", grid, names, x, placements, ops, grad):
        torch.testing.assert_close(res["out"], ref.detach(), rtol=1e-4, atol=1e-5)
        if grad:
            torch.testing.assert_close(res["grad"], ref_x.grad, rtol=1e-4, atol=1e-5)


ALL_1D = [Shard(0), Shard(1), Replicate(), Partial()]
TARGETS = [Shard(0), Shard(1), Replicate()]  # torch: "redistributing to Partial is for internal use only"


@pytest.mark.parametrize("src", ALL_1D, ids=str)
@pytest.mark.parametrize("dst", TARGETS, ids=str)
def test_redistribute_every_pair_1d(workers, src, dst):
    x = torch.arange(30, dtype=torch.float32).reshape(5, 6)
    for res in _all(workers, "redistribute", GRID_1D, ("x",), x, [src], [dst]):
        torch.testing.assert_close(res["full"], x)
        assert res["placements"] == (dst,)
        if isinstance(dst, Shard):
            assert res["local"][dst.dim] <= -(-x.shape[dst.dim] // 4)


@settings(max_examples=12, deadline=None, suppress_health_check=list(HealthCheck))
@given(src=st.tuples(st.sampled_from(ALL_1D), st.sampled_from(ALL_1D)),
       dst=st.tuples(st.sampled_from(TARGETS), st.sampled_from(TARGETS)))
def test_redistribute_pairs_2d(workers, src, dst):
    x = torch.arange(42, dtype=torch.float32).reshape(7, 6)
    for res in _all(workers, "redistribute", GRID_2D, ("dp", "tp"), x, list(src), list(dst)):
        torch.testing.assert_close(res["full"], x)
        assert res["placements"] == dst


def test_attention_matmul_on_batch_and_heads_sharded_inputs(workers):
    # A (batch, heads) split over {dp, tp} that a view merges into one dim (a _StridedShard, as attention's bmm
    # sees it): results and gradients as local torch, the heads' placement kept, and the strategy rating's
    # prices of moving such an input: nothing to stay, something to gather, nothing from a replicated one.
    torch.manual_seed(2)
    q, k = torch.randn(4, 2, 3, 5), torch.randn(4, 2, 3, 5)
    rq, rk = q.clone().requires_grad_(True), k.clone().requires_grad_(True)
    ref = rq @ rk.transpose(-2, -1)
    ref.sum().backward()
    for res in _all(workers, "attention", q, k):
        torch.testing.assert_close(res["att"], ref.detach())
        torch.testing.assert_close(res["q_grad"], rq.grad)
        torch.testing.assert_close(res["k_grad"], rk.grad)
        assert res["placements"] == (Shard(0), Shard(1))
        assert "_StridedShard" in res["flat"]
        assert res["to_itself"] == 0 and res["from_replicate"] == 0
        assert 0 < res["to_replicate"] < float("inf")


def test_optimizer_on_sharded_params_matches_local(workers):
    torch.manual_seed(1)
    x, w = torch.randn(8, 6), torch.randn(6, 4)
    ref_w = w.clone().requires_grad_(True)
    opt = torch.optim.SGD([ref_w], lr=0.1)
    losses = []
    for _ in range(3):
        opt.zero_grad()
        loss = ((x @ ref_w) ** 2).mean()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    for res in _all(workers, "matmul_train", GRID_2D, ("dp", "tp"), x, w, [Shard(0), Replicate()],
                    [Replicate(), Shard(1)], 3):
        torch.testing.assert_close(res["w"], ref_w.detach())
        assert res["losses"] == pytest.approx(losses, rel=1e-5)
