"""``DummyProcessGroup``: a mesh's process group where a function runs once to learn its output shapes (on the
controller too, which imports this module and none of the workers' collectives)."""

from __future__ import annotations

import torch.distributed as dist


class _Done:
    """A collective of ``DummyProcessGroup``: complete at once."""

    def __init__(self, value) -> None:
        self._value = value

    def wait(self, timeout=None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True

    def is_success(self) -> bool:
        return True

    def result(self):
        return self._value


class DummyProcessGroup(dist.ProcessGroup):
    """Stands in for a mesh's process group where a function runs once to learn its output shapes (on fake
    tensors on the controller, or on one rank for ``propagate="inspect"``): its collectives return at once
    and leave their tensors as they are, so shapes come out right and nothing waits for ranks that are not
    there. ``size()`` and ``rank()`` are the real group's (rank 0 on the controller). It is not registered
    with torch, so calls that name global ranks (``dist.broadcast(t, src=r, group=pg)``) fail on it: give
    such a function a ``propagate``."""

    def __init__(self, dims: tuple, world_size: int, rank: int = 0) -> None:
        super().__init__(rank, world_size)
        self.dims, self.world_size = dims, world_size

    def allreduce(self, tensors, opts=None):
        return _Done(tensors)

    def allreduce_coalesced(self, tensors, opts=None):
        return _Done(tensors)

    def allgather(self, outputs, inputs, opts=None):
        return _Done(outputs)

    def _allgather_base(self, output, input, opts=None):
        return _Done(output)

    def allgather_into_tensor_coalesced(self, outputs, inputs, opts=None):
        return _Done(outputs)

    def reduce_scatter(self, outputs, inputs, opts=None):
        return _Done(outputs)

    def _reduce_scatter_base(self, output, input, opts=None):
        return _Done(output)

    def reduce_scatter_tensor_coalesced(self, outputs, inputs, opts=None):
        return _Done(outputs)

    def alltoall_base(self, output, input, output_split_sizes, input_split_sizes, opts=None):
        return _Done(output)

    def broadcast(self, tensors, opts=None):
        return _Done(tensors)

    def reduce(self, tensors, opts=None):
        return _Done(tensors)

    def barrier(self, opts=None):
        return _Done(None)

    def __repr__(self) -> str:
        return f"DummyProcessGroup(dims={self.dims}, size={self.world_size})"

    def __reduce__(self):
        return (DummyProcessGroup, (self.dims, self.world_size, self.rank()))
