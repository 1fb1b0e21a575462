"""The runtime inside every proc: receive messages, host actors, run endpoints.

The mailbox's I/O thread decodes messages and hands them to this process's
asyncio loop (the main thread). Each actor handles its messages one at a time
in arrival order; a sync endpoint runs inline on the loop, an async one as a
task that holds the actor until it finishes. An endpoint that blocks the loop
waiting on a reply (``.get()``) runs the loop's turns meanwhile
(``_blocked_turn``), so the calls it waits on run even when they are async.
An actor's constructor runs on a thread of its own (``_construct``), so one
that blocks leaves the proc's other actors serving; what it set in the actor's
``threading.local`` attributes, and the CUDA device it made current, are carried
over to the loop's thread; the rest of the thread state it left that is kept
(``_thread_state``) is put in place around that actor's calls only.
Replies go straight back to the caller's port. Nothing a message contains can
kill the proc: an unknown actor or endpoint, or an endpoint that raises,
becomes an error reply (an endpoint
that raises a BaseException that is not an Exception, or raises with an
explicit response port, kills its actor, as in Monarch: ``_endpoint_killed``).
"""

from __future__ import annotations

import asyncio
import bdb
import collections
import concurrent.futures
import dataclasses
import fcntl
import inspect
import logging
import os
import select
import signal
import sys
import termios
import threading
import time
import traceback
from asyncio.events import _get_running_loop, _set_running_loop
from dataclasses import dataclass, field
from typing import Callable

from ..config import setting, take
from ..errors import ActorAbortedError, ActorError, ActorFailedError, ActorStoppedError, actor_label
from ..future import loop_threads
from ..shape import Point, Shape
from ..transport import mailbox as _mailbox_mod
from ..transport._fanout import GATHER_PREFIX
from ..transport.logs import OUTPUT_WAIT_S
from ..transport.mailbox import Mailbox, set_current_mailbox
from ..transport.messages import (
    ActorFault,
    CallEndpoint,
    ForwardLogs,
    InterruptCall,
    KnowPeers,
    PortRef,
    SendToPort,
    SetLogging,
    SpawnActor,
    StopActor,
    StopProc,
    reply_envelope,
)
from . import _actor_logs, _context, _hooks, _names, _proc_exit, _thread_state, _threads, _zygote
from ._port import Port

# An actor killed by its endpoint tells its owner, and its caller hears of the death once the owner has the
# failure in order (``_FaultAck``), or after this long: an owner that does not answer (busy in a long
# computation that serves no messages, or gone) delays the caller's error no longer.
FAULT_ACK_WAIT_S = 2.0

# A call to an actor this proc does not have waits this long for its spawn before it fails (see
# ProcRuntime._await_actor).
UNKNOWN_ACTOR_WAIT_S = setting("MONARCH_TENSOR_UNKNOWN_ACTOR_WAIT")

log = logging.getLogger("monarch_tensor.proc")


@dataclass
class _Slot:
    name: str
    instance: object
    ctx: _context.ActorContext
    init_error: BaseException | None = None
    queue: collections.deque = field(default_factory=collections.deque)
    busy: bool = False
    done_events: list = field(default_factory=list)  # set when the running async call ends (Reserved.done)
    tasks: set = field(default_factory=set)  # running @concurrent_endpoint calls
    stopped: str | None = None  # ActorMesh.stop()'s reason: calls that come after it fail
    stop_done: bool = False  # the calls before it have run, and the actor has stopped
    owner: str = ""  # the address of the process that spawned it: told of errors nobody awaits
    initializing: bool = False  # its constructor runs (on a thread of its own: _construct)
    pending_init: SpawnActor | None = None  # its spawn, whose arguments the tensor engine brings (args_by_engine)
    running: dict = field(default_factory=dict)  # reply port -> task of its running async (or concurrent) call
    thread_state: _thread_state.ActorThreadState | None = None  # what its constructor left in its thread's state


class Reserved:
    """A call's place in its actor's queue, taken before the call can run (its arguments are still being
    computed: mesh tensors on the tensor engine's stream). Calls queued after it wait for it.
    ``fill`` (on the proc's loop) supplies the call, or the error to reply with instead;
    ``done`` is set once the call has run."""

    __slots__ = ("msg", "error", "ready", "done")

    def __init__(self) -> None:
        self.msg: CallEndpoint | None = None
        self.error: BaseException | None = None
        self.ready = False
        self.done = threading.Event()


class _Gate:
    """A place in an actor's queue held while its async ``__supervise__`` runs: the calls that came after
    the failure wait for it, as they would for an async endpoint."""

    __slots__ = ()


class _FaultAck:
    """The owner's answer to an ``ActorFault`` (a port of this proc): ``then`` (the failed call's reply to its
    caller) runs once it came, once the owner is found dead, or after ``FAULT_ACK_WAIT_S``, whichever is first.
    So a caller who hears of the death and then asks the owner finds the owner's ``__supervise__`` has seen
    it (Monarch's order)."""

    def __init__(self, rt: ProcRuntime, owner: str, then: Callable[[], None]) -> None:
        self.rt, self.owner, self.then = rt, owner, then
        self.done = False
        self.port_id = 0
        self.timer: asyncio.TimerHandle | None = None
        rt.loop.call_soon_threadsafe(self._arm)

    def _arm(self) -> None:
        if not self.done:
            self.timer = self.rt.loop.call_later(FAULT_ACK_WAIT_S, self.fire)

    def fire(self) -> None:
        if self.done:
            return
        self.done = True
        if self.timer is not None:
            self.timer.cancel()
        self.rt.mailbox.close_port(self.port_id)
        self.then()

    def _soon(self) -> None:
        try:
            self.rt.loop.call_soon_threadsafe(self.fire)
        except RuntimeError:  # the loop closed: the proc is stopping
            pass

    def deliver(self, msg: SendToPort) -> bool:
        self._soon()
        return True

    def proc_died(self, addr: str, error: BaseException) -> tuple[bool, bool]:
        if addr != self.owner:
            return False, False
        self._soon()
        return False, True


