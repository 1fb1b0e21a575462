"""Workspace sync, the client side: ``await proc_mesh.sync_workspace(workspace, auto_reload=True)``.

1. Ask each proc (once per proc; an ``env.set`` of ``WORKSPACE_DIR`` tells without
   asking) for its host and workspace root; procs sharing a root form a group,
   served by one writer proc.
2. Scan the local dirs (size, mtime, mode per file) while the writers scan their
   roots (``ScanWorkspace``), or while procs not known yet answer step 1, and send
   that manifest to every writer; each replies with what differs (``_sync_proc.diff``).
3. Hash locally only the files the writer asked to verify; send whole files,
   changed blocks of large files, metadata-only updates and deletions in
   ``WriteFiles`` messages of up to ``CHUNK`` bytes, all writers at once.
   Files of ``PULL_MIN`` bytes and more do not ride in the messages to writers
   on other hosts: the client maps each once as an ``RDMABuffer`` and those
   writers pull the bytes (whole, or the changed blocks) over the data plane
   (``rdma/``: its TCP streams across hosts; cross-memory attach when
   ``PULL_SAME_HOST`` makes writers of this host pull too), until ``PULL_MAX``
   bytes are registered; the buffers are dropped when every writer has committed.
   A writer that sees the client's source dirs itself (this host, same directories:
   ``WorkspaceDiff.local``) is sent no bytes of whole files of ``INBAND`` bytes and more,
   only their paths: it copies them in the kernel, two at a time, while it takes its
   next messages (``COPY_LOCAL``; ``_sync_proc._Copies``).
4. Every proc puts the dirs on ``sys.path`` and, with ``auto_reload``,
   re-imports the changed modules.

With ``conda=True`` the conda environment is mirrored first, the same way, onto each host's
``$CONDA_PREFIX`` (``sync_env``).

>>> ws = Workspace(dirs=["./my_project"])
>>> result = await procs.sync_workspace(ws, auto_reload=True)  # doctest: +SKIP
>>> result.files_sent, result.bytes_sent  # doctest: +SKIP
(1, 213)
"""

from __future__ import annotations

import hashlib
import logging
import mmap
import os
import pickle
import re
import socket
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field

from .. import _seams
from ..config import setting
from ..future import Future, ThreadFuture
from ..tools.config.workspace import Workspace
from ..transport._ports import Collector
from ..transport.mailbox import current_mailbox
from . import _filetree
from . import _proc as _sync_proc
from .messages import DescribeWorkspace, DiffWorkspace, ReloadWorkspace, ScanWorkspace, WorkspaceDiff, WriteFiles

log = logging.getLogger("monarch_tensor.workspace_sync")

SYNC_TIMEOUT = _sync_proc.SYNC_TIMEOUT  # seconds ($MONARCH_TENSOR_SYNC_TIMEOUT), the procs' too
CHUNK = 8 << 20  # bytes of file data per WriteFiles message
FIRST_CHUNK = 1 << 20  # ... in a writer's first one, sent early so that it starts while the rest is planned
PULL_MIN = setting("MONARCH_TENSOR_SYNC_PULL_MIN")  # bytes: bigger files go on the data plane
INBAND = 64 << 10  # bytes: smaller file data rides inside a message's body, not as one frame per file
PULL_MAX = 2 << 30  # bytes registered for pulls at once in one sync; further files ride in messages
# Writers on this client's own host that cannot copy the files themselves (COPY_LOCAL below) get every
# file in the messages, which travel through shared memory there: bench/sync_bench.py measured that 1.3x
# faster than pulling (the pull's cross-memory read and the file write both run in the writer; the
# messages' copy runs in the client, in parallel).
PULL_SAME_HOST = setting("MONARCH_TENSOR_SYNC_PULL_SAME_HOST")
# A writer that sees the client's source dirs (same host and file system) copies whole files of INBAND
# bytes and more from them itself, two at a time: one kernel copy per byte, no message or pull at all.
COPY_LOCAL = setting("MONARCH_TENSOR_SYNC_COPY_LOCAL")

_roots: dict[tuple[str, str], tuple[str, str]] = {}  # (proc addr, root variable) -> (hostname, root)


