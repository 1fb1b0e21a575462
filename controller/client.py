"""One ``MeshClient`` per proc allocation: refs, instruction batches, flushing, fetch ports.

Instructions are appended to a queue and sent as one message per flush: on a
fetch, when the batch reaches its size bound, when the target ranks change
(a sliced mesh), and when the script goes idle (a background flusher thread
flushes a batch that stopped growing for ``IDLE_S``). The size bound starts
small and doubles with every batch sent for it, up to ``MAX_BATCH``: after a
fetch or a pause the workers have nothing to do, so the first instructions of
the next burst leave at once (``FIRST_BATCH`` of them) while later batches grow
to amortise the per-message cost. A batch is encoded once and sent to every
proc it targets; per-proc order is the issue order. Deletes of
garbage-collected tensors ride on the next batch.
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import os
import sys
import sysconfig
import threading
import time
import weakref

from monarch_tensor.worker import messages as m
from monarch_tensor.worker.interface import IMPLEMENTATION, WORKER_NAME, TensorWorkerInterface

from monarch_tensor.config import setting
from monarch_tensor.future import Future
from monarch_tensor.transport import _wire
from monarch_tensor.transport._net import ip_towards
from monarch_tensor.transport.mailbox import current_mailbox
from monarch_tensor.transport.messages import CallEndpoint

MAX_BATCH = setting("MONARCH_TENSOR_MAX_BATCH")
FIRST_BATCH = min(MAX_BATCH, setting("MONARCH_TENSOR_FIRST_BATCH"))
IDLE_S = setting("MONARCH_TENSOR_IDLE_FLUSH_S")
PAUSE_ANSWER = 10.0  # how long an interrupt waits for the paused workers to say how far they got (withdraw)
DELETE_IDLE_S = 0.5  # how often the flusher looks for deletes left with no batch to go with
PARK_S = 0.05  # how long the flusher keeps looking every IDLE_S after the last batch before it waits to be woken


# ---- where the user's script issued an op ------------------------------------------------
def _lib_dirs() -> tuple[str, ...]:
    import torch

    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    dirs = [os.path.dirname(torch.__file__), os.path.join(here, "controller"), os.path.join(here, "worker"),
            os.path.join(here, "monarch_tensor"), sysconfig.get_paths()["stdlib"], "<frozen"]
    return tuple(d for d in dirs if d)


_LIB = _lib_dirs()
_is_lib: dict = {}  # by file name (a string hashes once; a code object hashes its contents at every lookup)
# By ``(id(code), f_lasti)``: ``f_lineno`` scans the code's line table at every read. Each entry holds its code
# object, so that no other code object takes its id.
_locs: dict = {}


def user_loc():
    """``(file, line, function)`` of the innermost frame outside torch and this library (cheap)."""
    f = sys._getframe(2)
    is_lib = _is_lib
    while f is not None:
        c = f.f_code
        file = c.co_filename
        lib = is_lib.get(file)
        if lib is None:
            lib = is_lib[file] = file.startswith(_LIB)
        if not lib:
            k = (id(c), f.f_lasti)
            v = _locs.get(k)
            if v is None:
                v = _locs[k] = (c, (file, f.f_lineno, c.co_name))
            return v[1]
        f = f.f_back
    return None


# ---- fetch replies -------------------------------------------------------------------------------
class _FetchPort:
    """A fetch's reply from ``addr``; it fails when any proc of ``mesh`` dies (the addresses of the procs of
    the fetched value's mesh): the value may wait on a collective with the dead one, for ever."""

    observing = True

    def __init__(self, fut: Future, addr: str, mesh: frozenset = frozenset()) -> None:
        self.fut, self.addr, self.mesh = fut, addr, mesh

    def deliver(self, msg) -> bool:
        if msg.error is not None:
            self.fut._set_exception(msg.error)
        else:
            self.fut._set_result(msg.value)
        return True

    def proc_died(self, addr: str, error) -> tuple[bool, bool]:
        if addr != self.addr and addr not in self.mesh:
            return False, False
        self.fut._set_exception(error)
        return True, True


