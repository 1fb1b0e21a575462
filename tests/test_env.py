"""proc_mesh.env (get/set/list/mismatches) and torchrun's environment for torch.distributed in actors."""

from __future__ import annotations

import os

import pytest

from monarch_tensor.actor import Actor, endpoint, this_host
from monarch_tensor.spmd import elastic_env, setup_torch_elastic_env
from monarch_tensor.utils import setup_env_for_distributed

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def procs():
    mesh = this_host().spawn_procs(per_host={"hosts": 2, "gpus": 2})
    yield mesh
    mesh.stop()


def test_get_set_list_and_mismatches(procs):
    assert procs.env.get("MONARCH_TENSOR_RANK").get(timeout=30).values() == ["0", "1", "2", "3"]
    assert procs.env.get("MT_TEST_UNSET").get(timeout=30).values() == [None] * 4
    procs.env.set("NCCL_DEBUG", "INFO").get(timeout=30)
    procs.env.set("NCCL_SOCKET_IFNAME", "eth0").get(timeout=30)
    procs.env.set("NCCL_SOCKET_IFNAME", {3: "eth1"}).get(timeout=30)  # the odd host out
    listed = procs.env.list("NCCL_").get(timeout=30)
    assert listed.item(hosts=0, gpus=0) == {"NCCL_DEBUG": "INFO", "NCCL_SOCKET_IFNAME": "eth0"}
    assert listed.item(hosts=1, gpus=1)["NCCL_SOCKET_IFNAME"] == "eth1"
    diff = procs.env.mismatches("NCCL_").get(timeout=30)
    assert diff == {"NCCL_SOCKET_IFNAME": {"eth0": [0, 1, 2], "eth1": [3]}}
    assert str(diff) == "NCCL_SOCKET_IFNAME: 'eth0' on ranks [0, 1, 2]; 'eth1' on ranks [3]"
    procs.slice(hosts=0).env.set("NCCL_SOCKET_IFNAME", None).get(timeout=30)  # unset on a slice
    diff = procs.env.mismatches("NCCL_SOCKET").get(timeout=30)
    assert diff == {"NCCL_SOCKET_IFNAME": {None: [0, 1], "eth0": [2], "eth1": [3]}}
    procs.env.set("NCCL_SOCKET_IFNAME", None).get(timeout=30)
    assert str(procs.env.mismatches("NCCL_").get(timeout=30)) == "no differences"


def test_bad_env_input(procs):
    with pytest.raises(ValueError, match="bad environment variable name"):
        procs.env.get("1BAD")
    with pytest.raises(ValueError, match="needs 4 values"):
        procs.env.set("X", ["a"])
    with pytest.raises(ValueError, match="not in 0..3"):
        procs.env.set("X", {7: "a"})
    with pytest.raises(TypeError, match="must be str or None"):
        procs.env.set("X", 3)


def test_elastic_env_values():
    env = elastic_env({"hosts": 2, "gpus": 4}, 5, "h0", 29500)
    assert (env["RANK"], env["LOCAL_RANK"], env["WORLD_SIZE"], env["LOCAL_WORLD_SIZE"], env["GROUP_RANK"]) == \
        ("5", "1", "8", "4", "1")
    with pytest.raises(ValueError, match="both master_addr and master_port"):
        setup_torch_elastic_env(None, master_addr="h0")


def torchrun_style_main() -> float:
    """A training script's main as torchrun would run it: everything from the environment."""
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    t = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(t)
    out = (t.item(), int(os.environ["LOCAL_RANK"]), int(os.environ["LOCAL_WORLD_SIZE"]), dist.get_world_size())
    dist.destroy_process_group()
    return out


class SPMD(Actor):
    @endpoint
    def main(self):
        return torchrun_style_main()


def test_init_process_group_in_actors(procs):
    setup_env_for_distributed(procs)
    env = procs.env.list("MASTER_").get(timeout=30).values()
    assert len({(e["MASTER_ADDR"], e["MASTER_PORT"]) for e in env}) == 1
    results = procs.spawn("spmd", SPMD).main.call().get(timeout=90).values()
    assert results == [(10.0, r % 2, 2, 4) for r in range(4)]  # 1+2+3+4 on every rank
