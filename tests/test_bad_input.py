"""Bad input gets a clear error, and a failure on a proc answers its caller instead of leaving it waiting.

Each case here once hung (a proc's handler raised and never replied, or a callback's error was only
logged) or failed late with an unrelated message; found by probing the public API.
"""

from __future__ import annotations

import pytest

from monarch_tensor import Workspace
from monarch_tensor.actor import Accumulator, Actor, ActorError, endpoint, this_host
from monarch_tensor.env.messages import ReadEnv
from monarch_tensor.transport.messages import SetLogging
from monarch_tensor.utils import setup_env_for_distributed

pytestmark = pytest.mark.timeout(120)


class Counter(Actor):
    def __init__(self, start: int = 0) -> None:
        self.n = start

    @endpoint
    def incr(self) -> int:
        self.n += 1
        return self.n

    @endpoint
    def name_and_rank(self) -> tuple:
        from monarch_tensor.actor import context, current_actor_name

        name = context().actor_instance.name
        assert current_actor_name() == f"{name}[{context().actor_instance.rank.rank}]"
        return name, context().actor_instance.rank.rank

    @endpoint
    def bad_repr(self) -> None:
        class Odd(Exception):
            def __repr__(self):
                raise RuntimeError("no repr")

        raise Odd("odd")


def _send_to_all(procs, make, what: str):
    """Send ``make(port)`` to every proc of ``procs`` past the client's checks; the Future of their replies."""
    from monarch_tensor.transport._ports import Collector
    from monarch_tensor.transport.mailbox import current_mailbox

    members = procs._members()
    col = Collector([p.addr for p in members], [p.rank for p in members], list, what)
    port = current_mailbox().open_port(col)
    for p in members:
        current_mailbox().send(p.addr, make(port))
    return col.future


def test_a_handler_that_fails_on_a_proc_answers_its_caller(procs):
    # Past the client's checks: the procs' handlers raise, and the caller hears of it.
    with pytest.raises(RuntimeError, match="ReadEnv failed on .*TypeError"):
        _send_to_all(procs, lambda port: ReadEnv(None, None, port), "env read").get(timeout=30)
    with pytest.raises(RuntimeError, match="SetLogging failed on"):
        _send_to_all(procs, lambda port: SetLogging("yes", port), "logging").get(timeout=30)
    assert procs.env.list("MONARCH_TENSOR_RANK").get(timeout=30).values() == [
        {"MONARCH_TENSOR_RANK": "0"}, {"MONARCH_TENSOR_RANK": "1"}]  # the procs still serve


def test_env_and_logging_input_is_checked_on_the_client(procs):
    with pytest.raises(TypeError, match="prefix must be a str"):
        procs.env.list(None)
    with pytest.raises(ValueError, match="NUL character"):
        procs.env.set("MT_BAD", "a\0b")
    with pytest.raises(ValueError, match="NUL character"):
        procs.env.set("MT_BAD", {1: "a\0b"})
    with pytest.raises(TypeError, match="True or False"):
        procs.logging_option(stream_to_client="yes")
    with pytest.raises(TypeError, match="master_addr must be"):
        setup_env_for_distributed(procs, master_addr=5, master_port=1234)
    with pytest.raises(ValueError, match="master_port must be an int in 1..65535"):
        setup_env_for_distributed(procs, master_addr="h", master_port=70000)
    with pytest.raises(TypeError, match="on a ProcMesh"):
        setup_env_for_distributed("not a mesh")
    with pytest.raises(TypeError, match="list of dirs"):
        Workspace(dirs="/tmp")


def test_an_accumulator_whose_combine_fails_fails_its_future(procs):
    c = procs.spawn("acc_counter", Counter)
    with pytest.raises(TypeError, match="unsupported operand"):
        Accumulator(c.incr, 0, lambda a, b: a + "x").accumulate().get(timeout=30)
    with pytest.raises(TypeError, match="must be callable"):
        Accumulator(c.incr, 0, 5)
    assert Accumulator(c.incr, 0, lambda a, b: a + b).accumulate().get(timeout=30) == 2 + 2


