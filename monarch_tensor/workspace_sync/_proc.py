"""Workspace sync, the proc side: handlers of ``workspace_sync/messages.py``.

Each proc knows its host's workspace root: ``$WORKSPACE_DIR`` (Monarch's
variable; a host agent or job sets it per host) or, by default, a directory per
client session on this host. The writer proc of a root compares and writes,
in its message handlers. Large files for writers on other hosts arrive as
``RDMABuffer`` handles of the client's files and are pulled over the data
plane; a writer that sees the client's source dirs copies large files from them
itself; both on two lane threads that go on while it takes the next messages
(``_LaneJobs``; changed blocks of a large file are pulled a message at a time,
``_in_two_lanes``); the rest rides in the messages. Every
proc puts the synced dirs first on ``sys.path`` and re-imports changed modules
(``_reload.py``).
"""

from __future__ import annotations

import collections
import dataclasses
import errno
import hashlib
import importlib
import mmap
import os
import shutil
import socket
import sys
import threading
import traceback
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import wait as futures_wait

from ..config import setting
from ..transport.mailbox import Mailbox, socket_dir
from ..transport.messages import SendToPort
from . import _filetree, _reload
from .messages import DescribeWorkspace, DiffWorkspace, ReloadWorkspace, ScanWorkspace, WorkspaceDiff, WriteFiles


def client_key(client_addr: str) -> str:
    """A short name for one client session (its mailbox address), used in default roots."""
    return hashlib.sha1(client_addr.encode()).hexdigest()[:12]


def default_root(key: str) -> str:
    return os.path.join(socket_dir(), f"workspace-{key}")


def remove_default_root(client_addr: str) -> None:
    """Remove client session ``client_addr``'s default root on this host once the session ended (the client
    exited or was killed; its procs are gone): nothing reads it any more. Roots in ``$WORKSPACE_DIR`` are
    the user's or a job's, and stay."""
    root = default_root(client_key(client_addr))
    shutil.rmtree(root, ignore_errors=True)
    shutil.rmtree(_filetree.meta_dir(root), ignore_errors=True)


def workspace_root(key: str, root_var: str = "") -> str:
    """This process's workspace root for client ``key``: ``$WORKSPACE_DIR`` or the default; with
    ``root_var`` (``CONDA_PREFIX``), that variable's directory, which must be set; a ``root_var`` that is an
    absolute path is that directory itself (a job's ``remote_mount``)."""
    if root_var.startswith("/"):
        return os.path.normpath(root_var)
    if root_var:
        value = os.environ.get(root_var)
        if not value:
            raise ValueError(f"${root_var} is not set in this proc: set it (procs.env.set({root_var!r}, path)) "
                             f"to where the environment goes on this host")
        return os.path.abspath(value)
    return os.path.abspath(os.environ.get("WORKSPACE_DIR") or default_root(key))


def _rank() -> int:
    from ..runtime._proc import current_runtime

    rt = current_runtime()
    return rt.rank if rt is not None else 0


def _reply(mailbox: Mailbox, msg, value=None, error: BaseException | None = None) -> None:
    """Answer ``msg`` on its ``reply`` port, keyed by its ``slot``, not by this proc's rank: a host mesh's
    sync asks the procs of several meshes at once, whose ranks repeat."""
    if msg.reply is not None:
        mailbox.send(msg.reply.addr, SendToPort(msg.reply.port_id, value, error, msg.slot))


def _failed(what: str, e: BaseException) -> Exception:
    from ..errors import SyncError

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


def where(key: str, root_var: str = "") -> tuple[str, str]:
    """``(hostname, root)``: this proc's answer to ``DescribeWorkspace`` (and to an ``env.set`` that moves
    its root, ``_env_proc``)."""
    return socket.gethostname(), workspace_root(key, root_var)


def handle_describe(mailbox: Mailbox, msg: DescribeWorkspace) -> None:
    try:
        answer = where(msg.client_key, msg.root_var)
    except Exception as e:  # noqa: BLE001 - reported to the client
        _reply(mailbox, msg, error=_failed("workspace roots", e))
        return
    _reply(mailbox, msg, answer)


