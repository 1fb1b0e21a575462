"""The current job of a working directory, and named contexts (Monarch 0.7's ``monarch apply`` workflow).

    $ cat myjob.py
    from monarch_tensor.job import SlurmJob
    job = SlurmJob(meshes={"trainers": 2}, time_limit="02:00:00")
    $ monarch-tensor apply myjob.job      # allocate once (minutes on a real cluster)
    $ monarch-tensor exec python train.py # run on the allocation, again and again
    $ monarch-tensor kill

``set_current_job("myjob.job")`` records the spec (a ``module.attr`` import path)
in the current context's directory, ``.monarch/<context>/spec``;
``load_current_job()`` imports it again. The job file of a running job lives
at ``.monarch/<context>/state.json``, and ``.monarch/job_state.json``
(``DEFAULT_JOB_PATH``, ``state()``'s default ``cached_path``) is a symlink to
the active context's. A job from ``load_current_job()`` reattaches to the
allocation recorded there when it still runs and has the same spec, whatever
its kind (a ``LocalJob``'s agents too), instead of starting a new one.
"""

from __future__ import annotations

import importlib
import os
import shutil
import sys
from pathlib import Path

from ._base import DEFAULT_STATE, JobTrait, job_load

MONARCH_DIR = ".monarch"
DEFAULT_JOB_PATH = DEFAULT_STATE  # ".monarch/job_state.json": the active context's job file
STATE_FILE = "state.json"
SPEC_FILE = "spec"
DEFAULT_CONTEXT = "default"


def _check_name(name: str) -> str:
    if not isinstance(name, str) or not name or name in (".", "..") or "/" in name or name.startswith("."):
        raise ValueError(f"a context name is a plain directory name (no '/', not starting with '.'), got {name!r}")
    return name


def context_dir(name: str) -> Path:
    return Path(MONARCH_DIR) / _check_name(name)


def context_state(name: str) -> Path:
    """The job file of context ``name``."""
    return context_dir(name) / STATE_FILE


def current_context() -> str:
    """The active context's name (``default`` until ``context_use`` picks another)."""
    link = Path(DEFAULT_JOB_PATH)
    if link.is_symlink():
        target = Path(os.readlink(link))
        if len(target.parts) == 2 and target.parts[1] == STATE_FILE:
            return target.parts[0]
    return DEFAULT_CONTEXT


def _point_link_at(name: str) -> None:
    """Make ``DEFAULT_JOB_PATH`` a relative symlink to ``<name>/state.json``; a plain job file found there (an
    earlier ``dump``) moves into the default context first."""
    link = Path(DEFAULT_JOB_PATH)
    context_dir(name).mkdir(parents=True, exist_ok=True)
    if link.exists() and not link.is_symlink():
        context_dir(DEFAULT_CONTEXT).mkdir(parents=True, exist_ok=True)
        link.rename(context_state(DEFAULT_CONTEXT))
    if link.is_symlink():
        if os.readlink(link) == os.path.join(name, STATE_FILE):
            return
        link.unlink()
    link.symlink_to(os.path.join(name, STATE_FILE))


def set_current_job(module_path: str) -> None:
    """Record ``module_path`` (``"myjob.job"``: a module and the job object in it) as the active context's
    spec. It is imported right away, so a wrong path fails here rather than at the next ``exec``."""
    _import_job(module_path)
    _point_link_at(current_context())
    spec = context_dir(current_context()) / SPEC_FILE
    spec.write_text(module_path + "\n")


def current_spec() -> str | None:
    """The active context's spec (``module.attr``), or None when none was set."""
    try:
        return (context_dir(current_context()) / SPEC_FILE).read_text().strip() or None
    except FileNotFoundError:
        return None


def load_current_job() -> JobTrait:
    """A fresh job object of the active context's spec (not started). Its ``state()`` reattaches to the job
    running from the context's job file when that one can serve it (``can_run``), else starts it and writes
    the file."""
    spec = current_spec()
    if spec is None:
        raise FileNotFoundError(f"no job spec in context {current_context()!r} of {os.getcwd()} "
                                f"({context_dir(current_context()) / SPEC_FILE} is missing): run "
                                f"'monarch-tensor apply module.attr' (or set_current_job) first")
    job = _import_job(spec)
    job._reuse_cached = True
    return job


def _import_job(module_path: str) -> JobTrait:
    if not isinstance(module_path, str) or "." not in module_path.strip(".") or module_path != module_path.strip():
        raise ValueError(f"a job spec is 'module.attr' (the module that makes the job, and its name there), "
                         f"got {module_path!r}")
    mod_name, attr = module_path.rsplit(".", 1)
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())  # (as `python -m` does: the job's module sits beside the script)
    try:
        mod = importlib.import_module(mod_name)
    except ImportError as e:
        raise ImportError(f"cannot import the job spec's module {mod_name!r} (from {module_path!r}): {e}") from e
    except SyntaxError as e:
        raise ImportError(f"the job spec's module {mod_name!r} has a syntax error: {e.msg} ({e.filename}, line "
                          f"{e.lineno})") from e
    except Exception as e:  # the module's own code raised
        raise ImportError(f"the job spec's module {mod_name!r} raised while it was imported: {e!r}") from e
    job = getattr(mod, attr, None)
    if job is None:
        raise AttributeError(f"module {mod_name!r} has no {attr!r} (the job spec is {module_path!r})")
    if not isinstance(job, JobTrait):
        raise TypeError(f"{module_path} must be a job (LocalJob, SlurmJob, HostListJob, ...), "
                        f"got {type(job).__name__}")
    return job


def context_create(name: str) -> Path:
    """Make context ``name`` (a directory under ``.monarch``); the active one does not change."""
    d = context_dir(name)
    d.mkdir(parents=True, exist_ok=True)
    return d


def context_use(name: str) -> None:
    """Make ``name`` the active context (made if missing): the next ``apply``/``exec`` use its spec and job."""
    _point_link_at(name)


def context_ls() -> list[tuple[str, bool]]:
    """``(name, active)`` of every context, by name."""
    root = Path(MONARCH_DIR)
    names = {DEFAULT_CONTEXT} if Path(DEFAULT_JOB_PATH).is_symlink() else set()
    if root.is_dir():
        names |= {d.name for d in root.iterdir() if d.is_dir() and not d.name.startswith(".")}
    active = current_context()
    return [(n, n == active) for n in sorted(names)]


def kill_context(name: str | None = None) -> bool:
    """Kill the job of context ``name`` (default: the active one) and remove its job file; whether one was
    there."""
    name = current_context() if name is None else name
    state = context_state(name)
    if not state.exists():
        link = Path(DEFAULT_JOB_PATH)
        if name == current_context() and link.exists() and not link.is_symlink():
            state = link  # a plain job file from before contexts
        else:
            return False
    try:
        job_load(str(state)).kill()
    finally:
        state.unlink(missing_ok=True)
    return True


def context_rm(name: str) -> None:
    """Remove context ``name``, killing its job; the active context falls back to ``default``."""
    was_active = current_context() == _check_name(name)
    if not context_dir(name).exists() and name != DEFAULT_CONTEXT:
        raise FileNotFoundError(f"no context {name!r} (see 'monarch-tensor context ls')")
    if context_state(name).exists():
        kill_context(name)
    shutil.rmtree(context_dir(name), ignore_errors=True)
    if was_active:
        _point_link_at(DEFAULT_CONTEXT)
