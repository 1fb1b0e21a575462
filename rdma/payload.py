"""Large message buffers over the data plane, for messages that leave this host.

A message whose out-of-band buffers (tensor and ndarray bytes) add up to
``THRESHOLD`` bytes or more, sent to another host (a ``tcp://`` address, or a
proc behind a host agent), does not carry those bytes on the control
connection. The sender copies them once into one buffer (a snapshot: the
caller may change its tensors as soon as ``send`` returns), registers it like
an ``RDMABuffer`` and sends a small descriptor in their place. Each receiver
pulls the bytes while it decodes the message, over the best backend for the
pair (verbs where there is a NIC, cma when the "other host" is this machine,
else tcp's parallel streams), and tells the sender it is done. The
registration is dropped when every receiver has pulled, or ``TTL`` seconds
after the send, whichever comes first.

A pull that fails (the sender died, the network failed) never loses the
message silently: decoding raises :class:`PayloadLost` carrying the message
rebuilt over zeroed bytes, and the mailbox fails whoever waits on it (see
``Mailbox._lost``).

Environment: ``MONARCH_TENSOR_PAYLOAD_THRESHOLD`` (bytes; 0 sends every
payload in the message frames), ``MONARCH_TENSOR_PAYLOAD_TTL`` (seconds),
``MONARCH_TENSOR_PAYLOAD_MAX_BYTES`` (bytes published and not yet pulled, per
process; beyond it a message carries its bytes in its frames).
"""

from __future__ import annotations

import logging
import mmap
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from monarch_tensor.config import setting

from ._host import per_process
from .errors import RDMAError

if TYPE_CHECKING:
    from .buffer import RDMABuffer

log = logging.getLogger("monarch_tensor.rdma")

THRESHOLD = setting("MONARCH_TENSOR_PAYLOAD_THRESHOLD")
# (0 or less dropped every registration at once, failing every pull: at least a second)
TTL = setting("MONARCH_TENSOR_PAYLOAD_TTL")
MAX_BYTES = setting("MONARCH_TENSOR_PAYLOAD_MAX_BYTES")
POOL_BYTES = setting("MONARCH_TENSOR_PAYLOAD_POOL_BYTES")  # snapshots kept warm
_ALIGN = 64
_HUGE = 2 << 20
_PAGED = 64 << 10


