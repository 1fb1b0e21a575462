"""``verbs``: RDMA READ/WRITE over InfiniBand/RoCE reliable-connected queue pairs, through pyverbs.

NOT RUN ON HARDWARE: no machine this was written on has an RDMA device (the
kernel has no InfiniBand support, so not even rxe/siw). The code follows
rdma-core's pyverbs API and its tests (tests/base.py RCResources,
tests/utils.py rdma_traffic); its seams are tested without a device:
descriptor packing, chunk planning, the registration cache and the
queue-pair handshake over the control plane (``ConnectQueuePair``).

* Owner: registers the buffer's memory once (an MR, cached; CUDA memory
  through a dmabuf MR) and puts (device, address, rkey) in the descriptor.
* Reader: one RC queue pair per (owner, device), made lazily: it sends its
  endpoint (qp number, psn, lid, gid, mtu) to the owner's mailbox; the owner
  makes its own queue pair for this reader, moves it to RTS and replies with
  its endpoint. The reader's destination is registered too (cached).
* A transfer is cut into work requests of at most ``MAX_WR_BYTES``, posted
  ``MAX_OUTSTANDING`` at a time, each completion checked.
"""

from __future__ import annotations

import collections
import functools
import os
import struct
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

from monarch_tensor import config
from monarch_tensor.config import setting

from .._memory import Mem
from .._registry import Descriptor
from ..errors import BackendRefusedError, TransferError, TransferTimeoutError
from .base import Backend, check_deadline

MAX_WR_BYTES = 1 << 20  # one work request
MAX_OUTSTANDING = 16  # work requests in flight per queue pair (<= max_rd_atomic for READs)
MR_CACHE_BYTES = setting("MONARCH_TENSOR_RDMA_MR_CACHE_BYTES")
DEVICE = setting("MONARCH_TENSOR_RDMA_DEVICE")  # a device name (mlx5_0 ...); default: the first
PORT = 1
GID_INDEX = setting("MONARCH_TENSOR_RDMA_GID_INDEX")  # -1: the first RoCE v2 / non-zero GID


# ---- seams: descriptors, chunks, caches (tested without a device) ----------------------
@dataclass(frozen=True)
class Endpoint:
    """One side of an RC connection, as exchanged in the handshake."""

    qp_num: int
    psn: int
    lid: int
    gid: bytes  # 16 bytes (all zero on InfiniBand without GRH)
    mtu: int  # ibv_mtu enum value

    _S = struct.Struct("!IIH16sB")

    def pack(self) -> bytes:
        return self._S.pack(self.qp_num, self.psn, self.lid, self.gid, self.mtu)

    @classmethod
    def unpack(cls, data: bytes) -> Endpoint:
        if len(data) != cls._S.size:
            raise ValueError(f"a queue-pair endpoint is {cls._S.size} bytes, got {len(data)}")
        return cls(*cls._S.unpack(data))


@dataclass(frozen=True)
class RemoteMemory:
    """Where a registered buffer is for RDMA: the owner's device, the address to use, the rkey."""

    device: str
    addr: int  # a virtual address, or an offset into the dmabuf (IOVA) for GPU memory
    rkey: int
    length: int

    _S = struct.Struct("!QIQ")

    def pack(self) -> bytes:
        name = self.device.encode()
        if len(name) > 255:
            raise ValueError("device name too long")
        return bytes([len(name)]) + name + self._S.pack(self.addr, self.rkey, self.length)

    @classmethod
    def unpack(cls, data: bytes) -> RemoteMemory:
        if not data or len(data) != 1 + data[0] + cls._S.size:
            raise ValueError(f"malformed verbs memory descriptor ({len(data)} bytes)")
        n = data[0]
        return cls(data[1:1 + n].decode(), *cls._S.unpack(data[1 + n:]))


