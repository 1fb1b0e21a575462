"""Monarch's ``monarch.common.future`` path."""

from monarch_tensor.future import Future

__all__ = ["Future"]
