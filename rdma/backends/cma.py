"""``cma``: cross-memory attach (``process_vm_readv`` / ``process_vm_writev``) for CPU memory on one host.

One-sided: the owner does nothing during a transfer. Every transfer reads the
registration's 8-byte slot in the owner, which holds the buffer's id until it
is dropped, and a dropped buffer is refused before any byte reaches the
destination: a small read reads the slot in the same system call as its data
(another iovec, ahead of the data, into scratch memory copied out once the
slot checks), any other transfer in a call of its own first. The kernel may
transfer less than asked: the loop goes on from where it stopped. When the
kernel refuses (EPERM: another uid, a non-dumpable owner, Yama ptrace_scope),
the owner is remembered as refused and the transfer falls back to the next
backend (``BackendRefusedError``). Within one process it is a plain memmove.

A large transfer is split into pieces (``pieces``) that up to ``threads()``
threads take in turn, the calling thread among them. The kernel pins the
owner's pages in small batches and copies them page by page, so the owner's
page size matters. On this project's 2-core test machine, at 64 and 256 MiB:
one thread moved 37-50% of memcpy's bytes per second from 4 KiB pages and
about 100% from 2 MiB pages (a scratch loop of ``process_vm_readv``); two
threads, in bench/rdma_bench.py at 64 MiB, 72-81% and 90-130%. Procs
allocate large tensors on 2 MiB pages (``THP_MEM_ALLOC_ENABLE``,
monarch_tensor/hosts/host.py).

Where the CPU has fast string copies (x86's ``erms``/``fsrm`` flags), the
kernel copies between processes with ``rep movsb``, and that copy is several
times slower when its destination lies a few bytes past its source, counted
within a page (``short_distance``: glibc's memmove steers clear of the case,
the kernel's copy does not). On this project's VM (an AMD EPYC) a distance of
1 to 31 bytes made 64 KiB-64 MiB reads 1.6-11x slower: a 4 MiB read of a
page-aligned tensor took 1.7-2.7 ms into a bytearray or a numpy array (whose
bytes start 16 bytes into a page) against 0.22-0.4 ms into a tensor (64 bytes
in, or page-aligned), 0.37-0.47 ms staged (bench/rdma_bench.py --distance). Such a transfer goes through this thread's staging
memory (``STAGE`` bytes at a time, placed ``STAGE_SHIFT`` bytes past the
remote bytes within a page), then memmove: one more copy, of cache-warm bytes.
"""

from __future__ import annotations

import ctypes
import errno
import functools
import os
import threading
from concurrent.futures import ThreadPoolExecutor

from monarch_tensor.config import setting

from .._host import alive, host_id, my_pid, per_process
from .._memory import Mem
from .._registry import Descriptor
from ..errors import BackendRefusedError, BufferDroppedError, OwnerDiedError, TransferError
from .base import Backend, check_deadline

_MAX_CALL = 1 << 30  # bytes per call (the kernel caps a call at about 2 GiB anyway)
SHORT = 32  # a copy whose destination lies 1 to SHORT - 1 bytes past its source, within a page, is slow
STAGE = 2 << 20  # bytes per staged call (see the docstring)
STAGE_SHIFT = 256  # where staging memory sits within a page, past the remote bytes (0 and 32-4095: fast here)
STAGE_MIN = 16 << 10  # bytes: smaller transfers are moved directly however far apart (a few µs at most)
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


def _call(write: bool, pid: int, local: int, remote: int, n: int, slot: tuple[int, int] | None = None) -> int:
    """One ``process_vm_readv``/``writev`` of ``n`` bytes: the bytes moved, or minus the errno. With ``slot``
    (an 8-byte word's address here, the registration slot's there), a read first reads the slot in the
    same call, and its 8 bytes count in the result."""
    if FORCE_ERRNO is not None:
        return -FORCE_ERRNO
    lib = _lib()
    fn = lib.process_vm_writev if write else lib.process_vm_readv
    if slot is None:
        r = fn(pid, ctypes.byref(_IOVec(local, n)), 1, ctypes.byref(_IOVec(remote, n)), 1, 0)
    else:
        _, liov, riov, _ = _one_call()
        liov[0].iov_base, liov[1].iov_base, liov[1].iov_len = slot[0], local, n  # ([0] is 8 bytes long)
        riov[0].iov_base, riov[1].iov_base, riov[1].iov_len = slot[1], remote, n
        r = fn(pid, liov, 2, riov, 2, 0)
    return r if r >= 0 else -ctypes.get_errno()


_tls = threading.local()
ONE_CALL_MAX = 32 << 10  # bytes: a read up to this size takes the slot and the data in one call (_read)


def _one_call():
    """This thread's memory for one-call reads, made once (a ctypes array costs about a µs to build): the
    scratch address (room for the slot's word and ``ONE_CALL_MAX`` bytes of data anywhere within a page:
    ``_placed``), two 2-entry iovec arrays, and the scratch itself (kept alive)."""
    held = getattr(_tls, "one_call", None)
    if held is None:
        scratch = ctypes.create_string_buffer(8 + ONE_CALL_MAX + 4096)
        liov, riov = (_IOVec * 2)(_IOVec(0, 8), _IOVec(0, 0)), (_IOVec * 2)(_IOVec(0, 8), _IOVec(0, 0))
        held = _tls.one_call = (ctypes.addressof(scratch), liov, riov, scratch)
    return held


