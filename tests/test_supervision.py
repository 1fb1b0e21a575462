"""Supervision: dead procs raise SupervisionError fast; no orphans whatever the client does."""

import asyncio
import glob
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest

import monarch_tensor.actor as actor_mod
from monarch_tensor import heal_mesh
from monarch_tensor.actor import (
    Actor,
    ActorError,
    Channel,
    SupervisionError,
    concurrent_endpoint,
    context,
    current_rank,
    endpoint,
    this_host,
)
from monarch_tensor.errors import MeshStoppedError
from monarch_tensor.transport.mailbox import socket_dir

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class Worker(Actor):
    @endpoint
    def pid(self) -> int:
        return os.getpid()

    @endpoint
    def sleep(self, s: float) -> float:
        time.sleep(s)
        return s

    @endpoint
    def die(self, code: int) -> None:
        os._exit(code)

    @endpoint
    def segfault(self) -> None:
        import ctypes

        ctypes.string_at(0)


@pytest.fixture
def mesh():
    procs = this_host().spawn_procs({"gpus": 3})
    w = procs.spawn("w", Worker)
    pids = w.pid.call().get(timeout=60).values()
    yield procs, w, pids
    procs.stop().get(timeout=30)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/status") as f:
            return not any(line.startswith("State:") and "Z" in line.split()[1] for line in f)
    except (FileNotFoundError, ProcessLookupError):
        return False


@pytest.mark.timeout(60)
def test_sigkill_fails_pending_call(mesh, faults):
    procs, w, pids = mesh
    fut = w.slice(gpus=1).sleep.call_one(30)
    os.kill(pids[1], signal.SIGKILL)
    # The endpoint sleeps 30 s: an error well before that can only come from supervision.
    with pytest.raises(SupervisionError) as ei:
        fut.get(timeout=5)
    assert "SIGKILL" in str(ei.value) and ei.value.rank == 1 and "rank 1" in str(ei.value)
    assert faults == []  # the waiting caller saw it: handled


@pytest.mark.timeout(60)
def test_later_calls_fail_and_slices_without_the_dead_proc_work(mesh, faults):
    procs, w, pids = mesh
    w.slice(gpus=2).die.broadcast(7)
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and not faults:
        time.sleep(0.01)
    assert len(faults) == 1 and "exited with code 7" in str(faults[0])  # nobody waited: unhandled hook
    with pytest.raises(SupervisionError, match="exited with code 7"):
        w.pid.call().get(timeout=5)
    assert w.slice(gpus=slice(0, 2)).pid.call().get(timeout=10).values() == pids[:2]
    with pytest.raises(SupervisionError):
        procs.spawn("again", Worker)


@pytest.mark.timeout(90)
def test_a_node_failure_is_a_device_mesh_error_and_heal_mesh_replaces_the_mesh(mesh, faults):
    from monarch_tensor import heal_mesh
    from monarch_tensor.errors import MeshStoppedError
    from monarch_tensor.exceptions import DeviceMeshError

    procs, w, pids = mesh
    fut = w.slice(gpus=1).sleep.call_one(30)
    os.kill(pids[1], signal.SIGKILL)
    with pytest.raises(DeviceMeshError, match="SIGKILL"):  # the seeds' name for a node failure
        fut.get(timeout=10)
    tail = procs.slice(gpus=slice(1, 3))
    healed = heal_mesh(tail)  # the same slice of a new allocation of the same sizes
    assert healed.sizes == {"gpus": 2} and healed._alloc.sizes == procs.sizes
    new_pids = healed.spawn("w", Worker).pid.call().get(timeout=60).values()
    assert len(set(new_pids)) == 2 and not set(new_pids) & set(pids)
    with pytest.raises(MeshStoppedError):  # what was left of the old one is stopped
        procs.spawn("again", Worker)
    deadline = time.monotonic() + 10
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(_alive(p) for p in pids)
    healed._alloc.stop()
    with pytest.raises(TypeError, match="takes a ProcMesh"):
        heal_mesh("mesh")


@pytest.mark.timeout(60)
def test_a_raising_supervise_passes_the_failure_on_with_its_mesh(mesh, faults, monkeypatch):
    import types

    procs, _, _ = mesh

    class Owner:
        def __supervise__(self, failure):
            raise RuntimeError("the handler itself fails")

    monkeypatch.setattr(procs, "_owner", types.SimpleNamespace(instance=Owner()))
    procs._failed(SupervisionError("proc x died: exited with code 3", proc="x", rank=2, exit_status="exited with code 3"))
    _wait_for(lambda: faults)  # (on the supervision thread)
    assert len(faults) == 1
    f = faults[0]
    assert "and __supervise__ raised RuntimeError('the handler itself fails')" in str(f)
    assert f.mesh is procs and f.rank == 2 and f.exit_status == "exited with code 3"
    assert "exit: exited with code 3" in f.report() and f.mesh_name == f"proc mesh #{procs._seq}"


@pytest.mark.timeout(60)
def test_segfault_and_os_exit_are_reported(mesh, faults):
    procs, w, pids = mesh
    with pytest.raises(SupervisionError, match="SIGSEGV"):
        w.slice(gpus=0).segfault.call_one().get(timeout=10)
    with pytest.raises(SupervisionError, match="exited with code 5"):
        w.slice(gpus=1).die.call_one(5).get(timeout=10)


@pytest.mark.timeout(60)
def test_owner_supervise_handles_failure_of_its_procs(faults):
    class Owner(Actor):
        def __init__(self):
            self.failures = []
            self.procs = this_host().spawn_procs({"gpus": 1})
            self.child = self.procs.spawn("child", Worker)

        def __supervise__(self, failure):
            mine = failure.mesh is self.procs and failure.mesh_name == f"proc mesh #{self.procs._seq}"
            self.failures.append((str(failure), mine, failure.report()))
            return True

        @endpoint
        def kill_child(self) -> int:
            pid = self.child.pid.call_one().get(timeout=30)
            os.kill(pid, signal.SIGKILL)
            return pid

        @endpoint
        def failures_seen(self) -> list:
            return self.failures

    procs = this_host().spawn_procs({"gpus": 1})
    try:
        owner = procs.spawn("owner", Owner)
        owner.kill_child.call_one().get(timeout=60)
        deadline = time.monotonic() + 10
        seen = []
        while time.monotonic() < deadline and not seen:
            seen = owner.failures_seen.call_one().get(timeout=10)
            time.sleep(0.05)
        assert seen and "SIGKILL" in seen[0][0]
        assert seen[0][1], "failure.mesh is the proc mesh that failed, and mesh_name names it"
        assert "mesh: {'gpus': 1} of proc mesh #" in seen[0][2] and "rank: 0" in seen[0][2], seen[0][2]
        assert faults == []
    finally:
        procs.stop().get(timeout=30)


class Hanger(Actor):
    """Its ``hang`` calls stay pending: each tells ``port`` it started, then waits a minute (as a task: the
    actor takes other calls meanwhile)."""

    @concurrent_endpoint
    async def hang(self, port) -> None:
        port.send(current_rank().rank)
        await asyncio.sleep(60)

    @endpoint
    def pid(self) -> int:
        return os.getpid()

    @endpoint
    def f(self) -> int:
        return 1