class _LogForwarder:
    """Routes fds 1 and 2 through pipes whose lines reach the client.

    A proc forked by this host's template for the client (``_zygote``, ``relay``): the template reads the
    pipes and relays the bytes to the client (``host.LocalHost``), so what a proc writes reaches the client
    even when the proc dies right after (its own threads would have lost what they had read and not yet
    sent). Otherwise (a host agent's procs) a pump thread per stream sends the lines to the client, and the
    template sends what is left unread in the pipes when the proc exits.

    ``set_enabled`` switches the forwarding in order with the output: it writes a switch into each pipe
    (``logs.StreamLines``), so lines written before it are handled as before it, however late they are read.

    What the proc wrote before it replies to the client reaches the client before the reply (``before_reply``):
    the template's relay says how much it wrote (``_zygote.OutputCounts``), and the client prints that much
    first; a pump sends the lines on the mailbox the reply then takes, so the reply waits for the pumps."""

    def __init__(self, mailbox: Mailbox, client_addr: str, rank: int) -> None:
        self.mailbox, self.client_addr, self.rank = mailbox, client_addr, rank
        from .. import config

        on = config.get("enable_log_forwarding")  # as the client's configure() had it when it spawned us
        self.enabled = {1: on, 2: on}  # per stream, as its pump has read the switches (pumps only)
        self.flushed = False
        self.threads = []
        self.originals = {}
        self.pipes = {}  # stream -> its pipe's read end (in a relayed proc, only to see what is unread in it)
        self.holding = select.poll()  # the read ends, to see whether they hold anything (see _unread)
        self.counts = None  # a relayed proc's _zygote.OutputCounts
        self.pid = os.getpid()
        self.told = threading.local()  # .written: the counts the last reply from this thread carried (relayed)
        self.pumped = {1: 0, 2: 0}  # bytes each pump has read and sent on (pumps only)
        self.pumping = threading.Condition()  # held while a pump reads and sends on what it read
        given = take(_zygote.LOG_PIPES_ENV)  # "relay|pump,r1,r2,t1,t2" (see _zygote._child)
        mode, *fds = given.split(",") if given else ("",)
        for stream in (1, 2):
            if given:  # fds 1 and 2 are the template's pipes already
                r, self.originals[stream] = int(fds[stream - 1]), int(fds[stream + 1])
            else:
                self.originals[stream] = os.dup(stream)
                r, w = os.pipe()
                os.dup2(w, stream)
                os.close(w)
            self.pipes[stream] = r
            self.holding.register(r, select.POLLIN)
            if mode == "relay":  # the template reads them
                self.counts = _zygote.output_counts
                continue
            t = threading.Thread(target=self._pump, args=(r, stream), daemon=True, name=f"logs-{stream}")
            t.start()
            self.threads.append(t)
        sys.stdout.reconfigure(line_buffering=True)
        sys.stderr.reconfigure(line_buffering=True)

    def _pump(self, fd: int, stream: int) -> None:
        from ..transport.logs import StreamLines

        lines = StreamLines(self.enabled[stream])
        readable = select.poll()
        readable.register(fd, select.POLLIN)
        while True:
            readable.poll()
            with self.pumping:  # (a reply looks at the pipe meanwhile: what it sees unread is not half sent)
                try:
                    chunk = os.read(fd, 65536)
                except OSError:
                    chunk = b""
                for on, run in lines.feed(chunk) if chunk else lines.end():
                    self._emit(stream, run, on)
                self.pumped[stream] += len(chunk)
                self.pumping.notify_all()
            if not chunk:
                break
            self.enabled[stream] = lines.enabled

    def before_reply(self) -> tuple | None:
        """Called as a reply to the client is about to go: what the proc wrote so far must reach the client
        first. A relayed proc returns ``(pid, stdout bytes, stderr bytes)`` written so far, for the reply to
        carry (``SendToPort.output_before``), or None when no more was written since this thread's last
        reply. With pumps, waits until they sent on what is in the pipes now (``OUTPUT_WAIT_S`` at most: a
        stuck pipe delays replies no longer), and returns None. Partial lines are not waited for."""
        if self.flushed:
            return None
        if self.counts is not None:
            written = self.counts.written(self._unread)
            if written is None or written == getattr(self.told, "written", (0, 0)):
                return None
            self.told.written = written
            return (self.pid, *written)
        if not self.threads:
            return None
        with self.pumping:
            want = {s: self.pumped[s] + n for s, n in zip((1, 2), self._unread())}
            if want != self.pumped:
                self.pumping.wait_for(lambda: all(self.pumped[s] >= n for s, n in want.items()), OUTPUT_WAIT_S)
        return None

    def _unread(self) -> tuple[int, int]:
        """Bytes written to stdout and to stderr that their pipes hold still. (One poll first: it costs a
        fifth of the two ioctls that count them, and a call that printed nothing needs no more.)"""
        held = {1: 0, 2: 0}
        for fd, _ in self.holding.poll(0):
            stream = 1 if fd == self.pipes[1] else 2
            try:
                held[stream] = int.from_bytes(fcntl.ioctl(fd, termios.FIONREAD, b"\0\0\0\0"), sys.byteorder)
            except OSError:
                pass
        return held[1], held[2]

    def set_enabled(self, on: bool) -> None:
        """Forward what is written from now on (``on``), or leave it on the proc's own terminal."""
        from ..transport.logs import StreamLines

        mark = StreamLines.MARK_OF[on]
        sys.stdout.flush()
        sys.stderr.flush()
        for stream in (1, 2):
            if self.flushed:  # fds 1 and 2 are the terminal's again: no pump reads a switch any more
                self.enabled[stream] = on
                continue
            try:
                os.write(stream, mark)
            except OSError:
                self.enabled[stream] = on

    def _emit(self, stream: int, lines: list[bytes], on: bool) -> None:
        text = tuple(ln.decode(errors="replace") for ln in lines)
        if on:
            try:
                self.mailbox.send(self.client_addr, ForwardLogs(self.rank, stream, text))
                return
            except Exception:  # noqa: BLE001 - fall back to the inherited terminal
                pass
        os.write(self.originals[stream], ("\n".join(text) + "\n").encode())

    def flush(self, timeout: float = 2.0) -> None:
        self.flushed = True
        sys.stdout.flush()
        sys.stderr.flush()
        for stream in (1, 2):
            os.dup2(self.originals[stream], stream)  # closes the pipe's write end
        for t in self.threads:
            t.join(timeout)


