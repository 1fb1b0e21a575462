"""Mesh tensors in one script: rank tensors, reduce, fetch, slicing, to_mesh, an actor that gets each
rank's tensor, a module that lives on the workers, and an error at its line.

    python examples/mesh_tensors.py

A mesh tensor is one local tensor per rank of a proc mesh, all of one shape.
Ops on it are recorded by this script and run on the procs; values come back
only when fetched. Runs on a CPU-only laptop (gloo collectives); on a GPU
host the same script computes on the GPUs.
"""

import torch

from monarch_tensor import RemoteException, fetch_shard, inspect, this_host
from monarch_tensor.actor import Actor, current_rank, endpoint
from monarch_tensor.builtins.random import set_manual_seed_remote
from monarch_tensor.opaque_module import OpaqueModule


class Norms(Actor):
    """An actor on the same procs: a mesh tensor passed to it arrives as its rank's local tensor."""

    @endpoint
    def norm(self, t: torch.Tensor) -> str:
        return f"rank {current_rank().rank}: {type(t).__name__} {t.tolist()}, norm {t.norm().item():.1f}"


# ---- settings -------------------------------------------------------------------------------
HOSTS, GPUS = 2, 2  # mesh sizes ("hosts" is only a name here: all procs run on this machine)

procs = this_host().spawn_procs(per_host={"hosts": HOSTS, "gpus": GPUS})
print(f"proc mesh {procs.sizes}")

with procs.activate():
    # Every rank gets its own values: its coordinates, as 0-dim mesh tensors.
    rank = procs.rank("hosts") * GPUS + procs.rank("gpus")
    x = torch.ones(4) * (rank + 1)
    for h in range(HOSTS):
        for g in range(GPUS):
            print(f"x on hosts={h}, gpus={g}: {inspect(x, hosts=h, gpus=g).tolist()}")

    # Collectives over named dims.
    total = x.reduce(("hosts", "gpus"), "sum")
    per_host = x.reduce("gpus", "avg")
    gathered = x.reduce("gpus", "stack")
    print(f"reduce over all ranks, sum     -> {fetch_shard(total).result().tolist()}")
    print(f"reduce over gpus, avg (hosts=1) -> {fetch_shard(per_host, hosts=1).result().tolist()}")
    print(f"reduce over gpus, stack shape   -> {tuple(gathered.shape)}")

    # Slicing the mesh, and moving data from one slice to another.
    host0, host1 = procs.slice(hosts=0), procs.slice(hosts=1)
    moved = x.slice_mesh(hosts=0).to_mesh(host1)
    print(f"to_mesh hosts=0 -> hosts=1, gpus=1 now holds {inspect(moved, gpus=1).tolist()}")

    # Actors on the mesh's procs get each rank's local tensor (after the ops issued before the call).
    norms = procs.spawn("norms", Norms)
    for line in norms.norm.call(x * 2).get(timeout=60).values():
        print(f"actor got {line}")

    # A module built on every rank (Monarch's OpaqueModule), seeded alike; autograd runs through it.
    set_manual_seed_remote(0)
    linear = OpaqueModule("torch.nn.Linear", 4, 2)
    weight, bias = linear.parameters()  # mesh tensors on the workers' own parameters
    linear(x, propagator=lambda self, t: t.new_empty(2)).sum().backward()
    same = torch.equal(inspect(weight, hosts=0, gpus=0), inspect(weight, hosts=1, gpus=1))
    print(f"OpaqueModule: same weights on every rank: {same}; "
          f"weight.grad row on hosts=1, gpus=1: {inspect(weight.grad, hosts=1, gpus=1)[0].tolist()}")

    # A shape error is caught by the controller at once, at the line that made it.
    try:
        x @ torch.ones(3)
    except RuntimeError as e:
        print(f"shape error raised at once: {str(e).splitlines()[0][:60]}...")

    # Errors the controller cannot see (they depend on values) are values: the failing op's line is
    # reported when a result that depends on it is fetched.
    # (Not an index out of range: on a GPU that is a device-side assert, after which CUDA refuses the
    # process any more work.)
    factor = torch.linalg.cholesky(-torch.eye(2))  # not positive-definite: fails on the workers
    y = factor * 2
    try:
        fetch_shard(y).result()
    except RemoteException as e:
        print("fetch raised RemoteException:")
        print("\n".join("    " + ln for ln in str(e).splitlines()[:3]))
    print(f"the mesh is still usable: {inspect(x * 2).tolist()}")

procs.stop()
