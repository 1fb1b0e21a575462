"""File trees for workspace sync: scan, compare, hash by blocks, write atomically.

Used on both ends: the client scans its workspace dirs, a host's writer proc
scans its workspace root, compares, and writes what it is sent. A file is
identified by its key, the path relative to the workspace root with ``/``
separators (``"proj/train.py"``).

What counts as changed (rsync's quick check, then content hashes): a file whose
size and mtime (preserved on the destination) match is taken as unchanged, unless
it was written within ``RACY_NS`` of a sync (2 s on coarse-timestamp filesystems) (git's "racily clean" rule: the
filesystem clock ticks coarsely, so two writes in one tick share an mtime);
every other candidate is compared by SHA-256, whole or per ``BLOCK`` bytes for
large files, and only differing content moves.
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
import tempfile

from ..transport.mailbox import socket_dir

BLOCK = 1 << 20  # bytes per block of a large file
LARGE = 4 * BLOCK  # files at least this big are compared and patched by blocks
RACY_NS = 50_000_000  # files modified this close to a sync are verified by hash next time (fine-grained clocks)
RACY_COARSE_NS = 2_000_000_000  # ... on filesystems whose timestamps are whole milliseconds or coarser


def racy(mtime_ns: int, scan_ns: int) -> bool:
    """Whether a file with this mtime may have been changed again in the same clock tick as the scan."""
    window = RACY_COARSE_NS if mtime_ns % 1_000_000 == 0 else RACY_NS
    return mtime_ns >= scan_ns - window
META_DIR = ".monarch-tensor"  # this project's own files (SLURM logs, a root's records): never synced
EXCLUDED_NAMES = frozenset({"__pycache__", ".git", ".hg", ".svn", META_DIR, ".mypy_cache", ".pytest_cache",
                            ".ruff_cache", ".ipynb_checkpoints"})
EXCLUDED_SUFFIXES = (".pyc", ".pyo", ".swp")


def scan(base: str, prefix: str = "") -> dict[str, tuple[int, int, int]]:
    """Every regular file under ``base`` as ``{prefix + relpath: (size, mtime_ns, permission bits)}``;
    symlinks are followed, to files, and to directories outside ``base`` (a link to a directory inside it
    would bring its files twice, as a venv's ``lib64 -> lib`` would; one to a directory that holds ``base``
    would loop). (Plain tuples: a scan of a 5,000-file workspace is on the critical
    path of every sync, and the client sends them as its manifest as they are.)

    >>> scan("/tmp/proj", "proj/")  # doctest: +SKIP
    {'proj/train.py': (120, 1795550000000000000, 420)}
    """
    out: dict[str, tuple[int, int, int]] = {}
    if not os.path.isdir(base):
        return out
    names, suffixes, is_reg = EXCLUDED_NAMES, EXCLUDED_SUFFIXES, stat.S_ISREG
    stack = [(base, prefix)]
    while stack:
        d, p = stack.pop()
        try:
            it = os.scandir(d)
        except (FileNotFoundError, NotADirectoryError):
            continue
        with it:
            for e in it:
                name = e.name
                if name in names or name.endswith(suffixes):
                    continue
                try:
                    if e.is_dir(follow_symlinks=False):
                        if not name.endswith(META_DIR):  # (a nested root's records: meta_dir)
                            stack.append((e.path, f"{p}{name}/"))
                        continue
                    st = e.stat()
                except OSError:  # vanished, or a dangling symlink
                    continue
                mode = st.st_mode
                if is_reg(mode):
                    out[p + name] = (st.st_size, st.st_mtime_ns, mode & 0o7777)
                elif stat.S_ISDIR(mode) and _outside(e.path, base):  # a symlink to a directory
                    stack.append((e.path, f"{p}{name}/"))
    return out


def _outside(link: str, base: str) -> bool:
    """Whether the directory that ``link`` points to and ``base`` are apart: neither holds the other."""
    target, top = os.path.realpath(link), os.path.realpath(base)
    return not (_within(target, top) or _within(top, target))


def _within(path: str, d: str) -> bool:
    return path == d or path.startswith(d.rstrip("/") + "/")


def file_digest(path: str) -> bytes:
    """SHA-256 of a whole file."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(BLOCK):
            h.update(chunk)
    return h.digest()