def plan_chunks(length: int, max_chunk: int = MAX_WR_BYTES, max_outstanding: int = MAX_OUTSTANDING
                ) -> list[list[tuple[int, int]]]:
    """Work requests for ``length`` bytes: rounds of at most ``max_outstanding`` (offset, size) pieces."""
    if length < 0 or max_chunk <= 0 or max_outstanding <= 0:
        raise ValueError(f"bad chunk plan arguments {length}, {max_chunk}, {max_outstanding}")
    pieces = [(o, min(max_chunk, length - o)) for o in range(0, length, max_chunk)]
    return [pieces[i:i + max_outstanding] for i in range(0, len(pieces), max_outstanding)]


class MRCache:
    """Memory registrations by (device, address range); a cached one covering a request is reused.

    ``factory(addr, length, device) -> mr`` registers; ``mr.close()`` deregisters
    (on eviction, least recently used first, when ``capacity`` bytes are exceeded).
    """

    def __init__(self, factory: Callable[[int, int, str], Any], capacity: int = MR_CACHE_BYTES) -> None:
        self.factory, self.capacity = factory, capacity
        self.entries: collections.OrderedDict[tuple[str, int, int], Any] = collections.OrderedDict()
        self.bytes = 0
        self.lock = threading.Lock()

    def get(self, addr: int, length: int, device: str = "cpu"):
        with self.lock:
            for key, mr in self.entries.items():
                dev, a, n = key
                if dev == device and a <= addr and addr + length <= a + n:
                    self.entries.move_to_end(key)
                    return mr
            mr = self.factory(addr, length, device)
            self.entries[(device, addr, length)] = mr
            self.bytes += length
            while self.bytes > self.capacity and len(self.entries) > 1:
                (_, _, n), old = self.entries.popitem(last=False)
                self.bytes -= n
                old.close()
            return mr

    def invalidate(self, addr: int, length: int, device: str = "cpu") -> None:
        """Deregister every entry overlapping [addr, addr + length) (the memory is going away)."""
        with self.lock:
            for key in [k for k in self.entries if k[0] == device and k[1] < addr + length and addr < k[1] + k[2]]:
                self.bytes -= key[2]
                self.entries.pop(key).close()


# ---- pyverbs ---------------------------------------------------------------------------
PYVERBS_DIRS = [setting("MONARCH_TENSOR_PYVERBS_DIR") or "", "/usr/lib/python3/dist-packages/pyverbs"]


def import_pyverbs():
    """``import pyverbs``, or the distribution's copy (python3-pyverbs) when the venv has none.

    Only the ``pyverbs`` package is taken from the system directory, not the rest of it.
    """
    import importlib.util
    import sys

    try:
        import pyverbs
        return pyverbs
    except ImportError:
        pass
    for d in PYVERBS_DIRS:
        init = os.path.join(d, "__init__.py") if d else ""
        if init and os.path.exists(init):
            spec = importlib.util.spec_from_file_location("pyverbs", init, submodule_search_locations=[d])
            mod = importlib.util.module_from_spec(spec)
            sys.modules["pyverbs"] = mod
            try:
                spec.loader.exec_module(mod)
            except Exception:
                del sys.modules["pyverbs"]
                raise
            return mod
    raise ImportError("no module named pyverbs (apt install python3-pyverbs, or set MONARCH_TENSOR_PYVERBS_DIR)")


@functools.lru_cache(maxsize=1)
def unavailable_reason() -> str | None:
    """None when pyverbs imports and finds a device; else why not (in words)."""
    try:
        import_pyverbs()
        from pyverbs import device as d
        from pyverbs.pyverbs_error import PyverbsError
    except ImportError as e:
        return f"pyverbs does not import ({e}); install the distribution's python3-pyverbs"
    try:
        devs = d.get_device_list()
    except PyverbsError as e:  # ENOSYS when the kernel has no RDMA support at all
        return f"no RDMA device (pyverbs: {e})"
    if not devs:
        return "no RDMA device"
    return None


def available() -> bool:
    return not config.get("rdma_disable_ibverbs") and unavailable_reason() is None


