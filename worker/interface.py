"""The tensor worker as the controller sees it: what both sides import, without the worker's code.

The controller spawns the worker actor by the qualified name of its class (``IMPLEMENTATION``) and calls its
endpoints by name, so a script never imports ``worker/worker.py``, its streams or its collectives. This
module names them: the actor's name on every proc (``WORKER_NAME``), its endpoints
(``TensorWorkerInterface``: their signatures and what each does; ``TensorWorker`` implements every one,
``tests/test_engine_wire.py`` checks it), and the two helpers whose results both sides must agree on
(``flat_leaves``: the layout of an op's outputs; ``resolve_function``: a function named by a dotted path).

>>> procs._spawn_named(WORKER_NAME, TensorWorkerInterface, store_addr, implementation=IMPLEMENTATION)  # doctest: +SKIP
"""

from __future__ import annotations

import importlib
from typing import Any

from monarch_tensor.actor import Actor, endpoint

from .opaque import OpaqueRef

WORKER_NAME = "tensor_engine_worker"  # the worker actor's name on every proc of a mesh
IMPLEMENTATION = "monarch_tensor.worker.worker:TensorWorker"  # the class the procs construct


class TensorWorkerInterface(Actor):
    """The worker actor's endpoints, for the controller's actor mesh of it (the procs run
    ``IMPLEMENTATION``; this class is never constructed)."""

    def __init__(self, store_addr: tuple[str, int] | None = None) -> None:
        raise TypeError(f"TensorWorkerInterface only names the worker's endpoints: procs construct {IMPLEMENTATION}")

    @endpoint
    def execute(self, batch: list, first: int = 0) -> None:
        """Controller -> worker: queue ``batch``'s instructions on their streams; ``first`` is the sequence
        number of ``batch[0]`` (0: not withdrawable)."""

    @endpoint
    def pause(self) -> int:
        """Controller -> worker, on an interrupt: stop every stream before its next instruction; the highest
        sequence number begun."""
        raise NotImplementedError

    @endpoint
    def withdraw(self, after: int, end: int) -> None:
        """Controller -> worker, after ``pause``: drop the instructions numbered in ``(after, end]``."""

    @endpoint
    def execute_unreadable(self, batch: list, error: BaseException, payload_lost: bool) -> None:
        """The worker's mailbox -> the worker: a batch that could not be read whole; what it could not read fails."""

    @endpoint
    def peers_died(self, ranks: list) -> None:
        """Controller -> worker: the procs of ``ranks`` died; groups with them stop waiting for them."""

    @endpoint
    def deliver(self, xfer: int, value: Any) -> None:
        """Worker -> worker: ``to_mesh`` data of transfer ``xfer``."""

    @endpoint
    def deliver_failed(self, xfer: int, error: BaseException) -> None:
        """Worker -> worker: transfer ``xfer``'s data never arrived; its receiving ref fails with ``error``."""


def flat_leaves(obj: Any) -> list:
    """Leaves of nested tuples/lists/dicts (a dict's values in its order), in order (the layout of
    ``CallOp.outs``); an ``OpaqueRef``'s leaf is its key tensor."""
    if isinstance(obj, (tuple, list)):  # named tuples and torch.return_types too
        out = []
        for x in obj:
            if isinstance(x, (tuple, list, dict)):
                out.extend(flat_leaves(x))
            elif isinstance(x, OpaqueRef):
                out.append(x._key)
            else:
                out.append(x)
        return out
    if isinstance(obj, dict):
        return flat_leaves(list(obj.values()))
    return [obj._key] if isinstance(obj, OpaqueRef) else [obj]


def resolve_function(fn: Any):
    """A callable, or a dotted path ``"package.module.function"`` imported here."""
    if isinstance(fn, str):
        module, _, name = fn.rpartition(".")
        return getattr(importlib.import_module(module), name)
    return fn
