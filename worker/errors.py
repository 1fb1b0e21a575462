"""Errors that happen on a worker, as the controller receives them."""

from __future__ import annotations

import linecache


class RemoteException(Exception):
    """An instruction failed on a worker: the user's op or function, not the runtime.

    Raised by ``fetch_shard(...).result()`` (and ``inspect``) when the fetched
    value depends on the failure. ``loc`` is the line of the controller script
    that issued the failing op, ``rank`` the proc rank where it failed,
    ``traceback`` the worker's traceback and ``exception`` the original
    exception when it could be pickled.

    >>> try:
    ...     fetch_shard(x @ bad_shape).result()
    ... except RemoteException as e:
    ...     print(e.loc, e.rank)
    """

    def __init__(self, op: str, loc, rank: int, exc_repr: str, traceback: str,
                 exception: BaseException | None = None) -> None:
        self.op, self.loc, self.rank = op, loc, rank
        self.exc_repr, self.traceback, self.exception = exc_repr, traceback, exception
        super().__init__(op, loc, rank, exc_repr)

    def __reduce__(self):
        return (RemoteException, (self.op, self.loc, self.rank, self.exc_repr, self.traceback, self.exception))

    def __str__(self) -> str:
        lines = [f"{self.op} failed on rank {self.rank}: {self.exc_repr}"]
        if self.loc:
            filename, lineno, func = self.loc
            lines.append(f"  issued at {filename}:{lineno} in {func}")
            src = linecache.getline(filename, lineno).strip()
            if src:
                lines.append(f"    {src}")
        if self.traceback:
            lines.append("worker traceback:")
            lines.append(self.traceback.rstrip())
        return "\n".join(lines)