def scan_root(root: str, dirs) -> dict[str, tuple[int, int, int]]:
    """The files of ``root`` under the synced ``dirs`` (``_filetree.scan``); a file written with its prefix
    rewritten (``rewritten.json``) shows as the client's file it came from while its mtime stays."""
    ours: dict[str, tuple[int, int, int]] = {}
    for d in dirs:
        ours.update(_filetree.scan(os.path.join(root, d) if d else root, f"{d}/" if d else ""))
    for key, (size, mtime_ns) in _filetree.read_meta(root, "rewritten.json", {}).items():
        mine = ours.get(key)
        if mine is not None and mine[1] == mtime_ns:
            ours[key] = (size, mtime_ns, mine[2])
    return ours


def diff(root: str, dirs, manifest: dict, ours: dict | None = None) -> WorkspaceDiff:
    """Compare the client's manifest with ``root`` (see ``_filetree`` for the rules); ``ours``: the root's
    scan, when it was made already (``ScanWorkspace``)."""
    if ours is None:
        ours = scan_root(root, dirs)
    racy = set(_filetree.read_meta(root, "racy.json", []))
    send, verify, blocks = [], {}, {}
    for key, theirs in manifest.items():
        mine = ours.get(key)
        if mine == theirs and key not in racy:  # (size, mtime_ns, mode) alike: unchanged
            continue
        size = theirs[0]
        if mine is None:
            send.append(key)
        elif mine[0] != size:
            send.append(key)
            if size >= _filetree.LARGE and mine[0] >= _filetree.BLOCK:
                blocks[key] = _filetree.block_digests(os.path.join(root, key))
        else:  # same size; another mtime or mode, or racy
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


_scans: dict[str, tuple] = {}  # sync_id -> (root, dirs, scan) made by ScanWorkspace, for its DiffWorkspace
KEEP_SCANS = 8  # scans kept for diffs not come yet (a client that died between the two leaves one behind)


def handle_scan(mailbox: Mailbox, msg: ScanWorkspace) -> None:
    try:
        root = workspace_root(msg.client_key, msg.root_var)
        found = scan_root(root, msg.dirs)
    except Exception:  # noqa: BLE001 - the diff scans again and reports what fails
        return
    _scans[msg.sync_id] = (root, tuple(msg.dirs), found)
    while len(_scans) > KEEP_SCANS:
        _scans.pop(next(iter(_scans)))


def _is_source(root: str, sources) -> bool:
    """Whether ``root`` is the client's one source dir itself (a host that sees the client's conda
    environment at the path its procs use: there is nothing to sync)."""
    if len(sources) != 1:
        return False
    try:
        st = os.stat(root)
    except OSError:
        return False
    return (st.st_dev, st.st_ino) == tuple(sources[0][1:])


def handle_diff(mailbox: Mailbox, msg: DiffWorkspace) -> None:
    try:
        root = workspace_root(msg.client_key, msg.root_var)
        scanned = _scans.pop(msg.sync_id, None)
        if msg.root_var and _is_source(root, msg.sources):
            _reply(mailbox, msg, WorkspaceDiff((), {}, {}, (), root, same=True))
            return
        _filetree.adopt_inner_records(root)
        if msg.root_var.startswith("/"):
            check_mount_point(root)
        ours = scanned[2] if scanned is not None and scanned[:2] == (root, tuple(msg.dirs)) else None
        value = diff(root, msg.dirs, msg.manifest, ours)
        if sees_sources(msg.sources):
            value = dataclasses.replace(value, local=True)
    except Exception as e:  # noqa: BLE001 - reported to the client
        _reply(mailbox, msg, error=_failed("workspace diff", e))
        return
    _reply(mailbox, msg, value)


SYNC_TIMEOUT = setting("MONARCH_TENSOR_SYNC_TIMEOUT")  # every wait of a sync, both sides
PULL_PIECE = 8 << 20  # bytes per data-plane read

_local = threading.local()
_lane_pool: tuple[int, ThreadPoolExecutor] | None = None


def _lanes() -> ThreadPoolExecutor:
    """The lane threads: two per process (made again after a fork), one per core of a 2-core host. They
    copy and pull whole files (``_LaneJobs``) and run a block pull's second lane (``_in_two_lanes``)."""
    global _lane_pool
    if _lane_pool is None or _lane_pool[0] != os.getpid():
        _lane_pool = (os.getpid(), ThreadPoolExecutor(2, thread_name_prefix="monarch-tensor-sync-lane"))
    return _lane_pool[1]


