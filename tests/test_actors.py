"""Actors on real procs: meshes, every endpoint adverb, ordering, channels, errors.

One proc mesh of shape {"hosts": 2, "gpus": 2} is shared by the module; each
test spawns its own actors on it (actor names are unique per test).
"""

from __future__ import annotations

import asyncio
import os
import sys
import threading
import time

import pytest

import monarch_tensor.actor as actor_mod
from monarch_tensor.actor import (
    Accumulator,
    Actor,
    ActorError,
    ActorMesh,
    Channel,
    Context,
    Future,
    Port,
    ProcMesh,
    ValueMesh,
    as_endpoint,
    concurrent_endpoint,
    context,
    current_actor_name,
    current_rank,
    current_size,
    endpoint,
    get_or_spawn_controller,
    proc_mesh,
    send,
    this_host,
    this_proc,
)
from monarch_tensor.errors import MeshStoppedError, SupervisionError

pytestmark = pytest.mark.timeout(60)

T = 30  # seconds any single reply may take on a loaded 2-core machine


# ---- actors ----------------------------------------------------------------------------------
def _own_rank() -> int:
    """The running actor's rank in the mesh it was spawned as (``current_rank()`` is the message's)."""
    return context().actor_instance.rank.rank


def _whoami() -> dict:
    r = current_rank()
    ctx = context()
    return {"rank": r.rank, "coords": dict(r), "name": ctx.actor_name, "sizes": current_size(),
            "ctx_rank": int(ctx.rank), "ctx_same": ctx.actor_instance.rank == r,
            "message_rank": (ctx.message_rank.rank, dict(ctx.message_rank)),
            "is_context": isinstance(ctx, Context), "pid": os.getpid()}


class Counter(Actor):
    def __init__(self, start: int = 0, *, step: int = 1) -> None:
        self.n = start
        self.step = step

    @endpoint
    def incr(self) -> int:
        self.n += self.step
        return self.n

    @endpoint
    async def aincr(self) -> int:
        await asyncio.sleep(0)
        self.n += self.step
        return self.n

    @endpoint
    def value(self) -> int:
        return self.n

    @endpoint
    def set(self, v: int) -> None:
        self.n = v

    @endpoint
    def pid(self) -> int:
        return os.getpid()

    @endpoint
    def who(self) -> dict:
        return _whoami()

    @endpoint
    async def awho(self) -> dict:
        await asyncio.sleep(0)
        return _whoami()

    @endpoint
    async def slow(self, seconds: float) -> float:
        await asyncio.sleep(seconds)
        return seconds

    @endpoint
    async def gated(self, gate: str) -> str:
        """Returns once the file ``gate`` exists (at most 60 s)."""
        for _ in range(6000):
            if os.path.exists(gate):
                return "open"
            await asyncio.sleep(0.01)
        return "never opened"

    def helper(self) -> None:
        """Not an endpoint."""

    def plain_add(self, k: int) -> dict:
        """Not an endpoint either: called through as_endpoint()."""
        self.n += k
        return {"n": self.n, "point": current_rank(), "name": current_actor_name()}

    async def aplain(self) -> int:
        await asyncio.sleep(0)
        return self.n

    def answer_via(self, port, v: int) -> None:
        port.send(v * 10 + current_rank().rank)

    @endpoint
    def log_something(self) -> tuple:
        self.logger.debug("debug from an actor")
        return self.logger.name, self.logger.getEffectiveLevel()


class Recorder(Actor):
    def __init__(self) -> None:
        self.seen: list[int] = []

    @endpoint
    def record(self, i: int) -> int:
        self.seen.append(i)
        return len(self.seen)

    @endpoint
    async def arecord(self, i: int) -> int:
        await asyncio.sleep(0)
        self.seen.append(i)
        return len(self.seen)

    @endpoint
    def log(self) -> list[int]:
        return self.seen


def _raise_deep(msg: str) -> None:
    raise ValueError(msg)


class Faulty(Actor):
    def __init__(self) -> None:
        self.calls = 0

    @endpoint
    def fail(self, msg: str) -> None:
        self.calls += 1
        _raise_deep(msg)

    @endpoint
    def fail_on(self, rank: int) -> int:
        if _own_rank() == rank:
            raise RuntimeError(f"rank {rank} fails on purpose")
        return _own_rank()

    @endpoint
    async def afail(self) -> None:
        await asyncio.sleep(0)
        raise KeyError("async-boom")

    @endpoint
    def local_exception(self) -> None:
        class NotImportable(Exception):
            pass

        raise NotImportable("defined inside the endpoint")

    @endpoint
    def unpicklable_result(self):
        return threading.Lock()

    @endpoint
    def calls_made(self) -> int:
        return self.calls


class BrokenInit(Actor):
    def __init__(self, bad_rank: int | None = None) -> None:
        if bad_rank is None or current_rank().rank == bad_rank:
            raise RuntimeError(f"constructor failed on rank {current_rank().rank}")

    @endpoint
    def ping(self) -> str:
        return "pong"


class Emitter(Actor):
    @endpoint
    def emit(self, port, n: int) -> int:
        for i in range(n):
            port.send((_own_rank(), i))
        return n

    @endpoint
    def emit_error(self, port) -> None:
        port.exception(ValueError("through the port"))


class PingPong(Actor):
    """Monarch's getting-started example: two actor meshes that call each other."""

    def __init__(self, label: str) -> None:
        self.label = label
        self.received: list[str] = []

    @endpoint
    async def init(self, other: ActorMesh) -> None:
        self.other = other
        self.pair = other.slice(**current_rank())
        self.identity = current_rank().rank

    @endpoint
    async def send(self, message: str) -> None:
        await self.pair.recv.call(f"{self.label}:{self.identity} {message}")

    @endpoint
    async def recv(self, message: str) -> None:
        self.received.append(message)

    @endpoint
    def received_msgs(self) -> list[str]:
        return self.received

    @endpoint
    def sync_relay(self, message: str, timeout: float = T):
        return self.pair.echo_back.call_one(message).get(timeout=timeout)

    @endpoint
    async def async_relay_all(self, message: str) -> list:
        vm = await self.other.echo_back.call(message)
        return vm.values()

    @endpoint
    def echo_back(self, message: str):
        return (self.label, current_rank().rank, message)


# ---- fixtures ------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def procs():
    mesh = this_host().spawn_procs({"hosts": 2, "gpus": 2})
    yield mesh
    mesh.stop().get(timeout=T)


@pytest.fixture(scope="module")
def counter(procs):
    c = procs.spawn("counter", Counter)
    c.initialized.get(timeout=T)
    return c


@pytest.fixture(scope="module")
def pids(counter) -> ValueMesh:
    return counter.pid.call().get(timeout=T)


# ---- making meshes ------------------------------------------------------------------------------
@pytest.mark.parametrize("make", [
    lambda: this_host().spawn_procs({"gpus": 2}),
    lambda: this_host().spawn_procs(per_host={"gpus": 2}),
    lambda: proc_mesh(gpus=2),
], ids=["positional", "per_host", "proc_mesh"])
def test_spawn_procs_forms(make):
    mesh = make()
    try:
        assert isinstance(mesh, ProcMesh)
        assert mesh.sizes == {"gpus": 2} and len(mesh) == 2 and mesh.size() == 2 and mesh.size("gpus") == 2
        c = mesh.spawn("c", Counter, 5, step=2)
        assert c.incr.call().get(timeout=T).values() == [7, 7]
        who = c.who.call().get(timeout=T)
        assert [w["rank"] for w in who.values()] == [0, 1]
        assert [w["coords"] for w in who.values()] == [{"gpus": 0}, {"gpus": 1}]
        assert len({w["pid"] for w in who.values()}) == 2
    finally:
        mesh.stop().get(timeout=T)


def test_spawn_procs_with_no_dims_and_async_with():
    # Monarch's per_host defaults to {}: one proc per host, with the hosts' extent ({} for this_host());
    # it made a {"procs": 1} mesh, whose item() then needed a coordinate. `async with procs:` stops them.
    async def main():
        async with this_host().spawn_procs() as mesh:
            assert mesh.extent == {} and len(mesh) == 1
            c = mesh.spawn("c", Counter, 5)
            assert (await c.value.call()).item() == 5 and await c.value.call_one() == 5
        return mesh

    mesh = asyncio.run(main())
    assert mesh._alloc._stopped and not any(p.alive for p in mesh._procs)


def test_proc_mesh_needs_a_dimension():
    with pytest.raises(ValueError, match="dimension"):
        proc_mesh()


def test_proc_mesh_shape_slice_size_len(procs):
    assert procs.sizes == {"hosts": 2, "gpus": 2}
    assert len(procs) == 4 and procs.size() == 4 and procs.size("hosts") == 2 and procs.size("gpus") == 2
    h1 = procs.slice(hosts=1)
    assert h1.sizes == {"gpus": 2} and len(h1) == 2 and h1.size() == 2
    col = procs.slice(gpus=slice(1, 2))
    assert col.sizes == {"hosts": 2, "gpus": 1} and len(col) == 2
    one = procs.slice(hosts=0, gpus=1)
    assert one.sizes == {} and len(one) == 1
    with pytest.raises(KeyError, match="nodes"):
        procs.size("nodes")
    with pytest.raises(KeyError, match="nodes"):
        procs.slice(nodes=0)
    with pytest.raises(IndexError):
        procs.slice(gpus=2)


def test_spawn_on_a_sliced_proc_mesh(procs, pids):
    sub = procs.slice(hosts=1).spawn("sub_counter", Counter)
    who = sub.who.call().get(timeout=T)
    assert who.sizes == {"gpus": 2}
    assert [w["pid"] for w in who.values()] == [pids.item(hosts=1, gpus=0), pids.item(hosts=1, gpus=1)]
    assert [w["rank"] for w in who.values()] == [0, 1]
    assert [w["sizes"] for w in who.values()] == [{"gpus": 2}] * 2


