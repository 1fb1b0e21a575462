"""A tour of global sharded tensors: distribute, look (no data moves), `dt @ dt.T`, redistribute, fetch.

    python examples/dt_matmul.py

The seed's snippet, made runnable: a tensor sharded over a named mesh looks like
one tensor, `dt @ dt.T` just works, and `full_tensor()` equals local torch.
"""

import time

import torch

from monarch_tensor import Replicate, Shard, ShardingError, distribute, this_host

# -----------------------------------------------------------------------------
N = 1024                         # the matrix is N x N
MESH = {"data_parallel": 2, "model_parallel": 2}
# -----------------------------------------------------------------------------

t0 = time.monotonic()
device_mesh = this_host().spawn_procs(MESH)
print(f"mesh {MESH} up in {time.monotonic() - t0:.1f} s")

torch.manual_seed(0)
local_tensor = torch.randn(N, N)

# The seed's form: one entry per tensor dim naming the mesh dim it is split over.
dt = distribute(local_tensor, device_mesh, sharding_spec=["data_parallel", None])
print(f"Distributed Tensor Shape: {dt.shape}")          # the global shape
print(f"repr: {dt!r}")                                   # nothing was fetched
print(f"placements: {dt.placements}")
print(f"device_mesh: {dt.device_mesh}")

result = dt @ dt.T                                        # runs on the workers' DTensors
print(f"dt @ dt.T -> {result!r}")
expected = local_tensor @ local_tensor.T
print("full_tensor() equals local torch:", torch.allclose(result.full_tensor(), expected, rtol=1e-4, atol=1e-3))

# The same layout written as placements, one per mesh dim; then move it around.
col = distribute(local_tensor, device_mesh, [Replicate(), Shard(1)])
print(f"column-sharded: {col!r}")
row = col.redistribute(placements=[Shard(0), Replicate()])
print(f"redistributed:  {row!r}")
print("redistribute keeps the value:", torch.equal(row.full_tensor(), local_tensor))

# Each rank's own shard, as an ordinary mesh tensor.
shard = row.to_local()
print(f"to_local(): {shard!r}")

# Gradients flow through sharded ops (autograd runs here, the ops on the workers).
w = distribute(torch.randn(N, 8), device_mesh, [Replicate(), Replicate()])
w.requires_grad_(True)
(torch.tanh(dt @ w) ** 2).mean().backward()
ref_w = w.full_tensor().requires_grad_(True)
(torch.tanh(local_tensor @ ref_w) ** 2).mean().backward()
print(f"w.grad: {w.grad!r}")
print("gradient equals local torch:", torch.allclose(w.grad.full_tensor(), ref_w.grad, rtol=1e-4, atol=1e-6))

# Mistakes are caught here, at this line, before anything is sent.
try:
    distribute(local_tensor, device_mesh, sharding_spec=["tensor_parallel", None])
except ShardingError as e:
    print(f"ShardingError: {e}")

device_mesh.stop().get(timeout=60)
print(f"done in {time.monotonic() - t0:.1f} s")
