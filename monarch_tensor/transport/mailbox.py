"""A process's mailbox: one ROUTER socket to receive, cached DEALERs to send.

Every process of the runtime (the client script and every proc) owns exactly
one ``Mailbox``. Its I/O thread receives, decodes and dispatches messages:
values for ports (call replies, channels) are delivered right there; everything
else goes to the process's ``on_message`` hook (a proc's actor runtime). In a
client, a thread that blocks on a reply (``Future.get``) takes the socket over
and receives itself until its reply is in (``lead``): the I/O thread lets go
while it waits, and takes over again once nobody has waited for ``_LINGER_S``.
A thread about to block for the next message first polls the socket for up to
``SPIN_S`` (200 µs) while messages lately came that soon (``Spin``): an idle
virtual CPU takes tens of µs to wake. Sending happens on the caller's thread
under a lock, so a call costs no thread hop on the way out. Messages from one
sender to one address arrive in order (one DEALER per destination).

Calls and their replies may be batched: a small one that follows another to
the same address within ``BATCH_GAP`` (200 µs) joins a batch that leaves as one
frame when someone waits on a reply, when the receiving loop has drained its
socket, when it is full, or after ``BATCH_DELAY`` (1 ms) at most. A lone call
(a round trip) is never delayed; 2,000 pipelined calls cost half the CPU per
call on both sides. Any other send flushes the batch first, so messages still
leave in the order they were sent.
"""

from __future__ import annotations

import collections
import itertools
import json
import logging
import os
import tempfile
import threading
import time
import uuid
from typing import Callable, Protocol

import zmq

from .. import future as _future
from ..config import setting
from ..errors import ProtocolError, SupervisionError
from . import _wire
from . import logs as _logs
from ._at_exit import at_exit
from ._fanout import GATHER_PREFIX, ROUTE_SEP, UP_MAGIC, read_up, routed_frames, up_header
from .messages import FoldedReplies, ForwardLogs, GatheredReplies, PortRef, SendToPort, port_ref

log = logging.getLogger("monarch_tensor.transport.mailbox")


def _us_from_env(name: str) -> float:
    """Seconds from a declared setting that holds microseconds."""
    return setting(name) * 1e-6


# Batching of calls and replies (see Mailbox.send_frames); MONARCH_TENSOR_BATCH_GAP_US=0 turns it off.
BATCH_GAP = _us_from_env("MONARCH_TENSOR_BATCH_GAP_US")
_NEVER = float("-inf")  # a last-send time that no next send is within BATCH_GAP of
BATCH_DELAY = 0.001  # the longest a batched message waits
BATCH_MAX = 512  # messages in one batch
BATCH_BYTES = 1 << 18

# zmq's constants as plain ints: ``int & IntFlag`` runs enum code in Python (several µs per message).
_EVENTS, _POLLIN, _RCVMORE, _NOBLOCK = int(zmq.EVENTS), int(zmq.POLLIN), int(zmq.RCVMORE), int(zmq.NOBLOCK)
# A thread that blocks on a reply receives on the client's socket itself while it waits, instead of
# waiting for the I/O thread to hand the reply over: a synchronous call then pays one thread wake-up
# less (measured 230-240 -> 158 µs a round trip on a 2-core VM). 0 turns it off.
RECEIVE_ON_WAIT = setting("MONARCH_TENSOR_RECEIVE_ON_WAIT")
# Polling before blocking for the next message (see Spin); 0 turns it off.
SPIN_S = _us_from_env("MONARCH_TENSOR_SPIN_US")
_sched_yield = getattr(os, "sched_yield", None) or (lambda: time.sleep(0))  # both release the GIL
_LEAD_SLICE_MS = 100  # a receiving waiter's longest poll before it looks at the clock and the mailbox
_EXIT_LINGER_MS = 2000  # at a script's exit, how long what it sent last may wait for its peer (_close_at_exit)
_LINGER_S = 0.002  # after a waiter received, the I/O thread waits this long for the next one before it takes over
_PARKED_S = 1.0  # the I/O thread's longest wait while a waiter that notifies it as it leaves receives (a backstop)
_HELP_TICK_S = 0.002  # how long a message waits on a busy proc's socket before a waiting thread takes it (receive_for)


# System messages (workspace sync, env, debugger, the data plane's) handled by whichever process receives them,
# by message type: ``handler(mailbox, msg)``. The tools' handlers are installed from their registry entries
# (``runtime/_hooks.py``: in every proc before it serves, the debugger's in every process); the data plane's,
# the actor layer's and hosts' by their modules as they load.
SYSTEM_HANDLERS: dict[type, Callable[[Mailbox, object], None]] = {}


# Messages that have no reply port but waiters all the same (the tensor engine's batches and to_mesh data):
# when one cannot be read whole, ``rewrite(msg, error, payload_lost)`` gives the message to handle instead;
# ``payload_lost``: its buffers could not be pulled (the message holds zeros for them), else the pieces that
# could not be unpickled are stubs (``_wire.holds``). Keyed by (actor, method).
LOST_REWRITES: dict[tuple[str, str], Callable[[object, BaseException, bool], object]] = {}


class PortHandler(Protocol):
    def deliver(self, msg: SendToPort) -> bool:
        """Take one value; return True when the port is finished and can be closed."""

    def proc_died(self, addr: str, error: SupervisionError) -> tuple[bool, bool]:
        """A proc died; return whether this port waited on its answer (its waiter is told: the death is
        seen, not an unhandled fault), and whether the port is finished and can be closed. A port that
        waits on several procs stays open after a first death, to see the next one too."""


def socket_dir() -> str:
    """The 0700 directory that holds this user's ipc sockets."""
    d = os.path.join(tempfile.gettempdir(), f"monarch-tensor-{os.getuid()}")
    os.makedirs(d, mode=0o700, exist_ok=True)
    os.chmod(d, 0o700)
    return d


def new_ipc_address(kind: str) -> str:
    return f"ipc://{socket_dir()}/{kind}-{os.getpid()}-{uuid.uuid4().hex[:10]}"


_loadavg_fd: int | None = None
_NCPU = os.cpu_count() or 1