class Holder(Actor):
    """Holds an actor mesh it did not spawn (passed to it) and says what its calls on it raise; records the
    faults its own process's hook is given (a holder is no owner: it must see none)."""

    def __init__(self, held) -> None:
        self.held = held
        self.hooked: list = []
        actor_mod.unhandled_fault_hook = self.hooked.append  # (in this proc only)

    @endpoint
    def call_held(self, method: str, *args) -> str:
        try:
            getattr(self.held, method).call(*args).get(timeout=20)
        except Exception as e:  # noqa: BLE001 - what the call raised is the answer
            return type(e).__name__
        return "ok"

    @endpoint
    def faults_seen(self) -> list:
        return [str(f) for f in self.hooked]


def _pending_hang(call, port_receiver, n: int = 2):
    """Start ``call`` (a hang on ``n`` ranks) and return it once every rank runs it."""
    for _ in range(n):
        port_receiver.recv().get(timeout=30)
    return call


@pytest.mark.timeout(60)
def test_a_stopped_mesh_fails_the_calls_of_an_actor_that_holds_it(faults):
    """Only the process that spawned a mesh learnt that its procs stopped: an actor holding the mesh waited
    for ever on its pending and later calls (the procs never answer). Now they fail as the owner's do."""
    wp = this_host().spawn_procs({"gpus": 2})
    hp = this_host().spawn_procs({"gpus": 1})
    try:
        w = wp.spawn("w", Hanger)
        h = hp.spawn("h", Holder, w)
        assert h.call_held.call_one("f").get(timeout=30) == "ok"
        port, started = Channel.open()
        pending = _pending_hang(h.call_held.call_one("hang", port), started)
        wp.stop().get(timeout=30)
        assert pending.get(timeout=30) == "MeshStoppedError"
        assert h.call_held.call_one("f").get(timeout=30) == "MeshStoppedError"
        assert h.faults_seen.call_one().get(timeout=30) == [] and faults == []
    finally:
        hp.stop().get(timeout=30)
        wp.stop().get(timeout=30)


@pytest.mark.timeout(60)
def test_a_dead_proc_fails_the_calls_of_an_actor_that_holds_its_mesh_and_only_the_owner_supervises(faults):
    """A proc of a mesh the script spawned dies: an actor holding the mesh gets SupervisionError on its pending
    and later calls (it waited for ever); the script, the owner, supervises it, once; the holder does not."""
    wp = this_host().spawn_procs({"gpus": 2})
    hp = this_host().spawn_procs({"gpus": 1})
    try:
        w = wp.spawn("w", Hanger)
        h = hp.spawn("h", Holder, w)
        pids = w.pid.call().get(timeout=30).values()
        port, started = Channel.open()
        pending = _pending_hang(h.call_held.call_one("hang", port), started)
        os.kill(pids[1], signal.SIGKILL)
        assert pending.get(timeout=30) == "SupervisionError"
        assert h.call_held.call_one("f").get(timeout=30) == "SupervisionError"
        _wait_for(lambda: len(faults) == 1)
        assert len(faults) == 1 and faults[0].proc == w._procs[1].addr  # the owner's hook (no call of its waited)
        assert h.faults_seen.call_one().get(timeout=30) == []
    finally:
        hp.stop().get(timeout=30)
        wp.stop().get(timeout=30)


class Maker(Actor):
    """Spawns a mesh and hands it to its caller; supervises its procs."""

    def __init__(self) -> None:
        self.failures: list = []

    @endpoint
    def make(self):
        self.procs = this_host().spawn_procs({"gpus": 2})
        return self.procs.spawn("w", Hanger)

    def __supervise__(self, failure) -> bool:
        self.failures.append(str(failure))
        return True

    @endpoint
    def failures_seen(self) -> list:
        return self.failures


@pytest.mark.timeout(60)
def test_a_dead_proc_fails_the_scripts_calls_on_a_mesh_an_actor_spawned(faults):
    """An actor spawns a mesh and returns it to the script; a proc of it dies. The script's pending and later
    calls on the mesh fail with SupervisionError (they waited for ever), slices without the proc still work,
    the actor's ``__supervise__`` handles the death, and the script's hook is not run for it."""
    mp = this_host().spawn_procs({"gpus": 1})
    try:
        m = mp.spawn("m", Maker)
        w = m.make.call_one().get(timeout=30)
        pids = w.pid.call().get(timeout=30).values()
        port, started = Channel.open()
        pending = _pending_hang(w.hang.call(port), started)
        os.kill(pids[1], signal.SIGKILL)
        with pytest.raises(SupervisionError, match="SIGKILL"):
            pending.get(timeout=30)
        with pytest.raises(SupervisionError):
            w.f.call().get(timeout=30)
        assert w.slice(gpus=0).f.call_one().get(timeout=30) == 1
        _wait_for(lambda: m.failures_seen.call_one().get(timeout=30) != [])
        assert len(m.failures_seen.call_one().get(timeout=30)) == 1
        assert faults == []
    finally:
        mp.stop().get(timeout=30)


SCRIPT = textwrap.dedent("""
    import os, sys, time
    sys.path.insert(0, {root!r})
    from monarch_tensor.actor import Actor, endpoint, this_host
    import numpy as np
    class W(Actor):
        @endpoint
        def pid(self):
            from monarch_tensor.runtime import _zygote
            _zygote.leave_last_words("why this proc ends")  # (as a fault would: its template removes them)
            return os.getpid()
        @endpoint
        def twice(self, a):
            return a * 2
    procs = this_host().spawn_procs({{"gpus": 2}})
    w = procs.spawn("w", W)
    pids = w.pid.call().get(timeout=60).values()
    w.twice.call(np.ones(1 << 20)).get(timeout=60)  # 8 MiB each way: through shared memory
    print("PIDS", *pids, flush=True)
    mode = sys.argv[1]
    sys.stdin.readline()  # the test has seen the procs alive
    if mode == "raise":
        raise RuntimeError("the script failed")
    if mode == "wait":
        time.sleep(600)
""")