# ---- adverbs -------------------------------------------------------------------------------------
def test_call_gives_a_value_mesh(counter, pids):
    vm = counter.who.call().get(timeout=T)
    assert isinstance(vm, ValueMesh) and len(vm) == 4 and vm.sizes == {"hosts": 2, "gpus": 2}
    assert [w["rank"] for w in vm.values()] == [0, 1, 2, 3]
    for point, w in vm.items():
        assert w["rank"] == point.rank and w["coords"] == dict(point)
    assert vm.item(hosts=1, gpus=0)["rank"] == 2 and vm.item(hosts=0, gpus=1)["coords"] == {"hosts": 0, "gpus": 1}
    assert len(set(pids.values())) == 4
    with pytest.raises(KeyError):
        vm.item(hosts=1)


def test_dir_and_repr_show_the_endpoints(counter):
    # Tab completion in a notebook lists dir(): the endpoints, resolved by __getattr__, were missing.
    names = dir(counter)
    assert {"incr", "aincr", "pid"} <= set(names) and "slice" in names
    assert repr(counter.incr) == "<endpoint counter.incr of actor mesh 'counter' {'hosts': 2, 'gpus': 2}>"


def test_call_on_a_slice(counter):
    vm = counter.slice(gpus=1).who.call().get(timeout=T)
    assert vm.sizes == {"hosts": 2}
    assert [w["ctx_rank"] for w in vm.values()] == [1, 3], "an actor's own rank is its rank in the spawned mesh"
    # Monarch's current_rank() and current_size(): the message's rank, in the slice it went to
    assert [(w["rank"], w["coords"], w["sizes"]) for w in vm.values()] == \
        [(0, {"hosts": 0}, {"hosts": 2}), (1, {"hosts": 1}, {"hosts": 2})]
    assert [dict(p) for p, _ in vm.items()] == [{"hosts": 0}, {"hosts": 1}]
    assert vm.item(hosts=1)["coords"] == {"hosts": 1}
    # Monarch's message_rank: where the actor lies in the slice the message went to
    assert [w["message_rank"] for w in vm.values()] == [(0, {"hosts": 0}), (1, {"hosts": 1})]
    one = counter.slice(hosts=1, gpus=0).awho.call_one().get(timeout=T)
    assert one["ctx_rank"] == 2 and one["message_rank"] == (0, {})  # a singleton's point has no dims
    assert one["rank"] == 0 and one["sizes"] == {}
    block = counter.slice(hosts=slice(1, 2), gpus=slice(0, 2))
    assert [w["message_rank"] for w in block.who.call().get(timeout=T).values()] == \
        [(0, {"hosts": 0, "gpus": 0}), (1, {"hosts": 0, "gpus": 1})]


def test_context_and_current_rank_inside_endpoints(counter):
    for adverb in ("who", "awho"):
        vm = getattr(counter, adverb).call().get(timeout=T)
        for point, w in vm.items():
            assert w["name"] == "counter"
            assert w["rank"] == w["ctx_rank"] == point.rank and w["ctx_same"] and w["is_context"]
            assert w["message_rank"] == (point.rank, dict(point))  # sent to the whole mesh
            assert w["sizes"] == {"hosts": 2, "gpus": 2}
            assert w["coords"] == dict(point)


def test_proc_mesh_execute_runs_a_function_on_every_proc(procs):
    got = procs.execute(lambda x, k=1: (x * 2 + k, current_rank().rank), 5, k=3)  # the seeds' mesh.execute
    assert isinstance(got, ValueMesh) and got.values() == [(13, r) for r in range(4)]
    assert procs.slice(hosts=1).execute(os.getpid).values() == [p for p in
                                                                  procs.execute(os.getpid).values()[2:]]
    with pytest.raises(ActorError, match="ZeroDivisionError"):
        procs.execute(lambda: 1 / 0)
    with pytest.raises(TypeError, match="a function to run on every proc"):
        procs.execute(42)
    fut = procs.execute_async(lambda x: x + current_rank().rank, 10)  # the Future form, as other calls return
    assert isinstance(fut, Future) and fut.get(timeout=T).values() == [10, 11, 12, 13]
    assert asyncio.run(_awaited(procs.execute_async(lambda: "awaited"))).values() == ["awaited"] * 4
    with pytest.raises(TypeError, match="a function to run on every proc"):
        procs.execute_async(None)


async def _awaited(fut):
    return await fut


def test_spawn_procs_runs_its_bootstrap_on_every_proc_before_the_mesh_is_used():
    import asyncio

    async def later():
        await asyncio.sleep(0.01)
        os.environ["MT_TEST_BOOT_ASYNC"] = f"{current_rank().rank}:{os.getpid()}"

    procs = this_host().spawn_procs({"gpus": 2}, lambda: os.environ.__setitem__("MT_TEST_BOOT", str(os.getpid())))
    other = this_host().spawn_procs(per_host={"gpus": 2}, bootstrap=later)
    try:
        pids = procs.execute(os.getpid).values()
        assert procs.execute(lambda: os.environ.get("MT_TEST_BOOT")).values() == [str(p) for p in pids]
        assert other.execute(lambda: os.environ.get("MT_TEST_BOOT_ASYNC")).values() == \
            [f"{r}:{p}" for r, p in enumerate(other.execute(os.getpid).values())]
    finally:
        procs.stop()
        other.stop()
    failed = this_host().spawn_procs({"gpus": 2}, bootstrap=lambda: 1 / 0)  # (Monarch's: it returns, and
    with pytest.raises(ActorError, match="ZeroDivisionError"):  # the mesh's initialized raises)
        failed.initialized.get(timeout=60)
    with pytest.raises(ActorError, match="ZeroDivisionError"):  # as does its first use
        failed.execute(os.getpid)
    with pytest.raises(TypeError, match="a function of no arguments"):
        this_host().spawn_procs({"gpus": 2}, bootstrap="setup.sh")


def _threads_cpus() -> list:
    """The CPUs each thread of this process may run on (one entry per distinct set)."""
    return sorted({tuple(sorted(os.sched_getaffinity(int(t)))) for t in os.listdir("/proc/self/task")})


def _mempolicy() -> tuple[int, int]:
    """(mode, node mask) of this thread's memory policy (get_mempolicy; x86_64's syscall number)."""
    import ctypes

    mode, mask = ctypes.c_int(-1), (ctypes.c_ulong * 1)()
    libc = ctypes.CDLL(None, use_errno=True)
    assert libc.syscall(ctypes.c_long(239), ctypes.byref(mode), mask, ctypes.c_ulong(65), None, ctypes.c_ulong(0)) == 0
    return mode.value, mask[0]


def test_spawn_procs_binds_each_proc_of_a_host_to_cpus_and_numa_nodes():
    import platform

    last = max(os.sched_getaffinity(0))
    numa = os.path.exists("/sys/devices/system/node/node0")
    binds = [{"cpus": str(last)}, {"cpunodebind": "0", "membind": "0"} if numa else {"physcpubind": f"0-{last}"}]
    procs = this_host().spawn_procs({"gpus": 2}, proc_bind=binds)
    try:
        got = procs.execute(_threads_cpus).values()
        assert got[0] == [(last,)]  # every thread of the proc, those started after the binding too
        assert len(got[1]) == 1 and set(got[1][0]) <= set(os.sched_getaffinity(0))
        if numa and platform.machine() == "x86_64":
            assert procs.execute(_mempolicy).values() == [(0, 0), (2, 1)]  # MPOL_DEFAULT; MPOL_BIND to node 0
    finally:
        procs.stop()
    for bad, err, match in (([{"cpus": "0"}], ValueError, "one dict per proc of a host"),
                            ([{"cpus": "0"}, {"gpu": "1"}], ValueError, "unknown: .'gpu'."),
                            ([{"cpus": "0-"}, {}], ValueError, "expected a list such as"),
                            ([{"cpus": "0", "physcpubind": "0"}, {}], ValueError, "not both"),
                            ([{"cpus": 0}, {}], TypeError, "takes a string"),
                            ([{"cpus": "4096"}, {}], ValueError, "this machine has no CPU .4096."),
                            ([{"membind": "63"}, {}], ValueError, "no NUMA node 63")):
        with pytest.raises(err, match=match):
            this_host().spawn_procs({"gpus": 2}, proc_bind=bad)


def _wrapper_of_nested_procs() -> tuple:
    """In a proc: the wrapper marks of procs it spawns on its own host (``this_host()``)."""
    inner = this_host().spawn_procs({"gpus": 1})
    try:
        return tuple(inner.execute(lambda: (os.environ.get("MT_TEST_WRAPPED"), os.environ.get("MT_TEST_WRAPPER"),
                                            os.environ.get("MT_TEST_WRAPPER") == os.environ.get("MT_OUTER"))).values()[0])
    finally:
        inner.stop()