@dataclass
class SyncResult:
    """What one sync did: files written (whole or patched), bytes of file data sent, deletions, reloads."""

    files_sent: int = 0
    bytes_sent: int = 0  # file data to every writer, in messages or pulled
    bytes_pulled: int = 0  # the part of bytes_sent the writers pulled over the data plane
    bytes_copied: int = 0  # the part of bytes_sent the writers copied from this host's files themselves
    unchanged: int = 0
    deleted: int = 0
    roots: list[str] = field(default_factory=list)
    changed: list[str] = field(default_factory=list)
    # proc rank -> modules; (proc mesh, rank) -> modules where the procs synced are several meshes' (a
    # host mesh's sync, the procs it spawned on hosts where none ran included: ranks repeat), ``_proc_keys``
    reloaded: dict = field(default_factory=dict)
    seconds: float = 0.0
    # Where the seconds went, in order: "roots" (asking procs not seen before for their host and root,
    # while this process scans its dirs), "diff" (scanning here and at the writers, and comparing),
    # "write" (every writer's files written and committed), "reload" (every proc's sys.path and changed
    # modules). Empty when no proc ran yet.
    phases: dict[str, float] = field(default_factory=dict)
    conda: SyncResult | None = None  # with ``conda=True``: the environment's own sync (its roots: $CONDA_PREFIX)


def forget_roots(addrs, root_var: str = "") -> None:
    """Drop what is known of these procs' roots (their ``WORKSPACE_DIR``, or ``root_var``, changed)."""
    for a in addrs:
        _roots.pop((a, root_var), None)


def learn_roots(addr: str, roots: dict) -> None:
    """``{root_var: (hostname, root)}`` of the proc at ``addr``, as it answered a ``DescribeWorkspace`` or an
    ``env.set`` that moved them (``_sync_proc.where``): syncs ask it no more (``_describe``)."""
    for root_var, where in roots.items():
        _roots[(addr, root_var)] = tuple(where)


def check_workspace(workspace) -> None:
    """Raise a TypeError unless ``workspace`` is a ``Workspace`` (a path is not one), then check its dirs."""
    if not isinstance(workspace, Workspace):
        raise TypeError(f"sync_workspace needs a Workspace, got {workspace!r}")
    workspace.check()


def sync_workspace(procs: list, workspace: Workspace, auto_reload: bool = False,
                   spawn_helpers=None, conda: bool = False) -> Future[SyncResult]:
    """Sync ``workspace`` to the roots of ``procs`` (``ProcInfo``s); see the module docstring.
    ``spawn_helpers()``, when given, makes a proc mesh on the hosts where no proc runs yet: it is called in
    the sync's thread, synced through with ``procs``, and stopped before the result is set. ``conda``: first
    mirror the conda environment too (``conda_prefix``; ``sync_env``)."""
    check_workspace(workspace)
    prefix = conda_prefix(workspace) if conda else None
    fut: Future[SyncResult] = ThreadFuture("workspace sync")

    def run() -> None:
        helpers = None
        try:
            if spawn_helpers is not None:
                helpers = spawn_helpers()
            targets = [p for p in procs if p.alive] + (list(helpers._procs) if helpers is not None else [])
            env, ws = None, workspace
            if prefix is not None:
                ws, editables = with_editables(workspace, prefix)
                env = sync_env(targets, prefix, editables)
            result = _sync(targets, ws, auto_reload)
            result.conda = env
        except BaseException as e:  # noqa: BLE001 - surfaces on .get() / await
            _stop(helpers)
            fut._set_exception(e)
            return
        _stop(helpers)
        fut._set_result(result)

    threading.Thread(target=run, daemon=True, name="monarch-tensor-sync").start()
    return fut


def _stop(helpers) -> None:
    if helpers is None:
        return
    try:
        helpers.stop().get(timeout=SYNC_TIMEOUT)
    except Exception as e:  # noqa: BLE001 - the sync's outcome stands; the procs' hosts reap them
        log.warning("stopping the workspace sync's helper procs: %r", e)


