"""``RDMABuffer``: a registered buffer, read and written one-sidedly from any proc or the controller.

>>> import torch
>>> from monarch_tensor.rdma import RDMABuffer
>>> weights = torch.randn(1024)
>>> buf = RDMABuffer(weights.view(torch.uint8))   # in the owner (an actor, or the controller)
>>> # ... send ``buf`` to another actor in an ordinary message; there:
>>> out = torch.empty(1024)
>>> buf.read_into(out.view(torch.uint8)).get()     # one-sided: the owner does nothing
>>> buf.backend                                     # 'cma' on one host, 'tcp' across hosts, ...
'cma'

The handle pickles to a small descriptor. The registration lives until
``drop()`` or the owner's death; using it afterwards fails with
``BufferDroppedError`` / ``OwnerDiedError`` within the timeout, never a hang.
The backend is chosen per (owner, reader) pair in the order verbs, cuda_ipc,
cma, tcp; ``MONARCH_TENSOR_RDMA_BACKEND=tcp`` (or another name) forces one.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import warnings
from typing import Any, NamedTuple

from monarch_tensor.config import _runtime as _config_runtime  # (what configure() set)
from monarch_tensor.config import setting
from monarch_tensor.future import Future
from monarch_tensor.transport import _wire
from monarch_tensor.transport._net import ip_towards

from ._future import TransferFuture
from ._host import host_id, my_pid
from ._memory import Mem, as_mem
from ._registry import Descriptor, registry
from .backends.base import Backend
from .errors import (
    BackendRefusedError,
    BackendUnavailableError,
    BufferDroppedError,
    OwnerDiedError,
    RDMAError,
    RDMAReadTransferWarning,
    RDMATcpFallbackWarning,
    RDMAWriteTransferWarning,
)

log = logging.getLogger("monarch_tensor.rdma")
for _w in (RDMATcpFallbackWarning, RDMAReadTransferWarning, RDMAWriteTransferWarning):
    warnings.simplefilter("once", _w)  # as Monarch: once per process
ENV_BACKEND = "MONARCH_TENSOR_RDMA_BACKEND"
DEFAULT_TIMEOUT = 60.0
INLINE_BYTES = 64 << 20  # cma transfers up to this size run on the caller's thread: a bounded copy, no thread hop

_backends: list[Backend] | None = None
_lock = threading.Lock()
_logged: set[str] = set()  # backends whose first transfer here was logged (at info level, once each)


def backends() -> list[Backend]:
    """Every backend, in order of preference."""
    global _backends
    if _backends is not None:
        return _backends
    with _lock:
        if _backends is None:
            from .backends.cma import CmaBackend
            from .backends.cuda_ipc import CudaIpcBackend
            from .backends.tcp import TcpBackend
            from .backends.verbs import VerbsBackend

            _backends = [VerbsBackend(), CudaIpcBackend(), CmaBackend(), TcpBackend()]
            from . import service

            service.install()
    return _backends


def backend_named(name: str) -> Backend:
    for b in backends():
        if b.name == name:
            return b
    raise BackendUnavailableError(f"no data-plane backend named {name!r}; known: {[b.name for b in backends()]}")


def _forced_backend(name: str) -> Backend:
    """The backend ``configure(rdma_backend=...)`` or ``$MONARCH_TENSOR_RDMA_BACKEND`` names: a name that is
    none is an error naming the setting (a bare "no data-plane backend named ..." left the user to find where
    that name came from), and so is one this process cannot use, with the reason."""
    try:
        b = backend_named(name)
    except BackendUnavailableError as e:
        raise BackendUnavailableError(f"{_where_forced()}: {e}") from None
    why = b.unavailable_reason()
    if why is not None:
        raise BackendUnavailableError(f"{_where_forced()}, but the {name} backend is unavailable here: {why}")
    return b


def _where_forced() -> str:
    chosen = _config_runtime.get("rdma_backend")
    return f"configure(rdma_backend={chosen!r})" if chosen else f"{ENV_BACKEND}={setting(ENV_BACKEND)}"


def unavailable_backends() -> dict[str, str]:
    """Each backend this process cannot use, with why (``{"verbs": "no RDMA device", ...}``)."""
    return {b.name: why for b in backends() if (why := b.unavailable_reason()) is not None}


def _forced() -> str | None:
    """``configure(rdma_backend=...)``, else ``$MONARCH_TENSOR_RDMA_BACKEND``, read at every transfer (a test or
    a notebook may set either at any time), the variable from the environment's own dict where there is one:
    ``os.environ.get`` of a name that is not set raises and catches a KeyError inside, 0.7 µs on this
    project's VM, a tenth of a small transfer's Python."""
    chosen = _config_runtime.get("rdma_backend")
    if chosen is not None:
        return chosen or None
    if _ENV_DATA is None:
        return setting(ENV_BACKEND) or None
    v = _ENV_DATA.get(_ENV_KEY)
    if v is None:
        return None
    name = _DECODED.get(v)
    if name is None:  # (os.fsdecode costs as much again: the names seen are kept, a handful at most)
        name = _DECODED[v] = os.fsdecode(v)
    return name


_ENV_DATA = getattr(os.environ, "_data", None)  # CPython's os.environ keeps its items in a dict of bytes
if not isinstance(_ENV_DATA, dict) or not hasattr(os.environ, "encodekey"):
    _ENV_DATA = None
_ENV_KEY = os.environ.encodekey(ENV_BACKEND) if _ENV_DATA is not None else None
_DECODED: dict[bytes, str] = {}


def preferred_backend() -> str:
    """This project's name of the backend this process prefers for CPU memory: ``"verbs"`` where a NIC is
    found, else ``"cma"`` or ``"tcp"`` (or the one ``rdma_backend`` forces). ``buf.backend`` says which one
    moved a given buffer's last transfer."""
    forced = _forced()
    if forced:
        return _forced_backend(forced).name
    for b in backends():
        if b.name in ("verbs", "cma", "tcp") and b.available():
            return b.name
    return "tcp"


