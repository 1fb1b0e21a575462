"""``shard_batch``: each data-parallel rank gets its own slice of a global batch, from a local tensor, a
DataLoader's batches or a mesh tensor, equal to the local slices, with no warning."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from monarch_tensor import MeshTensorError, fetch_shard, shard_batch

pytestmark = pytest.mark.timeout(120)


def _on(t, **coords):
    return fetch_shard(t, **coords).result(timeout=60)


def test_each_rank_gets_its_slice_of_a_dataloaders_batches(mesh):
    xs, ys = torch.randn(12, 3), torch.arange(12)
    local_model = torch.nn.Linear(3, 1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no warning, from the library or torch
        with mesh.activate():
            model = torch.nn.Linear(3, 1)
            with torch.no_grad():
                model.weight.copy_(local_model.weight.detach())
                model.bias.copy_(local_model.bias.detach())
            for i, (x, y) in enumerate(DataLoader(TensorDataset(xs, ys), batch_size=4)):
                mx, my = shard_batch((x, y), "gpus")
                assert mx.shape == (2, 3) and my.dtype == torch.int64
                out = model(mx)
                for r in range(2):
                    rows = slice(4 * i + 2 * r, 4 * i + 2 * r + 2)
                    assert torch.equal(_on(my, gpus=r), ys[rows])
                    torch.testing.assert_close(_on(out, gpus=r), local_model(xs[rows]).detach())


def test_a_mesh_tensor_batch_and_several_dims(mesh):
    grid = mesh.split(gpus=("dp", "tp"), tp=1)  # {"dp": 2, "tp": 1}: the same two procs
    batch = torch.arange(24.0).reshape(6, 4)
    with grid.activate():
        whole = torch.arange(24.0).reshape(6, 4)  # a mesh tensor: the same batch on every rank
        by_dp = shard_batch(whole, "dp")
        by_both = shard_batch({"b": batch}, ("tp", "dp"))["b"]
        by_tp = shard_batch(batch, "tp")  # one rank along tp: each rank the whole batch
        for r in range(2):
            assert torch.equal(_on(by_dp, dp=r), batch[3 * r:3 * r + 3])
            assert torch.equal(_on(by_both, dp=r), batch[3 * r:3 * r + 3])
            assert torch.equal(_on(by_tp, dp=r), batch)


def test_what_cannot_be_split_is_refused(mesh):
    with pytest.raises(MeshTensorError, match="activate"):
        shard_batch(torch.ones(4), "gpus")
    with mesh.activate():
        with pytest.raises(ValueError, match="divides by 2.*shape \\(5,\\)"):
            shard_batch(torch.ones(5), "gpus")
        with pytest.raises(KeyError, match="no dimension 'dp'"):
            shard_batch(torch.ones(4), "dp")
        with pytest.raises(TypeError, match="dims"):
            shard_batch(torch.ones(4), 0)
        with pytest.raises(TypeError, match="tensor"):
            shard_batch([1, 2], "gpus")
