"""``tcp``: everything else, over the data plane's own TCP connections (never the control socket).

The owner runs a small server (one thread per connection, started with its
first registration) that serves reads and writes of registered buffers to
whoever presents the buffer's id and secret token. Readers keep a pool of
connections per owner; a large transfer is cut into chunks spread over
``STREAMS`` connections in parallel. CUDA buffers are staged through the CPU
on both sides.
"""

from __future__ import annotations

import atexit
import concurrent.futures
import ctypes
import socket
import struct
import sys
import threading
import time

from monarch_tensor.config import setting
from monarch_tensor.transport.mailbox import _crowded, _sched_yield

from .._host import alive, host_id, per_process
from .._memory import Mem
from .._registry import Descriptor, registry
from ..errors import BufferDroppedError, OwnerDiedError, TransferError, TransferTimeoutError
from .base import Backend, check_deadline

STREAMS = setting("MONARCH_TENSOR_RDMA_TCP_STREAMS")
MIN_STREAM_CHUNK = 4 << 20  # below this a transfer uses one connection
# A client (reader or writer) polls its socket this long for the owner's answer before it blocks: blocked, it
# waited for the scheduler to wake its core (65 µs for a 4 KiB read on this project's 2-core VM; 24 µs polling).
# The owner's thread polls as long for the next request after a transfer that had one connection, while
# such requests keep coming within that time (see _next_request).
SPIN_S = setting("MONARCH_TENSOR_RDMA_TCP_SPIN_US") * 1e-6
TICK_S = 0.1  # a reader's socket waits in the kernel at most this long at a time, then checks its deadline
# The longest a connect may wait: a socket refuses a timeout past about 9.2e9 s (OverflowError; a transfer's
# timeout may be float("inf")), and the kernel gives up on an unanswered connect after about 2 minutes anyway.
CONNECT_MAX_S = 3600.0
# Every header on a data connection is HEAD bytes. Data behind a header of another length (a 1-byte
# status before) lay misaligned against the reader's memory, and the kernel's copy out of the socket
# slowed down: 1-4 MiB reads were 1.6x slower on this project's VM.
HEAD = 64
# magic, op, flags, buffer id, token, offset, length, the reader's CPU (NO_CPU: unknown, or another host); padding
_REQ = struct.Struct(f"!4sBBQQQQH{HEAD - 40}x")
NO_CPU = 0xFFFF
_MAGIC = b"MTDP"
READ, WRITE = 1, 2
# Atomics on one 8-byte word, done by the owner: the header is followed by two operands (_OPERANDS: the
# addend and 0, or compare and swap), the answer by the word's value before.
FETCH_ADD, COMPARE_SWAP = 3, 4
_OPERANDS = struct.Struct("!QQ")
ALONE = 1  # a request's flag: the only connection of its transfer (the owner polls for a write's bytes)
OK, UNKNOWN, RANGE, READONLY, FAILED, MISALIGNED = 0, 1, 2, 3, 4, 5
_ANSWER = [bytes([code]) + bytes(HEAD - 1) for code in range(6)]  # the owner's answer: a status, padded
ALIGN = 4096  # a transfer over several connections is cut at multiples of this
_STATUS = {UNKNOWN: "was dropped by its owner (or never existed there)", RANGE: "range is out of bounds",
           READONLY: "is read-only", FAILED: "failed on the owner's side",
           MISALIGNED: "atomic target is not an 8-byte word at an offset that is a multiple of 8"}
_ATOMIC_LOCK = threading.Lock()  # the owner's atomics, one at a time: atomic with respect to each other


def _send_parts(sock: socket.socket, head: bytes, data=None, deadline: float | None = None) -> None:
    """``head`` then ``data`` in one system call where the kernel takes both (small transfers)."""
    parts: list[bytes | memoryview] = [head] if data is None else [head, memoryview(data).cast("B")]
    sent = sock.sendmsg(parts)
    for part in parts:
        if sent >= len(part):
            sent -= len(part)
            continue
        view = memoryview(part)[sent:]
        sent = 0
        while view:
            try:
                view = view[sock.send(view):]
            except BlockingIOError:  # a reader's kernel send timeout (TICK_S): is the deadline past?
                if deadline is not None and time.monotonic() >= deadline:
                    raise TimeoutError("the owner took no bytes before the deadline") from None


