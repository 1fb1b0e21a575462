"""Monarch's ``monarch.common.selection`` path."""

from ..selection import Selection  # noqa: F401

__all__ = ["Selection"]