@pytest.mark.timeout(120)  # (new interpreters that import torch, with the suite's other workers on the cores)
def test_with_python_executable_runs_procs_with_another_interpreter(tmp_path):
    from monarch_tensor import heal_mesh

    wrapper = tmp_path / "python-wrapped"  # an interpreter that marks its processes (and its own pid)
    wrapper.write_text(f"#!/bin/sh\nMT_TEST_WRAPPED=yes MT_TEST_WRAPPER=$$ exec {sys.executable} \"$@\"\n")
    wrapper.chmod(0o755)
    hosts = this_host().with_python_executable(str(wrapper))
    procs = hosts.spawn_procs({"gpus": 2})
    plain = this_host().spawn_procs({"gpus": 1})
    try:
        assert procs.execute(lambda: os.environ.get("MT_TEST_WRAPPED")).values() == ["yes", "yes"]
        assert plain.execute(lambda: os.environ.get("MT_TEST_WRAPPED")).values() == [None]
        # Procs that those procs spawn run it too: the wrapper runs again for them (Monarch's recursive spawn).
        one = procs.slice(gpus=0)
        one.execute(lambda: os.environ.__setitem__("MT_OUTER", os.environ["MT_TEST_WRAPPER"]))
        wrapped, _, inherited = one.execute(_wrapper_of_nested_procs).item()
        assert wrapped == "yes" and not inherited
        healed = heal_mesh(procs)  # the new procs run it too
        assert healed.execute(lambda: os.environ.get("MT_TEST_WRAPPED")).values() == ["yes", "yes"]
        healed.stop()
    finally:
        procs.stop()
        plain.stop()
    with pytest.raises(FileNotFoundError, match="no such executable"):
        this_host().with_python_executable(str(tmp_path / "missing"))
    with pytest.raises(TypeError, match="path of a Python interpreter"):
        this_host().with_python_executable(None)


@pytest.mark.timeout(60)
def test_with_python_executable_that_is_no_working_python_says_so(tmp_path):
    """An interpreter that exits at once (a broken venv) fails the spawn with an error naming it and its
    exit status, whether the template had exited before the spawn asked or while it asked (a broken pipe)."""
    broken = tmp_path / "python"
    broken.write_text("#!/bin/sh\necho 'python: error while loading shared libraries' >&2\nexit 127\n")
    broken.chmod(0o755)
    for _ in range(3):
        with pytest.raises(RuntimeError, match=f"exited with code 127 before it started: {broken} .* not a working"):
            this_host().with_python_executable(str(broken)).spawn_procs({"gpus": 1})


def test_proc_mesh_to_table(procs):
    table = procs.to_table().splitlines()
    assert table[0].split() == ["rank", "hosts", "gpus", "pid", "address"] and len(table) == 2 + 4
    assert [row.split()[:3] for row in table[2:]] == [["0", "0", "0"], ["1", "0", "1"], ["2", "1", "0"],
                                                     ["3", "1", "1"]]
    assert procs.slice(gpus=1).to_table().splitlines()[2].split()[:2] == ["0", "0"]


def test_context_in_the_client():
    assert context().actor_name == "client" and current_rank().rank == 0


def test_call_one(counter):
    w = counter.slice(hosts=1, gpus=1).who.call_one().get(timeout=T)
    assert w["ctx_rank"] == 3 and (w["rank"], w["coords"]) == (0, {})  # current_rank(): the message's
    # a one-actor mesh that still has dims
    w = counter.slice(hosts=slice(0, 1), gpus=slice(1, 2)).who.call_one().get(timeout=T)
    assert w["ctx_rank"] == 1 and (w["rank"], w["coords"]) == (0, {"hosts": 0, "gpus": 0})


def test_a_mesh_keeps_its_endpoints_and_a_slice_calls_its_own_actors(counter):
    """``mesh.method`` is one object on every access (as Monarch's meshes keep theirs), and a slice's endpoint,
    made after the whole mesh's was kept, still calls the slice's actor, not the whole mesh."""
    assert counter.who is counter.who
    whole = counter.who
    one = counter.slice(hosts=1, gpus=1)
    assert one.who is not whole and one.who is one.who
    assert one.who.call_one().get(timeout=T)["ctx_rank"] == 3
    assert sorted(v["ctx_rank"] for v in whole.call().get(timeout=T).values()) == [0, 1, 2, 3]


def test_call_one_on_many_actors_is_an_error(counter):
    with pytest.raises(ValueError, match="call_one"):
        counter.who.call_one().get(timeout=T)
    with pytest.raises(ValueError, match="call_one"):
        counter.slice(hosts=0).who.call_one().get(timeout=T)


def test_sync_and_async_endpoints(procs):
    c = procs.spawn("sync_async", Counter, 10)
    one = c.slice(hosts=0, gpus=0)
    assert one.incr.call_one().get(timeout=T) == 11
    assert one.aincr.call_one().get(timeout=T) == 12
    assert one.incr.call_one().get(timeout=T) == 13
    assert c.aincr.call().get(timeout=T).values() == [14, 11, 11, 11]


def test_choose(counter, pids):
    chosen = [counter.pid.choose().get(timeout=T) for _ in range(40)]
    assert set(chosen) <= set(pids.values())
    assert len(set(chosen)) > 1, "choose() picks among the actors, not always the same one"
    assert counter.slice(gpus=0).pid.choose().get(timeout=T) in (pids.item(hosts=0, gpus=0),
                                                                 pids.item(hosts=1, gpus=0))


def test_broadcast_effect_is_seen_by_a_later_call(procs):
    c = procs.spawn("broadcast_counter", Counter)
    assert c.set.broadcast(42) is None
    assert c.value.call().get(timeout=T).values() == [42] * 4
    c.slice(gpus=0).set.broadcast(7)
    assert c.value.call().get(timeout=T).values() == [7, 42, 7, 42]


def test_stream_yields_futures_for_every_reply(counter):
    futs = list(counter.who.stream())
    assert len(futs) == 4 and all(isinstance(f, Future) for f in futs)
    assert sorted(f.get(timeout=T)["rank"] for f in futs) == [0, 1, 2, 3]
    got = [f.get(timeout=T)["ctx_rank"] for f in counter.slice(hosts=1).who.stream()]
    assert sorted(got) == [2, 3]


class Relay(Actor):
    """Waits on other actors from inside its (sync) endpoints."""

    @endpoint
    def stream_from(self, other) -> list:
        return sorted(f.get(timeout=T)["rank"] for f in other.who.stream())

    @endpoint
    def exception_of(self, other):
        return other.fail_on.call_one(2).exception(timeout=T), other.fail_on.call_one(0).exception(timeout=T)

    @endpoint
    def slow(self, gate: str) -> str:
        deadline = time.monotonic() + T
        while not os.path.exists(gate) and time.monotonic() < deadline:
            time.sleep(0.01)
        return "done"


def test_stream_sends_at_once_and_its_futures_take_timeouts(procs, counter, tmp_path):
    c = procs.spawn("stream_counter", Counter)
    pending = c.set.stream(5)  # sent now, before anything is taken from the generator
    assert c.value.call().get(timeout=T).values() == [5] * 4
    assert [f.get(timeout=T) for f in pending] == [None] * 4
    relay = procs.spawn("stream_relay", Relay)
    gate = str(tmp_path / "gate")
    futs = relay.slow.stream(gate)
    first = next(futs)
    with pytest.raises(TimeoutError):
        first.get(timeout=0.2)  # nobody answers before the gate opens
    open(gate, "w").close()
    assert [first.get(timeout=T)] + [f.get(timeout=T) for f in futs] == ["done"] * 4


def test_stream_and_exception_inside_an_endpoint_receive_their_replies(procs, counter):
    relay = procs.spawn("relay", Relay).slice(hosts=0, gpus=0)
    assert relay.stream_from.call_one(counter).get(timeout=T) == [0, 1, 2, 3]
    faulty = procs.spawn("relay_faulty", Faulty).slice(hosts=1, gpus=0)  # rank 2
    error, none = relay.exception_of.call_one(faulty).get(timeout=T)
    assert isinstance(error, ActorError) and "rank 2 fails on purpose" in str(error)
    assert none is None
    assert counter.slice(hosts=0, gpus=0).value.call_one().get(timeout=T) is not None  # the proc still serves


def test_send_with_a_port(counter):
    port, receiver = Channel.open()
    counter.who.send((), {}, port=port)
    got = [receiver.recv().get(timeout=T) for _ in range(4)]
    assert sorted(w["rank"] for w in got) == [0, 1, 2, 3]


def test_send_without_a_port_is_fire_and_forget(procs):
    c = procs.spawn("send_counter", Counter)
    c.set.send((9,))
    c.slice(hosts=1).set.send(kwargs={"v": 3})
    assert c.value.call().get(timeout=T).values() == [9, 9, 3, 3]


def test_accumulator(procs):
    c = procs.spawn("acc_counter", Counter, 0, step=5)
    c.incr.broadcast()
    assert Accumulator(c.value, 0, lambda a, b: a + b).accumulate().get(timeout=T) == 20
    assert Accumulator(c.who, [], lambda acc, w: acc + [w["rank"]]).accumulate().get(timeout=T) == [0, 1, 2, 3]
    f = procs.spawn("acc_faulty", Faulty)
    with pytest.raises(ActorError):
        Accumulator(f.fail_on, 0, lambda a, b: a + b).accumulate(2).get(timeout=T)


def test_calling_an_endpoint_directly_points_at_the_adverbs(counter):
    with pytest.raises(TypeError, match="call"):
        counter.value()


# ---- ordering ---------------------------------------------------------------------------------------
def test_thousand_calls_from_one_sender_arrive_in_order(procs):
    rec = procs.spawn("recorder", Recorder)
    one = rec.slice(hosts=1, gpus=1)
    futs = []
    for i in range(1000):
        if i % 3 == 0:
            one.record.broadcast(i)
        elif i % 3 == 1:
            futs.append((i, one.record.call_one(i)))
        else:
            futs.append((i, one.arecord.call_one(i)))
    for i, f in futs:
        assert f.get(timeout=T) == i + 1, "each call sees exactly the calls sent before it"
    assert one.log.call_one().get(timeout=T) == list(range(1000))
    for i in range(1000, 1200):
        rec.record.broadcast(i)
    logs = rec.log.call().get(timeout=T)
    assert logs.item(hosts=1, gpus=1) == list(range(1200))
    for point, log in logs.items():
        if point.rank != 3:
            assert log == list(range(1000, 1200))


