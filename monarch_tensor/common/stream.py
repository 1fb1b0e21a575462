"""Monarch's ``monarch.common.stream`` path."""

from controller.api import Stream, get_active_stream  # noqa: F401

__all__ = ["Stream", "get_active_stream"]