class ProcRuntime:
    """The actor runtime of a proc; ``in_script``: the one a script runs on a thread of its own
    (``start_in_script``), whose actors share the script's memory."""

    def __init__(self, addr: str, client_addr: str, rank: int, in_script: bool = False) -> None:
        self.rank = rank
        self.client_addr = client_addr
        self.in_script = in_script
        self.on_exit: Callable[[], None] | None = None  # in a script: told once the runtime has stopped
        self.loop = asyncio.new_event_loop()
        self.actors: dict[str, _Slot] = {}
        self._awaiting: dict[str, tuple[asyncio.TimerHandle, list[CallEndpoint]]] = {}  # (_await_actor)
        self._handlers: dict[type, object] = {}  # message type -> its handle_X method (or None)
        # No I/O thread: the loop's own thread receives, so a call costs no thread hop here.
        self.mailbox = Mailbox(addr, on_message=self._handle, on_logs=self._relay_logs, io_thread=False)
        self.mailbox.on_deferred = self._defer
        self.mailbox.on_blocked_turn = self._blocked_turn
        self.mailbox.blocked_wake_fd = self.loop._ssock.fileno()
        self.mailbox.after_waits = self._after_waits
        self._held_stop: StopProc | None = None  # one that came while the loop's thread blocked in a wait
        self._stopping = False  # a StopProc is being handled
        self._skipped = asyncio.Handle(_nothing, (), self.loop)  # a cancelled callback: the loop skips it
        self._skipped.cancel()
        self.mailbox.on_held = self._wake_for_held
        self.mailbox.on_lost_spawn = self._spawn_lost
        self.logs: _LogForwarder | None = None
        if in_script:  # the script's threads keep its own mailbox; this one is its thread's (_bind_thread).
            # Its output is the script's own, and its loop never polls (a spinning thread would take the GIL
            # from the script's).
            self.mailbox._spin = _mailbox_mod.Spin(self.mailbox._router, 0.0)
            self.mailbox.wake_waiter = self.loop._write_to_self
        else:
            set_current_mailbox(self.mailbox)
            self.mailbox.set_up(client_addr)  # behind a host agent: what goes to the client goes up through it
            self.logs = _LogForwarder(self.mailbox, client_addr, rank)
            if self.logs.counts is not None:  # relayed: counted without waiting, so once per frame as it leaves
                self.mailbox.output_mark = self.output_before
            else:  # pumps: each reply waits for them before it is sent, so that their lines go first
                self.mailbox.output_before = self.output_before
        # The loop polls for the next message only while each of these says the proc is otherwise idle
        # (a tensor worker's streams computing need the cores more than the next message does).
        self.spin_gates: list[Callable[[], bool]] = []
        # Interrupts (InterruptCall): the synchronous call running on the loop now, the one to interrupt, and
        # the reply ports of calls interrupted here (their error says so).
        self.loop_ident: int | None = None  # (the loop's thread, once it runs)
        self.sync_call: CallEndpoint | None = None
        self.thread_state: list | None = None  # [state, what it replaced]: the actor thread state in place
        self.interrupting: CallEndpoint | None = None
        self.interrupted: set = set()

    def output_before(self, addr: str) -> tuple | None:
        """For a value about to be sent to ``addr``: what of this proc's output must reach ``addr`` first (see
        ``_LogForwarder.before_reply``). Only its client prints it: for anyone else, nothing."""
        return self.logs.before_reply() if addr == self.client_addr and self.logs is not None else None

    def _relay_logs(self, msg: ForwardLogs) -> None:
        # Logs of procs this proc spawned go up to our own client.
        self.mailbox.send(self.client_addr, msg)

    def _defer(self, msg: object) -> None:
        """A message that came while an endpoint blocks waiting for a reply."""
        if (isinstance(msg, CallEndpoint) and msg.actor in self.actors) or isinstance(msg, SpawnActor):
            # a call runs now unless its actor is the busy one (then it queues); a spawn: an endpoint that
            # spawns a sibling here and waits for it. Either runs in its own actor's thread state, not the
            # waiting one's.
            in_state = _thread_state.leave(self)
            try:
                self._handle(msg)
            finally:
                _thread_state.resume(self, in_state)
        else:
            self.loop.call_soon(self._handle, msg)

    def _blocked_turn(self) -> float | None:
        """One turn of this proc's event loop, run from inside the callback that blocks it: an endpoint waiting
        with ``.get()`` (``Mailbox.wait_until``). What the wait may need runs meanwhile, as it would on a loop
        left free: async endpoints and tasks of other actors, timers, messages. Returns the seconds until the
        loop has more to do (0: now; None: nothing scheduled).

        The blocked callback's own pass of the loop goes on popping the callbacks that were ready when it began,
        once this returns: those this turn ran are replaced by cancelled ones, which it skips. A task that runs
        the blocked callback is set aside meanwhile (asyncio runs one task at a time per loop). A debugger that
        traces this thread (a rank paused at ``breakpoint()``, waiting for its next command) does not trace
        the turn: it would stop in the other actors' code."""
        tracer = sys.gettrace()
        debugged = isinstance(getattr(tracer, "__self__", None), bdb.Bdb)
        if debugged:
            sys.settrace(None)
        loop, ready = self.loop, self.loop._ready
        owed = len(ready)
        task = asyncio.current_task(loop)
        if task is not None:
            asyncio.tasks._leave_task(loop, task)
        sync_call = self.sync_call
        in_state = _thread_state.leave(self)  # (the waiting actor's thread state: not the other calls')
        reader = self._lend_reader()
        hidden = _get_running_loop() is None  # (a sync endpoint's wait: what the turn runs sees the loop)
        if hidden:
            _set_running_loop(loop)
        try:
            loop.call_soon(_nothing)  # (so that the turn's look for I/O does not block)
            loop._run_once()
        finally:
            if hidden:
                _set_running_loop(None)
            self.sync_call = sync_call
            _thread_state.resume(self, in_state)
            if reader is not None:
                self._restore_reader(*reader)
            if task is not None:
                asyncio.tasks._enter_task(loop, task)
            if debugged and sys.gettrace() is None:
                sys.settrace(tracer)
            if len(ready) < owed:
                ready.extendleft(self._skipped for _ in range(owed - len(ready)))
        if any(not h._cancelled for h in ready):
            return 0.0
        timers = loop._scheduled
        return max(0.0, timers[0]._when - loop.time()) if timers else None

    def _lend_reader(self) -> tuple[asyncio.Handle, asyncio.Handle] | None:
        """For a turn of the loop run from inside a callback (the wait may be inside the mailbox's reader): the
        loop runs a reader's callback in the context the reader was registered with, and a context cannot be
        entered twice, so the turn gets a reader of its own (the same ``_drain``). Returns (the reader to put
        back, the one lent)."""
        selector, fd = self.loop._selector, self.mailbox.fd
        try:
            key = selector.get_key(fd)
        except KeyError:  # (the proc is stopping: no reader)
            return None
        reader, writer = key.data
        if reader is None:
            return None
        lent = asyncio.Handle(self._drain, (), self.loop)
        selector.modify(fd, key.events, (lent, writer))  # (same events: no system call)
        return reader, lent

    def _restore_reader(self, reader: asyncio.Handle, lent: asyncio.Handle) -> None:
        selector, fd = self.loop._selector, self.mailbox.fd
        try:
            key = selector.get_key(fd)
        except KeyError:
            return
        if key.data[0] is lent:  # (not replaced or removed meanwhile)
            selector.modify(fd, key.events, (reader, key.data[1]))

    def _after_waits(self) -> None:
        """The loop's thread no longer blocks in a wait: a ``StopProc`` that came meanwhile runs now."""
        msg, self._held_stop = self._held_stop, None
        if msg is not None:
            self.loop.call_soon(self._handle, msg)

    def run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.mailbox.receiver_ident = self.loop_ident = threading.get_ident()
        self.loop.add_reader(self.mailbox.fd, self._drain)
        self.loop.call_soon(self.mailbox.drain)
        loop_threads.add(self.loop_ident)
        try:
            self.loop.run_forever()
        finally:
            loop_threads.discard(self.loop_ident)

    def _bind_thread(self) -> None:
        """In a script: the calling thread (the loop's, a constructor's) is this runtime's, and its code uses
        this runtime's mailbox and sees this runtime as ``current_runtime()``; the script's threads do not."""
        if self.in_script:
            _mailbox_mod.bind_thread(self.mailbox)
            _thread.runtime = self

    def _drain(self) -> None:
        """The loop's reader: handle what came; then, while nothing else is ready to run on the loop,
        poll for the next message a while before the loop blocks (``mailbox.Spin``): in a loop of
        synchronous calls the next one comes within a few tens of µs of the reply."""
        mb, spin = self.mailbox, self.mailbox._spin
        woke = time.perf_counter()
        came = mb.drain()  # (not every wake-up of zmq's descriptor is a message)
        if came:
            spin.woke(woke)
        ready = getattr(self.loop, "_ready", None)  # asyncio's queue of callbacks due now (async endpoints)
        gates = self.spin_gates
        while came and not ready and all(idle() for idle in gates) and self._spin_poll():
            mb.drain()

    def _spin_poll(self) -> bool:
        with self.mailbox._rx_lock:
            return self.mailbox._spin.poll()

    def _wake_for_held(self) -> None:
        """Another thread received messages for this one while it was busy (``Mailbox.receive_for``)."""
        try:
            self.loop.call_soon_threadsafe(self._drain)
        except RuntimeError:  # the loop closed: the proc is stopping
            pass

    def _handle(self, msg: object) -> None:
        handler = self._handlers.get(type(msg))
        if handler is None:
            handler = self._handlers[type(msg)] = getattr(self, f"handle_{type(msg).__name__}", None)
        if handler is None:
            log.warning("proc %d dropped unknown message %s", self.rank, type(msg).__name__)
            return
        try:
            handler(msg)
        except Exception as e:  # its sender hears of it, and does not wait forever
            if not self.mailbox.fail_reply(msg, e):
                raise

    # ---- handlers, one per message ------------------------------------------
    def handle_SpawnActor(self, msg: SpawnActor) -> None:
        msg = self._placed(msg)
        shape: Shape = msg.shape
        point = shape.point(msg.rank) if len(shape.names) else Point(0, {})
        old = self.actors.get(msg.name)
        # One whose constructor failed, or that was stopped, may be spawned again; so may one whose stop was
        # acknowledged while its constructor still ran (it stops once that returns, under its old slot).
        if old is not None and old.init_error is None and not old.stop_done and \
                not (old.stopped is not None and old.initializing):
            err = ValueError(f"an actor named {actor_label(msg.name)!r} already runs on proc {self.rank}: spawn it under "
                             f"another name (the running one keeps its state)")
            self._reply(msg.reply, None, ActorError(msg.name, point.rank, "__init__", repr(err), "", err),
                        point.rank)
            return
        ctx = _context.ActorContext(msg.name, point, self.rank, sizes=shape.sizes, loop=self.loop, runtime=self)
        ctx.proc_mesh_bytes = msg.proc_mesh
        owner = msg.reply.addr
        slot = _Slot(msg.name, None, ctx, owner=owner[len(GATHER_PREFIX):] if owner.startswith(GATHER_PREFIX) else owner)
        slot.busy = slot.initializing = True  # its calls queue until the constructor has returned
        self.actors[msg.name] = slot
        timer, calls = self._awaiting.pop(msg.name, (None, ()))
        if timer is not None:
            timer.cancel()
        for call in calls:
            self.handle_CallEndpoint(call)
        if msg.args_by_engine:  # constructed when the engine's call of __init__ brings the arguments (fill)
            slot.pending_init = msg
            return
        self._start_construct(slot, msg)

    def _placed(self, msg: SpawnActor) -> SpawnActor:
        """A spawn sent to the whole mesh at once (``ranks``) as this proc's own: its place in the mesh."""
        if msg.ranks is None:
            return msg
        if self.rank not in msg.ranks:
            raise ValueError(f"a spawn of actor {actor_label(msg.name)!r} reached proc rank {self.rank}, which is not among its "
                             f"procs' ranks")
        return dataclasses.replace(msg, rank=msg.ranks.index(self.rank), ranks=None)

    def _start_construct(self, slot: _Slot, msg: SpawnActor) -> None:
        if isinstance(msg.cls, str):  # the class by its path (its spawner did not import it): imported here
            try:
                msg = dataclasses.replace(msg, cls=_names.resolve(msg.cls))
                if not isinstance(msg.cls, type):
                    raise TypeError(f"{msg.cls!r} is not a class")
            except Exception as e:  # noqa: BLE001 - as a constructor that raised: its callers hear of it
                err = ActorError(msg.name, slot.ctx.rank.rank, "__init__", repr(e), traceback.format_exc(), _picklable(e))
                self._constructed(slot, msg, None, err)
                return
        if getattr(msg.cls, "_init_on_loop", False):  # the runtime's own actors whose place in message order
            self._construct(slot, msg, inline=True)  # matters (the tensor engine's worker: see TensorWorker)
            return
        # The constructor runs on a thread of its own, as Monarch's: one that blocks (for ever, even) leaves the
        # other actors of this proc serving.
        threading.Thread(target=self._construct, args=(slot, msg), daemon=True,
                         name=f"monarch-init-{actor_label(msg.name)}").start()

    def _construct(self, slot: _Slot, msg: SpawnActor, inline: bool = False) -> None:
        """The constructor's thread (or, ``inline``, the loop's): runs it, then hands the result to the loop
        (``_constructed``)."""
        if not inline:
            self._bind_thread()
            _threads.adopt()
        token = _context.enter(slot.ctx)
        instance, err = None, None
        device = _cuda_device()
        try:
            instance = msg.cls(*msg.args, **msg.kwargs)
        except BaseException as e:  # noqa: BLE001 - the constructor is user code
            err = ActorError(msg.name, slot.ctx.rank.rank, "__init__", repr(e), traceback.format_exc(), _picklable(e))
        finally:
            _context.leave(token)
        if inline:
            self._constructed(slot, msg, instance, err)
            return
        after = _cuda_device()  # torch.cuda.set_device() in the constructor: its endpoints' device too
        device = after if after is not None and after != (device or 0) else None
        state = None
        if err is None:
            try:
                state = _thread_state.capture()
            except Exception:  # the actor is made all the same; say what it will not see
                log.warning("actor %s: the thread state its __init__ left could not be kept for its endpoints",
                            msg.name, exc_info=True)
        try:
            self.loop.call_soon_threadsafe(self._constructed, slot, msg, instance, err, _thread_locals(instance),
                                           device, state)
        except RuntimeError:  # the loop closed: the proc stops
            pass

    def _constructed(self, slot: _Slot, msg: SpawnActor, instance: object, err: ActorError | None,
                     carried: tuple = (), device: int | None = None,
                     state: _thread_state.ActorThreadState | None = None) -> None:
        slot.thread_state = state
        for local, values in carried:  # (on the loop's thread, where its endpoints run)
            local.__dict__.update(values)
        if device is not None:
            try:
                sys.modules["torch"].cuda.set_device(device)
            except Exception:  # the constructor's own call worked: say why this one did not
                log.warning("actor %s: could not make CUDA device %d, which its __init__ set, current for its "
                            "endpoints", msg.name, device, exc_info=True)
        slot.instance = slot.ctx.instance = instance
        slot.init_error = err
        slot.busy = slot.initializing = False
        self._reply(msg.reply, None, err, slot.ctx.rank.rank)
        while slot.done_events:  # (a constructor the tensor engine called: its stream waits for it)
            slot.done_events.pop().set()
        self._pump(slot)

    def _engine_init(self, slot: _Slot, entry: Reserved, msg: CallEndpoint, error: BaseException | None) -> None:
        """The tensor engine's call of ``__init__`` for a spawn whose arguments held mesh tensors: construct the
        actor with this rank's tensors (or fail its spawn with ``error``); the engine's stream waits for it."""
        spawn, slot.pending_init = slot.pending_init, None
        if entry in slot.queue:
            slot.queue.remove(entry)
        slot.done_events.append(entry.done)
        if error is not None:
            err = error if isinstance(error, ActorError) else ActorError(
                slot.name, slot.ctx.rank.rank, "__init__", getattr(error, "exc_repr", None) or repr(error),
                getattr(error, "traceback", "") or "", _picklable(error))
            self._constructed(slot, spawn, None, err)
            return
        self._start_construct(slot, dataclasses.replace(spawn, args=msg.args, kwargs=msg.kwargs))

    def _spawn_lost(self, msg: SpawnActor, error: BaseException) -> None:
        """A SpawnActor that could not be unpickled here (an argument's class this proc cannot import, a
        reducer that raises): calls to the actor fail with that error, as for a constructor that raised,
        rather than wait for a spawn that never comes and then say none was made."""
        try:
            msg = self._placed(msg)
            name, shape = msg.name, msg.shape
            point = shape.point(msg.rank) if len(shape.names) else Point(0, {})
            sizes = shape.sizes
        except Exception:  # noqa: BLE001 - not even its name could be read: its caller hears of it all the same
            return
        if not isinstance(name, str) or name in self.actors:
            return
        slot = _Slot(name, None, _context.ActorContext(name, point, self.rank, sizes=sizes, loop=self.loop, runtime=self))
        slot.init_error = ActorError(name, point.rank, "__init__", repr(error), "", error)
        self.actors[name] = slot
        timer, calls = self._awaiting.pop(name, (None, ()))
        if timer is not None:
            timer.cancel()
        for call in calls:
            self.handle_CallEndpoint(call)

    def handle_CallEndpoint(self, msg: CallEndpoint) -> None:
        if msg.reply is not None and not isinstance(msg.reply, PortRef):  # (nowhere to answer: not run)
            log.warning("proc %d dropped a call of %r: its reply port is a %s, not a PortRef", self.rank,
                        msg.method, type(msg.reply).__name__)
            return
        slot = self.actors.get(msg.actor)
        if slot is None:
            self._await_actor(msg)
            return
        if slot.stopped is not None:
            self._reply(msg.reply, None, self._stopped_error(slot, msg.method), slot.ctx.rank.rank)
            return
        slot.queue.append(msg)
        if not slot.busy:
            self._pump(slot)

    def _await_actor(self, msg: CallEndpoint) -> None:
        """A call to an actor this proc does not have: it waits ``UNKNOWN_ACTOR_WAIT_S`` for the actor's spawn,
        then fails. The spawner's ``SpawnActor`` and a call from anyone else have no order between them: a
        mesh just spawned, handed to another actor, may bring that actor's call here first."""
        waiting = self._awaiting.get(msg.actor)
        if waiting is None:
            timer = self.loop.call_later(UNKNOWN_ACTOR_WAIT_S, self._no_such_actor, msg.actor)
            waiting = self._awaiting[msg.actor] = (timer, [])
        waiting[1].append(msg)

    def _no_such_actor(self, name: str) -> None:
        for msg in self._awaiting.pop(name, (None, ()))[1]:
            err = ActorError(name, -1, msg.method, f"no actor named {actor_label(name)!r} on proc {self.rank} (none was spawned "
                             f"within {UNKNOWN_ACTOR_WAIT_S:g} s of the call)", "")
            self._reply(msg.reply, None, err, -1)

    def reserve(self, actor: str) -> Reserved:
        """A place for a call to ``actor`` behind the calls queued so far (on the loop thread)."""
        entry = Reserved()
        slot = self.actors.get(actor)
        if slot is not None and slot.stopped is None:  # (a stopped actor's call fails at fill(), with the reason)
            slot.queue.append(entry)
        return entry

    def fill(self, actor: str, entry: Reserved, msg: CallEndpoint | None, error: BaseException | None) -> None:
        """Runs ``msg`` (or replies ``error`` to it) in ``entry``'s place (on the loop thread)."""
        entry.msg, entry.error, entry.ready = msg, error, True
        slot = self.actors.get(actor)
        if slot is not None and slot.pending_init is not None and msg is not None and msg.method == "__init__":
            self._engine_init(slot, entry, msg, error)
            return
        if slot is None or entry not in slot.queue:  # no such actor: the call gets handle_CallEndpoint's error
            self._settle(entry)
            return
        if not slot.busy:
            self._pump(slot)

    def _settle(self, entry: Reserved) -> None:
        """Runs a reserved call whose actor does not exist (anymore)."""
        try:
            if entry.error is not None:
                self._reply(entry.msg.reply, None, entry.error, -1)
            else:
                self.handle_CallEndpoint(entry.msg)
        finally:
            entry.done.set()

    def handle_SetLogging(self, msg: SetLogging) -> None:
        if self.logs is not None:  # (in a script, its actors write to the script's own streams)
            self.logs.set_enabled(msg.stream_to_client)
        logging.getLogger().setLevel(msg.level)
        self._reply(msg.reply, None, None, self.rank)

    def handle_KnowPeers(self, msg: KnowPeers) -> None:
        from ..transport import _curve

        for addr, public, secret in msg.peers:
            _curve.remember_peer(addr, _curve.JobKeys(public, secret))
        self.mailbox.relayed.update(msg.relayed)

    def handle_StopActor(self, msg: StopActor) -> None:
        """Stop an actor (``ActorMesh.stop``) in order with its calls: those that came before run (an async
        one is not cancelled, as calls are not), then its concurrent endpoints are cancelled and its
        ``__cleanup__`` runs; every call that comes after fails with the reason. The ack goes then."""
        slot = self.actors.get(msg.name)
        if slot is None or slot.stopped is not None:
            self._reply(msg.reply, None, None, self.rank)
            return
        slot.stopped = msg.reason
        if slot.initializing:  # a constructor may never return: the stop is acknowledged now, and the calls
            # that came before it, then __cleanup__, run once it has returned
            self._reply(msg.reply, None, None, self.rank)
            msg = StopActor(msg.name, msg.reason, None)
        slot.queue.append(msg)
        if not slot.busy:
            self._pump(slot)

    def _finish_stop(self, slot: _Slot, msg: StopActor) -> None:
        slot.stop_done = True
        for task in list(slot.tasks):
            task.cancel()
        _cleanup(slot)
        slot.instance = None
        rank = slot.ctx.rank.rank
        for entry in list(slot.queue):  # (places reserved before the stop came, filled after it)
            if type(entry) is Reserved and entry.ready and entry.msg is not None:
                self._reply(entry.msg.reply, None, entry.error or self._stopped_error(slot, entry.msg.method), rank)
                entry.done.set()
        slot.queue.clear()  # (a place not filled yet: fill() finds it gone and answers the call then)
        self._reply(msg.reply, None, None, self.rank)

    def abort_actor(self, name: str, reason: str | None) -> None:
        """``context().actor_instance.abort(reason)`` in actor ``name``: it stops as ``ActorMesh.stop`` stops it
        (after the running call), the calls queued to it fail with the abort, and its owner is told."""
        slot = self.actors.get(name)
        if slot is None or slot.stopped is not None:
            return
        text = reason if reason else "no reason provided"
        rank = slot.ctx.rank.rank
        cls = type(slot.instance).__name__
        err = ActorAbortedError(f"actor {actor_label(name)} ({cls}) rank {rank} on proc {self.rank} aborted: {text}",
                                actor=name, rank=rank, proc=self.mailbox.addr)
        self._kill_actor(slot, err, f"aborted: {text}")

    def _endpoint_killed(self, slot: _Slot, msg: CallEndpoint, e: BaseException, explicit: bool) -> bool:
        """Whether ``e``, raised by the call ``msg``, kills its actor, as in Monarch: a ``BaseException`` that is
        not an ``Exception`` (``SystemExit``, a custom one; not a cancellation, nor the interrupt its caller
        asked for), or any exception out of an endpoint with an explicit response port (its caller waits on
        the port, not on the endpoint's return). Then the call fails with an ``ActorFailedError`` (a
        ``SupervisionError``), the actor stops as ``abort`` stops it, and its owner's supervision is told."""
        if msg.reply is not None and msg.reply in self.interrupted:
            return False
        if not explicit and isinstance(e, (Exception, asyncio.CancelledError)):
            return False
        if slot.stopped is not None:  # (it stopped meanwhile, aborted by the endpoint itself say): as any error
            return False
        info = self._error(slot, msg, e)
        method = msg.method.partition("/")[0]
        why = "with an explicit response port" if explicit and isinstance(e, Exception) else "a BaseException"
        err = ActorFailedError(
            f"The actor {actor_label(slot.name)} and all its descendants have failed: {type(slot.instance).__name__} "
            f"rank {info.rank} on proc {self.rank}: endpoint {actor_label(slot.name)}.{method} ({why}) raised {info.exc_repr}",
            actor=slot.name, rank=info.rank, proc=self.mailbox.addr, traceback=info.traceback,
            exception=info.exception)
        # Its owner is told first, and the caller is answered once the owner has it (as in Monarch: the owner
        # hears of the death no later than the caller, whose reply may prompt a look at it).
        then = None if msg.reply is None else (lambda: self._reply(msg.reply, None, err, info.rank))
        self._kill_actor(slot, err, str(err), then)
        return True

    def _kill_actor(self, slot: _Slot, err: ActorFailedError, reason: str,
                    then: Callable[[], None] | None = None) -> None:
        """``slot``'s actor stops with the failure ``err``: the calls queued to it fail with it, later ones with
        ``reason``; its ``__cleanup__`` runs once the running call returns, and its owner is told. ``then``
        runs once the owner has the failure (``_FaultAck``)."""
        name, rank = slot.name, slot.ctx.rank.rank
        slot.stopped = reason
        queued = list(slot.queue)
        slot.queue.clear()  # (in place: a _pump running now holds this deque)
        for entry in queued:
            if type(entry) is StopActor:
                self._reply(entry.reply, None, None, self.rank)
            elif type(entry) is Reserved:
                if entry.ready and entry.msg is not None:
                    self._reply(entry.msg.reply, None, err, rank)
                    entry.done.set()
                # (a place not filled yet: fill() finds it gone, and the stopped actor answers the call then)
            elif type(entry) is not _Gate:  # (a gate: its __supervise__ goes on, and finds it gone)
                self._reply(entry.reply, None, err, rank)
        slot.queue.append(StopActor(name, slot.stopped, None))  # cleanup once the running call returns
        self.loop.call_soon_threadsafe(self._pump, slot)
        owner = slot.owner or self.client_addr
        if then is None:
            self.mailbox.send(owner, ActorFault(self.mailbox.addr, err))
            return
        ack = _FaultAck(self, owner, then)
        port = self.mailbox.open_port(ack)
        ack.port_id = port.port_id
        try:
            self.mailbox.send(owner, ActorFault(self.mailbox.addr, err, port))
        except BaseException:
            ack.fire()  # the caller is answered all the same
            raise

    def supervise_in_order(self, ctx: _context.ActorContext, handler: Callable, err: BaseException,
                           timeout: float):
        """Run ``handler`` (actor ``ctx``'s ``__supervise__``) with ``err`` on this runtime's loop, in order
        with the messages the actor receives: a message that comes after the failure sees its effects. A
        sync one runs now (on the loop's thread, as the fault is received) or as soon as the loop is free,
        as ``__supervise__`` has always run: beside a running async endpoint (which may wait for it), or in
        a wait of a blocked sync one. An async one starts so, and the actor's queued calls wait for it to
        finish (``timeout`` at most). Returns a future of what it returned (or raised), or None when the
        actor is not here."""
        slot = self.actors.get(ctx.actor_name)
        if slot is None or slot.ctx is not ctx or self.loop.is_closed():
            return None
        done: concurrent.futures.Future = concurrent.futures.Future()
        if threading.get_ident() == self.loop_ident:
            self._supervise_now(slot, handler, err, done, timeout)
        else:
            try:
                self.loop.call_soon_threadsafe(self._supervise_now, slot, handler, err, done, timeout)
            except RuntimeError:  # (closed meanwhile)
                return None
        return done

    def _supervise_now(self, slot: _Slot, handler: Callable, err: BaseException,
                       done: concurrent.futures.Future, timeout: float) -> None:
        running = _get_running_loop()
        _set_running_loop(None)  # (a sync __supervise__ sees no running loop, as a sync endpoint)
        try:
            value = handler(err)
        except BaseException as e:  # noqa: BLE001 - user code: the supervision thread reports it
            done.set_exception(e)
            return
        finally:
            _set_running_loop(running)
        if not inspect.iscoroutine(value):
            done.set_result(value)
            return
        gate = _Gate()
        slot.queue.append(gate)

        async def supervise():
            return await asyncio.wait_for(value, timeout)

        def finished(task: asyncio.Task) -> None:
            try:
                slot.queue.remove(gate)
            except ValueError:  # (the actor stopped meanwhile)
                pass
            if task.cancelled():
                done.set_exception(RuntimeError("the async __supervise__ was cancelled (its actor stopped)"))
            elif isinstance(task.exception(), asyncio.TimeoutError):
                done.set_exception(TimeoutError(
                    f"the async __supervise__ did not finish within {timeout:g} s"))
            elif task.exception() is not None:
                done.set_exception(task.exception())
            else:
                done.set_result(task.result())
            self._pump(slot)

        self.loop.create_task(supervise()).add_done_callback(finished)

    def _stopped_error(self, slot: _Slot, method: str) -> ActorError:
        return ActorStoppedError(slot.name, slot.ctx.rank.rank, method.partition("/")[0], slot.stopped)

    def _track(self, slot: _Slot, msg: CallEndpoint, task: asyncio.Task) -> None:
        """Remember a running async call's task by its reply port, for an ``InterruptCall``."""
        if msg.reply is not None:
            slot.running[msg.reply] = task
            task.add_done_callback(lambda _t: slot.running.pop(msg.reply, None))

    def handle_InterruptCall(self, msg: InterruptCall) -> None:
        """The caller stopped waiting (Ctrl-C): drop the call if it has not started, cancel it if it runs as a
        task. (A synchronous one blocks this loop while it runs: ``_InterruptWatch`` stops that one.)"""
        port = msg.reply
        for slot in self.actors.values():
            task = slot.running.get(port)
            if task is not None:
                self.interrupted.add(port)
                task.cancel()
                return
            for entry in slot.queue:
                call = entry.msg if type(entry) is Reserved else entry
                if type(call) is CallEndpoint and call.reply == port:
                    if type(entry) is Reserved:
                        if not entry.ready:
                            continue  # (its arguments are still being made: it runs, as it cannot be taken out)
                        entry.error = ActorError(slot.name, slot.ctx.rank.rank, call.method.partition("/")[0],
                                                 "KeyboardInterrupt: the call was interrupted by its caller before "
                                                 "it started", "")
                    else:
                        slot.queue.remove(entry)
                        self._reply(port, None, ActorError(
                            slot.name, slot.ctx.rank.rank, call.method.partition("/")[0],
                            "KeyboardInterrupt: the call was interrupted by its caller before it started", ""),
                            slot.ctx.rank.rank)
                    return

    def handle_StopProc(self, msg: StopProc) -> None:
        """Stop the proc as a process that exits would stop: its running ``@concurrent_endpoint`` tasks are
        cancelled and run their cancellation to the end, then each actor's ``__cleanup__`` runs, then the
        interpreter's shutdown (``_proc_exit``: ``atexit`` hooks, finalizers); all of it within
        ``_proc_exit.EXIT_LIMIT_S``, past which the proc exits anyway."""
        if self.mailbox._waits:  # an endpoint blocked in a wait: the proc stops once it returns (_after_waits)
            self._held_stop = msg
            return
        if self._stopping:
            return
        self._stopping = True
        if not self.in_script:  # (a script's runtime stops; the script goes on)
            _proc_exit.exit_within(_proc_exit.EXIT_LIMIT_S, 0)
        tasks = [task for slot in self.actors.values() for task in slot.tasks]
        for task in tasks:
            task.cancel()
        if not tasks:
            self._stop_proc()
            return

        async def cancelled() -> None:
            await asyncio.wait(tasks, timeout=_proc_exit.EXIT_LIMIT_S / 2)
            self._stop_proc()

        self.loop.create_task(cancelled())

    def _stop_proc(self) -> None:
        for slot in list(self.actors.values()):
            if slot.instance is not None and not slot.stop_done:
                _cleanup(slot)
        self.actors.clear()
        self.shutdown(0, graceful=True)

    def shutdown(self, code: int, graceful: bool = False) -> None:
        """End the proc; ``graceful``: after the interpreter's shutdown (``_proc_exit``), while its output is
        still forwarded. A script's runtime ends its loop and its mailbox only (``_end_in_script``)."""
        if self.in_script:
            self._end_in_script()
            return
        try:
            if graceful:
                _proc_exit.run_exit_hooks()
                _proc_exit.finalize_user_modules()
            self.logs.flush()
            self.mailbox.close()
        finally:
            os._exit(code)

    def _end_in_script(self) -> None:
        """On the loop's thread: a script's runtime stops (its actors have): its mailbox closes, its loop ends
        (and with it its thread), and ``on_exit`` tells the script's side."""
        try:
            self.loop.remove_reader(self.mailbox.fd)
        except Exception:  # noqa: BLE001 - (the socket is gone already)
            pass
        try:
            self.mailbox.close()
        finally:
            _mailbox_mod.unbind(self.mailbox)
            self.loop.stop()
            if self.on_exit is not None:
                self.on_exit()

    # ---- running endpoints ----------------------------------------------------
    def _pump(self, slot: _Slot) -> None:
        q = slot.queue
        while not slot.busy:
            if not q:
                return
            msg = q[0]
            if type(msg) is StopActor:  # ActorMesh.stop, after the calls that came before it
                q.popleft()
                self._finish_stop(slot, msg)
                return
            if type(msg) is _Gate:
                return  # an async __supervise__ runs: the calls behind it wait for it
            if type(msg) is Reserved:
                if not msg.ready:
                    return  # the calls behind it wait for it
                q.popleft()
                if msg.error is not None:
                    self._reply(msg.msg.reply, None, msg.error, slot.ctx.rank.rank)
                    msg.done.set()
                else:
                    self._run(slot, msg.msg, msg.done)
                continue
            q.popleft()
            self._run(slot, msg)

    def _run(self, slot: _Slot, msg: CallEndpoint, done: threading.Event | None = None) -> None:
        """Runs one call; ``done`` (if given) is set when it has finished (after an async one's await)."""
        rank = slot.ctx.rank.rank
        if done is not None:
            task = None
            try:
                task = self._run(slot, msg)
            finally:
                if slot.busy:  # an async endpoint: done when its task ends
                    slot.done_events.append(done)
                elif task is not None:  # a concurrent endpoint: likewise, though the actor goes on meanwhile
                    task.add_done_callback(lambda _t: done.set())
                else:
                    done.set()
            return
        if slot.init_error is not None:
            self._reply(msg.reply, None, slot.init_error, rank)
            return
        method, _, plain = msg.method.partition("/")  # "name/plain", "name/port": as_endpoint() of a method
        fn = None if plain and method.startswith("_") else getattr(slot.instance, method, None)
        if fn is None or not (plain or getattr(fn, "_is_endpoint", False)) or not callable(fn):
            err = ActorError(slot.name, rank, method,
                             f"{type(slot.instance).__name__} has no {'method' if plain else 'endpoint'} {method!r}", "")
            self._reply(msg.reply, None, err, rank)
            return
        token = _context.enter(slot.ctx, msg.shape)
        args = msg.args
        explicit = plain == "port" if plain else getattr(fn, "_explicit_port", False)
        if explicit:  # @endpoint(explicit_response_port=True): the endpoint answers through a port of its own
            args = (Port(msg.reply, rank),) + tuple(args)
        try:
            is_coro = getattr(fn, "_endpoint_coro", None)  # set by @endpoint
            if is_coro is None:
                is_coro = inspect.iscoroutinefunction(fn)
            state = slot.thread_state
            if is_coro:
                if getattr(fn, "_concurrent", False):  # @concurrent_endpoint: the actor takes its next message now
                    body = fn(*args, **msg.kwargs)
                    if state is not None:
                        body = state.wrap(self, body)
                    task = self.loop.create_task(self._run_concurrent(slot, msg, body, explicit))
                    slot.tasks.add(task)
                    task.add_done_callback(slot.tasks.discard)
                    self._track(slot, msg, task)
                    task.add_done_callback(lambda t: self._concurrent_cancelled(t, slot, msg, body))
                    return task
                slot.busy = True
                body = fn(*args, **msg.kwargs)
                if state is not None:
                    body = state.wrap(self, body)
                task = self.loop.create_task(self._run_async(slot, msg, body, explicit))
                self._track(slot, msg, task)
                return
            slot.busy = True
            outer, self.sync_call = self.sync_call, msg  # (what an InterruptCall that comes meanwhile stops:
            running = _get_running_loop()  # _InterruptWatch; ``outer``: a call blocked in a wait, which ran
            _set_running_loop(None)  # this one meanwhile). A sync endpoint sees no running loop (Monarch's).
            try:
                if state is None:
                    value = fn(*args, **msg.kwargs)
                else:
                    value = state.run(self, fn, args, msg.kwargs)
            finally:
                _set_running_loop(running)
                slot.busy = False
                self.sync_call = outer
            if type(value) not in _PLAIN and inspect.isawaitable(value):  # a sync def returned a coroutine
                if state is not None:
                    value = state.wrap(self, value)
                slot.busy = True
                self._track(slot, msg, self.loop.create_task(self._run_async(slot, msg, value, explicit)))
                return
        except BaseException as e:  # noqa: BLE001 - user code
            if not self._endpoint_killed(slot, msg, e, explicit):
                self._reply(msg.reply, None, self._error(slot, msg, e), rank)
            return
        finally:
            _context.leave(token)
        if not explicit:
            self._reply(msg.reply, value, None, rank, slot, method)

    async def _run_async(self, slot: _Slot, msg: CallEndpoint, aw, explicit: bool = False) -> None:
        rank = slot.ctx.rank.rank
        try:
            value = await aw
        except BaseException as e:  # noqa: BLE001 - user code
            if not self._endpoint_killed(slot, msg, e, explicit):
                self._reply(msg.reply, None, self._error(slot, msg, e), rank)
        else:
            if not explicit:
                self._reply(msg.reply, value, None, rank, slot, msg.method.partition("/")[0])
        finally:
            slot.busy = False
            while slot.done_events:
                slot.done_events.pop().set()
            self._pump(slot)

    async def _run_concurrent(self, slot: _Slot, msg: CallEndpoint, aw, explicit: bool) -> None:
        rank = slot.ctx.rank.rank
        try:
            value = await aw
        except asyncio.CancelledError as e:
            if asyncio.current_task().cancelling() and msg.reply not in self.interrupted:
                raise  # the actor stops: _concurrent_cancelled answers
            # the user's code ended in a cancellation of its own: the caller hears of it as of any error
            if not self._endpoint_killed(slot, msg, e, explicit):
                self._reply(msg.reply, None, self._error(slot, msg, e), rank)
        except BaseException as e:  # noqa: BLE001 - user code
            if not self._endpoint_killed(slot, msg, e, explicit):
                self._reply(msg.reply, None, self._error(slot, msg, e), rank)
        else:
            if not explicit:
                self._reply(msg.reply, value, None, rank, slot, msg.method.partition("/")[0])

    def _concurrent_cancelled(self, task: asyncio.Task, slot: _Slot, msg: CallEndpoint, body) -> None:
        """A ``@concurrent_endpoint`` call's task was cancelled (the actor stops: ``ActorMesh.stop``, or the
        proc stops), maybe before it started: its caller is answered rather than left waiting for ever."""
        if not task.cancelled():
            return
        body.close()  # (one that never started: no "never awaited" warning)
        if self._stopping:  # the proc stops: its caller's wait fails as for any call pending on a stopped proc
            return  # (MeshStoppedError, a SupervisionError, where the stop is known)
        err = self._stopped_error(slot, msg.method) if slot.stopped is not None else ActorError(
            slot.name, slot.ctx.rank.rank, msg.method.partition("/")[0], "the call was cancelled as its proc "
            "stopped", "")
        self._reply(msg.reply, None, err, slot.ctx.rank.rank)

    def _error(self, slot: _Slot, msg: CallEndpoint, e: BaseException) -> ActorError:
        if msg.reply is not None and msg.reply in self.interrupted:
            self.interrupted.discard(msg.reply)
            if isinstance(e, (KeyboardInterrupt, asyncio.CancelledError)):
                return ActorError(slot.name, slot.ctx.rank.rank, msg.method.partition("/")[0],
                                  f"KeyboardInterrupt: the call was interrupted by its caller ({type(e).__name__} "
                                  f"raised in the endpoint)", "")
        tb = e.__traceback__
        if tb is not None and tb.tb_frame.f_code.co_filename == __file__:
            tb = tb.tb_next  # the user's frames only, not the runtime's
        text = "".join(traceback.format_exception(type(e), e, tb))
        try:
            shown = repr(e)
        except Exception:  # noqa: BLE001 - user code: an exception whose __repr__ raises
            shown = f"{type(e).__name__} (its repr() raised)"
        return ActorError(slot.name, slot.ctx.rank.rank, msg.method.partition("/")[0], shown, text, _picklable(e))

    def _reply(self, port, value, error, rank, slot: _Slot | None = None, method: str = "?") -> None:
        """Send ``value`` (or ``error``) to ``port``; ``slot`` and ``method``: the endpoint that made it."""
        if port is None:
            if error is not None:  # nobody awaits it (a broadcast): the supervision of its spawner hears of it
                slot = self.actors.get(getattr(error, "actor", None))
                try:
                    self.mailbox.send(slot.owner if slot is not None and slot.owner else self.client_addr,
                                      ActorFault(self.mailbox.addr, error))
                except Exception as e:  # noqa: BLE001 - e.g. an error that does not pickle: at least it is seen here
                    print(f"[monarch_tensor] unawaited error: {error} (not reported to the owner: {e!r})",
                          file=sys.stderr)
            return
        addr = port.addr
        if addr.startswith(GATHER_PREFIX):  # a call() whose replies the host agents gather (_fanout.py)
            self._reply_gathered(addr[len(GATHER_PREFIX):], port, value, error, rank, slot, method)
            return
        output = self.mailbox.output_before(addr)
        try:
            if not self.mailbox.send_plain(addr, reply_envelope(port.port_id, value, error, rank, output)):
                self.mailbox.send(addr, SendToPort(port.port_id, value, error, rank, output), batch=True)
        except Exception as e:  # noqa: BLE001 - e.g. an unpicklable result
            err = ActorError("?" if slot is None else slot.name, rank, method, f"cannot send the result back: {e!r}",
                             traceback.format_exc())
            try:
                self.mailbox.send(addr, SendToPort(port.port_id, None, err, rank, output))
            except Exception:  # noqa: BLE001 - not a usable port at all
                log.warning("proc %d cannot reply to %r: %s", self.rank, port, e)

    def _reply_gathered(self, client: str, port, value, error, rank, slot: _Slot | None, method: str) -> None:
        """``_reply`` to a gathered call of ``client``: up to this proc's host agent (``Mailbox.send_gathered``)."""
        output = self.output_before(client)
        try:
            self.mailbox.send_gathered(client, SendToPort(port.port_id, value, error, rank, output), error is not None)
        except Exception as e:  # noqa: BLE001 - e.g. an unpicklable result
            err = ActorError("?" if slot is None else slot.name, rank, method, f"cannot send the result back: {e!r}",
                             traceback.format_exc())
            try:
                self.mailbox.send_gathered(client, SendToPort(port.port_id, None, err, rank, output), True)
            except Exception:  # noqa: BLE001 - not a usable port at all
                log.warning("proc %d cannot reply to %r: %s", self.rank, port, e)


