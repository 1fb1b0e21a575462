"""Errors of the tensor engine's controller, named for whose fault they are."""

from __future__ import annotations

from monarch_tensor.worker.errors import RemoteException  # noqa: F401 - re-exported: a worker's failure, as the controller sees it


class MeshTensorError(Exception):
    """The script used a mesh tensor in a way the engine cannot record.

    Examples: mixing tensors of two meshes or two streams in one op, reading a
    value on the controller (``t.item()``, ``if t:``) without ``fetch_shard``,
    an op whose output shape depends on the data.
    """


class BorrowError(MeshTensorError):
    """A borrowed tensor was used after ``borrow.drop()``, or a borrow was dropped twice."""
