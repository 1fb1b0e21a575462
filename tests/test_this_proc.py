"""The script's own process hosts actors, as Monarch's (issue 41): ``this_proc().spawn(...)`` and
``get_or_spawn_controller(...)`` in a script run actors on an in-process runtime that shares the script's
memory; a controller is one per job, from the script and from any actor."""

import asyncio
import os
import subprocess
import sys
import textwrap
import threading
import time

import pytest

import monarch_tensor.actor as actor_mod
from monarch_tensor.actor import (
    Actor,
    ActorError,
    ActorMesh,
    SupervisionError,
    concurrent_endpoint,
    context,
    endpoint,
    get_or_spawn_controller,
    this_host,
    this_proc,
)

T = 60
SEEN: list = []  # appended to by in-process actors: the script sees it
RELEASE = threading.Event()  # what a blocked in-process endpoint waits for


class Local(Actor):
    def __init__(self, tag: str = "") -> None:
        self.tag = tag
        self.init_thread = threading.current_thread().name
        self.init_proc = context().actor_instance.proc_id  # (its constructor runs as on a proc: in its context)

    @endpoint
    def record(self, value) -> int:
        SEEN.append(value)
        return os.getpid()

    @endpoint
    def where(self) -> tuple:
        return this_proc()._procs[0].addr, context().actor_instance.proc_id, self.init_proc

    @endpoint
    def threads(self) -> tuple:
        return self.init_thread, threading.current_thread().name

    @endpoint
    def ping(self, remote) -> tuple:
        return remote.echo.call_one(("sync", self.tag)).get(timeout=T)

    @endpoint
    async def aping(self, remote) -> tuple:
        return await remote.echo.call_one(("async", self.tag))

    @endpoint
    def blocks(self) -> str:
        return "released" if RELEASE.wait(T) else "timed out"

    @endpoint
    def exits(self) -> None:
        raise SystemExit(3)


class Remote(Actor):
    """An actor on a proc of its own."""

    @endpoint
    def echo(self, x):
        return x, os.getpid()

    @endpoint
    def where(self) -> str:
        return this_proc()._procs[0].addr

    @endpoint
    def calls_back(self, local) -> int:
        return local.record.call_one("from a proc").get(timeout=T)

    @endpoint
    def store_value(self, key: str, name: str = "mt_test_store"):
        store = get_or_spawn_controller(name, Store).get(timeout=T)
        return store.get.call_one(key).get(timeout=T), store.who.call_one().get(timeout=T)


class Store(Actor):
    def __init__(self) -> None:
        self.d: dict = {}

    @endpoint
    def put(self, key: str, value) -> None:
        self.d[key] = value

    @endpoint
    def get(self, key: str):
        return self.d.get(key)

    @endpoint
    def who(self) -> tuple:
        return context().actor_instance.actor_id, os.getpid()

    @endpoint
    def spawns_beside(self) -> ActorMesh:
        return context().actor_instance.proc_mesh.spawn("beside", Local)


class Tidy(Actor):
    @endpoint
    def ready(self) -> bool:
        return True

    def __cleanup__(self, exc) -> None:
        SEEN.append(("cleanup", threading.current_thread().name))


class Gate(Actor):
    def __init__(self) -> None:
        self.opened = asyncio.Event()

    @concurrent_endpoint
    async def passes(self) -> str:
        await self.opened.wait()
        return "passed"

    @endpoint
    async def open(self) -> None:
        self.opened.set()


class FailsInInit(Actor):
    def __init__(self) -> None:
        raise ValueError("constructor fails on purpose")


@pytest.fixture(scope="module")
def remote():
    procs = this_host().spawn_procs(per_host={"gpus": 1})
    yield procs.spawn("remote", Remote)
    procs.stop().get(timeout=T)


@pytest.fixture(scope="module")
def local():
    mesh = this_proc().spawn("local", Local, "L")
    yield mesh
    ActorMesh.stop(mesh).get(timeout=T)


def test_in_process_actors_share_the_scripts_memory_and_run_on_its_runtime_thread(local):
    SEEN.clear()
    assert local.record.call_one([1, 2]).get(timeout=T) == os.getpid()
    assert SEEN == [[1, 2]]  # the very list of this module, not a copy
    init_thread, endpoint_thread = local.threads.call_one().get(timeout=T)
    assert endpoint_thread == "monarch-tensor-actors" and init_thread.startswith("monarch-init-")


def test_this_proc_is_the_scripts_process_in_the_script_and_in_its_actors_and_its_own_proc_elsewhere(local, remote):
    here = this_proc()
    assert here is this_proc() and here._shape.names == ()
    addr = here._procs[0].addr
    assert local.where.call_one().get(timeout=T) == (addr, addr, addr)
    elsewhere = remote.where.call_one().get(timeout=T)
    assert elsewhere != addr and elsewhere == remote._procs[0].addr