def _nothing() -> None:
    pass


# Results that are never awaitable (inspect.isawaitable's ABC check costs ~1 µs a call).
_PLAIN = frozenset({type(None), bool, int, float, str, bytes, tuple, list, dict})


def _cuda_device() -> int | None:
    """This thread's current CUDA device, where torch has initialized CUDA; else None."""
    torch = sys.modules.get("torch")
    if torch is None:
        return None
    try:
        return torch.cuda.current_device() if torch.cuda.is_initialized() else None
    except Exception:  # noqa: BLE001 - a broken CUDA set-up: nothing to carry over
        return None


def _thread_locals(instance: object) -> tuple:
    """The ``threading.local`` attributes of an actor and what its constructor's thread set in them: the loop's
    thread, where its endpoints run, sees the same (Monarch runs constructor and endpoints on one thread)."""
    try:
        attrs = getattr(instance, "__dict__", None)
        if not isinstance(attrs, dict):
            return ()
        return tuple((v, dict(v.__dict__)) for v in list(attrs.values()) if isinstance(v, threading.local))
    except Exception:  # noqa: BLE001 - an odd instance carries nothing; its construction still completes
        return ()


def _cleanup(slot: _Slot) -> None:
    """An actor's ``__cleanup__`` as it stops: Monarch's ``__cleanup__(self, exc)``, ``exc`` None on a normal
    stop (one of no arguments works too); an ``async def`` one runs to its end on a loop of its own (this
    thread runs the proc's), in the actor's context. Its error is printed; the actor stops all the same. Then
    the meshes it spawned stop (``_stop_owned``)."""
    stop = getattr(slot.instance, "__cleanup__", None)
    if not callable(stop):
        _stop_owned(slot.ctx)
        return
    token = _context.enter(slot.ctx)
    try:
        try:
            takes_exc = bool(inspect.signature(stop).parameters)
        except (TypeError, ValueError):
            takes_exc = False
        running = _get_running_loop()
        _set_running_loop(None)  # (a sync one sees no running loop, as a sync endpoint does)
        try:
            result = stop(None) if takes_exc else stop()
        finally:
            _set_running_loop(running)
        if inspect.isawaitable(result):
            from ..future import run_to_end

            run_to_end(result)
    except Exception:  # noqa: BLE001 - user code
        traceback.print_exc()
    finally:
        _context.leave(token)
        _stop_owned(slot.ctx)