def enum(name: str) -> int:
    """An ibverbs constant, from ``pyverbs.libibverbs_enums`` (rdma-core >= 50) or ``pyverbs.enums``."""
    try:
        import pyverbs.libibverbs_enums as e

        for cls in vars(e).values():
            if hasattr(cls, name):
                return int(getattr(cls, name))
    except ImportError:
        pass
    import pyverbs.enums as e2

    return int(getattr(e2, name))


class _Device:
    """One opened RDMA device: context, protection domain, completion queue, port attributes."""

    def __init__(self, name: str | None) -> None:
        from pyverbs import cq, device, pd

        names = [dv.name.decode() if isinstance(dv.name, bytes) else dv.name for dv in device.get_device_list()]
        self.name = name or names[0]
        self.ctx = device.Context(name=self.name)
        self.pd = pd.PD(self.ctx)
        self.cq = cq.CQ(self.ctx, 4096, None, None, 0)
        self.port = self.ctx.query_port(PORT)
        self.gid_index = GID_INDEX if GID_INDEX >= 0 else self._pick_gid()
        self.gid = self.ctx.query_gid(PORT, self.gid_index)
        self.lock = threading.Lock()
        self.mrs = MRCache(self._register)

    def _pick_gid(self) -> int:
        if self.port.link_layer == enum("IBV_LINK_LAYER_INFINIBAND"):
            return 0
        for i in range(self.port.gid_tbl_len):
            try:
                if self.ctx.query_gid_type(PORT, i) == enum("IBV_GID_TYPE_ROCE_V2"):
                    return i
            except Exception:  # noqa: BLE001 - older pyverbs: take the first non-zero gid
                return 1
        return 0

    def _register(self, addr: int, length: int, device: str):
        from pyverbs import mr

        access = (enum("IBV_ACCESS_LOCAL_WRITE") | enum("IBV_ACCESS_REMOTE_READ")
                  | enum("IBV_ACCESS_REMOTE_WRITE"))
        if device == "cpu":
            return mr.MR(self.pd, length, access, address=addr)
        fd, base = _dmabuf_fd(addr, length)
        return mr.DmaBufMR(self.pd, length, access, dmabuf=fd, offset=addr - base)

    def endpoint(self, qp) -> Endpoint:
        return Endpoint(qp.qp_num, qp.qp_num & 0xFFFFFF, self.port.lid, gid_bytes(self.gid.gid),
                        int(self.port.active_mtu))

    def new_qp(self):
        from pyverbs import qp

        cap = qp.QPCap(max_send_wr=512, max_recv_wr=1, max_send_sge=1, max_recv_sge=1)
        init = qp.QPInitAttr(qp_type=enum("IBV_QPT_RC"), scq=self.cq, rcq=self.cq, cap=cap, sq_sig_all=1)
        attr = qp.QPAttr(port_num=PORT)
        attr.qp_access_flags = (enum("IBV_ACCESS_LOCAL_WRITE") | enum("IBV_ACCESS_REMOTE_READ")
                                | enum("IBV_ACCESS_REMOTE_WRITE"))
        return qp.QP(self.pd, init, attr)

    def connect(self, qp, remote: Endpoint) -> None:
        from pyverbs import addr
        from pyverbs import qp as qpm

        attr = qpm.QPAttr(port_num=PORT)
        attr.dest_qp_num, attr.rq_psn, attr.sq_psn = remote.qp_num, remote.psn, qp.qp_num & 0xFFFFFF
        attr.path_mtu = min(remote.mtu, int(self.port.active_mtu))
        attr.max_rd_atomic = attr.max_dest_rd_atomic = MAX_OUTSTANDING
        attr.min_rnr_timer, attr.timeout, attr.retry_cnt, attr.rnr_retry = 12, 14, 7, 7
        if self.port.link_layer == enum("IBV_LINK_LAYER_INFINIBAND") and not any(remote.gid):
            attr.ah_attr = addr.AHAttr(dlid=remote.lid, port_num=PORT)
        else:
            gr = addr.GlobalRoute(dgid=addr.GID(_gid_str(remote.gid)), sgid_index=self.gid_index, hop_limit=64)
            attr.ah_attr = addr.AHAttr(is_global=1, gr=gr, port_num=PORT)
        qp.to_rts(attr)

    def post_and_wait(self, qp, opcode: int, lkey: int, laddr: int, rkey: int, raddr: int, length: int,
                      deadline: float) -> None:
        from pyverbs import wr

        with self.lock:  # one completion queue per device: one transfer polls it at a time
            for batch in plan_chunks(length):
                for off, n in batch:
                    send = wr.SendWR(opcode=opcode, num_sge=1, sg=[wr.SGE(laddr + off, n, lkey)])
                    send.set_wr_rdma(rkey, raddr + off)
                    qp.post_send(send)
                left = len(batch)
                while left:
                    check_deadline(deadline, "RDMA completion")
                    n, wcs = self.cq.poll(num_entries=left)
                    for wc in wcs[:n]:
                        if wc.status != enum("IBV_WC_SUCCESS"):
                            raise TransferError(f"RDMA work completion failed with status {wc.status} "
                                                "(remote access error: the buffer was probably dropped)")
                    left -= n
                    if not n:
                        time.sleep(0)


