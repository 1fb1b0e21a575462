"""Jobs: allocations of hosts, each serving a host agent (Monarch's ``monarch.job``).

>>> from monarch_tensor.job import SlurmJob, job_load
>>> job = SlurmJob(meshes={"mesh0": 2}, job_name="train", time_limit="01:00:00")
>>> procs = job.state().mesh0.spawn_procs(per_host={"gpus": 8})
>>> job.dump("job.json")          # a second script: job_load("job.json").state().mesh0
>>> job.kill()

The command-line workflow (``monarch-tensor apply myjob.job``, ``exec``, ``shell``, ``kill``, ``context``)
keeps the working directory's current job: ``set_current_job``, ``load_current_job`` (``current.py``),
``exec_command`` (``exec.py``), ``shell`` (``shell.py``). ``PortForwarder`` forwards TCP ports between
proc meshes (``port_forward.py``).
"""

from ._base import JobState, JobTrait, job_load, job_loads
from .current import DEFAULT_JOB_PATH, load_current_job, set_current_job
from .exec import exec_command
from .hosts import HostListJob
from .local import LocalJob, ProcessJob
from .port_forward import PortForwarder
from .shell import shell
from .slurm import SlurmJob

__all__ = ["DEFAULT_JOB_PATH", "HostListJob", "JobState", "JobTrait", "LocalJob", "PortForwarder", "ProcessJob", "SlurmJob",
           "exec_command", "job_load", "job_loads", "load_current_job", "set_current_job", "shell"]
