"""Monarch's ``monarch.cached_remote_function`` path: ``remote_autograd_function``."""

from monarch_tensor.controller.cached_remote_function import RemoteAutogradFunction, remote_autograd_function

__all__ = ["RemoteAutogradFunction", "remote_autograd_function"]