@pytest.mark.timeout(90)
@pytest.mark.parametrize("mode", ["exit", "raise", "sigkill", "ctrl-c"])
def test_no_orphans(tmp_path, mode):
    script = tmp_path / "client.py"
    script.write_text(SCRIPT.format(root=ROOT))
    files_before = set(glob.glob(f"{socket_dir()}/*"))  # (a pid of an earlier run may be this one's)
    p = subprocess.Popen([sys.executable, str(script), "wait" if mode in ("sigkill", "ctrl-c") else mode],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         start_new_session=True)  # (its own process group, for the ctrl-c mode's killpg)
    line = p.stdout.readline()
    assert line.startswith("PIDS"), p.stderr.read()
    pids = [int(x) for x in line.split()[1:]]
    assert len(pids) == 2 and all(_alive(pid) for pid in pids)
    p.stdin.write("go\n")
    p.stdin.flush()
    if mode == "sigkill":
        p.kill()
    elif mode == "ctrl-c":  # what a terminal does: SIGINT to the script's whole process group
        time.sleep(0.5)
        os.killpg(p.pid, signal.SIGINT)
    p.wait(timeout=30)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(_alive(pid) for pid in pids):
        time.sleep(0.05)
    assert not any(_alive(pid) for pid in pids), f"orphans left after {mode}"
    # Nor socket files (a SIGKILLed script's are removed by its template process once its procs are gone).
    def left() -> list:
        return [f for f in glob.glob(f"{socket_dir()}/*-{p.pid}-*") if f not in files_before]

    while left() and time.monotonic() < deadline + 10:
        time.sleep(0.05)
    assert left() == []
    assert [f for pid in (p.pid, *pids) for f in glob.glob(f"/dev/shm/mt-{pid}-*")] == []
    assert [pid for pid in pids if os.path.exists(f"{socket_dir()}/last-words-{pid}")] == []  # nor last words
    if mode == "raise":
        assert "the script failed" in p.stderr.read()


CTRL_C_SCRIPT = textwrap.dedent("""
    import os, signal, sys, time
    sys.path.insert(0, {root!r})
    from monarch_tensor.actor import Actor, endpoint, this_host
    class Slow(Actor):
        @endpoint
        def nap(self, s):
            time.sleep(s)
            return "woke"
        @endpoint
        def pid(self):
            return os.getpid()
    procs = this_host().spawn_procs({{"gpus": 2}})
    s = procs.spawn("s", Slow)
    before = s.pid.call().get(timeout=60).values()
    try:
        f = s.nap.call(5)
        time.sleep(0.5)
        os.killpg(os.getpgid(0), signal.SIGINT)  # Ctrl-C at a terminal: the whole foreground process group
        f.get(timeout=60)
    except KeyboardInterrupt:
        print("INTERRUPTED", flush=True)
    time.sleep(2)  # (a template that died of it was noticed within this)
    assert s.pid.call().get(timeout=60).values() == before
    print("SAME PROCS", flush=True)
    procs.stop().get(timeout=30)
""")


@pytest.mark.timeout(90)
def test_ctrl_c_interrupts_the_script_and_leaves_its_procs_running(tmp_path):
    # The template and procs were in the script's process group: a Ctrl-C the script caught (to save a
    # checkpoint, or keep working in a notebook) killed them all, and the runtime then exited the script.
    script = tmp_path / "client.py"
    script.write_text(CTRL_C_SCRIPT.format(root=ROOT))
    p = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=80,
                       start_new_session=True)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "INTERRUPTED" in p.stdout and "SAME PROCS" in p.stdout


@pytest.mark.timeout(60)
def test_each_proc_runs_in_a_session_of_its_own_as_torchruns_ranks_do(mesh):
    # Where Linux shares the CPU out by session (autogroup), a proc's share beside other work is then a session's,
    # as each torchrun rank's is; the procs of one template once shared one session's share.
    _, _, pids = mesh
    sessions = [os.getsid(pid) for pid in pids]
    assert sessions == list(pids), (pids, sessions)
    assert os.getsid(0) not in sessions


@pytest.mark.timeout(60)
def test_unhandled_failure_stops_the_script_by_default(tmp_path):
    script = tmp_path / "client.py"
    script.write_text(textwrap.dedent(f"""
        import os, sys, time
        sys.path.insert(0, {ROOT!r})
        from monarch_tensor.actor import Actor, endpoint, this_host
        class W(Actor):
            @endpoint
            def die(self):
                os._exit(9)
        import atexit
        atexit.register(lambda: print("atexit ran", flush=True))
        procs = this_host().spawn_procs({{"gpus": 1}})
        try:
            procs.spawn("w", W).die.broadcast()
            time.sleep(30)
            print("NOT REACHED")
        finally:
            print("finally ran", flush=True)
    """))
    p = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=50)
    assert p.returncode != 0
    assert "unhandled supervision failure" in p.stderr and "exited with code 9" in p.stderr
    assert "NOT REACHED" not in p.stdout
    # Monarch's: the main thread gets a KeyboardInterrupt, so the script ends as from Ctrl-C, cleaning up
    assert "KeyboardInterrupt" in p.stderr and "finally ran" in p.stdout and "atexit ran" in p.stdout, p


@pytest.mark.timeout(60)
def test_a_child_forked_from_the_script_leaves_its_procs_alone_when_it_exits(tmp_path):
    # The child ran the script's exit hooks: it stopped (SIGKILLed) the script's procs, whose deaths then
    # ended the script with an unhandled supervision failure.
    script = tmp_path / "client.py"
    script.write_text(textwrap.dedent(f"""
        import os, sys
        sys.path.insert(0, {ROOT!r})
        from monarch_tensor.actor import Actor, endpoint, this_host
        class A(Actor):
            @endpoint
            def f(self):
                return os.getpid()
        procs = this_host().spawn_procs({{"gpus": 2}})
        a = procs.spawn("a", A)
        before = a.f.call().get(timeout=30).values()
        pid = os.fork()
        if pid == 0:
            sys.exit(0)
        assert os.waitpid(pid, 0)[1] == 0
        print("same procs", a.f.call().get(timeout=30).values() == before, flush=True)
    """))
    p = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=50)
    assert (p.returncode, p.stdout) == (0, "same procs True\n"), p
    assert "supervision" not in p.stderr, p


@pytest.mark.timeout(60)
def test_several_unhandled_faults_at_once_interrupt_the_script_once(tmp_path):
    # A broadcast that raises on every proc is four faults at once, each on a thread of its own: each sent
    # the main thread a KeyboardInterrupt, and the later ones cut off its finally blocks and the library's
    # atexit cleanup ("Exception ignored in atexit callback"), or ended it with os._exit(1).
    script = tmp_path / "client.py"
    script.write_text(textwrap.dedent(f"""
        import atexit, sys, time
        sys.path.insert(0, {ROOT!r})
        from monarch_tensor.actor import Actor, endpoint, this_host
        class E(Actor):
            @endpoint
            def boom(self):
                raise ValueError("boom in broadcast")
        atexit.register(lambda: print("atexit ran", flush=True))
        procs = this_host().spawn_procs({{"gpus": 4}})
        e = procs.spawn("e", E)
        try:  # (the first fault may come back before broadcast() has returned: it sends to four procs)
            e.boom.broadcast()
            time.sleep(30)
            print("NOT REACHED")
        finally:
            time.sleep(1)  # cleanup that takes a moment, while the other faults arrive
            print("finally ran", flush=True)
    """))
    p = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=50)
    assert p.returncode == -signal.SIGINT, p
    assert "boom in broadcast" in p.stderr, p
    assert p.stderr.count("delivering KeyboardInterrupt") == 1, p
    assert p.stdout.splitlines() == ["finally ran", "atexit ran"], p
    assert "Exception ignored" not in p.stderr, p


