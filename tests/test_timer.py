"""Monarch's monarch.timer: ExecutionTimer here and on a mesh's workers (CPU clock: no GPU in these tests)."""

import time

import pytest
import torch

from monarch_tensor import inspect, remote, this_host
from monarch_tensor.timer import ExecutionTimer, execution_timer_start, execution_timer_stop
from monarch_tensor.timer.remote_execution_timer import (
    remote_execution_timer_start,
    remote_execution_timer_stop,
    remote_get_execution_timer_average_ms,
    remote_get_latest_timer_measurement,
)

pytestmark = pytest.mark.timeout(120)


def test_sections_are_timed_and_summarised():
    ExecutionTimer.reset()
    for d in (0.02, 0.04):
        with ExecutionTimer.time("sleep", use_cpu=True):
            time.sleep(d)
    execution_timer_start("outer", use_cpu=True)
    execution_timer_start("outer", use_cpu=True)  # nested: the inner one stops first
    time.sleep(0.01)
    execution_timer_stop("outer", use_cpu=True)
    execution_timer_stop("outer", use_cpu=True)
    s = ExecutionTimer.summary()
    assert s["sleep"]["count"] == 2 and s["outer"]["count"] == 2
    assert s["sleep"]["min_ms"] >= 20 and s["sleep"]["max_ms"] >= 40
    assert s["sleep"]["total_ms"] == pytest.approx(s["sleep"]["mean_ms"] * 2)
    assert ExecutionTimer.get_latest_measurement("sleep") >= 40  # the 40 ms section came last
    assert ExecutionTimer.get_latest_measurement("never") == 0.0
    with pytest.raises(RuntimeError, match="no section of that name was started"):
        ExecutionTimer.stop("never")
    ExecutionTimer.reset()
    assert ExecutionTimer.summary() == {}


def _sleep(seconds: float) -> None:
    time.sleep(seconds)


def test_a_section_on_the_workers_times_the_work_issued_inside_it():
    mesh = this_host().spawn_procs(per_host={"gpus": 2})
    try:
        with mesh.activate():
            nap = remote(_sleep, propagate=lambda s: None)
            for _ in range(2):
                remote_execution_timer_start("nap")
                nap(0.05)
                remote_execution_timer_stop("nap")
            # the example's form: a dotted path, its result shape asked of rank 0
            by_path = remote("monarch_tensor.timer.remote_execution_timer.get_execution_timer_average_ms",
                             propagate=lambda name: torch.tensor(0.0, dtype=torch.float64))
            avg = inspect(by_path("nap"), gpus=1).item()
            latest = inspect(remote_get_latest_timer_measurement("nap"), gpus=0).item()
            again = inspect(remote_get_execution_timer_average_ms("nap"), gpus=0).item()
        assert avg >= 50 and latest >= 50 and again >= 50
    finally:
        mesh.stop()