def _stop_owned(ctx: _context.ActorContext) -> None:
    """The meshes an actor spawned stop with it, after its ``__cleanup__`` (Monarch's ownership): its actor
    meshes, on whichever procs, then its proc meshes; the last spawned first. Nothing waits for them here."""
    owned, ctx.owned_meshes = ctx.owned_meshes, []
    for mesh in reversed(owned):
        try:
            mesh.stop(f"its owner, actor {ctx.name}, stopped")
        except Exception:  # (stopped already, its procs gone: nothing left to stop)
            log.debug("stopping a mesh of actor %s", ctx.name, exc_info=True)


def _point_in(shape: Shape, rank: int) -> Point | None:
    """Where rank ``rank`` of an actor mesh lies in its slice ``shape`` (None: it is not in it)."""
    try:
        return shape.point(shape.index_of(rank))
    except (ValueError, IndexError):
        return None


def _picklable(e: BaseException) -> BaseException | None:
    """``e`` if it survives the trip to the caller as messages make it (an exception class of the script's
    ``__main__`` travels by value), else None."""
    from ..transport import _wire

    try:
        _wire.decode(_wire.encode(e))
        return e
    except Exception:  # noqa: BLE001
        return None


class _InterruptWatch:
    """A synchronous endpoint runs on the proc's loop, which receives nothing meanwhile, so an ``InterruptCall``
    for it would wait until it returned. This thread looks each tick at whether one synchronous call has run
    for a whole tick; then it receives what waits on the socket (held for the loop, as ``Mailbox._help``
    does) and, finding an ``InterruptCall`` for that call, raises ``KeyboardInterrupt`` in it: SIGINT to the
    loop's thread (which breaks a blocking sleep or read), whose handler raises only for that call. A call
    still running ``NATIVE_S`` later is in code that does not return to Python: the proc says so once."""

    TICK_S = 0.2
    NATIVE_S = 3.0

    def __init__(self, rt: ProcRuntime) -> None:
        self.rt = rt
        threading.Thread(target=self._run, daemon=True, name="monarch-interrupt-watch").start()

    def _run(self) -> None:
        rt, mb = self.rt, self.rt.mailbox
        last, fired_at, told = None, 0.0, None
        while not mb._closed:
            time.sleep(self.TICK_S)
            call = rt.sync_call
            if call is None or call is not last:
                last = call
                continue
            if rt.interrupting is call or call is told:
                if call is not told and time.monotonic() - fired_at > self.NATIVE_S:
                    told = call
                    print(f"monarch_tensor: the interrupted call {call.actor}.{call.method.partition('/')[0]} is "
                          f"still running, in native code that does not return to Python; this proc takes its next "
                          f"calls once it returns", file=sys.stderr, flush=True)
                continue
            mb._help(True)
            if self._take_interrupt(call):
                rt.interrupted.add(call.reply)
                rt.interrupting, fired_at = call, time.monotonic()
                try:
                    signal.pthread_kill(rt.loop_ident, signal.SIGINT)
                except (OSError, ValueError, AttributeError):
                    pass

    def _take_interrupt(self, call: CallEndpoint) -> bool:
        """Whether an InterruptCall for ``call`` waits among the held messages (it is taken out)."""
        mb = self.rt.mailbox
        if call.reply is None:
            return False
        with mb._rx_lock:
            for i, (m, unreadable) in enumerate(mb._held):
                if unreadable is None and type(m) is InterruptCall and m.reply == call.reply:
                    del mb._held[i]
                    return True
        return False