# ---- channels ---------------------------------------------------------------------------------------
def test_channel_port_passed_to_an_actor(procs):
    em = procs.spawn("emitter", Emitter)
    port, receiver = Channel.open()
    assert em.slice(hosts=0, gpus=1).emit.call_one(port, 20).get(timeout=T) == 20
    assert [receiver.recv().get(timeout=T) for _ in range(20)] == [(1, i) for i in range(20)]
    assert em.emit.call(port, 5).get(timeout=T).values() == [5] * 4
    got = [receiver.recv().get(timeout=T) for _ in range(20)]
    assert sorted(got) == [(r, i) for r in range(4) for i in range(5)]
    for r in range(4):
        assert [i for rr, i in got if rr == r] == list(range(5)), "values from one sender stay in order"
    em.slice(hosts=0, gpus=0).emit_error.call_one(port).get(timeout=T)
    with pytest.raises(ValueError, match="through the port"):
        receiver.recv().get(timeout=T)


def test_a_recv_that_timed_out_does_not_swallow_the_next_value():
    port, receiver = Channel.open()
    with pytest.raises(TimeoutError):
        receiver.recv().get(timeout=0.2)
    port.send("first")
    assert receiver.recv().get(timeout=T) == "first"
    waited = receiver.recv()
    with pytest.raises(TimeoutError):
        waited.get(timeout=0.2)
    port.send("second")
    port.send("third")
    assert waited.get(timeout=T) == "second"  # waited on again, it takes its turn again
    assert receiver.recv().get(timeout=T) == "third"

    async def cancelled_then_again():
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(receiver.recv(), 0.2)
        port.send("fourth")
        return await asyncio.wait_for(receiver.recv(), T)

    assert asyncio.run(cancelled_then_again()) == "fourth"

    async def cancelled_as_asyncio_then_again():  # (it kept its place, and took the next value)
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(receiver.recv().as_asyncio(), 0.2)
        port.send("fifth")
        return await asyncio.wait_for(receiver.recv(), T)

    assert asyncio.run(cancelled_as_asyncio_then_again()) == "fifth"


def test_ranked_and_once_channels(procs):
    em = procs.spawn("emitter_ranked", Emitter)
    port, ranked = Channel.open_ranked()
    em.slice(hosts=1).emit.call(port, 2).get(timeout=T)
    got = sorted(ranked.recv().get(timeout=T) for _ in range(4))
    assert got == [(2, (2, 0)), (2, (2, 1)), (3, (3, 0)), (3, (3, 1))]  # the senders' ranks in their mesh
    port.send("from the client")
    assert ranked.recv().get(timeout=T) == (0, "from the client")
    port2, plain = Channel.open()
    both = plain.ranked()  # the same channel, read either way
    port2.send("a")
    port2.send("b")
    assert plain.recv().get(timeout=T) == "a" and both.recv().get(timeout=T) == (0, "b")

    waiter = both.recv()  # a value handed to a waiter that was cancelled meanwhile goes back whole
    port2.send("c")
    assert waiter.get(timeout=T) == (0, "c")
    both._r._give_back(waiter)  # what a cancelled await does with it
    assert plain.recv().get(timeout=T) == "c"
    once_port, once = Channel.open(once=True)
    once_port.send(1)
    once_port.send(2)  # the port closed after its first value
    assert once.recv().get(timeout=T) == 1
    with pytest.raises(ValueError, match="once=True"):  # (it waited for ever)
        once.recv().get(timeout=T)
    once_port, once = Channel.open(once=True)
    first = once.recv()
    with pytest.raises(ValueError, match="once=True"):  # one waits for the one value already
        once.recv().get(timeout=T)
    once_port.send(3)
    assert first.get(timeout=T) == 3


def test_a_channel_closes_when_its_receivers_are_gone(procs):
    import gc

    from monarch_tensor.transport.mailbox import current_mailbox

    ports = current_mailbox()._ports
    gc.collect()
    before = len(ports)
    for i in range(50):
        port, receiver = Channel.open()
        port.send(i)
        assert receiver.ranked().recv().get(timeout=T) == (0, i)
        del port, receiver
    gc.collect()
    assert len(ports) == before  # every channel's port stayed open (about 2 KB each) for ever

    em = procs.spawn("emitter_unheld", Emitter)
    port, receiver = Channel.open()
    waiting = receiver.recv()
    del receiver  # a waiting recv() keeps its channel open
    gc.collect()
    em.slice(hosts=1, gpus=0).emit.call_one(port, 1).get(timeout=T)
    assert waiting.get(timeout=T) == (2, 0)


def test_future_as_asyncio(counter):
    with pytest.raises(RuntimeError, match="running asyncio event loop"):
        counter.value.call().as_asyncio()

    async def main():
        one = counter.slice(hosts=0, gpus=0)
        fut = one.value.call_one()
        a, b = fut.as_asyncio(), fut.as_asyncio()
        assert isinstance(a, asyncio.Future)
        done = await asyncio.gather(a, b, asyncio.wait_for(one.value.call_one().as_asyncio(), T))
        with pytest.raises(ActorError):
            await asyncio.wait_for(one.slow.call_one("not a number").as_asyncio(), T)
        return done

    got = asyncio.run(main())
    assert got[0] == got[1] == got[2] and isinstance(got[0], int)


def test_channel_receives_in_order_when_recv_comes_first(procs):
    em = procs.spawn("emitter_early", Emitter)
    port, receiver = Channel.open()
    futs = [receiver.recv() for _ in range(200)]
    em.slice(hosts=1, gpus=0).emit.call_one(port, 200).get(timeout=T)
    assert [f.get(timeout=T) for f in futs] == [(2, i) for i in range(200)]


# ---- actor meshes as arguments --------------------------------------------------------------------
def test_ping_pong_between_two_actor_meshes(procs):
    ping = procs.slice(hosts=0).spawn("ping", PingPong, "ping")
    pong = procs.slice(hosts=1).spawn("pong", PingPong, "pong")
    ping.init.call(pong).get(timeout=T)
    pong.init.call(ping).get(timeout=T)
    ping.send.call("Ping").get(timeout=T)
    pong.send.call("Pong").get(timeout=T)
    assert pong.received_msgs.call().get(timeout=T).values() == [["ping:0 Ping"], ["ping:1 Ping"]]
    assert ping.received_msgs.call().get(timeout=T).values() == [["pong:0 Pong"], ["pong:1 Pong"]]
    # a sync endpoint that blocks on a call to its pair in the other mesh (a slice of one: rank 0 of it)
    assert ping.sync_relay.call("hi").get(timeout=T).values() == [("pong", 0, "hi"), ("pong", 0, "hi")]
    # an async endpoint that awaits a call() on the whole other mesh
    assert pong.slice(gpus=1).async_relay_all.call_one("all").get(timeout=T) == [
        ("ping", 0, "all"), ("ping", 1, "all")]


def test_sync_endpoint_can_call_another_actor_on_its_own_proc(procs):
    a = procs.slice(hosts=0, gpus=0).spawn("same_proc_a", PingPong, "a")
    b = procs.slice(hosts=0, gpus=0).spawn("same_proc_b", PingPong, "b")
    a.init.call(b).get(timeout=T)
    assert a.sync_relay.call_one("x", 2.0).get(timeout=T) == ("b", 0, "x")


# ---- futures -------------------------------------------------------------------------------------
def test_get_with_timeout_raises_timeout_error(procs, tmp_path):
    c = procs.spawn("slow_counter", Counter)
    gate = str(tmp_path / "gate")
    fut = c.slice(hosts=0, gpus=1).gated.call_one(gate)  # cannot return before the gate opens below
    with pytest.raises(TimeoutError, match="within"):
        fut.get(timeout=0.05)
    assert not fut.done()
    open(gate, "w").close()
    assert fut.get(timeout=T) == "open"


def test_await_futures_in_asyncio_run(procs):
    c = procs.spawn("await_counter", Counter, 100)

    async def main():
        mesh = await procs.spawn("awaited_mesh", Counter, 1)
        first = await c.slice(hosts=0, gpus=0).incr.call_one()
        vm = await c.value.call()
        both = await asyncio.gather(c.slice(hosts=1, gpus=1).incr.call_one(),
                                    c.slice(hosts=1, gpus=0).aincr.call_one())
        other = await mesh.value.call()
        with pytest.raises(ActorError):
            await procs.spawn("awaited_broken", BrokenInit)
        return first, vm.values(), both, other.values()

    first, values, both, other = asyncio.run(main())
    assert first == 101 and values == [101, 100, 100, 100] and both == [101, 101] and other == [1] * 4


# ---- errors --------------------------------------------------------------------------------------
def test_actor_error_carries_traceback_name_and_rank_and_the_actor_keeps_serving(procs):
    f = procs.spawn("faulty", Faulty)
    one = f.slice(hosts=1, gpus=0)
    with pytest.raises(ActorError) as ei:
        one.fail.call_one("kaboom").get(timeout=T)
    e = ei.value
    assert e.actor == "faulty" and e.rank == 2 and e.method == "fail"
    assert "kaboom" in str(e) and "faulty" in str(e) and "rank 2" in str(e)
    assert "_raise_deep" in e.traceback and "ValueError: kaboom" in e.traceback
    assert isinstance(e.exception, ValueError) and e.exception.args == ("kaboom",)
    assert one.calls_made.call_one().get(timeout=T) == 1, "the actor keeps its state and serves on"
    assert f.fail_on.call(-1).get(timeout=T).values() == [0, 1, 2, 3]


def test_actor_error_from_one_rank_of_a_call(procs):
    f = procs.spawn("faulty_call", Faulty)
    with pytest.raises(ActorError) as ei:
        f.fail_on.call(3).get(timeout=T)
    assert ei.value.rank == 3 and "fails on purpose" in str(ei.value)
    results = []
    for fut in f.fail_on.stream(1):
        try:
            results.append(fut.get(timeout=T))
        except ActorError as e:
            results.append(("error", e.rank))
    assert sorted(results, key=str) == sorted([0, ("error", 1), 2, 3], key=str)


