"""Large message buffers through shared memory, for messages between procs of one host.

A message whose out-of-band buffers add up to ``SHM_THRESHOLD`` bytes or more
is sent with its buffers copied once into a shared-memory segment in
``/dev/shm``; the receiver maps that segment and unpickles straight from the
mapping (no copy). Through the control socket the same bytes would be copied
several times by zmq and the kernel.

The receivers of one broadcast share one segment: each maps it privately
(copy-on-write), so the buffers are its own to change, as a copy would be, and
a change stays in its process (a shared mapping showed one receiver's
``x.add_(1)`` in the others' arguments); only the pages it writes are copied. A
segment with one reader is that reader's alone until it releases it: it stays
mapped shared, its pages faulted in once.

Segments are pooled and stay in the page cache (the sender keeps them
mapped), so their pages are allocated once, not per message (a fresh 64 MiB
file costs ~65 ms of page faults).
A segment's first ``HEADER`` bytes are one hold flag per reader: the sender
sets them before sending; each reader clears its own when the last view of
the message's buffers is freed (a finalizer on the buffer objects), and the
sender reuses a segment only once every flag is clear. The pool is bounded
(``SHM_POOL_BYTES``); beyond it a message gets a one-off file, with one name
(a hard link) per reader that the reader unlinks on arrival: the bytes go with
the last name. Files are named ``mt-<pid>-...`` so those of a
proc that died can be removed by whoever reaps it.

A reader that dies before it let go never clears its flag nor unlinks its
name: the sender notes which reader (by address) holds each, and whoever
reaps a proc calls :func:`release_reader` for it (else each message it died
holding stayed in ``/dev/shm`` until the sender exited).
"""

from __future__ import annotations

import atexit
import collections
import ctypes
import glob
import itertools
import mmap
import os
import threading
import uuid
import weakref

from ..config import setting

SHM_DIR = "/dev/shm"
SHM_THRESHOLD = setting("MONARCH_TENSOR_SHM_THRESHOLD")
SHM_POOL_BYTES = setting("MONARCH_TENSOR_SHM_POOL_BYTES")  # per sending process
SHM_MAP_CACHE_BYTES = setting("MONARCH_TENSOR_SHM_MAP_CACHE_BYTES")  # per receiver
HEADER = 64  # one hold flag per reader; also keeps the data 64-byte aligned
MAX_READERS = HEADER
_ALIGN = 1 << 20
_CLEAR = bytes(HEADER)


def available() -> bool:
    return os.path.isdir(SHM_DIR) and os.access(SHM_DIR, os.W_OK)


def _layout(views: list[memoryview]) -> tuple[list[tuple[int, int]], int]:
    layout, offset = [], 0
    for v in views:
        layout.append((offset, v.nbytes))
        offset += (v.nbytes + 63) & ~63
    return layout, offset


_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long)
_libc.munmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t)
_MAP_FAILED = ctypes.c_void_p(-1).value


def _map(fd: int, size: int, private: bool = False) -> memoryview:
    """The first ``size`` bytes of file ``fd``, mapped shared (or private: copy-on-write), as a writable byte
    view; unmapped once it and every view made of it are gone, and holding no descriptor (``fd`` can be
    closed at once). Python's ``mmap.mmap`` keeps a duplicate of ``fd`` open while it lives (before 3.13):
    one per segment in the sender's pool, three per segment mapped by a reader, so a few hundred kept
    1 MiB messages ran out of the common limit of 1024 descriptors."""
    addr = _libc.mmap(None, size, mmap.PROT_READ | mmap.PROT_WRITE,
                      mmap.MAP_PRIVATE if private else mmap.MAP_SHARED, fd, 0)
    if addr is None or addr == _MAP_FAILED:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))
    whole = (ctypes.c_char * size).from_address(addr)
    # (not at exit: views still alive then, a finalizer clearing a hold flag one, must stay readable)
    weakref.finalize(whole, _libc.munmap, addr, size).atexit = False
    return memoryview(whole).cast("B")


