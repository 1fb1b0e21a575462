"""Host agents and LocalJob on real processes: spawn, call, broadcast tree, faults, reattach, keys.

One LocalJob of two agents serves most tests (module fixture); the fault tests
that kill an agent start their own.
"""

import json
import os
import pickle
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import zmq

import monarch_tensor.actor as actor_mod
from monarch_tensor.actor import Actor, SupervisionError, context, endpoint, this_host
from monarch_tensor.errors import AddressInUseError, HostUnreachableError, JobKeyError, JobStartError, MeshStoppedError
from monarch_tensor.hosts.agent import HostAgent
from monarch_tensor.hosts.agent_messages import REPORTS, REQUESTS, OpenSession, ReportSpawnedTree, SpawnProcs, SpawnTree
from monarch_tensor.hosts.remote_hosts import AgentClient, attach_to_workers
from monarch_tensor.job import HostListJob, LocalJob, job_load, job_loads
from monarch_tensor.transport import _curve, _fanout, _wire

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class Where(Actor):
    def __init__(self) -> None:
        self.seen = []

    @endpoint
    def where(self):
        return context().actor_instance.rank.rank, os.getcwd(), os.getpid()  # its rank in the mesh spawned

    @endpoint
    def note(self, x) -> None:
        self.seen.append(x)

    @endpoint
    def notes(self):
        return list(self.seen)

    @endpoint
    def pid_of(self, other) -> int:
        """Call a one-proc actor mesh from this proc: its pid."""
        return other.where.call_one().get(timeout=30)[2]

    @endpoint
    def pids_of(self, other) -> list:
        """Call a whole actor mesh from this proc: its pids, sorted."""
        return sorted(p for _, _, p in other.where.call().get(timeout=30).values())

    @endpoint
    def ask(self, other, rank: int):
        """Call another actor mesh from this proc (proc -> proc across agents, reply back to this proc)."""
        return other.slice(hosts=rank // 2, gpus=rank % 2).where.call_one().get(timeout=30)[0]


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    """Two hosts for the tests, and a spare one for the test that kills its agent."""
    old = os.environ.get("MONARCH_TENSOR_SESSION_TIMEOUT")
    os.environ["MONARCH_TENSOR_SESSION_TIMEOUT"] = "3"  # the agents drop a dead controller's procs after 3 s
    try:
        j = LocalJob(meshes={"mesh0": 2, "spare": 1}, root_dir=str(tmp_path_factory.mktemp("job")), ttl=120)
        j.state()
    finally:
        if old is None:
            del os.environ["MONARCH_TENSOR_SESSION_TIMEOUT"]
        else:
            os.environ["MONARCH_TENSOR_SESSION_TIMEOUT"] = old
    yield j
    j.kill()


# ---- meshes on agents ---------------------------------------------------------------------
@pytest.mark.timeout(180)
def test_spawn_procs_on_every_host_and_call_them(job):
    hosts = job.state().mesh0
    assert hosts.sizes == {"hosts": 2}
    procs = hosts.spawn_procs(per_host={"gpus": 2})
    assert procs.sizes == {"hosts": 2, "gpus": 2}
    w = procs.spawn("w", Where)
    got = w.where.call().get(timeout=120).values()
    assert [r for r, _, _ in got] == [0, 1, 2, 3]
    # Each host's procs run in that host's own working directory.
    assert [d for _, d, _ in got] == [hosts.workdirs[0]] * 2 + [hosts.workdirs[1]] * 2
    assert hosts.workdirs[0] != hosts.workdirs[1]
    assert w.slice(hosts=1, gpus=0).where.call_one().get(timeout=30)[0] == 2
    # Proc -> proc across agents: the reply finds its way back to the asking proc.
    assert w.slice(hosts=0, gpus=0).ask.call_one(w, 3).get(timeout=30) == 3
    procs.stop().get(timeout=30)
    for _, _, pid in got:
        _wait_gone(pid)


@pytest.mark.timeout(180)
def test_host_meshes_slice_rename_and_split_like_other_meshes(job):
    hosts = job.state().mesh0
    assert hosts.size() == 2 and hosts.extent.labels == ["hosts"] and len(hosts) == 2
    assert hosts.initialized.get(timeout=5) is True
    one = hosts.slice(hosts=1)  # an int drops the dim, as on every mesh
    assert one.sizes == {} and one.workdirs == [hosts.workdirs[1]]
    procs = one.spawn_procs(per_host={"gpus": 2})
    assert procs.sizes == {"gpus": 2}
    assert procs.spawn("w", Where).where.call().get(timeout=60).values()[1][1] == hosts.workdirs[1]
    assert procs.host_mesh.workdirs == [hosts.workdirs[1]]
    dp = hosts.rename(hosts="dp")
    renamed = dp.spawn_procs(per_host={"gpus": 1})
    assert renamed.sizes == {"dp": 2, "gpus": 1}
    w = renamed.spawn("w", Where)
    assert [d for _, d, _ in w.where.call().get(timeout=60).values()] == hosts.workdirs
    assert renamed.slice(dp=1).host_mesh.workdirs == [hosts.workdirs[1]]
    assert renamed.host_mesh.workdirs == hosts.workdirs
    assert hosts.split(hosts=("racks", "nodes"), nodes=1).sizes == {"racks": 2, "nodes": 1}
    with pytest.raises(ValueError, match="'dp' dimension: the host mesh"):
        dp.spawn_procs(per_host={"dp": 2})
    with pytest.raises(TypeError, match="per_host must be a dict of dimension sizes"):
        dp.spawn_procs(per_host=2)
    one.stop().get(timeout=30)  # every proc mesh with procs on host 1 stops, the one across both hosts too
    with pytest.raises(MeshStoppedError):
        w.slice(dp=0).where.call_one().get(timeout=30)
    with pytest.raises(MeshStoppedError):
        procs.spawn("w2", Where)
    again = one.spawn_procs(per_host={"gpus": 1})  # the host itself stays usable
    assert again.spawn("w", Where).where.call_one().get(timeout=60)[1] == hosts.workdirs[1]
    again.stop()


@pytest.mark.timeout(120)
def test_heal_mesh_respawns_a_jobs_procs_on_the_same_hosts(job):
    from monarch_tensor import heal_mesh

    hosts = job.state().mesh0.rename(hosts="dp")
    # bootstrap runs on every proc of a job's hosts before spawn_procs returns, and again on healed procs
    # (and proc_bind binds each proc of every host, again on healed procs too)
    procs = hosts.spawn_procs(per_host={"gpus": 1},
                              bootstrap=lambda: os.environ.__setitem__("MT_TEST_BOOT", str(os.getpid())),
                              proc_bind=[{"cpus": "0"}])
    old = [pid for _, _, pid in procs.spawn("w", Where).where.call().get(timeout=60).values()]
    assert procs.execute(lambda: os.environ.get("MT_TEST_BOOT")).values() == [str(p) for p in old]
    assert procs.execute(lambda: sorted(os.sched_getaffinity(0))).values() == [[0], [0]]
    healed = heal_mesh(procs.slice(dp=1))
    assert healed.sizes == {"gpus": 1} and healed._alloc.sizes == {"dp": 2, "gpus": 1}
    rank, workdir, pid = healed.spawn("w", Where).where.call_one().get(timeout=60)
    assert rank == 0 and workdir == job.state().mesh0.workdirs[1] and pid not in old  # on host 1
    assert healed.execute(lambda: os.environ.get("MT_TEST_BOOT")).values() == [str(pid)]
    assert healed.execute(lambda: sorted(os.sched_getaffinity(0))).values() == [[0]]
    for p in old:
        _wait_gone(p)
    healed._alloc.stop()


class HostUser(Actor):
    @endpoint
    def spawn_on(self, hosts) -> list:
        procs = hosts.spawn_procs(per_host={"gpus": 1})
        try:
            return [d for _, d, _ in procs.spawn("w", Where).where.call().get(timeout=60).values()]
        finally:
            procs.stop().get(timeout=30)


@pytest.mark.timeout(180)
def test_a_host_mesh_handle_stops_its_own_procs_and_travels_to_actors(job):
    # Monarch's test_stop_only_drains_own_mesh_procs: each state() is a handle of its own, whose stop() stops
    # the procs spawned through it (and its slices), not another handle's on the same hosts.
    first, second = job.state().mesh0, job.state().mesh0
    mine = first.slice(hosts=slice(0, 2)).spawn_procs(per_host={"gpus": 1})
    theirs = second.spawn_procs(per_host={"gpus": 1})
    pids = theirs.execute(os.getpid).values()
    first.stop().get(timeout=30)
    with pytest.raises(MeshStoppedError):
        mine.execute(os.getpid)
    assert theirs.execute(os.getpid).values() == pids
    # Monarch's test_pickle: a job's host mesh pickles, so an actor can be given it and spawn there; an
    # unpickled one cannot shut the hosts down (test_shutdown_unpickled_host_mesh_throws_exception).
    user = theirs.slice(hosts=0).spawn("host_user", HostUser)
    assert user.spawn_on.call_one(second).get(timeout=120) == second.workdirs
    with pytest.raises(RuntimeError, match="only the process that holds the job"):
        pickle.loads(pickle.dumps(second)).shutdown()
    second.stop().get(timeout=30)
    with pytest.raises(MeshStoppedError):
        theirs.execute(os.getpid)


@pytest.mark.timeout(120)
def test_monarchs_local_job_forms_hosts_names_and_process_job_env(tmp_path):
    from monarch_tensor.job import ProcessJob

    named = LocalJob(hosts=["trainers", "gen"], root_dir=str(tmp_path / "a"), ttl=60)
    assert named.meshes == {"trainers": 1, "gen": 1} and LocalJob(["x"]).meshes == {"x": 1}
    j = ProcessJob({"m": 2}, {"MT_TEST_JOB_ENV": "from the job"}, root_dir=str(tmp_path / "b"), ttl=60)
    try:
        procs = j.state().m.spawn_procs(per_host={"gpus": 1})
        assert procs.execute(lambda: os.environ.get("MT_TEST_JOB_ENV")).values() == ["from the job"] * 2
        procs.stop()
    finally:
        j.kill()


@pytest.mark.timeout(120)
def test_leaving_async_with_a_host_mesh_shuts_its_hosts_down(tmp_path):
    import asyncio

    j = LocalJob(meshes={"m": 1}, root_dir=str(tmp_path / "j"), ttl=60)
    try:
        hosts = j.state().m

        async def use() -> list:
            async with hosts as h:
                procs = h.spawn_procs(per_host={"gpus": 2})
                got = await procs.spawn("w", Where).where.call()
            return procs, [pid for _, _, pid in got.values()]

        procs, pids = asyncio.run(use())
        for pid in pids:
            _wait_gone(pid)
        with pytest.raises(MeshStoppedError):
            procs.spawn("w2", Where)
        with pytest.raises(SupervisionError, match="was lost: shut down"):
            hosts.spawn_procs(per_host={"gpus": 1})
        assert j.active
    finally:
        j.kill()
    assert not j.active


@pytest.mark.timeout(120)
def test_tensor_engine_reduce_across_hosts(job):
    import torch

    from monarch_tensor import fetch_shard

    procs = job.state().mesh0.spawn_procs(per_host={"gpus": 1})
    with procs.activate():
        x = torch.ones(4) + procs.rank("hosts")
        y = x.reduce("hosts", "sum")
        got = fetch_shard(y, hosts=1, gpus=0).result(timeout=60)
    assert torch.equal(got, torch.full((4,), 3.0))
    procs.stop()


@pytest.mark.timeout(120)
def test_broadcast_goes_down_a_tree_and_reaches_every_proc_in_order(job, monkeypatch):
    monkeypatch.setattr(_fanout, "FANOUT", 1)  # a chain: controller -> agent 0 -> agent 1
    procs = job.state().mesh0.spawn_procs(per_host={"gpus": 2})
    w = procs.spawn("w", Where)
    w.initialized.get(timeout=60)
    for i in range(20):
        w.note.broadcast(i)
    assert w.notes.call().get(timeout=30).values() == [list(range(20))] * 4
    procs.stop().get(timeout=30)


@pytest.mark.timeout(120)
def test_spawn_broadcast_and_single_calls_reach_a_proc_in_the_order_sent(job, monkeypatch):
    """Spawns and single calls are sent one by one, broadcasts down the tree (a chain here): all take
    each agent's one path, so nothing overtakes (calls issued before any spawn ack included)."""
    monkeypatch.setattr(_fanout, "FANOUT", 1)
    procs = job.state().mesh0.spawn_procs(per_host={"gpus": 2})
    try:
        for i in range(5):
            w = procs.spawn(f"w{i}", Where)
            w.note.broadcast("first")
            got = w.where.call()                       # down the chain, issued before any spawn ack
            one = w.slice(hosts=1, gpus=1).notes.call_one()
            assert [r for r, _, _ in got.get(timeout=60).values()] == [0, 1, 2, 3]
            assert one.get(timeout=60) == ["first"]
    finally:
        procs.stop().get(timeout=30)


def test_tree_bounds_fan_out_gives_each_agent_one_path_and_covers_every_host():
    items = [(f"tcp://h{i}:1", [str(i)]) for i in range(100)]
    for a, _ in items:
        _fanout.register(a, "test-tree-key")
    for fanout in (1, 2, 3, 8):
        tree = _fanout.build_tree(items, fanout)
        seen, depth = [], 0
        stack = [(a, p, [a]) for a, p in tree]
        assert len(tree) <= fanout
        while stack:
            a, p, route = stack.pop()
            assert len(p["c"]) <= fanout
            if p["t"]:
                assert p["t"] == [a[len("tcp://h"):-len(":1")]]
                assert route == _fanout.path(a, fanout)  # the broadcast takes the agent's one path
            seen.append(a)
            depth = max(depth, len(route))
            stack += [(c, sp, route + [c]) for c, sp in p["c"]]
        assert sorted(seen) == sorted(a for a, _ in items)
        assert depth == _fanout.depth(100, fanout)
        if fanout == 8:
            assert depth <= 3  # 8 + 64 + 512 >= 100
    # A single message takes the same path, with a one-branch plan.
    first, frames = _fanout.routed_frames("tcp://h20:1", "ipc:///p", [b"payload"])
    assert first == _fanout.path("tcp://h20:1")[0] and frames[-1] == b"payload"
    with pytest.raises(ValueError, match="fan-out"):
        _fanout.build_tree(items, 0)
    # Another job's agent at one of these addresses (its port handed out again) is that job's root, not a
    # leaf of this tree whose agents route to it.
    _fanout.register("tcp://h99:1", "test-other-job-key")
    assert _fanout.path("tcp://h99:1", 1) == ["tcp://h99:1"]
    for a, _ in items:
        _fanout.forget(a)
    assert _fanout.path("tcp://h99:1", 1) == ["tcp://h99:1"]


# ---- faults -----------------------------------------------------------------------------------
@pytest.mark.timeout(180)
def test_killing_an_agent_fails_its_procs_with_a_supervision_error(job, faults):
    from monarch_tensor.hosts.remote_hosts import RemoteHostMesh

    st = job.state()
    hosts = RemoteHostMesh([st.mesh0._agents[0], st.spare._agents[0]])  # one healthy host, the spare
    procs = hosts.spawn_procs(per_host={"gpus": 1})
    w = procs.spawn("w", Where)
    w.where.call().get(timeout=120)
    os.kill(job.pids[2], signal.SIGKILL)  # the spare's agent
    t0 = time.monotonic()
    while not faults and time.monotonic() - t0 < 10:
        time.sleep(0.02)
    assert faults and isinstance(faults[0], SupervisionError)
    assert "host agent" in str(faults[0]) and "was lost" in str(faults[0])
    with pytest.raises(SupervisionError):
        w.slice(hosts=1).where.call_one().get(timeout=10)
    # The other host is unaffected.
    assert w.slice(hosts=0).where.call_one().get(timeout=10)[0] == 0
    from monarch_tensor import heal_mesh

    with pytest.raises(HostUnreachableError, match="are lost, and this mesh cannot move"):
        heal_mesh(procs)  # a lost host is not replaced
    # The lost agent's sockets are closed: nothing goes on reconnecting to the dead host (a socket left
    # retrying, with an unread monitor, once wedged every agent connection of this process).
    spare = st.spare._agents[0]
    t0 = time.monotonic()
    while not spare.sock.closed and time.monotonic() - t0 < 10:
        time.sleep(0.05)
    assert spare.sock.closed and spare.monitor.closed and spare.keep.closed
    procs.stop().get(timeout=30)


class Slow(Actor):
    @endpoint
    def slow(self) -> None:
        time.sleep(60)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("who", ["agent", "every process"])
def test_a_terminated_agent_says_so_in_its_procs_supervision_errors(tmp_path, who):
    """SIGTERM to the agent (``scancel``, a time limit: a scheduler signals every process of the job, its
    template and procs too) fails a pending call with an error that names the agent's end, not only the
    template's."""
    j = LocalJob(meshes={"m": 1}, root_dir=str(tmp_path), ttl=60)
    try:
        procs = j.state().m.spawn_procs(per_host={"gpus": 1})
        fut = procs.spawn("s", Slow).slow.call()
        agent = j.pids[0]
        family = [agent]
        if who == "every process":
            family += [int(p) for p in subprocess.run(["pgrep", "-P", str(agent)], capture_output=True,
                                                      text=True).stdout.split()]
        for pid in family:
            os.kill(pid, signal.SIGTERM)
        with pytest.raises(SupervisionError, match=f"host agent {j.addrs['m'][0]} was terminated"):
            fut.get(timeout=60)
    finally:
        j.kill()


@pytest.mark.timeout(180)
def test_sigkilled_controller_leaves_agents_serving_and_a_second_script_reattaches(job, tmp_path):
    path = str(tmp_path / "job.json")
    _dump_without_spare(job, path)
    assert os.stat(path).st_mode & 0o777 == 0o600
    script = textwrap.dedent(f"""
        import os, sys, time
        sys.path.insert(0, {ROOT!r})
        from monarch_tensor.job import job_load
        from tests.test_agents import Where
        procs = job_load({path!r}).state().mesh0.spawn_procs(per_host={{"gpus": 1}})
        w = procs.spawn("w", Where)
        print("PIDS", [p for _, _, p in w.where.call().get(timeout=120).values()], flush=True)
        MODE
    """)
    first = subprocess.Popen([sys.executable, "-c", script.replace("MODE", "time.sleep(300)")], cwd=ROOT,
                             stdout=subprocess.PIPE, text=True)
    line = first.stdout.readline()
    assert line.startswith("PIDS"), line
    pids = json.loads(line[4:])
    first.send_signal(signal.SIGKILL)
    first.wait(timeout=10)
    # Its procs go once its keep-alives stop; the agents stay.
    for pid in pids:
        _wait_gone(pid, timeout=30)
    second = subprocess.run([sys.executable, "-c", script.replace("MODE", "")], cwd=ROOT, capture_output=True,
                            text=True, timeout=120)
    assert second.returncode == 0, second.stderr
    assert second.stdout.startswith("PIDS")


@pytest.mark.timeout(60)
def test_address_in_use_is_a_clear_error(job):
    addr = job.addrs["mesh0"][0]
    with pytest.raises(AddressInUseError, match="already in use"):
        HostAgent(addr, job.keys)


@pytest.mark.parametrize("bind, why", [
    ("tcp://127.0.0.1:70000", "port of 1-65535"),  # (zmq wrapped it: 4464)
    ("tcp://127.0.0.1:abc", "port of 1-65535"),
    ("tcp://10.255.255.254:0", "cannot listen on .*HOST must be an address or name of this machine"),
    ("tcp://nosuchhost.invalid:0", "cannot listen on .*HOST must be an address or name of this machine"),
    ("ipc:///tmp/agent0", "an ipc:// agent address .* is not served; on one machine use tcp://127.0.0.1:PORT"),
    ("udp://127.0.0.1:0", "address is tcp://HOST:PORT, or Monarch's alias tcp://DIAL_HOST:PORT@tcp://BIND_HOST"),
    ("tcp://:5@tcp://127.0.0.1:0", "alias is tcp://DIAL_HOST:PORT@tcp://BIND_HOST:PORT, got the dial address"),
])
def test_a_bad_bind_address_is_a_clear_error(bind, why):
    # A raw zmq traceback before, or a port that silently wrapped.
    with pytest.raises(ValueError, match=why):
        HostAgent(bind, _curve.JobKeys.generate())


@pytest.mark.timeout(60)
def test_host_command_reports_address_in_use(job, tmp_path):
    key = str(tmp_path / "k")
    job.keys.save(key)
    r = subprocess.run([sys.executable, "-m", "monarch_tensor.cli", "host", "--bind", job.addrs["mesh0"][0],
                        "--key-file", key], cwd=ROOT, capture_output=True, text=True, timeout=50)
    assert r.returncode == 2
    assert "already in use" in r.stderr


@pytest.mark.timeout(60)
def test_unreachable_host_is_a_clear_error_in_bounded_time():
    keys = _curve.JobKeys.generate()
    with zmq.Context() as ctx, ctx.socket(zmq.ROUTER) as s:  # a free port nobody listens on afterwards
        port = s.bind_to_random_port("tcp://127.0.0.1")
    with pytest.raises(HostUnreachableError, match="no host agent reachable"):
        AgentClient(f"tcp://127.0.0.1:{port}", keys, timeout=1.5)


@pytest.mark.timeout(60)
def test_a_job_that_never_starts_is_a_clear_error(tmp_path):
    j = LocalJob(meshes={"m": 1}, root_dir=str(tmp_path / "j"), python_exe="/bin/false", start_timeout=20)
    with pytest.raises(JobStartError, match="exited with code 1"):
        j.state()


# ---- security ---------------------------------------------------------------------------------
class _Tripwire:
    """Unpickling this creates a file: proof that someone read a pickle."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


@pytest.mark.timeout(60)
def test_wrong_key_is_refused_with_a_clear_error(job):
    with pytest.raises(JobKeyError, match="refused this controller's key"):
        AgentClient(job.addrs["mesh0"][0], _curve.JobKeys.generate(), timeout=5)


@pytest.mark.timeout(60)
def test_an_address_that_is_no_host_agent_is_a_clear_error():
    """Some other TCP service (an HTTP server at a mistyped port) is no host agent, not a refused key; a
    port outside 1-65535 is refused before any wait."""
    import socket
    import threading

    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(8)

    def serve() -> None:
        while True:
            try:
                c, _ = srv.accept()
            except OSError:
                return
            c.sendall(b"HTTP/1.0 200 OK\r\n\r\nhello")
            c.close()

    threading.Thread(target=serve, daemon=True).start()
    try:
        with pytest.raises(HostUnreachableError, match=r"not a host agent \(protocol mismatch\)"):
            AgentClient(f"tcp://127.0.0.1:{srv.getsockname()[1]}", _curve.JobKeys.generate(), timeout=10)
    finally:
        srv.close()
    with pytest.raises(ValueError, match="PORT in 1-65535"):
        AgentClient("tcp://127.0.0.1:99999", _curve.JobKeys.generate(), timeout=30)


def _send_or_refused(sock: zmq.Socket, frames: list) -> None:
    """Send, unless the server has already dropped the connection (a failed CURVE handshake leaves a
    DEALER with no peer to queue for: its send would block until the next reconnect, forever)."""
    sock.setsockopt(zmq.SNDTIMEO, 2000)
    try:
        sock.send_multipart(frames)
    except zmq.Again:
        pass  # refused before a byte of it could reach the server: nothing to read


@pytest.mark.timeout(60)
@pytest.mark.parametrize("client", ["plain", "wrong key", "right server key, own client key"])
def test_unauthenticated_clients_cannot_make_an_agent_read_anything(job, tmp_path, client):
    marker = tmp_path / "unpickled"
    addr = job.addrs["mesh0"][0]
    ctx = zmq.Context()
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    if client == "wrong key":
        _curve.connect_curve(s, _curve.JobKeys.generate())
    elif client == "right server key, own client key":
        mine = _curve.JobKeys.generate()
        s.setsockopt(zmq.CURVE_SERVERKEY, job.keys.public.encode())
        s.setsockopt(zmq.CURVE_PUBLICKEY, mine.public.encode())
        s.setsockopt(zmq.CURVE_SECRETKEY, mine.secret.encode())
    s.connect(addr)
    # A request, a relayed message for proc 1, and a tree broadcast: each carries the tripwire.
    evil = pickle.dumps((1, _Tripwire(str(marker))))
    _send_or_refused(s, [_wire._HEADER.pack(_wire.MAGIC, 0) + evil])
    _send_or_refused(s, [b"MTRT1", _wire._HEADER.pack(_wire.MAGIC, 0) + evil])
    _send_or_refused(s, [_fanout.TREE_MAGIC + b'{"t": ["1", "2"], "c": []}', _wire._HEADER.pack(_wire.MAGIC, 0) + evil])
    assert not s.poll(1500), "an unauthenticated client got an answer"
    s.close()
    ctx.term()
    assert not marker.exists()
    # The agent still serves its job.
    a = AgentClient(addr, job.keys, timeout=10)
    assert a.request(OpenSession("probe")).addr == addr
    a.close()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("client", ["plain", "wrong key"])
def test_unauthenticated_clients_cannot_make_the_controller_read_anything(job, tmp_path, client):
    from monarch_tensor.hosts import remote_hosts
    from monarch_tensor.transport.mailbox import socket_dir

    gateway = remote_hosts._gateway_for(job.keys, job.addrs["mesh0"][0])
    marker = tmp_path / "unpickled"
    ctx = zmq.Context()
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    if client == "wrong key":
        _curve.connect_curve(s, _curve.JobKeys.generate())
    s.connect(gateway.addr)
    _send_or_refused(s, [_wire._HEADER.pack(_wire.MAGIC, 0) + pickle.dumps(_Tripwire(str(marker)))])
    time.sleep(1.0)
    s.close()
    ctx.term()
    assert not marker.exists()
    # Procs listen on ipc only, in a directory nobody else can enter.
    assert os.stat(socket_dir()).st_mode & 0o777 == 0o700


@pytest.mark.timeout(180)
def test_this_hosts_procs_and_a_jobs_procs_call_each_other_whichever_was_spawned_first(tmp_path):
    """``this_host()``'s procs reach a job's procs, and answer them, with the job's key: those spawned
    before the job was attached are given it then, those spawned after at their start. (The way from a
    job's procs to ours when their host does not see our sockets is tests/test_netns_hosts.py's.)"""
    before = this_host().spawn_procs(per_host={"gpus": 1})
    j = LocalJob(meshes={"m": 1}, root_dir=str(tmp_path), ttl=60)
    try:
        there = j.state().m.spawn_procs(per_host={"gpus": 1})
        after = this_host().spawn_procs(per_host={"gpus": 1})
        t = there.spawn("there", Where)
        t_pid = t.where.call_one().get(timeout=60)[2]
        for procs in (before, after):
            h = procs.spawn("here", Where)
            assert h.pid_of.call_one(t).get(timeout=60) == t_pid
            assert t.pid_of.call_one(h).get(timeout=60) == h.where.call_one().get(timeout=60)[2]
        after.stop().get(timeout=60)
    finally:
        before.stop().get(timeout=60)
        j.kill()


@pytest.mark.timeout(180)
def test_procs_of_two_jobs_call_each_other_through_the_controller(job, tmp_path):
    """Two jobs have two keys, and neither job's hosts get the other's: a proc reaches the other job's
    procs through this process's gateway, which sends on with that job's key; replies come back alike."""
    other = LocalJob(meshes={"m": 1}, root_dir=str(tmp_path), ttl=60)
    ours = job.state().mesh0.slice(hosts=0).spawn_procs(per_host={"gpus": 1})
    try:
        assert other.keys.public != job.keys.public
        theirs = other.state().m.spawn_procs(per_host={"gpus": 1})
        a, b = ours.spawn("a", Where), theirs.spawn("b", Where)
        a_pid, b_pid = a.where.call_one().get(timeout=60)[2], b.where.call_one().get(timeout=60)[2]
        assert a.pid_of.call_one(b).get(timeout=60) == b_pid
        assert b.pid_of.call_one(a).get(timeout=60) == a_pid
    finally:
        ours.stop().get(timeout=60)
        other.kill()


@pytest.mark.timeout(180)
def test_a_proc_calls_a_mesh_of_several_procs_of_another_job(job, tmp_path):
    """A call from a proc to several procs of another job's agent leaves it as one tree message for that
    agent; the controller's gateway passes it on down that job's tree, and every proc answers."""
    other = LocalJob(meshes={"m": 1}, root_dir=str(tmp_path), ttl=60)
    ours = job.state().mesh0.slice(hosts=0).spawn_procs(per_host={"gpus": 1})
    try:
        theirs = other.state().m.spawn_procs(per_host={"gpus": 2})
        a, b = ours.spawn("a", Where), theirs.spawn("b", Where)
        b_pids = sorted(p for _, _, p in b.where.call().get(timeout=60).values())
        assert a.pids_of.call_one(b).get(timeout=60) == b_pids
    finally:
        ours.stop().get(timeout=60)
        other.kill()


@pytest.mark.timeout(60)
def test_the_gateway_fails_a_call_it_cannot_pass_on(job):
    """A call the gateway drops (for no live proc of this process, or for an agent this process never
    attached to) fails its caller's reply port at once instead of leaving the caller waiting."""
    from monarch_tensor.hosts import remote_hosts
    from monarch_tensor.transport._ports import OneReply
    from monarch_tensor.transport.mailbox import current_mailbox, new_ipc_address
    from monarch_tensor.transport.messages import CallEndpoint

    gateway = remote_hosts._gateway_for(job.keys, job.addrs["mesh0"][0])
    ctx = zmq.Context()
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    _curve.connect_curve(s, job.keys)
    s.connect(gateway.addr)
    try:
        gone = new_ipc_address("gone")
        for route, first, why in [(gone, [], "not a live proc"),
                                  ("tcp://127.0.0.1:1", [_fanout.TREE_MAGIC + b'{"t": ["1", "2"], "c": []}'],
                                   "not behind a host agent this process attached to")]:
            handler = OneReply(gone, "a call through the gateway")
            call = _wire.encode(CallEndpoint("a", "where", (), {}, current_mailbox().open_port(handler)))
            s.send_multipart([_fanout.ROUTE_MAGIC + route.encode(), *first, *call])
            with pytest.raises(HostUnreachableError, match=why):
                handler.future.get(timeout=30)
    finally:
        s.close()
        ctx.term()


@pytest.mark.timeout(60)
def test_the_gateway_relays_only_to_this_processs_live_procs(job, monkeypatch):
    from monarch_tensor.hosts import remote_hosts
    from monarch_tensor.transport.mailbox import new_ipc_address
    from monarch_tensor.transport.messages import StopProc

    gateway = remote_hosts._gateway_for(job.keys, job.addrs["mesh0"][0])
    procs = this_host().spawn_procs(per_host={"gpus": 1})
    ctx = zmq.Context()
    stranger = ctx.socket(zmq.ROUTER)  # a socket of this user that is no proc of this process
    stranger.setsockopt(zmq.LINGER, 0)
    path = new_ipc_address("stranger")
    stranger.bind(path)
    # ... and an agent this process never attached to, which would admit this job's key (ours, here)
    monkeypatch.setattr(_curve, "_env_keys", [job.keys])
    fake_agent = ctx.socket(zmq.ROUTER)
    fake_agent.setsockopt(zmq.LINGER, 0)
    _curve.serve_curve(ctx, fake_agent, job.keys)
    fake_agent.bind("tcp://127.0.0.1:*")
    fake = fake_agent.getsockopt(zmq.LAST_ENDPOINT).decode()
    while fake in _curve.peers():  # (the port of an agent an earlier test attached to, free again: another one)
        fake_agent.unbind(fake)
        fake_agent.bind("tcp://127.0.0.1:*")
        fake = fake_agent.getsockopt(zmq.LAST_ENDPOINT).decode()
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    _curve.connect_curve(s, job.keys)
    s.connect(gateway.addr)
    try:
        stop = _wire.encode(StopProc("stopped through the gateway"))
        s.send_multipart([_fanout.ROUTE_MAGIC + path.encode(), *stop])
        s.send_multipart([_fanout.ROUTE_MAGIC + f"{fake}|1".encode(), *stop])
        assert not stranger.poll(1000), "the gateway relayed to a socket that is not one of our procs"
        assert not fake_agent.poll(500), "the gateway relayed to an agent this process never attached to"
        proc = procs._procs[0]
        s.send_multipart([_fanout.ROUTE_MAGIC + proc.addr.encode(), *stop])
        deadline = time.monotonic() + 30
        while proc.alive and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not proc.alive, "a live proc of ours got nothing through the gateway"
    finally:
        s.close()
        stranger.close()
        fake_agent.close()
        _curve.stop_serving(ctx)
        ctx.term()
        procs.stop().get(timeout=60)


def test_key_files_are_private_and_checked(tmp_path):
    keys = _curve.JobKeys.generate()
    path = str(tmp_path / "k")
    keys.save(path)
    assert os.stat(path).st_mode & 0o777 == 0o600
    assert _curve.JobKeys.load(path) == keys
    assert keys.secret not in repr(keys)
    os.chmod(path, 0o644)
    with pytest.raises(JobKeyError, match="readable by other users"):
        _curve.JobKeys.load(path)
    with pytest.raises(JobKeyError, match="does not belong"):
        _curve.JobKeys(keys.public, _curve.JobKeys.generate().secret).checked()
    with pytest.raises(JobKeyError, match="no key"):
        _curve.JobKeys.load(str(tmp_path / "missing"))


def test_attach_to_workers_needs_addresses_and_a_key(monkeypatch):
    for var in (_curve.ENV_PUBLIC, _curve.ENV_SECRET, _curve.ENV_KEY_FILE):
        monkeypatch.delenv(var, raising=False)
    with pytest.raises(ValueError, match="at least one"):
        attach_to_workers(workers=[])
    with pytest.raises(JobKeyError, match="needs the job's key"):
        attach_to_workers(workers=["tcp://127.0.0.1:1"])


@pytest.mark.timeout(120)
def test_a_jobs_hosts_run_procs_with_another_interpreter(job, tmp_path):
    from monarch_tensor import heal_mesh

    wrapper = tmp_path / "python-wrapped"  # an interpreter that marks its processes
    wrapper.write_text(f"#!/bin/sh\nMT_TEST_WRAPPED=yes exec {sys.executable} \"$@\"\n")
    wrapper.chmod(0o755)
    hosts = job.state().mesh0
    wrapped = hosts.with_python_executable(str(wrapper))
    procs = wrapped.spawn_procs({"gpus": 2})
    plain = hosts.spawn_procs({"gpus": 1})
    try:
        assert procs.execute(lambda: os.environ.get("MT_TEST_WRAPPED")).values() == ["yes"] * 4
        assert plain.execute(lambda: os.environ.get("MT_TEST_WRAPPED")).values() == [None, None]
        one = wrapped.slice(hosts=1).spawn_procs()  # a slice keeps it
        assert one.execute(lambda: os.environ.get("MT_TEST_WRAPPED")).values() == ["yes"]
        one.stop()
        healed = heal_mesh(procs)  # the new procs run it too
        assert healed.execute(lambda: os.environ.get("MT_TEST_WRAPPED")).values() == ["yes"] * 4
        healed.stop()
    finally:
        procs.stop()
        plain.stop()
    with pytest.raises(FileNotFoundError, match="no such executable on"):
        hosts.with_python_executable(str(tmp_path / "missing")).spawn_procs()
    with pytest.raises(ValueError, match="absolute path"):
        hosts.with_python_executable("venv/bin/python")
    with pytest.raises(TypeError, match="path of a Python interpreter"):
        hosts.with_python_executable(None)
    after = hosts.spawn_procs()  # the refused spawn left the hosts as they were
    assert after.execute(lambda: 1).values() == [1, 1]
    after.stop()


@pytest.mark.timeout(60)
def test_attach_to_workers_and_job_load_give_the_same_hosts(job, tmp_path):
    path = str(tmp_path / "job.json")
    _dump_without_spare(job, path)
    key = str(tmp_path / "k")
    job.keys.save(key)
    hosts = attach_to_workers(workers=job.addrs["mesh0"], key_file=key)
    listed = HostListJob({"m": job.addrs["mesh0"]}, key_file=key).state().m
    assert hosts.workdirs == listed.workdirs == job.state().mesh0.workdirs == job_load(path).state().mesh0.workdirs
    again = job_loads(json.dumps(_without_spare(json.loads(job.dumps()))).encode())
    assert again.active and job.active and type(again) is type(job)
    assert again.state().mesh0.workdirs == hosts.workdirs
    with pytest.raises(ValueError, match="not a monarch-tensor job file"):
        job_loads(b"{not json")
    with pytest.raises(TypeError, match="what job.dumps\\(\\) returned"):
        job_loads(None)
    procs = listed.slice(hosts=1).spawn_procs(per_host={"gpus": 1})
    assert procs.spawn("w", Where).where.call_one().get(timeout=60)[1] == listed.workdirs[1]
    procs.stop()
    with pytest.raises(ValueError, match="'hosts'"):
        hosts.spawn_procs(per_host={"hosts": 2})
    with pytest.raises(ValueError, match="asks for 5000 procs on each host, more than the limit of 1024"):
        hosts.spawn_procs(per_host={"gpus": 5000})


@pytest.mark.timeout(120)
def test_a_job_whose_agent_has_an_earlier_jobs_port_is_reached(tmp_path):
    """Two jobs in turn, each with its own key, whose agents the system gives the same port: the socket this
    process kept to the first agent holds the first job's key, which the second agent's CURVE handshake
    refuses. Calls to the second job's procs were dropped without a word (CI: "no reply ... within 60 s")."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))  # as LocalJob's agents get it
    for job in ("a", "b"):
        key, addr_file = str(tmp_path / f"key-{job}"), tmp_path / f"addr-{job}"
        _curve.JobKeys.generate().save(key)
        agent = subprocess.Popen([sys.executable, "-m", "monarch_tensor.cli", "host", "--bind",
                                  f"tcp://127.0.0.1:{port}", "--address-file", str(addr_file), "--ttl", "60",
                                  "--key-file", key], cwd=ROOT, env=env)
        try:
            deadline = time.monotonic() + 30
            while not (addr_file.exists() and addr_file.read_text().strip()):
                assert agent.poll() is None and time.monotonic() < deadline, "the agent did not start"
                time.sleep(0.05)
            hosts = attach_to_workers(workers=[f"tcp://127.0.0.1:{port}"], key_file=key)
            procs = hosts.spawn_procs()
            assert procs.spawn(f"where_{job}", Where).where.call_one().get(timeout=30)[2] == procs._procs[0].pid
            hosts.shutdown()
            agent.wait(timeout=30)
        finally:
            if agent.poll() is None:
                agent.kill()
                agent.wait(timeout=30)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("entry,auth", [("start_worker_loop_forever", "key"), ("run_worker_loop_until_shutdown", "key"),
                                        ("run_worker_loop_until_shutdown", "trust_all_connections")])
def test_monarchs_other_worker_loop_entry_points_serve_until_their_hosts_shut_down(tmp_path, entry, auth,
                                                                                   monkeypatch):
    from monarch_tensor.transport._curve import InsecureConnectionWarning, JobKeys

    key = str(tmp_path / "k")
    JobKeys.generate().save(key)
    # Monarch's explicit opt-out: no key on either side, ca="trust_all_connections" on both
    creds = f"key_file={key!r}" if auth == "key" else "ca='trust_all_connections'"
    if auth != "key":
        for var in (_curve.ENV_PUBLIC, _curve.ENV_SECRET, _curve.ENV_KEY_FILE):
            monkeypatch.delenv(var, raising=False)
    addr_file = str(tmp_path / "addr")
    # (the opt-out's agent binds Monarch's alias form: listen on every interface, named by 127.0.0.1)
    bind = "tcp://127.0.0.1:0" if auth == "key" else "tcp://127.0.0.1:0@tcp://0.0.0.0:0"
    body = (f"fut = start_worker_loop_forever(address='tcp://127.0.0.1:0', {creds}, "
            f"address_file={addr_file!r})\nprint('started', flush=True)\nfut.get(timeout=100)"
            if entry == "start_worker_loop_forever" else
            f"run_worker_loop_until_shutdown(address={bind!r}, {creds}, "
            f"address_file={addr_file!r})")
    script = f"import sys\nsys.path.insert(0, {ROOT!r})\nfrom monarch_tensor.actor import {entry}\n{body}\n" \
             f"print('returned', flush=True)\n"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))  # as LocalJob's agents get it
    p = subprocess.Popen([sys.executable, "-c", script], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while not (os.path.exists(addr_file) and open(addr_file).read().strip()):
            assert p.poll() is None and time.monotonic() < deadline, p.stderr.read() if p.poll() is not None else ""
            time.sleep(0.05)
        addr = open(addr_file).read().strip()
        if auth == "key":
            hosts = attach_to_workers(workers=[addr], key_file=key)
        else:
            with pytest.raises(JobKeyError, match="trust_all_connections"):  # still refused without the opt-out
                attach_to_workers(workers=[addr])
            assert addr.startswith("tcp://127.0.0.1:")  # the alias's dial address, with the port it bound
            with pytest.warns(InsecureConnectionWarning, match="accept any peer"):  # (a ProcAddr's alias dials left)
                hosts = attach_to_workers(workers=[f"service<x>@{addr}@tcp://0.0.0.0:1"], ca="trust_all_connections")
        procs = hosts.spawn_procs(per_host={"gpus": 1})
        assert procs.spawn("w", Where).where.call_one().get(timeout=60)[0] == 0
        hosts.shutdown()
        out, err = p.communicate(timeout=60)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    assert p.returncode == 0, err
    assert out.splitlines()[-1] == "returned"  # it came back (run_worker_loop_forever would end the process)
    assert ("InsecureConnectionWarning" in err) == (auth != "key")  # the agent said so too


# ---- the protocol ------------------------------------------------------------------------------
@pytest.mark.parametrize("cls", REQUESTS + REPORTS)
def test_agent_messages_round_trip_and_have_handlers(cls):
    import dataclasses

    from monarch_tensor.transport.messages import PortRef

    values = {"session": "s", "ranks": (0, 1), "envs": ({}, {}), "client_addr": "ipc:///x", "gateway": "tcp://a:1",
              "events": PortRef("ipc:///x", 3), "pids": (5,), "sig": 9, "reason": "r", "hostname": "h",
              "addr": "tcp://a:1", "pid": 7, "workdir": "/w", "gpus": 0, "procs": 1, "addrs": ("a",),
              "status": "exited with code 0", "python_exe": "/opt/venv/bin/python", "spawn_id": "3f2a",
              "agent": "tcp://a:1", "below": (), "timeout": 60.0, "reply_to": ("tcp://b:1", 4), "tid": 4,
              "results": (("tcp://a:1", None, ValueError("no")),)}
    values["spawn"] = SpawnProcs(*(values[f.name] for f in dataclasses.fields(SpawnProcs)))
    values["below"] = (("tcp://c:1", SpawnTree("s", "tcp://c:1", values["spawn"], (), 58.0)),)
    msg = cls(**{f.name: values[f.name] for f in dataclasses.fields(cls)})
    if cls is ReportSpawnedTree:  # (an exception compares by identity)
        assert repr(_wire.decode(_wire.encode(msg))) == repr(msg)
    else:
        assert _wire.decode(_wire.encode(msg)) == msg
    assert cls.__doc__
    if cls in REQUESTS:
        assert hasattr(HostAgent, f"handle_{cls.__name__}")


def _without_spare(data: dict) -> dict:
    """A job file's data without the spare host (a test kills its agent): its mesh, address and agent's pid
    (a LocalJob runs while every agent of its file does)."""
    del data["meshes"]["spare"], data["addrs"]["spare"]
    spare = data["pids"].pop()  # (the last mesh's: pids are in mesh order)
    data["starts"].pop(str(spare), None)
    return data


def _dump_without_spare(job, path: str) -> None:
    """The job file, without the spare host."""
    job.dump(path)
    _curve.write_private(path, json.dumps(_without_spare(json.loads(open(path).read()))))


def _wait_gone(pid: int, timeout: float = 15) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/status") as f:
                if any(ln.startswith("State:") and "Z" in ln for ln in f):
                    return
        except (FileNotFoundError, ProcessLookupError):  # (gone before, or while, its status was read)
            return
        time.sleep(0.05)
    raise AssertionError(f"proc {pid} still alive after {timeout} s")


@pytest.mark.timeout(120)
def test_kill_removes_the_directory_the_job_made_and_the_key_of_one_it_was_given(tmp_path):
    made = LocalJob(meshes={"m": 1}, ttl=60)  # its own temporary directory, with the job's secret key
    given = LocalJob(meshes={"m": 1}, root_dir=str(tmp_path / "given"), ttl=60)
    try:
        made.state()
        given.state()
        root = made.root_dir
        assert os.path.exists(os.path.join(root, "job.key"))
    finally:
        made.kill()
        given.kill()
    assert not os.path.exists(root)
    assert not os.path.exists(tmp_path / "given" / "job.key") and os.path.exists(tmp_path / "given" / "m-0.log")


UNRECORDED_JOB_SCRIPT = textwrap.dedent("""
    import json, sys
    sys.path.insert(0, {root!r})
    from monarch_tensor.job import LocalJob
    from tests.test_agents import Where
    job = LocalJob(meshes={{"m": 1}}, ttl=60)
    procs = job.state(cached_path=None).m.spawn_procs(per_host={{"gpus": 1}})
    procs.spawn("w", Where).where.call().get(timeout=60)
    if {dump!r}:
        job.dump({dump!r})
    print("JOB", json.dumps({{"pids": job.pids, "root": job.root_dir}}), flush=True)
""")


@pytest.mark.timeout(120)
def test_a_local_job_no_file_names_ends_with_the_script_that_started_it(tmp_path):
    # Its agents ran on until their ttl with the job's directory and key, though nothing could reattach
    # to them: each run of such a script left another set. One that a job file names runs on.
    from monarch_tensor.job.local import _alive

    def run(dump: str) -> dict:
        r = subprocess.run([sys.executable, "-c", UNRECORDED_JOB_SCRIPT.format(root=ROOT, dump=dump)], cwd=tmp_path,
                           capture_output=True, text=True, timeout=90)
        assert r.returncode == 0 and "JOB" in r.stdout, r.stdout + r.stderr
        return json.loads(r.stdout.split("JOB", 1)[1])

    ended = run("")
    for pid in ended["pids"]:
        _wait_gone(pid, timeout=10)
    assert not os.path.exists(ended["root"])
    path = str(tmp_path / "job.json")
    kept = run(path)
    try:
        assert all(_alive(pid) for pid in kept["pids"])
        assert os.path.exists(os.path.join(kept["root"], "job.key"))
    finally:
        job_load(path).kill()


@pytest.mark.timeout(120)
def test_an_agent_that_dies_while_it_handles_a_request_fails_it(tmp_path, monkeypatch):
    # The request waited for its answer until its own timeout (60 s for a spawn), then blamed the network,
    # though the watcher had found the agent lost seconds before.
    import threading

    monkeypatch.setattr(actor_mod, "unhandled_fault_hook", lambda failure: None)
    job = LocalJob(meshes={"m": 1}, root_dir=str(tmp_path / "j"), ttl=60)
    try:
        hosts = job.state().m
        pid = job.pids[0]
        os.kill(pid, signal.SIGSTOP)  # it takes the request and never answers...
        killer = threading.Timer(2.0, os.kill, (pid, signal.SIGKILL))  # ...then dies
        killer.start()
        with pytest.raises(SupervisionError, match="was lost while it handled SpawnTree"):
            hosts.spawn_procs(per_host={"gpus": 1})
        killer.join()
    finally:
        job.kill()


@pytest.mark.timeout(25)  # (kill() waited 30 s to connect to the dead agent, and then shut down none)
def test_kill_of_a_loaded_job_with_a_dead_agent_shuts_down_the_rest_at_once(tmp_path):
    job = LocalJob(meshes={"m": 2}, root_dir=str(tmp_path / "j"), ttl=60)
    job.state(cached_path=None)
    path = str(tmp_path / "job.json")
    job.dump(path)
    dead, live = job.pids
    os.kill(dead, signal.SIGKILL)
    os.waitpid(dead, 0)
    job_load(path).kill()
    _wait_gone(live, timeout=10)


@pytest.mark.timeout(60)
def test_state_of_a_loaded_job_whose_agents_exited_says_so(tmp_path):
    job = LocalJob(meshes={"m": 1}, root_dir=str(tmp_path / "j"), ttl=60)
    job.state(cached_path=None)
    path = str(tmp_path / "job.json")
    job.dump(path)
    os.kill(job.pids[0], signal.SIGKILL)
    os.waitpid(job.pids[0], 0)
    with pytest.raises(HostUnreachableError, match="allocation no longer runs .its host agents exited"):
        job_load(path).state()  # (it waited 30 s for the agent, then blamed the network)


def test_a_log_tail_keeps_the_agents_own_errors(tmp_path):
    # A scheduler's lines after an agent's error pushed it out of the tail that errors quote.
    from monarch_tensor.job._base import log_tail

    log = tmp_path / "job.out"
    log.write_text("monarch-tensor host agent 7 serving on tcp://h:1\n"
                   "monarch-tensor host: cannot listen on tcp://0.0.0.0:2: the address is already in use\n"
                   + "srun: error: some scheduler noise\n" * 30)
    tail = log_tail(str(log))
    assert tail.startswith("monarch-tensor host: cannot listen on tcp://0.0.0.0:2")
    assert tail.count("srun: error") == 15 and "serving on" not in tail
    assert log_tail(str(tmp_path / "none")) == "(no log)"
