"""``job.remote_mount(source, mntpoint)``: a local directory mirrored onto a job's hosts (Monarch 0.7's).

>>> job = SlurmJob(meshes={"trainers": 4})
>>> job.remote_mount("/home/me/proj", mntpoint="/scratch/proj")   # proj/.venv/bin/python, if there,
>>> hosts = job.state().trainers                                 #   runs the procs of `hosts`

The mount is configuration: it is applied each time ``state()`` connects to the
job (a new script, a ``monarch-tensor exec``), by the workspace sync, so only
what changed since moves (content hashes; big files by blocks, over the data
plane), deletions included. When ``source/python_exe`` exists (a virtual
environment in the source, ``.venv/bin/python`` by default), the meshes come
back running their procs with ``mntpoint/python_exe``, and ``monarch-tensor
exec`` puts its directory first on ``PATH``.

Monarch mounts the directory read-only through FUSE and fetches files when they
are read; here it is a copy made at connect time: every file is there before the
procs start, and nothing is fetched later. Like a read-only mount, it is no
place for output: what a host writes there is replaced or deleted at the next
connect. A mount point that holds files that no mount or sync wrote is refused
(the copy would delete them).
"""

from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass(frozen=True)
class Mount:
    source: str
    mntpoint: str
    meshes: tuple[str, ...] | None
    python_exe: str | None


def check(job, source, mntpoint, meshes, python_exe, options: dict) -> Mount:
    """The mount that ``job.remote_mount(...)`` declares, or a clear error."""
    if options:
        raise TypeError(f"remote_mount() options {sorted(options)} tune Monarch's FUSE mount, which has no "
                        f"counterpart here (the directory is copied at connect time)")
    if not isinstance(source, (str, os.PathLike)) or not os.path.isdir(source):
        raise FileNotFoundError(f"remote_mount(source={source!r}): no such local directory")
    source = os.path.abspath(os.fspath(source))
    mntpoint = source if mntpoint is None else os.fspath(mntpoint)
    if not isinstance(mntpoint, str) or not os.path.isabs(mntpoint):
        raise ValueError(f"remote_mount(mntpoint={mntpoint!r}) takes an absolute path on the hosts")
    mntpoint = os.path.normpath(mntpoint)
    if mntpoint == "/":
        raise ValueError("remote_mount(mntpoint='/') would mirror over the hosts' whole file system")
    if meshes is not None:
        if isinstance(meshes, str) or not all(isinstance(m, str) for m in meshes):
            raise TypeError(f"remote_mount(meshes=...) takes a list of mesh names, got {meshes!r}")
        unknown = [m for m in meshes if m not in job.meshes]
        if unknown:
            raise ValueError(f"remote_mount(meshes={list(meshes)}): the job has no mesh {unknown[0]!r}; its meshes "
                             f"are {list(job.meshes)}")
        meshes = tuple(meshes)
    if python_exe is not None and (not isinstance(python_exe, str) or os.path.isabs(python_exe)):
        raise ValueError(f"remote_mount(python_exe={python_exe!r}) is a path relative to the mount point "
                         f"(None: the procs keep their interpreter)")
    return Mount(source, mntpoint, meshes, python_exe)


def apply(job, state) -> None:
    """Mirror each of ``job``'s mounts onto the hosts of its meshes (helper procs, stopped after), and point
    the meshes of ``state`` at the mount's interpreter where the source has one."""
    from ..hosts.remote_hosts import RemoteHostMesh
    from ..tools.config import Workspace
    from ..workspace_sync import _sync

    for m in getattr(job, "_mounts", ()):
        names = list(m.meshes or job.meshes)
        agents = [a for name in names for a in state._meshes[name]._agents]
        helpers = RemoteHostMesh(agents).spawn_procs(name="remote-mount")
        try:
            _sync(helpers._procs, Workspace(dirs={m.source: ""}), False, root_var=m.mntpoint)
        finally:
            helpers.stop()
        if m.python_exe and os.path.exists(os.path.join(m.source, m.python_exe)):
            exe = os.path.join(m.mntpoint, m.python_exe)
            for name in names:
                mesh = state._meshes[name].with_python_executable(exe)
                state._meshes[name] = mesh
                setattr(state, name, mesh)