def test_actor_error_from_async_endpoints_and_odd_exceptions(procs):
    f = procs.spawn("faulty_odd", Faulty).slice(hosts=0, gpus=0)
    with pytest.raises(ActorError, match="async-boom") as ei:
        f.afail.call_one().get(timeout=T)
    assert "afail" in ei.value.traceback
    with pytest.raises(ActorError, match="defined inside the endpoint") as ei:
        f.local_exception.call_one().get(timeout=T)
    assert "NotImportable" in str(ei.value)
    with pytest.raises(ActorError, match="cannot send the result back") as ei:
        f.unpicklable_result.call_one().get(timeout=T)
    assert (ei.value.actor, ei.value.method) == ("faulty_odd", "unpicklable_result")
    assert f.calls_made.call_one().get(timeout=T) == 0


def test_constructor_failure_surfaces_on_initialized_and_on_calls(procs):
    bad = procs.spawn("broken", BrokenInit)
    with pytest.raises(ActorError, match="constructor failed") as ei:
        bad.initialized.get(timeout=T)
    assert ei.value.method == "__init__" and ei.value.actor == "broken"
    assert "BrokenInit" in ei.value.traceback or "__init__" in ei.value.traceback
    with pytest.raises(ActorError, match="constructor failed"):
        bad.ping.call().get(timeout=T)
    with pytest.raises(ActorError, match="constructor failed"):
        bad.slice(hosts=1, gpus=1).ping.call_one().get(timeout=T)


def test_constructor_failure_on_one_rank(procs):
    partly = procs.spawn("partly_broken", BrokenInit, 2)
    with pytest.raises(ActorError) as ei:
        partly.initialized.get(timeout=T)
    assert ei.value.rank == 2 and "rank 2" in str(ei.value)
    assert partly.slice(hosts=0).ping.call().get(timeout=T).values() == ["pong", "pong"]
    with pytest.raises(ActorError):
        partly.slice(hosts=1, gpus=0).ping.call_one().get(timeout=T)
    fine = procs.spawn("after_broken", Counter, 1)
    assert fine.value.call().get(timeout=T).values() == [1] * 4, "the procs keep serving"


def test_unknown_endpoint_is_an_attribute_error(counter):
    with pytest.raises(AttributeError, match="no endpoint 'nope'"):
        _ = counter.nope
    with pytest.raises(AttributeError, match=r"Counter.helper is not annotated as an endpoint.*as_endpoint"):
        counter.helper.call()  # a method, but not an endpoint
    with pytest.raises(RuntimeError, match="not annotated as an endpoint"):
        counter.helper()
    with pytest.raises(AttributeError):
        _ = counter._private
    with pytest.raises(AttributeError, match="no endpoint 'n'"):
        _ = counter.n  # an instance attribute, not a method
    assert not hasattr(counter, "nope")


def test_as_endpoint_calls_a_method_that_is_not_an_endpoint(procs):
    c = procs.spawn("as_endpoint_counter", Counter, 1)
    got = as_endpoint(c.plain_add).call(2).get(timeout=T)
    assert [v["n"] for v in got.values()] == [3] * 4
    assert [v["name"] for v in got.values()] == [f"as_endpoint_counter[{r}]" for r in range(4)]
    point = got.get(3)["point"]  # Monarch's Point: extent and size(label) of the actor's mesh
    assert point.rank == 3 and dict(point) == {"hosts": 1, "gpus": 1}
    assert point.extent == c.extent and point.size("gpus") == 2 and point.size() == 4
    assert as_endpoint(c.slice(hosts=1, gpus=0).aplain).call_one().get(timeout=T) == 3  # async def
    answers = as_endpoint(c.answer_via, explicit_response_port=True).call(4).get(timeout=T)
    assert answers.values() == [40, 41, 42, 43]
    with pytest.raises(ValueError, match="is an @endpoint already"):
        as_endpoint(c.value)
    with pytest.raises(ValueError, match="method of a spawned actor mesh"):
        as_endpoint(Counter.plain_add)
    with pytest.raises(TypeError, match=r"Counter\.plain_add\(\): missing a required argument"):  # at the call
        as_endpoint(c.slice(hosts=0, gpus=0).plain_add).call_one()


def test_actor_logger_is_named_for_its_class(counter):
    import logging

    assert counter.slice(hosts=0, gpus=1).log_something.call_one().get(timeout=T) == ("Counter", logging.DEBUG)


class Gate(Actor):
    def __init__(self) -> None:
        self.opened: asyncio.Event | None = None
        self.order: list = []

    def _event(self) -> asyncio.Event:
        if self.opened is None:
            self.opened = asyncio.Event()
        return self.opened

    @concurrent_endpoint
    async def wait_open(self, tag: str) -> str:
        self.order.append(tag)
        await asyncio.wait_for(self._event().wait(), 10)  # a plain async endpoint would hold the actor here
        return tag

    @endpoint
    async def open(self) -> list:
        self._event().set()
        return list(self.order)

    @concurrent_endpoint
    async def fails(self) -> None:
        await asyncio.sleep(0)
        raise ValueError("a concurrent endpoint fails on purpose")

    @concurrent_endpoint
    async def cancelled_inside(self) -> None:
        inner = asyncio.ensure_future(asyncio.sleep(10))
        asyncio.get_running_loop().call_soon(inner.cancel)
        await inner  # ends in the inner task's CancelledError


def test_concurrent_endpoints_overlap_and_start_in_order(procs):
    gate = procs.slice(hosts=0, gpus=1).spawn("gate", Gate)
    first, second = gate.wait_open.call_one("a"), gate.wait_open.call_one("b")
    assert gate.open.call_one().get(timeout=T) == ["a", "b"]  # ran while both waited, after both started
    assert (first.get(timeout=T), second.get(timeout=T)) == ("a", "b")
    with pytest.raises(ActorError, match="a concurrent endpoint fails on purpose"):
        gate.fails.call_one().get(timeout=T)
    assert gate.wait_open.call_one("c").get(timeout=T) == "c"  # the actor keeps serving
    # A body that ends in a cancellation of its own, and calls running when the actor stops, are answered:
    # their callers waited for ever.
    with pytest.raises(ActorError, match="CancelledError"):
        gate.cancelled_inside.call_one().get(timeout=T)
    closed = procs.slice(hosts=0, gpus=1).spawn("closed_gate", Gate)
    waiting = closed.wait_open.call_one("d")  # (waits for an open() that never comes)
    closed.stop("the test stops it").get(timeout=T)
    with pytest.raises(ActorError, match="was stopped \\(the test stops it\\)"):
        waiting.get(timeout=T)
    with pytest.raises(ValueError, match="needs an async def"):  # Monarch's error type (concurrent.py)
        concurrent_endpoint(lambda self: None)
    with pytest.raises(ValueError, match="does not wrap @endpoint"):  # Monarch refuses the stack too

        class Stacked(Actor):
            @concurrent_endpoint
            @endpoint
            async def ping(self):
                return "pong"


def test_send_function_and_value_mesh_get(procs):
    c = procs.spawn("send_fn_counter", Counter, 5)
    port, receiver = Channel.open_ranked()
    send(c.who, (), {}, port=port)
    got = sorted(receiver.recv().get(timeout=T) for _ in range(4))
    assert [r for r, _ in got] == [0, 1, 2, 3] and all(w["rank"] == r for r, w in got)
    send(c.set, (7,), {}, selection="choose")
    values = c.value.call().get(timeout=T)
    assert sorted(values.values()) == [5, 5, 5, 7]
    assert [values.get(i) for i in range(4)] == values.values()
    with pytest.raises(IndexError, match="rank 4 is out of range"):
        values.get(4)
    with pytest.raises(ValueError, match="'all' or 'choose'"):
        send(c.set, (1,), {}, selection="some")
    with pytest.raises(TypeError, match="needs an endpoint"):
        send(c.helper, (), {})


@pytest.mark.parametrize("cls", [object, int, Counter(), lambda: None, "Counter"],
                         ids=["object", "int", "an-instance", "a-function", "a-string"])
def test_spawn_needs_an_actor_class(procs, cls):
    with pytest.raises(TypeError, match="Actor"):
        procs.spawn("not_an_actor", cls)


def test_spawn_needs_a_name(procs):
    with pytest.raises(ValueError, match="name"):
        procs.spawn("", Counter)


# ---- singletons and lifecycle ----------------------------------------------------------------------
def test_get_or_spawn_controller_returns_the_same_actor():
    name = "test_actors_controller"
    try:
        first = get_or_spawn_controller(name, Counter, 10).get(timeout=T)
        second = get_or_spawn_controller(name, Counter, 10).get(timeout=T)
        assert first.incr.call_one().get(timeout=T) == 11
        assert second.incr.call_one().get(timeout=T) == 12, "the second call reaches the same actor"
        assert first.pid.call_one().get(timeout=T) == second.pid.call_one().get(timeout=T)
        third = get_or_spawn_controller(name, Counter, 10).get(timeout=T)
        assert third.value.call_one().get(timeout=T) == 12
    finally:
        mesh = actor_mod._controllers.pop(name, None)
        if mesh is not None:
            ActorMesh.stop(mesh).get(timeout=T)


