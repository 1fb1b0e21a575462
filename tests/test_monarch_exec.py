"""Monarch's execution model on one shared proc (issue 41): what runs while an endpoint or a constructor
blocks, how a proc stops."""

import asyncio
import atexit
import os
import threading
import time

import pytest

from monarch_tensor.actor import (
    Actor,
    ActorError,
    ActorMesh,
    Channel,
    SupervisionError,
    concurrent_endpoint,
    endpoint,
    get_or_spawn_controller,
    this_host,
)

T = 60


class Counter(Actor):
    def __init__(self, v: int) -> None:
        self.v = v

    @endpoint
    async def value(self) -> int:
        await asyncio.sleep(0.01)  # (a timer of the proc's loop)
        return self.v


class Relay(Actor):
    @endpoint
    async def value_via(self, counter) -> int:
        return await counter.value.call_one() + 1


class SyncActor(Actor):
    @endpoint
    def sync_endpoint(self, counter) -> int:
        return counter.value.choose().get(timeout=T)

    @endpoint
    def sync_via(self, relay, counter) -> int:
        return relay.value_via.call_one(counter).get(timeout=T)

    @endpoint
    def calls_itself(self, me) -> int:
        return me.sync_endpoint.call_one(None).get(timeout=T)


PROCS = {"gpus": 1}  # conftest's procs fixture: one proc


def test_a_sync_endpoint_waits_on_an_async_endpoint_of_its_proc(procs):
    # Monarch's test_sync_actor and test_choose: a sync endpoint calling .get() on another actor's async
    # endpoint on the same proc gets its value; here also through a second async actor on that proc.
    counter = procs.spawn("counter", Counter, 5)
    relay = procs.spawn("relay", Relay)
    sync = procs.spawn("sync", SyncActor)
    assert sync.sync_endpoint.choose(counter).get(timeout=T) == 5
    assert sync.sync_via.call_one(relay, counter).get(timeout=T) == 6
    # The one wait that would deadlock, an actor waiting on its own reply, is a clear error at once.
    with pytest.raises(ActorError, match="calls itself"):
        sync.calls_itself.call_one(sync).get(timeout=T)
    assert sync.sync_endpoint.call_one(counter).get(timeout=T) == 5


class Pinger(Actor):
    @endpoint
    def ping(self) -> int:
        return 1


class Looper(Actor):
    @endpoint
    def ping_many(self, pinger, n: int) -> int:
        return sum(pinger.ping.call_one().get(timeout=T) for _ in range(n))


def test_a_sync_endpoint_waits_in_a_loop_while_its_proc_gets_other_calls(procs, capfd):
    # A wait run from inside the proc's message reader, with messages for the proc arriving throughout: the
    # loop's turns inside the wait read them with a reader of their own (the reader's context cannot be
    # entered twice), so every call is answered and the proc prints no error.
    pinger = procs.spawn("pinger", Pinger)
    looper = procs.spawn("looper", Looper)
    other = procs.spawn("other", Counter, 3)
    for _ in range(3):
        looped = looper.ping_many.call_one(pinger, 300)
        others = [other.value.call_one() for _ in range(200)]
        assert looped.get(timeout=T) == 300
        assert sum(f.get(timeout=T) for f in others) == 600
    err = capfd.readouterr().err
    assert "Traceback" not in err and "already entered" not in err, err


class RunForeverOnInit(Actor):
    """Monarch's RunForeverOnInitActor: its constructor spawns a sibling, hands it out, and never returns."""

    def __init__(self, procs, port) -> None:
        counter = procs.spawn("counter_from_init", Counter, 42)
        port.send(counter)
        threading.Event().wait()

    @endpoint
    def unreachable(self) -> None:
        pass


def test_an_init_that_never_returns_leaves_its_proc_serving(procs):
    # Monarch's test_run_forever_on_init.
    port, receiver = Channel.open()
    forever = procs.spawn("forever", RunForeverOnInit, procs, port)
    counter = receiver.recv().get(timeout=T)
    assert counter.value.call_one().get(timeout=T) == 42
    sync = procs.spawn("sync_beside_forever", SyncActor)
    assert sync.sync_endpoint.call_one(counter).get(timeout=T) == 42
    forever.stop().get(timeout=T)
    with pytest.raises(SupervisionError):
        forever.unreachable.call_one().get(timeout=T)


class Incr(Actor):
    def __init__(self) -> None:
        self.c = 0

    @endpoint
    def incr(self, x) -> int:
        self.c += 1
        return self.c - 1


def test_an_engine_call_to_an_actor_keeps_its_place_among_direct_calls(procs):
    # Monarch's test_actor_tensor_ordering: calls with mesh tensors go through the tensor engine's stream,
    # calls without go straight to the actor; the actor runs them in the order they were made (the engine's
    # worker is constructed in order with the messages, while user actors' constructors run on threads).
    import torch

    with procs.activate():
        counter = procs.spawn("incr", Incr)
        results = []
        for _ in range(3):
            results.append(counter.incr.call(torch.ones(())))
            results.append(counter.incr.call(1))
        assert [r.get(timeout=T).item(gpus=0) for r in results] == list(range(6))


