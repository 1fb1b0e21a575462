"""Two hosts that are really separate on the network: host agents in their own network namespaces.

Each host is a network namespace with one address on a bridge; the controller (this process) stays in
the root namespace, on the bridge too. No host can reach another's loopback, so the agents' control
links, the procs' replies (the CURVE gateway), the tensor engine's rendezvous store and gloo's
connections all have to use routable addresses. Nor does a host see this process's ipc sockets: its
agent runs with a file system of its own over the socket directory. Needs root and iproute2 (CI has
both); skips otherwise.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch

from monarch_tensor import Replicate, Shard, distribute, fetch_shard
from monarch_tensor.actor import Actor, endpoint, this_host
from monarch_tensor.hosts.remote_hosts import attach_to_workers, shutdown_agents
from monarch_tensor.spmd import SPMDActor
from monarch_tensor.transport._curve import JobKeys
from monarch_tensor.transport._net import ip_towards
from monarch_tensor.transport.mailbox import socket_dir
from monarch_tensor.utils import setup_env_for_distributed

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TAG = f"{os.getpid() % 100000}"
NET = f"10.231.{os.getpid() % 250}"
BRIDGE = f"mtbr{TAG}"
HOSTS = [(f"mt{TAG}h{i}", f"mtv{TAG}{i}", f"{NET}.{i + 2}") for i in range(2)]  # (netns, veth, address)


def _ip(*args: str, netns: str | None = None) -> None:
    cmd = (["ip", "netns", "exec", netns, "ip"] if netns else ["ip"]) + list(args)
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    if r.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)}: {r.stderr.strip()}")


def _teardown_network() -> None:
    for ns, veth, _ in HOSTS:
        subprocess.run(["ip", "link", "del", veth], capture_output=True, timeout=30)
        subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)
    subprocess.run(["ip", "link", "del", BRIDGE], capture_output=True, timeout=30)


def _setup_network() -> str:
    """'' once the bridge and both hosts are up, else why not."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None:
        return "iproute2's ip is not installed"
    try:
        _ip("link", "add", BRIDGE, "type", "bridge")
        _ip("addr", "add", f"{NET}.1/24", "dev", BRIDGE)
        _ip("link", "set", BRIDGE, "up")
        for ns, veth, addr in HOSTS:
            _ip("netns", "add", ns)
            _ip("link", "add", veth, "type", "veth", "peer", "name", veth + "p")
            _ip("link", "set", veth + "p", "netns", ns)
            _ip("link", "set", veth, "master", BRIDGE)
            _ip("link", "set", veth, "up")
            _ip("addr", "add", f"{addr}/24", "dev", veth + "p", netns=ns)
            _ip("link", "set", veth + "p", "up", netns=ns)
            _ip("link", "set", "lo", "up", netns=ns)
    except (RuntimeError, OSError, subprocess.TimeoutExpired) as e:
        _teardown_network()
        return f"could not make network namespaces here: {e}"
    return ""


class Where(Actor):
    @endpoint
    def where(self, controller: str) -> str:
        """This proc's address on the route to the controller's side of the bridge."""
        return ip_towards(controller)

    @endpoint
    def echo(self, x):
        return x

    @endpoint
    def pid(self) -> int:
        return os.getpid()

    @endpoint
    def sees(self, path: str) -> bool:
        return os.path.exists(path)

    @endpoint
    def ask(self, other, x):
        """Call ``other`` (a one-proc mesh) from here: its pid, and ``x`` echoed."""
        return other.pid.call_one().get(timeout=60), other.echo.call_one(x).get(timeout=60)

    @endpoint
    def publish(self, n: int):
        from monarch_tensor.rdma import RDMABuffer

        self.data = torch.arange(n, dtype=torch.float32)
        return RDMABuffer(self.data.view(torch.uint8))

    @endpoint
    def pulled(self) -> tuple[int, int]:
        from monarch_tensor.rdma import payload, transfer_stats

        return payload.stats()["pulled"], transfer_stats()["tcp"]["reads"]


