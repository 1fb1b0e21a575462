"""SlurmJob end to end on a real SLURM cluster (``.ci/run`` starts slurmctld + two slurmd: nodes n1, n2).

Skips, with the reason, where SLURM is not installed or no controller answers.
"""

import json
import os
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from monarch_tensor import fetch_shard
from monarch_tensor.actor import Actor, endpoint
from monarch_tensor.errors import JobStartError
from monarch_tensor.job import SlurmJob
from monarch_tensor.job.slurm import slurm_available

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_why = slurm_available()
pytestmark = pytest.mark.skipif(bool(_why), reason=f"no SLURM cluster here: {_why}")


class Node(Actor):
    @endpoint
    def node(self) -> str:
        return os.environ.get("SLURMD_NODENAME", "?")

    @endpoint
    def add(self, a: int, b: int) -> int:
        return a + b


@pytest.mark.timeout(300)
def test_slurm_job_submit_spawn_call_reattach_kill(tmp_path):
    job = SlurmJob(meshes={"mesh0": 2}, job_name="mt-ci", time_limit="00:10:00", partition="debug",
                   log_dir=str(tmp_path / "logs"), ttl=120)
    try:
        hosts = job.state(cached_path=None).mesh0
        st, _ = job.squeue_state()
        assert st == "RUNNING"
        procs = hosts.spawn_procs(per_host={"gpus": 1})
        assert procs.sizes == {"hosts": 2, "gpus": 1}
        nodes = procs.spawn("nodes", Node)
        assert sorted(nodes.node.call().get(timeout=120).values()) == ["n1", "n2"]
        assert nodes.add.call(2, 3).get(timeout=30).values() == [5, 5]
        # A tensor-engine collective across the two nodes.
        with procs.activate():
            x = torch.ones(4) + procs.rank("hosts")
            y = x.reduce("hosts", "sum")
            got = fetch_shard(y, hosts=1, gpus=0).result(timeout=60)
        assert torch.equal(got, torch.full((4,), 3.0))
        # A second process reattaches from the job file and spawns on both nodes.
        path = str(tmp_path / "job.json")
        job.dump(path)
        script = textwrap.dedent(f"""
            import sys
            sys.path.insert(0, {ROOT!r})
            from monarch_tensor.job import job_load
            from tests.test_slurm import Node
            procs = job_load({path!r}).state().mesh0.spawn_procs(per_host={{"gpus": 1}})
            print(sorted(procs.spawn("n", Node).node.call().get(timeout=120).values()))
        """)
        r = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=180)
        assert r.returncode == 0, r.stderr
        assert r.stdout.strip() == "['n1', 'n2']"
        procs.stop().get(timeout=30)
    finally:
        job.kill()
    # The allocation is gone.
    out = subprocess.run(["squeue", "-h", "-j", str(job.job_id), "-o", "%T"], capture_output=True, text=True).stdout
    assert out.strip() in ("", "COMPLETED", "CANCELLED"), out


@pytest.mark.timeout(60)
def test_a_job_slurm_refuses_is_a_clear_error(tmp_path):
    job = SlurmJob(meshes={"mesh0": 3}, job_name="mt-too-big", log_dir=str(tmp_path / "logs"), start_timeout=20)
    with pytest.raises(JobStartError, match="sbatch refused"):
        job.state(cached_path=None)


@pytest.mark.timeout(120)
def test_a_job_name_and_log_dir_with_spaces(tmp_path):
    # Their #SBATCH directives were written unquoted: sbatch refused the job ("Invalid directive").
    with pytest.raises(ValueError, match="without '/'"):
        SlurmJob(meshes={"mesh0": 1}, job_name="a/b")
    job = SlurmJob(meshes={"mesh0": 1}, job_name="mt ci spaces", time_limit="00:05:00",
                   log_dir=str(tmp_path / "my logs"), ttl=60)
    try:
        procs = job.state(cached_path=None).mesh0.spawn_procs(per_host={"gpus": 1})
        assert procs.spawn("nodes", Node).add.call(2, 3).get(timeout=60).values() == [5]
    finally:
        job.kill()


