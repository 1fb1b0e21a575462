"""``cma``: cross-memory attach (``process_vm_readv`` / ``process_vm_writev``) for CPU memory on one host.

One-sided: the owner does nothing during a transfer. The reader first reads
the registration's 8-byte slot in the owner (same call, another iovec), so a
dropped buffer is refused before any byte moves. The kernel may transfer
less than asked: the loop goes on from where it stopped. When the kernel
refuses (EPERM: another uid, a non-dumpable owner, Yama ptrace_scope), the
owner is remembered as refused and the transfer falls back to the next
backend (``BackendRefusedError``). Within one process it is a plain memmove.

A large transfer is split into pieces (``pieces``) that up to ``threads()``
threads take in turn, the calling thread among them. The kernel pins and
copies page by page: on this project's 2-core test machine one thread reached
about 60% of memcpy at 64 MiB and two threads about memcpy's speed
(bench/rdma_bench.py).
"""

from __future__ import annotations

import ctypes
import errno
import functools
import os
import threading
from concurrent.futures import ThreadPoolExecutor

from .._host import alive, host_id, per_process
from .._memory import Mem
from .._registry import Descriptor
from ..errors import BackendRefusedError, BufferDroppedError, OwnerDiedError, TransferError
from .base import Backend, check_deadline

_MAX_CALL = 1 << 30  # bytes per call (the kernel caps a call at about 2 GiB anyway)
PIECE_MIN = 4 << 20  # bytes: a transfer under twice this runs in one piece on the calling thread
PIECE_MAX = 32 << 20  # bytes: larger transfers are cut into more pieces than threads, taken in turn
FORCE_ERRNO: int | None = None  # tests: make every call fail with this errno (e.g. errno.EPERM)


class _IOVec(ctypes.Structure):
    _fields_ = [("iov_base", ctypes.c_void_p), ("iov_len", ctypes.c_size_t)]


_libc = None


def _lib():
    global _libc
    if _libc is None:
        lib = ctypes.CDLL(None, use_errno=True)
        for name in ("process_vm_readv", "process_vm_writev"):
            fn = getattr(lib, name)
            fn.restype = ctypes.c_ssize_t
            fn.argtypes = [ctypes.c_int, ctypes.POINTER(_IOVec), ctypes.c_ulong, ctypes.POINTER(_IOVec),
                           ctypes.c_ulong, ctypes.c_ulong]
        _libc = lib
    return _libc


@per_process
def allow_readers() -> None:
    """Let other processes of this user attach to our memory under Yama ``ptrace_scope=1`` (once per process)."""
    try:
        with open("/proc/sys/kernel/yama/ptrace_scope") as f:
            if f.read().strip() != "1":
                return
    except OSError:
        return
    PR_SET_PTRACER, PR_SET_PTRACER_ANY = 0x59616D61, ctypes.c_ulong(-1).value
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PTRACER, ctypes.c_ulong(PR_SET_PTRACER_ANY), 0, 0, 0)


def _call(write: bool, pid: int, local: int, remote: int, n: int) -> int:
    if FORCE_ERRNO is not None:
        return -FORCE_ERRNO
    lib = _lib()
    liov, riov = _IOVec(local, n), _IOVec(remote, n)
    fn = lib.process_vm_writev if write else lib.process_vm_readv
    r = fn(pid, ctypes.byref(liov), 1, ctypes.byref(riov), 1, 0)
    return r if r >= 0 else -ctypes.get_errno()


@functools.lru_cache(maxsize=1)
def threads() -> int:
    """Threads per large transfer: ``$MONARCH_TENSOR_CMA_THREADS``, else the cores we may run on (at most 8)."""
    env = os.environ.get("MONARCH_TENSOR_CMA_THREADS")
    if env:
        if not env.isdigit() or int(env) < 1:
            raise ValueError(f"MONARCH_TENSOR_CMA_THREADS must be a positive integer, got {env!r}")
        return int(env)
    return max(1, min(8, len(os.sched_getaffinity(0))))


@per_process
def _executor() -> ThreadPoolExecutor:
    """The helper threads of this process (a forked child makes its own)."""
    return ThreadPoolExecutor(max(1, threads() - 1), thread_name_prefix="monarch-tensor-cma")