def test_one_controller_per_job_from_the_script_and_from_an_actor_on_a_proc(remote):
    store = get_or_spawn_controller("mt_test_store", Store).get(timeout=T)
    try:
        assert store._procs[0].addr == this_proc()._procs[0].addr  # in the script's process
        store.put.call_one("k", 41).get(timeout=T)
        assert get_or_spawn_controller("mt_test_store", Store).get(timeout=T) is store
        ident = store.who.call_one().get(timeout=T)
        assert ident[1] == os.getpid()
        assert remote.store_value.call_one("k").get(timeout=T) == (41, ident)  # the same actor, its state
        # Monarch's test_context_proc_mesh_in_controller_spawns_actor_in_client_os_process
        beside = store.spawns_beside.call_one().get(timeout=T)
        assert beside.record.call_one("beside").get(timeout=T) == os.getpid()
        # one that an actor on a proc asks for first: spawned in the script's process too, and the script's then
        first_value, first_ident = remote.store_value.call_one("k", "mt_test_store_2").get(timeout=T)
        assert first_value is None and first_ident[1] == os.getpid()
        assert get_or_spawn_controller("mt_test_store_2", Store).get(timeout=T).who.call_one().get(
            timeout=T) == first_ident
    finally:
        for name in ("mt_test_store", "mt_test_store_2"):
            mesh = actor_mod._controllers.pop(name, None)
            if mesh is not None:
                ActorMesh.stop(mesh).get(timeout=T)


def test_an_in_process_actor_calls_an_actor_on_a_proc_and_is_called_back(local, remote):
    remote_pid = remote.echo.call_one(0).get(timeout=T)[1]
    assert remote_pid != os.getpid()
    assert local.ping.call_one(remote).get(timeout=T) == (("sync", "L"), remote_pid)
    assert local.aping.call_one(remote).get(timeout=T) == (("async", "L"), remote_pid)
    assert remote.calls_back.call_one(local).get(timeout=T) == os.getpid()


def test_a_failing_constructor_is_the_callers_error_and_a_base_exception_kills_the_actor(monkeypatch):
    bad = this_proc().spawn("fails_in_init", FailsInInit)
    with pytest.raises(ActorError, match="constructor fails on purpose"):
        bad.initialized.get(timeout=T)
    faults = []
    monkeypatch.setattr(actor_mod, "unhandled_fault_hook", faults.append)
    doomed = this_proc().spawn("doomed", Local)
    with pytest.raises(SupervisionError, match="SystemExit"):
        doomed.exits.call_one().get(timeout=T)
    with pytest.raises(ActorError, match="was stopped"):
        doomed.record.call_one(0).get(timeout=T)
    deadline = time.monotonic() + T  # (the owner's supervision hears of it on its own thread)
    while not faults and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(faults) == 1 and "SystemExit" in str(faults[0])


def test_a_blocked_sync_endpoint_leaves_the_scripts_main_thread_free(local, remote):
    RELEASE.clear()
    pending = local.blocks.call_one()
    assert remote.echo.call_one("meanwhile").get(timeout=T)[0] == "meanwhile"  # the script goes on
    assert not pending.done()
    RELEASE.set()
    assert pending.get(timeout=T) == "released"


def test_an_async_call_of_an_in_process_actor_can_be_awaited_and_a_concurrent_endpoint_lets_others_run(local):
    async def main():
        return await local.record.call_one("awaited")

    assert asyncio.run(main()) == os.getpid()
    gate = this_proc().spawn("gate", Gate)
    waiting = gate.passes.call_one()
    gate.open.call_one().get(timeout=T)  # (taken while `passes` waits for it)
    assert waiting.get(timeout=T) == "passed"
    ActorMesh.stop(gate).get(timeout=T)


def test_stopping_this_proc_runs_its_actors_cleanup_and_a_later_this_proc_is_a_new_one(local):
    SEEN.clear()
    mesh = this_proc()
    tidy = mesh.spawn("tidy", Tidy)
    assert tidy.ready.call_one().get(timeout=T)
    mesh.stop().get(timeout=T)
    assert ("cleanup", "monarch-tensor-actors") in SEEN
    with pytest.raises(SupervisionError):  # (MeshStoppedError)
        tidy.ready.call_one().get(timeout=T)
    again = this_proc()
    assert again is not mesh and again._procs[0].addr != mesh._procs[0].addr
    assert again.spawn("tidy", Tidy).ready.call_one().get(timeout=T)


SCRIPT = """
    import logging
    import os
    import sys
    from monarch_tensor.actor import Actor, endpoint, get_or_spawn_controller, this_proc

    logging.basicConfig(stream=sys.stdout, level=logging.INFO, format="%(message)s")

    SEEN = []

    class Counter(Actor):
        def __init__(self):
            self.n = 0

        @endpoint
        def incr(self):
            self.n += 1
            SEEN.append(self.n)
            logging.getLogger("script").info("counted")
            return os.getpid()

        def __cleanup__(self, exc):
            print("cleanup ran", self.n, flush=True)

    c = this_proc().spawn("counter", Counter)
    assert c.incr.call_one().get(timeout=60) == os.getpid()
    ctl = get_or_spawn_controller("ctl", Counter).get(timeout=60)
    ctl.incr.call_one().get(timeout=60)
    print("seen", SEEN, flush=True)
"""


def test_a_script_that_spawned_on_this_proc_exits_cleanly_after_its_actors_cleanup(tmp_path):
    path = tmp_path / "script.py"
    path.write_text(textwrap.dedent(SCRIPT))
    p = subprocess.run([sys.executable, str(path)], capture_output=True, text=True, timeout=T)
    assert p.returncode == 0, p.stderr
    lines = p.stdout.splitlines()
    assert "seen [1, 1]" in lines  # __main__'s own list, appended to by both actors
    assert lines.count("cleanup ran 1") == 2 and lines.index("seen [1, 1]") < lines.index("cleanup ran 1")
    # (log records its actors write carry their identity, as on a proc)
    assert "[actor=<root>.<__main__.Counter counter{}>] counted" in lines
    assert "[actor=<root>.<__main__.Counter ctl{}>] counted" in lines
