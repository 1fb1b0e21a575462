"""What the ``monarch-tensor`` job commands do (Monarch 0.7's ``monarch.tools.commands``).

    apply_job("myjob.job")                 # monarch-tensor apply myjob.job
    exec_on_job(["python", "train.py"])    # monarch-tensor exec python train.py
    exec_on_job(["hostname"], run_all=True)
    shell_on_job(point_str="hosts=1")      # monarch-tensor shell --point hosts=1
    kill()                                 # monarch-tensor kill

The job comes from the working directory's active context (``monarch_tensor.job.current``).
"""

from __future__ import annotations

import os
import sys
import time
import uuid

from ..job.current import (  # noqa: F401 - Monarch's names, re-exported
    DEFAULT_JOB_PATH,
    MONARCH_DIR,
    context_create,
    context_ls,
    context_rm,
    context_state,
    context_use,
    current_context,
    current_spec,
    kill_context,
    load_current_job,
    set_current_job,
)
from ..job.exec import BashActor, exec_command, rank_env, sliced_coords
from ..job.shell import shell

READY_TIMEOUT = 600.0


def apply_job(module_path: str | None = None) -> float:
    """Record ``module_path`` as the active context's job spec (None: keep the recorded one), start the job
    or reattach to it, and wait until a proc on its first mesh runs a command. Returns the seconds it took."""
    if module_path is not None:
        set_current_job(module_path)
    t0 = time.monotonic()
    job = load_current_job()
    state = job.state()
    mesh = next(iter(state._meshes.values()))
    procs = mesh.spawn_procs()
    try:
        code = procs.spawn("_ready_check", BashActor).run.call(["true"]).get(timeout=READY_TIMEOUT)
        if max(code.values()) != 0:
            raise RuntimeError(f"the job's hosts started, but 'true' failed there: {code}")
    finally:
        procs.stop().get(timeout=30.0)
    return time.monotonic() - t0


def parse_env(env: list[str] | None) -> dict[str, str]:
    """``["K=V", ...]`` (``-e``) as a dict."""
    out = {}
    for item in env or []:
        k, sep, v = item.partition("=")
        if not sep or not k:
            raise ValueError(f"an environment variable is KEY=VALUE, got {item!r}")
        out[k] = v
    return out


def parse_point(s: str, flag: str = "--point") -> dict[str, int]:
    """``"hosts=1,gpus=0"`` (``--point``) as a dict; ``flag`` names the option in the error."""
    out = {}
    for pair in s.split(","):
        k, sep, v = pair.partition("=")
        try:
            if not sep or not k.strip():
                raise ValueError
            out[k.strip()] = int(v)
        except ValueError:
            example = "gpus=2" if flag == "--per-host" else "hosts=1"
            raise ValueError(f"{flag} takes DIM=N[,DIM=N...], e.g. {example}, got {s!r}") from None
    return out


def parse_per_host(s: str | None) -> dict[str, int] | None:
    """``"gpus=4"`` (``--per-host``) as a dict."""
    if not s:
        return None
    out = parse_point(s, "--per-host")
    if any(v < 1 for v in out.values()):
        raise ValueError(f"--per-host sizes are >= 1, got {s!r}")
    return out


def _meshes(job):
    state = job.state()
    if not state._meshes:
        raise RuntimeError("the job has no host meshes")
    return state._meshes


def exec_argv(args: list[str], module: str | None) -> list[str]:
    """What an ``exec`` runs, from its command-line arguments: those after an optional ``--``, behind
    ``-m MODULE`` where a module is given (``python -m``)."""
    cmd = list(args)
    if cmd[:1] == ["--"]:
        cmd = cmd[1:]
    return ["-m", module, *cmd] if module else cmd


def exec_on_job(cmd: list[str], run_all: bool = False, mesh_name: str | None = None, point_str: str | None = None,
                env: list[str] | None = None, workdir: str | None = None, kill: bool = False,
                script: str | None = None, per_host: dict[str, int] | None = None,
                output_dir: str | None = None) -> int:
    """Run ``cmd`` (or the bash ``script``, a file or ``-`` for stdin) on the active job; the largest exit
    status. By default on rank 0 of the first mesh, streaming its output here; ``point_str`` picks a host
    of the first mesh (streamed too); ``mesh_name`` all hosts of that mesh and ``run_all`` all hosts of all
    meshes, their output going to ``stdout.txt``/``stderr.txt`` under ``output_dir`` on each host (default
    ``/tmp/monarch_exec_<id>/<rank's coordinates>``, printed). ``kill``: kill the job after."""
    if script is not None:
        if script == "-":
            text = sys.stdin.read()
        else:
            with open(script) as f:
                text = f.read()
        cmd = ["bash", "-c", text]
    if not cmd:
        raise ValueError("no command to run: give one, or --script FILE")
    env_dict = parse_env(env)
    point = parse_point(point_str) if point_str is not None else None
    if sum((run_all, mesh_name is not None, point is not None)) > 1:
        raise ValueError("choose one of run_all, mesh_name and point_str")
    job = load_current_job()
    meshes = _meshes(job)
    if mesh_name is not None and mesh_name not in meshes:
        raise ValueError(f"the job has no mesh {mesh_name!r}; its meshes are {list(meshes)}")
    first = next(iter(meshes))
    if run_all:
        targets = list(meshes.items())
    else:
        targets = [(mesh_name or first, meshes[mesh_name or first])]
    streamed = not run_all and mesh_name is None
    out_dir = None
    if not streamed:
        base = output_dir or f"/tmp/monarch_exec_{uuid.uuid4().hex[:8]}"
        print(f"Output -> {base}/<mesh>/<rank's coordinates>/stdout.txt and stderr.txt on each host", flush=True)
    code = 0
    for name, hosts in targets:
        if not streamed:
            out_dir = os.path.join(base, name, "$SUBDIR")
        code = max(code, exec_command(hosts, cmd, env=env_dict or None, workdir=workdir, output_dir=out_dir,
                                      rank=0 if streamed and point is None else None, point=point,
                                      per_host=per_host).get())
    if kill:
        kill_context()
    return code


def shell_on_job(mesh_name: str | None = None, point_str: str | None = None, env: list[str] | None = None,
                 workdir: str | None = None, kill: bool = False) -> int:
    """An interactive shell on one host of the active job (default: rank 0 of the first mesh); its status."""
    job = load_current_job()
    meshes = _meshes(job)
    if mesh_name is not None and mesh_name not in meshes:
        raise ValueError(f"the job has no mesh {mesh_name!r}; its meshes are {list(meshes)}")
    hosts = meshes[mesh_name or next(iter(meshes))]
    point = parse_point(point_str) if point_str is not None else None
    fixed = sliced_coords(hosts, None if point else 0, point)  # the host's place in its mesh, as exec's
    one = hosts.slice(**point) if point is not None else hosts.flatten("rank").slice(rank=0)
    code = shell(one, env={**rank_env(fixed), **parse_env(env)}, workdir=workdir)
    if kill:
        kill_context()
    return code


def kill(name: str | None = None) -> bool:
    """Kill the job of context ``name`` (default: the active one); whether there was one."""
    return kill_context(name)