@pytest.mark.timeout(60)
def test_an_unhandled_fault_while_the_script_exits_makes_its_exit_status_non_zero(tmp_path):
    # With no main thread left to interrupt, the fault's handler imported a module at the interpreter's exit
    # ("can't register atexit after shutdown"): the supervision thread crashed and the script exited 0.
    script = tmp_path / "client.py"
    script.write_text(textwrap.dedent(f"""
        import atexit, sys, time
        sys.path.insert(0, {ROOT!r})
        from monarch_tensor.actor import Actor, endpoint, this_host
        class E(Actor):
            @endpoint
            def boom(self):
                time.sleep(1)  # (the script's main thread ends first, on a loaded machine too)
                raise ValueError("boom at exit")
        procs = this_host().spawn_procs({{"gpus": 2}})
        procs.spawn("e", E).boom.broadcast()
        # (runs before the library's hooks, which stop the procs: the faults come while it waits)
        atexit.register(lambda: (time.sleep(3), print("atexit ran", flush=True)))
        print("end of script", flush=True)
    """))
    p = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=50)
    assert p.returncode == 1, p
    assert "boom at exit" in p.stderr and "unhandled supervision failure" in p.stderr, p
    assert "Exception in thread" not in p.stderr and "Traceback" not in p.stderr, p
    assert p.stdout.splitlines() == ["end of script", "atexit ran"], p


TORCHLESS_SCRIPT = textwrap.dedent("""
    import sys
    sys.path.insert(0, {root!r})
    from monarch_tensor.actor import Actor, endpoint, this_host
    class A(Actor):
        @endpoint
        def has_torch(self):
            return "torch" in sys.modules
    def new_mesh_has_torch():
        procs = this_host().spawn_procs({{"gpus": 1}})
        try:
            return procs.spawn("a", A).has_torch.call_one().get(timeout=60)
        finally:
            procs.stop().get(timeout=30)
    print("FIRST", new_mesh_has_torch(), flush=True)
    print("SECOND", new_mesh_has_torch(), flush=True)
    import torch  # noqa: F401 - from now on the script works with torch
    print("AFTER IMPORT", new_mesh_has_torch(), flush=True)
    print("WARMED", "torch._dynamo" in sys.modules, flush=True)  # the tensor engine's warm-up ran meanwhile
""")


@pytest.mark.timeout(120)
def test_a_script_without_torch_gets_procs_at_once_and_later_meshes_with_torch(tmp_path):
    """The template imports torch before forking only for a script that imported it: an actor-only
    script's procs fork at once (like Monarch's, they import torch if they use it), and once the script
    imports torch, the template does too before its next fork."""
    script = tmp_path / "client.py"
    script.write_text(TORCHLESS_SCRIPT.format(root=ROOT))
    env = dict(os.environ)
    env.pop("MONARCH_TENSOR_PRELOAD", None)
    env.pop("MONARCH_TENSOR_NO_WARMUP", None)
    p = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=100, env=env)
    assert p.returncode == 0, p.stderr
    assert "FIRST False" in p.stdout and "SECOND False" in p.stdout, p.stdout
    assert "AFTER IMPORT True" in p.stdout and "WARMED True" in p.stdout, p.stdout


THIS_HOST_SCRIPT = textwrap.dedent("""
    import asyncio, sys
    sys.path.insert(0, {root!r})
    from monarch_tensor.actor import Actor, HostMesh, endpoint, this_host
    from monarch_tensor.errors import MeshStoppedError

    class W(Actor):
        @endpoint
        def ping(self):
            return "pong"

    host = this_host()
    print("SHAPE", host.size(), dict(host.extent), host.initialized.get(timeout=5))
    a = host.spawn_procs({{"gpus": 2}})
    b = host.spawn_procs({{"gpus": 1}})
    w = a.spawn("w", W)
    print("PING", w.ping.call().get(timeout=60).values())
    print("HOST", type(a.slice(gpus=1).host_mesh).__name__, a.host_mesh.sizes)
    host.stop().get(timeout=30)
    for mesh in (a, b):
        try:
            mesh.spawn("w2", W)
        except MeshStoppedError:
            print("STOPPED")

    async def scoped():
        async with this_host() as h:
            c = h.spawn_procs({{"gpus": 1}})
            print("SCOPED", await c.spawn("w", W).ping.call_one())
        return c

    c = asyncio.run(scoped())
    try:
        c.spawn("w3", W)
    except MeshStoppedError:
        print("STOPPED AFTER WITH")
    d = this_host().spawn_procs({{"gpus": 1}})  # this machine stays usable
    print("AGAIN", d.spawn("w", W).ping.call_one().get(timeout=60))
    from monarch_tensor.actor import shutdown_context
    shutdown_context().get(timeout=60)  # every mesh, and the template
    try:
        d.spawn("w4", W)
    except MeshStoppedError:
        print("STOPPED BY SHUTDOWN")
    e = this_host().spawn_procs({{"gpus": 1}})  # a new template
    print("AFTER SHUTDOWN", e.spawn("w", W).ping.call_one().get(timeout=60))
""")


@pytest.mark.timeout(120)
def test_this_host_is_a_mesh_whose_stop_stops_every_local_proc_mesh(tmp_path):
    script = tmp_path / "client.py"
    script.write_text(THIS_HOST_SCRIPT.format(root=ROOT))
    p = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=100)
    assert p.returncode == 0, p.stderr
    assert "SHAPE 1 {} True" in p.stdout, p.stdout
    assert "PING ['pong', 'pong']" in p.stdout and "HOST HostMesh {}" in p.stdout, p.stdout
    assert p.stdout.count("STOPPED\n") == 2, p.stdout
    assert "SCOPED pong" in p.stdout and "STOPPED AFTER WITH" in p.stdout and "AGAIN pong" in p.stdout, p.stdout
    assert "STOPPED BY SHUTDOWN" in p.stdout and "AFTER SHUTDOWN pong" in p.stdout, p.stdout


@pytest.mark.timeout(90)
def test_mesh_tensor_fetches_fail_when_a_proc_of_their_mesh_dies(mesh, faults):
    """A fetch pending from a live rank fails when another proc of the value's mesh dies (the value may wait
    on a collective with it, for ever: a reduce's fetch hung), and so does every later one there, at once;
    the failure reached a waiter, so the fault hook does not run for it."""
    import torch

    from monarch_tensor import fetch_shard

    procs, w, pids = mesh
    with procs.activate():
        x = torch.ones(300, 300)
        for _ in range(4):
            x = x @ x / 300
        pending = fetch_shard(x.reduce("gpus", "sum"), gpus=0)
        os.kill(pids[1], signal.SIGKILL)
        with pytest.raises(SupervisionError, match=r"rank 1 .*SIGKILL"):
            pending.get(timeout=30)
        for later in (fetch_shard(x, gpus=0), fetch_shard(torch.ones(2).reduce("gpus", "sum"), gpus=2)):
            with pytest.raises(SupervisionError, match="rank 1"):
                later.get(timeout=30)  # (a timeout would be a TimeoutError)
    assert faults == []


class FailsThenDies(Actor):
    @endpoint
    def step(self) -> None:
        if current_rank().rank == 0:
            raise RuntimeError("a peer's collective failed")  # what survivors of a dead peer see first
        time.sleep(0.3)
        os._exit(9)


