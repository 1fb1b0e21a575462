"""Monarch's ``monarch.opaque_module`` path: ``from monarch_tensor.opaque_module import OpaqueModule``."""

from monarch_tensor.controller.opaque_module import OpaqueModule

__all__ = ["OpaqueModule"]