def _on_sigint(signum, frame) -> None:
    """SIGINT in a proc: ``KeyboardInterrupt`` in the synchronous call that its caller interrupted (see
    ``_InterruptWatch``); any other SIGINT is ignored (a proc is no terminal's foreground job)."""
    rt = _runtime
    if rt is not None and rt.interrupting is not None and rt.interrupting is rt.sync_call:
        rt.interrupting = None
        raise KeyboardInterrupt("the call was interrupted by its caller")


_runtime: ProcRuntime | None = None  # this proc's (None in a script)


class _ThreadRuntime(threading.local):
    runtime: ProcRuntime | None = None  # set on the threads of a script's in-process runtime (_bind_thread)


_thread = _ThreadRuntime()


def current_runtime() -> ProcRuntime | None:
    """The runtime whose actors the calling thread runs: this proc's, or, on a thread of a script's
    in-process runtime, that one (``in_script``); None on the script's own threads."""
    return _thread.runtime or _runtime


def start_in_script(addr: str, on_exit: Callable[[], None] | None = None) -> ProcRuntime:
    """Start an actor runtime in this script's process, at ``addr``, on a daemon thread of its own with its own
    mailbox and event loop: actors spawned there run as on a proc and share the script's memory. Its
    ``client_addr`` is the script's mailbox (what reaches it for the script, it passes on there).
    ``on_exit`` runs once it stopped (a ``StopProc``: its actors' ``__cleanup__`` ran)."""
    from ..transport import _wire
    from ..transport.mailbox import current_mailbox

    client = current_mailbox()
    rt = ProcRuntime(addr, client.addr, 0, in_script=True)
    _hooks.load()  # (the tools' modules: their messages are answered here as on a proc)
    _actor_logs.ActorLogFilter.install()  # (records its actors write carry their identity, as on a proc)
    rt.on_exit = on_exit
    _wire.IN_PROCESS.update((addr, client.addr))  # (messages between them refer to __main__ by reference)
    started = threading.Event()

    def main() -> None:
        rt._bind_thread()
        rt.loop.call_soon(started.set)
        try:
            rt.run()
        finally:
            _wire.IN_PROCESS.discard(addr)
            rt.loop.close()

    threading.Thread(target=main, daemon=True, name="monarch-tensor-actors").start()
    if not started.wait(30):
        raise RuntimeError("the script's in-process actor runtime did not start within 30 s")
    return rt


