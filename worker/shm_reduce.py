"""All-reduce, all-gather, reduce-scatter, all-to-all and broadcast through shared memory, for a group whose procs
all run on one host.

Gloo sends a same-host all-reduce through TCP on the loopback interface, through its own threads and a
copy per hop. Here each member has a shared-memory file of
two slots; an all-reduce of a buffer copies it, in chunks of one slot, into the member's slot, tells
every other member so with one datagram on a Unix socket, waits for theirs, and sums all members'
slots in rank order into its buffer (every member computes the same bits: the order is the same
everywhere). The slots alternate between chunks: a member writes a slot again only two chunks later,
after every other member has said it finished the chunk that read it (it sends the next chunk's
datagram only then), so one exchange of datagrams per chunk is all the synchronisation needed. The
datagrams go through the kernel, which orders the slot's writes before the reads on every CPU. An
all-gather copies every member's slot into its place instead; a reduce-scatter sums only this member's
part of the buffer; an all-to-all copies this member's part of every member's slot; a broadcast copies
the root's slot (the others write none).

Used by ``Collectives`` for the engine's own reduces (``reduce_``, data-parallel gradients), and by the
process groups that user code, DTensor and the FSDP path get (``StagedGroup``), when the rendezvous
finds every member on this host and each could allocate its file; otherwise, and for the tensors and
reduce ops it does not take, gloo as before. All members decide alike: the decision is made once, in the
group's rendezvous, and each call's path depends only on its tensors' dtype, device and layout and its
reduce op, the same on every member.
A member that dies mid-collective fails the others' wait (its socket refuses the datagram, or the
controller's death report arrives), as with gloo; so does one that stays silent past the timeout.

Collectives pair up by their order in the group, as with gloo; so one member that skips a collective (its
remote function raised before it, returned without it, or did not run: an input had failed there) would
pair its next one with the others' skipped one, and both would compute on the wrong tensors without an
error. Each datagram therefore carries a tag, what the proc's thread runs (``current.tag``: the
controller's sequence number of the instruction, and the step of a compiled program): a member whose next
chunk comes from a later instruction or step than the others' fails their collective (its instruction
raises, naming the member) instead of pairing with it; and a member whose remote function raised, or was
given a process group, says at the call's end that the call is over (``left``), which fails a collective
of that call still waiting for it within milliseconds instead of at the timeout (the end of a call is a
word in the member's file, which a wait reads every 10 ms, not a datagram: a member that runs no collective
of the group reads no datagram, and its queue would fill). Either way the members that failed take their
chunk back (nothing of it was read), so the group stays in step for what comes next. A member whose
collective at the same point differs from the others' (another kind, reduce op, dtype or size: code that
branches on its rank) fails it on every member, as gloo does, rather than reading the others' slots as if
they held its kind of data.

A gloo group whose members are not all on one host gets the same checks without the data (``CrossHostTags``):
the same frames on a TCP connection between every two members, before each of its collectives through gloo.
"""

from __future__ import annotations

import functools
import mmap
import os
import re
import select
import socket
import struct
import sys
import tempfile
import threading
import time
import uuid
import weakref
import zlib

import torch

from monarch_tensor.transport.mailbox import SPIN_S, _crowded, _sched_yield

SLOT_BYTES = 4 << 20  # a member's file holds two slots of this size: a larger buffer goes through in chunks
_SIGNAL = struct.Struct("<iqqQ")  # sender's index in the group, chunk sequence number (or _LEFT), its tag, and
# what the collective is (``_what``: its kind, reduce op, dtype and size, which every member's must equal)
_LEFT = -1  # in a datagram's sequence number: the sender ended the call of its tag (``left``)
STEP_BITS = 20  # a tag: the instruction's sequence number << STEP_BITS | the step of a compiled program (0: none)
_REDUCE = {"sum": torch.add, "avg": torch.add, "max": torch.maximum, "min": torch.minimum, "product": torch.mul}
_FOREACH = {"sum": torch._foreach_add_, "avg": torch._foreach_add_, "max": torch._foreach_maximum_,
            "min": torch._foreach_minimum_, "product": torch._foreach_mul_}  # (in place, over lists of tensors)
_POLL_S = 0.5  # how often a wait looks at the controller's death reports
_SEND_S = 60.0  # how long a frame may wait for room at a member (it reads none: it is stuck)
_FILE_BYTES = 2 * SLOT_BYTES + 8  # a member's file: its two slots, then the tag of the last call it ended (``left``)


class _Current(threading.local):
    tag = 0  # what this thread runs (see the module's docstring); 0: not known, which pairs with any
    gave_group = False  # whether the remote function this thread runs was given a process group


current = _Current()
_groups: weakref.WeakSet = weakref.WeakSet()  # this proc's groups, told by ``left``


class Skipped(RuntimeError):
    """A member of the group did not run this collective (it is past it, or ended its call before it)."""


class Mismatched(RuntimeError):
    """The members run different collectives at one point (each sees it at the collective's first chunk, and
    fails it: the group stays in step)."""


