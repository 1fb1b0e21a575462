"""torchrun-style SPMD jobs (Monarch's ``monarch.job.spmd``): ``serve`` a torchrun command, then ``run_spmd()``.

>>> job = serve(["torchrun", "--nproc-per-node=4", "--standalone", "train.py", "--lr", "0.1"],
...             scheduler="local_cwd")
>>> job.run_spmd()        # train.py on 4 procs of this host, with torchrun's variables set

Monarch schedules the job through torchx; this project has no torchx, so only its local schedulers
(``local_cwd``, ``local_docker``... any name starting with ``local``) are served: the job's workers are this
host. Any other scheduler is refused with an error saying so (start a ``SlurmJob`` and run the script with
``monarch_tensor.spmd.SPMDActor`` on its procs instead).
"""

from __future__ import annotations

import argparse
import warnings
from typing import Any

from ._base import JobState, JobTrait

__all__ = ["SPMDJob", "serve"]


def _torchrun_parser() -> argparse.ArgumentParser:
    """torchrun's options (torch/distributed/run.py), as Monarch's ``_get_torchrun_parser``."""
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--nnodes", type=str, default="1:1")
    p.add_argument("--nproc-per-node", "--nproc_per_node", type=str, default="1")
    for opt in ("rdzv-backend", "rdzv-endpoint", "rdzv-id", "rdzv-conf", "start-method", "role", "log-dir",
                "local-ranks-filter", "master-addr", "local-addr"):
        p.add_argument(f"--{opt}", f"--{opt.replace('-', '_')}", type=str)
    p.add_argument("--standalone", action="store_true")
    p.add_argument("--max-restarts", "--max_restarts", type=int)
    p.add_argument("--monitor-interval", "--monitor_interval", type=float)
    p.add_argument("-m", "--module", action="store_true")
    p.add_argument("--no-python", "--no_python", action="store_true")
    p.add_argument("--run-path", "--run_path", action="store_true")
    p.add_argument("-r", "--redirects", type=str)
    p.add_argument("-t", "--tee", type=str)
    p.add_argument("--node-rank", "--node_rank", type=int)
    p.add_argument("--master-port", "--master_port", type=int)
    p.add_argument("training_script", nargs="?")
    p.add_argument("training_script_args", nargs=argparse.REMAINDER)
    return p


def parse_torchrun(roles: list[dict[str, Any]]) -> tuple[list[str], int]:
    """``(script args, procs per node)`` of a job's one role ``{"entrypoint": ..., "args": [...]}``, as
    Monarch's ``_parse_torchrun``: ``torchrun ...``, ``python -m torch.distributed.run ...`` (or ``-m torchrun``),
    or a plain ``python train.py ...`` (one proc)."""
    if not roles:
        raise ValueError("No roles provided")
    if len(roles) > 1:
        raise ValueError("Multiple roles provided. monarch.spmd supports single-role SPMD jobs")
    role = roles[0]
    args, entrypoint = list(role.get("args", [])), role.get("entrypoint", "")
    if entrypoint in ("torchrun", "torch.distributed.run", "python", "python3"):
        args = [entrypoint, *args]
    if not args:
        raise ValueError("Role has no args")
    if args[0] in ("torchrun", "torch.distributed.run"):
        rest = args[1:]
    elif args[0] in ("python", "python3"):
        if len(args) >= 3 and args[1] == "-m" and args[2] in ("torch.distributed.run", "torchrun"):
            rest = args[3:]
        else:
            return list(args[1:]), 1
    else:
        raise ValueError(f"Expected args to start with torchrun, torch.distributed.run, python, or python3, "
                         f"got: {args[0]}")
    parsed, _ = _torchrun_parser().parse_known_args(rest)
    try:
        nproc = int(parsed.nproc_per_node)
    except ValueError:
        warnings.warn(f"--nproc-per-node={parsed.nproc_per_node} is not an integer, defaulting to 1. Use an "
                      f"explicit integer value instead of '{parsed.nproc_per_node}'.", stacklevel=2)
        nproc = 1
    if nproc < 1:
        raise ValueError(f"--nproc-per-node must be at least 1, got {parsed.nproc_per_node}")
    script = (["-m"] if parsed.module else []) + ([parsed.training_script] if parsed.training_script else [])
    return script + list(parsed.training_script_args or []), nproc


def _local(scheduler: str) -> bool:
    return isinstance(scheduler, str) and scheduler.startswith("local")


