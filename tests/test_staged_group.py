"""StagedGroup (worker/collectives.py), the gloo group user code and DTensor get: every collective it
overrides runs when called without options, as c10d's callers may call it, and gives gloo's result."""

import pytest
import torch
import torch.distributed as dist
from monarch_tensor.worker.collectives import StagedGroup

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def pg():
    return StagedGroup(dist.ProcessGroupGloo(dist.HashStore(), 0, 1), 0, 1)


def test_every_collective_runs_without_options(pg):
    x = torch.arange(4.0)
    t = x.clone()
    pg.allreduce([t]).wait()
    assert torch.equal(t, x)
    t = x.clone()
    pg.allreduce_coalesced([t]).wait()
    assert torch.equal(t, x)
    out = [[torch.empty(4)]]
    pg.allgather(out, [x]).wait()
    assert torch.equal(out[0][0], x)
    out = torch.empty(4)
    pg._allgather_base(out, x).wait()
    assert torch.equal(out, x)
    outs = [torch.empty(4), torch.empty(2)]
    pg.allgather_into_tensor_coalesced(outs, [x, x[:2]]).wait()
    assert torch.equal(outs[0], x) and torch.equal(outs[1], x[:2])
    out = torch.empty(4)
    pg._reduce_scatter_base(out, x).wait()
    assert torch.equal(out, x)
    outs = [torch.empty(4)]
    pg.reduce_scatter_tensor_coalesced(outs, [x]).wait()
    assert torch.equal(outs[0], x)
    out = torch.empty(4)
    pg.alltoall_base(out, x, [], []).wait()
    assert torch.equal(out, x)
    t = x.clone()
    pg.broadcast([t]).wait()
    assert torch.equal(t, x)
    t = x.clone()
    pg.reduce([t]).wait()
    assert torch.equal(t, x)
    out = [[torch.empty(4)]]
    pg.gather(out, [x]).wait()
    assert torch.equal(out[0][0], x)
    out = [torch.empty(4)]
    pg.scatter(out, [[x]]).wait()
    assert torch.equal(out[0], x)
    pg.barrier().wait()