def test_calls_on_a_stopped_mesh_are_refused():
    mesh = this_host().spawn_procs({"gpus": 1})
    try:
        c = mesh.spawn("stopped", Counter)
        c.initialized.get(timeout=T)
    finally:
        mesh.stop().get(timeout=T)
    with pytest.raises(MeshStoppedError, match=r"was stopped \(stopped by client\)"):
        mesh.spawn("again", Counter)
    with pytest.raises(MeshStoppedError):
        c.value.call().get(timeout=T)
    with pytest.raises(SupervisionError):  # Monarch's error for calls after stop()
        c.value.call().get(timeout=T)
    with pytest.raises(MeshStoppedError):
        c.value.stream()
    other = this_host().spawn_procs({"gpus": 1})
    c = other.spawn("stopped", Counter)
    with pytest.raises(TypeError, match="takes a string"):
        other.stop(reason=3)
    other.stop(reason="epoch 3 done").get(timeout=T)  # Monarch's stop(reason): what later calls are told
    with pytest.raises(MeshStoppedError, match=r"was stopped \(epoch 3 done\)"):
        c.value.call().get(timeout=T)
    with pytest.raises(MeshStoppedError, match=r"was stopped \(epoch 3 done\)"):
        c.value.choose().get(timeout=T)  # (no live actor to choose: the mesh says why)


class Sleeper(Actor):
    @endpoint
    def nap(self, seconds: float) -> str:
        time.sleep(seconds)
        return "rested"


@pytest.mark.timeout(60)
def test_a_call_cut_short_by_stop_fails_and_awaiting_stop_leaves_the_loop_free():
    """A call still running when ``stop`` kills its proc (after the 5 s a proc gets to finish) fails with
    MeshStoppedError, not silence; ``await procs.stop()`` lets the event loop run other tasks meanwhile."""
    mesh = this_host().spawn_procs({"gpus": 1})
    s = mesh.spawn("sleeper", Sleeper)
    s.initialized.get(timeout=T)
    pending = s.nap.call_one(60)
    time.sleep(0.2)  # (it runs)

    async def main() -> int:
        ticks = 0

        async def tick() -> None:
            nonlocal ticks
            while True:
                await asyncio.sleep(0.01)
                ticks += 1

        ticker = asyncio.ensure_future(tick())
        await asyncio.wait_for(mesh.stop(), 30)
        ticker.cancel()
        return ticks

    assert asyncio.run(main()) > 10  # the loop ran while the procs were given their 5 s
    with pytest.raises(MeshStoppedError, match=r"was stopped \(stopped by client\) before it answered"):
        pending.get(timeout=T)


@pytest.mark.timeout(60)
def test_spawn_on_this_proc_in_the_script_works_as_monarchs_getting_started_does():
    """``this_proc().spawn("counter", Counter, initial_value=0)`` (Monarch's first example): the actors run in
    the script's own process, a mesh of one with no dims; stopping it stops them, and a later this_proc() is
    a new one."""
    counter = this_proc().spawn("script_counter", Counter, 5)
    counter.incr.call_one().get(timeout=T)
    assert counter.value.call_one().get(timeout=T) == 6 and counter._shape.names == ()
    other = this_proc().spawn("script_counter_2", Counter)  # the same proc for the next one
    assert other._procs[0].addr == counter._procs[0].addr == this_proc()._procs[0].addr
    assert other.pid.call_one().get(timeout=T) == os.getpid()
    mesh = this_proc()
    mesh.stop().get(timeout=T)
    with pytest.raises(SupervisionError):
        counter.value.call_one().get(timeout=T)
    again = this_proc()
    assert again is not mesh and again.spawn("script_counter", Counter, 1).value.call_one().get(timeout=T) == 1


# ---- found by probing: each once hung, lost a value or gave a raw error ---------------------------
class Reentrant(Actor):
    @endpoint
    def f(self, x):
        return x

    @endpoint
    def me(self, mesh):
        return mesh

    @endpoint
    def calls_itself(self, me):
        return me.f.call_one(1).get(timeout=T)

    @endpoint
    async def awaits_itself(self, me):
        return await me.f.call_one(1)

    @endpoint
    def spawns_a_sibling(self, name: str):
        sibling = this_proc().spawn(name, Reentrant)
        sibling.initialized.get(timeout=T)
        return sibling.f.call_one(12).get(timeout=T)

    @endpoint(explicit_response_port=True)
    def answers_through_a_port(self, port, x):
        port.send(x + 1)


class Replier(Actor):
    """Answers calls through their explicit response port from elsewhere: another thread, another actor."""

    @endpoint(explicit_response_port=True)
    def from_a_thread(self, port):
        rank = context().actor_instance.rank.rank
        t = threading.Thread(target=port.send, args=(rank,))
        t.start()
        t.join()

    @endpoint(explicit_response_port=True)
    def through(self, port, helper):
        helper.answer_for.call_one(port, context().actor_instance.rank.rank).get(timeout=T)

    @endpoint
    def answer_for(self, port, value):
        port.send(value * 10)


def test_a_response_port_answers_for_its_rank_wherever_it_is_used(procs):
    # The port stamped its replies with the rank of whoever sent on it: the client's 0 from a thread, the
    # helper's rank when forwarded. call() then gave None for some ranks, or hung on a slice.
    r = procs.spawn("replier", Replier)
    assert r.from_a_thread.call().get(timeout=T).values() == [0, 1, 2, 3]
    helper = procs.spawn("replier_helper", Replier).slice(hosts=1, gpus=1)
    assert r.through.call(helper).get(timeout=T).values() == [0, 10, 20, 30]
    assert r.slice(gpus=1).through.call(helper).get(timeout=T).values() == [10, 30]
    assert sorted(f.get(timeout=T) for f in r.from_a_thread.stream()) == [0, 1, 2, 3]


class FailingInit(Actor):
    def __init__(self) -> None:
        raise ValueError("init fails on purpose")


def test_an_actor_waiting_on_itself_fails_at_once_and_a_sibling_spawned_in_an_endpoint_works(procs):
    r = procs.spawn("reentrant", Reentrant)
    one = r.slice(hosts=0, gpus=0)
    for method in (one.calls_itself, one.awaits_itself):
        with pytest.raises(ActorError, match="an actor calls itself and would wait for its own reply"):
            method.call_one(one).get(timeout=T)
    assert one.spawns_a_sibling.call_one("sibling").get(timeout=T) == 12
    assert r.answers_through_a_port.call(1).get(timeout=T).values() == [2] * 4


def test_spawn_errors_leave_nothing_behind(procs):
    with pytest.raises(TypeError, match="pickle"):
        procs.spawn("unpicklable_args", Counter, threading.Lock())
    assert procs.spawn("unpicklable_args", Counter, 5).value.call().get(timeout=T).values() == [5] * 4
    name = "failing_controller"
    try:
        with pytest.raises(ActorError, match="init fails on purpose"):
            get_or_spawn_controller(name, FailingInit).get(timeout=T)
        assert get_or_spawn_controller(name, Counter, 3).get(timeout=T).value.call_one().get(timeout=T) == 3
    finally:
        mesh = actor_mod._controllers.pop(name, None)
        if mesh is not None:
            ActorMesh.stop(mesh).get(timeout=T)
    with pytest.raises(TypeError, match="needs a subclass of Actor"):
        get_or_spawn_controller("not_an_actor", int)


def test_bad_input_to_meshes_and_endpoints_is_a_clear_error(counter):
    with pytest.raises(KeyError, match="has no dimension 'nope'; its dimensions are"):
        counter.size("nope")
    with pytest.raises(TypeError, match="needs a Port"):
        counter.value.send((), port="x")
    port, _ = Channel.open()
    with pytest.raises(TypeError, match="needs an exception"):
        port.exception("not an exception")
    with pytest.raises(TypeError, match="is a generator"):
        endpoint(lambda self: (yield 1))
    with pytest.raises(TypeError, match="unknown option"):
        endpoint(lambda self: 1, explicit_port=True)


def test_arguments_that_do_not_fit_an_endpoint_are_a_type_error_at_the_call(counter, procs):
    # Monarch binds them to the endpoint's signature at the call site: they failed later, on every rank, as an
    # ActorError (and a broadcast's only as a log line on each proc).
    one = counter.slice(hosts=0, gpus=1)
    calls = [lambda: counter.set.call(1, 2), lambda: one.set.call_one(), lambda: counter.set.choose(w=1),
             lambda: counter.set.broadcast(1, 2), lambda: counter.set.stream(), lambda: counter.set.send((1, 2)),
             lambda: as_endpoint(counter.plain_add).call(1, 2)]
    for call in calls:
        with pytest.raises(TypeError, match=r"Counter\.(set|plain_add)\(\): "):
            call()
    r = procs.spawn("replier_args", Replier)
    with pytest.raises(TypeError, match=r"Replier\.answer_for\(\): missing a required argument: 'value'"):
        r.answer_for.call(None)
    with pytest.raises(TypeError, match=r"Replier\.through\(\): too many positional"):
        r.through.call(1, 2)  # an explicit response port is not one of the caller's arguments
    assert counter.slice(hosts=0, gpus=0).set.call_one(v=7).get(timeout=T) is None  # keywords fit
    assert counter.slice(hosts=0, gpus=0).value.call_one().get(timeout=T) == 7


def test_monarchs_other_names(procs):
    from monarch_tensor.actor import gpu_direct_rdma_supported, local_proc_mesh

    assert gpu_direct_rdma_supported() is False  # no RDMA device on these machines
    mesh = local_proc_mesh(gpus=1)
    try:
        with pytest.raises(ActorError) as info:
            mesh.spawn("faulty_names", Faulty).fail_on.call_one(0).get(timeout=T)
        e = info.value
        assert e.message == "endpoint faulty_names.fail_on raised on rank 0: RuntimeError('rank 0 fails on purpose')"
        assert e.exception_formatted == e.traceback and "fails on purpose" in e.exception_formatted
    finally:
        mesh.stop().get(timeout=T)