def get_rdma_backend() -> str:
    """Monarch's answer, one of ``"ibverbs"``, ``"tcp"`` or ``"none"``: ``"ibverbs"`` where this process
    prefers the verbs backend; else ``"tcp"``, the fallback transport Monarch names (here it covers this
    project's ``cma`` and ``tcp`` backends: ``preferred_backend()`` says which); ``"none"`` where there is no
    RDMA device and ``configure(rdma_allow_tcp_fallback=False)`` forbids the fallback (buffers of another
    host then fail; those of this host still move over ``cma``), as Monarch's."""
    name = preferred_backend()
    if name == "verbs":
        return "ibverbs"
    from monarch_tensor import config

    if _forced() or config.get("rdma_allow_tcp_fallback"):
        return "tcp"
    return "none"


def is_ibverbs_available() -> bool:
    """Whether pyverbs imports and finds an RDMA device on this host."""
    from .backends import verbs

    return verbs.available()


def transfer_stats() -> dict[str, dict]:
    """Per backend: reads, writes, bytes and seconds of the transfers this process made."""
    return {b.name: dict(b.stats) for b in backends()}


def candidates(desc: Descriptor, local: Mem) -> list[Backend]:
    """Backends that can serve the pair (``desc``'s owner, this process), best first."""
    forced = _forced()
    if forced:
        b = _forced_backend(forced)
        if not b.can_serve(desc, local):
            raise BackendUnavailableError(f"{_where_forced()} but that backend cannot move buffer "
                                          f"{desc.buf_id} ({desc.device} in pid {desc.pid} on "
                                          f"{desc.host.split('/')[0]}) to {local.device} here"
                                          + (" (cma and cuda_ipc reach processes of this host only)"
                                             if b.name in ("cma", "cuda_ipc") and desc.host != host_id() else ""))
        return [b]
    found = [b for b in backends() if b.can_serve(desc, local)]
    if not found:
        raise BackendUnavailableError(f"no backend can reach buffer {desc.buf_id} ({desc.device} in pid "
                                      f"{desc.pid} on {desc.host.split('/')[0]}) from here")
    if found[0].name == "tcp" and desc.host != host_id():
        from monarch_tensor import config

        if not config.get("rdma_allow_tcp_fallback"):
            raise BackendUnavailableError(
                f"buffer {desc.buf_id} of {desc.host.split('/')[0]} can only move over TCP here (no RDMA device "
                f"serves this pair of hosts), and configure(rdma_allow_tcp_fallback=False) forbids that")
        warnings.warn(f"buffer {desc.buf_id} of {desc.host.split('/')[0]} moves over TCP: no RDMA device (verbs) "
                      f"serves this pair of hosts, and TCP has far lower throughput and higher latency; "
                      f"{ENV_BACKEND}=tcp chooses it on purpose (and silences this; "
                      f"configure(rdma_allow_tcp_fallback=False) makes it an error)", RDMATcpFallbackWarning,
                      stacklevel=2)
    return found


