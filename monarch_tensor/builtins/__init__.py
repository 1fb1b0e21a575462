"""Monarch's ``monarch.builtins``: remote functions for common PyTorch and logging calls on every rank of the
active mesh (``log``, ``random``)."""

from .log import log_remote, set_logging_level_remote

__all__ = ["log_remote", "set_logging_level_remote"]
