"""Monarch's ``monarch.tools.config.environment``: the environment a ``Workspace`` runs in.

``Workspace(dirs=[...], env=CondaEnvironment("/opt/envs/train"))`` names the conda environment that
``sync_workspace(ws, conda=True)`` mirrors onto the hosts (default: the active one, ``$CONDA_PREFIX``).
"""

from __future__ import annotations

import os


class NoCondaEnvironmentError(ValueError, AssertionError):
    """No conda environment named and none active: a ``ValueError``, and the ``AssertionError`` Monarch's
    ``CondaEnvironment().conda_prefix`` raises."""


class Environment:
    """The dependencies of a workspace's projects (Monarch's base class)."""


class CondaEnvironment(Environment):
    """A conda environment: ``conda_prefix``, or the active one (``$CONDA_PREFIX``) when it is None."""

    def __init__(self, conda_prefix: str | None = None) -> None:
        self._conda_prefix = conda_prefix

    @property
    def conda_prefix(self) -> str:
        """The prefix given, else the active environment's; a ValueError when there is neither."""
        prefix = self._conda_prefix or os.environ.get("CONDA_PREFIX")
        if not prefix:
            raise NoCondaEnvironmentError("no conda environment is active ($CONDA_PREFIX is not set): name one, "
                             "CondaEnvironment('/path/to/env'), or activate one")
        return prefix

    def __eq__(self, other: object) -> bool:
        return isinstance(other, CondaEnvironment) and self._conda_prefix == other._conda_prefix

    def __hash__(self) -> int:
        return hash(self._conda_prefix)

    def __repr__(self) -> str:
        return f"CondaEnvironment({self._conda_prefix!r})"
