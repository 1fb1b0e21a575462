"""The sharded-tensor examples run to completion and print what they promise."""

import re

import pytest
from test_examples import run_example


@pytest.mark.timeout(200)
def test_dt_matmul_tour():
    out = run_example("dt_matmul.py", timeout=190).stdout
    lines = out.splitlines()
    assert "Distributed Tensor Shape: torch.Size([1024, 1024])" in lines
    assert ("repr: DTensor(shape=(1024, 1024), dtype=torch.float32, placements={data_parallel: S(0), "
            "model_parallel: R}, mesh={'data_parallel': 2, 'model_parallel': 2})") in lines
    assert "placements: (Shard(dim=0), Replicate())" in lines
    assert "full_tensor() equals local torch: True" in lines
    assert "redistribute keeps the value: True" in lines
    assert re.search(r"^to_local\(\): MeshTensor\(shape=\(512, 1024\)", out, re.M)
    assert "gradient equals local torch: True" in lines
    assert any(ln.startswith("ShardingError: sharding_spec entry 0 names mesh dim 'tensor_parallel'") for ln in lines)


@pytest.mark.timeout(450)  # (about 90 s alone on 2 cores; the suite's other workers share the cores)
def test_train_sharded_matches_local():
    out = run_example("train_sharded.py", timeout=440, args=("--steps", "2")).stdout
    runs = dict(re.findall(r"^(local|fsdp  dp=2|dp=2 x tp=2): +losses (\[.*?\])", out, re.M))
    assert set(runs) == {"local", "fsdp  dp=2", "dp=2 x tp=2"}, out
    assert runs["fsdp  dp=2"] == runs["local"] and runs["dp=2 x tp=2"] == runs["local"], out
    assert "sharded losses match local training" in out
