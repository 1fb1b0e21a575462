"""The job workflow of Monarch 0.7's CLI: ``monarch-tensor apply / exec / shell / kill / context``, and the API
under it (``set_current_job``, ``load_current_job``, ``exec_command``, ``shell``).

The CLI runs as a user runs it: separate processes in a working directory that
holds the job's spec (a LocalJob: real agents, real procs), one command after
another, each reattaching to the job that ``apply`` started.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from monarch_tensor.actor import this_host
from monarch_tensor.errors import ActorError
from monarch_tensor.job import LocalJob, current, exec_command, job_load, load_current_job, set_current_job, shell
from monarch_tensor.tools import commands

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])))
SPEC = "from monarch_tensor.job import LocalJob\njob = LocalJob(meshes={meshes!r}, ttl=120)\n"


def cli(cwd, *args, stdin: str | None = None, timeout: float = 90) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "monarch_tensor.cli", *args], cwd=cwd, env=ENV, input=stdin,
                          capture_output=True, text=True, timeout=timeout)


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie child of this process is not alive
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def sleeping(secs: str) -> bool:
    """Whether a ``sleep <secs>`` runs on this machine."""
    return subprocess.run(["pgrep", "-f", f"^sleep {secs}$"], capture_output=True).returncode == 0


def pids(cwd, context: str = "default") -> list[int]:
    with open(os.path.join(cwd, ".monarch", context, "state.json")) as f:
        return json.load(f)["pids"]


@pytest.fixture
def workdir(tmp_path):
    """A working directory with job specs; every job started there is killed after the test."""
    (tmp_path / "myjob.py").write_text(SPEC.format(meshes={"trainers": 2, "gen": 1}))
    (tmp_path / "other.py").write_text(SPEC.format(meshes={"beta": 1}))
    yield tmp_path
    for state in (tmp_path / ".monarch").glob("*/state.json"):
        try:
            job_load(str(state)).kill()
        except Exception:  # noqa: BLE001 - killed by the test already
            pass


@pytest.mark.timeout(360)
def test_apply_exec_kill(workdir):
    r = cli(workdir, "apply", "myjob.job")
    assert r.returncode == 0, r.stderr
    assert "is ready" in r.stdout
    link = workdir / ".monarch" / "job_state.json"
    assert link.is_symlink() and os.readlink(link) == os.path.join("default", "state.json")
    assert (workdir / ".monarch" / "default" / "spec").read_text().strip() == "myjob.job"
    assert oct(os.stat(link).st_mode & 0o777) == "0o600"  # it holds the job's key
    agents = pids(workdir)
    assert len(agents) == 3 and all(alive(p) for p in agents)

    # the default target: rank 0 of the first mesh, output streamed, its status returned
    r = cli(workdir, "exec", "--", "bash", "-c",
            "echo r=$MONARCH_RANK_hosts/$MONARCH_SIZE_hosts cwd=$(pwd); echo oops >&2; exit 3")
    assert r.returncode == 3, r.stderr
    assert f"r=0/2 cwd={workdir}" in r.stdout and "oops" in r.stderr
    assert pids(workdir) == agents  # it reattached: no new agents

    # every host of every mesh, output to files per rank; the largest status
    out = workdir / "outputs"
    r = cli(workdir, "exec", "--all", "--output-dir", str(out), "--", "bash", "-c",
            "echo host $MONARCH_RANK_hosts of $MONARCH_SIZE_hosts; exit $MONARCH_RANK_hosts")
    assert r.returncode == 1, r.stderr
    files = sorted(str(p.relative_to(out)) for p in out.rglob("stdout.txt"))
    assert files == ["gen/hosts_0_procs_0/stdout.txt", "trainers/hosts_0_procs_0/stdout.txt",
                     "trainers/hosts_1_procs_0/stdout.txt"]
    assert (out / "trainers/hosts_1_procs_0/stdout.txt").read_text() == "host 1 of 2\n"
    assert (out / "gen/hosts_0_procs_0/stdout.txt").read_text() == "host 0 of 1\n"

    # one host, several procs on it: lines labelled by rank, each rank's in order; -e, --workdir
    r = cli(workdir, "exec", "--point", "hosts=1", "--per-host", "gpus=2", "-e", "FOO=bar", "--workdir", "/tmp",
            "--", "bash", "-c", "echo $FOO $MONARCH_RANK_gpus/$MONARCH_SIZE_gpus $(pwd); echo second")
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    for g in (0, 1):
        mine = [ln for ln in lines if ln.startswith(f"[hosts_1_gpus_{g}] ")]
        assert mine == [f"[hosts_1_gpus_{g}] bar {g}/2 /tmp", f"[hosts_1_gpus_{g}] second"], r.stdout

    # a bash script from stdin; a Python file, run with the procs' interpreter
    r = cli(workdir, "exec", "--script", "-", stdin="x=41\necho $((x + 1))\n")
    assert (r.returncode, r.stdout) == (0, "42\n"), r.stderr
    (workdir / "hello.py").write_text("import sys\nprint('py', sys.argv[1:], sys.executable == %r)\n"
                                      % sys.executable)
    r = cli(workdir, "exec", "hello.py", "a", "b")
    assert (r.returncode, r.stdout) == (0, "py ['a', 'b'] True\n"), r.stderr

    # bad targets: one line on stderr, status 2, the job as it was
    for args, msg in ((["--mesh", "nope", "true"], "no mesh 'nope'"),
                      (["--point", "hosts=5", "true"], "out of range"),
                      (["--point", "hosts", "true"], "DIM=N"),
                      (["-e", "NOEQUALS", "true"], "KEY=VALUE"),
                      ([], "no command"),
                      (["--workdir", "/no/such/dir", "true"], "'/no/such/dir' does not exist on")):
        r = cli(workdir, "exec", *args)
        assert r.returncode == 2 and msg in r.stderr and "Traceback" not in r.stderr, (args, r.stderr)
    assert pids(workdir) == agents

    # Ctrl-C: the command's procs stop, and the command with them
    p = subprocess.Popen([sys.executable, "-m", "monarch_tensor.cli", "exec", "--", "bash", "-c",
                          "echo started; exec sleep 61.25"], cwd=workdir, env=ENV, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline() == "started\n"
        deadline = time.monotonic() + 30  # (bash printed, then execs sleep: pgrep may look before the exec)
        while not sleeping("61.25") and time.monotonic() < deadline:
            time.sleep(0.05)
        assert sleeping("61.25")
        p.send_signal(signal.SIGINT)
        _, err = p.communicate(timeout=60)
    finally:
        p.kill()
    assert p.returncode == 130 and "interrupted" in err, err
    deadline = time.monotonic() + 20
    while sleeping("61.25") and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not sleeping("61.25")
    assert pids(workdir) == agents  # the job itself runs on

    # the command's proc dies under it: a one-line error, status 2, and neither the command nor the children it
    # started outlive it
    r = cli(workdir, "exec", "--", "python", "-c",
            "import os, signal, subprocess, time; subprocess.Popen(['sleep', '61.75']); time.sleep(0.2); "
            "os.kill(os.getppid(), signal.SIGKILL); time.sleep(61.5)")
    assert r.returncode == 2 and "died" in r.stderr and "Traceback" not in r.stderr, r.stderr
    deadline = time.monotonic() + 20
    while subprocess.run(["pgrep", "-f", "time.sleep.61.5"], capture_output=True).returncode == 0 or \
            sleeping("61.75"):
        assert time.monotonic() < deadline, "the command or its child outlived its proc"
        time.sleep(0.1)

    # kill: the agents exit and the job file goes; a second kill says there is nothing to kill
    r = cli(workdir, "kill")
    assert r.returncode == 0, r.stderr
    deadline = time.monotonic() + 20
    while any(alive(p) for p in agents) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(alive(p) for p in agents)
    assert not (workdir / ".monarch" / "default" / "state.json").exists()
    r = cli(workdir, "kill")
    assert r.returncode == 2 and "no running job" in r.stderr


@pytest.mark.timeout(360)
def test_contexts_hold_jobs_side_by_side(workdir):
    assert cli(workdir, "apply", "myjob.job").returncode == 0
    r = cli(workdir, "context", "use", "second")
    assert r.returncode == 0 and "Switched" in r.stdout
    r = cli(workdir, "exec", "true")  # no spec recorded in this context yet
    assert r.returncode == 2 and "no job spec in context 'second'" in r.stderr
    assert cli(workdir, "apply", "other.job").returncode == 0
    assert cli(workdir, "context", "ls").stdout.splitlines() == ["  default", "* second"]

    where = ["exec", "--", "bash", "-c", "echo $WORKSPACE_DIR"]  # each LocalJob host has its own directory
    assert "/beta-0/" in cli(workdir, *where).stdout
    assert cli(workdir, "context", "use", "default").returncode == 0
    assert "/trainers-0/" in cli(workdir, *where).stdout

    r = cli(workdir, "context", "rm", "nosuch")
    assert r.returncode == 2 and "no context 'nosuch'" in r.stderr
    (workdir / "broken.py").write_text("job = (\n")
    r = cli(workdir, "apply", "broken.job")
    assert r.returncode == 2 and len(r.stderr.splitlines()) == 1 and "syntax error" in r.stderr, r.stderr
    r = cli(workdir, "exec", "--point", "bogus=0", "--", "true")
    assert r.returncode == 2 and "has no dimension 'bogus'" in r.stderr and '"' not in r.stderr, r.stderr

    second = pids(workdir, "second")
    r = cli(workdir, "context", "rm", "second")  # kills its job
    assert r.returncode == 0, r.stderr
    deadline = time.monotonic() + 20
    while any(alive(p) for p in second) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(alive(p) for p in second)
    assert cli(workdir, "context", "ls").stdout.splitlines() == ["* default"]
    assert all(alive(p) for p in pids(workdir))  # the other context's job runs on

    # its agents died (killed behind its back): the next exec starts the job again
    before = pids(workdir)
    for p in before:
        os.kill(p, signal.SIGKILL)
    r = cli(workdir, "exec", "--", "bash", "-c", "echo again")
    assert (r.returncode, r.stdout) == (0, "again\n"), r.stderr
    assert set(pids(workdir)).isdisjoint(before)


@pytest.mark.timeout(120)
def test_current_job_api(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    (tmp_path / "spec_mod.py").write_text("from monarch_tensor.job import LocalJob\njob = LocalJob(meshes={'m': 1})\n"
                                          "not_a_job = 42\n")
    with pytest.raises(FileNotFoundError, match="no job spec in context 'default'"):
        load_current_job()
    with pytest.raises(ValueError, match="module.attr"):
        set_current_job("nodots")
    with pytest.raises(ImportError, match="no_such_module"):
        set_current_job("no_such_module.job")
    with pytest.raises(AttributeError, match="has no 'nope'"):
        set_current_job("spec_mod.nope")
    with pytest.raises(TypeError, match="must be a job"):
        set_current_job("spec_mod.not_a_job")
    assert not (tmp_path / ".monarch" / "default" / "spec").exists()  # nothing recorded by the failures
    set_current_job("spec_mod.job")
    job = load_current_job()
    assert isinstance(job, LocalJob) and job.meshes == {"m": 1} and not job.active
    assert current.current_context() == "default" and current.current_spec() == "spec_mod.job"
    with pytest.raises(ValueError, match="plain directory name"):
        current.context_use("../escape")
    current.context_use("x")
    assert current.context_ls() == [("default", False), ("x", True)]
    assert current.current_spec() is None  # context x has none of its own

    # a plain job file (a job.dump() there before contexts) moves into the default context
    other = tmp_path / "older"
    (other / ".monarch").mkdir(parents=True)
    (other / ".monarch" / "job_state.json").write_text("{}")
    monkeypatch.chdir(other)
    current.context_use("y")
    assert (other / ".monarch" / "default" / "state.json").read_text() == "{}"
    assert current.context_ls() == [("default", False), ("y", True)]


@pytest.fixture(scope="module")
def two_hosts():
    job = LocalJob(meshes={"hosts": 2}, ttl=120)
    try:
        yield job.state().hosts
    finally:
        job.kill()


@pytest.mark.timeout(120)
def test_exec_command(two_hosts, capfd):
    code = exec_command(two_hosts, ["bash", "-c", "echo at $MONARCH_RANK_hosts; exit 4"], rank=1).get(timeout=60)
    assert code == 4
    assert capfd.readouterr().out == "at 1\n"
    # on every host, streamed: labelled lines; the Future holds the largest status
    code = exec_command(two_hosts, ["bash", "-c", "echo x; exit $MONARCH_RANK_hosts"]).get(timeout=60)
    assert code == 1
    assert sorted(capfd.readouterr().out.splitlines()) == ["[hosts_0_procs_0] x", "[hosts_1_procs_0] x"]
    # a signal's status as a shell reports it
    assert exec_command(two_hosts, ["bash", "-c", "kill -TERM $$"], rank=0).get(timeout=60) == 128 + 15
    # this machine's host too
    assert exec_command(this_host(), ["true"]).get(timeout=60) == 0
    # bad input raises at once
    with pytest.raises(TypeError, match="list of words"):
        exec_command(two_hosts, "echo hi")
    with pytest.raises(ValueError, match="not both"):
        exec_command(two_hosts, ["true"], rank=0, point={"hosts": 0})
    with pytest.raises(ValueError, match="rank 2 is not in"):
        exec_command(two_hosts, ["true"], rank=2)
    with pytest.raises(TypeError, match="string values"):
        exec_command(two_hosts, ["true"], env={"A": 1})
    # per_host with a dim of the host mesh: refused on one host too, whose slice lost the dim (its procs were
    # told hosts ranks 0 and 1 on one host)
    for target in ({}, {"rank": 0}, {"point": {"hosts": 1}}):
        with pytest.raises(ValueError, match="per_host cannot have a 'hosts' dimension"):
            exec_command(two_hosts, ["true"], per_host={"hosts": 2}, **target)
    # a working directory the host lacks fails the Future, with its name
    with pytest.raises(ActorError, match="working directory '/no/such/dir' does not exist"):
        exec_command(two_hosts, ["true"], rank=0, workdir="/no/such/dir").get(timeout=60)
    # a command the host lacks: a shell's status and words (127, "command not found")
    capfd.readouterr()
    assert exec_command(two_hosts, ["/no/such/cmd", "x"], rank=0).get(timeout=60) == 127
    assert "/no/such/cmd: command not found" in capfd.readouterr().err


@pytest.mark.timeout(60)
def test_shell_needs_one_host(two_hosts):
    with pytest.raises(ValueError, match="one host"):
        shell(two_hosts)
    with pytest.raises(ValueError, match="DIM=N"):
        commands.parse_point("hosts")
    with pytest.raises(ValueError, match=">= 1"):
        commands.parse_per_host("gpus=0")


@pytest.mark.timeout(180)
def test_shell_in_a_terminal(workdir):
    pexpect = pytest.importorskip("pexpect", reason="pexpect is a dev extra: pip install -e '.[dev]'")
    assert cli(workdir, "apply", "myjob.job").returncode == 0
    sh = pexpect.spawn(sys.executable, ["-m", "monarch_tensor.cli", "shell", "--point", "hosts=1", "-e", "ZZ=top"],
                       cwd=str(workdir), env=ENV, encoding="utf-8", timeout=60, dimensions=(24, 80))
    try:
        sh.expect(r"[#$] ")  # the remote shell's first prompt
        sh.sendline("echo rank=$MONARCH_RANK_hosts/$MONARCH_SIZE_hosts zz=$ZZ; tty; stty size")
        sh.expect(r"rank=1/2 zz=top\s+/dev/pts/\d+\s+24 80")
        sh.setwinsize(40, 100)  # the remote terminal follows the local one's size
        deadline = time.monotonic() + 20
        while True:
            sh.sendline("stty size")
            if sh.expect([r"40 100", r"24 80"]) == 0 or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert sh.after == "40 100"
        sh.sendline("sleep 60; echo slept-$((2 * 2))")
        time.sleep(0.5)
        sh.sendintr()  # Ctrl-C reaches the remote foreground job, not this client
        sh.sendline("echo after-$((6 * 7))")
        sh.expect("after-42")
        assert "slept-4" not in sh.before  # (the command line it echoed says slept-$((2 * 2)))
        sh.sendline("exit 7")
        sh.expect(pexpect.EOF)
    finally:
        sh.close(force=True)
    assert sh.exitstatus == 7
    # the shell's proc dies under it (input from a pipe that stays open): a one-line error, status 2
    sh = _piped_shell(workdir)
    try:
        sh.stdin.write("kill -9 $PPID; sleep 30\n")
        sh.stdin.flush()
        sh.wait(timeout=60)  # (the pipe stays open: its end would hang the shell up)
        err = sh.stderr.read()
    finally:
        sh.kill()
    assert sh.returncode == 2 and "the remote shell's proc" in err and "Traceback" not in err, err


def _piped_shell(workdir) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "monarch_tensor.cli", "shell"], cwd=str(workdir), env=ENV,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("command,secs", [("sleep 613", "613"), ("(trap '' HUP; exec sleep 614)", "614")],
                         ids=["foreground", "ignores-sighup"])
def test_the_end_of_piped_input_hangs_the_shell_up_at_once(workdir, command, secs):
    """Input from a pipe is typed into the remote shell; where it ends, the session is hung up at once, as
    Monarch's (a terminal's hang-up): a foreground command that reads no input (``sleep``) is killed rather
    than waited for, also one that ignores the hang-up (then SIGTERM, SIGKILL), and ``shell`` returns the
    hang-up's status, 129."""
    assert cli(workdir, "apply", "myjob.job").returncode == 0
    sh = _piped_shell(workdir)
    try:
        sh.stdin.write(f"echo piped-$((40 + 2)); {command}\n")
        sh.stdin.flush()
        while "piped-42" not in sh.stdout.readline():  # the shell ran what was typed ...
            assert sh.poll() is None, sh.stderr.read()
        while not sleeping(secs):  # ... up to the sleep, which reads no input
            assert sh.poll() is None, sh.stderr.read()
            time.sleep(0.1)
        sh.stdin.close()  # the input ends
        sh.wait(timeout=60)
        rest, err = sh.stdout.read(), sh.stderr.read()
        assert sh.returncode == 129 and "Traceback" not in err, (rest, err)
        deadline = time.monotonic() + 10  # the hung-up command is gone too (SIGHUP, then SIGTERM, SIGKILL)
        while sleeping(secs) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not sleeping(secs)
    finally:
        sh.kill()
        subprocess.run(["pkill", "-KILL", "-f", f"^sleep {secs}$"], capture_output=True)  # (none left for others)


