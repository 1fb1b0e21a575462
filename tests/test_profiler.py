"""``monarch_tensor.profiler``: torch.profiler on the tensor engine's workers, traces per rank."""

import json

import pytest
import torch
from torch.profiler import ProfilerActivity

from monarch_tensor import inspect
from monarch_tensor.profiler import Schedule, profile, record_function


def names(path) -> set[str]:
    with open(path) as f:
        return {e.get("name") for e in json.load(f)["traceEvents"]}


@pytest.mark.timeout(120)
def test_profile_writes_a_trace_per_rank_with_the_ops_and_records(mesh, tmp_path):
    out = tmp_path / "traces"
    with mesh.activate():
        a = torch.ones(64, 64)
        with profile(activities=[ProfilerActivity.CPU], on_trace_ready=str(out)):
            with record_function("my_block"):
                b = a @ a
            c = torch.relu(b)
        inspect(c, gpus=1)  # (everything above has run on the workers)
        inspect(c, gpus=0)
    for rank in (0, 1):
        seen = names(out / f"trace_{rank}.json")
        assert "my_block" in seen and "aten::mm" in seen and "aten::relu" in seen, sorted(seen)[:20]


@pytest.mark.timeout(120)
def test_a_schedule_records_its_active_steps(mesh, tmp_path):
    out = tmp_path / "scheduled"
    with mesh.activate():
        x = torch.ones(8)
        with profile(activities=[ProfilerActivity.CPU], on_trace_ready=str(out),
                     schedule=Schedule(wait=1, warmup=1, active=2, repeat=1)) as prof:
            for step in range(5):
                with record_function(f"step{step}"):
                    x = x * 2
                prof.step()
        torch.testing.assert_close(inspect(x, gpus=0), torch.full((8,), 32.0))
        inspect(x, gpus=1)
    for rank in (0, 1):
        seen = names(out / f"trace_{rank}.json")
        assert {"step2", "step3"} <= seen and not {"step0", "step1", "step4"} & seen, sorted(seen)[:20]


def test_bad_arguments_are_clear_errors(mesh):
    with mesh.activate():
        with pytest.raises(TypeError, match="directory"):
            profile(activities=[ProfilerActivity.CPU], on_trace_ready=lambda p: None)
        with pytest.raises(TypeError, match="Schedule"):
            profile(on_trace_ready="x", schedule=torch.profiler.schedule(wait=1, warmup=1, active=1))
        with pytest.raises(RuntimeError, match="inside `with profile"):
            profile(on_trace_ready="x").step()
        with pytest.raises(TypeError, match="takes a string"):
            record_function(3)