def pieces(n: int, k: int, align: int = 4096) -> list[tuple[int, int]]:
    """Split ``n`` bytes for ``k`` threads: (offset, length) pieces, page-aligned, of ``PIECE_MIN`` to ``PIECE_MAX``."""
    if k <= 1 or n < 2 * PIECE_MIN:
        return [(0, n)]
    step = min(PIECE_MAX, max(PIECE_MIN, -(-n // k)))
    step = -(-step // align) * align
    return [(o, min(step, n - o)) for o in range(0, n, step)]


@functools.lru_cache(maxsize=1)
def _has_pid_ns() -> bool:
    return os.path.exists("/proc/self/ns/pid")  # (a stat of /proc costs ~150 µs on some VMs)


class CmaBackend(Backend):
    name = "cma"

    def __init__(self) -> None:
        super().__init__()
        self.refused: set[tuple[int, int]] = set()  # owners (pid, start) the kernel refused

    def available(self) -> bool:
        return _has_pid_ns()

    def usable(self, desc: Descriptor, local: Mem) -> bool:
        return desc.host == host_id() and (desc.pid, desc.started) not in self.refused

    def _check_slot(self, desc: Descriptor) -> None:
        word = ctypes.c_uint64(0)
        self._move(False, desc, ctypes.addressof(word), desc.slot_addr, 8)
        if word.value != desc.buf_id:
            raise BufferDroppedError(f"buffer {desc.buf_id} of pid {desc.pid} was dropped by its owner")

    def _move(self, write: bool, desc: Descriptor, local: int, remote: int, n: int, deadline: float = 0.0) -> None:
        if desc.pid == os.getpid() and FORCE_ERRNO is None:
            ctypes.memmove(remote, local, n) if write else ctypes.memmove(local, remote, n)
            return
        parts = pieces(n, threads())
        if len(parts) == 1:
            self._move_piece(write, desc, local, remote, n, deadline)
            return
        todo = iter(parts)
        lock = threading.Lock()
        errors: list[BaseException] = []

        def drain() -> None:
            while not errors:
                with lock:
                    o, m = next(todo, (0, 0))
                if not m:
                    return
                try:
                    self._move_piece(write, desc, local + o, remote + o, m, deadline)
                except BaseException as e:  # noqa: BLE001 - raised by the caller once every helper is done
                    errors.append(e)

        helpers = [_executor().submit(drain) for _ in range(min(threads(), len(parts)) - 1)]
        drain()
        for f in helpers:
            f.result()
        if errors:
            raise errors[0]

    def _move_piece(self, write: bool, desc: Descriptor, local: int, remote: int, n: int, deadline: float) -> None:
        done = 0
        while done < n:
            if deadline:
                check_deadline(deadline, f"cma transfer of {n} bytes")
            r = _call(write, desc.pid, local + done, remote + done, min(n - done, _MAX_CALL))
            if r > 0:
                done += r
                continue
            err = -r
            if r == 0:
                raise TransferError(f"process_vm_{'writev' if write else 'readv'} made no progress at byte {done}")
            if err == errno.ESRCH or not alive(desc.pid, desc.started):
                raise OwnerDiedError(f"the owner of buffer {desc.buf_id} (pid {desc.pid}) died")
            if err == errno.EPERM:
                self.refused.add((desc.pid, desc.started))
                raise BackendRefusedError(f"the kernel refused cross-memory attach to pid {desc.pid} (EPERM: "
                                          "another user, a non-dumpable process, or Yama ptrace_scope)")
            if err == errno.EFAULT:
                raise BufferDroppedError(f"buffer {desc.buf_id} of pid {desc.pid} is no longer mapped "
                                         "(dropped by its owner)")
            raise TransferError(f"process_vm_{'writev' if write else 'readv'}: {os.strerror(err)}")

    def _read(self, desc: Descriptor, offset: int, local: Mem, deadline: float) -> None:
        self._check_slot(desc)
        self._move(False, desc, local.ptr, desc.addr + offset, local.nbytes, deadline)

    def _write(self, desc: Descriptor, offset: int, local: Mem, deadline: float) -> None:
        self._check_slot(desc)
        self._move(True, desc, local.ptr, desc.addr + offset, local.nbytes, deadline)