@pytest.mark.timeout(60)
def test_a_zombie_agent_is_not_running():
    """An agent whose starter exited belongs to another parent: dead but not reaped, it is not running (a job
    file's LocalJob is then started again, not reattached to)."""
    from monarch_tensor.job.local import _alive

    parent = subprocess.Popen([sys.executable, "-c", "import os, time\npid = os.fork()\nif pid == 0:\n    os._exit(0)\n"
                               "print(pid, flush=True)\ntime.sleep(30)\n"], stdout=subprocess.PIPE, text=True)
    try:
        zombie = int(parent.stdout.readline())
        deadline = time.monotonic() + 10
        while not open(f"/proc/{zombie}/stat").read().rpartition(")")[2].split()[0] == "Z":
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert not _alive(zombie)
        assert _alive(parent.pid)
    finally:
        parent.kill()
        parent.wait()


@pytest.mark.timeout(360)
def test_remote_mount_mirrors_a_directory_and_its_interpreter(tmp_path):
    src, mnt = tmp_path / "proj", tmp_path / "mnt"
    (src / "pkg").mkdir(parents=True)
    (src / "pkg" / "mod.py").write_text("VALUE = 1\n")
    (src / "old.txt").write_text("going\n")
    # a virtual environment in the source (the procs find this monarch_tensor through PYTHONPATH)
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(src / ".venv")], check=True, timeout=60)
    foreign = tmp_path / "home"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine\n")
    (tmp_path / "mounted.py").write_text(
        "from monarch_tensor.job import LocalJob\n"
        "job = LocalJob(meshes={'trainers': 2, 'other': 1}, ttl=120)\n"
        f"job.remote_mount({str(src)!r}, mntpoint={str(mnt)!r}, meshes=['trainers'])\n")
    (tmp_path / "clobber.py").write_text(
        "from monarch_tensor.job import LocalJob\n"
        "job = LocalJob(meshes={'m': 1}, ttl=120)\n"
        f"job.remote_mount({str(src)!r}, mntpoint={str(foreign)!r})\n")
    try:
        r = cli(tmp_path, "apply", "mounted.job")
        assert r.returncode == 0, r.stderr
        assert (mnt / "pkg" / "mod.py").read_text() == "VALUE = 1\n" and (mnt / "old.txt").exists()
        # the mesh's procs run the mount's interpreter, and `python` in exec is it
        show = ["exec", "--", "bash", "-c", f"cd {mnt} && python -c 'import sys, pkg.mod; "
                                            "print(sys.prefix, pkg.mod.VALUE)'"]
        r = cli(tmp_path, *show)
        assert (r.returncode, r.stdout) == (0, f"{mnt}/.venv 1\n"), r.stderr
        r = cli(tmp_path, "exec", "--", "python", "-c", "import sys; print(sys.executable)")  # the procs' too
        assert (r.returncode, r.stdout) == (0, f"{mnt}/.venv/bin/python\n"), r.stderr
        r = cli(tmp_path, "exec", "--mesh", "other", "--output-dir", str(tmp_path / "o"), "--", "python", "-c",
                "import sys; print(sys.executable)")
        assert r.returncode == 0, r.stderr
        assert [p.read_text() for p in (tmp_path / "o").rglob("stdout.txt")] == [sys.executable + "\n"]
        # a change and a deletion in the source reach the hosts at the next connect
        (src / "pkg" / "mod.py").write_text("VALUE = 2\n")
        (src / "old.txt").unlink()
        r = cli(tmp_path, *show)
        assert (r.returncode, r.stdout) == (0, f"{mnt}/.venv 2\n"), r.stderr
        assert not (mnt / "old.txt").exists()
    finally:
        cli(tmp_path, "kill")
    # a mount point with files that no sync wrote is refused, and left as it was
    assert cli(tmp_path, "context", "use", "c2").returncode == 0
    try:
        r = cli(tmp_path, "apply", "clobber.job")
        assert r.returncode == 2 and "already holds files that no mount or sync wrote" in r.stderr, r.stderr
        assert "Traceback" not in r.stderr
        assert sorted(p.name for p in foreign.iterdir()) == ["notes.txt"]
    finally:
        cli(tmp_path, "kill")


