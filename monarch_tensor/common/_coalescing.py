"""Monarch's ``monarch.common._coalescing`` path: ``coalescing`` and ``compile``."""

from controller.client import coalescing  # noqa: F401
from controller.compile import compile  # noqa: F401

__all__ = ["coalescing", "compile"]
