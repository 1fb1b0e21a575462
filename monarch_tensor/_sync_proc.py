"""Workspace sync, the proc side: handlers of ``sync_messages``.

Each proc knows its host's workspace root: ``$WORKSPACE_DIR`` (Monarch's
variable; a host agent or job sets it per host) or, by default, a directory per
client session on this host. The writer proc of a root compares and writes,
in its message handlers. Large files for writers on other hosts arrive as
``RDMABuffer`` handles of the client's files and are pulled over the data
plane (``_Prefetch``, overlapping the reads with the file writes); the rest
ride in the messages. Every proc puts the synced dirs first on ``sys.path``
and re-imports changed modules (``_reload.py``).
"""

from __future__ import annotations

import dataclasses
import errno
import hashlib
import importlib
import os
import queue
import socket
import sys
import threading
import traceback
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import wait as futures_wait

from . import _filetree, _reload
from .mailbox import SYSTEM_HANDLERS, Mailbox, socket_dir
from .messages import SendToPort
from .sync_messages import DescribeWorkspace, DiffWorkspace, ReloadWorkspace, WorkspaceDiff, WriteFiles


def client_key(client_addr: str) -> str:
    """A short name for one client session (its mailbox address), used in default roots."""
    return hashlib.sha1(client_addr.encode()).hexdigest()[:12]


def default_root(key: str) -> str:
    return os.path.join(socket_dir(), f"workspace-{key}")


def workspace_root(key: str) -> str:
    """This process's workspace root for client ``key``: ``$WORKSPACE_DIR`` or the default."""
    return os.path.abspath(os.environ.get("WORKSPACE_DIR") or default_root(key))


def _rank() -> int:
    from ._proc import current_runtime

    rt = current_runtime()
    return rt.rank if rt is not None else 0


def _reply(mailbox: Mailbox, port, value=None, error: BaseException | None = None) -> None:
    if port is not None:
        mailbox.send(port.addr, SendToPort(port.port_id, value, error, _rank()))


def _failed(what: str, e: BaseException) -> Exception:
    from .errors import SyncError

    host = socket.gethostname()
    return SyncError(f"{what} failed on {host} (proc rank {_rank()}): {e!r}\n{traceback.format_exc()}")


def add_to_sys_path(root: str, dirs) -> None:
    """Put ``root/dst`` for each synced dir first on ``sys.path`` (once each, in order); ``$WORKSPACE_DIR`` = root."""
    os.environ["WORKSPACE_DIR"] = root
    for d in reversed(list(dirs)):
        p = os.path.join(root, d) if d else root
        if p in sys.path:
            if sys.path[0] == p:
                continue
            sys.path.remove(p)
        sys.path.insert(0, p)


def handle_describe(mailbox: Mailbox, msg: DescribeWorkspace) -> None:
    _reply(mailbox, msg.reply, (socket.gethostname(), workspace_root(msg.client_key)))


def diff(root: str, dirs, manifest: dict) -> WorkspaceDiff:
    """Compare the client's manifest with ``root`` (see ``_filetree`` for the rules)."""
    ours: dict[str, _filetree.Entry] = {}
    for d in dirs:
        ours.update(_filetree.scan(os.path.join(root, d) if d else root, f"{d}/" if d else ""))
    racy = set(_filetree.read_meta(root, "racy.json", []))
    send, verify, blocks = [], {}, {}
    for key, (size, mtime_ns, mode) in manifest.items():
        mine = ours.get(key)
        if mine is None:
            send.append(key)
        elif mine.size != size:
            send.append(key)
            if size >= _filetree.LARGE and mine.size >= _filetree.BLOCK:
                blocks[key] = _filetree.block_digests(os.path.join(root, key))
        elif mine.mtime_ns != mtime_ns or key in racy or mine.mode != mode:
            verify[key] = _filetree.fingerprint(os.path.join(root, key), size)
    delete = tuple(k for k in ours if k not in manifest)
    return WorkspaceDiff(tuple(send), verify, blocks, delete, root)


def sees_sources(sources) -> bool:
    """Whether this proc sees the client's source dirs (same path, device and inode): then it can copy
    the client's files itself instead of receiving their bytes."""
    if not sources:
        return False
    for path, dev, ino in sources:
        try:
            st = os.stat(path)
        except OSError:
            return False
        if (st.st_dev, st.st_ino) != (dev, ino):
            return False
    return True