def _refuse(scheduler: str) -> None:
    if not _local(scheduler):
        raise ValueError(f"SPMD jobs on scheduler {scheduler!r} are scheduled through torchx in Monarch, which this "
                         f"project does not use; only the local schedulers ('local_cwd', ...) run here. For a "
                         f"cluster, start a SlurmJob and run the script with monarch_tensor.spmd.SPMDActor on its "
                         f"procs")


def serve(appdef, scheduler: str = "mast_conda", scheduler_cfg: dict | None = None) -> SPMDJob:
    """An ``SPMDJob`` for a torchrun command (a list: single-node only, as Monarch's) or an AppDef-like object
    (its one role's ``entrypoint`` and ``args``). ``run_spmd()`` then runs it. Only local schedulers here."""
    _refuse(scheduler)
    if scheduler_cfg:
        raise ValueError(f"serve(scheduler_cfg=...): the local scheduler {scheduler!r} takes no options here, got "
                         f"{scheduler_cfg!r}")
    if isinstance(appdef, list):
        if not appdef:
            raise ValueError("command cannot be empty")
        nnodes, _ = _torchrun_parser().parse_known_args(appdef[1:])
        if nnodes.nnodes is not None and nnodes.nnodes.strip() not in ("1", "1:1"):
            raise ValueError(f"Multi-node torchrun commands are not supported with serve(). Got "
                             f"--nnodes={nnodes.nnodes.strip()}. When passing a command list, only single-node "
                             f"(--nnodes=1 or --standalone) is valid.")
        roles = [{"entrypoint": appdef[0], "args": list(appdef[1:])}]
    else:
        try:
            roles = [{"entrypoint": r.entrypoint, "args": list(r.args)} for r in appdef.roles]
        except AttributeError:
            raise TypeError(f"serve() takes a torchrun command (a list of strings) or an AppDef (roles with an "
                            f"entrypoint and args), got {appdef!r}") from None
    parse_torchrun(roles)  # (a command it cannot run is an error now, not at run_spmd)
    return SPMDJob(handle=f"local://spmd-{id(roles):x}", scheduler=scheduler, original_roles=roles)


class SPMDJob(JobTrait):
    """A torchrun-style job (Monarch's): ``state().workers`` is its host mesh, ``run_spmd()`` runs its script
    on ``--nproc-per-node`` procs per host with torchrun's variables set (``SPMDActor``), and ``kill()``
    stops the procs it started. Written the Monarch way (``_create``, ``_state``, ``_kill``)."""

    def __init__(self, handle: str, scheduler: str, workspace: str | None = None,
                 original_roles: list[dict[str, Any]] | None = None) -> None:
        super().__init__()
        _refuse(scheduler)
        self._app_handle, self._scheduler, self._workspace = handle, scheduler, workspace
        self._original_roles = list(original_roles or [])
        self._procs = None

    def _create(self, client_script: str | None = None) -> None:
        if client_script is not None:
            raise TypeError("SPMDJob.apply(client_script=...): an SPMD job runs its own script (run_spmd())")

    def can_run(self, spec: JobTrait) -> bool:
        return (isinstance(spec, SPMDJob) and self.active and spec._scheduler == self._scheduler
                and spec._original_roles == self._original_roles)

    def _state(self) -> JobState:
        from ..hosts.host import this_host

        return JobState({"workers": this_host()})

    def _kill(self) -> None:
        procs, self._procs = self._procs, None
        if procs is not None:
            procs.stop().get(timeout=60)

    def __getstate__(self):
        state = super().__getstate__()
        state["_procs"] = None  # (they are this process's)
        return state

    def run_spmd(self, timeout: float | None = None) -> None:
        """Run the job's script on every proc and wait for it (``timeout`` seconds, None: no limit): a script that
        raises, or exits with a non-zero status, on any rank raises here."""
        from ..spmd import SPMDActor

        self.apply()
        script_args, nproc = parse_torchrun(self._original_roles)
        workers = self._state().workers
        if self._procs is None:
            self._procs = workers.spawn_procs(per_host={"gpus": nproc})
        am = self._procs.spawn("_SPMDActor", SPMDActor)
        first = am.slice(**dict.fromkeys(self._procs._shape.names, 0))
        addr, port = first.get_host_port.call_one(None).get(timeout=60)
        am.main.call(addr, port, script_args).get(timeout=timeout)
