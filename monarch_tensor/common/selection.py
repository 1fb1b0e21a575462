"""Monarch's ``monarch.common.selection`` path."""

from ..selection import Selection

__all__ = ["Selection"]
