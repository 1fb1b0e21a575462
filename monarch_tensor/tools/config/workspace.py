"""``Workspace``: the local directories that ``sync_workspace`` mirrors onto every host.

Same constructor as Monarch's ``monarch.tools.config.workspace.Workspace``: a
list of dirs (each lands in ``$WORKSPACE_DIR/<its name>`` on the hosts) or a
dict ``{local dir: remote subdir}`` (``""`` means the root itself). Each remote
dir is put on the procs' ``sys.path``, so code in it imports.
"""

from __future__ import annotations

import os
from pathlib import Path


class Workspace:
    """Local dirs to mirror on the hosts.

    >>> ws = Workspace(dirs=["/home/me/proj"])          # -> $WORKSPACE_DIR/proj
    >>> ws = Workspace(dirs={"/home/me/proj": "code"})  # -> $WORKSPACE_DIR/code
    >>> await proc_mesh.sync_workspace(ws, auto_reload=True)  # doctest: +SKIP
    """

    def __init__(self, dirs: list[Path | str] | dict[Path | str, str] | None = None, env: object = None) -> None:
        self.env = env  # a CondaEnvironment: what sync_workspace(..., conda=True) mirrors (default: the active one)
        self.dirs: dict[Path, str] = {}
        if dirs is not None and not isinstance(dirs, (list, tuple, dict)):
            raise TypeError(f"Workspace(dirs=...) takes a list of dirs or a {{dir: remote name}} dict, got {dirs!r}")
        items = [(d, None) for d in dirs] if isinstance(dirs, (list, tuple)) else list((dirs or {}).items())
        for src, dst in items:
            if not src:
                raise ValueError(f"workspace dir {src!r} is empty; give a directory path")
            path = Path(os.path.abspath(os.path.expanduser(str(src))))
            dst = path.name if dst is None else str(dst).strip("/")
            if any(p in ("..", ".") for p in dst.split("/")) or os.path.isabs(dst):
                raise ValueError(f"remote dir {dst!r} for {src} must be a relative path without '.' or '..'")
            if dst in self.dirs.values():
                raise ValueError(f"two workspace dirs map to the same remote dir {dst!r}")
            self.dirs[path] = dst
        for dst in self.dirs.values():
            for other in self.dirs.values():
                if other != dst and (dst == "" or other.startswith(dst + "/")):
                    raise ValueError(f"remote dir {other!r} would be inside remote dir {dst!r}; they must not nest")

    def check(self) -> None:
        """Raise ``FileNotFoundError`` naming the first dir that does not exist."""
        for path in self.dirs:
            if not path.is_dir():
                raise FileNotFoundError(f"workspace dir {path} does not exist or is not a directory")

    def merge(self, outdir: str | Path) -> None:
        """Copy every dir into ``outdir`` at its remote name, as a host's root gets it (Monarch's ``merge``:
        e.g. to build an image of the workspace): the files a sync moves (symlinks followed, caches and
        version-control dirs left out, no empty dirs), with their permission bits and times."""
        import shutil

        from monarch_tensor.workspace_sync import _filetree

        self.check()
        out = Path(outdir)
        out.mkdir(parents=True, exist_ok=True)
        for src, dst in self.dirs.items():
            for rel in _filetree.scan(str(src)):
                target = out / dst / rel
                target.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(src / rel, target)

    @staticmethod
    def null() -> Workspace:
        """A workspace with no dirs."""
        return Workspace()

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Workspace) and self.dirs == other.dirs and self.env == other.env

    def __repr__(self) -> str:
        return f"Workspace(dirs={ {str(k): v for k, v in self.dirs.items()} })"