def _recv_first(sock: socket.socket, bufs: list, deadline: float | None = None) -> int:
    """``recvmsg_into(bufs)``, polling up to ``SPIN_S`` before a blocking wait under ``deadline``. ``sock``
    is in blocking mode (``client_socket``). Each try that finds nothing yields the core: a polling owner
    thread (``_next_request``) may share it, and would not see the request until the scheduler switched
    them (rounds of 4 KiB reads took 256-290 µs, medians, with a reader that did not yield)."""
    if SPIN_S > 0:
        end = time.perf_counter() + SPIN_S
        while True:
            try:
                return sock.recvmsg_into(bufs, 0, socket.MSG_DONTWAIT)[0]
            except BlockingIOError:
                if time.perf_counter() >= end:
                    break
                _sched_yield()
    while True:
        try:
            return sock.recvmsg_into(bufs)[0]
        except BlockingIOError:  # the kernel's receive timeout (TICK_S): is the deadline past?
            if deadline is not None and time.monotonic() >= deadline:
                raise TimeoutError("the owner sent nothing before the deadline") from None


def _recv_exact(sock: socket.socket, view: memoryview, deadline: float | None = None) -> None:
    """Fill ``view``: one system call per 1 GiB (``MSG_WAITALL``) unless the sender pauses longer than the
    socket's kernel timeout, after which the deadline is checked."""
    got = 0
    while got < len(view):
        try:
            n = sock.recv_into(view[got:], min(len(view) - got, 1 << 30), socket.MSG_WAITALL)
        except BlockingIOError:
            n = -1
        if n == 0:
            raise ConnectionError("connection closed mid-transfer")
        if n > 0:
            got += n
        if got < len(view) and deadline is not None and time.monotonic() >= deadline:
            raise TimeoutError(f"{len(view) - got} bytes had not come at the deadline")


def _recv_rest(sock: socket.socket, view: memoryview, deadline: float | None = None) -> None:
    """Fill ``view`` as ``_recv_exact`` does, but poll while bytes keep coming (each try within ``SPIN_S``
    of the last bytes). Blocked in the middle of a transfer, a thread is woken once per batch of segments,
    and each wake of an idle core costs tens of µs on a VM: a plain client's 1 MiB reads took 235-279 µs
    polling, 315-384 blocked; ``read_into`` got 5-12% faster at 1 MiB and 14-24% at 3 MiB (interleaved).
    It polls ten times ``SPIN_S`` at most: on a slow link the bytes trickle in for long, and the rest is
    waited for blocked. Only for a transfer's only connection: several would poll at once."""
    got = 0
    if SPIN_S > 0:
        now = time.perf_counter()
        end, stop = now + SPIN_S, now + 10 * SPIN_S
        while got < len(view):
            try:
                n = sock.recv_into(view[got:], len(view) - got, socket.MSG_DONTWAIT)
            except BlockingIOError:
                if time.perf_counter() >= end:
                    break
                continue
            if n == 0:
                raise ConnectionError("connection closed mid-transfer")
            got += n
            end = min(time.perf_counter() + SPIN_S, stop)
    if got < len(view):
        _recv_exact(sock, view[got:], deadline)


def _next_request(conn: socket.socket, head: memoryview, poll: bool) -> bool:
    """Receive the next request's header into ``head`` (an owner's server thread). With ``poll``, poll for it
    first, for up to ``SPIN_S``, yielding the core and the GIL at each try, and not on a crowded machine
    (the control plane's ``mailbox.Spin`` does the same). Returns whether to poll before the next one: the
    request came within ``SPIN_S`` of the wait's start.

    Blocked, the thread waits for the VM to wake its core, and the longer the core has been idle the
    longer that takes: a reader's next 4 KiB request 0-2 µs after the last answer got its bytes in 29-30
    µs, 10-100 µs after in 40-45 µs, and a reader spends 10-15 µs of Python between two transfers. The
    server polls only after a transfer that had one connection (``ALONE``): after a transfer cut over
    several, all their threads would poll at once, and a small transfer after a 1 GiB one took 0.2-4 ms
    when every owner thread polled. Nor does it poll when its reader runs on the same CPU (the request
    says which; ``_serve``): the two would take turns on one core."""
    start = time.perf_counter()
    got = 0
    if poll and SPIN_S > 0:
        end, tries = start + SPIN_S, 0
        while True:
            try:
                got = conn.recv_into(head, len(head), socket.MSG_DONTWAIT)
                if got == 0:
                    raise ConnectionError("closed")
                break
            except BlockingIOError:
                if time.perf_counter() >= end or (tries & 31 == 0 and _crowded()):
                    break
                tries += 1
                _sched_yield()
    if got < len(head):
        _recv_exact(conn, head[got:])
    return time.perf_counter() - start <= SPIN_S


