"""The tensor engine's instruction protocol: controller -> worker, one frozen record per kind.

The controller batches these per mesh and sends each batch as one message to
the ``TensorWorker`` actor of every proc of the mesh; the worker handles ``X``
with ``TensorWorker.handle_X`` (``worker/worker.py``), so protocol and handlers
read side by side. Tensors appear in instructions as ``Ref(id)``; ``loc`` is the
user's ``(file, line, function)`` that issued the instruction, shown when it fails.
``tests/test_engine_wire.py`` round-trips every instruction and checks its handler.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, fields
from typing import Any, NamedTuple

from monarch_tensor.transport import _wire
from monarch_tensor.transport.messages import PortRef


def _fast_reduce(cls):
    """Pickle as (cls, field values), the values read by one C call (a batch holds hundreds)."""
    get = operator.attrgetter(*(f.name for f in fields(cls)))
    cls.__reduce__ = lambda self: (cls, get(self))
    return cls

Loc = Any  # (filename, lineno, function) or None
DEEP = "*"  # in CallOp.tpos: arguments also hold Ref objects (resolve them everywhere)


class Ref:
    """A tensor of the worker's ref table, as it travels inside instruction arguments."""

    __slots__ = ("id",)

    def __init__(self, id: int) -> None:
        self.id = id

    def __reduce__(self):
        return (Ref, (self.id,))

    def __eq__(self, other) -> bool:
        return isinstance(other, Ref) and other.id == self.id

    def __hash__(self) -> int:
        return hash(("Ref", self.id))

    def __repr__(self) -> str:
        return f"Ref({self.id})"


class Group:
    """A mesh's process group as it travels inside a remote function's arguments
    (``mesh.process_group(dims)``): the worker puts its own group in its place, the one of ``groups`` (tuples
    of proc ranks) that holds it, made for the function's stream; where the function runs on one rank only
    (``propagate="inspect"``, ``call_on_shard_and_fetch``) a stand-in whose collectives change nothing."""

    __slots__ = ("dims", "groups")

    def __init__(self, dims: tuple, groups: tuple) -> None:
        self.dims, self.groups = dims, groups

    def __reduce__(self):
        return (Group, (self.dims, self.groups))

    def __eq__(self, other) -> bool:
        return isinstance(other, Group) and (other.dims, other.groups) == (self.dims, self.groups)

    def __hash__(self) -> int:
        return hash(("Group", self.dims, self.groups))

    def __repr__(self) -> str:
        return f"Group({self.dims}, {self.groups})"


class CallOp(NamedTuple):
    """Run aten op ``op`` (e.g. ``"aten::add.Tensor"``) and store its tensor outputs at ``outs``.

    Tensor arguments are ref ids at the places ``tpos`` lists (an index, an
    ``(index, item)`` pair, a kwarg name; ``DEEP``: also ``Ref``s anywhere).
    ``outs`` mirrors the flattened result (``None`` where nothing is stored);
    ``mutates`` are refs the op writes in place (they hold the error if it fails).

    The one record per recorded op, so a named tuple rather than a frozen dataclass: as immutable, and made (and
    unpickled) by one call of tuple's constructor rather than one ``object.__setattr__`` per field.
    """

    op: str
    args: tuple
    kwargs: dict
    tpos: tuple
    outs: tuple
    mutates: tuple
    stream: int
    loc: Loc

    def __reduce__(self):
        return (CallOp, tuple(self))


@_fast_reduce
@dataclass(frozen=True, slots=True)
class CallFunction:
    """Run a user function (an object, or a dotted path) on every rank; store tensor results at ``outs``.
    ``metas`` holds ``(shape, dtype)`` for each out its propagate made a new tensor (None elsewhere; empty:
    nothing to check): a result that differs fails."""

    fn: Any
    args: tuple
    kwargs: dict
    outs: tuple
    mutates: tuple
    stream: int
    loc: Loc
    metas: tuple = ()


@_fast_reduce
@dataclass(frozen=True, slots=True)
class CreateValue:
    """Store a tensor the controller uploads (a local constant) at ``ref``, on the worker's device."""

    ref: int
    value: Any
    stream: int


@_fast_reduce
@dataclass(frozen=True, slots=True)
class CreateRank:
    """Store this proc's coordinate along a mesh dim (``coords[proc rank]``) as a 0-dim int64 tensor."""

    ref: int
    coords: dict
    stream: int


@_fast_reduce
@dataclass(frozen=True, slots=True)
class DeleteRefs:
    """Forget refs whose controller tensors were garbage-collected."""

    refs: tuple
    stream: int


@_fast_reduce
@dataclass(frozen=True, slots=True)
class Reduce:
    """Collective over the group of ``groups`` that holds this proc: all-reduce, gather, reduce-scatter.

    ``reduction`` is sum/avg/max/min/product/stack; ``inplace`` writes into ``src``; ``numel`` and
    ``dtype`` are ``src``'s (a rank whose ``src`` failed takes part with a stand-in of that size).
    """

    out: int
    src: int
    groups: tuple
    reduction: str
    scatter: bool
    inplace: bool
    numel: int
    dtype: Any
    stream: int
    loc: Loc