class AddWithState(Actor):
    def __init__(self, state) -> None:
        if state.dim() != 0:
            raise ValueError(f"a scalar state, please: got shape {tuple(state.shape)}")
        self.state = state

    @endpoint
    def forward(self, x):
        return x + self.state


def test_mesh_tensors_given_to_a_constructor_arrive_as_each_ranks_own(procs):
    # Monarch's test_actor_with_tensors: spawned inside activate() with a mesh tensor, an actor's constructor
    # gets its rank's local tensor, as its endpoints do; a constructor that raises fails the spawn as ever.
    import torch

    with procs.activate():
        adder = procs.spawn("adder", AddWithState, torch.ones(()) * 2)
        y = torch.ones(())
        out = adder.forward.call(y).get(timeout=T).item(gpus=0)
        assert type(out) is torch.Tensor and out.item() == 3.0
        bad = procs.spawn("bad_adder", AddWithState, torch.ones(2))
        with pytest.raises(ActorError, match="a scalar state"):
            bad.initialized.get(timeout=T)


class Rooted(Actor):
    """Monarch's SpawningActorFromEndpointActor."""

    def __init__(self, root: str = "None") -> None:
        self._root = root

    @endpoint
    async def return_root(self) -> str:
        return self._root

    @endpoint
    async def spawning_from_endpoint(self, name: str, root: str) -> None:
        await get_or_spawn_controller(name, Rooted, root=root)

    @endpoint
    def root_of(self, name: str) -> str:
        return get_or_spawn_controller(name, Rooted).get(timeout=T).return_root.call_one().get(timeout=T)


@pytest.fixture
def controllers_stopped_after():
    """The controllers a test spawns live as long as the script (one per name and job): stopped after it, so
    that later tests see no procs of theirs (a host's sync reaches every live proc)."""
    import monarch_tensor.actor as actor_mod

    before = set(actor_mod._controllers)
    yield
    for name in set(actor_mod._controllers) - before:
        ActorMesh.stop(actor_mod._controllers.pop(name)).get(timeout=T)


def test_get_or_spawn_controller_inside_an_actor_finds_the_jobs_one(procs, controllers_stopped_after):
    # Monarch's test_get_or_spawn_controller_inside_actor_endpoint: a controller spawned from inside an actor
    # is the job's, which the script then gets; and an actor asking for it gets that one, not a second.
    first = get_or_spawn_controller("mt_ctl_first", Rooted).get(timeout=T)
    first.spawning_from_endpoint.call_one("mt_ctl_second", "mt_ctl_first").get(timeout=T)
    second = get_or_spawn_controller("mt_ctl_second", Rooted).get(timeout=T)
    assert second.return_root.call_one().get(timeout=T) == "mt_ctl_first"
    asker = procs.spawn("asker", Rooted, "asker")
    assert asker.root_of.call_one("mt_ctl_second").get(timeout=T) == "mt_ctl_first"
    assert asker.root_of.call_one("mt_ctl_first").get(timeout=T) == "None"


def _write(path: str, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)


class _Finalized:
    """Monarch's ObjectWithFinalizer: writes its file when it is finalized (the file opened up front, as
    ``open`` itself may be gone by then)."""

    def __init__(self, path: str) -> None:
        self._file = open(path, "w")

    def __del__(self) -> None:
        self._file.write("finalized")
        self._file.close()


_finalized_at_exit = None  # set in a proc: only the interpreter's shutdown frees it


class Stoppable(Actor):
    def __init__(self, path: str) -> None:
        global _finalized_at_exit
        self.file = open(path + ".order", "w")
        self.unblock = asyncio.Event()
        _finalized_at_exit = _Finalized(path + ".del")
        atexit.register(_write, path + ".atexit", "ran")

    @concurrent_endpoint(explicit_response_port=True)
    async def run(self, port) -> None:
        port.send("started")
        try:
            await self.unblock.wait()
        finally:
            self.file.write("task_cancelled\n")
            self.file.flush()

    async def __cleanup__(self, exc) -> None:
        self.file.write("cleanup\n")
        self.file.close()


def _read_when_there(path: str, timeout: float = 20) -> str:
    deadline = time.monotonic() + timeout
    while not os.path.exists(path) and time.monotonic() < deadline:
        time.sleep(0.05)
    with open(path) as f:
        return f.read()


def test_a_stopped_proc_cancels_its_tasks_then_cleans_up_then_runs_its_exit(tmp_path):
    # Monarch's test_actor_loop_shutdown_cancels_concurrent_endpoint_before_cleanup and
    # test_del_runs_on_proc_mesh_stop, and an atexit hook as a process that exits runs it.
    own = this_host().spawn_procs(per_host={"gpus": 1})
    base = str(tmp_path / "stop")
    actor = own.spawn("stoppable", Stoppable, base)
    assert actor.run.call_one().get(timeout=T) == "started"
    own.stop().get(timeout=T)
    assert _read_when_there(base + ".atexit") == "ran"
    deadline = time.monotonic() + 20
    while _read_when_there(base + ".del") != "finalized" and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _read_when_there(base + ".del") == "finalized"
    assert _read_when_there(base + ".order") == "task_cancelled\ncleanup\n"