def left(tag: int) -> None:
    """This thread ended the call of ``tag`` (a remote function's, which may hold collectives: one that raised,
    or one given a process group): tell every group of this thread's stream, so that a member waiting in a
    collective of that call that this one did not run fails now instead of at the timeout. (A member waiting
    in one this one did run takes its frame first: ``_reached``.)"""
    if tag:
        me = threading.get_ident()
        for g in list(_groups):
            if g.owner is None or g.owner == me:  # (another stream's group runs no collective of this call)
                g._left(tag)


def _fold(op, parts: list, out: torch.Tensor) -> None:
    """``out`` = ``parts`` reduced by ``op`` in rank order (every member computes the same bits)."""
    op(parts[0], parts[1], out=out)
    for p in parts[2:]:
        op(out, p, out=out)


def _host_id() -> str:
    """What two procs share when they can meet here: one kernel (its boot), one user, and the same network and
    mount namespaces (the sockets' abstract names are per network namespace; /dev/shm is per mount)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    spaces = []
    for ns in ("net", "mnt"):
        try:
            spaces.append(os.readlink(f"/proc/self/ns/{ns}"))
        except OSError:
            spaces.append("")
    return "|".join([socket.gethostname(), boot, str(os.getuid()), *spaces])


def _shm_dir() -> str:
    return "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


def _path(nonce: str, i: int, pid: int) -> str:
    """Member ``i``'s file, made by process ``pid`` (which ``_sweep`` looks at)."""
    return os.path.join(_shm_dir(), f"monarch-tensor-{nonce}-{i}.{pid}")


_FILE = re.compile(r"monarch-tensor-[0-9a-f]{32}-\d+\.(\d+)")
SWEEP_AGE_S = 60.0  # a rendezvous that left its file this long ago is over
_swept = False


def _sweep() -> None:
    """Remove the files of members killed during their group's rendezvous (before it unlinked them: a
    script killed while its procs formed a group), once per process: those whose process is gone, made
    more than SWEEP_AGE_S ago."""
    global _swept
    if _swept:
        return
    _swept = True
    folder = _shm_dir()
    try:
        names = os.listdir(folder)
    except OSError:
        return
    now = time.time()
    for name in names:
        found = _FILE.fullmatch(name)
        if found is None:
            continue
        path = os.path.join(folder, name)
        try:
            if now - os.stat(path).st_mtime < SWEEP_AGE_S:
                continue
            os.kill(int(found.group(1)), 0)
        except ProcessLookupError:
            try:
                os.unlink(path)
            except OSError:
                pass
        except OSError:  # (alive, another user's; or gone already)
            pass