def is_rdma_available() -> bool:
    """Monarch's older name for ``is_ibverbs_available()`` (deprecated there, as here: several backends
    make it ambiguous; ``preferred_backend()`` says which one this process prefers)."""
    warnings.warn("is_rdma_available() is deprecated: it says whether RDMA over ibverbs is available; use "
                  "is_ibverbs_available() or get_rdma_backend()", DeprecationWarning, stacklevel=2)
    return is_ibverbs_available()


class RDMABuffer:
    """A registered buffer; the handle is picklable and works from any proc or the controller.

    >>> buf = RDMABuffer(torch.arange(10, dtype=torch.float32))
    >>> dst = torch.empty(10)
    >>> buf.read_into(dst).get(); buf.drop()
    """

    __slots__ = ("_desc", "_last_backend", "__weakref__")

    def __init__(self, data: Any) -> None:
        mem = as_mem(data, "RDMABuffer data")
        bs = backends()
        from monarch_tensor.transport import mailbox as _mb

        from .backends import cma, tcp

        cma.allow_readers()
        extras: dict = {}
        for b in bs:
            reg = getattr(b, "register", None)
            if reg is not None and b.available():
                reg(mem, extras)
        owner = _mb._mailbox.addr if _mb._mailbox is not None else ""
        self._desc = registry().register(mem, owner, tcp.server_address(), extras).desc
        self._last_backend: str | None = None

    @classmethod
    def _from_desc(cls, desc: Descriptor) -> RDMABuffer:
        self = cls.__new__(cls)
        self._desc, self._last_backend = desc, None
        return self

    def __reduce__(self):
        d = self._desc = _with_owner(self._desc)
        towards = _wire.destination()
        if towards and d.tcp is not None and d.pid == os.getpid() and not setting("MONARCH_TENSOR_RDMA_HOST"):
            # Pickled into a message for another host: announce the tcp server (which listens on every
            # address) at this machine's address on the route there, not the default one (may be loopback).
            host = ip_towards(towards)
            if host != "0.0.0.0" and host != d.tcp[0]:
                d = dataclasses.replace(d, tcp=(host, d.tcp[1]))
        return (RDMABuffer._from_desc, (d,))

    # ---- what it is -------------------------------------------------------------------
    def size(self) -> int:
        """Bytes in the buffer."""
        return self._desc.nbytes

    @property
    def owner(self) -> str:
        """The owner process: its mailbox address (or ``pid:<pid>`` where it has none)."""
        d = self._desc = _with_owner(self._desc)
        return d.owner or f"pid:{d.pid}"

    @property
    def device(self) -> str:
        return self._desc.device

    @property
    def backend(self) -> str:
        """The backend used by the last transfer from here, or the one that would be chosen for CPU memory."""
        if self._last_backend is not None:
            return self._last_backend
        probe = Mem(0, 0, "cpu", True, None, None) if self._desc.device == "cpu" else _probe_cuda()
        return candidates(self._desc, probe)[0].name

    def __repr__(self) -> str:
        d = self._desc
        return f"RDMABuffer({d.nbytes} bytes, {d.device}, pid {d.pid}, id {d.buf_id})"

    # ---- transfers --------------------------------------------------------------------
    def read_into(self, dst: Any, *, offset: int | None = None, timeout: float = DEFAULT_TIMEOUT) -> Future[None]:
        """Copy the buffer into the start of ``dst``, which must be at least as large (Monarch's rule); with
        ``offset``, copy ``dst.nbytes`` bytes of the buffer from ``offset`` on (a part of it). A Future of None.

        >>> buf.read_into(out).get()                  # all of buf; out may be larger
        >>> buf.read_into(out[:16], offset=64).get()  # buf's bytes [64, 80)
        """
        local = self._check_read(dst, offset, "read_into destination")
        return self._submit("read", local, offset or 0, _check_timeout(timeout))

    def write_from(self, src: Any, *, offset: int = 0, timeout: float = DEFAULT_TIMEOUT) -> Future[None]:
        """Copy ``src`` into the buffer at ``offset``; a Future of None."""
        local = self._check(src, offset, "write_from source")
        if not self._desc.writable:
            raise ValueError(f"{self!r} wraps read-only memory: it cannot be written")
        return self._submit("write", local, offset, _check_timeout(timeout))

    def drop(self) -> Future[None]:
        """End the registration (from the owner, or from anywhere holding the handle); a Future of None, set
        once it took effect (at once in the owner; elsewhere when the owner answers), as Monarch's.

        >>> buf.drop().get()      # or ``await buf.drop()``; a later read fails with BufferDroppedError
        """
        d = self._desc
        if d.pid == my_pid() and d.host == host_id():
            registry().drop(d.buf_id)
            return Future.ready(None)
        from monarch_tensor.transport.mailbox import current_mailbox

        from .messages import DropBuffer

        if not d.owner:
            return Future.failed(RDMAError(
                f"cannot drop buffer {d.buf_id} from here: its handle was pickled before its owner (pid {d.pid}) "
                f"had a mailbox, so it names no address to send the drop to; drop it in its owner"))
        mb = current_mailbox()
        done = _DropDone(d.owner, f"drop of buffer {d.buf_id}")
        port = mb.open_port(done)
        # A death reported before the port opened never reaches it: asked once it is open, none slips between.
        if mb.death_of(d.owner) is None:
            try:
                mb.send(d.owner, DropBuffer(d.buf_id, d.token, port))
                return done.future
            except Exception as e:  # noqa: BLE001 - a dead owner has nothing left to drop
                log.debug("drop of %r: %s", self, e)
        mb.close_port(port.port_id)
        done.future._set_result(None)  # (a dead owner has nothing left to drop)
        return done.future

    def _check_read(self, dst: Any, offset: int | None, what: str) -> Mem:
        """The memory a read moves into: with ``offset``, all of ``dst``; without, the first ``size()`` bytes of
        ``dst`` (Monarch's read takes the whole buffer, into a destination at least as large)."""
        if offset is not None:
            return self._check(dst, offset, what, into=True)
        local = self._check(dst, 0, what, into=True, whole=False)
        if local.nbytes < self._desc.nbytes:
            raise ValueError(f"size mismatch: {what} has {local.nbytes} bytes, but the buffer has {self._desc.nbytes}: "
                             f"a read without offset= moves the whole buffer, so the destination must be at least "
                             f"as large (read a part with offset=)")
        return local.head(self._desc.nbytes)

    def _check(self, obj: Any, offset: int, what: str, into: bool = False, whole: bool = True) -> Mem:
        """``obj`` as memory to move from or into the buffer at ``offset``; with ``whole``, all of it must fit."""
        local = as_mem(obj, what)
        if into and not local.writable:
            raise ValueError(f"{what} is read-only ({type(obj).__name__}): a read needs memory it may write")
        if not isinstance(offset, int) or offset < 0:
            raise ValueError(f"offset must be a non-negative int, got {offset!r}")
        if whole and offset + local.nbytes > self._desc.nbytes:
            raise ValueError(f"size mismatch: {what} has {local.nbytes} bytes, but the buffer has "
                             f"{self._desc.nbytes} bytes from which {self._desc.nbytes - offset} are left at "
                             f"offset {offset}")
        return local

    def _submit(self, kind: str | _Atomic, local: Mem, offset: int, timeout: float,
                defer: bool = True) -> Future[None]:
        what = kind.op if type(kind) is _Atomic else kind
        fut = TransferFuture(f"RDMA {what} of {local.nbytes} bytes")
        try:
            cands = None if type(kind) is _Atomic else candidates(self._desc, local)
        except Exception as e:  # noqa: BLE001 - delivered to the waiter
            fut._set_exception(e)
            return fut
        if cands and cands[0].name == "cma" and local.nbytes <= INLINE_BYTES and not local.is_cuda:
            self._run(fut, kind, local, offset, timeout, cands)  # a few µs of syscall: no thread hop
            return fut
        fut.defer((self, kind, local, offset, timeout, cands), kick=defer)  # who runs it: see _future
        return fut

    def _run(self, fut: Future, kind: str | _Atomic, local: Mem, offset: int, timeout: float,
             cands: list[Backend] | None = None) -> None:
        try:
            self.transfer(kind, local, offset, timeout, cands)
        except BaseException as e:  # noqa: BLE001 - delivered to the waiter
            fut._set_exception(e)
        else:
            fut._set_result(None)

    def transfer(self, kind: str | _Atomic, local: Mem, offset: int, timeout: float,
                 cands: list[Backend] | None = None) -> None:
        """Run one transfer on this thread (the Future-less form; ``kind`` is "read" or "write"), with the
        first of ``cands`` (default: ``candidates``) that does not refuse it."""
        d = self._desc
        _check_owner(d)
        if type(kind) is _Atomic:  # done by the owner, whichever backend moves this buffer's bytes
            from .backends.tcp import COMPARE_SWAP, FETCH_ADD, TcpBackend

            if d.tcp is None:
                raise BackendUnavailableError(f"buffer {d.buf_id} has no data server to do atomics")
            tcp = backend_named("tcp")
            assert isinstance(tcp, TcpBackend)  # (the backend of that name; its atomic() is its own)
            tcp.atomic(d, FETCH_ADD if kind.op == "fetch_add" else COMPARE_SWAP, offset, kind.a, kind.b, local,
                       timeout)
            return
        last: Exception | None = None
        for b in candidates(d, local) if cands is None else cands:
            try:
                (b.read if kind == "read" else b.write)(d, offset, local, timeout)
                self._last_backend = b.name
                if b.name not in _logged:
                    _logged.add(b.name)
                    log.info("data plane: %s moves buffers of %s (first transfer by it in this process)",
                             b.name, "this host" if d.host == host_id() else d.host.split("/")[0])
                return
            except BackendRefusedError as e:
                log.warning("%s; falling back to the next backend", e)
                last = e
        raise BackendUnavailableError(f"every backend refused buffer {d.buf_id}: {last}")


