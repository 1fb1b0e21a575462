"""Large message buffers through shared memory, for messages between procs of one host.

A message whose out-of-band buffers add up to ``SHM_THRESHOLD`` bytes or more
is sent with its buffers copied once into a fresh file in ``/dev/shm``; the
receiver maps that file and unpickles straight from the mapping (no copy),
then unlinks it. Through the control socket the same bytes would be copied
several times by zmq and the kernel. Files are named ``mt-<pid>-...`` so those
of a proc that died mid-transfer can be removed by whoever reaps it.
"""

from __future__ import annotations

import glob
import mmap
import os
import uuid

SHM_DIR = "/dev/shm"
SHM_THRESHOLD = int(os.environ.get("MONARCH_TENSOR_SHM_THRESHOLD", str(1 << 20)))


def available() -> bool:
    return os.path.isdir(SHM_DIR) and os.access(SHM_DIR, os.W_OK)


def write(buffers: list) -> tuple[str, list[tuple[int, int]]]:
    """Copy ``buffers`` into one new shared-memory file; return its name and (offset, length) of each."""
    views = [memoryview(b).cast("B") for b in buffers]
    layout, offset = [], 0
    for v in views:
        layout.append((offset, v.nbytes))
        offset += (v.nbytes + 63) & ~63
    name = f"mt-{os.getpid()}-{uuid.uuid4().hex[:12]}"
    path = os.path.join(SHM_DIR, name)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.ftruncate(fd, max(offset, 1))
        with mmap.mmap(fd, max(offset, 1)) as m:
            for v, (off, n) in zip(views, layout):
                m[off:off + n] = v
    except BaseException:
        os.unlink(path)
        raise
    finally:
        os.close(fd)
    return name, layout


def read(name: str, layout: list[tuple[int, int]]) -> list[memoryview]:
    """Map the file, unlink it, and return a view per buffer (kept alive by the views)."""
    if "/" in name or not name.startswith("mt-"):
        raise ValueError(f"bad shared-memory name {name!r}")
    path = os.path.join(SHM_DIR, name)
    fd = os.open(path, os.O_RDWR)
    try:
        size = os.fstat(fd).st_size
        m = mmap.mmap(fd, size)
    finally:
        os.close(fd)
        os.unlink(path)
    whole = memoryview(m)
    return [whole[off:off + n] for off, n in layout]


def remove_files_of(pid: int) -> None:
    """Remove leftovers of a process that died before its receivers mapped them."""
    for path in glob.glob(os.path.join(SHM_DIR, f"mt-{pid}-*")):
        try:
            os.unlink(path)
        except OSError:
            pass