class _Tags:
    """What every group's collectives are checked with (see the module's docstring): per chunk of a
    collective, a frame from each member to every other (``_SIGNAL``: its index, the chunk's sequence
    number, its tag and what it runs), and at a call's end a word of it (``left``). Subclasses move the frames
    and the word (``_send``, ``_recv``, ``_left``, ``_left_tag``)."""

    def __init__(self, me: int, n: int) -> None:
        self.me, self.n = me, n
        self.seq = 0  # chunks sent
        self.seen = [(0, 0, 0)] * n  # per member: (chunk sequence number, tag, what) of the latest chunk it wrote
        self.left_at = [0] * n  # per member: the tag of the last call it said it ended (``left``)
        self.broken: str | None = None
        self.owner: int | None = None  # the thread that runs its collectives (a stream's), once one ran

    def _send(self, i: int, frame: bytes) -> None:
        """``frame`` to member ``i``; OSError where it is gone."""
        raise NotImplementedError

    def _recv(self, timeout: float) -> bytes | None:
        """The next frame from any member, or None after ``timeout`` seconds without one."""
        raise NotImplementedError

    def _left(self, tag: int) -> None:
        """Tell every other member that this one ended the call of ``tag`` (``left``), never blocking: a member
        may not read its frames for a long time (it runs no collective of this group), and its queue fills."""
        raise NotImplementedError

    def _left_tag(self, i: int) -> int:
        """The tag of the last call member ``i`` said it ended."""
        return self.left_at[i]

    def _take(self, frame: bytes) -> None:
        """A frame received: what it says of its member."""
        who, their_seq, their_tag, their_what = _SIGNAL.unpack(frame)
        if their_seq == _LEFT:
            if their_tag > self.left_at[who]:
                self.left_at[who] = their_tag
        elif (their_seq, their_tag) > self.seen[who][:2]:  # (the same chunk again, of a later call: _chunks)
            self.seen[who] = (their_seq, their_tag, their_what)

    def _drain(self) -> None:
        """Take the frames that came, without waiting."""
        while (frame := self._recv(0)) is not None:
            self._take(frame)

    _poll_s = _POLL_S  # how long a wait blocks before it looks at the controller's death reports and ``_left_tag``

    def sync(self, method: str, lost, timeout: float) -> None:
        """Every member says it reached this collective (gloo's ``method``) of the same call, exchanging no data:
        before one that goes through gloo, which pairs collectives by their order alone (see the module's
        docstring)."""
        self._chunks(1, 1, None, None, lost, timeout, _what("gloo", method))

    def _chunks(self, total: int, width: int, write, use, lost, timeout: float, what: int) -> None:
        """``total`` bytes through the slots in chunks (a multiple of ``width`` each): per chunk, ``write(mine,
        start, size)`` fills this member's slot (``mine``, ``size`` bytes; None: it writes none), the frames
        are exchanged, then ``use(slots, start, size)`` with every member's slot (its chunk at 0; None: the caller
        reads the slots itself). ``what``: the collective (``_what``), which every member's must equal."""
        if self.broken:
            raise RuntimeError(f"this group's collective failed before: {self.broken}")
        if self.owner is None:
            self.owner = threading.get_ident()
        step = SLOT_BYTES - SLOT_BYTES % width
        tag = current.tag
        in_step = False  # (a collective nobody ran: the group is not broken)
        try:
            for start in range(0, total, step):
                size = min(step, total - start)
                self.seq += 1
                off = (self.seq % 2) * SLOT_BYTES
                if write is not None:
                    write(self._mine[off:off + size], start, size)
                self._signal(tag, what)
                try:
                    self._wait_for(self.seq, tag, what, lost, timeout)
                except Skipped:
                    if not start:  # nobody read this chunk: the next collective writes and signals it again
                        self.seq -= 1
                        in_step = True
                    raise
                except Mismatched:
                    in_step = not start  # (every member fails this chunk, read by none)
                    raise
                if use is not None:
                    use([self._slot(i)[off:off + SLOT_BYTES] for i in range(self.n)], start, size)
        except BaseException as e:
            if not in_step:
                self.broken = repr(e)
            raise

    def _signal(self, tag: int, what: int) -> None:
        signal = _SIGNAL.pack(self.me, self.seq, tag, what)
        for i in range(self.n):
            if i != self.me:
                try:
                    self._send(i, signal)
                except OSError as e:  # its socket is gone: its proc exited
                    raise RuntimeError(f"member {i} of this group is gone (its proc exited?): {e}") from e

    def _has(self, i: int, seq: int, tag: int) -> bool:
        """Whether member ``i`` wrote chunk ``seq`` of this collective (or a later one)."""
        s, t, _ = self.seen[i]
        return s > seq or (s == seq and (t == tag or not t or not tag))

    def _reached(self, i: int, seq: int, tag: int) -> bool:
        """``_has``, raising ``Skipped`` where member ``i`` never will."""
        if self._has(i, seq, tag):
            return True
        if tag and self._left_tag(i) >= tag:  # it ended this call, or a later one: without this chunk?
            self._drain()  # (what it sent before it ended the call waits here, unread: take it first)
            if self._has(i, seq, tag):
                return True
            raise Skipped(f"member {i} of this group ended this call before it reached this collective (its "
                          f"remote function raised, returned without this collective, or did not run there: an "
                          f"input of it had failed)")
        s, t, _ = self.seen[i]
        if s == seq and t > tag:
            raise Skipped(f"member {i} of this group did not run this collective: its chunk {seq} belongs "
                          f"to a later call (its remote function raised before this collective, or did not run "
                          f"there: an input of it had failed)")
        return False

    def _wait_for(self, seq: int, tag: int, what: int, lost, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        reached = self._reached
        spin = SPIN_S > 0
        while not all([reached(i, seq, tag) for i in range(self.n) if i != self.me]):
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"a member of this group did not reach the same collective within {timeout} s "
                                   f"(members still missing: {self._missing(seq, tag)})")
            data = self._spun() if spin else None
            if data is None:
                spin = False  # (not again in this wait: it was not short)
                data = self._recv(min(self._poll_s, left))
            if data is None:
                dead = lost()
                if dead:
                    raise RuntimeError(f"the procs of rank(s) {dead} of this group died during the "
                                       f"collective") from None
                continue
            self._take(data)
        for i in range(self.n):  # (a member past this chunk compared its own with every member's)
            if i != self.me and self.seen[i][0] == seq and self.seen[i][2] != what:
                raise Mismatched(f"member {i} of this group runs another collective here than this member (another "
                                 f"kind, reduce op, dtype or size: code that differs between ranks?)")

    def _spun(self) -> bytes | None:
        """A frame that comes within ``SPIN_S`` (200 µs) of a wait's start, polled for (yielding the core each
        try), or None: the members of a collective come to it at about the same time, and a blocked thread
        waits for the scheduler to wake it, on a busy 2-core VM about as long as a small gloo collective takes.
        Not on a crowded machine (``_crowded``), where polling takes a core from a thread that has work."""
        if _crowded():
            return None
        end = time.perf_counter() + SPIN_S
        recv = self._recv
        while (frame := recv(0)) is None:
            if time.perf_counter() >= end:
                return None
            _sched_yield()
        return frame

    def _missing(self, seq: int, tag: int) -> list[int]:
        return [i for i in range(self.n) if i != self.me and not self._has(i, seq, tag)]


