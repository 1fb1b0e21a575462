"""SlurmJob's sbatch script and options (no cluster needed; tests/test_slurm.py runs jobs on a real one),
and proc_bind's CPU lists."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from monarch_tensor.job import SlurmJob

pytestmark = pytest.mark.timeout(30)


def _directives(job, nodes=2):
    return [line.split(" ", 1)[1] for line in job._script(nodes).splitlines() if line.startswith("#SBATCH ")]


def test_monarchs_options_become_sbatch_directives(tmp_path):
    job = SlurmJob(meshes={"trainers": 2}, job_name="t", partition="gpu", account="research", qos="high",
                   gpus_per_node=8, log_dir=str(tmp_path))
    got = _directives(job)
    for d in ("--job-name=t", "--nodes=2", "--ntasks-per-node=1", "--partition=gpu", "--gpus-per-node=8",
              "--exclusive", "--account=research", "--qos=high"):
        assert d in got, (d, got)
    shared = _directives(SlurmJob(meshes={"m": 1}, exclusive=False, log_dir=str(tmp_path)), 1)
    assert "--exclusive" not in shared and not any(d.startswith(("--account", "--qos")) for d in shared)


def test_start_timeout_port_and_tasks_per_node(tmp_path):
    assert SlurmJob(meshes={"m": 1}, job_start_timeout=7, log_dir=str(tmp_path)).start_timeout == 7
    job = SlurmJob(meshes={"m": 1}, monarch_port=22222, log_dir=str(tmp_path))
    assert job.bind == "tcp://0.0.0.0:22222" and "22222" in job._script(1)
    with pytest.raises(ValueError, match="one host agent runs per node"):
        SlurmJob(meshes={"m": 1}, ntasks_per_node=2)
    with pytest.raises(ValueError, match="a TCP port is 1-65535"):
        SlurmJob(meshes={"m": 1}, monarch_port=70000)
    with pytest.raises(ValueError, match="positive number of seconds"):
        SlurmJob(meshes={"m": 1}, job_start_timeout=0)


def test_a_batch_job_script_starts_the_agents_then_the_client(tmp_path):
    job = SlurmJob(meshes={"m": 2}, log_dir=str(tmp_path))
    lines = job._script(2, client_script="/work/train.py").splitlines()
    srun = next(i for i, ln in enumerate(lines) if ln.startswith("srun "))
    assert lines[srun].endswith(" &")  # the agents in the background
    assert "write_batch_state" in lines[srun + 1] and lines[srun + 2].endswith("/work/train.py")
    from monarch_tensor.job import LocalJob

    with pytest.raises(FileNotFoundError, match="no such file"):  # (a LocalJob runs one too: Monarch's batch mode)
        LocalJob(meshes={"m": 1}).apply(client_script=str(tmp_path / "missing.py"))


@given(st.lists(st.tuples(st.integers(0, 300), st.integers(0, 20)), min_size=1, max_size=8))
def test_proc_bind_cpu_lists_parse_as_numactl_writes_them(runs):
    """Hypothesis: a list of ranges and single CPUs, written as numactl does ("0-3,8"), parses back to
    exactly those CPUs, in order."""
    from monarch_tensor.runtime._bind import parse_list

    text = ",".join(f"{lo}-{lo + k}" if k else str(lo) for lo, k in runs)
    assert parse_list(text, "cpus") == [c for lo, k in runs for c in range(lo, lo + k + 1)]