def run_proc(addr: str, client_addr: str, rank: int) -> None:
    """Entry point of a forked proc (called by the zygote)."""
    global _runtime
    from . import _bind, _threads

    _bind.apply_from_env()  # before any other thread starts: they inherit it
    _threads.apply_from_env()  # (after the binding: a bound proc's share is of its own CPUs)
    if "torch" in sys.modules and not setting("MONARCH_TENSOR_NO_WARMUP"):  # (the script uses torch)
        _zygote.finish_preload(_zygote._modules("MONARCH_TENSOR_IDLE_PRELOAD"))
    _proc_exit.forget_inherited_hooks()
    rt = _runtime = ProcRuntime(addr, client_addr, rank)
    try:
        signal.signal(signal.SIGINT, _on_sigint)
    except ValueError:  # not the main thread: interrupts reach async endpoints only
        pass
    else:
        _InterruptWatch(rt)
    _hooks.start(rt)  # the tools' modules and start hooks (workspace dirs on sys.path, breakpoint() hook)
    _actor_logs.ActorLogFilter.install()
    _say_started()
    rt.run()


def _say_started() -> None:
    """Tell the template this proc started, its mailbox bound: its spawn waits for that (a proc that dies
    before is the spawn's error, not a supervision failure: ``host.LocalHost.spawn``)."""
    fd = take(_zygote.STARTED_ENV)
    if fd:
        os.write(int(fd), b"1")
        os.close(int(fd))