def test_value_mesh_slices_and_compares(counter):
    who = counter.who.call().get(timeout=T)
    ranks = ValueMesh(who.shape, [w["rank"] for w in who.values()])
    assert ranks.slice(hosts=1).item(gpus=0) == 2
    assert ranks.slice(gpus=1).values() == [1, 3]
    assert ranks == ValueMesh(who.shape, [0, 1, 2, 3]) and ranks != ValueMesh(who.shape, [0, 1, 2, 4])
    # Monarch's from_indexed: (rank, value) pairs in any order, a later pair for a rank winning
    built = ValueMesh.from_indexed(who.shape, [(3, 3), (1, "x"), (0, 0), (2, 2), (1, 1)])
    assert built == ranks
    with pytest.raises(ValueError, match=r"no value for rank\(s\) \[1\]"):
        ValueMesh.from_indexed(who.shape, [(0, 0), (2, 2), (3, 3)])
    with pytest.raises(ValueError, match="rank 4 is not one of the 4 ranks"):
        ValueMesh.from_indexed(who.shape, [(4, 0)])
    with pytest.raises(TypeError, match=r"takes \(rank, value\) pairs"):
        ValueMesh.from_indexed(who.shape, [5])


def test_meshes_split_rename_and_flatten_like_monarchs(procs, counter, pids):
    sp = procs.split(gpus=("gpus_a", "gpus_b"), gpus_b=1)
    assert sp.sizes == {"hosts": 2, "gpus_a": 2, "gpus_b": 1} and len(sp) == 4 and sp.size(("hosts", "gpus_a")) == 4
    assert sp.extent == {"hosts": 2, "gpus_a": 2, "gpus_b": 1} and sp.extent.nelements == 4
    flat = procs.flatten("all")
    assert flat.sizes == {"all": 4}
    # actors spawned on a relabelled mesh run on the same procs, ranked by its shape
    who = flat.spawn("flat_counter", Counter).who.call().get(timeout=T)
    assert [w["pid"] for w in who.values()] == pids.values()
    assert [w["coords"] for w in who.values()] == [{"all": i} for i in range(4)]
    dp = counter.rename(hosts="dp", gpus="tp")
    assert dp.sizes == {"dp": 2, "tp": 2} and dp.size("tp") == 2
    vm = dp.slice(tp=1).pid.call().get(timeout=T)
    assert vm.sizes == {"dp": 2} and vm.values() == [pids.item(hosts=0, gpus=1), pids.item(hosts=1, gpus=1)]
    assert counter.flatten("all").slice(all=slice(1, 3)).pid.call().get(timeout=T).values() == pids.values()[1:3]
    # a value mesh relabels its values in the same order
    assert pids.flatten("r").values() == pids.values() and pids.flatten("r").sizes == {"r": 4}
    assert pids.rename(gpus="g").item(hosts=1, g=0) == pids.item(hosts=1, gpus=0)
    assert pids.split(hosts=("x", "y"), y=1).slice(y=0, gpus=1).values() == pids.slice(gpus=1).values()
    assert pids.extent == procs.extent and pids.size("gpus") == 2
    with pytest.raises(KeyError, match="actor mesh 'counter' has no dimension 'gpu'"):
        counter.size("gpu")
    with pytest.raises(KeyError, match="value mesh .* has no dimension 'gpu'"):
        pids.size("gpu")
    with pytest.raises(TypeError, match="has no dimension 'gpu'"):  # Monarch's slice raises a TypeError
        procs.slice(gpu=0)
    with pytest.raises(KeyError, match="no dimension 'gpu' to rename"):
        procs.rename(gpu="g")
    with pytest.raises(ValueError, match="cannot infer the sizes"):
        counter.split(gpus=("a", "b"))


def test_an_actor_mesh_that_came_back_through_pickling_knows_its_procs_stopped():
    mesh = this_host().spawn_procs({"gpus": 1})
    try:
        r = mesh.spawn("round_trip", Reentrant)
        back = r.me.call_one(r).get(timeout=T)
        assert back.f.call_one(3).get(timeout=T) == 3
    finally:
        mesh.stop().get(timeout=T)
    with pytest.raises(MeshStoppedError):
        back.f.call_one(3).get(timeout=T)


@pytest.mark.timeout(120)
def test_an_exception_class_of_the_script_reaches_the_caller_as_itself(tmp_path):
    """``ActorError.exception`` is the endpoint's exception, also when its class is defined in the script
    (``__main__``: it travels by value, as the actor class does), so ``isinstance`` works on it."""
    import subprocess
    import textwrap

    script = tmp_path / "script.py"
    script.write_text(textwrap.dedent('''
        from monarch_tensor.actor import Actor, endpoint, this_host
        from monarch_tensor.errors import ActorError

        class MyError(Exception):
            def __init__(self, msg, code=0):
                super().__init__(msg)
                self.code = code

        class A(Actor):
            @endpoint
            def boom(self):
                raise MyError("mine", 7)

        procs = this_host().spawn_procs(per_host={"gpus": 1})
        try:
            procs.spawn("a", A).boom.call_one().get(timeout=30)
        except ActorError as e:
            assert isinstance(e.exception, MyError) and e.exception.code == 7, repr(e.exception)
            print("CAUGHT", repr(e.exception))
        finally:
            procs.stop()
    '''))
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])))
    proc = subprocess.run([sys.executable, str(script)], cwd=root, env=env, capture_output=True, text=True,
                          timeout=100)
    assert proc.returncode == 0 and "CAUGHT MyError('mine')" in proc.stdout, proc.stdout + proc.stderr


class Answerer(Actor):
    @endpoint
    async def ping(self) -> str:
        return "pong"

    @endpoint
    def sync_ping(self) -> str:
        return "sync pong"


class Asker(Actor):
    @endpoint
    def ask(self, other, method: str) -> str:
        return getattr(other, method).call_one().get(timeout=20)

    @endpoint
    async def ask_blocking(self, other) -> str:
        return other.ping.call_one().get(timeout=20)

    @endpoint
    async def ask_awaiting(self, other) -> str:
        return await other.ping.call_one()


@pytest.mark.timeout(60)
def test_waiting_with_get_on_an_async_endpoint_of_the_same_proc_runs_it():
    """Actors of one proc share its event loop: an endpoint that blocks in ``.get()`` on another actor's
    endpoint there gets its answer, sync or async (the loop's turns run while it waits, as Monarch's
    separate threads would), from a sync endpoint and from an async one alike; awaiting works too."""
    procs = this_host().spawn_procs({"gpus": 1})
    try:
        b = procs.spawn("answerer", Answerer)
        a = procs.spawn("asker", Asker)
        assert a.ask.call_one(b, "sync_ping").get(timeout=T) == "sync pong"
        assert a.ask_awaiting.call_one(b).get(timeout=T) == "pong"
        assert a.ask.call_one(b, "ping").get(timeout=T) == "pong"
        assert a.ask_blocking.call_one(b).get(timeout=T) == "pong"
        assert a.ask_awaiting.call_one(b).get(timeout=T) == "pong"  # both still serve
    finally:
        procs.stop()


class Leaf(Actor):
    @endpoint
    def double(self, x: int) -> int:
        return 2 * x

    @endpoint
    def numbers(self, n: int, port: Port[int]) -> None:
        for i in range(n):
            port.send(i)


class FanOut(Actor):
    """Waits on replies from threads of its own making, as a user's code does with a thread pool."""

    def __init__(self, leaf, note: str = "") -> None:
        self.leaf = leaf
        self.note = note  # where __cleanup__ writes what it got

    @endpoint
    def fan(self, n: int) -> list:
        from concurrent.futures import ThreadPoolExecutor

        def chain(i):  # a few calls one after the other on each thread
            return [self.leaf.double.call_one(i * 10 + k).get(timeout=T) for k in range(3)]

        with ThreadPoolExecutor(4) as pool:
            return list(pool.map(chain, range(n)))

    @endpoint
    def stream(self, n: int) -> list:
        """A thread reads a channel's values while this endpoint waits for it: they come in order."""
        from concurrent.futures import ThreadPoolExecutor

        def read():
            port, recv = Channel.open()
            self.leaf.numbers.call_one(n, port).get(timeout=T)
            return [recv.recv().get(timeout=T) for _ in range(n)]

        with ThreadPoolExecutor(1) as pool:
            return pool.submit(read).result(timeout=T)

    @endpoint
    def ping(self) -> str:
        return "pong"

    async def __cleanup__(self, exc) -> None:
        if self.note:
            got = await self.leaf.double.call_one(21)
            with open(self.note, "w") as f:
                f.write(str(got))


@pytest.mark.timeout(120)
def test_threads_of_an_endpoint_get_their_replies_while_it_waits_for_them(tmp_path):
    """A proc's messages are received by its own thread, which runs the endpoints. A thread an endpoint
    started that waits on a reply while the endpoint waits on that thread, and an async ``__cleanup__``
    awaiting a call (on a loop of its own while the proc's thread stops the actor), get their replies:
    they receive them while the proc's thread is busy (``Mailbox.receive_for``); before, each waited for
    its timeout (the endpoint failed, the stop timed out). Calls to the proc's actors that came meanwhile run after, and a channel's values
    arrive in order."""
    procs = this_host().spawn_procs({"gpus": 2})
    try:
        leaf = procs.slice(gpus=1).spawn("leaf", Leaf)
        note = tmp_path / "cleanup"
        fan = procs.slice(gpus=0).spawn("fan", FanOut, leaf, str(note))
        other = procs.slice(gpus=0).spawn("other", FanOut, leaf)
        calls = [fan.fan.call_one(6) for _ in range(3)] + [other.ping.call_one() for _ in range(5)]
        assert calls[0].get(timeout=T) == [[2 * (i * 10 + k) for k in range(3)] for i in range(6)]
        assert [c.get(timeout=T) for c in calls[1:3]] == [calls[0].get()] * 2
        assert [c.get(timeout=T) for c in calls[3:]] == ["pong"] * 5
        assert fan.stream.call_one(200).get(timeout=T) == list(range(200))
        fan.stop().get(timeout=T)
        assert note.read_text() == "42"
    finally:
        procs.stop().get(timeout=T)


