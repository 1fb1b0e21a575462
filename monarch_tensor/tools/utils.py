"""Where Monarch's tools keep their files, and the active conda environment (Monarch's
``monarch.tools.utils``).

>>> from monarch_tensor.tools.utils import MONARCH_HOME, conda
>>> MONARCH_HOME("conda-pack-out")           # ~/.monarch/conda-pack-out (or under $MONARCH_HOME), made if missing
>>> conda.active_env_name()                  # the active conda environment's name; None outside one
"""

from __future__ import annotations

import os
import pathlib

__all__ = ["MONARCH_HOME", "conda"]


def MONARCH_HOME(*subdir_paths: str) -> pathlib.Path:
    """``~/.monarch`` (or ``$MONARCH_HOME``) joined with ``subdir_paths``; the directory is created (with
    its parents) if it does not exist.

    >>> MONARCH_HOME() == pathlib.Path.home() / ".monarch"
    True
    """
    home = pathlib.Path(os.getenv("MONARCH_HOME", str(pathlib.Path.home() / ".monarch")))
    path = home.joinpath(*subdir_paths)
    path.mkdir(parents=True, exist_ok=True)
    return path


class conda:
    """The active conda environment, from ``$CONDA_PREFIX`` (``conda activate`` sets it)."""

    @staticmethod
    def active_env_dir() -> str | None:
        """The active environment's directory; None outside a conda environment."""
        return os.getenv("CONDA_PREFIX")

    @staticmethod
    def active_env_name() -> str | None:
        """The active environment's name (its directory's name); None outside a conda environment."""
        env_dir = conda.active_env_dir()
        return os.path.basename(env_dir) if env_dir else None