def handle_diff(mailbox: Mailbox, msg: DiffWorkspace) -> None:
    try:
        root = workspace_root(msg.client_key)
        value = diff(root, msg.dirs, msg.manifest)
        if sees_sources(msg.sources):
            value = dataclasses.replace(value, local=True)
    except Exception as e:  # noqa: BLE001 - reported to the client
        _reply(mailbox, msg.reply, error=_failed("workspace diff", e))
        return
    _reply(mailbox, msg.reply, value)


SYNC_TIMEOUT = float(os.environ.get("MONARCH_TENSOR_SYNC_TIMEOUT", "120"))  # every wait of a sync, both sides
PULL_PIECE = 8 << 20  # bytes per data-plane read
PULL_SLOTS = 3  # pieces read ahead of the file writes

_local = threading.local()
_helper: tuple[int, ThreadPoolExecutor] | None = None


def _reader() -> ThreadPoolExecutor:
    global _helper
    if _helper is None or _helper[0] != os.getpid():
        _helper = (os.getpid(), ThreadPoolExecutor(1, thread_name_prefix="monarch-tensor-sync-pull"))
    return _helper[1]


class _Prefetch:
    """Reads a message's pulls, piece by piece and in order, on a helper thread into a ring of
    ``PULL_SLOTS`` buffers while the handler writes the pieces already read: the copy from the
    client and the file write run on two cores. ``next()`` gives the next piece; ``release()``
    hands its buffer back once written."""

    def __init__(self, pieces: list[tuple]) -> None:
        size = max(n for _, _, n in pieces)
        slots = getattr(_local, "slots", None)  # kept per handler thread: fresh memory costs page faults
        if slots is None or len(slots[0]) < size:
            slots = _local.slots = [memoryview(bytearray(max(size, 1 << 20))) for _ in range(PULL_SLOTS)]
        self.pieces, self.slots = pieces, slots
        self.free = threading.Semaphore(PULL_SLOTS)
        self.ready: queue.SimpleQueue = queue.SimpleQueue()
        self.stopped = False
        _reader().submit(self._run)

    def _run(self) -> None:
        for i, (buf, offset, n) in enumerate(self.pieces):
            while not self.free.acquire(timeout=0.5):
                if self.stopped:
                    return
            if self.stopped:
                return
            view = self.slots[i % PULL_SLOTS][:n]
            try:
                buf.read_into(view, offset=offset, timeout=SYNC_TIMEOUT).get(timeout=SYNC_TIMEOUT)
            except BaseException as e:  # noqa: BLE001 - raised by next() in the handler
                self.ready.put(e)
                return
            self.ready.put(view)

    def next(self) -> memoryview:
        try:
            v = self.ready.get(timeout=SYNC_TIMEOUT + 5)
        except queue.Empty:
            raise TimeoutError(f"no data-plane read finished within {SYNC_TIMEOUT + 5} s") from None
        if isinstance(v, BaseException):
            raise v
        return v

    def release(self) -> None:
        self.free.release()

    def close(self) -> None:
        self.stopped = True


def _pieces(op: tuple) -> range:
    return range(0, op[4], PULL_PIECE)


def _copy_file(src_path: str, fd: int, size: int) -> int:
    """Copy up to ``size`` bytes of ``src_path`` into ``fd`` (in the kernel where it can); the bytes copied."""
    with open(src_path, "rb", buffering=0) as src:
        s = src.fileno()
        off = 0
        try:
            while off < size:
                n = os.sendfile(fd, s, off, size - off)
                if n == 0:
                    break
                off += n
            return off
        except OSError as e:  # a file system without sendfile between these files
            if e.errno not in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
                raise
        os.lseek(s, off, 0)
        while off < size:
            chunk = os.read(s, min(PULL_PIECE, size - off))
            if not chunk:
                break
            os.pwrite(fd, chunk, off)
            off += len(chunk)
        return off


def _copy_all(w: _filetree.Writer, copies: list[tuple]) -> None:
    """The message's ``("c", key, path, size)`` ops, in two lanes (this thread and the helper): a
    file copy is a kernel copy plus page allocation on one core, so two cores copy about 1.5x faster.
    Destinations are opened here first (the Writer is not shared between threads)."""
    jobs = [(w._fd(op[1], False), op[2], op[3], op[1]) for op in copies]
    lanes: list[list] = [[], []]
    loads = [0, 0]
    for job in sorted(jobs, key=lambda j: -j[2]):
        i = 0 if loads[0] <= loads[1] else 1
        lanes[i].append(job)
        loads[i] += job[2]

    def run(lane: list) -> list:
        return [(key, _copy_file(path, fd, size)) for fd, path, size, key in lane]

    other = _reader().submit(run, lanes[1]) if lanes[1] else None
    try:
        done = run(lanes[0])
    finally:
        if other is not None:  # never leave it writing into fds that an abort closes
            futures_wait([other], timeout=SYNC_TIMEOUT)
    if other is not None:
        done += other.result(timeout=0)  # its error, or TimeoutError
    for key, n in done:
        w.copied(key, n)


