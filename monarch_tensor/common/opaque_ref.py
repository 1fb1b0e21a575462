"""Monarch's ``monarch.common.opaque_ref`` path."""

from worker.opaque import OpaqueRef  # noqa: F401

__all__ = ["OpaqueRef"]