@pytest.mark.timeout(120)
def test_an_agent_that_fails_to_start_ends_the_job_with_its_error(tmp_path):
    # This cluster's two nodes share one machine: a fixed port can serve only one of their agents. The other
    # agent's error sat in the job's output while the client waited its whole start timeout, and the error
    # then said only that the agents did not start.
    job = SlurmJob(meshes={"mesh0": 2}, job_name="mt-port", exclusive=False, monarch_port=26613,
                   log_dir=str(tmp_path / "logs"), job_start_timeout=45, ttl=600)
    try:
        with pytest.raises(JobStartError, match="(?s)ended .*cannot listen on tcp://0.0.0.0:26613: the address is "
                                                "already in use"):
            job.state(cached_path=None)
    finally:
        job.kill()


@pytest.mark.timeout(120)
def test_a_script_terminated_while_it_waits_for_its_allocation_cancels_it(tmp_path):
    # SIGTERM (timeout, kill, a batch system) ended the script at once: the allocation stayed queued or
    # running, with no job file naming it.
    import signal

    name = f"mt-term-{os.getpid()}"
    script = tmp_path / "client.py"
    script.write_text(textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {ROOT!r})
        from monarch_tensor.job import SlurmJob
        SlurmJob(meshes={{"mesh0": 1}}, job_name={name!r}, log_dir={str(tmp_path / "logs")!r}, start_timeout=90,
                 slurm_args=["--begin=now+1hour"]).state(cached_path=None)
    """))

    def queued() -> str:
        return subprocess.run(["squeue", "-h", "-n", name, "-o", "%i"], capture_output=True, text=True).stdout.strip()

    p = subprocess.Popen([sys.executable, str(script)])
    try:
        deadline = time.monotonic() + 60
        while not queued() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert queued(), "the job was never submitted"
        p.send_signal(signal.SIGTERM)
        assert p.wait(timeout=60) == 128 + signal.SIGTERM
        deadline = time.monotonic() + 30
        while queued() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not queued()
    finally:
        p.kill()
        left = queued().split()
        if left:
            subprocess.run(["scancel", *left])


@pytest.mark.timeout(60)
def test_a_job_that_never_starts_is_a_clear_error_and_is_cancelled(tmp_path):
    job = SlurmJob(meshes={"mesh0": 1}, job_name="mt-never", log_dir=str(tmp_path / "logs"), start_timeout=3,
                   slurm_args=["--begin=now+1hour"])
    with pytest.raises(JobStartError, match="did not start its 1 agents within 3 s .state PENDING"):
        job.state(cached_path=str(tmp_path / "state.json"))
    assert not os.path.exists(tmp_path / "state.json")  # only a job that runs is kept
    assert job.squeue_state()[0] in (None, "CANCELLED")


@pytest.mark.timeout(300)
def test_state_reattaches_to_the_running_allocation_of_the_same_spec(tmp_path):
    from monarch_tensor.job import job_load

    cache = str(tmp_path / ".monarch" / "job_state.json")
    spec = dict(meshes={"mesh0": 1}, job_name="mt-reuse", time_limit="00:10:00", log_dir=str(tmp_path / "logs"),
                ttl=120)
    first = SlurmJob(**spec)
    jobs = [first]
    try:
        first.state(cached_path=cache)
        assert job_load(cache).job_id == first.job_id
        # the script run again: a new job of the same spec takes the running allocation, no new sbatch
        again = SlurmJob(**spec)
        jobs.append(again)
        procs = again.state(cached_path=cache).mesh0.spawn_procs(per_host={"gpus": 1})
        assert again.job_id == first.job_id
        assert procs.spawn("n", Node).node.call_one().get(timeout=120) in ("n1", "n2")
        procs.stop().get(timeout=30)
        # the spec changed: the cached allocation is cancelled and a new one runs in its place
        changed = SlurmJob(**{**spec, "time_limit": "00:09:00"})
        jobs.append(changed)
        changed.state(cached_path=cache)
        assert changed.job_id != first.job_id and changed.squeue_state()[0] == "RUNNING"
        assert first.squeue_state()[0] in (None, "CANCELLED", "COMPLETED")
        assert job_load(cache).job_id == changed.job_id
    finally:
        for j in jobs:
            j.kill()


@pytest.mark.timeout(300)
def test_apply_with_a_client_script_runs_it_inside_the_allocation(tmp_path, monkeypatch):
    """Monarch's batch mode: the script's own job.state() of the same spec reattaches to the allocation that
    runs it (no second sbatch), and the allocation ends with the script."""
    monkeypatch.chdir(tmp_path)  # the job file goes to .monarch/ here
    logs = str(tmp_path / "logs")
    client = tmp_path / "client.py"
    client.write_text(textwrap.dedent(f"""
        import os, sys
        sys.path.insert(0, {ROOT!r})
        from monarch_tensor.job import SlurmJob
        from tests.test_slurm import Node
        job = SlurmJob(meshes={{"mesh0": 2}}, job_name="mt-batch", time_limit="00:05:00", log_dir={logs!r})
        procs = job.state().mesh0.spawn_procs(per_host={{"gpus": 1}})
        print("BATCH", job.job_id, os.environ["SLURM_JOB_ID"], sorted(procs.spawn("n", Node).node.call()
              .get(timeout=60).values()), flush=True)
        procs.stop().get(timeout=30)
    """))
    job = SlurmJob(meshes={"mesh0": 2}, job_name="mt-batch", time_limit="00:05:00", log_dir=logs)
    try:
        job.apply(client_script=str(client))
        with pytest.raises(RuntimeError, match="already applied"):
            job.apply(client_script=str(client))
        deadline = time.monotonic() + 240
        while job.squeue_state()[0] not in (None, "COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"):
            assert time.monotonic() < deadline, "the batch job did not finish"
            time.sleep(0.5)
    finally:
        job._release()
    out = open(os.path.join(logs, f"mt-batch-{job.job_id}.out")).read()
    assert f"BATCH {job.job_id} {job.job_id} ['n1', 'n2']" in out, out
    with pytest.raises(FileNotFoundError, match="no such file"):
        SlurmJob(meshes={"mesh0": 1}, log_dir=logs).apply(client_script=str(tmp_path / "missing.py"))


@pytest.mark.timeout(300)
def test_the_job_cli_drives_a_slurm_allocation(tmp_path):
    """``monarch-tensor apply`` queues the job once; each ``exec`` runs on the allocation; ``kill`` cancels it."""
    (tmp_path / "cluster.py").write_text(textwrap.dedent(f"""
        from monarch_tensor.job import SlurmJob
        job = SlurmJob(meshes={{"nodes": 2}}, job_name="mt-cli", time_limit="00:10:00", partition="debug",
                       log_dir={str(tmp_path / "logs")!r}, ttl=120)
    """))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])))

    def cli(*args):
        return subprocess.run([sys.executable, "-m", "monarch_tensor.cli", *args], cwd=tmp_path, env=env,
                              capture_output=True, text=True, timeout=180)

    r = cli("apply", "cluster.job")
    state = tmp_path / ".monarch" / "default" / "state.json"
    job_id = json.loads(state.read_text())["job_id"] if state.exists() else None
    try:
        assert r.returncode == 0, r.stderr
        r = cli("exec", "--", "bash", "-c", "echo on $SLURMD_NODENAME $MONARCH_RANK_hosts")
        assert (r.returncode, r.stdout) == (0, "on n1 0\n"), r.stderr
        out = tmp_path / "out"  # (both "nodes" are this machine: their files are here)
        r = cli("exec", "--all", "--output-dir", str(out), "--", "bash", "-c", "echo $SLURMD_NODENAME")
        assert r.returncode == 0, r.stderr
        got = {p.parent.name: p.read_text().strip() for p in out.rglob("stdout.txt")}
        assert got == {"hosts_0_procs_0": "n1", "hosts_1_procs_0": "n2"}
        assert json.loads(state.read_text())["job_id"] == job_id  # the same allocation all along
    finally:
        r = cli("kill")
    assert r.returncode == 0, r.stderr
    assert not state.exists()
    out = subprocess.run(["squeue", "-h", "-j", str(job_id), "-o", "%T"], capture_output=True, text=True).stdout
    assert out.strip() in ("", "COMPLETED", "CANCELLED"), out