def _two_lanes(jobs: list, size) -> list[list]:
    """``jobs`` dealt into two lists of about equal ``size(job)`` in all, the largest first."""
    lanes: list[list] = [[], []]
    loads = [0, 0]
    for job in sorted(jobs, key=size, reverse=True):
        i = 0 if loads[0] <= loads[1] else 1
        lanes[i].append(job)
        loads[i] += size(job)
    return lanes


def _copy_file(src_path: str, fd: int, size: int) -> int:
    """Copy up to ``size`` bytes of ``src_path`` into ``fd``; the bytes copied. ``copy_file_range`` first:
    where the file system can, it shares the source's blocks (btrfs, XFS: a clone, no byte copied) or copies
    on the server (NFS); elsewhere the kernel copies, as ``sendfile`` does. Then ``sendfile`` for what it left
    (it refuses some pairs of file systems, and some special files read as empty to it), then read and
    write."""
    with open(src_path, "rb", buffering=0) as src:
        s = src.fileno()
        off = 0
        for move in (_range_copy, _send_copy, _plain_copy):
            off = move(s, fd, off, size)
            if off >= size:
                break
        return off


def _range_copy(s: int, fd: int, off: int, size: int) -> int:
    """``os.copy_file_range`` from ``off`` until ``size`` or until it stops (0 bytes: the end of the file,
    or a file it cannot read, which ``_send_copy`` then tries); the offset reached."""
    copy_range = getattr(os, "copy_file_range", None)
    try:
        while copy_range is not None and off < size:
            n = copy_range(s, fd, size - off, off, off)
            if n == 0:
                break
            off += n
    except OSError as e:  # no such call here, or not between these files
        if e.errno not in _NOT_HERE:
            raise
    return off


def _send_copy(s: int, fd: int, off: int, size: int) -> int:
    """``os.sendfile`` from ``off``, which writes at ``fd``'s position (``copy_file_range`` did not move it)."""
    try:
        os.lseek(fd, off, os.SEEK_SET)
        while off < size:
            n = os.sendfile(fd, s, off, size - off)
            if n == 0:
                break
            off += n
    except OSError as e:  # a file system without sendfile between these files
        if e.errno not in _NOT_HERE:
            raise
    return off


def _plain_copy(s: int, fd: int, off: int, size: int) -> int:
    while off < size:
        chunk = os.pread(s, min(PULL_PIECE, size - off), off)
        if not chunk:
            break
        view = memoryview(chunk)
        while view:
            k = os.pwrite(fd, view, off)
            view, off = view[k:], off + k
    return off


_NOT_HERE = (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.EXDEV)


def _whole(fill, tmp: str, dest: str, size: int, mtime_ns: int, mode: int, going) -> str | None:
    """A lane's job: a new ``tmp`` filled by ``fill(fd)`` (which returns the bytes written) and placed at
    ``dest`` (``_filetree.place``) unless ``going()`` says the sync has failed meanwhile; ``dest`` when a
    directory stood there and was removed, else None. On failure no temp file is left behind."""
    fd = _filetree.open_new(tmp)
    try:
        try:
            end = fill(fd)
        except BaseException:
            os.close(fd)
            raise
        if not going():  # a failed sync leaves the old version in place
            os.close(fd)
            _unlink(tmp)
            return None
        return dest if _filetree.place(fd, tmp, dest, size, end, mtime_ns, mode) else None
    except BaseException:
        _unlink(tmp)
        raise


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def _copy_whole(src: str, tmp: str, dest: str, size: int, mtime_ns: int, mode: int, going) -> str | None:
    """The client's file ``src`` copied into ``tmp`` and placed at ``dest`` (``_whole``)."""
    return _whole(lambda fd: _copy_file(src, fd, size), tmp, dest, size, mtime_ns, mode, going)


def _pull_whole(buf, tmp: str, dest: str, size: int, mtime_ns: int, mode: int, going) -> str | None:
    """The client's file, ``buf`` on the data plane, pulled into ``tmp`` and placed at ``dest`` (``_whole``)."""

    def fill(fd: int) -> int:
        for off in range(0, size, PULL_PIECE):
            _pull_piece(buf, off, min(PULL_PIECE, size - off), fd)
        return size

    return _whole(fill, tmp, dest, size, mtime_ns, mode, going)


