"""Monarch's ``monarch.common._coalescing`` path: ``coalescing`` and ``compile``."""

from monarch_tensor.controller.client import coalescing
from monarch_tensor.controller.compile import compile

__all__ = ["coalescing", "compile"]