def gid_bytes(text: str) -> bytes:
    """pyverbs's GID text ("fe80:0000:...:0001") as 16 bytes."""
    raw = bytes.fromhex(text.replace(":", ""))
    if len(raw) != 16:
        raise ValueError(f"a GID is 16 bytes, got {text!r}")
    return raw


def _gid_str(gid: bytes) -> str:
    h = gid.hex()
    return ":".join(h[i:i + 4] for i in range(0, 32, 4))


def _dmabuf_fd(ptr: int, length: int) -> tuple[int, int]:
    """A dmabuf fd for the CUDA allocation holding ``ptr`` and that allocation's base address."""
    import ctypes

    cuda = ctypes.CDLL("libcuda.so.1")
    base, size, fd = ctypes.c_uint64(), ctypes.c_size_t(), ctypes.c_int()
    if cuda.cuMemGetAddressRange_v2(ctypes.byref(base), ctypes.byref(size), ctypes.c_uint64(ptr)) != 0:
        raise BackendRefusedError("cuMemGetAddressRange failed: not CUDA memory?")
    rc = cuda.cuMemGetHandleForAddressRange(ctypes.byref(fd), base, size, 1, 0)  # 1: DMA_BUF_FD
    if rc != 0:
        raise BackendRefusedError(f"cuMemGetHandleForAddressRange failed ({rc}): no dmabuf support")
    return fd.value, base.value


_device: _Device | None = None
_device_lock = threading.Lock()


def device() -> _Device:
    global _device
    with _device_lock:
        if _device is None:
            _device = _Device(DEVICE)
        return _device


# ---- connections: the handshake ---------------------------------------------------------
class Connections:
    """Queue pairs by peer, made lazily; ``exchange(peer_addr, my_endpoint) -> their endpoint`` is the seam."""

    def __init__(self, dev_factory: Callable[[], Any], exchange: Callable[[str, str, bytes], bytes]) -> None:
        self.dev_factory, self.exchange = dev_factory, exchange
        self.qps: dict[tuple[str, str], Any] = {}
        self.lock = threading.Lock()

    def to_owner(self, owner: str, device_name: str):
        """The queue pair to ``owner``'s device (reader side)."""
        with self.lock:
            qp = self.qps.get((owner, device_name))
            if qp is None:
                dev = self.dev_factory()
                qp = dev.new_qp()
                theirs = Endpoint.unpack(self.exchange(owner, device_name, dev.endpoint(qp).pack()))
                dev.connect(qp, theirs)
                self.qps[(owner, device_name)] = qp
            return qp

    def accept(self, peer: str, endpoint: bytes) -> bytes:
        """Owner side of the handshake: a queue pair for ``peer``, connected to its ``endpoint``."""
        theirs = Endpoint.unpack(endpoint)
        dev = self.dev_factory()
        with self.lock:
            qp = dev.new_qp()
            dev.connect(qp, theirs)
            self.qps[(peer, "accepted")] = qp
        return dev.endpoint(qp).pack()