def conda_prefix(workspace: Workspace) -> str:
    """The conda environment that ``sync_workspace(..., conda=True)`` mirrors: the workspace's
    (``Workspace(env=CondaEnvironment(prefix))``), else the active one (``$CONDA_PREFIX``), as an absolute
    path; a clear error when there is none or it is no directory."""
    env = workspace.env
    if env is None:
        prefix = os.environ.get("CONDA_PREFIX")
        if not prefix:
            raise ValueError("sync_workspace(conda=True): no conda environment is active ($CONDA_PREFIX is not "
                             "set) and the Workspace names none (Workspace(..., env=CondaEnvironment(path)))")
    elif isinstance(getattr(type(env), "conda_prefix", None), property):  # a CondaEnvironment (ours or alike)
        prefix = env.conda_prefix
    else:
        raise TypeError(f"Workspace(env=...) must be a CondaEnvironment to sync it, got {env!r}")
    path = os.path.abspath(prefix)
    if not os.path.isdir(path):
        raise FileNotFoundError(f"conda environment {prefix} does not exist or is not a directory")
    return path


def editable_installs(prefix: str) -> list[tuple[str, str]]:
    """``(project name, source dir)`` of each editable install (``pip install -e``) in the environment at
    ``prefix``, from the ``direct_url.json`` of its ``site-packages`` (PEP 610)."""
    import glob
    import json
    from urllib.parse import unquote, urlparse

    out, seen = [], set()
    for direct in sorted(glob.glob(os.path.join(prefix, "lib", "python*", "site-packages", "*.dist-info",
                                                "direct_url.json"))):
        real = os.path.realpath(direct)  # (lib/python3 may be a link to lib/python3.11)
        if real in seen:
            continue
        seen.add(real)
        try:
            with open(direct) as f:
                info = json.load(f)
        except (OSError, ValueError):
            continue
        url = urlparse(info.get("url", "")) if isinstance(info, dict) else None
        if url is None or not (info.get("dir_info") or {}).get("editable") or url.scheme != "file":
            continue
        path = unquote(url.path)
        if not os.path.isdir(path):
            continue
        name = os.path.basename(os.path.dirname(direct)).rsplit("-", 1)[0]
        try:
            with open(os.path.join(os.path.dirname(direct), "METADATA")) as f:
                for line in f:
                    if line.startswith("Name:"):
                        name = line[5:].strip()
                        break
        except OSError:
            pass
        out.append((name, os.path.abspath(path)))
    return out


def with_editables(workspace: Workspace, prefix: str) -> tuple[Workspace, list[tuple[str, str]]]:
    """``workspace`` plus the source dirs of the environment's editable installs, each at
    ``__editable__.<name>`` unless the workspace has it already; and ``(source dir, remote dir)`` of each."""
    dirs = {str(k): v for k, v in workspace.dirs.items()}
    editables = []
    for name, path in editable_installs(prefix):
        if path not in dirs:
            dirs[path] = f"__editable__.{name}"
        editables.append((path, dirs[path]))
    if len(dirs) == len(workspace.dirs):
        return workspace, editables
    return Workspace(dirs=dirs, env=workspace.env), editables


def sync_env(procs: list, prefix: str, editables: list[tuple[str, str]] = ()) -> SyncResult:
    """Mirror the conda environment at ``prefix`` onto each host's ``$CONDA_PREFIX`` (that of its procs,
    which must have it set): only what changed moves, as for a workspace. Where a host's prefix is another
    path, text files that name this one are rewritten to name that one (binary files are copied as they
    are), and those that name the source dir of an editable install (``editables``: (source dir, remote
    dir), synced with the workspace) name its place in the host's workspace root. A host that sees this
    very directory at its prefix (the same file system, as a LocalJob's hosts on this machine) has nothing
    to do. Nothing is reloaded: procs pick up changed packages when they import them first, or when they
    reload them."""
    def forms(path: str) -> set[str]:
        return {path, os.path.realpath(path)}  # (as named, and resolved)

    if editables:
        _describe(procs, "")  # the workspace roots, where the editable installs go

    def rewrites(w, root: str) -> dict[bytes, bytes] | None:
        to = {f: root for f in forms(prefix)}
        for path, remote in editables:
            ws_root = _roots[(w.addr, "")][1]
            to.update({f: os.path.join(ws_root, remote) if remote else ws_root for f in forms(path)})
        out = {os.fsencode(k): os.fsencode(v) for k, v in to.items() if k != v}
        return out or None

    return _sync(procs, Workspace(dirs={prefix: ""}), False, root_var="CONDA_PREFIX", rewrite=rewrites,
                 guard=prefix)