def block_digests(path: str) -> list[bytes]:
    """SHA-256 of each ``BLOCK`` bytes of a file."""
    out = []
    with open(path, "rb") as f:
        while chunk := f.read(BLOCK):
            out.append(hashlib.sha256(chunk).digest())
    return out


def fingerprint(path: str, size: int) -> bytes | list[bytes]:
    """What two ends compare: block digests for a large file, else the whole file's digest."""
    return block_digests(path) if size >= LARGE else file_digest(path)


def changed_blocks(path: str, theirs: list[bytes]) -> list[int]:
    """Indices of the blocks of ``path`` whose digest differs from ``theirs`` (or that they lack)."""
    return [i for i, d in enumerate(block_digests(path)) if i >= len(theirs) or theirs[i] != d]


def module_name(key: str, dirs: list[str]) -> str | None:
    """The importable module a synced file is, given the synced dirs on sys.path (``root/dst``).

    >>> module_name("proj/pkg/mod.py", ["proj"])
    'pkg.mod'
    >>> module_name("proj/pkg/__init__.py", ["proj"])
    'pkg'
    """
    if not key.endswith(".py"):
        return None
    for d in sorted(dirs, key=len, reverse=True):
        rel = key if d == "" else (key[len(d) + 1:] if key.startswith(d + "/") else None)
        if rel is None:
            continue
        parts = rel[:-3].split("/")
        if parts[-1] == "__init__":
            parts.pop()
        if parts and all(p.isidentifier() for p in parts):
            return ".".join(parts)
    return None


