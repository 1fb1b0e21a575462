"""The timer's functions for the workers, by the dotted paths Monarch's timer example names
(``remote("monarch_tensor.timer.remote_execution_timer.execution_timer_start", propagate="inspect")``),
and as remote functions ready to call inside ``with mesh.activate():``."""

import torch

from monarch_tensor.controller.api import remote

from .execution_timer import (  # noqa: F401
    execution_timer_start,
    execution_timer_stop,
    get_execution_timer_average_ms,
    get_execution_timer_summary,
    get_latest_timer_measurement,
    get_time_perfcounter,
)


def _none(*args, **kwargs) -> None:
    return None


def _scalar(*args, **kwargs) -> torch.Tensor:
    return torch.tensor(0.0, dtype=torch.float64)


remote_execution_timer_start = remote(execution_timer_start, propagate=_none)
remote_execution_timer_stop = remote(execution_timer_stop, propagate=_none)
remote_get_execution_timer_average_ms = remote(get_execution_timer_average_ms, propagate=_scalar)
remote_get_latest_timer_measurement = remote(get_latest_timer_measurement, propagate=_scalar)
remote_get_time_perfcounter = remote(get_time_perfcounter, propagate=_scalar)