def _crowded() -> bool:
    """Whether more than twice as many threads want to run as this machine has cores (Linux's count of
    runnable tasks, in /proc/loadavg): then a polling thread takes a core from one that has work (8 procs
    on 2 cores). Twice: zmq's own I/O threads are runnable for a moment around every message."""
    global _loadavg_fd
    if _loadavg_fd is None:
        try:
            _loadavg_fd = os.open("/proc/loadavg", os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        except OSError:
            _loadavg_fd = -1
    if _loadavg_fd < 0:
        return False
    try:
        return int(os.pread(_loadavg_fd, 64, 0).split()[3].partition(b"/")[0]) > 2 * _NCPU
    except (OSError, ValueError, IndexError):
        return False


class _Replies:
    """Plain values for one port from a chunk of gathered replies (``Mailbox._chunk_parts``), in order."""

    __slots__ = ("port_id", "ranks", "values")

    def __init__(self, port_id: int, ranks: list, values: list) -> None:
        self.port_id, self.ranks, self.values = port_id, ranks, values


class Spin:
    """Polls a socket for up to ``SPIN_S`` before its thread blocks for the next message, as long as the
    last wait ended within ``SPIN_S`` (a loop of synchronous calls, a reply due soon); after a longer one
    it blocks at once until a short one is seen again, so an idle or slow peer costs no CPU.

    Blocked, a thread waits for the scheduler to wake its core: tens of µs on an idle virtual CPU, on each
    side of every round trip. Polling, it releases the GIL at each try (``os.sched_yield``), so the
    process's other threads run meanwhile; on a crowded machine (``_crowded``) it blocks at once. One
    thread uses a Spin at a time.
    """

    __slots__ = ("_sock", "_seconds", "_on", "_since")

    def __init__(self, sock: zmq.Socket, seconds: float = -1.0) -> None:
        self._sock = sock
        self._seconds = SPIN_S if seconds < 0 else seconds
        self._on = True
        self._since = 0.0

    def poll(self, until: Callable[[], bool] | None = None) -> bool:
        """Before blocking: True when a message came while polling (receive it instead of blocking), or
        ``until()`` became true (what the thread waits for happened elsewhere)."""
        now = time.perf_counter()
        self._since = now
        if not self._on or self._seconds <= 0:
            return False
        end = now + self._seconds
        get, yield_ = self._sock.getsockopt, _sched_yield
        tries = 0
        while True:
            if get(_EVENTS) & _POLLIN or (until is not None and until()):
                return True
            if time.perf_counter() >= end:
                self._on = False  # until a blocked wait shows the gaps are short again (woke)
                return False
            if tries & 31 == 0 and _crowded():
                return False  # polling would take a core from a thread that has work
            tries += 1
            yield_()

    def woke(self, now: float = 0.0) -> None:
        """After the blocking wait that followed ``poll`` (``now``: when it ended, if not now)."""
        self._on = (now or time.perf_counter()) - self._since <= self._seconds


class Mailbox:
    """Receives on ``self.addr``; ``send(addr, msg)`` to any other mailbox."""

    def __init__(self, addr: str | None = None, on_message: Callable[[object], None] | None = None,
                 on_logs: Callable[[ForwardLogs], None] | None = None, io_thread: bool = True) -> None:
        self.ctx = zmq.Context()
        self.addr = addr or new_ipc_address("client")
        self._router = self.ctx.socket(zmq.ROUTER)
        self._router.setsockopt(zmq.LINGER, 0)
        self._router.bind(self.addr)
        self._out: dict[str, zmq.Socket] = {}
        self._send_lock = threading.Lock()
        self._batch_addr: str | None = None  # the address the waiting batch goes to
        self._batch: list = []
        self._batch_bytes = 0
        self._last_addr: str | None = None  # where the last batchable message went, and when
        self._last_t = _NEVER
        self._flusher: threading.Thread | None = None
        self._flush_wake = threading.Event()
        self.batches_sent = 0  # frames that carried more than one message
        self._ports: dict[int, PortHandler] = {}
        self._ports_to_close: collections.deque = collections.deque()  # (close_port_later)
        self._ports_lock = threading.Lock()
        self._port_ids = itertools.count(1)
        self.on_message = on_message
        self.on_logs = on_logs
        self._dead: dict[str, SupervisionError] = {}
        self._closed = False
        self._thread: threading.Thread | None = None
        self.receiver_ident: int | None = None  # the thread that receives (None: the I/O thread)
        # Where messages other than port values go while the receiving thread blocks in wait_until.
        self.on_deferred: Callable[[object], None] | None = None
        # A proc's: told of a SpawnActor that could not be read here (its caller gets the error too).
        self.on_lost_spawn: Callable[[object, BaseException], None] | None = None
        # A proc's: for a value it sends to an address now, what of its output must reach there first
        # (``SendToPort.output_before``; see _proc.ProcRuntime.output_before). A script's: nothing.
        self.output_before: Callable[[str], tuple | None] = lambda addr: None
        # A relayed proc's instead: ``output_before`` asked once per frame as it leaves (a batch of replies: once
        # for all of them), under ``_send_lock``; what it returns goes ahead of the frame as a ``SendToPort`` to
        # port 0, which only carries ``output_before`` (``_marked``).
        self.output_mark: Callable[[str], tuple | None] | None = None
        self._waits: list = []  # the futures the receiving thread waits on in wait_until, innermost last
        # A proc's: runs its event loop's due work once while the receiving thread (the loop's) blocks in
        # wait_until, so that what the wait needs (an async endpoint of another actor) runs meanwhile; returns
        # the seconds until the loop has more to do (0: now; None: nothing scheduled). ``blocked_wake_fd``
        # becomes readable when another thread hands the loop work; ``after_waits`` runs as the outermost
        # wait ends.
        self.on_blocked_turn: Callable[[], float | None] | None = None
        self.blocked_wake_fd: int | None = None
        self.after_waits: Callable[[], None] | None = None
        # An in-process runtime's: wakes its thread blocked in wait_until when another thread settled a Future.
        self.wake_waiter: Callable[[], None] | None = None
        # A mailbox without an I/O thread (a proc's): messages that another thread waiting on a reply received
        # while the receiving thread was busy (``receive_for``), for the receiving thread, in order, as
        # (message, Unreadable or None); ``on_held()`` tells the receiving thread that some are there.
        self._held: collections.deque = collections.deque()
        self.on_held: Callable[[], None] | None = None
        # Addresses reached through another one (a remote controller's ipc address -> its tcp gateway).
        self.aliases: dict[str, str] = json.loads(setting("MONARCH_TENSOR_ALIASES") or "{}")
        # A proc behind a host agent: its controller's tcp gateway, which also relays to the controller's
        # procs on its own host (``this_host()``'s), whose ipc sockets are not on this host, and to the
        # procs of the controller's other jobs, whose keys this host does not hold (``_resolve``).
        self.gateway = (setting("MONARCH_TENSOR_GATEWAY") or "")
        self._here: set[str] = set()  # ipc addresses whose sockets are on this host
        self.relayed: set[str] = set()  # other jobs' agents, reached through the gateway (KnowPeers)
        # The address others reach this mailbox at, in ports (a proc behind a host agent: a routed one).
        pub = (setting("MONARCH_TENSOR_PUBLIC_ADDR") or "")
        self.public_addr = pub.partition("=")[2] if pub.startswith(self.addr + "=") else self.addr
        # A proc behind a host agent: what it sends its caller (``up_for``) goes up through the agent
        # (``set_up``, see _fanout.py), on a socket to the agent whose identity is the proc's id there.
        self.up_for: str | None = None
        self._up_sock: zmq.Socket | None = None
        self._up_head = b""
        self._up_k = self._up_w = ""
        # Who receives (the socket is used by one thread at a time): the I/O thread, unless a waiter
        # took over (``lead``). ``_rx_lock`` is held while receiving; waiters that want the socket count
        # themselves in ``_wanted`` and poke the I/O thread's pipe so it parks.
        # Re-entrant: the thread that receives holds it while it delivers a reply, and a callback of that
        # reply's Future may wait on another reply (receiving meanwhile), as may a payload's pull while a
        # proc's thread decodes a message (rdma/_future.py).
        self._rx_lock = threading.RLock()
        self._lead_cv = threading.Condition()
        self._wanted = 0
        self._lead_until = _NEVER  # the I/O thread stays parked until then (see _loop)
        self._io_parked = False
        self._leads = 0  # waits that took the socket so far: the I/O thread tells one long wait from many short ones
        self._io_long = False  # the I/O thread waits for a notify, not a tick: a waiter that leaves notifies it
        self._io_ident: int | None = None
        self._spin = Spin(self._router)  # used by whoever holds _rx_lock (lead), or by a proc's loop
        self._lead_poller: zmq.Poller | None = None  # the socket and _lead_wake_r, for whoever leads (made once)
        self._io_wake_r = self._io_wake_w = self._lead_wake_r = self._lead_wake_w = -1
        if io_thread:
            self._io_wake_r, self._io_wake_w = _pipe()
            self._lead_wake_r, self._lead_wake_w = _pipe()
            self._thread = threading.Thread(target=self._loop, name="monarch-tensor-io", daemon=True)
            self._thread.start()

    # ---- sending ----------------------------------------------------------
    def _socket_for(self, addr: str) -> zmq.Socket:
        s = self._out.get(addr)
        if s is None:
            s = self.ctx.socket(zmq.DEALER)
            s.setsockopt(zmq.LINGER, 2000)
            s.setsockopt(zmq.SNDHWM, 0)
            # A new proc may not have bound yet: retry every 5 ms, not zmq's default 100 ms.
            s.setsockopt(zmq.RECONNECT_IVL, 5)
            if addr.startswith("tcp://"):  # every TCP link is CURVE-authenticated and encrypted
                from . import _curve

                _curve.connect_curve(s, _curve.keys_for(addr))
            s.connect(addr)
            self._out[addr] = s
        return s

    def _resolve(self, addr: str) -> str:
        """Where ``addr`` is reached: an alias (a remote controller's tcp gateway), or, for a proc behind a
        host agent, the gateway's route to an ipc address whose socket is not on this host (a proc of the
        controller's host) or to a proc of another job's agent (``relayed``), or ``addr`` itself."""
        alias = self.aliases.get(addr)
        if alias is not None:
            return alias
        if self.gateway and addr.startswith("ipc://") and addr not in self._here:
            if os.path.exists(addr[len("ipc://"):]):  # (one stat per address)
                self._here.add(addr)
            else:
                alias = self.aliases[addr] = f"{self.gateway}{ROUTE_SEP}{addr}"
                return alias
        elif self.relayed and addr.partition(ROUTE_SEP)[0] in self.relayed:
            alias = self.aliases[addr] = f"{self.gateway}{ROUTE_SEP}{addr}"
            return alias
        return addr

    def route_of(self, addr: str) -> str:
        """The address a message to ``addr`` is sent to: ``addr`` itself, the tcp gateway it is reached
        through, or the host agent it is routed by."""
        return self._resolve(addr).partition(ROUTE_SEP)[0]

    def send(self, addr: str, msg: object, batch: bool = False) -> None:
        target = self.route_of(addr)
        if target.startswith("ipc://"):  # this host: large buffers through shared memory
            frames = _wire.encode(msg, shm=[target])
        else:  # another host: large buffers pulled by the receiver over the data plane
            frames = _wire.encode(msg, remote=(1, target, self.public_addr))
        self.send_frames(addr, frames, batch)

    def send_frames(self, addr: str, frames: list, batch: bool = False) -> None:
        """Send already-encoded frames (encode once, send to many).

        With ``batch`` (calls and their replies), a small message that follows another one to the
        same address within ``BATCH_GAP`` seconds waits to go out with the next ones in one frame:
        until someone waits on a reply (``flush``), the receiving loop has drained what came in, the
        batch is full, or at most ``BATCH_DELAY`` seconds. Any other send flushes it first, so
        messages leave in the order they were sent. A flush ends the burst: the next message leaves
        at once (a loop of synchronous calls is never batched).
        """
        if batch and BATCH_GAP > 0 and len(frames) == 1 and len(frames[0]) < BATCH_BYTES:
            self._send_batched(addr, frames[0], len(frames[0]))
            return
        with self._send_lock:
            if self._closed:
                raise RuntimeError("mailbox is closed")
            if self._batch:
                self._flush_locked()
            self._send_marked(addr, frames)

    def send_plain(self, addr: str, envelope: tuple, size: int | None = None) -> bool:
        """``send(addr, msg, batch=True)`` of a message given as its compact envelope (``_wire.COMPACT_ENCODERS``),
        where that is made of small immutable builtin values only (``_wire.frozen_size``, or ``size`` where the
        caller found it): in a batch it waits as the envelope itself, and the batch's run of them is pickled in
        one go when it leaves (``_wire.pack_runs``). False (nothing sent) for any other envelope, or with
        batching off."""
        if BATCH_GAP <= 0:
            return False
        if size is None:
            size = _wire.frozen_size(envelope)
        if size < 0:
            return False
        self._send_batched(addr, envelope, size)
        return True

    def _send_batched(self, addr: str, item: bytes | tuple, size: int) -> None:
        """``send_frames(..., batch=True)`` of one small message: its one frame, or its plain envelope (a tuple,
        encoded when it leaves)."""
        with self._send_lock:
            if self._closed:
                raise RuntimeError("mailbox is closed")
            if self._batch_addr == addr:
                self._batch.append(item)
                self._batch_bytes += size
                if len(self._batch) >= BATCH_MAX or self._batch_bytes >= BATCH_BYTES:
                    self._flush_locked()
                return
            if self._batch:
                self._flush_locked()
            now = time.monotonic()
            if addr == self._last_addr and now - self._last_t < BATCH_GAP:  # a burst: batch it
                self._batch_addr, self._batch, self._batch_bytes = addr, [item], size
                self._start_flusher()
                return
            self._last_addr, self._last_t = addr, now
            self._send_marked(addr, [_wire.encode_plain(item) if type(item) is tuple else item])

    def _send_marked(self, addr: str, frames: list) -> None:
        """Under ``_send_lock``: send ``frames`` now, after what ``output_mark`` says must reach ``addr`` first."""
        if self.output_mark is not None:
            mark = self._marked(addr)
            if mark is not None:
                self._send_now(addr, [mark])
        self._send_now(addr, frames)

    def _marked(self, addr: str) -> bytes | None:
        """Under ``_send_lock``, for a frame about to leave for ``addr``: the encoded message that must go ahead
        of it, saying what of this proc's output must reach ``addr`` first (``output_mark``), or None."""
        output = self.output_mark(addr)
        if output is None:
            return None
        return _wire.encode(SendToPort(0, None, None, -1, output))[0]

    def set_up(self, client_addr: str) -> None:
        """A proc behind a host agent: send what goes to ``client_addr`` (its caller) up through the agent."""
        up = (setting("MONARCH_TENSOR_AGENT_UP") or "")
        if not up or self.public_addr == self.addr or ROUTE_SEP not in self.public_addr:
            return
        s = self.ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 2000)
        s.setsockopt(zmq.SNDHWM, 0)
        s.setsockopt(zmq.IDENTITY, self.public_addr.rpartition(ROUTE_SEP)[2].encode())
        s.connect(up)
        w = self.route_of(client_addr)
        self._up_sock, self.up_for = s, client_addr
        self._up_head = up_header(b"p", {"w": w})
        self._up_k, self._up_w = json.dumps(client_addr), json.dumps(w)

    def send_gathered(self, client: str, msg: SendToPort, urgent: bool) -> None:
        """A reply to a gathered call of ``client`` (``PortRef(_fanout.GATHER_PREFIX + client, ...)``): up to this proc's
        agent, which gathers it with its peers' (see _fanout.py); a plain reply where there is no agent."""
        if client != self.up_for:
            self.send(client, msg, batch=True)
            return
        frames = _wire.encode(msg, remote=(1, self.route_of(client), self.public_addr))
        head = UP_MAGIC + b"g" + f'{{"k":[{self._up_k},{msg.port_id}],"u":{int(urgent)},"w":{self._up_w}}}'.encode()
        with self._send_lock:
            if self._closed:
                raise RuntimeError("mailbox is closed")
            if self._batch:
                self._flush_locked()
            self._up_sock.send_multipart([head, *frames], copy=_wire.is_small(frames))

    def _send_now(self, addr: str, frames: list) -> None:
        copy = _wire.is_small(frames)
        if addr == self.up_for:
            self._up_sock.send_multipart([self._up_head, *frames], copy=copy)
            return
        addr = self._resolve(addr)
        if ROUTE_SEP in addr:  # a proc behind a host agent (or gateway): along its path (see _fanout.py)
            agent, _, inner = addr.partition(ROUTE_SEP)
            addr, frames = routed_frames(agent, inner, frames)
        if len(frames) == 1:  # (most messages: one frame, without pyzmq's multipart loop and checks)
            self._socket_for(addr).send(frames[0], copy=copy)
        else:
            self._socket_for(addr).send_multipart(frames, copy=copy)

    def flush(self) -> None:
        """Send the waiting batch now (cheap when there is none) and end the burst.

        Callers are a thread about to wait on a reply, or a receiving loop with nothing left to
        handle: either way the sends so far were all the burst had, so the next message leaves at
        once instead of being taken for the burst's continuation. (In a loop of synchronous calls,
        each call follows the last one within ``BATCH_GAP``; batching them only delayed each one
        until its caller's wait flushed it, and woke the backstop thread every time.)
        """
        if self._batch:
            with self._send_lock:
                if self._batch and not self._closed:
                    self._flush_locked()
        self._last_t = _NEVER

    def _flush_locked(self) -> None:
        addr, batch = self._batch_addr, self._batch
        self._batch_addr, self._batch, self._batch_bytes = None, [], 0
        if self.output_mark is not None:
            mark = self._marked(addr)
            if mark is not None:
                batch.insert(0, mark)
        frames = _wire.pack_runs(batch)
        if len(frames) == 1:
            self._send_now(addr, frames)
        else:
            self._send_now(addr, [_wire.pack_batch(frames)])
        if len(batch) > 1:
            self.batches_sent += 1
        self._last_addr, self._last_t = addr, time.monotonic()

    def _start_flusher(self) -> None:
        """Wake the thread that sends a batch nobody flushed within ``BATCH_DELAY``."""
        if self._flusher is None:
            self._flusher = threading.Thread(target=self._flush_loop, name="monarch-tensor-flush", daemon=True)
            self._flusher.start()
        self._flush_wake.set()

    def _flush_loop(self) -> None:
        while not self._closed:
            self._flush_wake.wait()
            self._flush_wake.clear()
            time.sleep(BATCH_DELAY)
            try:
                self.flush()
            except Exception:  # never kills the thread; the waiting callers time out
                if not self._closed:
                    log.warning("could not send a batch of calls or replies", exc_info=True)

    def forget(self, addr: str) -> None:
        """Close the outgoing socket to ``addr`` (a stopped or dead proc)."""
        with self._send_lock:
            s = self._out.pop(addr, None)
            if s is not None:
                s.close(linger=0)

    # ---- ports --------------------------------------------------------------
    def open_port(self, handler: PortHandler) -> PortRef:
        pid = next(self._port_ids)
        with self._ports_lock:
            self._ports[pid] = handler
            while self._ports_to_close:
                self._ports.pop(self._ports_to_close.popleft(), None)
        return port_ref(self.public_addr, pid)

    def close_port_later(self, port_id: int) -> None:
        """``close_port`` from a garbage collector's callback (a channel whose receivers are gone), which may
        run on any thread at any allocation, this one's inside ``_ports_lock`` too: it closes the port now
        when the lock is free, else the next ``open_port`` does."""
        self._ports_to_close.append(port_id)
        if self._ports_lock.acquire(blocking=False):
            try:
                while self._ports_to_close:
                    self._ports.pop(self._ports_to_close.popleft(), None)
            finally:
                self._ports_lock.release()

    def close_port(self, port_id: int) -> None:
        with self._ports_lock:
            self._ports.pop(port_id, None)

    def proc_died(self, addr: str, error: SupervisionError) -> int:
        """Fail every port waiting on the proc at ``addr``; return how many were a user's calls."""
        self._dead[addr] = error
        with self._ports_lock:
            items = list(self._ports.items())
        observed = 0
        for pid, h in items:
            waited, finished = h.proc_died(addr, error)
            if waited:
                observed += getattr(h, "observing", True)
            if finished:
                self.close_port(pid)
        self.forget(addr)
        return observed

    def death_of(self, addr: str) -> SupervisionError | None:
        return self._dead.get(addr)

    def proc_born(self, addr: str) -> None:
        """A new proc was spawned at ``addr``: a death recorded there was an earlier proc's (a host agent whose
        port the system handed out again gives its procs the same addresses), not this one's."""
        self._dead.pop(addr, None)

    def any_death_among(self, addrs: list[str]) -> bool:
        """Whether a proc at one of ``addrs`` died (``death_of``), without a Python step per address."""
        return bool(self._dead) and not self._dead.keys().isdisjoint(addrs)

    # ---- receiving ----------------------------------------------------------
    def _recv(self, flags: int = 0) -> list:
        """One message's frames. Small frames are copied (measured twice as fast per
        message as zero-copy frames); only buffer frames are received zero-copy."""
        r = self._router
        r.recv(flags)  # the sender's routing id
        frames = [r.recv()]
        if r.getsockopt(_RCVMORE):  # not r.rcvmore: pyzmq's attribute lookup is slow
            nbuf = _wire.buffer_count(frames[0])
            while r.getsockopt(_RCVMORE):
                frames.append(r.recv(copy=nbuf == 0))
        return frames

    def _loop(self) -> None:
        """The I/O thread: receives and dispatches, except while a waiting thread does (``lead``).

        It waits on the socket's file descriptor without holding ``_rx_lock`` (that touches no zmq
        state), so a waiter takes the socket at once, without waking this thread first.
        """
        import select

        self._io_ident = self.receiver_ident = threading.get_ident()
        waits = select.poll()  # not select.select: no limit on the descriptors' numbers
        waits.register(self._router.getsockopt(zmq.FD), select.POLLIN)
        waits.register(self._io_wake_r, select.POLLIN)
        while not self._closed:
            if self._wanted or time.monotonic() < self._lead_until:
                # A waiter receives now. Take the socket back only once none has for _LINGER_S: in a
                # loop of synchronous calls this thread then sleeps instead of waking twice per call.
                # While one waiter stays (a long call), this thread waits for that waiter to notify it as it
                # leaves, instead of waking each _LINGER_S to look (a wake costs tens of µs of CPU);
                # while short waits follow one another, it wakes each _LINGER_S and nobody notifies it.
                with self._lead_cv:
                    self._io_parked = True
                    seen = -1
                    while (self._wanted or time.monotonic() < self._lead_until) and not self._closed:
                        if self._wanted and self._leads == seen:
                            self._io_long = True
                            self._lead_cv.wait(_PARKED_S)
                            self._io_long = False
                        else:
                            seen = self._leads
                            self._lead_cv.wait(_LINGER_S)
                    self._io_parked = False
                continue
            with self._rx_lock:
                if self._wanted:
                    continue
                if not self._receive_ready():
                    return
            try:
                ready = waits.poll()
            except OSError:  # closed under us
                return
            if any(fd == self._io_wake_r for fd, _ in ready):
                _drain_pipe(self._io_wake_r)

    def _receive_ready(self, done: Callable[[], bool] | None = None, waiting: bool = False) -> bool:
        """Receive and dispatch what is waiting now; flush a batch once caught up. False: socket gone.

        With ``done`` (a waiter's): stop once ``done()`` while no other port is open (a round trip's reply),
        without looking for more; whoever receives next looks at the socket before it blocks (the I/O thread
        here, a waiter in ``zmq.Poller.poll``), so nothing left waiting is missed. While other replies are
        awaited (a burst) it goes on while more is waiting, for the waits that follow. ``waiting``: a poll
        just saw a message, so the first is received without looking again. (Each look is one or two system
        calls.)"""
        r = self._router
        try:
            while waiting or r.getsockopt(_EVENTS) & _POLLIN:
                waiting = False
                frames = self._recv(_NOBLOCK)
                if self._closed:
                    return False
                self._dispatch(frames)
                if done is not None and not self._ports and done():
                    if self._batch:
                        self.flush()
                    return True
                if self._batch and not r.getsockopt(_EVENTS) & _POLLIN:
                    self.flush()  # all caught up: what handling sent goes out now
        except zmq.Again:
            pass
        except zmq.ZMQError:
            return False
        return True

    def can_lead(self) -> bool:
        """Whether a thread waiting on a reply may receive it itself (``lead``)."""
        return RECEIVE_ON_WAIT and self._thread is not None and not self._closed

    def lead(self, fut, timeout: float | None) -> None:
        """Receive on this thread until ``fut`` is settled (or ``timeout``), then give the socket back to
        the I/O thread. Messages for others are dispatched here as the I/O thread would; a Future
        settled by another thread pokes this one awake (``_wake_leader``)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        me = threading.get_ident()
        with self._lead_cv:
            self._wanted += 1
            self._leads += 1
        try:
            if not self._io_parked:
                _poke(self._io_wake_w)  # it parks now, while the request travels, not when the reply comes
            while not fut.done() and not self._closed:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return
                tick = 0.001 if left is None else min(left, 0.001)
                if not self._rx_lock.acquire(blocking=False):
                    if self.receiver_ident != self._io_ident:
                        # Another waiter receives (a script's main thread waiting while a workspace sync's
                        # thread waits on replies): it dispatches ``fut``'s reply, so wait on ``fut`` itself,
                        # woken when it is settled (waiting on the socket's lock, 1 ms at a time, added up to
                        # 1 ms to each of a sync's round trips); try for the socket each 1 ms.
                        fut._wait(tick)
                        continue
                    if not self._rx_lock.acquire(timeout=tick):  # the I/O thread, dispatching: brief
                        continue
                try:
                    self.receiver_ident = me
                    self._receive_until(fut.done, deadline)
                finally:
                    self.receiver_ident = self._io_ident
                    self._rx_lock.release()
        finally:
            with self._lead_cv:
                self._wanted -= 1
                self._lead_until = time.monotonic() + _LINGER_S
                if self._io_long and not self._wanted:
                    self._lead_cv.notify()

    def _receive_until(self, done: Callable[[], bool], deadline: float | None) -> None:
        """Under ``_rx_lock``: receive and dispatch until ``done()`` or ``deadline``. The spin or
        ``poller.poll`` is the first look at the socket (both see a message already waiting), and a message
        either saw is received without another."""
        poller = self._lead_poller
        if poller is None:
            poller = self._lead_poller = zmq.Poller()
            poller.register(self._router, zmq.POLLIN)
            poller.register(self._lead_wake_r, zmq.POLLIN)
        spin, router = self._spin, self._router
        while not self._closed and not done():
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                return
            waiting = False
            if spin.poll(done):
                waiting = not done()  # (it ends on a message, or on done(), which stays true)
            else:
                ms = _LEAD_SLICE_MS if left is None else max(1, min(_LEAD_SLICE_MS, int(left * 1000) + 1))
                try:
                    ready = poller.poll(ms)
                except zmq.ZMQError:
                    return
                spin.woke()
                for sock, _ in ready:
                    if sock is router:
                        waiting = True
                    else:
                        _drain_pipe(self._lead_wake_r)
            if not self._receive_ready(done, waiting):
                return

    @property
    def fd(self) -> int:
        """A file descriptor that becomes readable when messages may be waiting (edge-triggered)."""
        return self._router.getsockopt(zmq.FD)

    def drain(self, defer: Callable[[object], None] | None = None) -> bool:
        """Receive and dispatch every message waiting now (for a receiver without an I/O thread); whether
        there was any.

        With ``defer``, messages other than port values and logs are handed to it
        instead of ``on_message`` (used while a handler blocks waiting for a reply).

        The socket is used under ``_rx_lock``, which another thread waiting on a reply takes while this
        one is busy in a handler (``receive_for``); port values and logs are delivered as they are
        received, under the lock, so that each port gets its values in order whichever thread took them.
        """
        took = False
        while not self._closed:
            with self._rx_lock:
                if self._held:
                    items = [self._held.popleft()]
                else:
                    items = self._receive_one()
                    if items is None:
                        break
            took = True
            for msg, unreadable in items:
                self._take(msg, unreadable, defer)
        self.flush()
        return took

    def _receive_one(self) -> list | None:
        """Under ``_rx_lock``: receive one message (a batch: all of it), deliver its port values and logs,
        and return the rest, in order, as (message, Unreadable or None); None when none is waiting."""
        r = self._router
        if self._closed or not r.getsockopt(_EVENTS) & _POLLIN:
            return None
        try:
            frames = self._recv(_NOBLOCK)
        except zmq.Again:
            return None
        rest = []
        for msg, unreadable in self._decoded(frames):
            if unreadable is None and isinstance(msg, (SendToPort, ForwardLogs)):
                self._route(msg)
            else:
                rest.append((msg, unreadable))
        return rest

    def helps_here(self) -> bool:
        """Whether this thread, waiting on a reply, should help receive it (``receive_for``): a thread other
        than the receiving one of a mailbox without an I/O thread (a proc's)."""
        return self._thread is None and self.receiver_ident not in (None, threading.get_ident())

    def receive_for(self, fut, timeout: float | None) -> None:
        """Wait for ``fut``, a reply that a thread other than the receiving one of a mailbox without an I/O
        thread waits on (a thread a proc's endpoint started: a ``ThreadPoolExecutor`` fanning out calls).
        While the receiving thread is busy (in that endpoint, waiting for this thread), a message that
        has waited a whole tick on the socket is received here instead (``_help``)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        seen = False
        while not fut.done() and not self._closed:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                return
            if fut._wait(_HELP_TICK_S if left is None else min(left, _HELP_TICK_S)):
                return
            seen = self._help(seen)

    def receive_on_loop(self, loop, woken) -> None:
        """``receive_for`` for an await on an event loop of another thread than the receiving one: a look
        at the socket each tick on that loop, until ``woken`` (the awaiting side's future) is done."""
        seen = False

        def look() -> None:
            nonlocal seen
            if woken.done() or self._closed:
                return
            seen = self._help(seen)
            loop.call_later(_HELP_TICK_S, look)

        loop.call_later(_HELP_TICK_S, look)

    def _help(self, seen: bool) -> bool:
        """One look at the socket for a waiting thread: when a message waited there at this look and the last
        (``seen``), nobody received for a tick, so the receiving thread is busy: receive what is waiting,
        deliver port values, and hold the rest for the receiving thread (``drain``), which ``on_held``
        wakes. Returns whether a message waited."""
        if not self._rx_lock.acquire(blocking=False):  # the receiving thread receives
            return False
        held = False
        try:
            waiting = bool(not self._closed and self._router.getsockopt(_EVENTS) & _POLLIN)
            if waiting and seen:
                while (items := self._receive_one()) is not None:
                    self._held.extend(items)
                    held = held or bool(items)
        finally:
            self._rx_lock.release()
        if held and self.on_held is not None:
            self.on_held()
        return waiting

    def wait_until(self, done: Callable[[], bool], timeout: float | None) -> None:
        """Block the receiving thread until ``done()``, dispatching port values as they come."""
        self._waits.append(getattr(done, "__self__", None))  # (``Future.done``: the future)
        try:
            self._wait_until(done, timeout)
        finally:
            self._waits.pop()
            if not self._waits and self.after_waits is not None:
                self.after_waits()

    def _wait_until(self, done: Callable[[], bool], timeout: float | None) -> None:
        deadline = None if timeout is None else time.monotonic() + timeout
        defer, turn = self.on_deferred, self.on_blocked_turn
        poller = None
        if turn is not None and self.blocked_wake_fd is not None:
            poller = zmq.Poller()
            poller.register(self._router, zmq.POLLIN)
            poller.register(self.blocked_wake_fd, zmq.POLLIN)
        while not done():
            self.drain(defer)
            if done():
                return
            ms = 100
            if turn is not None:
                due = turn()
                if done():
                    return
                if due is not None:
                    if due <= 0:
                        continue
                    ms = min(ms, int(due * 1000) + 1)
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                return
            if left is not None:
                ms = max(1, min(ms, int(left * 1000)))
            with self._rx_lock:
                if poller is not None:
                    poller.poll(ms)
                else:
                    self._router.poll(ms, zmq.POLLIN)

    def _dispatch(self, frames: list, defer: Callable[[object], None] | None = None) -> None:
        for msg, unreadable in self._decoded(frames):
            self._take(msg, unreadable, defer)

    def _decoded(self, frames: list):
        """The messages ``frames`` hold (a batch: each of its messages, decoded one at a time as they are
        taken), as (message, None), or (what could be read of it, Unreadable) for one that could not be read
        whole; malformed ones are logged and dropped."""
        if len(frames) == 1 and _wire.is_batch(frames[0]):
            try:
                parts = [[part] for part in _wire.unpack_batch(frames[0])]
            except ProtocolError as e:
                log.warning("dropped a malformed batch on %s: %s", self.addr, e)
                return
        elif frames[0][:4] == UP_MAGIC:
            yield from self._up_entries(frames)
            return
        else:
            parts = [frames]
        for part in parts:
            if len(part) == 1 and _wire.is_batch(part[0]):  # (a chunk's batch holds its children's)
                yield from self._decoded(part)
                continue
            try:
                msg = _wire.decode(part)
                if type(msg) is _wire.Many:  # (a run of plain calls or replies: each in turn)
                    for m in msg:
                        yield m, None
                else:
                    yield msg, None
            except _wire.Unreadable as e:
                if e.message is None:
                    log.warning("dropped a malformed message on %s: %s", self.addr, e)
                else:
                    yield e.message, e
            except ProtocolError as e:
                log.warning("dropped a malformed message on %s: %s", self.addr, e)

    def _up_entries(self, frames: list):
        """The messages of one that came up the agent tree (``_fanout.UP_MAGIC``): a chunk of gathered
        entries, each decoded as a message of its own, in order, or one message passed up."""
        try:
            kind, head = read_up(frames[0])
            counts = head["n"] if kind == b"g" and "n" in head else (len(frames) - 1,)
            if sum(counts) != len(frames) - 1:
                raise ProtocolError(f"a chunk announces {sum(counts)} frames, got {len(frames) - 1}")
        except (ValueError, TypeError, AttributeError, ProtocolError) as e:
            log.warning("dropped a malformed message from the agent tree on %s: %s", self.addr, e)
            return
        pos = 1
        for n in counts:
            entry = frames[pos:pos + n]
            pos += n
            if entry and not isinstance(entry[0], bytes):
                entry[0] = bytes(entry[0].buffer if hasattr(entry[0], "buffer") else entry[0])
            if n == 1 and _wire.is_batch(entry[0]):
                try:
                    parts = _wire.unpack_batch(entry[0])
                except ProtocolError as e:
                    log.warning("dropped a malformed chunk on %s: %s", self.addr, e)
                    continue
                yield from self._chunk_parts(parts)
            else:
                for msg, unreadable in self._decoded(entry):
                    if type(msg) is GatheredReplies:  # (an agent's procs' replies, alone in their chunk)
                        msg = _Replies(msg.port_id, list(msg.ranks), list(msg.values))
                    yield msg, unreadable

    def _chunk_parts(self, parts: list):
        """A chunk's one-frame entries: each run of plain values for one port (no error, no output to print
        first) as one ``_Replies``, delivered in one go; any other entry decoded as a message of its own."""
        run = None  # [port id, ranks, values]
        for part in parts:
            t = None
            if _wire.is_batch(part):  # a child's chunk
                try:
                    inner = _wire.unpack_batch(part)
                except ProtocolError as e:
                    log.warning("dropped a malformed chunk on %s: %s", self.addr, e)
                    continue
                if run is not None:
                    yield _Replies(*run), None
                    run = None
                yield from self._chunk_parts(inner)
                continue
            try:
                t = _wire.loads_plain(part)
            except Exception:  # noqa: BLE001 - not plain: decoded (or reported) as any message is
                t = None
            if type(t) is tuple and len(t) == 4 and t[0] == "\0replies":  # an agent's procs' replies, read there
                if run is not None:
                    yield _Replies(*run), None
                    run = None
                yield _Replies(t[1], list(t[2]), list(t[3])), None
                continue
            if type(t) is tuple and len(t) == 6 and t[0] == "\0reply" and t[3] is None and t[5] is None:
                if run is not None and run[0] == t[1]:
                    run[1].append(t[4])
                    run[2].append(t[2])
                    continue
                if run is not None:
                    yield _Replies(*run), None
                run = [t[1], [t[4]], [t[2]]]
                continue
            if run is not None:
                yield _Replies(*run), None
                run = None
            yield from self._decoded([part])
        if run is not None:
            yield _Replies(*run), None

    def _take(self, msg: object, unreadable: _wire.Unreadable | None, defer: Callable[[object], None] | None) -> None:
        """``_route`` a message, or fail whoever waits on one that could not be read whole (``_lost``)."""
        if unreadable is not None:
            self._lost(msg, unreadable.error, defer, payload_lost=isinstance(unreadable, _wire.PayloadLost))
        else:
            self._route(msg, defer)

    def _route(self, msg: object, defer: Callable[[object], None] | None = None) -> None:
        """Hand a received message to whoever takes it: its port, the log sink, a system handler, ``defer``
        or ``on_message``."""
        try:
            if isinstance(msg, SendToPort):
                if msg.output_before is not None:  # what its proc printed before it, printed first
                    _logs.output_handled.wait_for(*msg.output_before)
                with self._ports_lock:
                    h = self._ports.get(msg.port_id)
                if h is None:
                    if msg.port_id:  # (port 0 is none: such a message only carries output_before)
                        log.debug("value for closed port %d dropped", msg.port_id)
                elif h.deliver(msg):
                    self.close_port(msg.port_id)
            elif type(msg) is _Replies:
                self._deliver_run(msg)
            elif type(msg) is GatheredReplies:  # (outside a chunk of gathered replies: delivered all the same)
                self._deliver_run(_Replies(msg.port_id, list(msg.ranks), list(msg.values)))
            elif type(msg) is FoldedReplies:
                self._deliver_folded(msg)
            elif isinstance(msg, ForwardLogs):
                if self.on_logs is not None:
                    self.on_logs(msg)
            elif type(msg) in SYSTEM_HANDLERS:
                try:
                    SYSTEM_HANDLERS[type(msg)](self, msg)
                except Exception as e:  # its sender hears of it, and does not wait forever
                    if not self.fail_reply(msg, e):
                        raise
            elif defer is not None:
                defer(msg)
            elif self.on_message is not None:
                self.on_message(msg)
            else:
                log.warning("dropped unexpected %s on %s", type(msg).__name__, self.addr)
        except Exception:  # a bad message never kills the I/O thread
            log.exception("error while handling %s", type(msg).__name__)

    def _deliver_run(self, run: _Replies) -> None:
        with self._ports_lock:
            h = self._ports.get(run.port_id)
        if h is None:
            log.debug("%d values for closed port %d dropped", len(run.values), run.port_id)
            return
        many = getattr(h, "deliver_values", None)
        if many is not None:
            done = many(run.ranks, run.values)
        else:
            done = False
            for rank, value in zip(run.ranks, run.values):
                done = h.deliver(SendToPort(run.port_id, value, None, rank))
                if done:
                    break
        if done:
            self.close_port(run.port_id)

    def _deliver_folded(self, msg: FoldedReplies) -> None:
        """Runs of replies that host agents folded (``_gather``) to the port's ``deliver_runs``; a port that
        does not fold gets an error instead (nothing it waits for is dropped silently)."""
        with self._ports_lock:
            h = self._ports.get(msg.port_id)
        if h is None:
            log.debug("folded replies for closed port %d dropped", msg.port_id)
            return
        take = getattr(h, "deliver_runs", None)
        if take is not None:
            done = take(msg.runs)
        else:
            done = h.deliver(SendToPort(msg.port_id, None, ProtocolError(
                f"port {msg.port_id} got replies folded by host agents, but does not fold (a protocol error)"), -1))
        if done:
            self.close_port(msg.port_id)

    def fail_reply(self, msg: object, error: BaseException) -> bool:
        """Answer ``msg``'s reply port (a ``reply`` field) with ``error``, raised where this process handled
        ``msg``; False when ``msg`` has no reply port."""
        reply = getattr(msg, "reply", None)
        if not isinstance(reply, PortRef):
            return False
        log.warning("%s failed on %s: %r", type(msg).__name__, self.addr, error)
        failure = RuntimeError(f"{type(msg).__name__} failed on {self.addr}: {type(error).__name__}: {error}")
        self.send(reply.addr, SendToPort(reply.port_id, None, failure, -1))
        return True

    def _lost(self, msg: object, error: BaseException, defer: Callable[[object], None] | None = None,
              payload_lost: bool = True) -> None:
        """A message that could not be read whole (its payload could not be pulled, or a piece of it could
        not be unpickled here): fail whoever waits on it, never drop it silently."""
        from .messages import CallEndpoint

        try:
            if isinstance(msg, (SendToPort, FoldedReplies)):  # a reply or channel value: its port gets the error
                with self._ports_lock:
                    h = self._ports.get(msg.port_id)
                if h is not None and h.deliver(SendToPort(msg.port_id, None, error, getattr(msg, "rank", -1))):
                    self.close_port(msg.port_id)
                return
            if self.on_lost_spawn is not None and type(msg).__name__ == "SpawnActor":
                self.on_lost_spawn(msg, error)
            reply = getattr(msg, "reply", None)
            if isinstance(reply, PortRef):  # a call or request: its caller gets the error (straight, not gathered)
                addr = reply.addr[len(GATHER_PREFIX):] if reply.addr.startswith(GATHER_PREFIX) else reply.addr
                self.send(addr, SendToPort(reply.port_id, None, error, getattr(msg, "rank", -1)))
                return
            rewrite = LOST_REWRITES.get((msg.actor, msg.method)) if isinstance(msg, CallEndpoint) else None
            handle = defer if defer is not None else self.on_message
            if rewrite is not None and handle is not None:
                handle(rewrite(msg, error, payload_lost))
                return
        except Exception:  # never kills the I/O thread
            log.exception("while failing a message whose payload was lost")
        log.error("dropped %s on %s: %s", type(msg).__name__ if msg is not None else "a message", self.addr, error)

    @property
    def closed(self) -> bool:
        """Whether ``close`` ran (this process is stopping): sends raise ``RuntimeError``."""
        return self._closed

    def close(self, linger_ms: int = 500) -> None:
        """Stop receiving and close every socket; what was sent and not yet delivered has ``linger_ms`` to
        leave (a peer that has not connected yet still gets it if it binds within that time)."""
        if self._closed:
            return
        self.flush()
        self._closed = True
        self._flush_wake.set()
        wake = self.ctx.socket(zmq.DEALER)
        wake.connect(self.addr)
        wake.send(b"")
        if self._thread is not None:
            _poke(self._io_wake_w)
            _poke(self._lead_wake_w)
            with self._lead_cv:
                self._lead_cv.notify_all()
            self._thread.join(timeout=5)
        # A waiter that receives stops within a poll (poked above); the socket closes after it let go.
        got = self.receiver_ident != threading.get_ident() and self._rx_lock.acquire(timeout=5)
        with self._send_lock:
            for sock in self._out.values():
                sock.close(linger=linger_ms)
            self._out.clear()
            if self._up_sock is not None:  # (every socket closes before ctx.term(), which otherwise waits for ever)
                self._up_sock.close(linger=linger_ms)
                self._up_sock = None
        wake.close(linger=0)
        self._router.close(linger=0)
        self.ctx.term()
        if got:
            self._rx_lock.release()
        for fd in (self._io_wake_r, self._io_wake_w, self._lead_wake_r, self._lead_wake_w):
            if fd >= 0:
                try:
                    os.close(fd)
                except OSError:
                    pass
        self._unlink_socket_file()

    def _unlink_socket_file(self) -> None:
        path = self.addr[len("ipc://"):] if self.addr.startswith("ipc://") else None
        if path and os.path.exists(path):
            try:
                os.unlink(path)
            except OSError:
                pass


def _wake_leader() -> None:
    """After a Future settled: wake a thread that receives while it waits, unless it settled it; and an
    in-process runtime's thread blocked in a wait (``wait_until`` polls its own socket, not the Future)."""
    mb = _mailbox
    if mb is not None and mb._wanted and threading.get_ident() != mb.receiver_ident:
        _poke(mb._lead_wake_w)
    for mb in _bound:
        if mb._waits and threading.get_ident() != mb.receiver_ident and mb.wake_waiter is not None:
            mb.wake_waiter()


def _pipe() -> tuple[int, int]:
    r, w = os.pipe()
    os.set_blocking(r, False)
    os.set_blocking(w, False)
    return r, w


def _poke(fd: int) -> None:
    try:
        os.write(fd, b"\0")
    except OSError:  # full: the reader is awake anyway; closed: nobody to wake
        pass


def _drain_pipe(fd: int) -> None:
    try:
        while os.read(fd, 4096):
            pass
    except OSError:
        pass


_mailbox: Mailbox | None = None
_mailbox_lock = threading.Lock()


class _ThreadMailbox(threading.local):
    mailbox: Mailbox | None = None  # set on the threads of an in-process runtime (``bind_thread``)


_thread = _ThreadMailbox()
_bound: tuple[Mailbox, ...] = ()  # the mailboxes bound to threads of this process (in-process runtimes')


def mailbox_here() -> Mailbox | None:
    """The mailbox of the calling thread: an in-process runtime's on its threads (``bind_thread``), else
    this process's (None in a script that has not made it yet)."""
    return _thread.mailbox or _mailbox


_future._settle_hook = _wake_leader
_future._mailbox_here = mailbox_here


def bind_thread(mb: Mailbox) -> None:
    """Make ``mb`` the mailbox of the calling thread (an in-process runtime's thread, in a script): what
    code on it sends, and the ports it opens, go through ``mb``."""
    global _bound
    _thread.mailbox = mb
    with _mailbox_lock:
        if mb not in _bound:
            _bound = (*_bound, mb)


def unbind(mb: Mailbox) -> None:
    """``mb`` is closed: no longer among this process's mailboxes (its threads end with it)."""
    global _bound
    with _mailbox_lock:
        _bound = tuple(m for m in _bound if m is not mb)


def local_mailboxes() -> list[Mailbox]:
    """Every mailbox of this process: its own, and those of in-process runtimes. A proc's death is news for
    each of them (``proc_died``): each holds ports of calls made from its threads."""
    return [m for m in (_mailbox, *_bound) if m is not None]


def current_mailbox() -> Mailbox:
    """The calling thread's mailbox (``mailbox_here``); this process's is created on first use in a client
    script."""
    global _mailbox
    mb = _thread.mailbox
    if mb is not None:
        return mb
    if _mailbox is None:
        with _mailbox_lock:
            if _mailbox is None:
                from .logs import client_log_sink

                _mailbox = Mailbox(on_logs=client_log_sink)
    return _mailbox


@at_exit
def _close_at_exit() -> None:
    """What a script sent last reaches its peers before the interpreter goes, and its socket file goes.

    Only a closed context waits for its sockets' queued messages: at the interpreter's exit pyzmq leaves
    the context as it is, and zmq's I/O thread ends with the process. A flush alone lost a burst sent right
    before the end whenever the connection to its peer was not up yet (a loaded machine). Closing waits
    for delivery, at most ``_EXIT_LINGER_MS`` (peers that went away are forgotten when they stop: nothing
    waits for them). The procs were stopped by the hooks that ran before this one.
    """
    if _mailbox is not None:
        try:
            _mailbox.close(linger_ms=_EXIT_LINGER_MS)
        except Exception:  # noqa: BLE001 - the script ends anyway; its socket file still goes
            _mailbox._unlink_socket_file()


def set_current_mailbox(mb: Mailbox) -> None:
    global _mailbox
    _mailbox = mb