def exchange_over_mailbox(owner: str, device_name: str, endpoint: bytes, timeout: float = 30.0) -> bytes:
    """Send our endpoint to ``owner``'s mailbox (``ConnectQueuePair``) and wait for its reply."""
    from monarch_tensor.future import Future
    from monarch_tensor.transport.mailbox import current_mailbox

    from ..messages import ConnectQueuePair

    mb = current_mailbox()
    fut: Future = Future("queue-pair handshake")

    class _Reply:
        observing = False

        def deliver(self, msg) -> bool:
            fut._set_exception(msg.error) if msg.error is not None else fut._set_result(msg.value)
            return True

        def proc_died(self, addr, error) -> tuple[bool, bool]:
            if addr == owner:
                fut._set_exception(error)
                return True, True
            return False, False

    port = mb.open_port(_Reply())
    death = mb.death_of(owner)  # (reported before the port opened: it never reaches the port)
    if death is not None:
        mb.close_port(port.port_id)
        raise death
    mb.send(owner, ConnectQueuePair(mb.addr, device_name, endpoint, port))
    try:
        return fut.get(timeout)
    except TimeoutError:
        raise TransferTimeoutError(f"no queue-pair handshake reply from {owner} within {timeout} s") from None
    finally:
        mb.close_port(port.port_id)


_connections: Connections | None = None


def connections() -> Connections:
    global _connections
    if _connections is None:
        _connections = Connections(device, exchange_over_mailbox)
    return _connections


def accept_connection(peer: str, device_name: str, endpoint: bytes) -> bytes:
    """Called by the ``ConnectQueuePair`` handler in the owner."""
    if not available():
        raise BackendRefusedError(f"no RDMA device in the owner: {unavailable_reason()}")
    return connections().accept(peer, endpoint)


def _forget_mr(reg) -> None:
    """A dropped registration's memory may be freed: deregister it (remote access then fails)."""
    if _device is not None:
        _device.mrs.invalidate(reg.mem.ptr, reg.mem.nbytes, reg.mem.device)


class VerbsBackend(Backend):
    name = "verbs"
    cpu_only = False
    remote_cpu_only = False

    def available(self) -> bool:
        return available()

    def unavailable_reason(self) -> str | None:
        if config.get("rdma_disable_ibverbs"):
            return "configure(rdma_disable_ibverbs=True) turns it off"
        return unavailable_reason()

    def register(self, mem: Mem, extras: dict) -> None:
        from .._registry import registry

        dev = device()
        hooks = registry().on_drop
        if _forget_mr not in hooks:
            hooks.append(_forget_mr)
        mr = dev.mrs.get(mem.ptr, mem.nbytes, mem.device)
        addr = mem.ptr if mem.device == "cpu" else mem.ptr - _dmabuf_fd(mem.ptr, mem.nbytes)[1]
        extras["verbs"] = RemoteMemory(dev.name, addr, mr.rkey, mem.nbytes).pack()

    def usable(self, desc: Descriptor, local: Mem) -> bool:
        return "verbs" in desc.extras and bool(desc.owner)

    def _go(self, desc: Descriptor, offset: int, local: Mem, deadline: float, opcode: str) -> None:
        remote = RemoteMemory.unpack(desc.extras["verbs"])
        dev = device()
        qp = connections().to_owner(desc.owner, remote.device)
        mr = dev.mrs.get(local.ptr, local.nbytes, local.device)
        laddr = local.ptr if local.device == "cpu" else local.ptr - _dmabuf_fd(local.ptr, local.nbytes)[1]
        dev.post_and_wait(qp, enum(opcode), mr.lkey, laddr, remote.rkey, remote.addr + offset, local.nbytes,
                          deadline)

    def _read(self, desc: Descriptor, offset: int, local: Mem, deadline: float) -> None:
        self._go(desc, offset, local, deadline, "IBV_WR_RDMA_READ")

    def _write(self, desc: Descriptor, offset: int, local: Mem, deadline: float) -> None:
        self._go(desc, offset, local, deadline, "IBV_WR_RDMA_WRITE")
