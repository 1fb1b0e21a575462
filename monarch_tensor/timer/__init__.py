"""Monarch's ``monarch.timer``: ``ExecutionTimer`` and its functions (see ``execution_timer``)."""

from .execution_timer import (
    ExecutionTimer,
    execution_timer_start,
    execution_timer_stop,
    get_execution_timer_average_ms,
    get_latest_timer_measurement,
)

__all__ = ["ExecutionTimer", "execution_timer_start", "execution_timer_stop", "get_latest_timer_measurement",
           "get_execution_timer_average_ms"]
