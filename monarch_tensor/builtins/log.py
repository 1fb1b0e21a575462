"""Logging on the workers (Monarch's ``monarch.builtins.log``): ``log_remote("step %d", 3)`` inside
``with mesh.activate():`` logs on every rank, through the procs' log forwarding."""

import logging

from monarch_tensor.controller.api import remote

logger = logging.getLogger(__name__)


def _log(*args, level: int = logging.WARNING, **kwargs) -> None:
    logger.log(level, *args, **kwargs)


def _set_level(level: int) -> None:
    logger.setLevel(level)


# (the functions travel by name: the workers import this module)
log_remote = remote(_log, propagate=lambda *args, **kwargs: None)
set_logging_level_remote = remote(_set_level, propagate=lambda level: None)