@pytest.mark.timeout(60)
def test_a_proc_that_dies_after_its_call_failed_elsewhere_is_seen_by_that_call(faults):
    # The first error ended the call, and the death of a rank that had not answered then went to no waiter:
    # an unhandled fault, which ends the script (KeyboardInterrupt) while it handles the call's error.
    procs = this_host().spawn_procs({"gpus": 2})
    try:
        w = procs.spawn("fails_then_dies", FailsThenDies)
        with pytest.raises(ActorError, match="a peer's collective failed"):
            w.step.call().get(timeout=30)
        _wait_for(lambda: not procs._procs[1].alive)  # (no call waits on it now)
        _wait_for(lambda: faults, timeout=2)  # (a fault would be reported right after)
        assert "exited with code 9" in procs._procs[1].exit_status and faults == []
    finally:
        procs.stop().get(timeout=30)


class DiesInTurn(Actor):
    @endpoint
    def step(self) -> int:
        rank = current_rank().rank
        if rank > 0:
            time.sleep(0.4 * rank)
            os._exit(rank)
        time.sleep(3)
        return rank


@pytest.mark.timeout(60)
def test_every_death_of_the_ranks_an_awaited_call_waits_on_is_that_calls(faults):
    # The first death finished the call and closed its port: the second found no port waiting on it, an
    # unhandled fault, which ends the script (KeyboardInterrupt) while it handles the call's error.
    procs = this_host().spawn_procs({"gpus": 3})
    try:
        w = procs.spawn("dies_in_turn", DiesInTurn)
        with pytest.raises(SupervisionError, match="died: exited with code"):
            w.step.call().get(timeout=30)
        _wait_for(lambda: not procs._procs[1].alive and not procs._procs[2].alive)
        _wait_for(lambda: faults, timeout=2)  # (a fault would be reported right after)
        assert [f"exited with code {r}" in procs._procs[r].exit_status for r in (1, 2)] == [True, True]
        assert faults == []
    finally:
        procs.stop().get(timeout=30)


@pytest.mark.timeout(60)
def test_a_death_a_stream_hands_to_its_receiver_is_handled(mesh, faults):
    # The stream's port, still waiting on the other ranks, did not count the death as seen: the hook ran.
    procs, w, pids = mesh
    futs = list(w.sleep.stream(2))
    os.kill(pids[1], signal.SIGKILL)
    got = []
    for f in futs:
        try:
            got.append(f.get(timeout=30))
        except SupervisionError as e:
            got.append(e.rank)
    assert sorted(got) == [1, 2, 2]  # (rank 1's failure, and the two others' 2 s)
    _wait_for(lambda: faults, timeout=2)
    assert faults == []


@pytest.mark.timeout(120)
def test_a_fault_hook_can_heal_the_mesh_and_deaths_are_reported_meanwhile(monkeypatch):
    # The hook ran on the thread that reads the template's replies: heal_mesh in it waited for the reply to
    # its spawn (60 s, then failed), and every other spawn and death report waited with it.
    healed, faults, release = [], [], threading.Event()

    def hook(failure):
        faults.append(failure)
        if len(faults) == 1:
            try:
                healed.append(heal_mesh(failure.mesh))
            except Exception as e:  # noqa: BLE001 - the test's failure, not a fault left unhandled
                healed.append(e)
            release.wait(60)  # (still in the hook while the next proc dies)

    monkeypatch.setattr(actor_mod, "unhandled_fault_hook", hook)
    procs = this_host().spawn_procs({"gpus": 2})
    other = this_host().spawn_procs({"gpus": 1})
    try:
        w = procs.spawn("w", Worker)
        os.kill(w.pid.call().get(timeout=60).values()[1], signal.SIGKILL)
        _wait_for(lambda: healed)
        assert len(healed[0].spawn("w", Worker).pid.call().get(timeout=60).values()) == 2
        fut = other.spawn("w", Worker).sleep.call_one(30)  # a call on a proc that dies while the hook blocks
        os.kill(other._procs[0].pid, signal.SIGKILL)
        with pytest.raises(SupervisionError, match="SIGKILL"):
            fut.get(timeout=10)
        release.set()
        _wait_for(lambda: len(faults) > 1, timeout=2)
        assert [f.mesh for f in faults] == [procs]  # (the waiting call saw the second death)
    finally:
        release.set()
        for m in [procs, other, *healed]:
            m.stop().get(timeout=30)


class Broadcaster(Actor):
    """Raises in calls nobody awaits, and owns a mesh whose actors do."""

    def __init__(self) -> None:
        self.failures = []

    @endpoint
    def fail(self, why: str) -> None:
        raise ValueError(why)

    @endpoint(explicit_response_port=True)
    def fail_through_port(self, port, why: str) -> None:
        port.exception(ValueError(why))  # a broadcast's port has nobody listening: the endpoint fails with it

    @endpoint
    def ping(self) -> str:
        return "pong"

    @endpoint
    def own_a_failing_mesh(self) -> None:
        self.child = this_host().spawn_procs({"gpus": 1}).spawn("child", Broadcaster)
        self.child.fail.broadcast("the child's")

    @endpoint
    def seen(self) -> list:
        return self.failures

    def __supervise__(self, failure) -> bool:
        self.failures.append(str(failure))
        return True


