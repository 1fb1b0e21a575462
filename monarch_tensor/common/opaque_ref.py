"""Monarch's ``monarch.common.opaque_ref`` path."""

from monarch_tensor.worker.opaque import OpaqueRef

__all__ = ["OpaqueRef"]
