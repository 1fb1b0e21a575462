"""Monarch's ``monarch.common.tensor`` path."""

from monarch_tensor.controller.api import reduce, reduce_
from monarch_tensor.controller.tensor import Tensor

__all__ = ["Tensor", "reduce", "reduce_"]