def _refuse_own_env(roots: list, prefix: str) -> None:
    """Refuse to mirror ``prefix`` over this script's own environment (a proc of this host whose
    ``$CONDA_PREFIX`` is the active environment or this interpreter's, when another one is synced)."""
    own = {os.path.realpath(p) for p in (os.environ.get("CONDA_PREFIX"), sys.prefix) if p}
    here = socket.gethostname()
    for host, root in roots:
        if host == here and os.path.realpath(root) in own:
            raise ValueError(f"sync_workspace(conda=True) would mirror {prefix} over {root}, the environment this "
                             f"script runs in (the $CONDA_PREFIX of procs on this host): set the procs' "
                             f"CONDA_PREFIX to another directory, or sync the active environment")


def _proc_keys(procs: list) -> list:
    """How a result names each of ``procs`` (``SyncResult.reloaded``): by rank where they are one proc
    mesh's, by ``(proc mesh, rank)`` where they are several meshes' (a host mesh's sync), whose ranks repeat."""
    if len({id(p.owner) for p in procs}) <= 1:
        return [p.rank for p in procs]
    return [(p.owner, p.rank) for p in procs]


def _collector(procs: list, what: str) -> Collector:
    """Waits for a reply from each of ``procs``, keyed by its place in the list (the ``slot`` of the message
    it answers), not by rank: the procs of a host mesh's sync are several meshes', whose ranks repeat."""
    return Collector([p.addr for p in procs], list(range(len(procs))), list, what)


def _ask(procs: list, make, what: str, why_late: str = "") -> list:
    """``_ask_start``'s replies, waited for up to ``SYNC_TIMEOUT``; a timeout names the procs that did not
    answer, and ``why_late`` says what may keep them."""
    col = _collector(procs, what)
    try:
        return _ask_start(procs, make, what, col).get(timeout=SYNC_TIMEOUT)
    except TimeoutError:
        keys = _proc_keys(procs)
        late = [keys[i] for i in sorted(col._by_rank)]  # (the slots still waited for)
        raise TimeoutError(f"no {what} from the proc(s) of rank {late} within {SYNC_TIMEOUT} s "
                           f"(MONARCH_TENSOR_SYNC_TIMEOUT){': ' + why_late if why_late else ''}") from None


def _ask_start(procs: list, make, what: str, col: Collector | None = None) -> Future[list]:
    """Send ``make(port, slot)`` to each proc (``slot``: its place in ``procs``, which keys its reply); a
    Future of their replies, in order."""
    mailbox = current_mailbox()
    if col is None:
        col = _collector(procs, what)
    port = mailbox.open_port(col)
    for p in procs:
        # A proc that died before the port opened never fails it (its death was told to the ports open
        # then): the sync waited its whole timeout, and the error did not name the proc.
        err = mailbox.death_of(p.addr)
        if err is not None:
            col.proc_died(p.addr, err)
            return col.future
    for slot, p in enumerate(procs):
        mailbox.send(p.addr, make(port, slot))
    return col.future


class _Sources:
    """``sources[key]``: the local path of a manifest key, made when asked (a sync reads few of them)."""

    def __init__(self) -> None:
        self._dirs: list[tuple[str, str, dict]] = []  # (prefix, local dir, its scan), later dirs win

    def add(self, prefix: str, src: str, scanned: dict) -> None:
        self._dirs.append((prefix, src, scanned))

    def __getitem__(self, key: str) -> str:
        for prefix, src, scanned in reversed(self._dirs):
            if key in scanned:
                return os.path.join(src, key[len(prefix):])
        raise KeyError(key)


def local_manifest(workspace: Workspace) -> tuple[dict, _Sources]:
    """``({key: (size, mtime_ns, mode)}, sources)`` of the workspace dirs (``sources[key]``: its local path)."""
    manifest: dict = {}
    sources = _Sources()
    for src, dst in workspace.dirs.items():
        prefix = f"{dst}/" if dst else ""
        scanned = _filetree.scan(str(src), prefix)
        manifest.update(scanned)
        sources.add(prefix, str(src), scanned)
    return manifest, sources


def _source_ids(workspace: Workspace) -> tuple:
    """``(absolute path, st_dev, st_ino)`` of each source dir (a writer that sees the same may copy)."""
    out = []
    for src in workspace.dirs:
        path = os.path.abspath(str(src))
        try:
            st = os.stat(path)
        except OSError:
            return ()
        out.append((path, st.st_dev, st.st_ino))
    return tuple(out)


