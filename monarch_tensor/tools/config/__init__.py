"""Configuration objects, at Monarch's import path: ``from monarch_tensor.tools.config import Workspace``."""

from .workspace import Workspace

__all__ = ["Workspace"]
