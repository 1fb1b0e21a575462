"""Monarch's ``monarch.opaque_object`` path: ``from monarch_tensor.opaque_object import OpaqueObject, opaque_method``."""

from monarch_tensor.controller.opaque import OpaqueObject, opaque_method

__all__ = ["OpaqueObject", "opaque_method"]