_sched_getcpu = None


def _cpu() -> int:
    """The CPU this thread runs on (``sched_getcpu``, 80 ns), or ``NO_CPU``."""
    global _sched_getcpu
    if _sched_getcpu is None:
        f = getattr(ctypes.CDLL(None), "sched_getcpu", None)
        if f is not None:
            f.restype, f.argtypes = ctypes.c_int, []
        _sched_getcpu = f or (lambda: -1)
    c = _sched_getcpu()
    return c if 0 <= c < NO_CPU else NO_CPU


def request(op: int, flags: int, buf_id: int, token: int, offset: int, length: int, cpu: int = NO_CPU) -> bytes:
    """A request's header: ``cpu`` is the reader's CPU when it runs on the owner's host (see ``_serve``)."""
    return _REQ.pack(_MAGIC, op, flags, buf_id, token, offset, length, cpu)


def client_socket(s: socket.socket) -> socket.socket:
    """Set up a connected socket for ``_send_parts``/``_recv_first``/``_recv_exact`` with deadlines: no
    Nagle delay, blocking mode, and the kernel's timeouts (``TICK_S``) on its waits. (A Python socket
    timeout would poll() before every send and receive, and a poll that waits defeats the polling.)"""
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    s.settimeout(None)
    tick = struct.pack("@ll", int(TICK_S), int(TICK_S % 1 * 1e6))
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, tick)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, tick)
    return s


# ---- owner side -----------------------------------------------------------------------
class Server:
    """Serves this process's registered buffers; ``address`` is (host, port)."""

    def __init__(self) -> None:
        # Listen on every address (a buffer's token guards it), so that a descriptor may name whichever
        # of this machine's addresses its reader can route to (message payloads do); announce the
        # host's default one, or MONARCH_TENSOR_RDMA_HOST, which then is the only one listened on.
        chosen = setting("MONARCH_TENSOR_RDMA_HOST")
        host = chosen or _default_host()
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            self.sock.bind((chosen or "0.0.0.0", 0))
        except OSError:
            host = "127.0.0.1"
            self.sock.bind((host, 0))
        self.sock.listen(64)
        self.address = (host, self.sock.getsockname()[1])
        threading.Thread(target=self._accept, daemon=True, name="mt-rdma-tcp").start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            threading.Thread(target=self._serve, args=(conn,), daemon=True, name="mt-rdma-tcp-conn").start()

    def _serve(self, conn: socket.socket) -> None:
        head = memoryview(bytearray(_REQ.size))
        poll = False
        try:
            while True:
                poll = _next_request(conn, head, poll)
                magic, op, flags, buf_id, token, offset, length, cpu = _REQ.unpack(head)
                if magic != _MAGIC or op not in (READ, WRITE, FETCH_ADD, COMPARE_SWAP):
                    return  # a stray client: hang up
                reg = registry().lookup(buf_id, token)
                status = OK
                if reg is None:
                    status = UNKNOWN
                elif offset + length > reg.desc.nbytes:
                    status = RANGE
                elif op != READ and not reg.desc.writable:
                    status = READONLY
                elif op > WRITE and (length != 8 or offset % 8):
                    status = MISALIGNED
                if op == READ:
                    self._serve_read(conn, reg, status, offset, length)
                elif op > WRITE:
                    self._serve_atomic(conn, reg, status, offset, op)
                else:
                    self._serve_write(conn, reg, status, offset, length, flags & ALONE)
                # Poll again only if the reader runs on another CPU: on a core the two share (the other one
                # busy), a polling owner took turns with its reader, and 4 KiB reads took 32 µs, 24 blocked.
                poll = poll and bool(flags & ALONE) and (cpu == NO_CPU or cpu != _cpu())
        except (OSError, ConnectionError):
            pass
        finally:
            conn.close()

    def _serve_read(self, conn, reg, status, offset, length) -> None:
        if status != OK:
            conn.sendall(_ANSWER[status])
            return
        mem = reg.mem
        data = mem.slice(offset, length).cpu().numpy() if mem.is_cuda else _whole(reg)[offset:offset + length]
        _send_parts(conn, _ANSWER[OK], data)

    def _serve_atomic(self, conn, reg, status, offset, op) -> None:
        operands = bytearray(_OPERANDS.size)
        _recv_exact(conn, memoryview(operands))
        if status != OK:
            conn.sendall(_ANSWER[status])
            return
        a, b = _OPERANDS.unpack(operands)
        mem = reg.mem
        with _ATOMIC_LOCK:
            if mem.is_cuda:
                import torch

                word = mem.slice(offset, 8)
                before = word.cpu().numpy().tobytes()
            else:
                word = mem.view(offset, 8)
                before = bytes(word)
            value = int.from_bytes(before, sys.byteorder)
            if op == FETCH_ADD:
                value = (value + a) & 0xFFFF_FFFF_FFFF_FFFF
            elif value == a:
                value = b
            after = value.to_bytes(8, sys.byteorder)
            if after != before:
                if mem.is_cuda:
                    word.copy_(torch.frombuffer(bytearray(after), dtype=torch.uint8))
                else:
                    word[:] = after
        conn.sendall(_ANSWER[OK] + before)

    def _serve_write(self, conn, reg, status, offset, length, alone) -> None:
        if status != OK:
            sink = bytearray(min(length, 1 << 20))
            left = length
            while left:
                n = conn.recv_into(sink, min(left, len(sink)))
                if n == 0:
                    raise ConnectionError("closed")
                left -= n
            conn.sendall(_ANSWER[status])
            return
        mem = reg.mem
        if mem.is_cuda:
            import torch

            stage = torch.empty(length, dtype=torch.uint8)
            _recv_exact(conn, memoryview(stage.numpy()))
            mem.slice(offset, length).copy_(stage)
        else:
            (_recv_rest if alone else _recv_exact)(conn, _whole(reg)[offset:offset + length])
        conn.sendall(_ANSWER[OK])