class SameHostReduce(_Tags):
    """The shared-memory collectives of one group (``me`` of ``n``); made by ``rendezvous``. Its frames go as
    datagrams on Unix sockets."""

    def __init__(self, nonce: str, me: int, n: int) -> None:
        super().__init__(me, n)
        self.nonce = nonce
        self._layouts: dict = {}  # (shapes, dtype, slot address) -> _Layout (_in_place)
        self._peers: dict[int, torch.Tensor] = {}  # member -> its file's bytes (mapped in the rendezvous)
        self._pids: list[int] = []  # each member's process, which named its file (set in the rendezvous)
        self._mine_path = _path(nonce, me, os.getpid())
        self._mine = _create(self._mine_path, _FILE_BYTES)
        self._left_words: dict = {}  # member -> the tag word at the end of its file (a numpy view)
        self._unlinked = False
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self._addrs = [self._address(i) for i in range(n)]
        self.sock.bind(self._addrs[me])
        _groups.add(self)

    def _send(self, i: int, frame: bytes) -> None:
        self.sock.settimeout(_SEND_S)  # (a wait left its own timeout on the socket)
        self.sock.sendto(frame, self._addrs[i])

    def _recv(self, timeout: float) -> bytes | None:
        self.sock.settimeout(timeout)
        try:
            return self.sock.recv(_SIGNAL.size)
        except (TimeoutError, BlockingIOError):
            return None

    _poll_s = 0.01  # (the end of a call is a word in a member's file, not a frame: a wait looks at it this often)

    def _word(self, i: int):
        w = self._left_words.get(i)
        if w is None:
            w = self._left_words[i] = self._slot(i)[2 * SLOT_BYTES:_FILE_BYTES].view(torch.int64).numpy()  # (~0.1 µs)
        return w

    def _left(self, tag: int) -> None:
        # A word in this member's file, which a wait reads (``_left_tag``), not a datagram: a member that runs
        # no collective of this group for a while reads none, and its queue (10 datagrams on some hosts) would
        # fill, then block the sender (a remote function given the group, called 11 times, hung its proc).
        self._word(self.me)[0] = tag

    def _left_tag(self, i: int) -> int:
        return int(self._word(i)[0])

    def _address(self, i: int):
        if sys.platform.startswith("linux"):
            return f"\0monarch-tensor-{self.nonce}-{i}"  # abstract: nothing to clean up
        return os.path.join(tempfile.gettempdir(), f"mt-{self.nonce[:16]}-{i}.sock")

    @classmethod
    def rendezvous(cls, store, me: int, n: int) -> SameHostReduce | None:
        """The group's shared-memory all-reduce, or None (gloo's then) where some member runs on another host
        or could not allocate or map the files. Every member calls this at the same point of the group's
        rendezvous in ``store`` and gets the same answer. The files are unlinked before it returns (each
        member has mapped every other's): nothing is left behind, however the procs end after it (the file of a
        member killed during it goes at the next rendezvous on this host: ``_sweep``). A group of one has
        nothing to exchange: None."""
        if n < 2:
            return None
        store.set(f"shm/host/{me}", _host_id())
        if any(store.get(f"shm/host/{i}").decode() != _host_id() for i in range(n)):
            return None
        _sweep()
        store.set(f"shm/pid/{me}", str(os.getpid()))
        if me == 0:
            store.set("shm/nonce", uuid.uuid4().hex)
        nonce = store.get("shm/nonce").decode()
        made: SameHostReduce | None = None
        try:
            made = cls(nonce, me, n)
        except OSError:
            pass
        ok = False
        try:
            store.set(f"shm/made/{me}", "1" if made is not None else "0")
            ok = all(store.get(f"shm/made/{i}") == b"1" for i in range(n))
            if ok:
                made._pids = [int(store.get(f"shm/pid/{i}")) for i in range(n)]
                try:
                    for i in range(n):
                        made._slot(i)
                except OSError:
                    ok = False
            store.set(f"shm/mapped/{me}", "1" if ok else "0")
            ok = all(store.get(f"shm/mapped/{i}") == b"1" for i in range(n))
        finally:  # (a member that died meanwhile fails the store's get: this file must not stay behind)
            if made is not None:
                made._unlink()
                if not ok:
                    made.close()
        return made if ok else None

    @staticmethod
    def takes(*ts: torch.Tensor) -> bool:
        """Whether the collectives here take these tensors: contiguous CPU tensors of a number type (what
        decides must be the same on every member: the tensors' dtype, device and layout are)."""
        return all(t.device.type == "cpu" and t.dtype != torch.bool and not t.is_complex() and t.is_contiguous()
                   for t in ts)

    def allreduce(self, work: torch.Tensor, reduction: str, lost, timeout: float) -> None:
        """Reduce ``work`` (contiguous, CPU) over the group in place. ``lost()``: the group's members whose
        procs the controller reported dead."""
        op = _REDUCE[reduction]

        def reduce(slots, start: int, size: int) -> None:
            _fold(op, [s[:size].view(work.dtype) for s in slots], flat[start:start + size].view(work.dtype))

        flat = _bytes(work)
        self._exchange(flat, work.element_size(), reduce, lost, timeout,
                       what=_what("allreduce", reduction, work.dtype, work.numel()))

    def allreduce_many(self, srcs: list, numels, flags: torch.Tensor, ok, reduction: str, lost, timeout: float,
                       into: list | None = None) -> tuple[list, list]:
        """Several tensors of ``flags``' dtype reduced over the group at once, written straight from ``srcs`` into
        this member's slot (no buffer of them all to fill first: ``Collectives.reduce_many``'s other path)
        and reduced into one new buffer. ``srcs[i]`` None: zeros of ``numels[i]`` elements take its place.
        ``flags``, one element per tensor, go first, reduced with the same op. The answer: ``(good, outs)``,
        per tensor whether its reduced flag equals ``ok`` (it does where every member's did) and its result,
        flat, a view of that buffer; with ``into``, ``into[i]`` written in place instead (it may be
        ``srcs[i]``: every chunk is read before any is written; None: nothing written). A tensor that is not
        good is not written. The caller sees that the tensors are contiguous CPU tensors this takes
        (``takes``)."""
        op = _REDUCE[reduction]
        dtype, width, k, n = flags.dtype, flags.element_size(), flags.numel(), self.n
        size_all = k + sum(numels)
        one_chunk = size_all * width <= SLOT_BYTES - SLOT_BYTES % width
        what = _what("allreduce", reduction, dtype, size_all)
        if one_chunk and into is not None and self.me < 2 and (reduction != "avg" or dtype.is_floating_point) \
                and all(d is s and s is not None for d, s in zip(into, srcs)) \
                and len({s.untyped_storage().data_ptr() for s in srcs}) == len(srcs):
            return self._in_place(srcs, flags, size_all * width, reduction, ok, lost, timeout, what)
        flat = [flags] + [s.view(-1) if s is not None else torch.zeros(c, dtype=dtype) for s, c in zip(srcs, numels)]

        def write_all(mine, start: int, size: int) -> None:  # (one chunk: one op writes them all)
            torch.cat(flat, out=mine.view(dtype))

        work = torch.empty(size_all, dtype=dtype)
        if one_chunk:
            write = write_all

            def use(slots, start: int, size: int) -> None:
                _fold(op, [s[:size].view(dtype) for s in slots], work)
        else:  # piece by piece: the pieces of the tensors in each chunk
            starts = [0]
            for t in flat:
                starts.append(starts[-1] + t.numel() * width)
            bflat, bwork = [_bytes(t) for t in flat], _bytes(work)

            def pieces(start: int, size: int):
                for i, t in enumerate(bflat):
                    lo, hi = max(starts[i], start), min(starts[i + 1], start + size)
                    if lo < hi:
                        yield t[lo - starts[i]:hi - starts[i]], lo - start, hi - start

            def write(mine, start: int, size: int) -> None:
                for piece, lo, hi in pieces(start, size):
                    mine[lo:hi].copy_(piece)

            def use(slots, start: int, size: int) -> None:
                _fold(op, [s[:size].view(dtype) for s in slots], bwork[start:start + size].view(dtype))

        self._chunks(size_all * width, width, write, use, lost, timeout, what)
        good = (work[:k] == ok).tolist()
        data = work[k:]
        if reduction == "avg":
            data.div_(n) if data.is_floating_point() else data.floor_divide_(n)
        outs = list(data.split(list(numels)))
        if into is not None:
            pairs = [(d.view(-1), o) for d, o, g in zip(into, outs, good) if g and d is not None]
            if pairs:
                torch._foreach_copy_([d for d, _ in pairs], [o for _, o in pairs])
            outs = into
        return good, [o if g else None for o, g in zip(outs, good)]

    def _in_place(self, srcs: list, flags: torch.Tensor, size: int, reduction: str, ok, lost,
                  timeout: float, what: int) -> tuple[list, list]:
        """``allreduce_many`` in place on a member of rank 0 or 1, of tensors that fit in one chunk (``size``
        bytes, ``flags`` first) and share no memory: each tensor, still this member's own input, takes the
        other members' parts in rank order with one grouped (``_foreach_``) op per member, no buffer and no
        copy back. The bits are the rank-order reduce's: on member 1, ``s1 + s0`` equals ``s0 + s1`` (each op
        here is commutative), and the rest follow in order. The views of the slots shaped like the tensors
        are made once per layout (``_Layout``): a data-parallel step reduces the same gradients every time."""
        dtype, n, me = flags.dtype, self.n, self.me
        key = (tuple([t.shape for t in srcs]), dtype)
        got: list = []

        def write(mine, start: int, size: int) -> None:
            at = (key, mine.data_ptr())
            lay = self._layouts.get(at)
            if lay is None:
                if len(self._layouts) >= 64:
                    self._layouts.clear()
                lay = self._layouts[at] = _Layout(self, key[0], dtype, (self.seq % 2) * SLOT_BYTES, size)
            torch._foreach_copy_(lay.parts[me], [flags, *srcs])
            got.append(lay)

        self._chunks(size, flags.element_size(), write, None, lost, timeout, what)
        lay = got[0]
        # A tensor is good where every member's flag is ``ok`` (flags are ``ok`` or the other value of _FLAGS: the
        # reduced flag equals ``ok`` exactly then).
        marks = [p[0].tolist() for p in lay.parts]
        good = [all(f == ok for f in col) for col in zip(*marks)]
        grouped = _FOREACH[reduction]
        if all(good):
            for j in range(n):
                if j != me:
                    grouped(srcs, lay.parts[j][1:])
            dsts = srcs
        else:
            keep = [i for i, g in enumerate(good) if g]
            dsts = [srcs[i] for i in keep]
            if keep:
                for j in range(n):
                    if j != me:
                        grouped(dsts, [lay.parts[j][1 + i] for i in keep])
        if reduction == "avg" and dsts:
            if n & (n - 1) == 0:  # (x * (1 / n) is x / n, bit for bit, for a power of 2; it takes 2/3 the time)
                torch._foreach_mul_(dsts, 1.0 / n)
            else:
                torch._foreach_div_(dsts, n)
        return good, [s if g else None for s, g in zip(srcs, good)]

    def allgather(self, output: torch.Tensor, input: torch.Tensor, lost, timeout: float) -> None:
        """``output`` (n times ``input``'s elements) = every member's ``input``, in rank order."""
        out = _bytes(output)
        whole = input.numel() * input.element_size()

        def gather(slots, start: int, size: int) -> None:
            for i, s in enumerate(slots):
                out[i * whole + start:i * whole + start + size].copy_(s[:size])

        self._exchange(_bytes(input), input.element_size(), gather, lost, timeout,
                       what=_what("allgather", input.dtype, input.numel()))

    def reduce_scatter(self, output: torch.Tensor, input: torch.Tensor, reduction: str, lost,
                       timeout: float) -> None:
        """``output`` = this member's part (its rank's of n equal parts) of every member's ``input`` reduced."""
        op = _REDUCE[reduction]
        dtype, width = input.dtype, input.element_size()
        out = _bytes(output)
        part = out.numel()
        mine = self.me * part

        def reduce(slots, start: int, size: int) -> None:
            lo, hi = max(start, mine), min(start + size, mine + part)
            if lo >= hi:
                return
            _fold(op, [s[lo - start:hi - start].view(dtype) for s in slots], out[lo - mine:hi - mine].view(dtype))

        self._exchange(_bytes(input), width, reduce, lost, timeout,
                       what=_what("reduce_scatter", reduction, dtype, input.numel()))

    def alltoall(self, output: torch.Tensor, input: torch.Tensor, lost, timeout: float) -> None:
        """``output``'s part j (of n equal parts) = member j's ``input``'s part for this member (its rank's)."""
        if output.untyped_storage().data_ptr() == input.untyped_storage().data_ptr():
            input = input.clone()  # (the parts written here would be read from later chunks)
        out = _bytes(output)
        part = out.numel() // self.n
        mine = self.me * part

        def scatter(slots, start: int, size: int) -> None:
            lo, hi = max(start, mine), min(start + size, mine + part)
            if lo >= hi:
                return
            for j, s in enumerate(slots):
                out[j * part + lo - mine:j * part + hi - mine].copy_(s[lo - start:hi - start])

        self._exchange(_bytes(input), input.element_size(), scatter, lost, timeout,
                       what=_what("alltoall", input.dtype, input.numel()))

    def broadcast(self, tensor: torch.Tensor, root: int, lost, timeout: float) -> None:
        """``tensor`` = member ``root``'s ``tensor``, on every member (only the root writes its slot)."""
        data = _bytes(tensor)

        def take(slots, start: int, size: int) -> None:
            if self.me != root:
                data[start:start + size].copy_(slots[root][:size])

        self._exchange(data, tensor.element_size(), take, lost, timeout, write=self.me == root,
                       what=_what("broadcast", root, tensor.dtype, tensor.numel()))

    def _exchange(self, data: torch.Tensor, width: int, use, lost, timeout: float, write: bool = True,
                  what: int = 0) -> None:
        """``data`` (bytes) through the slots in chunks: per chunk, this member's part written to its slot (unless
        not ``write``), the datagrams exchanged, then ``use(slots, start, size)`` with every member's slot (its
        chunk at 0)."""
        def put(mine, start: int, size: int) -> None:
            mine.copy_(data[start:start + size])

        self._chunks(data.numel(), width, put if write else None, use, lost, timeout, what)

    def _slot(self, i: int) -> torch.Tensor:
        """Member ``i``'s file as bytes (mapped in the rendezvous)."""
        if i == self.me:
            return self._mine
        mapped = self._peers.get(i)
        if mapped is None:
            mapped = self._peers[i] = _open(_path(self.nonce, i, self._pids[i]), _FILE_BYTES)
        return mapped

    def _unlink(self) -> None:
        self._unlinked = True
        try:
            os.unlink(self._mine_path)
        except FileNotFoundError:
            pass

    def close(self) -> None:
        """Unlink this member's file if the rendezvous has not (the mappings go with the object) and close
        its socket."""
        _groups.discard(self)
        if not self._unlinked:
            self._unlink()
        self.sock.close()
        if not sys.platform.startswith("linux"):
            try:
                os.unlink(self._addrs[self.me])
            except FileNotFoundError:
                pass


