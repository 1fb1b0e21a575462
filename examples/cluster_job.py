"""A job spec for the job commands, and a walk through them.

As a spec (Monarch 0.7's workflow), from this directory:

    monarch-tensor apply cluster_job.job                  # start the hosts once (or reattach)
    monarch-tensor exec -- python -c "import socket; print(socket.gethostname())"
    monarch-tensor exec --all -- nproc                    # every host; output to files there
    monarch-tensor shell --point hosts=1                  # a terminal on the second host
    monarch-tensor kill

``MT_JOB=slurm`` makes it a SLURM allocation of two nodes (partition from
``MT_PARTITION``, default ``debug``); otherwise two local "hosts" (a LocalJob).
The ``cluster_job_proj`` directory beside this file is mirrored onto the hosts at each
connect (``remote_mount``), so ``exec`` can run code from it.

Run directly (``python examples/cluster_job.py``), it does the same through the
Python API on a LocalJob and prints what each step returned.
"""

import os
import sys
import tempfile

from monarch_tensor.job import LocalJob, SlurmJob

HERE = os.path.dirname(os.path.abspath(__file__))
MOUNT = os.path.join(tempfile.gettempdir(), f"cluster-job-proj-{os.getuid()}")

if os.environ.get("MT_JOB") == "slurm":
    job = SlurmJob(meshes={"hosts": 2}, job_name="cluster-job", time_limit="01:00:00",
                   partition=os.environ.get("MT_PARTITION", "debug"))
else:
    job = LocalJob(meshes={"hosts": 2}, ttl=300)
job.remote_mount(os.path.join(HERE, "cluster_job_proj"), mntpoint=MOUNT, python_exe=None)


def main() -> None:
    from monarch_tensor.job import exec_command

    hosts = job.state().hosts
    try:
        print("hosts:", hosts.sizes, "mounted at", MOUNT, "->", sorted(os.listdir(MOUNT)))
        # every host runs the mounted script; output streams back labelled by rank
        code = exec_command(hosts, [sys.executable, os.path.join(MOUNT, "hello.py")]).get(timeout=120)
        print("exit status:", code)
        # one host, two procs on it, each told its coordinates
        code = exec_command(hosts, ["bash", "-c", "echo host $MONARCH_RANK_hosts gpu $MONARCH_RANK_gpus"],
                            point={"hosts": 1}, per_host={"gpus": 2}).get(timeout=120)
        print("exit status:", code)
    finally:
        job.kill()


if __name__ == "__main__":
    main()