def _with_owner(d: Descriptor) -> Descriptor:
    """``d`` naming its owner's mailbox: a buffer registered here before this process had one (a script's
    buffer made before its first mesh) names it once there is one, so that a handle sent on can reach the
    owner (a holder's ``drop()`` was silently ignored: it had no address to send the drop to)."""
    if not d.owner and d.pid == my_pid() and d.host == host_id():
        from monarch_tensor.transport import mailbox as _mb

        if _mb._mailbox is not None:
            return dataclasses.replace(d, owner=_mb._mailbox.addr)
    return d


class _DropDone:
    """The port of a drop sent to the owner: its answer settles the Future; so does the owner's death (a
    dead owner has nothing left to drop)."""

    observing = False

    def __init__(self, owner: str, what: str) -> None:
        self.future: Future[None] = Future(what)
        self._owner = owner

    def deliver(self, msg) -> bool:
        if msg.error is not None:
            self.future._set_exception(msg.error)
        else:
            self.future._set_result(None)
        return True

    def proc_died(self, addr: str, error: BaseException) -> tuple[bool, bool]:
        if addr == self._owner:
            self.future._set_result(None)
            return True, True
        return False, False


def _probe_cuda() -> Mem:
    return Mem(0, 0, "cuda:0", True, None, None)