def apply_ops(w: _filetree.Writer, ops) -> None:
    """Apply a message's ops in order; ``("r", key, offset, buf, n, patch)`` pulls [offset, offset + n),
    ``("c", key, path, size)`` copies a file (all of a message's copies first: distinct new files)."""
    pulls = [(op[3], op[2] + o, min(PULL_PIECE, op[4] - o)) for op in ops if op[0] == "r" for o in _pieces(op)]
    copies = [op for op in ops if op[0] == "c"]
    if copies:
        _copy_all(w, copies)
    pre = _Prefetch(pulls) if pulls else None
    try:
        for op in ops:
            kind = op[0]
            if kind == "c":
                continue
            if kind == "w":
                w.write(op[1], op[2], op[3], op[4])
            elif kind == "r":
                for o in _pieces(op):
                    w.write(op[1], op[2] + o, pre.next(), op[5])
                    pre.release()
            elif kind == "f":
                w.finish(*op[1:])
            elif kind == "t":
                w.touch(*op[1:])
            elif kind == "d":
                w.delete(op[1])
            else:
                raise ValueError(f"unknown workspace op {kind!r}")
    finally:
        if pre is not None:
            pre.close()


def commit(root: str, dirs, ops, scan_ns: int) -> None:
    """Record which files are racy (modified near this sync) and which dirs are synced."""
    racy = set(_filetree.read_meta(root, "racy.json", []))
    for op in ops:
        if op[0] == "f":
            key, mtime_ns = op[1], op[3]
        elif op[0] == "t":
            key, mtime_ns = op[1], op[2]
        else:
            if op[0] == "d":
                racy.discard(op[1])
            continue
        if _filetree.racy(mtime_ns, scan_ns):
            racy.add(key)
        else:
            racy.discard(key)
    _filetree.write_meta(root, "racy.json", sorted(racy))
    _filetree.write_meta(root, "dirs.json", list(dirs))


_writers: dict[str, _filetree.Writer] = {}
_failures: dict[str, Exception] = {}


def handle_write(mailbox: Mailbox, msg: WriteFiles) -> None:
    root = workspace_root(msg.client_key)
    if msg.sync_id not in _failures:
        w = _writers.get(msg.sync_id)
        if w is None:
            w = _writers[msg.sync_id] = _filetree.Writer(root)
        try:
            apply_ops(w, msg.ops)
            w.ops.extend(op for op in msg.ops if op[0] not in ("w", "r"))
        except Exception as e:  # noqa: BLE001
            w.abort()
            _failures[msg.sync_id] = _failed("workspace write", e)
    if not msg.last:
        return
    w = _writers.pop(msg.sync_id, None)
    err = _failures.pop(msg.sync_id, None)
    if err is None and w is not None:
        try:
            commit(root, msg.dirs, w.ops, msg.scan_ns)
        except Exception as e:  # noqa: BLE001
            err = _failed("workspace commit", e)
    _reply(mailbox, msg.reply, None if err else root, err)


def handle_reload(mailbox: Mailbox, msg: ReloadWorkspace) -> None:
    try:
        root = workspace_root(msg.client_key)
        add_to_sys_path(root, msg.dirs)
        importlib.invalidate_caches()
        reloaded: list[str] = []
        if msg.auto_reload:
            names = [_filetree.module_name(k, list(msg.dirs)) for k in msg.changed]
            reloaded = _reload.reload_modules([n for n in names if n])
    except Exception as e:  # noqa: BLE001
        _reply(mailbox, msg.reply, error=_failed("workspace reload", e))
        return
    _reply(mailbox, msg.reply, tuple(reloaded))


def on_start(client_addr: str) -> None:
    """A new proc: put the dirs synced to its root so far on ``sys.path``."""
    root = workspace_root(client_key(client_addr))
    dirs = _filetree.read_meta(root, "dirs.json", None)
    if dirs:
        add_to_sys_path(root, dirs)


SYSTEM_HANDLERS.update({
    DescribeWorkspace: handle_describe,
    DiffWorkspace: handle_diff,
    WriteFiles: handle_write,
    ReloadWorkspace: handle_reload,
})