_TOKEN_BYTES = 16  # a cross-host group's rendezvous: what a connection to a member's listener opens with


def _accept_members(listener: socket.socket, token: bytes, expected: set, deadline: float) -> dict:
    """The connections of the members in ``expected`` to ``listener``, by member: each opens with ``token``
    and its rank. A connection that opens with anything else, or closes first, is a stranger's: closed, and
    the accepts go on. OSError at ``deadline`` with members missing."""
    size = _TOKEN_BYTES + 4
    got: dict = {}
    pending: dict = {}  # fd -> (a connection not yet placed, the bytes it sent so far)
    listener.setblocking(False)
    poller = select.poll()
    poller.register(listener, select.POLLIN)
    try:
        while len(got) < len(expected):
            left = deadline - time.monotonic()
            if left <= 0:
                raise OSError(f"members {sorted(expected - set(got))} did not connect in time")
            for fd, _ in poller.poll(left * 1000):
                if fd == listener.fileno():
                    try:
                        s, _ = listener.accept()
                    except BlockingIOError:
                        continue
                    s.setblocking(False)
                    pending[s.fileno()] = (s, b"")
                    poller.register(s, select.POLLIN)
                    continue
                s, hello = pending[fd]
                try:
                    more = s.recv(size - len(hello))
                except BlockingIOError:
                    continue
                except OSError:
                    more = b""
                hello += more
                if more and len(hello) < size:
                    pending[fd] = (s, hello)
                    continue
                poller.unregister(fd)
                del pending[fd]
                rank = struct.unpack("<i", hello[_TOKEN_BYTES:])[0] if len(hello) == size else None
                if hello[:_TOKEN_BYTES] == token and rank in expected and rank not in got:
                    s.setblocking(True)
                    got[rank] = s
                else:
                    s.close()  # a stranger's: hung up on
    except BaseException:
        for s in got.values():
            s.close()
        raise
    finally:
        for s, _ in pending.values():
            s.close()
    return got