class _Batcher:
    """Packs ops into ``WriteFiles`` messages of about ``CHUNK`` bytes (carried or to pull) for one writer
    (``slot``: the key of its reply)."""

    def __init__(self, send, sync_id: str, key: str, dirs: tuple, scan_ns: int, root_var: str = "",
                 slot: int = 0) -> None:
        self.send, self.sync_id, self.key, self.dirs, self.scan_ns = send, sync_id, key, dirs, scan_ns
        self.root_var, self.slot = root_var, slot
        self.ops: list = []
        self.nbytes = 0
        self.limit = FIRST_CHUNK
        self.files = self.bytes = self.pulled = self.copied = 0

    def add(self, op: tuple, nbytes: int = 0, copy: bool = False) -> None:
        """``op`` moves ``nbytes`` of file data; ``copy``: a whole-file copy (``"C"``), whose bytes the
        writer's lanes move while it takes its next messages: they count toward the first message only
        (sent early, so that the lanes start), not toward later ones (a message per ``CHUNK`` of copies
        cost the writer's mailbox thread a core that the lanes wanted, and started them later)."""
        self.ops.append(op)
        self.bytes += nbytes
        if not copy or self.limit == FIRST_CHUNK:
            self.nbytes += nbytes
        if self.nbytes >= self.limit:
            self.flush(last=False, reply=None)

    def flush(self, last: bool, reply) -> None:
        self.send(WriteFiles(self.sync_id, self.key, self.dirs, tuple(self.ops), self.scan_ns, last, reply,
                             self.root_var, self.slot))
        self.ops, self.nbytes, self.limit = [], 0, CHUNK


class _Pulls:
    """Large files mapped read-only (no copy here) as buffers that every writer pulls; dropped after the sync.

    A file that changes during the sync gives the writers a mix of versions and
    a different mtime than the one recorded for it, so the next sync sends it
    again; one truncated meanwhile fails the transfer (EFAULT), never this process.
    """

    def __init__(self) -> None:
        self.bufs: dict[str, object] = {}
        self.maps: list[mmap.mmap] = []
        self.nbytes = 0

    def buffer(self, key: str, path: str):
        """The ``RDMABuffer`` of ``key``'s content, or None (small, empty, or over ``PULL_MAX``)."""
        if key in self.bufs:
            return self.bufs[key]
        RDMABuffer = _seams.get("RDMABuffer")

        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size < max(PULL_MIN, 1) or self.nbytes + size > PULL_MAX:
                return None
            # MAP_POPULATE: the page tables are filled here, not page by page inside the writers' reads
            mapped = mmap.mmap(f.fileno(), size, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0),
                               prot=mmap.PROT_READ)
        self.maps.append(mapped)
        buf = self.bufs[key] = RDMABuffer(memoryview(mapped))
        self.nbytes += size
        return buf

    def drop(self) -> None:
        for buf in self.bufs.values():
            buf.drop()
        self.bufs.clear()
        for mapped in self.maps:
            try:
                mapped.close()
            except BufferError:  # a view is still alive somewhere: the mapping goes with it
                pass
        self.maps.clear()


def _ranges(blocks: list[int], size: int) -> list[tuple[int, int]]:
    """(offset, length) runs of consecutive ``BLOCK``-sized blocks, clipped to ``size``."""
    out: list[list[int]] = []
    for i in blocks:
        off = i * _filetree.BLOCK
        n = min(_filetree.BLOCK, size - off)
        if n <= 0:
            continue
        if out and out[-1][0] + out[-1][1] == off:
            out[-1][1] += n
        else:
            out.append([off, n])
    return [(o, n) for o, n in out]


def _carried(data: bytes):
    """File data for a message: a small piece inside the pickle body, a larger one as its own buffer
    (its own frame, or in shared memory) that is never copied into the body."""
    return data if len(data) < INBAND else pickle.PickleBuffer(data)