def _placed(base: int, remote: int) -> int:
    """The address at or after ``base`` (within 4 KiB) that lies ``STAGE_SHIFT`` bytes past ``remote`` within a
    page: a kernel copy between the two is of the fast kind (``short_distance``)."""
    return base + ((remote + STAGE_SHIFT - base) & 0xFFF)


def _stage() -> int:
    """This thread's staging memory: ``STAGE`` bytes anywhere within a page (``_placed``), made on first use
    and kept (a thread that stages once is likely to again: fresh memory costs page faults)."""
    held = getattr(_tls, "stage", None)
    if held is None or len(held) < STAGE + 4096:  # (tests change STAGE)
        held = _tls.stage = ctypes.create_string_buffer(STAGE + 4096)
    return ctypes.addressof(held)


@functools.lru_cache(maxsize=1)
def _string_copies() -> bool:
    """Whether this CPU has fast string copies (``erms`` or ``fsrm`` in /proc/cpuinfo's flags), which the
    kernel copies user memory with (``rep movsb``)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    flags = line.split(":", 1)[1].split()
                    return "erms" in flags or "fsrm" in flags
    except OSError:
        pass
    return False


def short_distance(dst: int, src: int) -> bool:
    """Whether the kernel's copy from ``src`` to ``dst`` is of the slow kind: ``dst`` lies 1 to ``SHORT`` - 1
    bytes past ``src`` within a page, on a CPU with fast string copies (see the module's docstring)."""
    return 0 < (dst - src) & 0xFFF < SHORT and _string_copies()


@functools.lru_cache(maxsize=1)
def threads() -> int:
    """Threads per large transfer: ``$MONARCH_TENSOR_CMA_THREADS``, else the cores we may run on (at most 8)."""
    chosen = setting("MONARCH_TENSOR_CMA_THREADS")
    if chosen is not None:
        return chosen
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

    def unavailable_reason(self) -> str | None:
        return None if self.available() else "cross-memory attach (process_vm_readv) needs Linux with /proc"

    def usable(self, desc: Descriptor, local: Mem) -> bool:
        return desc.host == host_id() and (desc.pid, desc.started) not in self.refused

    def _check_slot(self, desc: Descriptor) -> None:
        word = ctypes.c_uint64(0)
        self._move(False, desc, ctypes.addressof(word), desc.slot_addr, 8)
        if word.value != desc.buf_id:
            raise BufferDroppedError(f"buffer {desc.buf_id} of pid {desc.pid} was dropped by its owner")

    def _move(self, write: bool, desc: Descriptor, local: int, remote: int, n: int, deadline: float = 0.0) -> None:
        if desc.pid == my_pid() and FORCE_ERRNO is None:
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
        if n >= STAGE_MIN and (short_distance(remote, local) if write else short_distance(local, remote)):
            self._move_staged(write, desc, local, remote, n, deadline)
            return
        self._move_direct(write, desc, local, remote, n, deadline)

    def _move_staged(self, write: bool, desc: Descriptor, local: int, remote: int, n: int, deadline: float) -> None:
        """``_move_direct`` through this thread's staging memory, ``STAGE`` bytes at a time, with memmove
        between it and ``local`` (see ``short_distance``)."""
        base = _stage()
        done = 0
        while done < n:
            m = min(STAGE, n - done)
            stage = _placed(base, remote + done)
            if write:
                ctypes.memmove(stage, local + done, m)
                self._move_direct(True, desc, stage, remote + done, m, deadline)
            else:
                self._move_direct(False, desc, stage, remote + done, m, deadline)
                ctypes.memmove(local + done, stage, m)
            done += m

    def _move_direct(self, write: bool, desc: Descriptor, local: int, remote: int, n: int, deadline: float) -> None:
        done = 0
        while done < n:
            if deadline:
                check_deadline(deadline, f"cma transfer of {n} bytes")
            r = _call(write, desc.pid, local + done, remote + done, min(n - done, _MAX_CALL))
            if r <= 0:
                self._failed(write, desc, r, done)
            done += r

    def _failed(self, write: bool, desc: Descriptor, r: int, done: int) -> None:
        """Raise what a call's result ``r`` (0, or minus the errno) means, ``done`` bytes into a piece."""
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
        n, remote = local.nbytes, desc.addr + offset
        if n > ONE_CALL_MAX or desc.pid == my_pid():
            self._check_slot(desc)
            self._move(False, desc, local.ptr, remote, n, deadline)
            return
        # A small read: the slot and the data in one call (a call is about 4 µs of a 4 KiB read's 11 here),
        # into this thread's scratch memory, copied out once the slot shows the buffer alive (a failed
        # read leaves the destination as it was).
        data = _placed(_one_call()[0] + 8, remote)  # (the copy out of the kernel: of the fast kind)
        word = data - 8
        r = _call(False, desc.pid, data, remote, n, (word, desc.slot_addr))
        if r < 8:
            self._failed(False, desc, r, 0)  # (a result of 1-7 bytes cannot be: the slot is one word)
        if ctypes.c_uint64.from_address(word).value != desc.buf_id:
            raise BufferDroppedError(f"buffer {desc.buf_id} of pid {desc.pid} was dropped by its owner")
        ctypes.memmove(local.ptr, data, r - 8)
        if r - 8 < n:  # the kernel moved less than asked: go on from there
            self._move_piece(False, desc, local.ptr + r - 8, remote + r - 8, n - (r - 8), deadline)

    def _write(self, desc: Descriptor, offset: int, local: Mem, deadline: float) -> None:
        self._check_slot(desc)
        self._move(True, desc, local.ptr, desc.addr + offset, local.nbytes, deadline)