def _create(path: str, size: int) -> memoryview:
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.ftruncate(fd, size)
        return _map(fd, size)
    except BaseException:
        os.unlink(path)
        raise
    finally:
        os.close(fd)


class _Segment:
    __slots__ = ("name", "size", "mm", "holders")

    def __init__(self, name: str, size: int) -> None:
        self.name, self.size = name, size
        self.mm = _create(os.path.join(SHM_DIR, name), size)
        self.holders: list[str | None] = []  # the reader of each hold flag of the last message, where known

    def free(self) -> bool:
        return self.mm[:HEADER] == _CLEAR

    def destroy(self) -> None:
        try:
            os.unlink(os.path.join(SHM_DIR, self.name))
        except OSError:
            pass
        self.mm = memoryview(b"")  # let go of the mapping: views a reader of ours may hold keep their own


class _Pool:
    """The sending side: segments of this process, reused once every reader let go."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.segments: list[_Segment] = []
        self.ids = itertools.count()
        self.tag = uuid.uuid4().hex[:8]

    def take(self, need: int, readers: int, holders: list[str] | None = None) -> _Segment | None:
        with self.lock:
            best = None
            for s in self.segments:
                if s.size >= need and (best is None or s.size < best.size) and s.free():
                    best = s
            if best is None:
                size = HEADER + ((need - HEADER + _ALIGN - 1) // _ALIGN) * _ALIGN
                total = sum(s.size for s in self.segments)
                for s in sorted(self.segments, key=lambda s: s.size):  # make room: drop free segments
                    if total + size <= SHM_POOL_BYTES:
                        break
                    if s.free():
                        s.destroy()
                        self.segments.remove(s)
                        total -= s.size
                if total + size > SHM_POOL_BYTES:
                    return None
                best = _Segment(f"mt-{os.getpid()}-p{self.tag}-{next(self.ids)}", size)
                self.segments.append(best)
            best.mm[:readers] = b"\1" * readers
            best.holders = list(holders) if holders else []
            return best

    def release(self, holder: str) -> None:
        """Clear the hold flags ``holder`` (a reader that died) left set."""
        with self.lock:
            for s in self.segments:
                for i, h in enumerate(s.holders):
                    if h == holder:
                        s.mm[i] = 0
                        s.holders[i] = None

    def close(self) -> None:
        with self.lock:
            for s in self.segments:
                s.destroy()
            self.segments.clear()


_pool: _Pool | None = None
_pool_pid = 0


def _get_pool() -> _Pool:
    global _pool, _pool_pid
    if _pool is None or _pool_pid != os.getpid():  # a forked child starts its own pool
        _pool, _pool_pid = _Pool(), os.getpid()
    return _pool


@atexit.register
def _close_pool() -> None:
    """Remove this process's pooled segments and the names of its one-off files no reader has taken yet
    (unlinked only by a reader, on arrival: a message still queued to a proc that never read it stayed in
    ``/dev/shm`` after this process exited)."""
    if _pool is not None and _pool_pid == os.getpid():
        _pool.close()
    mine = f"mt-{os.getpid()}-"  # (a forked child's notes are its parent's: not its to remove)
    with _oneoff_lock:
        names = [n for held in _oneoff_names.values() for n in held if n.startswith(mine)]
        _oneoff_names.clear()
    for n in names:
        try:
            os.unlink(os.path.join(SHM_DIR, n))
        except OSError:
            pass


def write(buffers: list, readers: int = 1, holders: list[str] | None = None) -> tuple:
    """Copy ``buffers`` into a segment for ``readers`` receivers; return its descriptor.

    The descriptor is ``(name, layout, reader_index, readers)``, ``reader_index`` -1
    for a one-off file; :func:`for_reader` makes the descriptor of the other readers.
    ``holders``, where given, are the readers' addresses (for :func:`release_reader`).
    """
    views = [memoryview(b).cast("B") for b in buffers]
    layout, total = _layout(views)
    seg = _get_pool().take(HEADER + total, readers, holders) if 0 < readers <= MAX_READERS else None
    if seg is None:
        desc = _write_oneoff(views, layout, total, readers)
        if holders:
            _note_oneoff(desc[0], holders)
        return desc
    mm = seg.mm
    for v, (off, n) in zip(views, layout):
        mm[HEADER + off:HEADER + off + n] = v
    return seg.name, layout, 0, readers


def for_reader(desc: tuple, i: int) -> tuple:
    """The descriptor reader ``i`` gets: its hold flag in a pooled segment, its own name of a one-off file."""
    name, layout, idx, readers = desc
    if idx < 0:
        return desc if i == 0 else (_oneoff_name(name, i), layout, -1, readers)
    return name, layout, i, readers


def _oneoff_name(name: str, i: int) -> str:
    return name if i == 0 else f"{name}-{i}"


def _write_oneoff(views, layout, total, readers: int) -> tuple:
    """A file outside the pool, with a name per reader: each reader unlinks its own once it mapped it (the
    first reader to unlink the only name left the other readers of a broadcast nothing to open)."""
    name = f"mt-{os.getpid()}-{uuid.uuid4().hex[:12]}"
    path = os.path.join(SHM_DIR, name)
    mm = _create(path, max(total, 1))
    links = []
    try:
        for v, (off, n) in zip(views, layout):
            mm[off:off + n] = v
        for i in range(1, readers):
            links.append(os.path.join(SHM_DIR, _oneoff_name(name, i)))
            os.link(path, links[-1])
    except BaseException:
        for p in [path, *links]:
            try:
                os.unlink(p)
            except OSError:
                pass
        raise
    finally:
        mm.release()
    return name, layout, -1, readers


_oneoff_lock = threading.Lock()
_oneoff_names: dict[str, set[str]] = {}  # reader address -> names of one-off files it may not have unlinked yet


def _note_oneoff(name: str, holders: list[str]) -> None:
    """Note each reader's name of one-off file ``name``, forgetting those it has unlinked since (a live
    reader unlinks its name on arrival: the set stays as small as its backlog)."""
    with _oneoff_lock:
        for i, holder in enumerate(holders):
            names = _oneoff_names.setdefault(holder, set())
            names -= {n for n in names if not os.path.exists(os.path.join(SHM_DIR, n))}
            names.add(_oneoff_name(name, i))


def release_reader(holder: str) -> None:
    """Let go of what reader ``holder`` (an address) held of this process's messages: it exited, maybe
    killed before it released them. Its hold flags on pooled segments are cleared (the segments can be
    reused) and its names of one-off files unlinked (the bytes go with the last name)."""
    if _pool is not None and _pool_pid == os.getpid():
        _pool.release(holder)
    with _oneoff_lock:
        names = _oneoff_names.pop(holder, ())
    for n in names:
        try:
            os.unlink(os.path.join(SHM_DIR, n))
        except OSError:
            pass


class _Opened:
    """A segment of another process, opened here: mapped shared once (its hold flags, and the data of
    messages with this one reader), no descriptor kept (see ``_map``)."""

    __slots__ = ("name", "size", "shared")

    def __init__(self, name: str) -> None:
        self.name = name
        fd = os.open(os.path.join(SHM_DIR, name), os.O_RDWR)
        try:
            self.size = os.fstat(fd).st_size
            self.shared = _map(fd, self.size)
        finally:
            os.close(fd)

    def map(self, private: bool) -> memoryview:
        """A message's map: private (copy-on-write, its own) where the segment has other readers; else the
        segment's shared map, whose pages stay mapped from message to message (a private map takes its page
        faults anew each time: 64 MiB read in 23-27 ms against 15). The file is opened again for a private
        map: its sender keeps its name while our hold flag is set."""
        if not private:
            return self.shared
        fd = os.open(os.path.join(SHM_DIR, self.name), os.O_RDWR)
        try:
            return _map_private(fd, self.size)
        finally:
            os.close(fd)


class _MapCache:
    """The receiving side: segments of other processes, opened once (LRU, bounded in bytes)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.maps: collections.OrderedDict[str, _Opened] = collections.OrderedDict()
        self.bytes = 0

    def get(self, name: str, private: bool = True) -> tuple[memoryview, memoryview]:
        """The segment's hold flags (shared), and a map of the whole segment: a private, copy-on-write one
        when ``private`` (see ``_Opened.map``)."""
        with self.lock:
            seg = self.maps.get(name)
            if seg is not None:
                self.maps.move_to_end(name)
        if seg is None:
            seg = _Opened(name)
            with self.lock:
                old = self.maps.pop(name, None)  # (another thread opened it meanwhile)
                if old is not None:
                    self.bytes -= old.size
                self.maps[name] = seg
                self.bytes += seg.size
                while self.bytes > SHM_MAP_CACHE_BYTES and len(self.maps) > 1:
                    _, old = self.maps.popitem(last=False)
                    self.bytes -= old.size  # live views keep their maps until they go
        return seg.shared[:HEADER], seg.map(private)

    def forget_process(self, pid: int) -> None:
        """Forget the segments of process ``pid`` (it exited: it will send nothing more through them). Views
        still alive keep theirs mapped until they go."""
        prefix = f"mt-{pid}-"
        with self.lock:
            for name in [n for n in self.maps if n.startswith(prefix)]:
                self.bytes -= self.maps.pop(name).size