class _Parted:
    """A large file pulled in pieces that both lanes take (``_LaneJobs._part``): placed by the lane that
    finishes its last piece, or removed there if a piece failed or the sync did (``_LaneJobs._piece_done``)."""

    __slots__ = ("fd", "tmp", "dest", "size", "mtime_ns", "mode", "left", "failed")

    def __init__(self, tmp: str, dest: str, size: int, mtime_ns: int, mode: int, pieces: int) -> None:
        self.fd = _filetree.open_new(tmp)
        self.tmp, self.dest, self.size, self.mtime_ns, self.mode = tmp, dest, size, mtime_ns, mode
        self.left, self.failed = pieces, False


class _LaneJobs:
    """One sync's whole files that the lane threads write: copies (``("C", ...)`` ops) and pulls (``("P",
    ...)``). The writer's mailbox thread queues a message's files and goes on to the sync's next message, so
    the lanes stay busy from one message to the next. The two lanes take the queued files one at a time,
    largest of a message first (a pull of more than two ``PULL_PIECE`` goes in pieces that both lanes
    take), until none is left: a lane that gets less of the cores meanwhile takes fewer. ``wait`` before
    what must follow them: deletions (which may remove directories), the commit, an abort.

    Measured on this project's 2-core VM (50 MB in 100 files to 8 procs): waiting for a message's copies
    before taking the next one left a lane idle while the other finished, and both idle while the mailbox
    thread opened and finished files, 0.6-0.9 ms per 8 MB message (write phase 27-32 ms against 26-28,
    medians of 4 interleaved runs); lanes dealt half of a message's bytes each up front left one idle 2.5 ms
    in a traced sync while the other copied (write phase 29.1 against 25.6 ms, medians of 7 interleaved
    runs). Pulls were done a message at a time by the mailbox thread and one lane: a trace showed a lane idle
    up to 2.8 ms at each 8 MB message's end, and the mailbox thread busy pulling instead of taking messages;
    on one host the pulled first sync barely changed (63.0 against 66.1 ms, medians of 8 interleaved runs:
    there the two cores are the limit), but no lane waits for a message's slowest piece any more."""

    LANES = 2

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._queue: collections.deque = collections.deque()  # (function, args) of each file or piece
        self._running = 0  # lane tasks started that have not found the queue empty yet
        self._stop = False  # a job failed or the wait timed out: the lanes take no more
        self._futs: list = []

    def add(self, w: _filetree.Writer, ops: list[tuple]) -> None:
        """Queue a message's ``"C"`` and ``"P"`` ops, and start lane tasks to take them where fewer than
        ``LANES`` run (a task per lane, not per file: a task per file cost the lanes 10% in hand-offs)."""
        jobs: list[tuple] = []
        parted: list[_Parted] = []
        try:
            for kind, key, source, size, mtime_ns, mode in sorted(ops, key=lambda op: op[3], reverse=True):
                tmp, dest = w.claim(key)
                if kind == "C":
                    jobs.append((_copy_whole, (source, tmp, dest, size, mtime_ns, mode, self._going)))
                elif size <= 2 * PULL_PIECE:
                    jobs.append((_pull_whole, (source, tmp, dest, size, mtime_ns, mode, self._going)))
                else:
                    offsets = range(0, size, PULL_PIECE)
                    parted.append(_Parted(tmp, dest, size, mtime_ns, mode, len(offsets)))
                    jobs += [(self._part, (parted[-1], source, o, min(PULL_PIECE, size - o))) for o in offsets]
        except BaseException:
            for f in parted:  # opened here, and no lane has them yet
                os.close(f.fd)
                _unlink(f.tmp)
            raise
        with self._lock:
            self._queue.extend(jobs)
            start = min(self.LANES - self._running, len(jobs))
            self._running += start
        self._futs += [_lanes().submit(self._lane) for _ in range(start)]

    def _going(self) -> bool:
        """Whether the sync is still on: after a failed job or a timed-out wait, no file is placed any more
        (a failed sync leaves the old versions; ``Writer.abort``)."""
        return not self._stop

    def _lane(self) -> list[str]:
        """A lane task: run queued jobs until none is left; the destinations where a directory was removed
        for the file."""
        dests: list[str] = []
        try:
            while True:
                with self._lock:
                    if self._stop or not self._queue:
                        self._running -= 1
                        return dests
                    fn, args = self._queue.popleft()
                dest = fn(*args)
                if dest is not None:
                    dests.append(dest)
        except BaseException:
            with self._lock:
                self._stop = True
                self._running -= 1
            raise

    def _part(self, f: _Parted, buf, offset: int, n: int) -> str | None:
        """One piece of ``f``; the last one to finish places the file (or removes it, if one failed)."""
        err = None
        if not f.failed:
            try:
                _pull_piece(buf, offset, n, f.fd)
            except BaseException as e:  # noqa: BLE001 - raised below, once the file is settled
                f.failed, err = True, e
        was_dir = self._piece_done(f)
        if err is not None:
            raise err
        return f.dest if was_dir else None

    def _piece_done(self, f: _Parted) -> bool:
        """Count one piece of ``f`` as done (run, or dropped unrun); after its last one, place the file, or
        remove it if a piece failed or was dropped or the sync failed meanwhile. True when a directory stood
        at its place and was removed."""
        with self._lock:
            f.left -= 1
            if f.left:
                return False
        if f.failed or self._stop:
            os.close(f.fd)
            _unlink(f.tmp)
            return False
        try:
            return _filetree.place(f.fd, f.tmp, f.dest, f.size, f.size, f.mtime_ns, f.mode)
        except BaseException:
            _unlink(f.tmp)
            raise

    def _drop_queued(self) -> int:
        """Stop the lanes taking jobs and drop those not started (a job failed, or the wait timed out); a file
        whose pieces are dropped is removed once no lane writes into it. How many jobs were dropped."""
        with self._lock:
            self._stop = True  # a running lane takes no more after its job
            dropped = list(self._queue)
            self._queue.clear()
        for fn, args in dropped:
            if fn == self._part:
                args[0].failed = True
                self._piece_done(args[0])
        return len(dropped)

    def wait(self, w: _filetree.Writer) -> None:
        """Until every job handed out is done; raise the first one's error (or TimeoutError)."""
        futs, self._futs = self._futs, []
        if not futs:
            return
        _, pending = futures_wait(futs, timeout=SYNC_TIMEOUT)
        if pending:
            left = self._drop_queued()
            for f in pending:
                f.cancel()
            raise TimeoutError(f"file copies and pulls did not finish within {SYNC_TIMEOUT:.0f} s ({left} not started)")
        errors = [f.exception() for f in futs if f.exception() is not None]
        if errors:
            self._drop_queued()  # (the lanes stopped taking them at the first error)
            raise errors[0]
        for f in futs:
            for dest in f.result():
                w.forget_dirs(dest)

    def drain(self) -> None:
        """Until the jobs handed out so far are done (at most ``SYNC_TIMEOUT``), leaving their outcomes to
        ``wait``."""
        futures_wait(list(self._futs), timeout=SYNC_TIMEOUT)

    def settle(self, w: _filetree.Writer) -> None:
        """``wait``, its errors dropped (a sync that failed already: never abort under a running copy)."""
        try:
            self.wait(w)
        except Exception:  # noqa: BLE001
            pass


