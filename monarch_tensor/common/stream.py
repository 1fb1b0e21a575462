"""Monarch's ``monarch.common.stream`` path."""

from monarch_tensor.controller.api import Stream, get_active_stream

__all__ = ["Stream", "get_active_stream"]
