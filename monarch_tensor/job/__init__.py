"""Jobs: allocations of hosts, each serving a host agent (Monarch's ``monarch.job``).

>>> from monarch_tensor.job import SlurmJob, job_load
>>> job = SlurmJob(meshes={"mesh0": 2}, job_name="train", time_limit="01:00:00")
>>> procs = job.state().mesh0.spawn_procs(per_host={"gpus": 8})
>>> job.dump("job.json")          # a second script: job_load("job.json").state().mesh0
>>> job.kill()
"""

from ._base import JobState, JobTrait, job_load, job_loads
from .hosts import HostListJob
from .local import LocalJob, ProcessJob
from .slurm import SlurmJob

__all__ = ["HostListJob", "JobState", "JobTrait", "LocalJob", "ProcessJob", "SlurmJob", "job_load", "job_loads"]