def _pull_piece(buf, offset: int, n: int, fd: int) -> None:
    """Read [offset, offset + n) of ``buf`` over the data plane into this thread's scratch memory, then
    write it at the same offset of ``fd``. The scratch is page-aligned, as the client's mapped files are:
    memory 16 bytes into a page (a bytearray's) made the kernel's copy several times slower (see
    rdma/backends/cma.py's ``short_distance``)."""
    scratch = getattr(_local, "scratch", None)  # kept per thread: fresh memory costs page faults
    if scratch is None or len(scratch) < n:
        scratch = _local.scratch = memoryview(mmap.mmap(-1, max(n, PULL_PIECE)))
    view = scratch[:n]
    buf.read_into(view, offset=offset, timeout=SYNC_TIMEOUT).get(timeout=SYNC_TIMEOUT)
    while view:
        k = os.pwrite(fd, view, offset)
        view, offset = view[k:], offset + k


def _in_two_lanes(w: _filetree.Writer, pulls: list[tuple]) -> None:
    """A message's pulls ``("r", key, offset, buf, n, patch)`` in two lanes (this thread and a lane thread):
    a lane reads a piece over the data plane and writes it, so the two cores each move different pieces.
    Destinations are opened here first (the Writer is not shared between threads)."""
    jobs, ends = [], []
    for op in pulls:
        fd = w._fd(op[1], op[5])
        for o in range(0, op[4], PULL_PIECE):  # a big file's pieces may go to both lanes
            jobs.append((min(PULL_PIECE, op[4] - o), fd, op[3], op[2] + o))
        ends.append((op[1], op[2] + op[4]))
    lanes = _two_lanes(jobs, lambda job: job[0])

    def run(lane: list) -> None:
        for n, fd, buf, offset in lane:
            _pull_piece(buf, offset, n, fd)

    other = _lanes().submit(run, lanes[1]) if lanes[1] else None
    try:
        run(lanes[0])
    finally:
        if other is not None:  # never leave it writing into fds that an abort closes
            futures_wait([other], timeout=SYNC_TIMEOUT)
    if other is not None:
        other.result(timeout=0)  # its error, or TimeoutError
    for key, end in ends:
        w.copied(key, end)