def test_an_exception_whose_repr_raises_still_fails_the_call(procs):
    c = procs.spawn("odd_counter", Counter)
    with pytest.raises(ActorError, match="its repr\\(\\) raised"):
        c.slice(gpus=0).bad_repr.call_one().get(timeout=30)


def test_a_second_actor_of_the_same_name_is_a_mesh_of_its_own_and_the_first_keeps_its_state(procs):
    # Monarch's: a name is a label; a second spawn under it is another mesh (here named "named_once<2>").
    first = procs.spawn("named_once", Counter, 10)
    assert first.incr.call().get(timeout=30).values() == [11, 11]
    second = procs.spawn("named_once", Counter, 100)
    third = procs.slice(gpus=1).spawn("named_once", Counter, 200)
    assert second.incr.call().get(timeout=30).values() == [101, 101]
    assert third.incr.call().get(timeout=30).values() == [201]
    assert first.incr.call().get(timeout=30).values() == [12, 12]
    assert (second._name, third._name) == ("named_once<2>", "named_once<3>")
    # The runtime's own actors, reached by name, are refused a name in use.
    with pytest.raises(ValueError, match="already runs on proc"):
        procs._spawn_named("named_once", Counter, 100)
    # A process that did not spawn the first (here a mesh made past this one's records): the proc refuses it.
    from monarch_tensor.hosts.host import ProcMesh

    infos = [type(p)(p.addr, p.rank) for p in procs._members()]
    for info in infos:
        info.actors = set()  # (another process's records: it spawned nothing there)
    again = ProcMesh(infos, procs._shape)
    with pytest.raises(ActorError, match="already runs on proc"):
        again.spawn("named_once", Counter, 100).initialized.get(timeout=30)
    assert first.incr.call().get(timeout=30).values() == [13, 13]
    second.stop().get(timeout=30)
    assert procs.spawn("named_once", Counter, 7)._name == "named_once<2>"  # a stopped one's name is free again


class ChildSpawner(Actor):
    """Spawns a ``Counter`` named "shared_child" on the procs it is given, starting at 100 x its rank + 1000."""

    def __init__(self, procs) -> None:
        from monarch_tensor.actor import current_rank

        self.rank = current_rank().rank
        self.child = procs.spawn("shared_child", Counter, 1000 + 100 * self.rank)

    @endpoint
    def child_counts(self) -> list:
        return self.child.incr.call().get(timeout=30).values()

    @endpoint
    def child_names(self) -> list:
        return self.child.name_and_rank.call().get(timeout=30).values()

    @endpoint
    def child_mesh(self):
        return self.child

    @endpoint
    def child_fails(self) -> str:
        try:
            self.child.bad_repr.call().get(timeout=30)
        except ActorError as e:
            return str(e)
        return "no error"


def test_meshes_of_one_name_spawned_by_different_processes_are_meshes_of_their_own(procs):
    # Monarch's (its test_supervise_callback_handled spawns "error_actor" from every rank of a mesh): each spawn
    # is a mesh of its own, though another process spawned one of that name on the same procs. Here the
    # script's "shared_child" and one from each of the 2 ranks (3 processes) share both procs, and every call
    # reaches its own mesh's actors (before, the ranks' spawns were refused and their calls served by the
    # script's actors, without an error).
    mine = procs.spawn("shared_child", Counter, 0)
    spawners = procs.spawn("child_spawner", ChildSpawner, procs)
    spawners.initialized.get(timeout=60)
    assert mine.incr.call().get(timeout=30).values() == [1, 1]
    assert spawners.child_counts.call().get(timeout=60).values() == [[1001, 1001], [1101, 1101]]
    assert spawners.child_counts.call().get(timeout=60).values() == [[1002, 1002], [1102, 1102]]
    assert mine.incr.call().get(timeout=30).values() == [2, 2]
    # They are shown under the name given: names, errors.
    assert mine._name == "shared_child"
    assert spawners.child_names.call().get(timeout=60).values() == [[("shared_child", 0), ("shared_child", 1)]] * 2
    text = spawners.slice(gpus=0).child_fails.call_one().get(timeout=60)
    assert "endpoint shared_child.bad_repr raised" in text and "\0" not in text
    with pytest.raises(ValueError, match="NUL"):  # (the hidden mark starts with one)
        procs.spawn("shared_child\0x", Counter, 0)
    # A child mesh passed to the script is that rank's mesh, not the script's.
    theirs = spawners.slice(gpus=1).child_mesh.call_one().get(timeout=60)
    assert theirs.incr.call().get(timeout=30).values() == [1103, 1103]
    spawners.stop().get(timeout=30)  # (their children stop with them; the script's do not)
    assert mine.incr.call().get(timeout=30).values() == [3, 3]


