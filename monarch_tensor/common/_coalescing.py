"""Monarch's ``monarch.common._coalescing`` path: ``coalescing`` and ``compile``."""

from controller.client import coalescing
from controller.compile import compile

__all__ = ["coalescing", "compile"]
