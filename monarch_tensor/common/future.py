"""Monarch's ``monarch.common.future`` path."""

from monarch_tensor.future import Future  # noqa: F401

__all__ = ["Future"]
