"""Monarch's ``monarch.common.tensor`` path."""

from controller.api import reduce, reduce_  # noqa: F401
from controller.tensor import Tensor  # noqa: F401

__all__ = ["Tensor", "reduce", "reduce_"]