def test_an_actor_spawned_by_its_class_path_is_imported_on_the_procs_and_a_bad_path_is_its_error(procs):
    """``_spawn_named(..., implementation="module:Class")`` (how the tensor engine spawns its worker): the procs
    import and construct that class; the mesh calls the endpoints of the class given."""
    mesh = procs._spawn_named("by_path", Counter, 40, implementation=f"{Counter.__module__}:Counter")
    assert mesh.incr.call().get(timeout=30).values() == [41, 41]
    missing = procs._spawn_named("by_path_missing", Counter, implementation="mt_no_such_module:Counter")
    with pytest.raises(ActorError, match="mt_no_such_module"):
        missing.initialized.get(timeout=30)
    not_a_class = procs._spawn_named("by_path_function", Counter, implementation="os.path:join")
    with pytest.raises(ActorError, match="is not a class"):
        not_a_class.initialized.get(timeout=30)
    with pytest.raises(ValueError, match="package.module:attribute"):
        procs._spawn_named("by_path_bad", Counter, implementation="os.path.join")


def test_every_adverb_on_actors_the_script_stopped_is_refused_at_the_call(procs):
    # A broadcast was sent, and the proc's "was stopped" answer went to nobody: an unhandled supervision
    # failure that ended the script.
    from monarch_tensor.actor import send

    c = procs.spawn("stopped_here", Counter)
    one = c.slice(gpus=1)  # (a slice taken before the stop is refused too)
    c.stop("bye").get(timeout=30)
    stopped = r"actor 'stopped_here' was stopped \(bye\)"
    for adverb in (lambda: c.incr.broadcast(), lambda: one.incr.broadcast(), lambda: c.incr.stream(),
                   lambda: send(c.incr, (), {}, selection="choose")):
        with pytest.raises(ActorError, match=stopped):
            adverb()
    for fut in (c.incr.call(), one.incr.call_one(), c.incr.choose()):
        with pytest.raises(ActorError, match=stopped):
            fut.get(timeout=30)
    again = procs.spawn("stopped_here", Counter, 5)  # the name may be spawned again
    assert again.incr.call().get(timeout=30).values() == [6, 6]


def test_a_wait_without_limit_is_inf_and_a_bad_timeout_names_timeout(procs):
    # timeout=inf was an OverflowError from inside the mailbox's wait, nan "cannot convert float NaN to
    # integer", "5" a TypeError about +.
    import math

    from monarch_tensor.actor import Channel
    from monarch_tensor.future import Future

    c = procs.spawn("waited_for", Counter)
    assert c.slice(gpus=0).incr.call_one().get(timeout=math.inf) == 1
    assert c.incr.call().get(timeout=1e308).values() == [2, 1]
    assert procs.execute(lambda: 7, timeout=math.inf).values() == [7, 7]
    port, receiver = Channel.open()
    port.send("sent")
    assert receiver.recv().get(timeout=math.inf) == "sent"
    for bad, error in [(math.nan, ValueError), (-1, ValueError), ("5", TypeError), (True, TypeError)]:
        for wait in (lambda t: c.incr.call().get(timeout=t), lambda t: receiver.recv().get(timeout=t),
                     lambda t: Future.ready(None).get(timeout=t)):
            with pytest.raises(error, match="timeout must be a"):
                wait(bad)


