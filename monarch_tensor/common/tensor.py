"""Monarch's ``monarch.common.tensor`` path."""

from controller.api import reduce, reduce_
from controller.tensor import Tensor

__all__ = ["Tensor", "reduce", "reduce_"]