def apply_ops(w: _filetree.Writer, ops, jobs: _LaneJobs | None = None) -> None:
    """Apply a message's ops in order; ``("r", key, offset, buf, n, patch)`` pulls [offset, offset + n),
    ``("C", key, path, size, mtime_ns, mode)`` copies and ``("P", key, buf, size, mtime_ns, mode)`` pulls
    a whole file on a lane thread (``jobs``: a sync's, left running; without it they are waited for here).
    A message's ``"r"`` pulls run first, in two lanes: they write distinct files, or distinct ranges of one
    (the other ops finish, touch or delete files)."""
    own = jobs is None
    if own:
        jobs = _LaneJobs()
    try:
        whole = [op for op in ops if op[0] == "C" or op[0] == "P"]
        if whole:
            jobs.add(w, whole)
        pulls = [op for op in ops if op[0] == "r"]
        if pulls:
            _in_two_lanes(w, pulls)
        for op in ops:
            kind = op[0]
            if kind == "C" or kind == "P" or kind == "r" or kind == "x":
                continue
            if kind == "w":
                w.write(op[1], op[2], op[3], op[4])
            elif kind == "f":
                w.finish(*op[1:])
            elif kind == "t":
                w.touch(*op[1:])
            elif kind == "d":
                jobs.wait(w)  # (a delete may remove a directory a lane writes into)
                w.delete(op[1])
            else:
                raise ValueError(f"unknown workspace op {kind!r}")
        if own:
            jobs.wait(w)
    except BaseException:
        if own:
            jobs.settle(w)
        raise


def check_mount_point(root: str) -> None:
    """A mount mirrors its source onto ``root``, deleting what the source lacks: refuse a directory that holds
    files no sync of ours wrote (it has no records, ``_filetree.meta_dir``), such as a home directory named by
    mistake."""
    try:
        names = os.listdir(root)
    except FileNotFoundError:
        return
    except NotADirectoryError:
        raise NotADirectoryError(f"remote_mount: {root} on {socket.gethostname()} is a file, not a directory") from None
    if names and not os.path.isdir(_filetree.meta_dir(root)):
        raise FileExistsError(f"remote_mount: {root} on {socket.gethostname()} already holds files that no mount "
                              f"or sync wrote ({', '.join(sorted(names)[:3])}{', ...' if len(names) > 3 else ''}); "
                              f"mirroring onto it would delete them: mount at a new or empty directory")


def commit(root: str, dirs, ops, scan_ns: int, env: bool = False) -> None:
    """Record which files are racy (modified near this sync), which were written with their prefix
    rewritten, and which dirs are synced (not for an environment: those are no workspace's)."""
    racy_before = _filetree.read_meta(root, "racy.json", [])
    racy = set(racy_before)
    rewritten = _filetree.read_meta(root, "rewritten.json", {})
    before = dict(rewritten)
    finished: dict[str, int] = {}
    for op in ops:
        if op[0] == "x":
            rewritten[op[1]] = [op[2], finished[op[1]]]
            continue
        if op[0] == "f":
            key, mtime_ns = op[1], op[3]
            finished[key] = mtime_ns
            rewritten.pop(key, None)  # (an "x" after it says it is rewritten again)
        elif op[0] == "t":
            key, mtime_ns = op[1], op[2]
            if key in rewritten:  # the same rewritten content: it stays taken for the client's file
                rewritten[key] = [rewritten[key][0], mtime_ns]
        else:
            if op[0] == "d":
                racy.discard(op[1])
                rewritten.pop(op[1], None)
            continue
        if _filetree.racy(mtime_ns, scan_ns):
            racy.add(key)
        else:
            racy.discard(key)
    # Each record is written only when it changes (a file made and renamed), but the records' directory
    # always exists after a commit: it marks the root as one that syncs wrote (``check_mount_point``).
    if sorted(racy) != racy_before or not os.path.isdir(_filetree.meta_dir(root)):
        _filetree.write_meta(root, "racy.json", sorted(racy))
    if rewritten != before:
        _filetree.write_meta(root, "rewritten.json", rewritten)
    if not env and _filetree.read_meta(root, "dirs.json", None) != list(dirs):
        _filetree.write_meta(root, "dirs.json", list(dirs))


