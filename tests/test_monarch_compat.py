"""Monarch's behaviours that its own tests pin (issue 41), on one shared proc mesh: what kills an actor, what
its caller and its owner's supervision see."""

import asyncio
import os
import threading
import time
import types

import pytest

from monarch_tensor.actor import (
    Actor,
    ActorError,
    SupervisionError,
    concurrent_endpoint,
    current_rank,
    endpoint,
    this_host,
)
from monarch_tensor.errors import ActorFailedError
from monarch_tensor.job import JobState, JobTrait

T = 60


class ActorFailure(BaseException):
    """Monarch's tests' ``ActorFailureError``: a BaseException that is not an Exception."""


class Fatal(Actor):
    def __init__(self) -> None:
        self.cleaned = False

    @endpoint
    def exits(self, code: int) -> None:
        raise SystemExit(code)

    @endpoint
    async def fails_async(self) -> None:
        raise ActorFailure("simulated actor failure")

    @endpoint
    def raises(self) -> None:
        raise ValueError("an ordinary error")

    @endpoint(explicit_response_port=True)
    def raises_with_port(self, port) -> None:
        raise ValueError("raised instead of port.send")

    @endpoint(explicit_response_port=True)
    async def raises_with_port_async(self, port) -> None:
        raise ValueError("raised instead of port.send (async)")

    @concurrent_endpoint(explicit_response_port=True)
    async def raises_with_port_concurrent(self, port) -> None:
        raise ValueError("raised instead of port.send (concurrent)")

    @endpoint(explicit_response_port=True)
    def answers_then_raises(self, port) -> None:
        port.send("answered")
        raise ValueError("raised after answering")

    @endpoint
    def ping(self) -> str:
        return "pong"


class _Supervising(Actor):
    """Records the supervision events of its children (``self.failures``) and handles them."""

    @endpoint
    def seen(self) -> list:
        return self.failures

    def __supervise__(self, failure) -> bool:
        self.failures.append(str(failure))
        return True


class Parent(_Supervising):
    """Owns a mesh of ``Fatal`` actors and records what its ``__supervise__`` sees."""

    def __init__(self, procs) -> None:
        self.child = procs.spawn("fatal_child", Fatal)
        self.failures = []

    @endpoint
    def kill_child(self) -> str:
        try:
            self.child.exits.call_one(4).get(timeout=T)
        except SupervisionError as e:
            return type(e).__name__
        return "no error"


PROCS = {"gpus": 1}  # conftest's procs fixture: one proc