class Trainer(Actor):
    @endpoint
    def master(self) -> tuple[str, str]:
        return os.environ["MASTER_ADDR"], os.environ["RANK"]

    @endpoint
    def all_reduce(self) -> float:
        import datetime

        import torch.distributed as dist

        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
        try:
            t = torch.tensor([float(dist.get_rank() + 1)])
            dist.all_reduce(t)
            return t.item()
        finally:
            dist.destroy_process_group()


@pytest.fixture(scope="module")
def hosts(tmp_path_factory):
    why = _setup_network()
    if why:
        pytest.skip(why)
    tmp = tmp_path_factory.mktemp("netns")
    key = str(tmp / "job.key")
    JobKeys.generate().save(key)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))  # as a cluster's shared home
    env["MONARCH_TENSOR_RDMA_BACKEND"] = "tcp"  # one kernel underneath: make pulls take the path between machines
    agents, addrs = [], []
    try:
        for ns, _, addr in HOSTS:
            f = tmp / f"{ns}.addr"
            # ``ip netns exec`` runs it in a mount namespace of its own: a tmpfs there hides our sockets.
            agents.append(subprocess.Popen(
                ["ip", "netns", "exec", ns, "sh", "-c", 'mount -t tmpfs tmpfs "$0" && exec "$@"', socket_dir(),
                 sys.executable, "-m", "monarch_tensor.cli", "host", "--bind",
                 f"tcp://{addr}:0", "--key-file", key, "--address-file", str(f), "--ttl", "300"],
                cwd=str(tmp), env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE))
            deadline = time.monotonic() + 60
            while not (f.exists() and f.read_text().strip()):
                if agents[-1].poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"the agent in {ns} did not start: {agents[-1].stderr.read()[-2000:]}")
                time.sleep(0.05)
            addrs.append(f.read_text().strip())
        mesh = attach_to_workers(workers=addrs, key_file=key)
        yield mesh, addrs
        shutdown_agents(mesh._agents, "test over")
    finally:
        for p in agents:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in agents:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(timeout=10)
        _teardown_network()


@pytest.mark.timeout(240)
def test_actors_reduce_and_dtensors_across_network_namespaces(hosts):
    mesh, addrs = hosts
    assert [a.rpartition(":")[0] for a in addrs] == [f"tcp://{addr}" for _, _, addr in HOSTS]
    procs = mesh.spawn_procs(per_host={"gpus": 2})
    try:
        assert procs.sizes == {"hosts": 2, "gpus": 2}
        w = procs.spawn("where", Where)
        # Each proc runs inside its host's namespace: its route to us starts at its host's address.
        assert w.where.call(f"{NET}.1").get(timeout=120).values() == [HOSTS[0][2]] * 2 + [HOSTS[1][2]] * 2
        a = torch.arange(32.0).reshape(8, 4)
        with procs.activate():
            x = torch.ones(4) * (procs.rank("hosts") * 2 + procs.rank("gpus") + 1)
            total = x.reduce(("hosts", "gpus"), "sum")       # gloo across the bridge: 1+2+3+4
            across = x.reduce("hosts", "sum")               # hosts only: 1+3 on gpus=0
            got = fetch_shard(total, hosts=1, gpus=1).result(timeout=120)
            got_hosts = fetch_shard(across, hosts=0, gpus=0).result(timeout=60)
            dt = distribute(a, procs, [Shard(0), Replicate()])
            prod = (dt @ dt.T).full_tensor()
        assert torch.equal(got, torch.full((4,), 10.0))
        assert torch.equal(got_hosts, torch.full((4,), 4.0))
        assert torch.allclose(prod, a @ a.T)
    finally:
        procs.stop().get(timeout=60)