class Stoppable(Actor):
    def __init__(self) -> None:
        self.n = 0

    @endpoint
    def inc(self) -> int:
        self.n += 1
        return self.n

    @endpoint
    async def slow(self, seconds: float) -> str:
        await asyncio.sleep(seconds)
        return "finished"

    def __cleanup__(self) -> None:
        print(f"cleanup {current_rank().rank}", flush=True)


@pytest.mark.timeout(60)
def test_stopping_an_actor_mesh_keeps_its_procs_and_fails_later_calls():
    """Monarch's ``ActorMesh.stop()``: in order with the calls, so a running call and those sent before it
    finish; later calls fail with the reason; the procs keep running, and the name may be spawned again."""
    procs = this_host().spawn_procs({"gpus": 2})
    try:
        a = procs.spawn("stoppable", Stoppable)
        assert a.inc.call().get(timeout=T).values() == [1, 1]
        running, before = a.slow.call(0.5), a.inc.call()
        a.stop("no longer needed").get(timeout=T)
        assert running.get(timeout=T).values() == ["finished"] * 2 and before.get(timeout=T).values() == [2, 2]
        with pytest.raises(ActorError, match=r"actor 'stoppable' was stopped \(no longer needed\)"):
            a.inc.call().get(timeout=T)
        with pytest.raises(ActorError, match="was stopped"):
            a.slice(gpus=1).inc.call_one().get(timeout=T)
        with pytest.raises(SupervisionError, match="was stopped"):  # Monarch's error for it
            a.inc.call().get(timeout=T)
        assert a.stop().get(timeout=T) is None  # stopping twice is harmless
        again = procs.spawn("stoppable", Stoppable)
        assert again.inc.call().get(timeout=T).values() == [1, 1]  # a new actor, on the same procs
        with pytest.raises(TypeError, match="takes a string"):
            again.stop(reason=5)
    finally:
        procs.stop()


class Trainer(Actor):
    """Endpoints named like the mesh's own methods and properties."""

    def __init__(self) -> None:
        self.stopped = False

    @endpoint
    def stop(self) -> str:
        self.stopped = True
        return "trainer stopped"

    @endpoint
    def size(self) -> int:
        return 123

    @endpoint
    def initialized(self) -> str:
        return "init endpoint"

    @endpoint
    def is_stopped(self) -> bool:
        return self.stopped

    @endpoint
    def stop_of(self, trainers: ActorMesh) -> list:
        """Call the ``stop`` endpoint of a mesh that came here pickled, sliced there by the mesh's own ``slice``."""
        return ActorMesh.slice(trainers, gpus=1).stop.call().get(timeout=T).values()


@pytest.mark.timeout(60)
def test_an_endpoint_named_like_a_mesh_method_is_the_endpoint():
    """As in Monarch, whose ActorMesh sets every endpoint as an attribute of the mesh: ``t.stop`` is the
    actor's ``stop`` endpoint (it was ActorMesh.stop, which ``t.stop()`` ran, stopping the actors), on the
    mesh, its slices and a mesh unpickled in another proc; the mesh's own stays reachable on the class."""
    procs = this_host().spawn_procs({"gpus": 2})
    try:
        t = procs.spawn("trainer", Trainer)
        assert t.size.call().get(timeout=T).values() == [123, 123]
        assert t.initialized.call().get(timeout=T).values() == ["init endpoint"] * 2
        one = ActorMesh.slice(t, gpus=0)
        assert one.stop.call_one().get(timeout=T) == "trainer stopped"
        assert t.is_stopped.call().get(timeout=T).values() == [True, False]
        helper = procs.spawn("trainer_helper", Trainer)
        assert ActorMesh.slice(helper, gpus=0).stop_of.call_one(t).get(timeout=T) == ["trainer stopped"]
        assert t.is_stopped.call().get(timeout=T).values() == [True, True]
        assert ActorMesh.size(t) == 2
        ActorMesh.stop(t, "done").get(timeout=T)  # the mesh's own stop: the actors stop
        with pytest.raises(ActorError, match="was stopped"):
            t.is_stopped.call().get(timeout=T)
    finally:
        procs.stop()


class Sibling(Actor):
    @endpoint
    def name(self) -> str:
        return context().actor_instance.name


class Compat(Actor):
    """Monarch's spellings: ``Port[int]`` hints, ``actor_instance``'s attributes, ``__cleanup__(self, exc)``."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    @endpoint
    def instance(self) -> tuple:
        inst = context().actor_instance
        sibling = inst.proc.spawn("sibling", Sibling)  # beside this actor, on its proc
        return (inst.name, inst.class_name, inst.actor_id, inst.proc_id, sibling.name.call_one().get(timeout=20),
                os.environ.get("COMPAT_ENV"), os.environ.get("COMPAT_SETUP"))

    @endpoint
    def answer(self, port: Port[int]) -> None:
        port.send(42)

    def __cleanup__(self, exc) -> None:
        with open(self.marker, "w") as f:
            f.write(f"exc={exc!r} rank={current_rank().rank}")


class AsyncCleanup(Actor):
    def __init__(self, marker: str) -> None:
        self.marker = marker

    async def __cleanup__(self, exc) -> None:
        await asyncio.sleep(0.01)
        with open(self.marker, "w") as f:
            f.write("async cleanup ran")


def _compat_setup() -> None:
    os.environ["COMPAT_SETUP"] = "ran"


@pytest.mark.timeout(60)
def test_monarch_spellings_of_proc_mesh_port_hints_instance_and_cleanup(tmp_path):
    procs = proc_mesh(gpus=1, env={"COMPAT_ENV": "given"}, setup=_compat_setup)  # Monarch's env= and setup=
    try:
        c = procs.spawn("compat", Compat, str(tmp_path / "cleanup"))
        name, cls, actor_id, proc_id, sibling, env, setup = c.instance.call_one().get(timeout=T)
        assert (name, cls, sibling, env, setup) == ("compat", f"{__name__}.Compat", "sibling", "given", "ran")
        assert actor_id == f"{proc_id}/compat[0]" and proc_id == procs._procs[0].addr
        port, receiver = Channel.open()
        c.answer.call_one(port).get(timeout=T)
        assert receiver.recv().get(timeout=T) == 42
        a = procs.spawn("async_cleanup", AsyncCleanup, str(tmp_path / "async"))
        a.initialized.get(timeout=T)  # (a stop during the constructor is acknowledged before __cleanup__ runs)
        c.stop().get(timeout=T)
        a.stop().get(timeout=T)
        assert (tmp_path / "cleanup").read_text() == "exc=None rank=0"  # exc is None on a normal stop
        assert (tmp_path / "async").read_text() == "async cleanup ran"
    finally:
        procs.stop()
    with pytest.raises(TypeError, match="string values"):
        proc_mesh(gpus=1, env={"A": 1})


class Draws(Actor):
    @endpoint
    def draw(self) -> float:
        import numpy as np

        return float(np.random.rand())


@pytest.mark.timeout(60)
def test_procs_draw_their_own_numpy_random_numbers():
    """Procs are forked from a template that imported numpy: each reseeds it, as a fresh process would (every
    proc drew the same numbers, in every mesh after the first)."""
    draws = []
    for _ in range(2):
        procs = this_host().spawn_procs({"gpus": 3})
        try:
            draws += procs.spawn("draws", Draws).draw.call().get(timeout=T).values()
        finally:
            procs.stop()
    assert len(set(draws)) == 6, draws


def _signature_source(n_pos: int, n_defaults: int, var_args: bool, kw_only: list[bool], var_kw: bool) -> str:
    params = ["self"] + [f"p{i}" + ("=0" if i >= n_pos - n_defaults else "") for i in range(n_pos)]
    if var_args:
        params.append("*args")
    elif kw_only:
        params.append("*")
    params += [f"k{i}" + ("=0" if has_default else "") for i, has_default in enumerate(kw_only)]
    if var_kw:
        params.append("**kw")
    return f"def method({', '.join(params)}):\n    return None\n"


def test_a_calls_arguments_are_checked_as_binding_them_would():
    """A call's arguments are checked at the call (a TypeError, as Monarch's); a call without keywords by
    their count alone, which must refuse exactly the calls that binding them to the signature refuses."""
    import inspect

    from hypothesis import given, settings
    from hypothesis import strategies as st

    from monarch_tensor.actor import _check_arguments, _signature

    @settings(max_examples=150, deadline=None)
    @given(n_pos=st.integers(0, 3), n_defaults=st.integers(0, 3), var_args=st.booleans(),
           kw_only=st.lists(st.booleans(), max_size=2), var_kw=st.booleans(), n_args=st.integers(0, 5),
           keywords=st.lists(st.sampled_from(["p0", "p2", "k0", "zz"]), max_size=2, unique=True))
    def check(n_pos, n_defaults, var_args, kw_only, var_kw, n_args, keywords):
        ns: dict = {}
        exec(_signature_source(n_pos, min(n_defaults, n_pos), var_args, kw_only, var_kw), ns)
        cls = type("Checked", (Actor,), {"method": endpoint(ns["method"])})
        args, kwargs = tuple(range(n_args)), dict.fromkeys(keywords, 1)
        try:
            inspect.signature(ns["method"]).bind(None, *args, **kwargs)
            binds = True
        except TypeError:
            binds = False
        try:
            _check_arguments(cls, "method", _signature(cls, "method", "method"), args, kwargs)
            passes = True
        except TypeError as e:
            assert str(e).startswith("Checked.method(): ")
            passes = False
        assert passes == binds

    check()
