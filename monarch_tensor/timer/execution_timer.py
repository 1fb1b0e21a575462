"""``ExecutionTimer`` (Monarch's ``monarch.timer``): time named sections of work, on the GPU's clock (CUDA events
on the current stream) where there is one, else on the CPU's.

>>> with ExecutionTimer.time("matmul"):
...     torch.matmul(a, b)
>>> ExecutionTimer.summary()["matmul"]["mean_ms"]

On a mesh, the same functions run on the workers as remote functions
(``monarch_tensor.timer.remote_execution_timer``): a worker runs a stream's
instructions in order, so a section timed there measures the ops issued
between its start and its stop.
"""

from __future__ import annotations

import logging
import threading
import time
from contextlib import contextmanager

import torch

log = logging.getLogger(__name__)


class ExecutionTimer:
    """Named sections' times in ms; sections of one name may nest (the innermost stops first)."""

    _lock = threading.Lock()
    _times: dict[str, list[float]] = {}
    _open: dict[str, list] = {}       # name -> started, not stopped: ("cpu", t0) or ("cuda", start event)
    _pending: dict[str, list] = {}    # name -> CUDA (start, end) event pairs not yet read

    @classmethod
    @contextmanager
    def time(cls, name: str | None = None, use_cpu: bool = False):
        cls.start(name, use_cpu)
        try:
            yield
        finally:
            cls.stop(name, use_cpu)

    @classmethod
    def start(cls, name: str | None = None, use_cpu: bool = False) -> None:
        name = name or "default"
        if use_cpu or not torch.cuda.is_available():
            mark = ("cpu", time.perf_counter())
        else:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record(torch.cuda.current_stream())
            mark = ("cuda", ev)
        with cls._lock:
            cls._open.setdefault(name, []).append(mark)
            cls._times.setdefault(name, [])

    @classmethod
    def stop(cls, name: str | None = None, use_cpu: bool = False) -> None:
        name = name or "default"
        with cls._lock:
            marks = cls._open.get(name)
            if not marks:
                raise RuntimeError(f"ExecutionTimer.stop({name!r}): no section of that name was started")
            kind, begin = marks.pop()
            if kind == "cpu":
                cls._times[name].append((time.perf_counter() - begin) * 1e3)
                return
        end = torch.cuda.Event(enable_timing=True)
        end.record(torch.cuda.current_stream())
        with cls._lock:
            cls._pending.setdefault(name, []).append((begin, end))

    @classmethod
    def _settle(cls, name: str | None = None) -> None:
        """Read the GPU times of finished sections (waiting for their events)."""
        with cls._lock:
            names = [name] if name is not None else list(cls._pending)
            pairs = [(n, p) for n in names for p in cls._pending.pop(n, [])]
        for n, (begin, end) in pairs:
            end.synchronize()
            with cls._lock:
                cls._times[n].append(begin.elapsed_time(end))

    @classmethod
    def reset(cls) -> None:
        """Forget every measurement (sections still open keep running)."""
        with cls._lock:
            cls._times = {n: [] for n in cls._open if cls._open[n]}
            cls._pending = {}

    @classmethod
    def summary(cls) -> dict[str, dict[str, float]]:
        """Per section: count, mean_ms, total_ms, min_ms, max_ms."""
        cls._settle()
        with cls._lock:
            return {n: {"count": len(ts), "mean_ms": sum(ts) / len(ts), "total_ms": sum(ts), "min_ms": min(ts),
                        "max_ms": max(ts)} for n, ts in cls._times.items() if ts}

    @classmethod
    def get_latest_measurement(cls, name: str | None = None) -> float:
        """The last time of ``name`` in ms (0.0, with a warning, before any)."""
        name = name or "default"
        cls._settle(name)
        with cls._lock:
            ts = cls._times.get(name)
            if not ts:
                log.warning("ExecutionTimer: no measurement of %r yet", name)
                return 0.0
            return ts[-1]


def execution_timer_start(name: str | None = None, use_cpu: bool = False) -> None:
    ExecutionTimer.start(name, use_cpu)


def execution_timer_stop(name: str | None = None, use_cpu: bool = False) -> None:
    ExecutionTimer.stop(name, use_cpu)


def get_execution_timer_average_ms(name: str = "default") -> torch.Tensor:
    summary = ExecutionTimer.summary()
    if name not in summary:
        raise KeyError(f"ExecutionTimer: no measurement of {name!r} (sections measured: {sorted(summary)})")
    return torch.tensor(summary[name]["mean_ms"], dtype=torch.float64)


def get_latest_timer_measurement(name: str | None = None) -> torch.Tensor:
    return torch.tensor(ExecutionTimer.get_latest_measurement(name), dtype=torch.float64)


def get_execution_timer_summary() -> dict[str, dict[str, float]]:
    return ExecutionTimer.summary()


def get_time_perfcounter() -> torch.Tensor:
    """``time.perf_counter()`` as a float64 tensor (for timing between two points on a worker)."""
    return torch.tensor(time.perf_counter(), dtype=torch.float64)