def test_proc_mesh_env_is_checked_at_the_call_as_env_set_checks_it(procs, monkeypatch):
    # These killed every proc at its start (os.environ.update in the template's child: a traceback per
    # proc), and the caller got a SupervisionError. A name with a space is refused as env.set refuses it.
    from monarch_tensor.actor import proc_mesh
    from monarch_tensor.hosts import _spawn

    monkeypatch.setattr(_spawn, "_spawn_procs", lambda *a, **k: pytest.fail("spawned procs for a bad env"))
    for env in ({"": "1"}, {"A=B": "1"}, {"A\0B": "1"}, {"MT A": "1"}, {"1A": "1"}):
        with pytest.raises(ValueError, match="bad environment variable name"):
            procs.env.set(next(iter(env)), "1")
        with pytest.raises(ValueError, match="bad environment variable name"):
            proc_mesh(gpus=1, env=env)
    with pytest.raises(ValueError, match="NUL character"):
        proc_mesh(gpus=1, env={"MT_A": "a\0b"})
    with pytest.raises(TypeError, match="maps variable names to string values"):
        proc_mesh(gpus=1, env={"MT_A": None})


def test_mesh_sizes_and_job_mesh_names_are_checked():
    from monarch_tensor.job import LocalJob
    from monarch_tensor.shape import Shape

    with pytest.raises(ValueError, match="positive int size"):
        Shape(("gpus",), (True,))
    for meshes in ({"m": True}, [2], {"m": 0}):  # (none at all: one mesh "hosts" of one host)
        with pytest.raises(ValueError, match="host counts >= 1"):
            LocalJob(meshes=meshes)
    for name in (5, "_meshes", "../esc", "a b"):
        with pytest.raises(ValueError, match="mesh names must be Python identifiers"):
            LocalJob(meshes={name: 1})
    for hosts in ([], "trainers", [3]):
        with pytest.raises(ValueError, match="takes names of host meshes"):
            LocalJob(hosts=hosts)
    with pytest.raises(TypeError, match="not both"):
        LocalJob(meshes={"m": 1}, hosts=["m"])
    with pytest.raises(TypeError, match="maps variable names to string values"):
        LocalJob(meshes={"m": 1}, env={"N": 3})


def test_spawn_procs_refuses_more_procs_per_host_than_its_limit(monkeypatch):
    with pytest.raises(ValueError, match=r"asks for 2000000 procs on each host, more than the limit of 1024"):
        this_host().spawn_procs(per_host={"nodes": 1000, "gpus": 2000})
    monkeypatch.setenv("MONARCH_TENSOR_MAX_PROCS_PER_HOST", "1")
    with pytest.raises(ValueError, match="limit of 1; set MONARCH_TENSOR_MAX_PROCS_PER_HOST"):
        this_host().spawn_procs(per_host={"gpus": 2})
    monkeypatch.setenv("MONARCH_TENSOR_MAX_PROCS_PER_HOST", "lots")
    with pytest.raises(ValueError, match="MONARCH_TENSOR_MAX_PROCS_PER_HOST must be a whole number, got 'lots'"):
        this_host().spawn_procs(per_host={"gpus": 2})
    monkeypatch.setenv("MONARCH_TENSOR_MAX_PROCS_PER_HOST", "2")
    mesh = this_host().spawn_procs(per_host={"gpus": 2})  # at the limit: allowed
    try:
        assert mesh.spawn("at_limit", Counter).incr.call().get(timeout=60).values() == [1, 1]
    finally:
        mesh.stop().get(timeout=60)


@pytest.mark.parametrize("var", ["MONARCH_TENSOR_PREFIX_WITH_RANK", "MONARCH_TENSOR_NO_WARMUP",
                                 "MONARCH_TENSOR_ENABLE_LOG_FORWARDING"])
def test_a_bad_switch_in_the_environment_is_an_error_at_the_spawn(var, monkeypatch):
    # PREFIX_WITH_RANK=maybe was first read on the thread that prints the procs' output, which it ended (see
    # the next test); NO_WARMUP=maybe was a traceback of the warm-up thread, and the spawn went on.
    monkeypatch.setenv(var, "maybe")
    with pytest.raises(ValueError, match=f"{var} must be 1 or 0"):
        this_host().spawn_procs(per_host={"gpus": 1})


class Loud(Actor):
    @endpoint
    def say(self) -> None:
        print("a line for the client", flush=True)

    @endpoint
    def die(self) -> None:
        import os

        os._exit(3)


