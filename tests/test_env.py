"""proc_mesh.env (get/set/list/mismatches) and torchrun's environment for torch.distributed in actors."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import textwrap

import pytest

from monarch_tensor.actor import Actor, ActorError, endpoint, this_host
from monarch_tensor.spmd import SPMDActor, _master_addr, _towards, elastic_env, setup_torch_elastic_env
from monarch_tensor.utils import setup_env_for_distributed

pytestmark = pytest.mark.timeout(120)
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
THP = os.path.isdir("/sys/kernel/mm/transparent_hugepage")  # a kernel built with transparent huge pages


def vm_flags(addr: int) -> list[str]:
    """The flags (``VmFlags`` of /proc/self/smaps) of this process's mapping that holds ``addr``."""
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split(maxsplit=1)[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= addr < hi
            elif inside and head == "VmFlags:":
                return line.split()[1:]
    raise LookupError(f"no mapping holds {addr:#x}")


class Tensors(Actor):
    @endpoint
    def huge_page_advice(self, nbytes: int) -> tuple:
        """PyTorch's THP switch here, and whether a fresh tensor of ``nbytes`` got MADV_HUGEPAGE (``hg``)."""
        import torch

        t = torch.ones(nbytes, dtype=torch.uint8)
        return os.environ.get("THP_MEM_ALLOC_ENABLE"), "hg" in vm_flags(t.data_ptr())


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


def test_the_master_is_on_loopback_only_when_every_proc_is_on_rank_0s_host():
    # Rank 0 on this machine's host name gave every rank 127.0.0.1, even ranks on other hosts.
    a, b = "tcp://10.0.0.2:26600", "tcp://10.0.0.3:26600"
    assert _towards(["ipc:///tmp/p0", "ipc:///tmp/p1"]) is None  # this machine's procs
    assert _towards([f"{a}|1", f"{a}|2"]) is None  # one host agent's
    assert _towards([f"{a}|1", f"{a}|2", f"{b}|3"]) == b  # rank 0 finds its route to the other host
    assert _towards(["ipc:///tmp/p0", f"{b}|3"]) == b
    assert _towards(["tcp://127.0.0.1:26600|1", "ipc:///tmp/p1"]) == "127.0.0.1"  # this machine, seen from there
    assert _master_addr(None, "vm", None) == "127.0.0.1"
    assert _master_addr(b, "vm", "10.0.0.2") == "10.0.0.2"  # not the name: it may resolve to loopback
    assert _master_addr(b, "vm", "0.0.0.0") == "vm"  # no route found there: the name, for the others to resolve


def test_init_process_group_in_actors(procs):
    assert setup_env_for_distributed(procs).done()  # a plain call returns once the variables are set

    async def seed_form():  # seed 002's: Monarch's is async
        await setup_env_for_distributed(procs, use_ipaddr=True)

    asyncio.run(seed_form())
    env = procs.env.list("MASTER_").get(timeout=30).values()
    assert len({(e["MASTER_ADDR"], e["MASTER_PORT"]) for e in env}) == 1
    results = procs.spawn("spmd", SPMD).main.call().get(timeout=90).values()
    assert results == [(10.0, r % 2, 2, 4) for r in range(4)]  # 1+2+3+4 on every rank


@pytest.mark.timeout(180)
def test_spmd_actor_runs_a_torchrun_style_script_and_module(procs, tmp_path):
    script = os.path.join(ROOT, "tests", "_spmd_train.py")
    spmd = procs.spawn("spmd_actor", SPMDActor)
    addr, port = spmd.slice(hosts=0, gpus=0).get_host_port.call_one(None).get(timeout=30)
    assert isinstance(addr, str) and 0 < port < 65536
    assert spmd.main.call(addr, port, [script, str(tmp_path), "path"]).get(timeout=120).values() == [True] * 4
    addr, port = spmd.slice(hosts=0, gpus=0).get_host_port.call_one(True).get(timeout=30)
    done = spmd.main.call(addr, port, ["-m", "tests._spmd_train", str(tmp_path), "module"]).get(timeout=120)
    assert done.values() == [True] * 4
    for tag in ("path", "module"):  # (under -m, as `python -m`, sys.argv[0] becomes the module's file)
        got = [(tmp_path / f"{tag}-rank{r}").read_text().split() for r in range(4)]
        assert got == [["10.0", str(r % 2), "4", script] for r in range(4)], tag  # 1+2+3+4 everywhere
    one = spmd.slice(hosts=1, gpus=1)
    with pytest.raises(ActorError, match="needs a script path or '-m module'"):
        one.main.call_one(addr, port, []).get(timeout=30)
    with pytest.raises(ActorError, match="no script '/nonexistent.py' on this proc"):
        one.main.call_one(addr, port, ["/nonexistent.py"]).get(timeout=30)
    for args in (script, ["-m", 5]):  # a str was split into one-character arguments: "no script '/'"
        with pytest.raises(ActorError, match="script_args must be a list of strings"):
            one.main.call_one(addr, port, args).get(timeout=30)
    with pytest.raises(ActorError, match="master_port must be an int"):
        one.setup_env.call_one(addr, "29500").get(timeout=30)
    exits = tmp_path / "exits.py"  # sys.exit(0) ends a script well, as under torchrun; another code does not
    exits.write_text("import sys\nsys.exit(int(sys.argv[1]) or None if sys.argv[1] != 'zero' else 0)\n")
    for code in ("zero", "0"):
        assert one.main.call_one(addr, port, [str(exits), code]).get(timeout=30) is True
    with pytest.raises(ActorError, match="exits.py exited with 3"):
        one.main.call_one(addr, port, [str(exits), "3"]).get(timeout=30)


@pytest.mark.skipif(not THP, reason="this kernel has no transparent huge pages")
def test_procs_allocate_large_tensors_on_huge_pages(procs):
    # The data plane's cma backend moves a proc's tensors about twice as fast from 2 MiB pages.
    t = procs.slice(hosts=0, gpus=0).spawn("tensors", Tensors)
    assert t.huge_page_advice.call_one(8 << 20).get(timeout=60) == ("1", True)
    assert t.huge_page_advice.call_one(1 << 20).get(timeout=60) == ("1", False)  # under PyTorch's 2 MiB


@pytest.mark.skipif(not THP, reason="this kernel has no transparent huge pages")
@pytest.mark.timeout(180)
def test_a_scripts_own_huge_page_setting_is_kept():
    script = textwrap.dedent("""
        import torch
        from monarch_tensor.actor import this_host
        from tests.test_env import Tensors
        procs = this_host().spawn_procs(per_host={"gpus": 1})
        print("ADVICE", procs.spawn("tensors", Tensors).huge_page_advice.call_one(8 << 20).get(timeout=60))
        procs.stop().get(timeout=60)
    """)
    r = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=150,
                       env={**os.environ, "THP_MEM_ALLOC_ENABLE": "0"})
    assert r.returncode == 0, r.stderr
    assert "ADVICE ('0', False)" in r.stdout, r.stdout + r.stderr