def _send_file(b: _Batcher, key: str, path: str, mtime_ns: int, mode: int, blocks: list[int] | None,
               pulls: _Pulls | None = None, copy: bool = False) -> None:
    """Whole file (``blocks`` None) or only the given blocks of it, then the op that finishes it
    (``copy``: the writer sees this file and copies a whole one of ``INBAND`` bytes or more itself)."""
    if copy and blocks is None:
        size = os.stat(path).st_size
        if size >= INBAND:
            b.copied += size
            b.add(("C", key, os.path.abspath(path), size, mtime_ns, mode), size, copy=True)
            b.files += 1
            return
    buf = pulls.buffer(key, path) if pulls is not None else None
    if buf is not None:
        size = buf.size()
        b.files += 1
        if blocks is None:  # pulled and finished on the writer's lanes, while it takes the next messages
            b.pulled += size
            b.add(("P", key, buf, size, mtime_ns, mode), size)  # counts toward CHUNK: writers start early
            return
        for off, n in _ranges(blocks, size):
            b.pulled += n
            b.add(("r", key, off, buf, n, True), n)
        b.add(("f", key, size, mtime_ns, mode, True))
        return
    with open(path, "rb", buffering=0) as f:
        size = os.fstat(f.fileno()).st_size
        if blocks is None:
            off = 0
            while off < size:  # reads of exactly what is left: read(CHUNK) would allocate CHUNK for a small file
                data = f.read(min(CHUNK, size - off))
                if not data:
                    break
                b.add(("w", key, off, _carried(data), False), len(data))
                off += len(data)
            size = off
        else:
            for i in blocks:
                f.seek(i * _filetree.BLOCK)
                data = f.read(_filetree.BLOCK)
                if data:
                    b.add(("w", key, i * _filetree.BLOCK, _carried(data), True), len(data))
    b.add(("f", key, size, mtime_ns, mode, blocks is not None))
    b.files += 1


def _rewrite_text(path: str, rewrite: dict[bytes, bytes]) -> tuple[bytes, bytes] | None:
    """``(content, content with each path of ``rewrite`` replaced by its value)`` when ``path`` is a text
    file (no NUL byte) that names one of them, else None (binary files keep their length)."""
    with open(path, "rb") as f:
        data = f.read(8192)
        if b"\0" in data:
            return None
        data += f.read()
    if b"\0" in data or not any(p in data for p in rewrite):
        return None
    pattern = re.compile(b"|".join(re.escape(p) for p in sorted(rewrite, key=len, reverse=True)))
    return data, pattern.sub(lambda m: rewrite[m.group(0)], data)


def _rewritten(b: _Batcher, key: str, path: str, mtime_ns: int, mode: int, rewrite: dict) -> bool:
    """Send ``key`` whole, rewritten (``_rewrite_text``), when it needs it; whether it did."""
    got = _rewrite_text(path, rewrite)
    if got is None:
        return False
    data, new = got
    b.add(("w", key, 0, _carried(new), False), len(new))
    b.add(("f", key, len(new), mtime_ns, mode, False))
    b.add(("x", key, len(data)))
    b.files += 1
    return True


def _same_rewritten(path: str, size: int, theirs, rewrite: dict) -> bool:
    """Whether the writer's file (``theirs``: its fingerprint, taken at our file's ``size``) is our file
    rewritten for it (a file written so in an earlier sync, whose mtime alone changed, or that was racy)."""
    got = _rewrite_text(path, rewrite)
    if got is None:
        return False
    new = got[1]
    if size >= _filetree.LARGE:
        ours = [hashlib.sha256(new[o:o + _filetree.BLOCK]).digest() for o in range(0, len(new), _filetree.BLOCK)]
    else:
        ours = hashlib.sha256(new).digest()
    return ours == theirs


def plan(b: _Batcher, diff: WorkspaceDiff, manifest: dict, sources: _Sources,
         pulls: _Pulls | None = None, copy: bool = False, rewrite: dict | None = None) -> list[str]:
    """Turn a writer's diff into ops on ``b``; return the keys whose content changes (``copy``: the
    writer copies whole files from ``sources`` itself; ``rewrite``: {path here: path there} for text
    files that name one of these paths, sent whole naming the writer's instead)."""
    changed = []
    for key in diff.send:
        _, mtime_ns, mode = manifest[key]
        changed.append(key)
        if rewrite is not None and _rewritten(b, key, sources[key], mtime_ns, mode, rewrite):
            continue
        theirs = diff.blocks.get(key)
        blocks = _filetree.changed_blocks(sources[key], theirs) if theirs is not None else None
        _send_file(b, key, sources[key], mtime_ns, mode, blocks, pulls, copy)
    for key, theirs in diff.verify.items():
        size, mtime_ns, mode = manifest[key]
        ours = _filetree.fingerprint(sources[key], size)
        if ours == theirs or (rewrite is not None and _same_rewritten(sources[key], size, theirs, rewrite)):
            b.add(("t", key, mtime_ns, mode))
            continue
        changed.append(key)
        if rewrite is not None and _rewritten(b, key, sources[key], mtime_ns, mode, rewrite):
            continue
        blocks = None
        if isinstance(theirs, list):
            blocks = [i for i, d in enumerate(ours) if i >= len(theirs) or theirs[i] != d]
        _send_file(b, key, sources[key], mtime_ns, mode, blocks, pulls, copy)
    for key in diff.delete:
        b.add(("d", key))
        changed.append(key)
    return changed