# ---- the destination side -----------------------------------------------------------
class Writer:
    """Applies writes, patches and deletes to a workspace root, each file replaced atomically.

    >>> w = Writer("/tmp/ws-root")  # doctest: +SKIP
    >>> w.write("proj/a.py", 0, b"x = 1\\n")  # doctest: +SKIP
    >>> w.finish("proj/a.py", size=6, mtime_ns=..., mode=0o644)  # doctest: +SKIP
    """

    def __init__(self, root: str) -> None:
        self.root = root
        self._open: dict[str, list] = {}  # key -> [fd, temp path, destination, bytes written up to]
        self.ops: list[tuple] = []  # the finish/touch/delete ops applied, for the commit
        self._dirs: set[str] = set()  # directories this writer made or found (a delete forgets them)
        self._tag = f".sync-{os.getpid()}-{os.urandom(4).hex()}-"  # its temp files' names, then a count
        self._count = 0

    def path(self, key: str) -> str:
        parts = key.split("/")
        if not key or key.startswith("/") or any(p in ("", ".", "..") for p in parts) or "\0" in key:
            raise ValueError(f"bad workspace path {key!r}: must be relative, without empty, '.' or '..' parts")
        return os.path.join(self.root, *parts)

    def _make_dir(self, d: str) -> None:
        if d in self._dirs:
            return
        try:
            os.makedirs(d, exist_ok=True)
        except (FileExistsError, NotADirectoryError):  # a file where a directory is now wanted
            p = d
            while len(p) > len(self.root):
                if os.path.lexists(p) and not os.path.isdir(p):
                    os.unlink(p)
                    break
                p = os.path.dirname(p)
            os.makedirs(d, exist_ok=True)
        self._dirs.add(d)

    def _fd(self, key: str, patch: bool) -> int:
        got = self._open.get(key)
        if got is not None:
            return got[0]
        dest = self.path(key)
        d = os.path.dirname(dest)
        self._make_dir(d)
        self._count += 1
        tmp = os.path.join(d, f"{self._tag}{self._count}")
        fd = open_new(tmp)
        self._open[key] = [fd, tmp, dest, 0]
        if patch:
            try:
                with open(dest, "rb") as src:
                    self._open[key][3] = -1  # the old version's length: truncate at the end
                    _copy_fd(src.fileno(), fd)
            except (FileNotFoundError, IsADirectoryError):
                pass
        return fd

    def write(self, key: str, offset: int, data, patch: bool = False) -> None:
        """Write ``data`` at ``offset`` of the new version of ``key`` (``patch``: start from the old one)."""
        fd = self._fd(key, patch)
        view = memoryview(data).cast("B")
        while view:
            n = os.pwrite(fd, view, offset)
            view, offset = view[n:], offset + n
        entry = self._open[key]
        if entry[3] != -1 and offset > entry[3]:
            entry[3] = offset

    def copied(self, key: str, n: int) -> None:
        """``n`` bytes of ``key``'s new version were written at its start through its fd (``_fd``)."""
        entry = self._open[key]
        if entry[3] != -1 and n > entry[3]:
            entry[3] = n

    def finish(self, key: str, size: int, mtime_ns: int, mode: int, patch: bool = False) -> None:
        """Complete ``key``: truncate to ``size``, set mode and mtime, move into place."""
        self._fd(key, patch)
        fd, tmp, dest, end = self._open.pop(key)
        if place(fd, tmp, dest, size, end, mtime_ns, mode):
            self.forget_dirs(dest)

    def claim(self, key: str) -> tuple[str, str]:
        """``(temp path, destination)`` for a new version of ``key`` that another thread writes and places
        (``place``); the directory is made here (this Writer's bookkeeping stays on one thread)."""
        dest = self.path(key)
        d = os.path.dirname(dest)
        self._make_dir(d)
        self._count += 1
        return os.path.join(d, f"{self._tag}{self._count}"), dest

    def forget_dirs(self, dest: str) -> None:
        """``dest`` was a directory, removed to put a file there: forget what was made under it."""
        self._dirs = {d for d in self._dirs if not (d == dest or d.startswith(dest + os.sep))}

    def touch(self, key: str, mtime_ns: int, mode: int) -> None:
        """Same content, new metadata (a file that was saved without changes)."""
        dest = self.path(key)
        os.chmod(dest, mode & 0o7777)
        os.utime(dest, ns=(mtime_ns, mtime_ns))

    def delete(self, key: str) -> None:
        dest = self.path(key)
        self._dirs.clear()  # it may remove directories left empty
        try:
            os.unlink(dest)
        except (FileNotFoundError, NotADirectoryError, IsADirectoryError):  # gone, or a file/directory swap
            return
        if key.endswith(".py"):
            _remove_pyc(dest)
        d = os.path.dirname(dest)
        while d != self.root and d.startswith(self.root):  # remove directories left empty
            try:
                if set(os.listdir(d)) - {"__pycache__"}:
                    break
                _rmtree(d)
            except OSError:
                break
            d = os.path.dirname(d)

    def abort(self) -> None:
        """Drop every unfinished file (a failed sync leaves the old versions in place)."""
        for fd, tmp, _, _ in self._open.values():
            os.close(fd)
            try:
                os.unlink(tmp)
            except OSError:
                pass
        self._open.clear()


def open_new(tmp: str) -> int:
    """A new temp file at ``tmp`` (never an existing one), open for writing, private until placed."""
    return os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o600)


