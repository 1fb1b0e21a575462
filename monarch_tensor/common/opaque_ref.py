"""Monarch's ``monarch.common.opaque_ref`` path."""

from worker.opaque import OpaqueRef

__all__ = ["OpaqueRef"]
