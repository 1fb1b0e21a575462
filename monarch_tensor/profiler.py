"""``torch.profiler`` on the tensor engine's workers (Monarch's ``monarch.profiler``).

>>> from torch.profiler import ProfilerActivity
>>> from monarch_tensor.profiler import Schedule, profile, record_function
>>> with procs.activate():
...     with profile(activities=[ProfilerActivity.CPU], on_trace_ready="./traces",
...                  schedule=Schedule(wait=1, warmup=1, active=2)) as prof:
...         for step in range(4):
...             with record_function("forward"):
...                 loss = model(batch)
...             prof.step()
>>> # ./traces/trace_<rank>.json on each worker's host: chrome://tracing or https://ui.perfetto.dev

Each call is a remote function in the workers' instruction stream, so the
profiler starts and stops between the same ops on every rank as the script
issues them, and records what the workers run (CPU, and CUDA where
``activities`` asks for it). The arguments are ``torch.profiler.profile``'s,
except as in Monarch: ``on_trace_ready`` is a directory (each rank writes
``trace_<rank>.json`` there, rank in the mesh; with a schedule, at the end of
each active span), and ``schedule`` is a ``Schedule``. A profiler that fails
on a worker fails what the script next fetches from that rank.
"""

from __future__ import annotations

import itertools
import os
from functools import partial
from typing import Any, NamedTuple

from monarch_tensor.controller.api import remote


class Schedule(NamedTuple):
    """``torch.profiler.schedule``'s arguments: skip ``skip_first`` steps, then cycles of ``wait`` idle,
    ``warmup`` and ``active`` recorded steps, ``repeat`` times (0: until the profiler exits)."""

    wait: int
    warmup: int
    active: int
    repeat: int = 0
    skip_first: int = 0


def _none(*args, **kwargs) -> None:
    return None


class profile:
    """``torch.profiler.profile`` on every worker of the active mesh; ``step()`` advances its ``Schedule``."""

    PATH_KEY = "on_trace_ready"
    _counter = itertools.count()

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        path = kwargs.get(self.PATH_KEY)
        if not isinstance(path, (str, os.PathLike)):
            raise TypeError(f"profile(on_trace_ready=...) takes the directory (a string) where each worker writes "
                            f"trace_<rank>.json, got {path!r}")
        kwargs[self.PATH_KEY] = os.fspath(path)
        schedule = kwargs.get("schedule")
        if schedule is not None and not isinstance(schedule, Schedule):
            raise TypeError(f"profile(schedule=...) takes a monarch_tensor.profiler.Schedule (or None), got "
                            f"{type(schedule).__name__}")
        self.id = next(self._counter)
        self._entered = False
        _remote_init(self.id, *args, **kwargs)

    def __enter__(self) -> profile:
        _remote_enter(self.id)
        self._entered = True
        return self

    def __exit__(self, *exc) -> None:
        _remote_exit(self.id)
        self._entered = False

    def step(self) -> None:
        """The end of one step: the workers' profilers move along their schedule."""
        if not self._entered:
            raise RuntimeError("profile.step() is for inside `with profile(...)`")
        _remote_step(self.id)


class record_function:
    """``torch.profiler.record_function(name, args)`` on every worker: the ops issued inside the block show
    under ``name`` in the traces."""

    _counter = itertools.count()

    def __init__(self, name: str, args: str | None = None) -> None:
        if not isinstance(name, str):
            raise TypeError(f"record_function(name) takes a string, got {name!r}")
        self.id = next(self._counter)
        self.name, self.args = name, args

    def __enter__(self) -> record_function:
        _remote_record_enter(self.id, self.name, self.args)
        return self

    def __exit__(self, *exc) -> None:
        _remote_record_exit(self.id)


# ---- worker side (the functions travel by name: the workers import this module) ----------------
_profilers: dict[int, tuple[tuple, dict, Any]] = {}
_records: dict[int, Any] = {}


def _export(prof, dir_path: str) -> None:
    from monarch_tensor.runtime._context import current

    os.makedirs(dir_path, exist_ok=True)
    prof.export_chrome_trace(os.path.join(os.path.abspath(dir_path), f"trace_{current().rank.rank}.json"))


def _init(ident: int, *args, **kwargs) -> None:
    if ident in _profilers:
        raise RuntimeError(f"profiler {ident} exists already on this worker")
    _profilers[ident] = (args, kwargs, None)


def _enter(ident: int) -> None:
    import torch

    args, kwargs, prof = _profilers[ident]
    if prof is not None:
        raise RuntimeError("this profile() was entered already (a profiler is entered once)")
    kwargs = dict(kwargs)
    kwargs[profile.PATH_KEY] = partial(_export, dir_path=kwargs[profile.PATH_KEY])
    if kwargs.get("schedule") is not None:
        kwargs["schedule"] = torch.profiler.schedule(**kwargs["schedule"]._asdict())
    prof = torch.profiler.profile(*args, **kwargs)
    prof.__enter__()
    _profilers[ident] = (args, kwargs, prof)


def _exit(ident: int) -> None:
    _, _, prof = _profilers.pop(ident)
    if prof is not None:
        prof.__exit__(None, None, None)


def _step(ident: int) -> None:
    _profilers[ident][2].step()


def _record_enter(ident: int, name: str, args: str | None) -> None:
    import torch

    rf = torch.profiler.record_function(name, args)
    rf.__enter__()
    _records[ident] = rf


def _record_exit(ident: int) -> None:
    _records.pop(ident).__exit__(None, None, None)


_remote_init = remote(_init, propagate=_none)
_remote_enter = remote(_enter, propagate=_none)
_remote_exit = remote(_exit, propagate=_none)
_remote_step = remote(_step, propagate=_none)
_remote_record_enter = remote(_record_enter, propagate=_none)
_remote_record_exit = remote(_record_exit, propagate=_none)