def place(fd: int, tmp: str, dest: str, size: int, end: int, mtime_ns: int, mode: int) -> bool:
    """Close the new version ``tmp`` of ``dest`` (open at ``fd``, its bytes written up to ``end``) with
    ``size`` bytes, ``mode`` and ``mtime_ns``, and move it into place; True when a directory stood at
    ``dest`` and was removed for it. Touches no ``Writer``: any thread may call it."""
    try:
        if end != size:
            os.ftruncate(fd, size)
        os.fchmod(fd, mode & 0o7777)
        os.utime(fd, ns=(mtime_ns, mtime_ns))
    finally:
        os.close(fd)
    was_dir = False
    try:
        os.replace(tmp, dest)
    except IsADirectoryError:  # a directory where a file is now wanted
        _rmtree(dest)
        was_dir = True
        os.replace(tmp, dest)
    if dest.endswith(".py"):  # a stale .pyc with the same mtime/size would shadow the new source
        _remove_pyc(dest)
    return was_dir


def _copy_fd(src: int, dst: int) -> None:
    size = os.fstat(src).st_size
    off = 0
    try:
        while off < size:
            n = os.copy_file_range(src, dst, size - off, off, off)
            if n == 0:
                break
            off += n
        return
    except (AttributeError, OSError):
        pass
    os.lseek(src, off, 0)
    while chunk := os.read(src, BLOCK):
        os.pwrite(dst, chunk, off)
        off += len(chunk)


def _remove_pyc(py_path: str) -> None:
    cache = os.path.join(os.path.dirname(py_path), "__pycache__")
    stem = os.path.basename(py_path)[:-3] + "."
    try:
        names = os.listdir(cache)
    except OSError:
        return
    for n in names:
        if n.startswith(stem) and n.endswith(".pyc"):
            try:
                os.unlink(os.path.join(cache, n))
            except OSError:
                pass


def _rmtree(path: str) -> None:
    import shutil

    shutil.rmtree(path, ignore_errors=True)


# ---- per-root bookkeeping -----------------------------------------------------------------
# A root's records (racy files, rewritten files, synced dirs) live outside it, so the synced tree holds the
# source's files and nothing else (as Monarch's): beside the root (``/data/ws`` -> ``/data/.ws.monarch-tensor``),
# on its filesystem and shared as it is; where the root's parent is not writable, in this user's directory
# of this host (``socket_dir``), under a name made from the root's real path.
def meta_dir(root: str) -> str:
    """The directory of ``root``'s records.

    >>> meta_dir("/data/ws")  # doctest: +SKIP
    '/data/.ws.monarch-tensor'
    """
    root = os.path.abspath(root)
    parent, name = os.path.split(root)
    beside = os.path.join(parent, f".{name}{META_DIR}")
    if name and (os.path.isdir(beside) or os.access(parent, os.W_OK | os.X_OK)):
        return beside
    key = hashlib.sha256(os.path.realpath(root).encode()).hexdigest()[:24]
    return os.path.join(socket_dir(), "roots", key)


def adopt_inner_records(root: str) -> None:
    """Records an earlier version kept inside the root (``root/.monarch-tensor``) move to ``meta_dir(root)``,
    so that a root it synced or mounted is still known as ours and its tree holds the source's files only."""
    inner = os.path.join(root, META_DIR)
    try:
        names = os.listdir(inner)
    except OSError:  # (none: the usual case)
        return
    if not names or not all(n.endswith(".json") for n in names):
        return  # not only records: this project's other files (a SlurmJob's logs) stay where they are
    outer = meta_dir(root)
    if os.path.isdir(outer):  # (records of the new kind already: the old ones are stale)
        _rmtree(inner)
        return
    import shutil

    os.makedirs(os.path.dirname(outer), exist_ok=True)
    shutil.move(inner, outer)


def read_meta(root: str, name: str, default):
    try:
        with open(os.path.join(meta_dir(root), name)) as f:
            return json.load(f)
    except (OSError, ValueError):
        return default


def write_meta(root: str, name: str, value) -> None:
    d = meta_dir(root)
    os.makedirs(d, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".meta-", dir=d)
    with os.fdopen(fd, "w") as f:
        json.dump(value, f)
    os.replace(tmp, os.path.join(d, name))
