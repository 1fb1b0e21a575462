"""A mesh's process groups for remote functions: ``pg = mesh.process_group("gpus")``.

Pass ``pg`` to a ``remote`` function and each rank finds there its own
``torch.distributed`` group: the ranks that share its coordinates on the
other dims. Inside, the function calls ``torch.distributed`` as it would
under ``torchrun`` (gloo on CPU, NCCL on GPU)::

    @remote(propagate=lambda t, group: t)
    def all_reduce(t, group):
        torch.distributed.all_reduce(t, group=group)
        return t

    pg = procs.process_group("gpus")
    with procs.activate():
        total = all_reduce(procs.rank("gpus").float(), pg)

Calls that name ranks (``dist.broadcast(t, src=r, group=pg)``,
``dist.send(t, dst=r, group=pg)``) take global ranks: a proc's rank in its
mesh. ``dist.get_rank(pg)`` needs a default group, which the workers do not
start: ``pg.rank()`` gives the rank in the group. A group's collectives
belong to the stream the function runs on; a function that runs once to
learn its output shapes (no ``propagate`` given, or ``"inspect"``) gets a
stand-in whose collectives leave their tensors as they are. If an input of
the function failed on one rank, that rank does not run it, and the others'
collectives fail after ``MONARCH_TENSOR_COLLECTIVE_TIMEOUT`` seconds
(default 300).
"""

from __future__ import annotations

from monarch_tensor.worker import messages as m


class RemoteProcessGroup:
    """The controller's handle on the process groups of ``device_mesh`` along ``dims`` (Monarch's name).

    >>> pg = procs.process_group(("hosts", "gpus"))  # doctest: +SKIP
    >>> pg.size()  # doctest: +SKIP
    8
    """

    def __init__(self, dims, device_mesh) -> None:
        if isinstance(dims, str):
            dims = (dims,)
        elif not (isinstance(dims, (tuple, list)) and dims and all(isinstance(d, str) for d in dims)):
            raise TypeError(f"process_group needs a dimension name or a list of them, such as 'gpus', "
                            f"not {dims!r}")
        dims = tuple(dims)
        shape = device_mesh._shape
        unknown = [d for d in dims if d not in shape.names]
        if unknown:
            raise ValueError(f"process_group{dims}: the mesh has no dimension(s) {unknown}; "
                             f"its dims are {list(shape.names)}")
        if len(set(dims)) != len(dims):
            raise ValueError(f"process_group{dims}: a dimension is named twice")
        from .collectives import _groups

        self.dims = dims
        self.device_mesh = device_mesh
        self._groups = _groups(shape, dims)

    def size(self) -> int:
        """How many ranks each group holds."""
        return len(self._groups[0])

    def _wire(self) -> m.Group:
        return m.Group(self.dims, self._groups)

    def _check_used_on(self, ctx) -> None:
        """Refuse a call on ``ctx``'s ranks that would leave a member of one of the groups out (it would wait
        for that member until its timeout), or that runs on another mesh's procs."""
        from .activation import client_for

        if client_for(self.device_mesh) is not ctx.client:
            raise ValueError(f"{self!r} belongs to another proc mesh than the one this remote function runs on")
        ranks = set(ctx.ranks)
        for g in self._groups:
            inside = ranks.intersection(g)
            if inside and len(inside) != len(g):
                raise ValueError(f"{self!r}: the remote function runs on ranks {sorted(ranks)}, which hold only "
                                 f"part of the group {list(g)}; call it on the whole mesh the group was made on, "
                                 f"or make the group on the mesh it runs on")
        if not ranks.issubset(r for g in self._groups for r in g):
            raise ValueError(f"{self!r}: the remote function runs on ranks {sorted(ranks)}, some of them outside "
                             f"the mesh the group was made on")

    def __reduce__(self):
        raise TypeError("a RemoteProcessGroup is an argument of remote functions (remote(fn)(..., pg)); "
                        "it cannot be pickled to be sent elsewhere")

    def __repr__(self) -> str:
        return f"RemoteProcessGroup(dims={self.dims}, size={self.size()})"