def test_remote_mount_refuses_bad_arguments(tmp_path):
    job = LocalJob(meshes={"m": 1})
    with pytest.raises(FileNotFoundError, match="no such local directory"):
        job.remote_mount(str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="absolute path"):
        job.remote_mount(str(tmp_path), mntpoint="relative/dir")
    with pytest.raises(ValueError, match="whole file system"):
        job.remote_mount(str(tmp_path), mntpoint="/")
    with pytest.raises(ValueError, match="no mesh 'x'"):
        job.remote_mount(str(tmp_path), meshes=["x"])
    with pytest.raises(ValueError, match="relative to the mount point"):
        job.remote_mount(str(tmp_path), python_exe="/usr/bin/python3")
    with pytest.raises(TypeError, match="FUSE"):
        job.remote_mount(str(tmp_path), cache_size=10)
    assert not getattr(job, "_mounts", None)


@pytest.mark.timeout(60)
def test_releasing_a_local_job_kills_only_its_own_agents(tmp_path):
    """A job's agent that died may have its pid taken by another process: releasing the job (``kill``, or a
    restart after its agents stopped answering) signals only processes that started when its agents did,
    and forgets the old pids (they piled up across restarts, and a kill SIGKILLed whatever held them)."""
    from monarch_tensor.job.local import LocalJob, _start_time

    stranger = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        job = LocalJob(meshes={"hosts": 1}, root_dir=str(tmp_path / "job"))
        start = _start_time(stranger.pid)
        assert start is not None
        job.pids, job.starts = [stranger.pid], {stranger.pid: start + 1}  # the pid of an agent that was
        restored = LocalJob()
        restored._restore(json.loads(json.dumps(job._extra())))  # (as a job file keeps them)
        assert restored.starts == job.starts and not restored._agent_alive(stranger.pid)
        job._release()
        time.sleep(0.2)
        assert stranger.poll() is None, "a process that is not the job's agent was killed"
        assert job.pids == [] and job.starts == {}
        job.pids, job.starts = [stranger.pid], {stranger.pid: start}  # now it is the agent: killed
        job._release()
        # (it was killed: the wait ends long before its sleep would; 0 where _release reaped it first)
        assert stranger.wait(timeout=10) in (-signal.SIGKILL, 0)
    finally:
        if stranger.poll() is None:
            stranger.kill()
            stranger.wait()