def _wait_for(cond, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not cond() and time.monotonic() < deadline:
        time.sleep(0.05)


def _exit_at_once() -> None:
    os._exit(3)


@pytest.mark.timeout(120)
def test_procs_that_die_during_their_spawn_are_its_error_and_no_fault(faults):
    # A proc that died before any call waited on it was an unhandled fault as well as the next call's error,
    # and the script was interrupted although it had caught that error. Here they die on the first line of
    # their runtime (a binding they cannot read), before they said they started.
    from monarch_tensor.actor import proc_mesh

    for _ in range(3):
        procs = proc_mesh(gpus=2, env={"MONARCH_TENSOR_PROC_BIND": "{"})
        _wait_for(lambda procs=procs: not any(p.alive for p in procs._procs))  # dead before anyone calls them
        with pytest.raises(SupervisionError, match="died.*exited with code 1"):
            procs.env.list("MT_").get(timeout=30)
    with pytest.raises(SupervisionError, match="exited with code 3"):
        this_host().spawn_procs({"gpus": 2}, bootstrap=_exit_at_once).initialized.get(timeout=60)
    _wait_for(lambda: faults, timeout=2)  # (a fault would be reported right after)
    assert faults == []


@pytest.mark.timeout(120)
def test_an_error_nobody_awaits_is_a_supervision_event_for_the_meshs_owner(faults):
    # Monarch's: an exception in an endpoint called with broadcast reaches the owner of the actor mesh (its
    # __supervise__, else unhandled_fault_hook); it was only a line in the proc's output.
    procs = this_host().spawn_procs({"gpus": 2})
    try:
        b = procs.spawn("b", Broadcaster)
        b.slice(gpus=1).fail.broadcast("on purpose")
        _wait_for(lambda: faults)
        assert len(faults) == 1 and isinstance(faults[0], SupervisionError)
        assert "b.fail raised on rank 1: ValueError('on purpose')" in str(faults[0]) and faults[0].rank == 1
        assert b.ping.call().get(timeout=30).values() == ["pong", "pong"]  # the actors go on serving
        owner = b.slice(gpus=1)
        owner.own_a_failing_mesh.call_one().get(timeout=60)
        _wait_for(lambda: owner.seen.call_one().get(timeout=30))
        assert ["ValueError(\"the child's\")" in f for f in owner.seen.call_one().get(timeout=30)] == [True]
        assert len(faults) == 1  # the owner handled it: not the script's hook
        # an explicit response port's endpoint that raises (here port.exception with nobody listening) kills its
        # actor, as in Monarch
        b.slice(gpus=0).fail_through_port.broadcast("through the port")
        _wait_for(lambda: len(faults) == 2)
        assert "ValueError('through the port')" in str(faults[1]) and "have failed" in str(faults[1])
        with pytest.raises(SupervisionError, match="have failed"):
            b.slice(gpus=0).ping.call_one().get(timeout=30)
    finally:
        procs.stop().get(timeout=30)


RAISING_HOOK_SCRIPT = textwrap.dedent("""
    import os, signal, sys, time
    sys.path.insert(0, {root!r})
    import monarch_tensor.actor as actor_mod
    from monarch_tensor.actor import Actor, endpoint, this_host
    class W(Actor):
        @endpoint
        def pid(self):
            return os.getpid()
    seen = []
    def hook(failure):
        seen.append(failure)
        raise RuntimeError("a bug in the user's hook")
    actor_mod.unhandled_fault_hook = hook
    for i in range(2):
        procs = this_host().spawn_procs({{"gpus": 1}})
        pid = procs.spawn("w", W).pid.call_one().get(timeout=60)
        try:
            os.kill(pid, signal.SIGKILL)
            time.sleep(30)
        except KeyboardInterrupt:
            print("interrupted", i, len(seen), type(seen[-1]).__name__, flush=True)
        procs.stop().get(timeout=30)
""")


@pytest.mark.timeout(120)
def test_a_raising_fault_hook_leaves_the_fault_unhandled_and_supervision_working():
    # A hook that raises leaves the fault unhandled (Monarch's): the main thread gets a KeyboardInterrupt.
    # The hook runs on the thread that reports procs' exits, which goes on: one that raised once killed that
    # thread, and later deaths went unnoticed (calls on them waited their whole timeout, spawns never ended).
    p = subprocess.run([sys.executable, "-c", RAISING_HOOK_SCRIPT.format(root=ROOT)], capture_output=True,
                       text=True, timeout=110)
    assert p.returncode == 0, p.stderr
    assert p.stdout.splitlines() == ["interrupted 0 1 SupervisionError", "interrupted 1 2 SupervisionError"]
    assert "a bug in the user's hook" in p.stderr


def test_logging_option_on_a_stopped_mesh_or_one_with_a_dead_proc_raises(mesh, faults):
    procs, w, pids = mesh
    os.kill(pids[1], signal.SIGKILL)
    with pytest.raises(SupervisionError, match="rank 1"):
        w.sleep.call(0).get(timeout=30)
    with pytest.raises(SupervisionError, match="rank 1"):  # (it waited for an answer for ever)
        procs.logging_option(stream_to_client=True)
    procs.stop().get(timeout=30)
    with pytest.raises(MeshStoppedError):
        procs.logging_option(stream_to_client=True)


# A client script whose procs will lose their template process; it records the faults in ``seen``.
_TEMPLATE_DEATH_START = textwrap.dedent("""
    import os, signal, sys, time
    sys.path.insert(0, {root!r})
    import monarch_tensor.actor as actor_mod
    from monarch_tensor.hosts import host
    from monarch_tensor.actor import Actor, endpoint, this_host
    class W(Actor):
        @endpoint
        def pid(self):
            return os.getpid()
    seen = []
    actor_mod.unhandled_fault_hook = seen.append
""")

TEMPLATE_DEATH_SCRIPT = _TEMPLATE_DEATH_START + textwrap.dedent("""
    procs = this_host().spawn_procs({{"gpus": 1}})
    procs.spawn("w", W).pid.call_one().get(timeout=60)
    os.kill(host.local_host().proc.pid, signal.SIGKILL)  # the template (the OOM killer's pick, say)
    deadline = time.monotonic() + 20
    while not seen and time.monotonic() < deadline:
        time.sleep(0.05)
    assert seen and "lost with the template process" in str(seen[0]), seen
    again = this_host().spawn_procs({{"gpus": 1}})  # a new template: it failed with BrokenPipeError for ever
    print("PID", again.spawn("w", W).pid.call_one().get(timeout=60), flush=True)
    again.stop().get(timeout=30)
""")


@pytest.mark.timeout(120)
def test_meshes_after_the_template_process_died_get_a_new_one(tmp_path):
    script = tmp_path / "client.py"
    script.write_text(TEMPLATE_DEATH_SCRIPT.format(root=ROOT))
    p = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=100)
    assert p.returncode == 0 and "PID" in p.stdout, p.stdout + p.stderr


TEMPLATE_DEATH_SOCKETS_SCRIPT = _TEMPLATE_DEATH_START + textwrap.dedent("""
    procs = this_host().spawn_procs({{"gpus": 2}})
    procs.spawn("w", W).pid.call().get(timeout=60)
    sockets = [p.addr[len("ipc://"):] for p in procs._procs]
    assert all(os.path.exists(s) for s in sockets), sockets
    os.kill(host.local_host().proc.pid, signal.SIGKILL)
    deadline = time.monotonic() + 20
    while len(seen) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(seen) == 2 and all("lost with the template process" in str(f) for f in seen), seen
    procs.stop().get(timeout=30)
    print("LEFT", [s for s in sockets if os.path.exists(s)], flush=True)
""")


@pytest.mark.timeout(120)
def test_procs_lost_with_the_template_process_leave_no_socket_files(tmp_path):
    # Their procs died with it, killed (PDEATHSIG): the template removes a reaped proc's socket file, and
    # once it was gone nobody removed theirs (4-5 files in the socket directory per such run).
    script = tmp_path / "client.py"
    script.write_text(TEMPLATE_DEATH_SOCKETS_SCRIPT.format(root=ROOT))
    p = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=100)
    assert p.returncode == 0 and "LEFT []" in p.stdout, p.stdout + p.stderr


TEMPLATE_DEATH_BEFORE_STARTED_SCRIPT = _TEMPLATE_DEATH_START + textwrap.dedent("""
    template = host.local_host().proc.pid
    procs = this_host().spawn_procs({{"gpus": 1}})
    os.kill(template, signal.SIGSTOP)  # (it never tells the script that the proc started)
    info = procs._procs[0]
    pid = procs.spawn("w", W).pid.call_one().get(timeout=60)
    print("STARTING", info.starting, flush=True)  # (the template's word that it started never came)
    os.kill(template, signal.SIGKILL)
    deadline = time.monotonic() + 20
    while not seen and time.monotonic() < deadline:
        time.sleep(0.05)
    assert seen and "lost with the template process" in str(seen[0]), seen
    print("FAULT", str(seen[0]).splitlines()[0], flush=True)
""")