def _check_owner(d: Descriptor) -> None:
    # (Whether a same-host owner still runs is checked by the backends when a transfer fails:
    # reading /proc up front would cost more than a small transfer.)
    if d.pid == my_pid() and d.host == host_id() and registry().lookup(d.buf_id, d.token) is None:
        raise BufferDroppedError(f"buffer {d.buf_id} was dropped")
    if d.owner:
        from monarch_tensor.transport import mailbox as _mb

        if _mb._mailbox is not None and _mb._mailbox.death_of(d.owner) is not None:
            raise OwnerDiedError(f"the owner of buffer {d.buf_id} ({d.owner}) died")


def _check_timeout(timeout: Any) -> float:
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
        raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")
    return timeout


class _Atomic(NamedTuple):
    """An atomic op as a transfer's kind: ``fetch_add`` (``a`` added) or ``compare_and_swap``."""

    op: str
    a: int
    b: int


def _word(value: Any, what: str) -> int:
    """``value`` as the unsigned 64-bit word an atomic takes (a negative int as its two's complement)."""
    if isinstance(value, bool) or not isinstance(value, int) or not -(1 << 63) <= value < (1 << 64):
        raise ValueError(f"{what} must be an int that fits in 64 bits, got {value!r}")
    return value & 0xFFFF_FFFF_FFFF_FFFF


def _local_and_buffer(what: str, local: Any, buf: Any) -> tuple[Any, RDMABuffer]:
    """``(local memory, RDMABuffer)`` of an action's two arguments, whichever order they came in."""
    if isinstance(local, RDMABuffer) and not isinstance(buf, RDMABuffer):
        local, buf = buf, local
    if not isinstance(buf, RDMABuffer):
        raise TypeError(f"{what} needs an RDMABuffer and local memory (a tensor, memoryview or bytearray); got "
                        f"{type(local).__name__} and {type(buf).__name__}")
    if isinstance(local, RDMABuffer):
        raise TypeError(f"{what} moves bytes between an RDMABuffer and local memory, not between two buffers: "
                        f"read one into local memory, then write that into the other")
    return local, buf