def _map_private(fd: int, size: int) -> memoryview:
    """A copy-on-write map of the file: writes to it stay in this map, and pages never written show the
    file. Each message gets its own: a page once written would keep its copy for the next message."""
    return _map(fd, size, private=True)


_maps = _MapCache()


def _release(flags: memoryview, idx: int, left: list) -> None:
    left[0] -= 1
    if left[0] == 0:
        try:
            flags[idx] = 0
        except (ValueError, IndexError):
            pass


def read(name: str, layout: list[tuple[int, int]], idx: int = -1, readers: int = 2) -> list:
    """Buffers of a message: views into a map of the segment (released when the last view is freed), a
    private one where the segment has several ``readers``: one reader's change to its buffers never shows
    in another's. A segment with one reader is its alone until it releases it: its shared map is kept."""
    if "/" in name or not name.startswith("mt-"):
        raise ValueError(f"bad shared-memory name {name!r}")
    if idx < 0:
        return _read_oneoff(name, layout)
    if idx >= MAX_READERS:
        raise ValueError(f"bad reader index {idx}")
    flags, mm = _maps.get(name, private=readers != 1)
    if HEADER + max((o + n for o, n in layout), default=0) > len(mm):
        raise ValueError(f"layout runs past the end of segment {name!r}")
    left = [len(layout)]
    out = []
    for off, n in layout:
        c = (ctypes.c_char * n).from_buffer(mm, HEADER + off)
        weakref.finalize(c, _release, flags, idx, left)
        out.append(c)
    if not out:
        flags[idx] = 0
    return out


def _read_oneoff(name: str, layout: list[tuple[int, int]]) -> list[memoryview]:
    path = os.path.join(SHM_DIR, name)
    fd = os.open(path, os.O_RDWR)
    try:
        m = _map_private(fd, os.fstat(fd).st_size)  # (the other readers' names are of the same file)
    finally:
        os.close(fd)
        os.unlink(path)
    return [m[off:off + n] for off, n in layout]


def remove_files_of(pid: int) -> None:
    """Remove leftovers of a process that died before its receivers mapped them, and this process's maps of
    its segments (they stayed mapped up to the cache's 2 GiB)."""
    _maps.forget_process(pid)
    for path in glob.glob(os.path.join(SHM_DIR, f"mt-{pid}-*")):
        try:
            os.unlink(path)
        except OSError:
            pass