def _wait_for(cond, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not cond() and time.monotonic() < deadline:
        time.sleep(0.05)


@pytest.mark.parametrize("method", ["exits", "fails_async"])
def test_a_base_exception_in_an_endpoint_kills_the_actor(procs, faults, method):
    # Monarch's test_base_exception_handling: the call raises a SupervisionError ("The actor ... and all its
    # descendants have failed"), later calls fail, the owner's supervision sees the failure; the proc lives.
    a, other = procs.spawn(f"fatal_{method}", Fatal), procs.spawn(f"other_{method}", Fatal)
    args = (3,) if method == "exits" else ()
    with pytest.raises(SupervisionError, match=f"The actor fatal_{method} and all its descendants have failed"):
        getattr(a, method).call_one(*args).get(timeout=T)
    with pytest.raises(SupervisionError, match="all its descendants have failed"):
        a.ping.call_one().get(timeout=T)
    _wait_for(lambda: faults)
    assert len(faults) == 1 and isinstance(faults[0], ActorFailedError) and isinstance(faults[0], RuntimeError)
    shown = "SystemExit(3)" if method == "exits" else "ActorFailure('simulated actor failure')"
    assert shown in str(faults[0]) and faults[0].actor == f"fatal_{method}" and faults[0].rank == 0
    assert other.ping.call_one().get(timeout=T) == "pong"  # the proc and its other actors go on


def test_an_ordinary_exception_leaves_the_actor_serving(procs, faults):
    a = procs.spawn("survives", Fatal)
    with pytest.raises(ActorError, match="an ordinary error"):
        a.raises.call_one().get(timeout=T)
    assert a.ping.call_one().get(timeout=T) == "pong"
    time.sleep(0.3)
    assert faults == []


def test_a_base_exception_reaches_the_owners_supervise(procs, faults):
    _its_child_dies_and_it_sees_it_once(procs.spawn("parent", Parent, procs))
    assert faults == []  # the owner handled it


def _its_child_dies_and_it_sees_it_once(parent) -> None:
    assert parent.kill_child.call_one().get(timeout=T) == "ActorFailedError"
    _wait_for(lambda: parent.seen.call_one().get(timeout=T))
    seen = parent.seen.call_one().get(timeout=T)
    assert len(seen) == 1 and "fatal_child" in seen[0] and "SystemExit(4)" in seen[0]


@pytest.mark.parametrize("method", ["raises_with_port", "raises_with_port_async", "raises_with_port_concurrent"])
def test_an_exception_out_of_an_explicit_port_endpoint_kills_the_actor(procs, faults, method):
    # Monarch's test_explicit_response_port_exception_kills_actor (and its concurrent form): the endpoint answers
    # through its port, so an exception that escapes it has no caller to go to: the actor dies, the caller gets a
    # SupervisionError, the owner's supervision sees it.
    a = procs.spawn(f"port_{method}", Fatal)
    with pytest.raises(SupervisionError, match=r"all its descendants have failed.*ValueError\('raised instead"):
        getattr(a, method).call_one().get(timeout=T)
    with pytest.raises(SupervisionError):
        a.ping.call_one().get(timeout=T)
    _wait_for(lambda: faults)
    assert len(faults) == 1 and f"port_{method}" in str(faults[0]) and "explicit response port" in str(faults[0])


def test_an_explicit_port_endpoint_that_answered_then_raised_still_dies(procs, faults):
    a = procs.spawn("answered_then_raised", Fatal)
    assert a.answers_then_raises.call_one().get(timeout=T) == "answered"
    _wait_for(lambda: faults)
    assert len(faults) == 1 and "raised after answering" in str(faults[0])
    with pytest.raises(SupervisionError):
        a.ping.call_one().get(timeout=T)


class ChildMeshOwner(_Supervising):
    """Owns a mesh of ``Fatal`` actors on ``procs``, which it hands out."""

    def __init__(self, procs) -> None:
        self.child = procs.spawn("owned_fatal", Fatal)
        self.failures = []

    @endpoint
    def get_child(self):
        return self.child


class AsyncChildMeshOwner(ChildMeshOwner):
    async def __supervise__(self, failure) -> bool:
        await asyncio.sleep(0.2)  # (the calls that came after the failure wait for it to finish)
        self.failures.append(str(failure))
        return True


@pytest.mark.parametrize("owner_cls", [ChildMeshOwner, AsyncChildMeshOwner])
def test_the_owner_has_seen_every_failure_of_a_call_by_the_time_it_raises(procs, faults, owner_cls):
    # Monarch's test_supervise_callback_with_mesh_ref: the script calls a mesh it does not own and every rank
    # dies; asked right after the call raised, with no wait, the owner's __supervise__ has seen each rank's death.
    others = this_host().spawn_procs(per_host={"gpus": 3})
    try:
        owner = procs.spawn(f"owner_{owner_cls.__name__}", owner_cls, others)
        child = owner.get_child.call_one().get(timeout=T)
        with pytest.raises(SupervisionError, match="^The actor owned_fatal and all its descendants have failed"):
            child.exits.call(4).get(timeout=T)
        seen = owner.seen.call_one().get(timeout=T)
        assert len(seen) == 3, seen
        assert all("owned_fatal" in s and "SystemExit(4)" in s for s in seen)
        # (shown as Monarch's MeshFailure, whose tests look for each rank so)
        assert all(s.startswith("MeshFailure(mesh_name=owned_fatal, crashed_ranks=[") for s in seen), seen
        assert sorted(next(r for r in range(3) if f"crashed_ranks=[{r}]" in s) for s in seen) == [0, 1, 2]
        assert faults == []  # the owner handled them
    finally:
        others.stop()


def test_a_failure_given_to_supervision_is_shown_as_monarchs_mesh_failure():
    import pickle

    err = ActorFailedError("The actor a and all its descendants have failed: boom", actor="a", rank=2, proc="p")
    failure = err.as_failure()
    assert type(failure) is ActorFailedError and failure is not err
    assert (failure.actor, failure.rank, failure.proc) == ("a", 2, "p")
    assert str(failure) == ("MeshFailure(mesh_name=a, crashed_ranks=[2], event=The actor a and all its "
                            "descendants have failed: boom)")
    assert str(err) == "The actor a and all its descendants have failed: boom"  # (what a call raises)
    assert failure.as_failure() is failure
    back = pickle.loads(pickle.dumps(failure))  # (a copy made elsewhere is an error again, of the same words)
    assert type(back) is ActorFailedError and str(back) == str(err)
    assert str(SupervisionError("proc died").as_failure()) == "MeshFailure(mesh_name=<none>, crashed_ranks=[], event=proc died)"


class DiesOnRankZero(Actor):
    @endpoint
    async def work(self) -> str:
        if current_rank().rank == 0:
            raise ActorFailure("rank 0 dies")
        await asyncio.sleep(300)  # (cancelled when its procs stop)
        return "done"


def test_a_call_that_killed_an_actor_does_not_wait_for_a_slow_rank(faults):
    # A death is held back only until the call's other ranks answered, or DEATH_GRACE_S after it: the caller
    # hears of it while the other rank still works (the timeout is far past that grace, far short of the work).
    from monarch_tensor.transport._ports import DEATH_GRACE_S

    others = this_host().spawn_procs(per_host={"gpus": 2})
    try:
        m = others.spawn("dies_on_rank_zero", DiesOnRankZero)
        with pytest.raises(SupervisionError, match="rank 0 dies"):
            m.work.call().get(timeout=DEATH_GRACE_S + 40)
    finally:
        others.stop()


class FailsInInit(Actor):
    def __init__(self, why: str, after: float = 0.0) -> None:
        time.sleep(after)
        raise ValueError(why)

    @endpoint
    def ping(self) -> str:
        return "pong"


class InitOwner(_Supervising):
    def __init__(self) -> None:
        self.failures = []

    @endpoint
    def spawn_failing(self, procs) -> None:
        self.child = procs.spawn("failing_grandchild", FailsInInit, "the grandchild's __init__")


def test_an_init_error_on_a_mesh_nobody_calls_reaches_the_fault_hook(procs, faults):
    # Monarch's test_actor_init_exception: the constructor's exception is a supervision event for the owner
    # (here the script's unhandled_fault_hook), one per proc, though nobody called the actors.
    procs.spawn("failing_init", FailsInInit, "an exception from __init__")
    _wait_for(lambda: faults)
    assert len(faults) == 1 and isinstance(faults[0], SupervisionError)
    assert "failing_init" in str(faults[0]) and "an exception from __init__" in str(faults[0])
    assert faults[0].mesh is procs


def test_an_init_error_somebody_waits_on_is_theirs(procs, faults):
    # (each constructor fails a while after the spawn: the call or wait below is made before, on a loaded machine
    # too; a failure that comes before anybody waits is the mesh owner's fault, the test above)
    m = procs.spawn("failing_init_called", FailsInInit, "awaited", 2.0)
    with pytest.raises(ActorError, match="awaited"):
        m.ping.call_one().get(timeout=T)
    m = procs.spawn("failing_init_waited", FailsInInit, "waited", 2.0)
    with pytest.raises(ActorError, match="waited"):
        m.initialized.get(timeout=T)
    m = procs._spawn_named("failing_runtime_actor", FailsInInit, "the runtime's own")  # (its user sees it)
    time.sleep(0.3)
    assert faults == []
    with pytest.raises(ActorError, match="the runtime's own"):
        m.initialized.get(timeout=T)


def test_an_init_error_reaches_the_spawning_actors_supervise(procs, faults):
    owner = procs.spawn("init_owner", InitOwner)
    owner.spawn_failing.call_one(procs).get(timeout=T)
    _wait_for(lambda: owner.seen.call_one().get(timeout=T))
    seen = owner.seen.call_one().get(timeout=T)
    assert len(seen) == 1 and "the grandchild's __init__" in seen[0]
    assert faults == []


class Sibling(Actor):
    @endpoint
    def pid(self) -> int:
        import os

        return os.getpid()

    @endpoint
    def env(self, name: str):
        import os

        return os.environ.get(name)

    @endpoint
    def spawn_beside(self, name: str):
        from monarch_tensor.actor import context

        mesh = context().actor_instance.proc_mesh
        return mesh.size(), mesh.spawn(name, Sibling)


def test_an_actors_proc_mesh_is_the_mesh_it_was_spawned_on(procs):
    from monarch_tensor.actor import context, this_proc

    s = procs.spawn("sibling", Sibling)
    size, beside = s.spawn_beside.call_one("beside").get(timeout=T)
    assert size == 1
    assert beside.pid.call_one().get(timeout=T) == s.pid.call_one().get(timeout=T)
    assert context().actor_instance.proc_mesh._procs == this_proc()._procs  # the script's: this_proc()


def test_bootstrap_command_env_and_program(procs):
    import sys

    from monarch_tensor.actor import BootstrapCommand, default_bootstrap_cmd

    base = default_bootstrap_cmd()
    assert base.program == sys.executable and base.args == [] and base.env == {}
    cmd = base.with_env({"MT_COMPAT_MARK": "3"})
    assert base.env == {} and cmd.env == {"MT_COMPAT_MARK": "3"}  # with_env leaves the original as it was
    host = this_host()
    per_rank = host.spawn_procs({"gpus": 2}, bootstrap_command=lambda p: cmd.with_env({"MT_RANK_MARK": str(p["gpus"])}))
    try:
        marks = per_rank.spawn("marks", Sibling)
        assert marks.env.call("MT_COMPAT_MARK").get(timeout=T).values() == ["3", "3"]
        assert marks.env.call("MT_RANK_MARK").get(timeout=T).values() == ["0", "1"]
    finally:
        per_rank.stop().get(timeout=30)
    assert procs.spawn("no_marks", Sibling).env.call_one("MT_COMPAT_MARK").get(timeout=T) is None
    # What cannot be honoured here is refused, never ignored.
    for bad in (BootstrapCommand(sys.executable, None, ["-m", "some.main"], {}),
                BootstrapCommand(sys.executable, "other-arg0", [], {})):
        with pytest.raises(ValueError, match="command line of your own"):
            host.spawn_procs({"gpus": 1}, bootstrap_command=bad)
    with pytest.raises(FileNotFoundError, match="no such program"):
        host.spawn_procs({"gpus": 1}, bootstrap_command=BootstrapCommand("/no/such/python"))
    with pytest.raises(ValueError, match="one program"):
        host.spawn_procs({"gpus": 2}, bootstrap_command=lambda p: BootstrapCommand(
            sys.executable if p["gpus"] else "/bin/true"))
    with pytest.raises(TypeError, match="BootstrapCommand"):
        host.spawn_procs({"gpus": 1}, bootstrap_command="python")


def test_a_bootstrap_commands_program_runs_the_procs(tmp_path):
    # (Planned, not spawned: another interpreter is another template process, as with_python_executable's.)
    import os
    import sys

    from monarch_tensor.actor import BootstrapCommand
    from monarch_tensor.hosts.host import bootstrap_plan
    from monarch_tensor.shape import Shape

    link = tmp_path / "python"
    os.symlink(sys.executable, link)
    shape = Shape.from_sizes({"gpus": 2})
    assert bootstrap_plan(BootstrapCommand(str(link), env={"A": "1"}), shape, None) == (str(link), [{"A": "1"}] * 2)
    assert bootstrap_plan(BootstrapCommand(sys.executable), shape, None) == (None, [{}, {}])
    assert bootstrap_plan(BootstrapCommand(sys.executable), shape, "/venv/bin/python")[0] == sys.executable
    assert bootstrap_plan(None, shape, "/venv/bin/python") == ("/venv/bin/python", None)


class Logs(Actor):
    @endpoint
    def log(self, off: bool = False):
        import io
        import logging

        from monarch_tensor.actor import config

        out = io.StringIO()
        handler = logging.StreamHandler(out)
        seen = []
        handler.emit = lambda r, emit=handler.emit: (seen.append((r.actor_name, r.actor_id)), emit(r))
        log = logging.getLogger("compat_logs")
        log.addHandler(handler)
        config.prefix_python_logs_with_actor = not off
        try:
            log.error("HUH %d", 1)
            log.error("")  # (structured logs: left empty)
        finally:
            config.prefix_python_logs_with_actor = True
            log.removeHandler(handler)
        return out.getvalue(), seen


def test_log_records_in_an_actor_carry_its_identity(procs):
    # Monarch's test_instance_name: "[actor=<root>.<module.Named the_name{'f': 0/2}>] HUH"; a record attribute
    # too, and monarch.actor.config.prefix_python_logs_with_actor turns the prefix off.
    lg = procs.spawn("the_logger", Logs)
    text, seen = lg.log.call_one().get(timeout=T)
    assert text.splitlines()[0] == "[actor=<root>.<test_monarch_compat.Logs the_logger{'gpus': 0/1}>] HUH 1"
    assert text.splitlines()[1] == ""
    assert seen[0][0] == "the_logger" and seen[0][1].endswith("/the_logger[0]")
    text, _ = lg.log.call_one(True).get(timeout=T)
    assert text.splitlines()[0] == "HUH 1"


class HereJob(JobTrait):
    """A job written the Monarch way (its test_job.py's MockJobTrait): workers on this host."""

    def __init__(self, tag: str, marks: str) -> None:
        super().__init__()
        self.tag, self.marks, self.created = tag, marks, 0

    def _create(self, client_script=None):
        self.created += 1

    def _state(self):
        return JobState({"workers": this_host()})

    def _kill(self):
        with open(self.marks, "a") as f:
            f.write(f"killed {self.tag}\n")

    def can_run(self, spec):
        return isinstance(spec, HereJob) and spec.tag == self.tag


def test_a_job_written_the_monarch_way(tmp_path):
    from monarch_tensor.job import job_load

    marks, cached = str(tmp_path / "marks"), str(tmp_path / "job_state.json")
    job = HereJob("a", marks)
    assert not job.active
    state = job.state(cached_path=cached)
    assert job.active and job.created == 1 and state.workers is not None and state._hosts["workers"] is state.workers
    job.state(cached_path=cached)
    assert job.created == 1  # running: state() asks _state() again, creates nothing
    again = HereJob("a", marks)
    again.state(cached_path=cached)  # reattaches to the cached (pickled) job, which can run it
    assert again.created == 0 and not again.active
    loaded = job_load(cached)
    assert isinstance(loaded, HereJob) and loaded.active and loaded.created == 1
    other = HereJob("b", marks)
    other.state(cached_path=cached)  # the cached job cannot run it: killed, and this one created
    assert other.created == 1 and open(marks).read() == "killed a\n"
    other.kill()
    assert not other.active and open(marks).read() == "killed a\nkilled b\n"


SPMD_SCRIPT = """
import os, sys
with open(os.path.join(sys.argv[1], "rank" + os.environ["RANK"]), "w") as f:
    f.write(" ".join([os.environ["WORLD_SIZE"], os.environ["LOCAL_RANK"], os.environ["MASTER_PORT"]] + sys.argv[2:]))
if sys.argv[2:] == ["fail"]:
    sys.exit(3)
"""


def test_spmd_job_runs_a_torchrun_command_on_this_host(tmp_path):
    from monarch_tensor.job.spmd import SPMDJob, parse_torchrun, serve

    script = tmp_path / "train.py"
    script.write_text(SPMD_SCRIPT)
    job = serve(["torchrun", "--nproc-per-node=2", "--standalone", str(script), str(tmp_path), "--lr", "0.1"],
                scheduler="local_cwd")
    assert isinstance(job, SPMDJob)
    try:
        job.run_spmd(timeout=60)
        got = sorted((tmp_path / f"rank{r}").read_text().split() for r in (0, 1))
        assert [g[:2] for g in got] == [["2", "0"], ["2", "1"]] and got[0][2] == got[1][2]
        assert got[0][3:] == ["--lr", "0.1"]
        assert job.state(cached_path=None).workers is not None
    finally:
        job.kill()
    failing = serve(["python", str(script), str(tmp_path), "fail"], scheduler="local_cwd")
    try:
        with pytest.raises(ActorError, match="exited with 3"):
            failing.run_spmd(timeout=60)
    finally:
        failing.kill()
    assert parse_torchrun([{"entrypoint": "python", "args": ["-m", "torch.distributed.run", "--nproc_per_node",
                                                             "4", "-m", "train", "--x"]}]) == (["-m", "train", "--x"], 4)
    assert parse_torchrun([{"entrypoint": "workspace/entrypoint.sh",
                            "args": ["torchrun", "--nnodes=1", "--nproc-per-node=8", "t.py"]}]) == (["t.py"], 8)
    with pytest.raises(ValueError, match="torchx"):
        serve(["torchrun", "train.py"], scheduler="slurm")
    with pytest.raises(ValueError, match="Multi-node"):
        serve(["torchrun", "--nnodes=2", "train.py"], scheduler="local_cwd")
    with pytest.raises(ValueError, match="Expected args to start with torchrun"):
        serve(["bash", "train.sh"], scheduler="local_cwd")


def test_tools_config(tmp_path):
    import warnings

    from monarch_tensor.tools.config import NOT_SET, Config, Workspace

    c = Config(scheduler="slurm", workspace=Workspace(dirs={str(tmp_path): ""}))
    assert c.scheduler == "slurm" and c.scheduler_args == {} and c.dryrun is False
    assert c.workspace.dirs == {tmp_path: ""}
    assert Config().scheduler == NOT_SET and Config().workspace == Workspace.null()
    with pytest.warns(FutureWarning):
        assert Config(workspace=None).workspace.dirs == {}
    with pytest.warns(FutureWarning):
        assert Config(workspace=str(tmp_path / "torch")).workspace.dirs == {tmp_path / "torch": ""}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(TypeError, match="Workspace"):
            Config(workspace=3)


_BATCH_SCRIPT = """
from monarch_tensor.job import LocalJob

job = LocalJob(meshes={"mesh0": 1}, ttl=120)  # the spec the job was applied with: state() reattaches
procs = job.state().mesh0.spawn_procs()
print("answer", procs.execute(lambda: 6 * 7).values(), flush=True)
job.kill()
"""


@pytest.mark.timeout(180)
def test_a_local_job_runs_a_client_script(tmp_path, monkeypatch):
    # Monarch's LocalJob.apply(client_script=...): the script runs in the background as the job's controller,
    # its output in the job's log directory; its own job.state() attaches to the job's hosts.
    from monarch_tensor.job import LocalJob

    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.py").write_text(_BATCH_SCRIPT)
    job = LocalJob(meshes={"mesh0": 1}, ttl=120, root_dir=str(tmp_path / "job"))
    try:
        job.apply(client_script="train.py")
        assert job.process.wait(timeout=150) == 0, (tmp_path / job.log_dir / "stderr.log").read_text()
        assert "answer [42]" in (tmp_path / job.log_dir / "stdout.log").read_text()
        assert not job._running()  # the script killed the job it attached to
    finally:
        job.kill()
    with pytest.raises(FileNotFoundError, match="no such file"):
        LocalJob(meshes={"mesh0": 1}).apply(client_script="missing.py")


class AsyncParent(Parent):
    """``Parent`` whose ``__supervise__`` is async: it runs on the actor's loop, and what it returns counts."""

    async def __supervise__(self, failure) -> bool:
        await asyncio.sleep(0.01)
        self.failures.append(str(failure))
        return True


def test_an_async_supervise_runs_on_its_actor_and_handles_the_failure(procs, faults):
    # Monarch's test_async_supervise_callback_handled: before, the coroutine was never awaited, and being
    # truthy it counted as handled: the failure vanished.
    _its_child_dies_and_it_sees_it_once(procs.spawn("async_parent", AsyncParent, procs))
    assert faults == []


def test_what_an_async_or_raising_supervise_decides(faults):
    # The owner's __supervise__ on the supervision thread: an async one runs on its actor's loop and its result
    # decides; one that raises passes the failure on with the exception as its cause; an async one whose actor
    # has no loop any more passes it on too, saying so.
    from monarch_tensor.hosts import host

    loop = asyncio.new_event_loop()
    runner = threading.Thread(target=loop.run_forever, daemon=True)
    runner.start()
    ran_on = []

    class Owner:
        def __init__(self, answer):
            self.answer = answer

        async def __supervise__(self, failure):
            ran_on.append(threading.current_thread())
            if isinstance(self.answer, Exception):
                raise self.answer
            return self.answer

    class RaisingSync:
        def __supervise__(self, failure):
            raise KeyError("sync handler")

    def supervise(instance, owner_loop=loop):
        err = SupervisionError("proc x died", proc="x", rank=0)
        host._supervise(types.SimpleNamespace(instance=instance, loop=owner_loop), err)
        return err

    try:
        supervise(Owner(True))
        assert faults == [] and ran_on == [runner]
        err = supervise(Owner(False))
        assert faults == [err] and ran_on == [runner, runner]
        supervise(Owner(ValueError("async handler")))
        assert "__supervise__ raised ValueError('async handler')" in str(faults[-1])
        assert isinstance(faults[-1].__cause__, ValueError)
        supervise(RaisingSync())
        assert isinstance(faults[-1].__cause__, KeyError) and faults[-1].proc == "x"
        supervise(Owner(True), owner_loop=None)
        assert "event loop is gone" in str(faults[-1]) and len(ran_on) == 3
    finally:
        loop.call_soon_threadsafe(loop.stop)
        runner.join(timeout=10)
        loop.close()


class LoopProbe(Actor):
    @endpoint
    def sync_sees_loop(self) -> bool:
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            return False
        return True

    @endpoint
    def asks_async_neighbour(self, other) -> tuple:
        # (Monarch's test_sync_endpoint_has_no_visible_loop_and_get_does_not_warn: no loop here, and a wait on an
        # async endpoint of another actor of this proc, which needs the loop, still runs)
        return other.async_sees_loop.call_one().get(timeout=T), self.sync_sees_loop.__name__


class AsyncLoopProbe(Actor):
    @endpoint
    async def async_sees_loop(self) -> bool:
        await asyncio.sleep(0.01)
        return asyncio.get_running_loop() is not None


def test_a_sync_endpoint_sees_no_running_loop_and_its_waits_still_run(procs):
    sync, other = procs.spawn("loop_probe", LoopProbe), procs.spawn("async_loop_probe", AsyncLoopProbe)
    assert sync.sync_sees_loop.call_one().get(timeout=T) is False
    assert other.async_sees_loop.call_one().get(timeout=T) is True
    assert sync.asks_async_neighbour.call_one(other).get(timeout=T) == (True, "sync_sees_loop")
    assert sync.sync_sees_loop.call_one().get(timeout=T) is False  # (and after a wait too)


def test_actor_mesh_is_generic(procs):
    # Monarch's tests cast spawned meshes: cast(ActorMesh[Counter], counters).stop()
    import typing

    from monarch_tensor.actor import ActorMesh

    alias = ActorMesh[LoopProbe]
    assert typing.get_origin(alias) is ActorMesh and typing.get_args(alias) == (LoopProbe,)
    m = typing.cast(ActorMesh[LoopProbe], procs.spawn("generic_probe", LoopProbe))
    assert isinstance(m, ActorMesh) and m.sync_sees_loop.call_one().get(timeout=T) is False


def test_conda_environment_without_one_active_fails_when_read(monkeypatch):
    # Monarch's tools/config/test_environment.py: made without $CONDA_PREFIX, read -> AssertionError
    from monarch_tensor.tools.config.environment import CondaEnvironment

    monkeypatch.delenv("CONDA_PREFIX", raising=False)
    env = CondaEnvironment()
    with pytest.raises(AssertionError, match=r"\$CONDA_PREFIX is not set"):
        _ = env.conda_prefix
    with pytest.raises(ValueError):
        _ = env.conda_prefix
    monkeypatch.setenv("CONDA_PREFIX", "/opt/envs/active")
    assert env.conda_prefix == "/opt/envs/active"


class MeshOwner(_Supervising):
    """Spawns a mesh under a name another owner of this proc uses too."""

    def __init__(self, procs) -> None:
        self.failures = []
        self.child = procs.spawn("same_name_child", Fatal)

    @endpoint
    def child_mesh(self):
        return self.child

    @endpoint
    def kill_through(self, mesh) -> str:
        try:
            mesh.exits.call_one(5).get(timeout=T)
        except SupervisionError as e:
            return type(e).__name__
        return "no error"


def test_owners_of_same_named_meshes_each_hear_of_their_own(procs, faults):
    # Monarch's test_supervise_callback_with_mesh_ref: two actors of one proc each spawn a mesh of the same name
    # on the same procs; a failure of one, caused through a reference by the other, reaches its owner only.
    a, b = procs.spawn("owner_a", MeshOwner, procs), procs.spawn("owner_b", MeshOwner, procs)
    assert a.kill_through.call_one(b.child_mesh.call_one().get(timeout=T)).get(timeout=T) == "ActorFailedError"
    _wait_for(lambda: b.seen.call_one().get(timeout=T))
    time.sleep(0.3)
    seen_b = b.seen.call_one().get(timeout=T)
    assert len(seen_b) == 1 and "same_name_child" in seen_b[0] and "SystemExit(5)" in seen_b[0]
    assert a.seen.call_one().get(timeout=T) == [] and faults == []
    assert a.child_mesh.call_one().get(timeout=T).ping.call_one().get(timeout=T) == "pong"  # (a's lives on)


class SlowInit(Actor):
    def __init__(self, seconds: float) -> None:
        time.sleep(seconds)

    @endpoint
    def ping(self) -> str:
        return "pong"


def test_a_name_stopped_while_its_constructor_runs_may_be_spawned_again(procs):
    # stop() of actors still constructing is acknowledged at once; the name is then free, as after any stop
    first = procs.spawn("slow_init", SlowInit, 1.0)
    first.stop("stopped early").get(timeout=T)
    again = procs.spawn("slow_init", SlowInit, 0.0)
    assert again._name == "slow_init" and again.ping.call_one().get(timeout=T) == "pong"
    time.sleep(1.2)  # (the first constructor has returned, and its actor stopped)
    assert again.ping.call_one().get(timeout=T) == "pong"


class TLSActor(Actor):
    """Monarch's test_python_actors.py TLSActor / TLSActorFullSync: a threading.local set in __init__."""

    def __init__(self) -> None:
        self.local = threading.local()
        self.local.value = 0
        self.init_thread = threading.get_ident()

    @endpoint
    def increment(self) -> None:
        self.local.value += 1

    @endpoint
    async def increment_async(self) -> None:
        self.local.value += 1

    @endpoint
    def get_value(self) -> int:
        return self.local.value

    @endpoint
    async def get_async(self) -> int:
        return self.local.value

    @endpoint
    def threads(self) -> tuple:
        return self.init_thread, threading.get_ident()


class DeviceActor(Actor):
    """Sets its CUDA device in __init__, as a GPU trainer does (``torch.cuda.set_device(local_rank)``). This proc
    has no GPU: torch.cuda's per-thread current device is stood in for by a thread-local here."""

    def __init__(self, device: int) -> None:
        import torch

        per_thread = threading.local()
        torch.cuda.is_initialized = lambda: True
        torch.cuda.current_device = lambda: getattr(per_thread, "device", 0)
        torch.cuda.set_device = lambda d: setattr(per_thread, "device", d)
        torch.cuda.set_device(device)

    @endpoint
    def device(self) -> int:
        import torch

        return torch.cuda.current_device()


def test_the_cuda_device_set_in_init_is_current_in_the_endpoints():
    procs = this_host().spawn_procs(per_host={"gpus": 1})
    try:
        assert procs.spawn("dev", DeviceActor, 3).device.call_one().get(timeout=T) == 3
    finally:
        procs.stop().get(timeout=T)


def test_a_thread_local_set_in_init_is_seen_by_the_endpoints(procs):
    am = procs.spawn("tls", TLSActor)
    for method in (am.increment, am.increment_async, am.increment, am.increment_async):
        method.call_one().get(timeout=T)
    assert am.get_value.call_one().get(timeout=T) == 4
    assert am.get_async.call_one().get(timeout=T) == 4
    init_thread, endpoint_thread = am.threads.call_one().get(timeout=T)
    assert init_thread != endpoint_thread  # (the constructor still ran on a thread of its own)
    am.stop().get(timeout=T)


class _Count(Actor):
    def __init__(self) -> None:
        self.n = 0

    @endpoint
    def incr(self) -> None:
        self.n += 1

    @endpoint
    def value(self) -> int:
        return self.n


class _CountsItsCleanup(Actor):
    def __init__(self, counter) -> None:
        self.counter = counter

    @endpoint
    def check(self) -> None:
        pass

    def __cleanup__(self, exc) -> None:
        self.counter.incr.call_one().get(timeout=30)


class _Owner(Actor):
    """Spawns a proc mesh of its own with an actor mesh on it, and an actor mesh on the procs it was given; no
    ``__cleanup__`` of its own."""

    def __init__(self, procs, counter) -> None:
        self.procs = this_host().spawn_procs()
        self.on_passed = procs.spawn("inner_passed", _CountsItsCleanup, counter)
        self.on_owned = self.procs.spawn("inner_owned", _CountsItsCleanup, counter)

    @endpoint
    def check(self) -> list:
        self.on_passed.check.call().get(timeout=30)
        self.on_owned.check.call().get(timeout=30)
        return [p.pid for p in self.procs._procs]


@pytest.mark.timeout(120)
def test_stopping_an_actor_stops_the_meshes_it_spawned(procs):
    """Monarch's test_recursive_stop: an actor owns the meshes it spawns; stopping it stops them (their
    actors' ``__cleanup__`` runs), on its own proc mesh and on one it was given, and its proc mesh's procs end."""
    counter = procs.spawn("count_cleanups", _Count)
    owner = procs.spawn("owner", _Owner, procs, counter)
    pids = owner.check.call_one().get(timeout=60)
    owner.stop().get(timeout=60)
    _wait_for(lambda: counter.value.call_one().get(timeout=30) >= 2)
    assert counter.value.call_one().get(timeout=30) == 2
    _wait_for(lambda: not any(os.path.exists(f"/proc/{p}") for p in pids))
    assert not any(os.path.exists(f"/proc/{p}") for p in pids), pids


class _FailsFatally(Actor):
    @endpoint
    async def check(self) -> str:
        return "ok"

    @endpoint
    async def fail(self) -> None:
        raise _ActorFailure("fails its actor")


class _ActorFailure(BaseException):
    """Monarch's tests' ActorFailureError: a BaseException kills the actor that raises it."""


class _SyncSupervisor(Actor):
    """Monarch's ErrorActorWithSupervise: a sync ``__supervise__`` that sets an ``asyncio.Event`` an async endpoint
    waits on."""

    def __init__(self, procs) -> None:
        self.mesh = procs.spawn("fails_fatally", _FailsFatally)
        self.failures: list = []
        self.faulted = asyncio.Event()
        self.loops: set = set()

    @endpoint
    async def broadcast_fail(self, expected: int) -> int:
        self.expected = expected
        self.loops.add(threading.get_ident())
        self.mesh.check.broadcast()
        self.mesh.fail.broadcast()  # (nobody awaits it: each rank's failure goes to __supervise__)
        await asyncio.wait_for(self.faulted.wait(), timeout=60)
        return len(self.failures)

    @endpoint
    def loops_seen(self) -> int:
        return len(self.loops)

    def __supervise__(self, failure) -> bool:
        self.loops.add(threading.get_ident())
        self.failures.append(str(failure))
        if len(self.failures) >= self.expected:
            self.faulted.set()
        return True


@pytest.mark.timeout(120)
def test_a_sync_supervise_runs_on_its_actors_loop_and_wakes_what_waits_there():
    """Monarch's test_supervise_callback_without_await_handled: a sync ``__supervise__`` runs on its actor's loop
    thread, as its endpoints (an ``asyncio.Event`` it sets wakes the async endpoint waiting on it; from another
    thread it did not, and that endpoint waited for ever)."""
    pm = this_host().spawn_procs({"gpus": 1})
    workers = this_host().spawn_procs({"gpus": 2})
    try:
        s = pm.spawn("sync_supervisor", _SyncSupervisor, workers)
        assert s.broadcast_fail.call_one(2).get(timeout=90) >= 2
        assert s.loops_seen.call_one().get(timeout=30) == 1
    finally:
        workers.stop().get(timeout=30)
        pm.stop().get(timeout=30)


class _SpawnsMany(Actor):
    @endpoint
    def spawn_and_stop(self, procs, n: int) -> tuple:
        from monarch_tensor.actor import context

        for i in range(n):
            m = procs.spawn(f"short_lived_{i}", _Count)
            m.value.call_one().get(timeout=30)
            m.stop().get(timeout=30)
        kept = procs.spawn("kept", _Count)
        kept.value.call_one().get(timeout=30)
        owned = context().actor_instance.owned_meshes
        return len(owned), kept in owned


@pytest.mark.timeout(120)
def test_an_actor_that_spawns_mesh_after_mesh_keeps_only_the_live_ones(procs):
    """The meshes an actor owns are kept until it stops; the stopped ones are let go as more come (an actor
    spawning and stopping a mesh per request does not hold them all)."""
    s = procs.spawn("spawns_many", _SpawnsMany)
    n, kept = s.spawn_and_stop.call_one(procs, 70).get(timeout=100)
    assert kept and n < 70, n