def _describe(procs: list, root_var: str) -> None:
    """Learn the host and root of each proc not asked yet (``_roots``)."""
    _describe_finish(_describe_start(procs, root_var))


def _describe_start(procs: list, root_var: str) -> tuple | None:
    """Ask each proc whose root is not known yet (neither asked nor told by ``env.set``: ``learn_roots``);
    None when there is none. ``_describe_finish`` waits for the answers."""
    unknown = [p for p in procs if (p.addr, root_var) not in _roots]
    if not unknown:
        return None
    key = _sync_proc.client_key(current_mailbox().addr)
    return unknown, root_var, _ask_start(unknown, lambda port, slot: DescribeWorkspace(key, port, root_var, slot),
                                         "workspace roots")


def _describe_finish(asked: tuple | None) -> None:
    if asked is not None:
        unknown, root_var, fut = asked
        for p, where in zip(unknown, fut.get(timeout=SYNC_TIMEOUT)):
            learn_roots(p.addr, {root_var: where})


def _writers(procs: list, root_var: str) -> list:
    """One proc per root (the first of the procs that share it): it compares and writes for them all."""
    groups: dict[tuple[str, str], object] = {}
    for p in procs:
        groups.setdefault(_roots[(p.addr, root_var)], p)
    return list(groups.values())


def _sync(procs: list, workspace: Workspace, auto_reload: bool, root_var: str = "",
          rewrite=None, guard: str | None = None) -> SyncResult:
    """One sync of ``workspace`` to the roots of ``procs``: their workspace roots, or (``root_var``) the
    directories their environment variable names (``sync_env``: no reload then). ``rewrite(writer, root)``:
    {path here: path there} for the text files that writer gets (or None); ``guard``: the environment
    synced, refused over this script's own (``_refuse_own_env``)."""
    t0 = time.perf_counter()
    mailbox = current_mailbox()
    key = _sync_proc.client_key(mailbox.addr)
    dirs = tuple(workspace.dirs.values())
    result = SyncResult()
    sync_id = uuid.uuid4().hex[:12]
    asked = _describe_start(procs, root_var)
    if asked is None:  # the writers are known: they scan their roots while this process scans the dirs
        writers = _writers(procs, root_var)
        for w in writers:
            mailbox.send(w.addr, ScanWorkspace(sync_id, key, dirs, root_var))
        t1 = time.perf_counter()
    scan_ns = time.time_ns()
    manifest, sources = local_manifest(workspace)  # (while procs not seen before say where their roots are)
    if asked is not None:
        _describe_finish(asked)
        writers = _writers(procs, root_var)  # (each scans its root when the diff comes)
        t1 = time.perf_counter()
    where = _source_ids(workspace) if COPY_LOCAL or root_var else ()
    diffs: list[WorkspaceDiff] = _ask(
        writers, lambda port, slot: DiffWorkspace(sync_id, key, dirs, manifest, port, where, root_var, slot),
        "workspace diff") if writers else []
    t2 = time.perf_counter()
    busy = [(w, d) for w, d in zip(writers, diffs) if not d.same]  # (a root that is the source: nothing to do)
    if guard is not None:
        _refuse_own_env([_roots[(w.addr, root_var)] for w, _ in busy], guard)
    result.roots = [d.root for d in diffs if d.same]
    col = _collector([w for w, _ in busy], "workspace write")
    port = mailbox.open_port(col)
    changed: set[str] = set()
    pulls = _Pulls()
    try:
        for slot, (w, diff) in enumerate(busy):
            b = _Batcher(lambda msg, addr=w.addr: mailbox.send(addr, msg), sync_id, key, dirs, scan_ns, root_var,
                         slot)
            host, root = _roots[(w.addr, root_var)]
            remote = PULL_SAME_HOST or host != socket.gethostname()
            copy = diff.local and not PULL_SAME_HOST
            rw = rewrite(w, root) if rewrite is not None else None
            changed.update(plan(b, diff, manifest, sources, pulls if remote and not copy else None, copy, rw))
            b.flush(last=True, reply=port)
            result.files_sent += b.files
            result.bytes_sent += b.bytes
            result.bytes_pulled += b.pulled
            result.bytes_copied += b.copied
            result.deleted = max(result.deleted, len(diff.delete))
        for diff in diffs:
            result.unchanged = max(result.unchanged, len(manifest) - len(diff.send) - len(diff.verify))
        result.roots += col.future.get(timeout=SYNC_TIMEOUT) if busy else []
    finally:
        pulls.drop()
        if not busy:
            mailbox.close_port(port.port_id)
    t3 = time.perf_counter()
    result.changed = sorted(changed)
    if procs and not root_var:
        names = tuple(sorted(k for k in changed if k.endswith(".py")))  # (stale until reloaded, see _reload)
        replies = _ask(procs, lambda port, slot: ReloadWorkspace(key, dirs, names, auto_reload, port, slot),
                       "workspace reload", "the files are written on every host, but a proc takes a sync's reload "
                       "between its actors' calls of synchronous endpoints (an async endpoint waiting at an await "
                       "lets it in, and goes on in the new code), and these still run one (a long endpoint, or a "
                       "rank paused in the debugger); each reloads when its call returns")
        result.reloaded = dict(zip(_proc_keys(procs), replies))
    t4 = time.perf_counter()
    result.seconds = t4 - t0
    result.phases = {"roots": t1 - t0, "diff": t2 - t1, "write": t3 - t2, "reload": t4 - t3}
    return result


