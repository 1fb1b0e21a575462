"""Configuration objects, at Monarch's import path: ``from monarch_tensor.tools.config import Config, Workspace``."""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Any

from .workspace import Workspace

NOT_SET: str = "__NOT_SET__"


@dataclass
class Config:
    """What Monarch's ``monarch.tools.config.Config`` holds to schedule a job: ``scheduler`` (its name),
    ``scheduler_args``, the ``workspace`` to mirror on the hosts (``host_mesh.sync_workspace(config.workspace)``),
    ``dryrun`` and ``appdef`` (a torchx job spec: Monarch submits it through torchx, which this project does
    not use; jobs are started with ``LocalJob``/``SlurmJob`` instead, so it is kept as given, None by default).
    As Monarch's, ``workspace=None`` or a directory path (a str) still work, with a ``FutureWarning``."""

    scheduler: str = NOT_SET
    scheduler_args: dict[str, Any] = field(default_factory=dict)
    workspace: Workspace = field(default_factory=Workspace.null)
    dryrun: bool = False
    appdef: Any = None

    def __post_init__(self) -> None:
        if self.workspace is None or self.workspace == "":
            warnings.warn("Setting `workspace=None` is deprecated. Use "
                          "`monarch_tensor.tools.config.workspace.Workspace(env=None)` instead.", FutureWarning,
                          stacklevel=3)
            self.workspace = Workspace.null()
        elif isinstance(self.workspace, str):
            warnings.warn(f"Setting `workspace='{self.workspace}'` is deprecated. Use "
                          f"`monarch_tensor.tools.config.workspace.Workspace(dirs=['{self.workspace}'])` instead.",
                          FutureWarning, stacklevel=3)
            self.workspace = Workspace(dirs={self.workspace: ""})  # (the dir's contents at the root, as before)
        elif not isinstance(self.workspace, Workspace):
            raise TypeError(f"Config(workspace=...) takes a Workspace, got {self.workspace!r}")
        if not isinstance(self.scheduler, str):
            raise TypeError(f"Config(scheduler=...) takes a scheduler's name, got {self.scheduler!r}")
        if not isinstance(self.scheduler_args, dict):
            raise TypeError(f"Config(scheduler_args=...) takes a dict, got {self.scheduler_args!r}")


__all__ = ["NOT_SET", "Config", "Workspace"]