def _interrupt_apply(cwd, marker, env) -> subprocess.CompletedProcess:
    """Run ``apply job.job`` in ``cwd``, Ctrl-C it once ``marker`` exists; its result."""
    p = subprocess.Popen([sys.executable, "-m", "monarch_tensor.cli", "apply", "job.job"], cwd=cwd, env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while not marker.exists() and p.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert marker.exists(), p.communicate(timeout=10)
        time.sleep(0.2)  # (the marker's writer is in its wait)
        p.send_signal(signal.SIGINT)
        out, err = p.communicate(timeout=60)
    finally:
        p.kill()
    return subprocess.CompletedProcess(p.args, p.returncode, out, err)


@pytest.mark.timeout(120)
def test_ctrl_c_while_apply_starts_the_agents_stops_them(tmp_path, short_tmp_path):
    """Ctrl-C while ``apply`` waits for its agents to serve: they are stopped and the job's directory (its key)
    removed, as no job file records them for ``kill``."""
    agent = tmp_path / "agent.sh"  # an agent that never serves: apply waits for it
    agent.write_text(f"#!/bin/sh\necho $$ >> {tmp_path}/started\nexec sleep 62.5\n")
    agent.chmod(0o755)
    (tmp_path / "job.py").write_text("from monarch_tensor.job import LocalJob\n"
                                     f"job = LocalJob(meshes={{'hosts': 2}}, python_exe={str(agent)!r})\n")
    r = _interrupt_apply(tmp_path, tmp_path / "started", dict(ENV, TMPDIR=str(short_tmp_path)))
    assert r.returncode == 130 and "no job was left running" in r.stderr and "Traceback" not in r.stderr, r.stderr
    started = [int(x) for x in (tmp_path / "started").read_text().split()]
    assert started and not any(alive(p) for p in started)
    assert os.listdir(short_tmp_path) == []  # the job's directory, with its key, is gone
    assert not (tmp_path / ".monarch" / "default" / "state.json").exists()


@pytest.mark.timeout(120)
def test_ctrl_c_after_apply_started_the_agents_stops_them(tmp_path):
    """Ctrl-C once the agents serve, before the job file is written (connecting to them): ``state()`` kills the
    job it started, which nothing else could find."""
    (tmp_path / "job.py").write_text(textwrap.dedent(f"""
        import time
        from monarch_tensor.job import LocalJob
        class SlowToConnect(LocalJob):
            def _connect(self):
                with open({str(tmp_path / "started")!r}, "w") as f:
                    print(*self.pids, file=f)
                    print(self.root_dir, file=f)
                time.sleep(60)
        job = SlowToConnect(meshes={{"hosts": 2}}, ttl=120)
        """))
    r = _interrupt_apply(tmp_path, tmp_path / "started", ENV)
    assert r.returncode == 130 and "no job was left running" in r.stderr and "Traceback" not in r.stderr, r.stderr
    agents, root = (tmp_path / "started").read_text().splitlines()
    agents = [int(p) for p in agents.split()]
    assert len(agents) == 2 and not any(alive(p) for p in agents)
    assert not os.path.exists(root)
    assert not (tmp_path / ".monarch" / "default" / "state.json").exists()


@pytest.mark.timeout(60)
def test_ctrl_c_while_a_job_command_exits_shows_no_traceback(tmp_path):
    """A Ctrl-C that comes as a job command finishes (its exit ends the sessions with the agents) ends the
    process at once, not with a KeyboardInterrupt traceback from the exit's cleanup."""
    script = ("import atexit, os, signal, sys, time\n"
              "from monarch_tensor import cli\n"
              "atexit.register(lambda: (os.kill(os.getpid(), signal.SIGINT), time.sleep(1)))  # (runs last)\n"
              "sys.exit(cli.main(['context', 'ls']))\n")
    r = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, env=ENV, capture_output=True, text=True,
                       timeout=30)
    assert r.returncode == -signal.SIGINT and "Traceback" not in r.stderr, r.stderr