@pytest.mark.timeout(120)
def test_a_proc_that_answered_is_a_fault_of_its_mesh_when_the_template_dies_before_saying_it_started(tmp_path):
    # The template relays a proc's "started" (from then on its death is a supervision event, not a failed start);
    # a template that died before it relayed it (its pipe read late on a loaded machine, in CI) left a proc that
    # had answered calls counted as starting: its loss was no fault of its mesh, and nobody heard of it.
    script = tmp_path / "client.py"
    script.write_text(TEMPLATE_DEATH_BEFORE_STARTED_SCRIPT.format(root=ROOT))
    p = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=100)
    assert p.returncode == 0 and "STARTING True" in p.stdout and "FAULT" in p.stdout, p.stdout + p.stderr
    assert "died during its start" not in p.stdout, p.stdout


@pytest.mark.timeout(120)
def test_the_templates_idle_import_steps_each_import_on_their_own():
    # The template imports torch._dynamo while idle in pieces, serving spawns and procs' output between
    # them; each piece must import on its own, in this order, with this torch.
    code = ("import torch\nfrom monarch_tensor.runtime._zygote import _in_steps\nsteps = _in_steps(['torch._dynamo'])\n"
            "assert steps[-1] == 'torch._dynamo' and len(steps) > 1, steps\nfor m in steps:\n    __import__(m)\n"
            "print('OK')")
    p = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=100)
    assert p.returncode == 0 and "OK" in p.stdout, p.stderr


INTERRUPTED_SPAWN_SCRIPT = textwrap.dedent("""
    import os, signal, sys, time
    sys.path.insert(0, {root!r})
    import torch
    from monarch_tensor.hosts import host, local
    from monarch_tensor.actor import this_host

    def interrupted():  # Ctrl-C while the first spawn warms the tensor engine up
        os.kill(os.getpid(), signal.SIGINT)
    local._warm_tensor_engine = interrupted
    try:
        this_host().spawn_procs({{"gpus": 2}})
    except KeyboardInterrupt:
        print("INTERRUPTED", flush=True)
    template = host.local_host().proc.pid

    def procs():
        kids = []
        for p in os.listdir("/proc"):
            try:
                if p.isdigit() and int(open(f"/proc/{{p}}/stat").read().rsplit(")", 1)[1].split()[1]) == template:
                    kids.append(int(p))
            except OSError:
                pass
        return kids
    deadline = time.monotonic() + 20
    while procs() and time.monotonic() < deadline:
        time.sleep(0.05)
    print("LEFT", procs(), flush=True)
""")


@pytest.mark.timeout(90)
def test_an_interrupted_spawn_stops_its_procs(tmp_path):
    # They ran on, and the script's normal end then reported them lost as an unhandled failure (exit 1).
    script = tmp_path / "client.py"
    script.write_text(INTERRUPTED_SPAWN_SCRIPT.format(root=ROOT))
    env = {k: v for k, v in os.environ.items() if k != "MONARCH_TENSOR_NO_WARMUP"}  # (it interrupts the warm-up)
    p = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=80, env=env)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "INTERRUPTED" in p.stdout and "LEFT []" in p.stdout, p.stdout
    assert "unhandled supervision failure" not in p.stderr


INTERRUPTED_STOP_SCRIPT = textwrap.dedent("""
    import os, signal, sys, threading
    sys.path.insert(0, {root!r})
    from monarch_tensor.hosts import host
    from monarch_tensor.actor import Actor, endpoint, this_host
    from monarch_tensor.errors import MeshStoppedError
    class Busy(Actor):
        @endpoint
        def pid(self):
            return os.getpid()
        @endpoint
        def spin(self):
            while True:
                pass
    procs = this_host().spawn_procs({{"gpus": 2}})
    b = procs.spawn("b", Busy)
    print("PIDS", *b.pid.call().get(timeout=60).values(), flush=True)
    f = b.spin.call()
    threading.Timer(1, os.kill, (os.getpid(), signal.SIGINT)).start()  # Ctrl-C within the procs' 5 s
    try:
        procs.stop().get()
    except KeyboardInterrupt:
        print("INTERRUPTED", flush=True)
    try:
        f.get(timeout=20)
    except MeshStoppedError:
        print("CALL STOPPED", flush=True)
    procs.stop().get(timeout=30)
    print("LIVE", procs in host._live_meshes, flush=True)
""")


@pytest.mark.timeout(90)
def test_ctrl_c_during_stop_still_ends_the_procs(tmp_path):
    # The interrupt skipped the kill: busy procs spun on, calls waiting on them never ended, and a second
    # stop() returned at once, the mesh marked stopped.
    script = tmp_path / "client.py"
    script.write_text(INTERRUPTED_STOP_SCRIPT.format(root=ROOT))
    p = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=80,
                       start_new_session=True)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "INTERRUPTED" in p.stdout and "CALL STOPPED" in p.stdout and "LIVE False" in p.stdout, p.stdout
    pids = [int(x) for x in p.stdout.split("PIDS", 1)[1].splitlines()[0].split()]
    assert not any(_alive(pid) for pid in pids)


INTERRUPTED_WARM_UP_SCRIPT = textwrap.dedent("""
    import os, signal, sys, time
    sys.path.insert(0, {root!r})
    import torch
    from monarch_tensor import fetch_shard
    from monarch_tensor.hosts import host
    from monarch_tensor.actor import this_host

    class CtrlC:  # Ctrl-C halfway through the first spawn's warm-up: as its import of torch._dynamo imports sympy
        def find_spec(self, name, path=None, target=None):
            if name == "sympy.printing":
                sys.meta_path.remove(self)
                os.kill(os.getpid(), signal.SIGINT)
    sys.meta_path.insert(0, CtrlC())
    try:
        this_host().spawn_procs({{"gpus": 1}})
    except KeyboardInterrupt:
        print("INTERRUPTED", flush=True)
    from monarch_tensor.controller import tensor as ct
    deadline = time.monotonic() + 60
    while ct._fake_mode is None and time.monotonic() < deadline:
        time.sleep(0.05)
    print("WARMED", ct._fake_mode is not None, flush=True)
    procs = this_host().spawn_procs({{"gpus": 1}})
    with procs.activate():
        print("SUM", fetch_shard(torch.ones(2) + 1).result(timeout=60).tolist(), flush=True)
    procs.stop().get(timeout=30)
""")


@pytest.mark.timeout(150)
def test_ctrl_c_during_the_tensor_engine_warm_up_leaves_its_imports_whole(tmp_path):
    # The warm-up ran on the main thread: a Ctrl-C in it left sympy and torch._dynamo half imported, and
    # every later mesh tensor op failed ("module 'sympy' has no attribute 'core'") until a restart.
    script = tmp_path / "client.py"
    script.write_text(INTERRUPTED_WARM_UP_SCRIPT.format(root=ROOT))
    env = {k: v for k, v in os.environ.items() if k != "MONARCH_TENSOR_NO_WARMUP"}  # (the warm-up is the point)
    p = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=140, env=env)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "INTERRUPTED" in p.stdout and "WARMED True" in p.stdout and "SUM [2.0, 2.0]" in p.stdout, p.stdout


