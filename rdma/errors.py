"""Errors of the data plane, named for whose fault they are."""

from __future__ import annotations


class RDMAError(Exception):
    """Base of every data-plane error."""


class BufferDroppedError(RDMAError):
    """The buffer was dropped by its owner (``drop()``); its handle no longer refers to memory."""


class OwnerDiedError(RDMAError):
    """The process that owns the buffer died (or cannot be reached): the registration is gone."""


class TransferTimeoutError(RDMAError, TimeoutError):
    """A transfer did not finish within its timeout."""


class BackendUnavailableError(RDMAError):
    """The backend asked for (by ``MONARCH_TENSOR_RDMA_BACKEND`` or by hand) cannot serve this pair."""


class BackendRefusedError(RDMAError):
    """The kernel or device refused a transfer this backend tried (e.g. EPERM for cross-memory attach);
    the caller falls back to the next backend."""


class TransferError(RDMAError):
    """A transfer failed in the backend (I/O error, bad completion); the message says where."""


# Monarch's warnings, by its names. Each is shown once per process (``warnings.simplefilter("once", ...)``
# in buffer.py); filter them by class as Monarch's users do.
class RDMATcpFallbackWarning(Warning):
    """Bytes of a buffer on another host moved over TCP: no RDMA device (verbs) serves the pair."""


class RDMAReadTransferWarning(Warning):
    """(Monarch's name; this data plane issues none: kept so that code filtering it imports.)"""


class RDMAWriteTransferWarning(Warning):
    """(Monarch's name; this data plane issues none: kept so that code filtering it imports.)"""
