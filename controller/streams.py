"""Streams: a second instruction stream on every worker (``Stream``), and borrowing a tensor onto it.

>>> comms = Stream("comms")
>>> g, borrow = comms.borrow(grad)
>>> with comms.activate():
...     g.reduce_("gpus", "sum")
>>> borrow.drop()
"""

from __future__ import annotations

import contextlib
import itertools
import warnings

from monarch_tensor.worker import messages as m

from .client import Ctx
from .errors import BorrowError
from .tensor import Loans, Tensor, borrowing, check_live, check_readable, forget_value, loans_of, mutable_loans, state

_stream_ids = itertools.count(1)
_borrow_ids = itertools.count(1)


class Stream:
    """A second instruction stream on every worker: work on it may overlap the main stream.

    >>> comms = Stream("comms")
    >>> g, borrow = comms.borrow(grad)
    >>> with comms.activate():
    ...     g.reduce_("gpus", "sum")
    >>> borrow.drop()
    """

    def __init__(self, name: str, _id: int | None = None) -> None:
        self.name = name
        self.id = next(_stream_ids) if _id is None else _id

    @contextlib.contextmanager
    def activate(self):
        prev = state.stream
        state.stream = None if self.id == 0 else self
        try:
            yield self
        finally:
            state.stream = prev

    def borrow(self, t: Tensor, mutable: bool = False) -> tuple[Tensor, Borrow]:
        """``t`` (of another stream) usable on this one until ``borrow.drop()``. Until then ``t`` cannot be
        written, and the borrowed tensor only with ``mutable=True``; a mutable borrow has the memory to itself:
        ``t`` cannot be read either (nor borrowed again), and a tensor lent already cannot be borrowed mutably.
        A borrow the script lets go of without ``drop()`` is dropped then, with a warning."""
        if type(t) is not Tensor:
            raise TypeError(f"borrow needs a mesh tensor, got {type(t).__name__}")
        check_live(t._ctx, "borrow")
        check_readable("borrow", (t,))
        src = t._ctx
        if src.sid == self.id:
            raise BorrowError(f"the tensor already lives on stream {self.name!r}")
        if mutable and (lent_to := loans_of(t)):
            raise BorrowError(f"borrow(mutable=True): this tensor (or a view of its memory) is lent to stream(s) "
                              f"{sorted(lent_to)} already, which may read it meanwhile; drop those borrows first")
        dst = src.client.ctx(src.pm, self)
        bid = next(_borrow_ids)
        ref = next(src.client.refs)
        src.client.issue(m.BorrowCreate(bid, t._ref, ref, src.sid, self.id), src.ranks)
        forget_value(t)  # the other stream shares its memory
        bt = Tensor(t._meta, t._mid, dst, ref)
        borrowing[0] = True
        if not mutable:
            bt._read_only = True
        # Writes through a view of it, or to its base and the base's other views, are refused too: the root
        # tensor of its memory (torch's ``_base``) shares the list (check_writable looks at both).
        root = t._base
        lent = getattr(t, "_lent", None)
        if lent is None:
            lent = getattr(root, "_lent", None) if root is not None else None
            if lent is None:
                lent = Loans()
            t._lent = lent
        if root is not None and getattr(root, "_lent", None) is not lent:
            root._lent = lent
        lent.append(self.name)
        if mutable:
            lent.mutable = True
            mutable_loans.add(bid)
        return bt, Borrow(bid, bt, src, dst, mutable, t)

    def __repr__(self) -> str:
        return f"Stream({self.name!r})"


_MAIN = Stream("main", 0)


def get_active_stream() -> Stream:
    return state.stream or _MAIN


class _Dropped(Ctx):
    """The context of a dropped tensor (``t.drop()``, or a borrowed one after ``borrow.drop()``): a context of
    stream -1 on no ranks, which any use refuses with a clear error (``tensor.check_live``)."""

    __slots__ = ("dropped_by",)

    def __init__(self, ctx: Ctx, dropped_by: str = "borrow.drop()") -> None:
        self.pm, self.stream, self.client = ctx.pm, ctx.stream, ctx.client
        self.sid, self.ranks = -1, ()
        self.dropped_by = dropped_by


class Borrow:
    """A lent tensor; ``drop()`` ends the loan (also ``with borrow:``). A borrow the script lets go of without
    ``drop()`` drops itself then, with a warning (Monarch's): the lender's stream waits for the other stream's
    work on it from that point."""

    def __init__(self, bid: int, tensor: Tensor, src: Ctx, dst: Ctx, mutable: bool, origin: Tensor) -> None:
        self.id, self._src, self._dst, self.mutable = bid, src, dst, mutable
        self._tensor: Tensor | None = tensor  # (None once dropped)
        self._dropped = False
        # The lent tensor stays alive while the borrow lasts, even if the script lets go of it: the other
        # stream reads it when it gets there.
        self._origin: Tensor | None = origin
        tensor._origin = origin

    def drop(self) -> None:
        if self._dropped:
            raise BorrowError(f"borrow {self.id} was already dropped")
        self._dropped = True
        self._src.client.issue(self._drop_instruction(), self._src.ranks)
        self._end()

    def _drop_instruction(self) -> m.BorrowDrop:
        t = self._tensor
        assert t is not None, "a borrow's drop instruction is made once, before the drop ends it"
        return m.BorrowDrop(self.id, t._ref, self._src.sid, self._dst.sid)

    def _end(self) -> None:
        """The controller's side of the drop: the borrowed tensor is refused from now on, the lender usable."""
        t = self._tensor
        assert t is not None, "a borrow ends once"
        t._ctx = _Dropped(self._dst)
        self._tensor = None
        origin = self._origin
        lent = getattr(origin, "_lent", None)
        if lent is not None:
            lent.remove(self._dst.stream.name)  # (the list is shared with its root, which sees it empty too)
            if self.mutable:
                lent.mutable = False
            if not lent:
                delattr(origin, "_lent")
        mutable_loans.discard(self.id)
        self._origin = t._origin = None

    def __del__(self) -> None:
        """Garbage-collected before ``drop()``: drop it now, as ``drop()`` would here. This runs at any time, on
        any thread (inside the client's lock, or a lock of the flusher's, too): the drop joins the batch without
        taking a lock (``issue_later``), before the next instruction; nothing is sent once the mesh stopped."""
        try:
            if self._dropped:
                return
            self._dropped = True
            client = self._src.client
            if not client.alloc._stopped:
                client.issue_later(self._drop_instruction(), self._src.ranks)
            self._end()
            warnings.warn(f"borrow {self.id} of a tensor lent to stream {self._dst.stream.name!r} was garbage-"
                          f"collected before borrow.drop(): it is dropped now, so the lender's stream waits here "
                          f"for that stream's work on it; call borrow.drop() (or use `with borrow:`) to say where",
                          stacklevel=2)
        except Exception:  # noqa: BLE001 - interpreter shutdown, or a warning filter that raises
            pass

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        if not self._dropped:
            self.drop()