class Ctx:
    """Where a tensor lives: a mesh (slice) of one allocation, and a stream."""

    __slots__ = ("client", "pm", "ranks", "sid", "stream")

    def __init__(self, client: MeshClient, pm, ranks: tuple, stream) -> None:
        self.client, self.pm, self.ranks, self.stream = client, pm, ranks, stream
        self.sid = stream.id


def _overlaps(span: tuple, written: dict) -> bool:
    """Whether a ``(memory, first byte, end byte)`` span (``tensor.memory_span``) may share bytes with one of
    ``written``'s (such spans by their memory)."""
    return any(span[1] < b[2] and b[1] < span[2] for b in written.get(span[0], ()))


class MeshClient:
    """The controller's side of one allocation's tensor workers."""

    def __init__(self, alloc) -> None:
        import torch

        self.alloc = alloc
        self.addrs = [p.addr for p in alloc._procs]
        self.all_ranks = tuple(range(len(self.addrs)))
        self.refs = itertools.count(1)
        self._q: collections.deque = collections.deque()
        self._dels: collections.deque = collections.deque()
        self._late: collections.deque = collections.deque()  # (instr, ranks) that finalizers queued: issue_later
        self.on_next_issue = None  # a function to run once, before the next instruction (torch_patches._lend_generator)
        self._ranks = self.all_ranks
        self._limit = FIRST_BATCH  # the size bound of the batch being filled (see the module docstring)
        self._fused = (None, {})  # the last Reduce or ReduceMany queued, and the spans it writes by memory (_fuse)
        self._lock = threading.RLock()
        self._ctxs: dict = {}
        self._streams = {0}
        self.default_dtype = torch.float32  # the workers' torch.get_default_dtype() (see tensor.record)
        self.closed = False
        self.messages = 0  # instruction batches sent, one per proc they went to
        self.seq = 0  # the sequence number of the last instruction sent (see withdraw)
        self._withdrawing = False
        self._connect(alloc)
        _flusher._clients.add(self)

    def _connect(self, alloc) -> None:
        """The link to the workers: this process's mailbox, the rendezvous store of their process groups, and
        the worker actors, spawned on ``alloc``'s procs. (A test's client without procs overrides it.)"""
        import torch.distributed as dist

        self.mailbox = current_mailbox()
        # The store listens on every interface; procs on other hosts (behind host agents) reach it at this
        # machine's address on the route to their agent.
        agent = next((a for a in (getattr(p, "agent", None) for p in alloc._procs) if a is not None), None)
        host = "127.0.0.1" if agent is None else ip_towards(agent.addr)
        self.store = dist.TCPStore(host, 0, is_master=True, wait_for_workers=False)
        self.store_addr = (host, self.store.port)
        self.workers = alloc._spawn_named(WORKER_NAME, TensorWorkerInterface, self.store_addr,
                                          implementation=IMPLEMENTATION)

    def ctx(self, pm, stream) -> Ctx:
        key = (pm._shape, stream.id)
        c = self._ctxs.get(key)
        if c is None:
            ranks = tuple(pm._shape.ranks())
            if ranks == self.all_ranks:
                ranks = self.all_ranks
            if stream.id not in self._streams:
                self._streams.add(stream.id)
                self.issue(m.CreateStream(stream.id, stream.name), self.all_ranks)
            c = self._ctxs[key] = Ctx(self, pm, ranks, stream)
        return c

    # ---- issuing -------------------------------------------------------------------------
    def stopped_error(self):
        """``MeshStoppedError`` once the procs were stopped (``procs.stop()``), else None."""
        if not self.alloc._stopped:
            return None
        from monarch_tensor.errors import MeshStoppedError

        return MeshStoppedError(f"the proc mesh of these tensors was stopped ({len(self.addrs)} procs)")

    def issue(self, instr, ranks: tuple, memory=None) -> None:
        """Queue ``instr`` for ``ranks``. ``memory``: for an in-place ``Reduce``, the memory it writes
        (``tensor.memory_span``), which ``_fuse`` looks at."""
        if self.alloc._stopped:
            raise self.stopped_error()
        with self._lock:  # (threads of the script issue to one batch: its ranks and its order are one thing)
            if self._late:
                self._take_late()
            if self.on_next_issue is not None:  # (it may issue: it is cleared first)
                hook, self.on_next_issue = self.on_next_issue, None
                hook()
            if ranks is not self._ranks:
                self.flush()
                self._ranks = ranks
            q = self._q
            if type(instr) is m.Reduce:
                if q and self._fuse(instr, memory):
                    return
                self._fused = (instr, {memory[0]: [memory]} if memory is not None else {})
            q.append(instr)
            if _held:  # inside coalescing(): the batch leaves at its end (or at a fetch, or a change of ranks)
                _held.add(self)
                return
            n = len(q)
            if n >= self._limit:
                self.flush(grow=True)
            elif n == 1:
                _flusher.wake(self)

    def issue_now(self, instr, ranks: tuple) -> None:
        """Queue ``instr`` and send the batch at once (inside ``coalescing()``, at its end): a compiled step's
        one instruction, which no batch needs to wait for."""
        if self.alloc._stopped:
            raise self.stopped_error()
        with self._lock:
            if self._late:
                self._take_late()
            if self.on_next_issue is not None:
                hook, self.on_next_issue = self.on_next_issue, None
                hook()
            if ranks is not self._ranks:
                self.flush()
                self._ranks = ranks
            self._q.append(instr)
            if _held:
                _held.add(self)
            else:
                self.flush()

    def _fuse(self, r, memory) -> bool:
        """Fold the reduce ``r`` into the batch's last instruction when that is a reduce of the same group,
        reduction, dtype, stream and kind (in place or not): one collective for a run of them, as for
        ``for p in params: p.grad.reduce_("dp", "avg")`` (each result still fails on its own).

        Not when ``r`` writes in place (``memory``) to memory that one of them wrote: one collective reads
        every input before it writes any, so ``b.reduce_(); b[:2].reduce_()`` would reduce ``b[:2]`` once."""
        if r.scatter or r.reduction == "stack":
            return False
        with self._lock:  # (a flush on the flusher's thread pops from the batch meanwhile)
            q = self._q
            if not q:
                return False
            last = q[-1]
            fused, memories = self._fused
            if fused is not last or (memory is not None and _overlaps(memory, memories)):
                return False
            t = type(last)
            if t is m.Reduce:
                if last.scatter or last.reduction == "stack":
                    return False
                last = m.ReduceMany((last.out,), (last.src,), last.groups, last.reduction, last.inplace,
                                    (last.numel,), last.dtype, last.stream, (last.loc,))
            elif t is not m.ReduceMany:
                return False
            if (last.groups, last.reduction, last.inplace, last.dtype, last.stream) != (
                    r.groups, r.reduction, r.inplace, r.dtype, r.stream) or r.src in last.outs:
                return False  # (r.src in last.outs: r reduces what an earlier one made; it must wait for it)
            q[-1] = m.ReduceMany(last.outs + (r.out,), last.srcs + (r.src,), last.groups, last.reduction,
                                 last.inplace, last.numels + (r.numel,), last.dtype, last.stream,
                                 last.locs + (r.loc,))
            if memory is not None:
                memories.setdefault(memory[0], []).append(memory)
            self._fused = (q[-1], memories)
            return True

    def issue_later(self, instr, ranks: tuple) -> None:
        """Called from a finalizer (``Borrow.__del__``: any thread, any time, inside this client's lock or the
        flusher's too): queue ``instr`` without taking a lock. It joins the batch before the next instruction
        issued, or at the next flush, so it comes after what was issued before it and before what comes after."""
        self._late.append((instr, ranks))

    def _take_late(self) -> None:
        """Move the instructions queued by ``issue_later`` into the batch, in their order (under the lock)."""
        late, q = self._late, self._q
        while late:
            instr, ranks = late.popleft()
            if ranks is not self._ranks:  # (what is queued for the other ranks leaves first, as in issue)
                self._send([q.popleft() for _ in range(len(q))], self._ranks)
                self._ranks = ranks
            q.append(instr)

    def delete(self, ref: int, sid: int) -> None:
        """Called from ``Tensor.__del__`` (any thread, any time): queue the delete. (A dropped borrow's
        tensor, stream -1, was deleted on the workers by the drop.)"""
        if sid >= 0:
            self._dels.append((ref, sid))

    def _take_deletes(self, n: int) -> list:
        """The first ``n`` queued deletes, as one ``DeleteRefs`` per stream."""
        dels = self._dels
        if not n:
            return []
        by_stream: dict = {}
        for _ in range(n):
            ref, sid = dels.popleft()
            by_stream.setdefault(sid, []).append(ref)
        return [m.DeleteRefs(tuple(refs), sid) for sid, refs in by_stream.items()]

    def flush(self, grow: bool = False) -> None:
        """Send what was issued so far (one message per target proc).

        ``grow``: the batch was sent for its size, so the script is issuing a burst and the next bound
        doubles; any other flush (a fetch, an idle script, a change of ranks) starts again from
        ``FIRST_BATCH``.
        """
        with self._lock:
            self._limit = min(self._limit * 2, MAX_BATCH) if grow else FIRST_BATCH
            if self.closed:
                self._q.clear()
                return
            if self._late:
                self._take_late()
            # Count the deletes before taking the batch: a delete queued before this point is for a ref
            # whose last use was issued before it, so that use is in this batch or an earlier one. A delete
            # queued while we pop may be for a ref whose last use comes after the pop (an uploaded constant
            # is deleted right after its op is issued): it waits for the next flush.
            nd = len(self._dels)
            q = self._q
            batch = [q.popleft() for _ in range(len(q))]
            ranks = self._ranks
            if ranks is self.all_ranks:
                batch.extend(self._take_deletes(nd))
                self._send(batch, ranks)
            else:
                self._send(batch, ranks)
                if nd > MAX_BATCH:
                    self._send(self._take_deletes(nd), self.all_ranks)

    def peers_died(self, rank: int) -> None:
        """The proc of ``rank`` died: tell the live workers, whose groups with it stop waiting for it to form
        (a fire-and-forget message to each, off the batch: their streams may be stuck in that wait)."""
        if self.closed:
            return
        msg = CallEndpoint(WORKER_NAME, "peers_died", ([rank],), {}, None)
        for info in self.alloc._procs:
            if info.alive and info.rank != rank:
                try:
                    self.mailbox.send(info.addr, msg)
                except Exception:  # noqa: BLE001 - closing down
                    pass

    def flush_if_idle(self, mark: int | None, pending: set) -> int | None:
        """The flusher's: send the batch if nothing was issued since its last look (``mark``, what this returned
        then: the script paused), unless a ``coalescing()`` block holds it (its end sends it). None when the
        batch needs no more watching: sent, held or empty (a fetch sent it); the client then leaves ``pending``,
        under the lock that ``issue`` takes, so that the first instruction of its next batch adds it again.
        Else the mark to look at next time. Checked under that lock, so that ops the script issues meanwhile (a
        block that begins between the check and the send) never leave early."""
        with self._lock:
            if self._q and self not in _held:
                now = self.seq + len(self._q)  # (instructions issued so far: sent or queued)
                if now != mark and not self.closed:  # it grew (or is new): the script is still issuing
                    return now
                self.flush()  # (closed: it drops the batch)
            pending.discard(self)
            return None

    def flush_deletes(self) -> None:
        """Send the queued deletes, to every rank, when nothing else waits to be sent (every use of their refs
        left already), and no ``coalescing()`` block is open."""
        with self._lock:
            if self._q or self.closed or _held:
                return
            if self._late:  # (a borrow that dropped itself: flush() sends it, and the deletes after it)
                self.flush()
                return
            nd = len(self._dels)
            if nd:
                self._send(self._take_deletes(nd), self.all_ranks)

    def _send(self, batch: list, ranks: tuple) -> None:
        if not batch:
            return
        addrs = self.addrs
        to = [r for r in ranks if self.alloc._procs[r].alive]
        msg = CallEndpoint(WORKER_NAME, "execute", (batch, self.seq + 1), {}, None)
        self.seq += len(batch)
        if to and self.mailbox.route_of(addrs[to[0]]).startswith("ipc://"):
            frames = _wire.encode(msg)  # constants are small; one encoding for every rank
        else:  # other hosts: a large constant is pulled by each worker over the data plane
            frames = _wire.encode_for(msg, [addrs[r] for r in to], self.mailbox)[0] if to else []
        self.messages += len(to)
        for r in to:
            self.mailbox.send_frames(addrs[r], frames)

    # ---- interrupts --------------------------------------------------------------------------
    def withdraw(self) -> None:
        """The script was interrupted (Ctrl-C, a notebook's stop) while it waited on these workers: drop the work
        sent that no rank has begun, so that the procs are free for what comes next. Each worker pauses its
        streams and says how far it got; the work after the furthest any rank got, up to the last instruction
        sent, is dropped on every rank (TensorWorker.pause); its results raise "withdrawn" when used. Runs on a
        thread of its own: the interrupt reaches the script at once; what the script issues next queues behind
        the decision. With no answer from a worker (within PAUSE_ANSWER s), nothing is dropped."""
        with self._lock:
            if self.closed or self._withdrawing:
                return
            self.flush()
            end = self.seq
            if not end:
                return
            self._withdrawing = True
        threading.Thread(target=self._withdraw, args=(end,), daemon=True, name="monarch-withdraw").start()

    def _withdraw(self, end: int) -> None:
        live = [info for info in self.alloc._procs if info.alive]
        after = end
        try:
            answers = []
            for info in live:
                fut: Future = Future("a paused worker's answer")
                port = self.mailbox.open_port(_FetchPort(fut, info.addr))
                self.mailbox.send(info.addr, CallEndpoint(WORKER_NAME, "pause", (), {}, port))
                answers.append(fut)
            self.mailbox.flush()
            got = [f.get(timeout=PAUSE_ANSWER) for f in answers]
            after = max(got)
        except Exception as e:  # noqa: BLE001 - a worker gone or silent: nothing is dropped, streams run on
            sys.stderr.write(f"monarch_tensor: the interrupted work could not be withdrawn ({e}); it runs on\n")
        finally:
            for info in live:
                try:
                    self.mailbox.send(info.addr, CallEndpoint(WORKER_NAME, "withdraw", (after, end), {}, None))
                except Exception:  # noqa: BLE001 - a proc gone meanwhile
                    pass
            self.mailbox.flush()
            self._withdrawing = False
        if after < end:
            sys.stderr.write("monarch_tensor: interrupted: the mesh work not yet begun was withdrawn; tensors it "
                             "would have made raise RemoteException (withdrawn) when used\n")

    # ---- fetching ----------------------------------------------------------------------------
    def request(self, rank: int, make_instr, what: str = "fetch", mesh: tuple = ()) -> Future:
        """Issue ``make_instr(port)`` to proc ``rank`` and flush; a future of its reply. ``mesh``: the ranks
        of the mesh the request's values live on: it fails at once if one of their procs died, and when one
        dies before the reply (README: every pending and later call on a mesh that includes a dead proc
        raises SupervisionError; a value there may wait on a collective with it, for ever)."""
        fut: Future = Future(what)
        if self.alloc._stopped:
            return Future.failed(self.stopped_error())
        spawned = self.workers._spawned
        if spawned.done() and spawned.exception() is not None:
            return Future.failed(spawned.exception())
        for r in (rank, *mesh):
            info = self.alloc._procs[r]
            if not info.alive:
                from monarch_tensor.errors import SupervisionError

                return Future.failed(SupervisionError(f"proc {info.addr} (rank {r}) of this mesh died: "
                                                      f"{info.exit_status}", proc=info.addr, rank=r,
                                                      exit_status=info.exit_status))
        procs = self.alloc._procs
        fut._interrupt = self.withdraw  # (an interrupted wait for it withdraws the work not begun)
        port = self.mailbox.open_port(_FetchPort(fut, procs[rank].addr, frozenset(procs[r].addr for r in mesh)))
        ranks = (rank,)
        with self._lock:  # (another thread's ops must not join the batch for this one rank)
            if ranks == self._ranks:  # (the batch waiting is for this rank alone: the request joins it, one message)
                ranks = self._ranks
            self.issue(make_instr(port), ranks)
            self.flush()
        return fut