@pytest.mark.timeout(180)
def test_large_payloads_are_pulled_across_network_namespaces_over_tcp(hosts, monkeypatch):
    """The data servers are announced at each side's address on the route to the other: a 4 MiB argument
    is pulled by a proc from this process, and its echo by this process from the proc, both over tcp."""
    from monarch_tensor.rdma import payload

    mesh, _ = hosts
    monkeypatch.setenv("MONARCH_TENSOR_RDMA_BACKEND", "tcp")
    procs = mesh.spawn_procs(per_host={"gpus": 1})
    try:
        w = procs.spawn("echo", Where)
        x = torch.randn(1 << 20)
        before = payload.stats()["pulled"]
        y = w.slice(hosts=1, gpus=0).echo.call_one(x).get(timeout=120)
        assert torch.equal(x, y)
        assert payload.stats()["pulled"] == before + 1
        assert w.slice(hosts=1, gpus=0).pulled.call_one().get(timeout=60) == (1, 1)
        # A handle made by a proc names the proc's address on the route to whoever it was sent to.
        buf = w.slice(hosts=0, gpus=0).publish.call_one(1000).get(timeout=60)
        assert buf._desc.tcp[0] == HOSTS[0][2]
        out = torch.empty(1000)
        buf.read_into(out.view(torch.uint8), timeout=30).get(timeout=60)
        assert torch.equal(out, torch.arange(1000.0)) and buf.backend == "tcp"
    finally:
        procs.stop().get(timeout=60)


@pytest.mark.timeout(180)
def test_procs_behind_agents_and_this_hosts_procs_call_each_other(hosts):
    """A proc on another host calls a proc of this host (``this_host()``'s, whose ipc socket that host does
    not see: through the controller's gateway) and the other way round (with the job's key, which this
    process gave its own procs); each answers the other, and large arguments and results are pulled over
    the data plane both ways."""
    mesh, _ = hosts
    here = this_host().spawn_procs(per_host={"gpus": 1})
    there = mesh.spawn_procs(per_host={"gpus": 1})
    try:
        h = here.spawn("here", Where)
        t = there.spawn("there", Where).slice(hosts=1, gpus=0)
        assert not t.sees.call_one(here._procs[0].addr[len("ipc://"):]).get(timeout=60)  # another host
        small, big = torch.arange(10), torch.randn(1 << 20)  # big: 4 MiB, on the data plane
        h_pid, t_pid = h.pid.call_one().get(timeout=60), t.pid.call_one().get(timeout=60)
        for x in (small, big):
            pid, y = t.ask.call_one(h, x).get(timeout=120)
            assert pid == h_pid and torch.equal(y, x)
            pid, y = h.ask.call_one(t, x).get(timeout=120)
            assert pid == t_pid and torch.equal(y, x)
    finally:
        there.stop().get(timeout=60)
        here.stop().get(timeout=60)


@pytest.mark.timeout(180)
def test_setup_env_for_distributed_forms_a_process_group_across_network_namespaces(hosts):
    """Both hosts have this machine's name, which resolves to loopback on each: MASTER_ADDR is rank 0's address
    on the route to the other host (it was 127.0.0.1 on every rank, rank 0's host having this machine's name,
    and the store never formed). gloo binds to what the host's name resolves to, so each proc is told its
    interface, as torch's warning says to."""
    mesh, _ = hosts
    procs = mesh.spawn_procs(per_host={"gpus": 1})
    try:
        t = procs.spawn("trainer", Trainer)
        procs.env.set("GLOO_SOCKET_IFNAME", [veth + "p" for _, veth, _ in HOSTS]).get(timeout=60)
        for use_ipaddr in (None, True):
            setup_env_for_distributed(procs, use_ipaddr=use_ipaddr)
            assert t.master.call().get(timeout=60).values() == [(HOSTS[0][2], "0"), (HOSTS[0][2], "1")]
        assert t.all_reduce.call().get(timeout=120).values() == [3.0, 3.0]  # 1 + 2, across the bridge
        setup_env_for_distributed(procs.slice(hosts=1))  # all on one host: loopback
        assert t.slice(hosts=1).master.call_one().get(timeout=60) == ("127.0.0.1", "0")
        spmd = procs.spawn("spmd", SPMDActor).slice(hosts=0, gpus=0)
        assert spmd.get_host_port.call_one(True).get(timeout=60)[0] == HOSTS[0][2]
    finally:
        procs.stop().get(timeout=60)