def test_a_failure_printing_a_procs_output_leaves_its_death_reported(monkeypatch):
    # One thread reads the template's replies (spawns, output, exits); printing a line that raised ended it,
    # and with it every later report: a proc's death was a caller's timeout, a spawn hung.
    from monarch_tensor.actor import SupervisionError

    mesh = this_host().spawn_procs(per_host={"gpus": 1})
    try:
        loud = mesh.spawn("loud", Loud)
        loud.say.call_one().get(timeout=60)
        monkeypatch.setenv("MONARCH_TENSOR_PREFIX_WITH_RANK", "maybe")  # read as each line is printed: raises
        loud.say.call_one().get(timeout=30)
        monkeypatch.delenv("MONARCH_TENSOR_PREFIX_WITH_RANK")
        with pytest.raises(SupervisionError, match="exited with code 3"):
            loud.die.call_one().get(timeout=30)
    finally:
        mesh.stop().get(timeout=30)


@pytest.mark.parametrize("per_host", [2, ["gpus"], "gpus", [("gpus", 2)]])
def test_spawn_procs_per_host_that_is_no_dict_is_a_type_error_naming_it(per_host):
    # per_host=2 (a torchrun user's "2 procs per host") failed with "'int' object is not iterable", a list
    # of names with "dictionary update sequence element #0 has length 4; 2 is required".
    with pytest.raises(TypeError, match=r"per_host must be a dict of dimension sizes, e.g. \{'gpus': 2\}, got "):
        this_host().spawn_procs(per_host=per_host)


def test_job_load_of_a_file_that_is_no_job_file_says_so(tmp_path):
    from monarch_tensor.job import job_load
    from monarch_tensor.transport._curve import write_private

    path = str(tmp_path / "job.json")
    for text, match in [("{not json", "not a monarch-tensor job file \\(not JSON"),
                        ("[1, 2]", "not a monarch-tensor job file \\(kind None\\)"),
                        ('{"kind": "local"}', "damaged local job file: KeyError: 'meshes'"),
                        ('{"kind": "local", "meshes": {"m": 1}, "keys": 3, "addrs": {}}',
                         "damaged local job file: TypeError")]:
        write_private(path, text)
        with pytest.raises(ValueError, match=match):
            job_load(path)


def test_enable_transport_accepts_what_runs_here_and_refuses_the_rest():
    import monarch_tensor.actor as actor
    from monarch_tensor.actor import ChannelTransport, enable_transport

    try:
        for ok, want in (("tcp", ChannelTransport.TcpWithHostname), ("tcp://127.0.0.1:8080",
                         ChannelTransport.TcpWithHostname), (ChannelTransport.Local, ChannelTransport.Local),
                         ("ipc", ChannelTransport.Unix)):
            enable_transport(ok)
            assert actor.enabled_transport is want
        for bad in ("tls", "metatls-hostname", ChannelTransport.Quic):
            with pytest.raises(ValueError, match="is not served here"):
                enable_transport(bad)
        with pytest.raises(ValueError, match="known names are"):
            enable_transport("carrier-pigeon")
        with pytest.raises(TypeError, match="takes a ChannelTransport"):
            enable_transport(5)
        assert actor.enabled_transport is ChannelTransport.Unix  # a refused one changes nothing
    finally:
        enable_transport("ipc")
    assert actor.config.get("prefix_with_rank") in (True, False)  # Monarch's monarch.actor.config