@pytest.mark.timeout(120)
def test_killing_a_local_job_whose_procs_run_leaves_no_socket_files(short_tmp_path):
    """``job.kill()`` while the job's procs still run (no ``stop()``: a script's ``finally: job.kill()``): the
    procs, killed by their template, leave no socket files in the socket directory."""
    script = textwrap.dedent("""
        from monarch_tensor.actor import Actor, endpoint
        from monarch_tensor.job import LocalJob
        class A(Actor):
            @endpoint
            def ping(self):
                return 1
        job = LocalJob(meshes={"hosts": 1}, ttl=60)
        procs = job.state(cached_path=None).hosts.spawn_procs(per_host={"gpus": 2})
        assert list(procs.spawn("a", A).ping.call().get().values()) == [1, 1]
        job.kill()
        """)
    tmp_path = short_tmp_path
    r = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, env=dict(ENV, TMPDIR=str(tmp_path)),
                       capture_output=True, text=True, timeout=90)
    assert r.returncode == 0, r.stderr
    sockets = tmp_path / f"monarch-tensor-{os.getuid()}"
    deadline = time.monotonic() + 20
    while (left := [p.name for p in sockets.glob("proc-*")]) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert left == []


def _root_dir(cwd) -> str:
    with open(os.path.join(cwd, ".monarch", "default", "state.json")) as f:
        return json.load(f)["root_dir"]