class CrossHostTags(_Tags):
    """The tags alone, for a gloo group whose members are not all on one host (gloo moves the data): the same
    frames, on a TCP connection between every two members, made by ``rendezvous``. Before each of the
    group's collectives through gloo (``StagedGroup``: ``sync``), so a member that skipped one fails it on
    the others rather than pairs it with its next."""

    def __init__(self, me: int, n: int, socks: dict) -> None:
        super().__init__(me, n)
        self._socks = socks  # member -> its connection
        self._member = {s.fileno(): i for i, s in socks.items()}  # (poll, not select: a proc may hold > 1024 fds)
        self._readable, self._writable = select.poll(), select.poll()
        for s in socks.values():
            self._readable.register(s, select.POLLIN)
            self._writable.register(s, select.POLLOUT)
        self._bufs = {i: b"" for i in socks}  # per member: bytes received past its last whole frame
        self._unsaid = 0  # the tag of the last call this member ended, not yet sent to every member (_left)
        self._unsaid_to: set = set()
        _groups.add(self)

    @classmethod
    def rendezvous(cls, store, me: int, n: int, ip: str, timeout: float = 60.0) -> CrossHostTags | None:
        """Every member listens on ``ip`` (its address on the route to the others), connects to the members
        before it and accepts those after it, through ``store``. None where a member could not (the group's
        collectives then go unchecked, as before); every member gets the same answer. A member's listener
        takes only connections that open with its token (from the store) and a member's rank: anything else
        that connects to its port (a socket of another program reconnecting to a port the kernel has since
        handed out again, as a zmq socket whose peer is gone does) is hung up on, and the accepts go on."""
        if n < 2:
            return None
        socks: dict = {}
        listener = None
        ok = True
        try:
            listener = socket.create_server((ip, 0), family=socket.AF_INET6 if ":" in ip else socket.AF_INET,
                                            backlog=n)
            token = os.urandom(_TOKEN_BYTES)
            store.set(f"tcp/addr/{me}", f"{ip} {listener.getsockname()[1]} {token.hex()}")
            for i in range(me):
                host, port, theirs = store.get(f"tcp/addr/{i}").decode().split()
                s = socks[i] = socket.create_connection((host, int(port)), timeout=timeout)
                s.sendall(bytes.fromhex(theirs) + struct.pack("<i", me))
            socks.update(_accept_members(listener, token, set(range(me + 1, n)), time.monotonic() + timeout))
        except OSError:
            ok = False
        finally:
            if listener is not None:
                listener.close()
        store.set(f"tcp/ok/{me}", "1" if ok else "0")
        if not all(store.get(f"tcp/ok/{i}") == b"1" for i in range(n)):
            for s in socks.values():
                s.close()
            return None
        for s in socks.values():
            s.settimeout(_SEND_S)
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return cls(me, n, socks)

    def _send(self, i: int, frame: bytes) -> None:
        if self._unsaid_to:  # (in order: the end of an earlier call, then this chunk)
            self._say_unsaid()
        self._socks[i].sendall(frame)

    def _left(self, tag: int) -> None:
        # To each member whose connection has room (the frame then goes whole); to the others at the next chance
        # (this member's next collective or end of a call), the latest tag only. First this member takes what the
        # others sent meanwhile, so that theirs have room too (a member that runs no collective of this group
        # for a while reads no frame otherwise).
        try:
            self._drain()
        except RuntimeError:  # (a member gone: the next collective says so)
            pass
        self._unsaid, self._unsaid_to = tag, set(self._socks)
        self._say_unsaid()

    def _say_unsaid(self) -> None:
        """``_unsaid`` to the members of ``_unsaid_to`` whose connection has room now."""
        frame = _SIGNAL.pack(self.me, _LEFT, self._unsaid, 0)
        for fd, events in self._writable.poll(0):
            i = self._member[fd]
            if i not in self._unsaid_to:
                continue
            if events & select.POLLOUT:
                try:
                    self._socks[i].sendall(frame)
                except OSError:  # (gone: nobody waits there)
                    pass
            self._unsaid_to.discard(i)  # (or closed: gone)

    def _recv(self, timeout: float) -> bytes | None:
        size = _SIGNAL.size
        for i, buf in self._bufs.items():
            if len(buf) >= size:
                self._bufs[i] = buf[size:]
                return buf[:size]
        ready = self._readable.poll(max(0, int(timeout * 1000 + 0.999)))
        for fd, _ in ready:
            i = self._member[fd]
            try:
                data = self._socks[i].recv(4096)
            except OSError:
                data = b""
            if not data:
                raise RuntimeError(f"member {i} of this group is gone (its connection closed: its proc exited?)")
            self._bufs[i] += data
        return self._recv(0) if ready else None

    def close(self) -> None:
        _groups.discard(self)
        for s in self._socks.values():
            s.close()