def _cli(*args, timeout: float = 30):
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    return subprocess.run([sys.executable, "-m", "monarch_tensor.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env=dict(os.environ, PYTHONPATH=root))


def test_the_cli_refuses_bad_paths_and_seconds_in_one_line(tmp_path):
    """A path it cannot write and a number of seconds that is none (negative, nan) are one line on stderr and
    status 2, not a traceback, nor accepted (``--ttl -1`` exited at once, ``nan`` never)."""
    from monarch_tensor.transport._curve import JobKeys

    key = str(tmp_path / "job.key")
    JobKeys.generate().save(key)
    host = ["host", "--bind", "tcp://127.0.0.1:0", "--key-file", key]
    for args, says in ((["keygen", "/nonexistent/dir/k"], "cannot write /nonexistent/dir/k"),
                       ([*host, "--address-file", "/nonexistent/a"], "cannot write the address file /nonexistent/a"),
                       ([*host, "--ttl", "-1"], "--ttl: a number of seconds > 0"),
                       ([*host, "--ttl", "nan"], "--ttl: a number of seconds > 0"),
                       ([*host, "--ttl", "0"], "--ttl: a number of seconds > 0"),
                       (["debug", "--wait", "-5"], "--wait: a number of seconds >= 0"),
                       # a directory (IsADirectoryError's traceback; /tmp's was "run `chmod 600 /tmp`")
                       (["host", "--bind", "tcp://127.0.0.1:0", "--key-file", str(tmp_path)],
                        f"{tmp_path} is a directory, not a key or job file")):
        r = _cli(*args)
        assert r.returncode == 2 and says in r.stderr and "Traceback" not in r.stderr, (args, r.stderr)


def test_ctrl_c_stops_a_host_agent_cleanly_and_takes_back_its_address_file(tmp_path):
    import os
    import signal
    import subprocess
    import sys
    import time

    from monarch_tensor.transport._curve import JobKeys

    key, addr = str(tmp_path / "job.key"), tmp_path / "addr"
    JobKeys.generate().save(key)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    p = subprocess.Popen([sys.executable, "-m", "monarch_tensor.cli", "host", "--bind", "tcp://127.0.0.1:0",
                          "--key-file", key, "--address-file", str(addr)], env=dict(os.environ, PYTHONPATH=root),
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while not addr.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert addr.exists()
        p.send_signal(signal.SIGINT)
        _, err = p.communicate(timeout=30)
    finally:
        p.kill()
    assert p.returncode == 130 and "interrupted" in err and "Traceback" not in err, err
    assert not addr.exists()


def test_a_str_where_a_list_of_strings_is_needed_is_a_type_error(tmp_path):
    # Each was split into characters: a "#SBATCH" line per character, a mesh of one "host" per character, and
    # attach_to_workers complained about the address 't'.
    from monarch_tensor.hosts.remote_hosts import attach_to_workers
    from monarch_tensor.job import HostListJob, SlurmJob
    from monarch_tensor.transport._curve import JobKeys

    key = str(tmp_path / "job.key")
    JobKeys.generate().save(key)
    with pytest.raises(TypeError, match=r"slurm_args=\.\.\.\) takes a list of strings, .* got '--foo'"):
        SlurmJob(meshes={"m": 1}, slurm_args="--foo")
    assert "#SBATCH --foo" in SlurmJob(meshes={"m": 1}, slurm_args=["--foo"])._script(1)
    with pytest.raises(TypeError, match="HostListJob needs a dict of mesh name -> list of agent address strings"):
        HostListJob({"m": "tcp://127.0.0.1:1"}, key_file=key)
    assert HostListJob({"m": ["tcp://127.0.0.1:1"]}, key_file=key).addrs == {"m": ["tcp://127.0.0.1:1"]}
    with pytest.raises(TypeError, match="attach_to_workers needs a list of address strings"):
        attach_to_workers("tcp://127.0.0.1:1", key_file=key, timeout=3)


def test_sync_workspace_of_a_path_is_a_type_error_whether_or_not_procs_run(procs, monkeypatch):
    # With no proc running, this_host().sync_workspace("/tmp") failed with "'str' object has no attribute
    # 'check'" (the path to sync_local skipped the type check the path to the procs makes).
    from monarch_tensor.hosts import host_mesh

    for ws in ("/tmp", None):
        with pytest.raises(TypeError, match="sync_workspace needs a Workspace, got"):
            this_host().sync_workspace(ws).get(timeout=30)  # to the procs running here
    monkeypatch.setattr(host_mesh, "_live_meshes", set())  # as if none ran: this host's root is written directly
    for ws in ("/tmp", None):
        with pytest.raises(TypeError, match="sync_workspace needs a Workspace, got"):
            this_host().sync_workspace(ws).get(timeout=30)


def test_job_and_exec_env_is_checked_at_the_call_as_proc_mesh_checks_it():
    # ProcessJob(env={"A=B": "1"}) was accepted, and state() failed later with subprocess's bare "illegal
    # environment variable name" (a NUL: "embedded null byte"), naming neither the variable nor env=.
    from monarch_tensor.job import LocalJob, ProcessJob, exec_command

    for job in (LocalJob, ProcessJob):
        for env in ({"A=B": "1"}, {"": "1"}, {"1A": "1"}):
            with pytest.raises(ValueError, match="bad environment variable name"):
                job({"m": 1}, env=env)
        with pytest.raises(ValueError, match="NUL character"):
            job({"m": 1}, env={"A": "a\0b"})
    with pytest.raises(ValueError, match="bad environment variable name 'A=B'"):
        exec_command(this_host(), ["true"], env={"A=B": "1"})
    with pytest.raises(ValueError, match="NUL character"):
        exec_command(this_host(), ["true"], env={"A": "a\0b"})


def test_a_key_or_job_file_that_is_a_directory_or_no_path_says_so(tmp_path):
    # Loading a directory said "run `chmod 600 /tmp`" (other users may read /tmp) or raised IsADirectoryError.
    from monarch_tensor.errors import JobKeyError
    from monarch_tensor.job import job_load
    from monarch_tensor.transport._curve import JobKeys

    for path in ("/tmp", str(tmp_path)):
        with pytest.raises(JobKeyError, match="is a directory, not a key or job file"):
            JobKeys.load(path)
        with pytest.raises(JobKeyError, match="is a directory, not a key or job file"):
            job_load(path)
    with pytest.raises(TypeError, match="path of a key or job file must be a str, got None"):
        job_load(None)


def test_unclear_errors_and_accepted_nonsense_now_say_what_was_wrong(procs, tmp_path):
    # Each failed deep inside with a message that named neither the argument nor the fault, or was accepted.
    from monarch_tensor import Extent, NDSlice, Shape
    from monarch_tensor.actor import ValueMesh, send
    from monarch_tensor.job import exec_command, job_loads
    from monarch_tensor.tools import commands

    with pytest.raises(ValueError, match=r"offset must be non-negative ints, got '0' \(str\)"):  # was "got 0"
        NDSlice(offset="0", sizes=[2], strides=[1])
    with pytest.raises(ValueError, match="dimension 'a' must have a positive int size, got -1"):  # accepted
        Extent(["a"], [-1])
    with pytest.raises(ValueError, match="3 values for the 2 ranks"):  # accepted
        ValueMesh(Shape.from_sizes({"g": 2}), [1, 2, 3])
    with pytest.raises(ValueError, match="not a monarch-tensor job file \\(not UTF-8 text"):  # UnicodeDecodeError
        job_loads(b"\xff\xfe")
    c = procs.spawn("unclear_counter", Counter)
    with pytest.raises(TypeError, match="positional arguments as a tuple"):  # "'int' object is not iterable"
        send(c.incr, 5, {})
    with pytest.raises(TypeError, match="keyword arguments as a dict"):  # "dictionary update sequence ..."
        c.incr.send((), [1])
    with pytest.raises(TypeError, match="needs an endpoint"):  # accumulate(): AttributeError on None
        Accumulator(None, 0, lambda a, b: a + b)
    with pytest.raises(TypeError, match="rank\\(\\) takes a dim name"):  # "'int' object is not iterable"
        procs.rank(0)
    with pytest.raises(TypeError, match="aggregate_window_sec=...\\) takes None or a number of seconds"):
        procs.logging_option(aggregate_window_sec="3")  # "'>' not supported between 'str' and 'int'"
    with pytest.raises(ValueError, match="number of seconds >= 0, got -1"):  # accepted
        procs.logging_option(aggregate_window_sec=-1)
    with pytest.raises(ValueError, match="--per-host takes DIM=N"):  # named --point's "a point is DIM=N"
        commands.parse_per_host("garbage")
    a_file = tmp_path / "a_file"
    a_file.write_text("")
    with pytest.raises(ActorError, match=f"cannot make the output directory '{a_file}/x'"):  # no path named
        exec_command(this_host(), ["true"], output_dir=f"{a_file}/x").get(timeout=60)