# coalescing(): the clients that issued while it holds ({None} marks a hold with nothing issued yet), and
# how many coalescing() blocks are open.
_held: set = set()
_hold_depth = 0


@contextlib.contextmanager
def coalescing():
    """``with coalescing():`` (Monarch's): the ops issued inside leave as one batch per mesh when the block
    ends, however many there are and however long the script takes between them (outside, a batch leaves
    at a size bound or when the script pauses). A fetch inside still sends what came before it."""
    global _hold_depth
    _hold_depth += 1
    _held.add(None)
    try:
        yield
    finally:
        _hold_depth -= 1
        if _hold_depth == 0:
            clients = [c for c in _held if c is not None]
            _held.clear()
            for c in clients:
                c.flush()


class _Flusher:
    """One background thread: flushes clients whose batch stopped growing (the script is idle).

    While batches keep coming it looks at them every ``IDLE_S`` on its own clock; it parks (waits on its event)
    only after ``PARK_S`` with no batch, and a client's first instruction wakes it only then. A script that
    alternates a few ops and a fetch (every fetch sends the batch) used to wake it once a batch: a thread
    wake-up and a turn of the GIL in the middle of every fetch's round trip (3-15% of bench/dispatch_bench.py's
    op + fetch round trip, in three runs on a 2-core VM, 2026-12-01)."""

    def __init__(self) -> None:
        self._ev = threading.Event()
        self._pending: set = set()  # clients whose batch it watches (added and removed under their _lock)
        self._thread: threading.Thread | None = None
        self._parked = True  # it waits on _ev (or has not started): a new batch must set it
        self._clients: weakref.WeakSet = weakref.WeakSet()  # every client: their deletes go out when idle

    def wake(self, client: MeshClient) -> None:
        """A batch began (under ``client._lock``)."""
        self._pending.add(client)
        if self._parked:  # (read after the add: see _park)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, daemon=True, name="monarch-tensor-flusher")
                self._thread.start()
            self._ev.set()

    def _run(self) -> None:
        self._parked = False  # (started by a wake(): its batch is pending)
        marks: dict = {}  # client -> what flush_if_idle returned at the last look
        quiet = 0  # looks in a row with no batch to watch
        park_after = int(PARK_S / IDLE_S) if IDLE_S > 0 else 0
        while True:
            if not self._pending:
                marks.clear()
                if quiet < park_after:
                    quiet += 1
                    time.sleep(IDLE_S)
                    continue
                self._park()
                continue
            quiet = 0
            for c in list(self._pending):
                try:
                    mark = c.flush_if_idle(marks.get(c), self._pending)
                except Exception:  # noqa: BLE001 - e.g. a closed mailbox at exit
                    self._pending.discard(c)
                    mark = None
                if mark is None:
                    marks.pop(c, None)
                else:
                    marks[c] = mark
            time.sleep(IDLE_S)

    def _park(self) -> None:
        """Wait for a batch; meanwhile send the deletes of quiet clients every ``DELETE_IDLE_S``."""
        self._parked = True
        # A batch whose wake() read _parked before it became True added its client before that: seen here.
        while not self._pending:
            if self._ev.wait(DELETE_IDLE_S):
                self._ev.clear()
                continue
            # A quiet script: the deletes of tensors it dropped go out anyway (they waited for its next
            # batch, the workers holding the memory meanwhile). Not woken by Tensor.__del__ itself: that
            # runs at any time, inside this Event's own lock too.
            if _held:  # inside coalescing(): nothing leaves before the block ends
                continue
            for c in list(self._clients):
                if (c._dels or c._late) and not c._q and not c.closed:
                    try:
                        c.flush_deletes()
                    except Exception:  # noqa: BLE001 - e.g. a closed mailbox at exit
                        pass
        self._parked = False


_flusher = _Flusher()