@functools.lru_cache(maxsize=4096)
def _what(*about) -> int:
    """What a collective is, as a number every member computes alike (``hash`` differs between processes)."""
    return zlib.crc32(repr(about).encode())


class _Layout:
    """Views of every member's slot (the one at ``off``) as one flag per tensor, then tensors of ``shapes`` side
    by side: ``parts[member]`` = [flags, tensor 0, tensor 1, ...]."""

    __slots__ = ("parts",)

    def __init__(self, group: SameHostReduce, shapes: tuple, dtype: torch.dtype, off: int, size: int) -> None:
        k, numels = len(shapes), [s.numel() for s in shapes]
        self.parts = []
        for j in range(group.n):
            v = group._slot(j)[off:off + size].view(dtype)
            self.parts.append([v[:k]] + [p.view(shape) for p, shape in zip(v[k:].split(numels), shapes)])


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's memory as a flat tensor of bytes (the same memory). (A contiguous tensor of one
    element may have any stride, which ``reshape`` keeps and ``view`` refuses: a DTensor's one-row shard.)"""
    flat = t.reshape(-1)
    if flat.numel() == 1 and flat.stride(0) != 1:
        flat = flat.as_strided((1,), (1,))
    return flat.view(torch.uint8)


def _create(path: str, size: int) -> torch.Tensor:
    """A new file of ``size`` bytes, its blocks allocated now (a tmpfs short of space refuses here, not with
    SIGBUS at the first write), mapped, as a tensor of bytes."""
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        if hasattr(os, "posix_fallocate"):
            os.posix_fallocate(fd, 0, size)
        else:
            os.ftruncate(fd, size)
            os.pwrite(fd, b"\0" * size, 0)
        mm = mmap.mmap(fd, size)
    except OSError:
        os.close(fd)
        os.unlink(path)
        raise
    os.close(fd)
    return torch.frombuffer(mm, dtype=torch.uint8)


def _open(path: str, size: int) -> torch.Tensor:
    """Another member's file, mapped, as a tensor of bytes."""
    fd = os.open(path, os.O_RDWR)
    try:
        mm = mmap.mmap(fd, size)
    finally:
        os.close(fd)
    return torch.frombuffer(mm, dtype=torch.uint8)