def sync_local(workspace: Workspace) -> SyncResult:
    """Sync into this client's own default root on this host (when no proc is running yet)."""
    t0 = time.perf_counter()
    check_workspace(workspace)
    key = _sync_proc.client_key(current_mailbox().addr)
    root = _sync_proc.workspace_root(key)
    dirs = tuple(workspace.dirs.values())
    scan_ns = time.time_ns()
    manifest, sources = local_manifest(workspace)
    diff = _sync_proc.diff(root, dirs, manifest)
    writer = _filetree.Writer(root)
    msgs: list[WriteFiles] = []
    b = _Batcher(msgs.append, "local", key, dirs, scan_ns)
    changed = plan(b, diff, manifest, sources)
    b.flush(last=True, reply=None)
    try:
        for m in msgs:
            _sync_proc.apply_ops(writer, m.ops)
    except BaseException:
        writer.abort()
        raise
    _sync_proc.commit(root, dirs, writer.ops, scan_ns)
    return SyncResult(files_sent=b.files, bytes_sent=b.bytes,
                      unchanged=len(manifest) - len(diff.send) - len(diff.verify), deleted=len(diff.delete),
                      roots=[root], changed=sorted(changed), seconds=time.perf_counter() - t0)


def sync_this_host(procs: list, workspace: Workspace, auto_reload: bool = False,
                   conda: bool = False) -> Future[SyncResult]:
    """``this_host().sync_workspace``: sync to ``procs``, the live procs that run on this host; with none, write
    this client's own root here directly (``sync_local``), which the procs spawned here later start from."""
    check_workspace(workspace)  # on every path, as sync_workspace checks it: a path is no Workspace
    if procs:
        return sync_workspace(procs, workspace, auto_reload, conda=conda)
    try:
        prefix = conda_prefix(workspace) if conda else None
        active = os.environ.get("CONDA_PREFIX")
        if prefix is not None and not (active and os.path.samefile(prefix, active)):
            raise ValueError(f"sync_workspace(conda=True): no proc runs on this host yet to receive {prefix} "
                             f"(procs spawned here run in this script's environment, {active}); spawn "
                             "procs with CONDA_PREFIX set where it should go, then sync")
        result = sync_local(workspace)
        if prefix is not None:  # (the procs spawned here later inherit this very environment)
            result.conda = SyncResult(roots=[prefix])
        return Future.ready(result)
    except Exception as e:  # noqa: BLE001
        return Future.failed(e)