def _late_on_rank_2(x, r):
    if int(r.item()) == 2:
        time.sleep(3.0)  # the others wait for it in the group's first rendezvous
    return x


@pytest.mark.timeout(120)
def test_a_proc_dying_before_its_group_forms_leaves_the_others_working(faults):
    # The survivors waited in the rendezvous for the collective timeout (300 s), and all their later tensor
    # work with them, on slices without the dead proc too.
    import torch

    from monarch_tensor import fetch_shard, remote

    procs = this_host().spawn_procs({"gpus": 3})
    try:
        pids = procs.execute(os.getpid).values()
        late = remote(_late_on_rank_2, propagate=lambda x, r: x)
        with procs.activate():
            x = late(torch.ones(4) * (procs.rank("gpus") + 1), procs.rank("gpus"))
            total = fetch_shard(x.reduce("gpus", "sum"), gpus=0)
            # (a loaded machine may take longer than the sleep to start rank 2's tensor worker: killed before
            # that, it fails the workers' spawn, and so every later fetch of the mesh, which is not this test)
            procs._tensor_client.workers.initialized.get(timeout=60)
            time.sleep(1.5)
            os.kill(pids[2], signal.SIGKILL)
            with pytest.raises(SupervisionError, match="rank 2"):
                total.result(timeout=60)
        with procs.slice(gpus=0).activate():
            assert fetch_shard(torch.ones(2) + 1).result(timeout=60).tolist() == [2.0, 2.0]
        with procs.slice(gpus=slice(0, 2)).activate():  # a group without the dead proc forms and works
            y = torch.ones(2) * (procs.slice(gpus=slice(0, 2)).rank("gpus") + 1)
            assert fetch_shard(y.reduce("gpus", "sum"), gpus=1).result(timeout=60).tolist() == [3.0, 3.0]
    finally:
        procs.stop().get(timeout=30)


def _exit_on_rank_1(x, r):
    if int(r.item()) == 1:
        os._exit(5)
    return x


@pytest.mark.timeout(120)
def test_a_proc_dying_in_a_collective_of_a_formed_group_is_the_fetchs_death(faults):
    # The survivor's gloo collective broke at once ("Connection reset by peer"), before the controller saw
    # the death: the fetch raised that RemoteException, and the death, which no waiting call had seen, was
    # an unhandled fault that ended the script (seed 004's `except DeviceMeshError: heal_mesh` could not work).
    import torch

    from monarch_tensor import fetch_shard, remote

    procs = this_host().spawn_procs({"gpus": 2})
    try:
        die = remote(_exit_on_rank_1, propagate=lambda x, r: x)
        with procs.activate():
            assert fetch_shard(torch.ones(2).reduce("gpus", "sum")).result(timeout=60).tolist() == [2.0, 2.0]
            x = die(torch.ones(2), procs.rank("gpus"))
            with pytest.raises(SupervisionError, match="rank 1 .*died: exited with code 5"):
                fetch_shard(x.reduce("gpus", "sum"), gpus=0).result(timeout=60)
        _wait_for(lambda: faults, timeout=2)  # (a fault would be reported right after)
        assert faults == []
    finally:
        procs.stop().get(timeout=30)


class Aborter(Actor):
    def __init__(self):
        self.cleaned = False

    @endpoint
    def abort(self, reason=None):
        context().actor_instance.abort(reason)
        return "answered"

    @endpoint
    def ping(self):
        return "pong"

    def __cleanup__(self, exc):
        print(f"aborter cleanup on rank {current_rank().rank}", flush=True)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("reason", [None, "test abort reason"])
def test_an_actor_that_aborts_is_a_supervision_failure_for_its_owner(faults, reason):
    # Monarch's context().actor_instance.abort(reason): the actor ends with a failure that its owner's supervision
    # sees (here the script's unhandled_fault_hook), with the reason; calls to it fail; other actors go on.
    procs = this_host().spawn_procs({"gpus": 1})
    try:
        a, other = procs.spawn("aborter", Aborter), procs.spawn("other", Aborter)
        queued = [a.abort.call_one(reason), a.ping.call_one()]
        assert queued[0].get(timeout=30) == "answered"  # the running call still answers
        _wait_for(lambda: faults)
        assert len(faults) == 1 and isinstance(faults[0], SupervisionError)
        report = faults[0].report()
        assert "Aborter" in report and (reason or "no reason provided") in report and faults[0].rank == 0
        with pytest.raises(SupervisionError, match="aborted"):
            queued[1].get(timeout=30)  # queued behind the abort
        with pytest.raises(SupervisionError, match="was stopped \\(aborted"):
            a.ping.call_one().get(timeout=30)
        assert other.ping.call_one().get(timeout=30) == "pong"
    finally:
        procs.stop().get(timeout=30)
    with pytest.raises(RuntimeError, match="call it from an endpoint"):
        context().actor_instance.abort("from the script")


class DiesSoon(Actor):
    @endpoint
    def die_in(self, s: float) -> None:
        """Returns at once; its proc exits ``s`` seconds later (with no call of its caller waiting)."""
        threading.Timer(s, os._exit, (3,)).start()


class RaisingSupervisor(Actor):
    """Spawns a worker mesh of its own; its ``__supervise__`` raises (Monarch's test_supervise_callback_raising)."""

    @endpoint
    def make(self) -> int:
        self.procs = this_host().spawn_procs({"gpus": 1})
        self.w = self.procs.spawn("w", DiesSoon)
        return os.getpid()

    @endpoint
    async def worker_dies(self, sleep: float) -> None:
        await self.w.die_in.call_one(0.2)  # (its proc's death is a supervision event for this actor)
        await asyncio.sleep(sleep)  # (__supervise__ runs on this actor's loop meanwhile)

    def __supervise__(self, failure) -> bool:
        raise RuntimeError("supervise-boom-4711")


@pytest.mark.timeout(120)
def test_a_raising_supervise_ends_its_proc_and_the_callers_error_says_why(faults):
    """An actor's ``__supervise__`` raises: the fault is unhandled, its proc ends, and a call waiting on that
    actor fails with a SupervisionError that names what ``__supervise__`` raised (the proc's last words),
    not only its exit code."""
    sp = this_host().spawn_procs({"gpus": 1})
    try:
        s = sp.spawn("s", RaisingSupervisor)
        pid = s.make.call_one().get(timeout=60)
        with pytest.raises(SupervisionError) as info:
            s.worker_dies.call_one(20).get(timeout=60)
        text = str(info.value)
        assert "supervise-boom-4711" in text and "exited with code 1" in text, text
        # (other tests' procs, running beside this one, may have theirs there for a moment)
        assert not os.path.exists(os.path.join(socket_dir(), f"last-words-{pid}")), "its last words were left behind"
    finally:
        sp.stop().get(timeout=30)