@_fast_reduce
@dataclass(frozen=True, slots=True)
class ReduceMany:
    """Several reduces of one dtype, group and reduction in one collective: one flag per tensor, then their
    elements side by side, as DDP's buckets. Made by a pytree's ``reduce``/``reduce_`` and by
    the controller from adjacent ``Reduce``s of a batch. Each result lands at ``outs[i]`` (for ``inplace``,
    ``outs`` are the ``srcs``, written in place); ``numels`` are the ``srcs``' sizes. A failed input fails
    only its own result, as separate reduces would, and names its own ``locs[i]``."""

    outs: tuple
    srcs: tuple
    groups: tuple
    reduction: str
    inplace: bool
    numels: tuple
    dtype: Any
    stream: int
    locs: tuple


@_fast_reduce
@dataclass(frozen=True, slots=True)
class FetchValue:
    """Send ``value`` (refs resolved to CPU tensors, ``fn`` applied if given) to ``reply``."""

    value: Any
    fn: Any
    reply: PortRef
    stream: int
    loc: Loc


@_fast_reduce
@dataclass(frozen=True, slots=True)
class SendTensor:
    """Send ref ``src`` to the proc at ``dests[proc rank]`` as transfer ``xfer`` (``to_mesh``)."""

    src: int
    xfer: int
    dests: dict
    stream: int
    loc: Loc


@_fast_reduce
@dataclass(frozen=True, slots=True)
class RecvTensor:
    """Wait for transfer ``xfer`` from another mesh and store it at ``out``."""

    out: int
    xfer: int
    timeout: float
    stream: int
    loc: Loc


@_fast_reduce
@dataclass(frozen=True, slots=True)
class CreateStream:
    """Start stream ``stream`` (a thread on CPU; a thread and a CUDA stream on GPU)."""

    stream: int
    name: str


@_fast_reduce
@dataclass(frozen=True, slots=True)
class BorrowCreate:
    """Lend ref ``src`` of stream ``from_stream`` to ``to_stream`` as ref ``dst``, after ``from_stream``'s prior work."""

    borrow: int
    src: int
    dst: int
    from_stream: int
    to_stream: int


@_fast_reduce
@dataclass(frozen=True, slots=True)
class BorrowDrop:
    """End borrow ``borrow``: ``from_stream`` waits for ``to_stream``'s work on it, ``dst`` is forgotten."""

    borrow: int
    dst: int
    from_stream: int
    to_stream: int


@_fast_reduce
@dataclass(frozen=True, slots=True)
class ReportRefs:
    """Send the number of live refs (and of threads/streams) to ``reply``: a test and debugging aid."""

    reply: PortRef
    stream: int


@_fast_reduce
@dataclass(frozen=True, slots=True)
class CallActor:
    """Call endpoint ``method`` of this proc's actor ``actor`` with the refs in ``args`` and ``kwargs``
    replaced by this rank's tensors; the stream waits until the endpoint has returned (the actor borrows
    the tensors meanwhile). The result goes to ``reply``, as any call's does; or, with ``outs``
    (``endpoint.rref``), its tensors are stored at those refs, checked against ``metas`` as
    ``CallFunction``'s are."""

    actor: str
    method: str
    args: tuple
    kwargs: dict
    reply: PortRef | None
    stream: int
    loc: Loc
    outs: tuple = ()
    metas: tuple = ()


@_fast_reduce
@dataclass(frozen=True, slots=True)
class DefineProgram:
    """Keep a compiled function's recording (``controller/compile.py``) at ref ``program`` as a prepared program
    (``worker/program.py``). ``instrs`` use fixed refs: the captured tensors' own, and per-program refs for its
    input slots ``inputs``, output slots ``outputs`` and temporaries; ``frees[i]``: the temporaries whose last
    use is ``instrs[i]``, dropped right after it."""

    program: int
    instrs: tuple
    inputs: tuple
    outputs: tuple
    frees: tuple
    stream: int


@_fast_reduce
@dataclass(frozen=True, slots=True)
class RunProgram:
    """Run prepared program ``program`` once: ``inputs`` are the refs its input slots take, ``outputs`` the refs
    its results are stored at (one message per compiled call)."""

    program: int
    inputs: tuple
    outputs: tuple
    stream: int
    loc: Loc


INSTRUCTIONS = (CallOp, CallFunction, CreateValue, CreateRank, DeleteRefs, Reduce, ReduceMany, FetchValue, SendTensor,
                RecvTensor, CreateStream, BorrowCreate, BorrowDrop, ReportRefs, CallActor,
                DefineProgram, RunProgram)
_wire.add_envelope_modules(__name__)  # a batch that cannot be read whole is still read instruction by instruction