_writers: dict[str, tuple[_filetree.Writer, _LaneJobs]] = {}
_failures: dict[str, Exception] = {}


def _as_committed(op: tuple) -> tuple:
    """The op as ``commit`` reads it: a whole-file copy or pull finishes its file as an ``"f"`` op does."""
    if op[0] == "C" or op[0] == "P":
        _, key, _source, size, mtime_ns, mode = op
        return ("f", key, size, mtime_ns, mode, False)
    return op


def handle_write(mailbox: Mailbox, msg: WriteFiles) -> None:
    try:
        root = workspace_root(msg.client_key, msg.root_var)
    except Exception as e:  # noqa: BLE001 - (it was there for the diff: the variable was unset since)
        if msg.last:
            _reply(mailbox, msg, error=_failed("workspace write", e))
        return
    if msg.sync_id not in _failures:
        got = _writers.get(msg.sync_id)
        if got is None:
            for other, others_jobs in list(_writers.values()):
                if other.root == root:  # (a sync into this root whose client went away, or another client's)
                    others_jobs.drain()  # its files land before this sync's: none overwrites a newer file
            got = _writers[msg.sync_id] = (_filetree.Writer(root), _LaneJobs())
        w, jobs = got
        try:
            apply_ops(w, msg.ops, jobs)
            if msg.last:
                jobs.wait(w)
            w.ops.extend(_as_committed(op) for op in msg.ops if op[0] not in ("w", "r"))
        except Exception as e:  # noqa: BLE001
            jobs.settle(w)
            w.abort()
            _failures[msg.sync_id] = _failed("workspace write", e)
    if not msg.last:
        return
    w = (_writers.pop(msg.sync_id, None) or (None,))[0]
    err = _failures.pop(msg.sync_id, None)
    if err is None and w is not None:
        try:
            commit(root, msg.dirs, w.ops, msg.scan_ns, env=bool(msg.root_var))
        except Exception as e:  # noqa: BLE001
            err = _failed("workspace commit", e)
    _reply(mailbox, msg, None if err else root, err)


def handle_reload(mailbox: Mailbox, msg: ReloadWorkspace) -> None:
    try:
        root = workspace_root(msg.client_key)
        add_to_sys_path(root, msg.dirs)
        importlib.invalidate_caches()
        _reload.note_changed(n for n in (_filetree.module_name(k, list(msg.dirs)) for k in msg.changed) if n)
        reloaded = _reload.reload_stale() if msg.auto_reload else []
    except Exception as e:  # noqa: BLE001
        _reply(mailbox, msg, error=_failed("workspace reload", e))
        return
    _reply(mailbox, msg, tuple(reloaded))


def on_start(rt) -> None:
    """A new proc (its start hook: ``runtime/_hooks.py``): put the dirs synced to its root so far on
    ``sys.path``. A proc starts even if its root is unreadable."""
    try:
        root = workspace_root(client_key(rt.client_addr))
        dirs = _filetree.read_meta(root, "dirs.json", None)
        if dirs:
            add_to_sys_path(root, dirs)
    except Exception as e:  # noqa: BLE001 - a proc must start even if its workspace root is unreadable
        print(f"monarch_tensor: cannot read the workspace root: {e!r}", file=sys.stderr)


def on_session_end(client_addrs) -> None:
    """A client session whose procs on this host are gone (its host agent ended it, or the script exited):
    its default roots here are removed (a hook: ``runtime/_hooks.py``)."""
    for addr in client_addrs:
        remove_default_root(addr)


def on_client_gone(client_pid: int, client_addrs) -> None:
    """A client that was killed (its procs are gone) left the default roots of its sessions on this host:
    removed by the host's template process (a hook: ``runtime/_hooks.py``)."""
    for addr in client_addrs:
        remove_default_root(addr)


# Workspace sync's messages to procs and their handlers (its registry entry names them: ``runtime/_hooks.py``).
HANDLERS = {
    DescribeWorkspace: handle_describe,
    ScanWorkspace: handle_scan,
    DiffWorkspace: handle_diff,
    WriteFiles: handle_write,
    ReloadWorkspace: handle_reload,
}
