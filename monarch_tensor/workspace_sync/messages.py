"""The workspace-sync protocol, client -> procs; handlers are in ``workspace_sync/_proc.py``.

A sync is three rounds: ``DescribeWorkspace`` to every proc (once per mesh:
which host and root each proc has), ``ScanWorkspace``, ``DiffWorkspace`` then
``WriteFiles`` to one writer proc per distinct root, and ``ReloadWorkspace``
to every proc.
Replies are ``SendToPort`` values (``WorkspaceDiff``, tuples), keyed by the ``slot`` of the message that
asked: the proc's place in the client's request (a host mesh's sync asks the procs of several meshes at
once, and their ranks repeat).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..transport.messages import PortRef, _fast_reduce


@_fast_reduce
@dataclass(frozen=True, slots=True)
class DescribeWorkspace:
    """Client -> proc: reply ``(hostname, workspace root)`` for this client (``client_key``).

    ``root_var`` (in every message that names a root): "" for the workspace root, else the environment
    variable whose value is the root (``CONDA_PREFIX``: the proc's conda environment, ``conda=True``).
    """

    client_key: str
    reply: PortRef
    root_var: str = ""
    slot: int = 0


@_fast_reduce
@dataclass(frozen=True, slots=True)
class ScanWorkspace:
    """Client -> writer proc, just before it scans its own dirs: scan the root under ``dirs`` now, for the
    ``DiffWorkspace`` of ``sync_id`` that follows (the two scans run at once). No reply."""

    sync_id: str
    client_key: str
    dirs: tuple[str, ...]
    root_var: str = ""


@_fast_reduce
@dataclass(frozen=True, slots=True)
class DiffWorkspace:
    """Client -> writer proc: compare ``manifest`` ({key: (size, mtime_ns, mode)}) with the root under ``dirs``.

    ``sources``: the client's source dirs as ``(absolute path, st_dev, st_ino)``; a writer that sees
    the same directories there says so (``WorkspaceDiff.local``) and may be sent files to copy by path.
    """

    sync_id: str
    client_key: str
    dirs: tuple[str, ...]
    manifest: dict
    reply: PortRef
    sources: tuple = ()
    root_var: str = ""
    slot: int = 0


@_fast_reduce
@dataclass(frozen=True, slots=True)
class WriteFiles:
    """Client -> writer proc: apply ``ops`` to the root; the message with ``last`` commits and replies.

    Ops are tuples: ``("w", key, offset, buffer, patch)`` write bytes; ``("C", key, path, size,
    mtime_ns, mode)`` copy a whole file of the client's (a writer that sees its sources) from ``path`` and
    finish it; ``("P", key, buf, size, mtime_ns, mode)`` pull a whole file (``buf``: an ``RDMABuffer`` of
    it) and finish it; ``("r", key, offset, buf, n, patch)`` pull bytes; ``("f", key, size, mtime_ns, mode,
    patch)`` finish a file; ``("t", key,
    mtime_ns, mode)`` same content, new metadata; ``("d", key)`` delete; ``("x", key, size)``: the file
    just finished is the client's file of ``size`` bytes with its prefix rewritten (a conda environment
    synced to another path), to be taken as unchanged while its mtime stays.
    ``scan_ns`` is the client's clock when it scanned (for the racy rule).
    """

    sync_id: str
    client_key: str
    dirs: tuple[str, ...]
    ops: tuple
    scan_ns: int
    last: bool
    reply: PortRef | None
    root_var: str = ""
    slot: int = 0


@_fast_reduce
@dataclass(frozen=True, slots=True)
class ReloadWorkspace:
    """Client -> every proc: put the synced dirs on sys.path; the modules of ``changed`` files are stale
    (``_reload.note_changed``); with ``auto_reload``, re-import every stale one."""

    client_key: str
    dirs: tuple[str, ...]
    changed: tuple[str, ...]
    auto_reload: bool
    reply: PortRef
    slot: int = 0


@_fast_reduce
@dataclass(frozen=True, slots=True)
class WorkspaceDiff:
    """Writer -> client (a reply value): what to send, verify by hash, patch by blocks, delete."""

    send: tuple[str, ...]
    verify: dict  # key -> remote fingerprint (digest, or block digests for large files)
    blocks: dict  # key -> remote block digests, for large files to patch
    delete: tuple[str, ...]
    root: str
    local: bool = False  # this writer sees the client's source dirs: files may be copied by path
    same: bool = False  # the root is the client's source dir itself (nothing to do)
