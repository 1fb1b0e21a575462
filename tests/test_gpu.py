"""The tensor engine and actors with CUDA: only where a GPU is present (the rest of the suite runs there too,
its mesh tensors then on the workers' GPU). ``bash .ci/gpu`` runs these with the other CUDA paths.

The machines these ran on have one GPU: every proc of a mesh shares it, so the engine's collectives take
gloo there (NCCL refuses two ranks on one GPU); NCCL itself is checked on a group of one.
"""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from monarch_tensor import fetch_shard, inspect, remote, this_host
from monarch_tensor.actor import Actor, endpoint

pytestmark = [pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU on this machine"),
              pytest.mark.timeout(180)]


def _device_code(x: torch.Tensor) -> torch.Tensor:
    return torch.tensor(1 if x.is_cuda else 0, device=x.device)


device_code = remote(_device_code, propagate=lambda x: torch.tensor(0))


def _all_reduce_in_place(x: torch.Tensor, pg) -> torch.Tensor:
    y = x.clone()
    dist.all_reduce(y, group=pg)
    return y


all_reduce_in_place = remote(_all_reduce_in_place, propagate=lambda x, pg: x.clone())


def test_mesh_tensors_live_on_the_workers_gpu_and_come_back_on_the_cpu(procs):
    with procs.activate():
        x = torch.ones(4, device="cuda") * (procs.rank_tensor("gpus") + 1)
        y = torch.arange(6.0).reshape(2, 3).to("cuda") @ torch.ones(3, 2).cuda()
        codes = [int(inspect(device_code(t), gpus=1)) for t in (x, y, torch.zeros(2))]
        got = fetch_shard(x, gpus=1).result(timeout=60)
        got_y = fetch_shard(y, gpus=0).result(timeout=60)
    assert codes == [1, 1, 1]
    assert got.device.type == "cpu" and torch.equal(got, torch.full((4,), 2.0))
    assert torch.equal(got_y, torch.arange(6.0).reshape(2, 3) @ torch.ones(3, 2))


@pytest.mark.parametrize("reduction,want", [("sum", 3.0), ("avg", 1.5), ("max", 2.0), ("min", 1.0)])
def test_reduce_of_gpu_tensors_over_procs_sharing_one_gpu(procs, reduction, want):
    with procs.activate():
        x = torch.ones(5, device="cuda") * (procs.rank_tensor("gpus") + 1)
        r = x.reduce("gpus", reduction)
        code = int(inspect(device_code(r), gpus=0))
        got = fetch_shard(r, gpus=1).result(timeout=60)
    assert code == 1  # the result is back on the GPU, where its input was
    assert torch.allclose(got, torch.full((5,), want))


def test_stack_scatter_and_in_place_reduce_on_gpu(procs):
    with procs.activate():
        r = procs.rank_tensor("gpus")
        x = torch.arange(4.0, device="cuda") + 10 * r
        stacked = x.reduce("gpus", "stack")
        scattered = x.reduce("gpus", "sum", scatter=True)
        y = x.clone()
        y.reduce_("gpus", "sum")
        codes = [int(inspect(device_code(t), gpus=1)) for t in (stacked, scattered, y)]
        got_stack = fetch_shard(stacked, gpus=0).result(timeout=60)
        got_scatter = fetch_shard(scattered, gpus=1).result(timeout=60)
        got_y = fetch_shard(y, gpus=0).result(timeout=60)
    assert codes == [1, 1, 1]
    assert torch.equal(got_stack, torch.stack([torch.arange(4.0), torch.arange(4.0) + 10]))
    assert torch.equal(got_scatter, (2 * torch.arange(4.0) + 10)[2:])
    assert torch.equal(got_y, 2 * torch.arange(4.0) + 10)


def test_a_process_group_takes_gpu_tensors_in_user_code(procs):
    pg = procs.process_group("gpus")
    with procs.activate():
        x = torch.ones(3, device="cuda") * (procs.rank_tensor("gpus") + 1)
        got = fetch_shard(all_reduce_in_place(x, pg), gpus=0).result(timeout=60)
    assert torch.equal(got, torch.full((3,), 3.0))


def test_to_mesh_moves_gpu_tensors_between_meshes(procs):
    other = this_host().spawn_procs(per_host={"gpus": 2})
    try:
        with procs.activate():
            x = torch.arange(1 << 18, dtype=torch.float32, device="cuda") + procs.rank_tensor("gpus")
            moved = x.to_mesh(other)
        with other.activate():
            code = int(inspect(device_code(moved), gpus=1))
            got = fetch_shard(moved, gpus=1).result(timeout=60)
    finally:
        other.stop()
    assert code == 1
    assert torch.equal(got, torch.arange(1 << 18, dtype=torch.float32) + 1)


class Doubler(Actor):
    @endpoint
    def double(self, t: torch.Tensor) -> tuple[str, torch.Tensor]:
        return str(t.device), t * 2


@pytest.mark.parametrize("n", [16, 4 << 20])  # in the message; out of band on the data plane (16 MiB)
def test_actor_messages_carry_gpu_tensors_to_the_receivers_gpu(procs, n):
    actors = procs.spawn(f"doubler_{n}", Doubler)
    t = torch.arange(n, dtype=torch.float32, device="cuda")
    where, back = actors.slice(gpus=1).double.call_one(t).get(timeout=60)
    assert where.startswith("cuda")
    assert back.is_cuda and torch.equal(back, t * 2)


def test_nccl_on_a_group_of_one_and_shared_gpus_detected():
    from monarch_tensor.worker.collectives import gpus_distinct, is_nccl, new_group

    store = dist.HashStore()
    dev = torch.device("cuda", 0)
    pg = new_group(dist.PrefixStore("one/", store), 0, 1, dev, "127.0.0.1")
    assert is_nccl(pg)
    t = torch.ones(8, device=dev)
    opts = dist.AllreduceOptions()
    opts.reduceOp = dist.ReduceOp.SUM
    pg.allreduce([t], opts).wait(timedelta(seconds=60))
    torch.cuda.synchronize()
    assert torch.equal(t.cpu(), torch.ones(8))
    two = dist.PrefixStore("two/", store)
    two.set("gpu/1", str(torch.cuda.get_device_properties(dev).uuid))  # a second rank on this same GPU
    assert not gpus_distinct(two, 0, 2, dev)
    other = dist.PrefixStore("other/", store)
    other.set("gpu/1", "GPU-another")
    assert gpus_distinct(other, 0, 2, dev)