@pytest.mark.timeout(240)
def test_a_dead_local_job_is_replaced_and_cleaned_up(tmp_path):
    """The next command replaces a LocalJob with a dead agent at once (its pids say so: no connecting to the
    dead agent first), stopping the agent left and removing the old job's directory (its key, logs); so for
    one whose agents all died."""
    (tmp_path / "myjob.py").write_text(SPEC.format(meshes={"hosts": 2}))
    try:
        assert cli(tmp_path, "apply", "myjob.job").returncode == 0
        for victims in (slice(0, 1), slice(None)):  # one agent of two dead; then all of them
            old, old_root = pids(tmp_path), _root_dir(tmp_path)
            for p in old[victims]:
                os.kill(p, signal.SIGKILL)
            r = cli(tmp_path, "exec", "--", "echo", "ran")
            assert (r.returncode, r.stdout) == (0, "ran\n"), r.stderr
            assert "did not answer" not in r.stderr, r.stderr  # (it waited for the dead agent to connect)
            new = pids(tmp_path)
            assert not set(new) & set(old) and all(alive(p) for p in new)
            deadline = time.monotonic() + 20
            while any(alive(p) for p in old) and time.monotonic() < deadline:
                time.sleep(0.1)
            assert not any(alive(p) for p in old)  # the one left of the old job too
            assert not os.path.exists(old_root)
            assert os.path.isdir(_root_dir(tmp_path))
    finally:
        cli(tmp_path, "kill")


@pytest.mark.timeout(60)
def test_python_dash_m_runs_the_command_line(tmp_path):
    from monarch_tensor import __version__

    r = subprocess.run([sys.executable, "-m", "monarch_tensor", "version"], cwd=tmp_path, env=ENV, capture_output=True,
                       text=True, timeout=50)
    assert (r.returncode, r.stdout.strip()) == (0, __version__), r.stderr
    r = subprocess.run([sys.executable, "-m", "monarch_tensor", "nosuch"], cwd=tmp_path, env=ENV, capture_output=True,
                       text=True, timeout=50)
    assert r.returncode == 2 and "usage: monarch-tensor" in r.stderr, r.stderr