class RDMAAction:
    """Several transfers submitted together; ``submit()`` is a Future of None that fails if any fails.

    >>> RDMAAction().read_remote(dst_a, buf_a).write_remote(buf_b, src_b).submit().get()

    Monarch's argument order: destination first (``read_remote(local, buffer)``,
    ``write_remote(buffer, local)``). The buffer may also come first in
    ``read_remote`` (this project's earlier order): the ``RDMABuffer`` is the
    remote side either way.
    """

    def __init__(self) -> None:
        self._ops: list[tuple[str | _Atomic, RDMABuffer, Mem, int]] = []

    def read_remote(self, dst: Any, src: RDMABuffer, *, offset: int | None = None) -> RDMAAction:
        """Queue a read of the RDMA buffer ``src`` into local memory ``dst``, as ``src.read_into(dst,
        offset=offset)`` does: all of it into a ``dst`` at least as large, or with ``offset`` a part."""
        local, buf = _local_and_buffer("read_remote", dst, src)
        self._ops.append(("read", buf, buf._check_read(local, offset, "read_remote destination"), offset or 0))
        return self

    def write_remote(self, dst: RDMABuffer, src: Any, *, offset: int = 0) -> RDMAAction:
        """Queue a write of local memory ``src`` into the RDMA buffer ``dst`` (from ``offset``)."""
        src, buf = _local_and_buffer("write_remote", src, dst)
        if not buf._desc.writable:
            raise ValueError(f"{buf!r} wraps read-only memory: it cannot be written")
        self._ops.append(("write", buf, buf._check(src, offset, "write_remote source"), offset))
        return self

    def fetch_add(self, src: RDMABuffer, dst: Any, add: int, *, offset: int = 0) -> RDMAAction:
        """Queue an atomic add of ``add`` to the 8-byte word of ``src`` at ``offset`` (a multiple of 8); ``dst``
        (8 bytes of local memory, such as a 1-element int64 tensor) receives the word's value before.
        Integers wrap modulo 2**64, as RDMA's do. (Monarch declares this and raises NotImplementedError.)"""
        buf, local = self._atomic_args("fetch_add", src, dst, offset)
        self._ops.append((_Atomic("fetch_add", _word(add, "add"), 0), buf, local, offset))
        return self

    def compare_and_swap(self, src: RDMABuffer, dst: Any, compare: int, swap: int, *,
                         offset: int = 0) -> RDMAAction:
        """Queue an atomic compare-and-swap of the 8-byte word of ``src`` at ``offset``: it becomes ``swap`` if
        it equals ``compare``; ``dst`` (8 bytes) receives its value before (equal to ``compare``: swapped)."""
        buf, local = self._atomic_args("compare_and_swap", src, dst, offset)
        self._ops.append((_Atomic("compare_and_swap", _word(compare, "compare"), _word(swap, "swap")), buf, local,
                          offset))
        return self

    @staticmethod
    def _atomic_args(what: str, src: Any, dst: Any, offset: int) -> tuple[RDMABuffer, Mem]:
        dst, buf = _local_and_buffer(what, dst, src)
        if not buf._desc.writable:
            raise ValueError(f"{buf!r} wraps read-only memory: an atomic {what} writes it")
        local = buf._check(dst, offset, f"{what} destination", into=True)
        if local.nbytes != 8:
            raise ValueError(f"{what}: the destination receives the 8-byte word's value before, so it must be 8 "
                             f"bytes (a 1-element int64 tensor), got {local.nbytes}")
        if offset % 8:
            raise ValueError(f"{what}: offset {offset} is not a multiple of 8 (atomics act on aligned 8-byte words)")
        return buf, local

    def submit(self, *, timeout: float = DEFAULT_TIMEOUT) -> Future[None]:
        _check_timeout(timeout)
        futs = [buf._submit(kind, mem, off, timeout, defer=False) for kind, buf, mem, off in self._ops]
        out: Future[None] = TransferFuture(f"RDMAAction of {len(futs)} transfers")
        left = [len(futs)]
        lock = threading.Lock()

        def one_done(f: Future) -> None:
            e = f.exception()
            if e is not None:
                out._set_exception(e)
            with lock:
                left[0] -= 1
                if left[0] == 0:
                    out._set_result(None)

        if not futs:
            out._set_result(None)
        for f in futs:
            f.add_done_callback(one_done)
        return out