def _alloc(n: int) -> np.ndarray:
    """``n`` bytes of fresh memory, page-aligned from ``_PAGED`` up (a snapshot and its reader's copy then
    start at the same offset within a page: the kernel's copy between memory a few bytes apart within a
    page is slow, see rdma/backends/cma.py's ``short_distance``); from 2 MiB up on transparent huge pages
    where the kernel has them: a transfer into fresh memory then takes one page fault per 2 MiB, not per
    4 KiB (about 1.5x faster)."""
    if n < _PAGED:
        return np.empty(n, dtype=np.uint8)
    m = mmap.mmap(-1, n, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if n >= _HUGE and advice is not None:
        try:
            m.madvise(advice)
        except OSError:
            pass
    return np.frombuffer(m, dtype=np.uint8)  # keeps the mapping alive as long as any view of it


class PayloadError(RDMAError):
    """A message's payload could not be pulled from its sender over the data plane."""


@dataclass(frozen=True, slots=True)
class Payload:
    """What travels in a message instead of its buffers: where to pull them from and how to cut them."""

    buf: RDMABuffer  # over the sender's snapshot
    layout: tuple  # ((offset, nbytes), ...) of each out-of-band buffer in the snapshot
    release_to: str  # the sender's mailbox address, as the receivers reach it


class _Published:
    """The sender's side: live snapshots, how many receivers each still waits for, and when it expires."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.live: dict[int, list] = {}  # buf_id -> [receivers left, deadline, nbytes, buffer]
        self.nbytes = 0
        self.stats = {"published": 0, "published_bytes": 0, "released": 0, "expired": 0,
                      "pulled": 0, "pulled_bytes": 0, "lost": 0}
        self.sweeper: threading.Thread | None = None
        self.free: list[np.ndarray] = []  # released snapshots, reused warm (at most POOL_BYTES of them)

    def take(self, n: int) -> np.ndarray:
        """Memory for a snapshot of ``n`` bytes (maybe more): a released one that fits (warm pages), else
        fresh memory."""
        with self.lock:
            fits = [i for i, a in enumerate(self.free) if n <= a.nbytes <= 2 * n]
            if fits:
                return self.free.pop(min(fits, key=lambda i: self.free[i].nbytes))
        return _alloc(n)

    def add(self, buf, readers: int, nbytes: int, memory: np.ndarray) -> None:
        with self.lock:
            self.live[buf._desc.buf_id] = [readers, time.monotonic() + TTL, nbytes, buf, memory]
            self.nbytes += nbytes
            self.stats["published"] += 1
            self.stats["published_bytes"] += nbytes
            if self.sweeper is None:
                self.sweeper = threading.Thread(target=self._sweep, name="mt-payload-ttl", daemon=True)
                self.sweeper.start()

    def release(self, buf_id: int, token: int) -> None:
        with self.lock:
            entry = self.live.get(buf_id)
            if entry is None or entry[3]._desc.token != token:
                return
            entry[0] -= 1
            if entry[0] > 0:
                return
            del self.live[buf_id]
            self.nbytes -= entry[2]
            self.stats["released"] += 1
        entry[3].drop()
        with self.lock:  # every receiver has its bytes: the memory may carry the next snapshot
            self.free.append(entry[4])
            while sum(a.nbytes for a in self.free) > POOL_BYTES:
                self.free.pop(0)

    def _sweep(self) -> None:
        while True:
            time.sleep(min(5.0, max(0.05, TTL / 4)))
            now = time.monotonic()
            with self.lock:
                gone = [k for k, e in self.live.items() if e[1] <= now]
                entries = [self.live.pop(k) for k in gone]
                for e in entries:
                    self.nbytes -= e[2]
            for e in entries:  # their memory is not reused: a receiver may still be reading it
                log.warning("a message payload of %d bytes was not pulled by %d receiver(s) within %.0f s; "
                            "dropped", e[2], e[0], TTL)
                e[3].drop()
            if entries:  # counted once dropped: whoever sees the count sees the registrations gone
                with self.lock:
                    self.stats["expired"] += len(entries)


_published = per_process(_Published)


def stats() -> dict:
    """This process's payload counts: published (as a sender), pulled (as a receiver), live, expired, lost."""
    p = _published()
    with p.lock:
        return dict(p.stats, live=len(p.live), live_bytes=p.nbytes)


def wanted(raws: list) -> bool:
    """Whether buffers this large go on the data plane rather than in the frames."""
    return THRESHOLD > 0 and sum(r.nbytes for r in raws) >= THRESHOLD


def publish(raws: list[memoryview], readers: int, release_to: str) -> Payload | None:
    """Snapshot ``raws`` into one registered buffer for ``readers`` receivers; None to send them in frames.

    The caller pickles the returned ``Payload`` within ``_wire.towards(a receiver's address)``, so that
    the data server is announced at this machine's address on the route there.
    """
    from .buffer import RDMABuffer

    layout, total = [], 0
    for r in raws:
        layout.append((total, r.nbytes))
        total += (r.nbytes + _ALIGN - 1) & ~(_ALIGN - 1)
    p = _published()
    with p.lock:
        if p.nbytes + total > MAX_BYTES:
            return None
    memory = p.take(total)
    snap = memory[:total]
    for (off, n), r in zip(layout, raws):
        snap[off:off + n] = np.frombuffer(r, dtype=np.uint8)
    buf = RDMABuffer(snap)
    p.add(buf, readers, total, memory)
    return Payload(buf, tuple(layout), release_to)


def pull(payload: Payload, timeout: float | None = None) -> list[memoryview]:
    """Pull a message's buffers from its sender; tell the sender when done. Raises ``PayloadError``."""
    layout = payload.layout
    total = payload.buf.size()
    dst = _alloc(total)
    try:
        if timeout is None:
            from monarch_tensor import config

            timeout = config.get("payload_timeout")  # (Monarch's message_delivery_timeout)
        payload.buf.read_into(dst.data, timeout=timeout).get()
    except BaseException as e:  # reported as the message's failure
        with _published().lock:
            _published().stats["lost"] += 1
        raise PayloadError(f"a message's payload of {total} bytes could not be pulled from its sender "
                           f"({payload.release_to or payload.buf.owner}) over the data plane: {e}") from e
    finally:
        _release(payload)
    p = _published()
    with p.lock:
        p.stats["pulled"] += 1
        p.stats["pulled_bytes"] += total
    mv = dst.data
    return [mv[off:off + n] for off, n in layout]


def placeholders(payload: Payload) -> list[memoryview]:
    """Zeroed buffers of the payload's layout: enough to rebuild a message whose pull failed, to fail it."""
    zeros = np.zeros(payload.buf.size(), dtype=np.uint8).data  # calloc: pages never touched stay free
    return [zeros[off:off + n] for off, n in payload.layout]


def _release(payload: Payload) -> None:
    from monarch_tensor.transport.mailbox import current_mailbox

    from .messages import ReleasePayload

    d = payload.buf._desc
    try:
        current_mailbox().send(payload.release_to, ReleasePayload(d.buf_id, d.token))
    except Exception as e:  # noqa: BLE001 - the sender's TTL drops it in the end
        log.debug("release of payload %d: %s", d.buf_id, e)


def handle_release(buf_id: int, token: int) -> None:
    _published().release(buf_id, token)