def _whole(reg) -> memoryview:
    """A writable memoryview of a CPU registration's whole buffer, made at its first transfer and kept with
    it (the registration keeps the memory alive): slicing it takes 0.1 µs, making a view of a transfer's
    bytes through ctypes (``Mem.view``) 0.7 µs, on each request."""
    view = reg.cache.get("tcp")
    if view is None:
        view = reg.cache["tcp"] = reg.mem.view(0, reg.mem.nbytes)
    return view


def _default_host() -> str:
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


_server = per_process(Server)


def server_address() -> tuple[str, int]:
    """This process's data server (started on first use)."""
    return _server().address


# ---- reader side ----------------------------------------------------------------------
class TcpBackend(Backend):
    name = "tcp"
    remote_cpu_only = False

    def __init__(self) -> None:
        super().__init__()
        self._idle: dict[tuple[str, int], list[socket.socket]] = {}
        self._lock = threading.Lock()
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=STREAMS, thread_name_prefix="mt-rdma-tcp")
        atexit.register(self._close_idle)  # (the connections kept for the next transfer, closed, not left to GC)

    def _close_idle(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, {}
        for conns in idle.values():
            for s in conns:
                s.close()

    def usable(self, desc: Descriptor, local: Mem) -> bool:
        return desc.tcp is not None

    def _conn(self, addr: tuple[str, int], desc: Descriptor, deadline: float) -> socket.socket:
        with self._lock:
            idle = self._idle.get(addr)
            if idle:
                return idle.pop()
        try:
            s = socket.create_connection(addr, timeout=min(check_deadline(deadline, "connecting to the owner"),
                                                           CONNECT_MAX_S))
        except (ConnectionRefusedError, socket.timeout, OSError) as e:
            raise self._lost(desc, e) from e
        return client_socket(s)

    def _release(self, addr, s: socket.socket) -> None:
        with self._lock:
            self._idle.setdefault(addr, []).append(s)

    def _lost(self, desc: Descriptor, e: BaseException) -> Exception:
        if isinstance(e, (socket.timeout, TimeoutError)):
            return TransferTimeoutError(f"tcp transfer of buffer {desc.buf_id} did not finish within its timeout")
        if desc.host == host_id() and not alive(desc.pid, desc.started):
            return OwnerDiedError(f"the owner of buffer {desc.buf_id} (pid {desc.pid}) died")
        return OwnerDiedError(f"the owner of buffer {desc.buf_id} (pid {desc.pid} on {desc.host.split('/')[0]}) "
                              f"cannot be reached at {desc.tcp}: {e!r} (it died, or the network failed)")

    def _one(self, op: int, desc: Descriptor, offset: int, local: Mem, lo: int, n: int, deadline: float,
             alone: bool = False, operands: bytes | None = None) -> None:
        """Move [lo, lo + n) of ``local`` on one connection (``alone``: the only one of its transfer); for an
        atomic, send ``operands`` and receive the word's value before into ``local``."""
        if desc.tcp is None:
            raise TransferError(f"buffer {desc.buf_id} has no tcp server: the tcp backend cannot move it")
        host, port = desc.tcp
        addr = (host, port)
        s = self._conn(addr, desc, deadline)
        ok = False
        try:
            check_deadline(deadline, "tcp transfer")
            req = request(op, ALONE if alone else 0, desc.buf_id, desc.token, offset + lo, n,
                          _cpu() if desc.host == host_id() else NO_CPU)
            status = bytearray(HEAD)
            view = local.view(lo, n)
            bufs: list[bytearray | memoryview]
            if op == WRITE:
                _send_parts(s, req, view, deadline)
                bufs = [status]
            else:
                _send_parts(s, req, operands, deadline)
                bufs = [status, view]  # the answer and the first bytes in one call
            got = _recv_first(s, bufs, deadline)
            if got == 0:
                raise ConnectionError("connection closed before the owner answered")
            if got < HEAD:  # the answer came in pieces
                _recv_exact(s, memoryview(status)[got:], deadline)
                got = HEAD
            if op != WRITE and status[0] == OK and got - HEAD < n:
                (_recv_rest if alone else _recv_exact)(s, view[got - HEAD:], deadline)
            ok = True
        except (OSError, ConnectionError) as e:
            raise self._lost(desc, e) from e
        finally:
            if ok:
                self._release(addr, s)
            else:
                s.close()
        if status[0] == UNKNOWN:
            raise BufferDroppedError(f"buffer {desc.buf_id} of pid {desc.pid} {_STATUS[UNKNOWN]}")
        if status[0] != OK:
            raise TransferError(f"buffer {desc.buf_id}: {_STATUS.get(status[0], f'status {status[0]}')}")

    def atomic(self, desc: Descriptor, op: int, offset: int, a: int, b: int, local: Mem, timeout: float) -> None:
        """``FETCH_ADD`` (``a``) or ``COMPARE_SWAP`` (``a`` compared, ``b`` swapped in) on the 8-byte word at
        ``offset``, done by the owner (any same-host or remote buffer: every owner serves tcp); ``local`` (8
        bytes) receives the word's value before."""
        operands = _OPERANDS.pack(a, b)
        self._transfer("atomics", lambda d, o, m, dl: self._one(op, d, o, m, 0, 8, dl, operands=operands),
                       desc, offset, local, timeout)

    def _run(self, op: int, desc: Descriptor, offset: int, local: Mem, deadline: float) -> None:
        n = local.nbytes
        streams = max(1, min(STREAMS, n // MIN_STREAM_CHUNK))
        if streams == 1:
            self._one(op, desc, offset, local, 0, n, deadline, alone=True)
            return
        step = -(-n // streams // ALIGN) * ALIGN  # each stream's data starts aligned in ``local``
        futs = [self._pool.submit(self._one, op, desc, offset, local, lo, min(step, n - lo), deadline)
                for lo in range(0, n, step)]
        errors = [f.exception() for f in futs]
        for e in errors:
            if e is not None:
                raise e

    def _read(self, desc: Descriptor, offset: int, local: Mem, deadline: float) -> None:
        self._run(READ, desc, offset, local, deadline)

    def _write(self, desc: Descriptor, offset: int, local: Mem, deadline: float) -> None:
        self._run(WRITE, desc, offset, local, deadline)
