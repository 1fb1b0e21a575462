"""The tensor worker: the instruction interpreter that runs on every proc of a mesh.

``TensorWorker`` is an actor, spawned lazily on a mesh's procs the first time
the controller records work there. Its ``execute`` endpoint receives a batch of
instructions (``worker/messages.py``) and queues each on its stream; every
stream is a thread (plus a CUDA stream on GPU) that runs ``handle_X`` for each
instruction ``X`` in order, so message handling never blocks on torch work.

Errors are values: a failing instruction stores a ``RemoteException`` in its
outputs (and in the tensors it mutates); an instruction that reads one stores
the same exception without running. Nothing an instruction does kills the worker.
"""

from __future__ import annotations

import contextlib
import contextvars
import ctypes
import functools
import logging
import os
import pickle
import queue
import sys
import threading
import traceback
from typing import Any

import numpy as np
import torch

from monarch_tensor.actor import Actor, current_rank, endpoint
from monarch_tensor.config import setting
from monarch_tensor.runtime import _threads
from monarch_tensor.runtime._proc import current_runtime
from monarch_tensor.runtime._zygote import finish_preload
from monarch_tensor.transport import _wire
from monarch_tensor.transport.mailbox import LOST_REWRITES, current_mailbox
from monarch_tensor.transport.messages import CallEndpoint, SendToPort

from . import collectives, opaque
from . import messages as m
from .collectives import TIMEOUT, Collectives, restore_names
from .containers import is_dataclass_instance, rebuild
from .dummy_group import DummyProcessGroup
from .errors import RemoteException
from .interface import WORKER_NAME, flat_leaves, resolve_function
from .opaque import OpaqueRef
from .program import STRAIGHT_FILE, Program
from .shm_reduce import STEP_BITS, current, left

log = logging.getLogger("monarch_tensor.worker")

RECV_TIMEOUT = TIMEOUT
# Freed tensor memory a worker keeps for its next allocations, in MiB (0: glibc's defaults).
KEEP_FREED_MB = setting("MONARCH_TENSOR_KEEP_FREED_MB")


def keep_freed_memory(keep_mb: int = KEEP_FREED_MB) -> bool:
    """Make glibc's malloc keep freed tensor memory for reuse instead of giving it back to the kernel.

    By default glibc serves large blocks with ``mmap`` (its threshold adapts, up to 32 MiB) and trims
    free memory off its heaps, so a training step that frees its activations pays to fault the same
    pages in again in the next step: a worker's GPT step took 1,000-2,500 page faults more than eager
    torch's. Here every block up to 32 MiB comes from the heaps, up to ``keep_mb`` MiB free at a
    heap's top stays there, and a thread's heap that empties is kept (like the CUDA caching allocator,
    the process keeps its peak). Only on glibc; False where it does not apply.
    """
    try:
        glibc = os.confstr("CS_GNU_LIBC_VERSION")
    except (ValueError, OSError):  # not a glibc system
        glibc = None
    if keep_mb <= 0 or not glibc:
        return False
    M_TRIM_THRESHOLD, M_TOP_PAD, M_MMAP_THRESHOLD = -1, -2, -3
    libc = ctypes.CDLL(None)
    return all(libc.mallopt(opt, value) for opt, value in (
        (M_MMAP_THRESHOLD, 32 << 20),  # glibc's largest
        (M_TRIM_THRESHOLD, keep_mb << 20),
        (M_TOP_PAD, 64 << 20),  # a thread's 64 MiB heap that empties is kept, not unmapped
    ))


class _Propagate(Exception):
    def __init__(self, failure: RemoteException) -> None:
        self.failure = failure


@functools.lru_cache(maxsize=None)
def resolve_op(name: str):
    """``"aten::add.Tensor"`` -> ``torch.ops.aten.add.Tensor``."""
    ns, _, rest = name.partition("::")
    opname, _, overload = rest.partition(".")
    return getattr(getattr(getattr(torch.ops, ns), opname), overload or "default")


_op_calls: dict = {}


def op_call(name: str):
    """What calling the op named ``name`` calls, found once per name: an ``OpOverload``'s ``_op`` (its
    ``__call__`` is that call, less a Python frame and the three look-ups of ``resolve_op``)."""
    f = _op_calls.get(name)
    if f is None:
        op = resolve_op(name)
        f = _op_calls[name] = getattr(op, "_op", op)
    return f


WARM_UP_TIMEOUT = 600.0


def start_warm_up() -> threading.Thread | None:
    """The thread importing what DTensor work imports on first use (torch._dynamo and what it loads,
    seconds per proc), started at the proc's start if its template had not imported it yet, else now;
    None when there is nothing to import (or ``MONARCH_TENSOR_NO_WARMUP``)."""
    if setting("MONARCH_TENSOR_NO_WARMUP"):
        return None
    return finish_preload(["torch._dynamo"])


# How long a stream paused by an interrupt (TensorWorker.pause) waits for the controller's decision before it
# runs on, dropping nothing.
PAUSE_TIMEOUT = 60.0


class _Stream:
    """One stream's thread and queue. Work the script's interrupt withdrew (see TensorWorker.pause) is not
    run: an instruction with a sequence number (only those that compute: see _WITHDRAWABLE) is dropped when
    it falls in one of ``withdrawn``'s ``(after, end]`` ranges, and its results fail."""

    def __init__(self, worker: TensorWorker, sid: int, name: str) -> None:
        self.worker, self.sid, self.name = worker, sid, name
        self.q: queue.SimpleQueue = queue.SimpleQueue()
        self.puts = self.dones = 0  # each written by one thread only (the proc's loop, this stream's)
        self.started = 0  # the sequence number of the last withdrawable instruction begun
        self.paused = False  # stop before the next instruction until the controller decides (pause/withdraw)
        self.withdrawn: list[tuple[int, int]] = []
        self.cv = threading.Condition()
        # In the worker actor's context: code the stream runs (remote functions) sees its rank (current_rank()).
        self.thread = threading.Thread(target=contextvars.copy_context().run, args=(self._run,), daemon=True,
                                       name=f"tensor-stream-{name}")
        self.thread.start()

    def put(self, handler, arg, seq: int = 0) -> None:
        self.puts += 1
        self.q.put((handler, arg, seq))

    def decide(self, after: int, end: int) -> None:
        """The controller's decision after a pause: drop what falls in ``(after, end]``, run the rest."""
        with self.cv:
            if after < end:
                self.withdrawn.append((after, end))
            self.paused = False
            self.cv.notify_all()

    def _withdrawn(self, seq: int) -> bool:
        """Whether to drop the instruction ``seq`` (after waiting out a pause); on this stream's thread."""
        with self.cv:
            if self.paused and not self.cv.wait_for(lambda: not self.paused, PAUSE_TIMEOUT):
                self.paused = False
                log.warning("tensor worker: stream %s was paused for an interrupt and no decision came within %s "
                            "s; it runs on", self.name, PAUSE_TIMEOUT)
            if not seq or not self.withdrawn:
                return False
            self.withdrawn = [r for r in self.withdrawn if seq <= r[1]]
            return any(after < seq <= end for after, end in self.withdrawn)

    def idle(self) -> bool:
        return self.dones == self.puts

    def _run(self) -> None:
        w = self.worker
        _threads.adopt()
        if w.device.type == "cuda":
            torch.cuda.set_device(w.device)
            if self.sid != 0:
                torch.cuda.set_stream(torch.cuda.Stream())
        while True:
            handler, arg, seq = self.q.get()
            if handler is None:
                return
            try:
                if seq:
                    self.started = seq  # (before looking at `paused`: see TensorWorker.pause)
                if (self.paused or self.withdrawn) and self._withdrawn(seq):
                    w._drop(arg)
                    continue
                current.tag = seq << STEP_BITS  # (what its collectives through shared memory say they belong to)
                handler(arg)
            except BaseException:  # handlers store errors; this is a bug, keep serving
                log.exception("tensor worker: handler %s failed", getattr(handler, "__name__", handler))
            finally:
                self.dones += 1


_OWN_FILES = (__file__, sys.modules[Program.__module__].__file__, STRAIGHT_FILE)  # the interpreter's frames, left out of tracebacks


class TensorWorker(Actor):
    """Executes the controller's instructions on this proc (see the module docstring). Its endpoints are
    ``interface.TensorWorkerInterface``'s, by which the controller calls them."""

    # Constructed on the proc's loop, in order with the messages that follow its spawn (a user actor's
    # constructor runs on a thread of its own): the engine's calls to actors (CallActor) take their places
    # in those actors' queues in the order the controller sent them, before calls sent after them directly.
    _init_on_loop = True

    def __init__(self, store_addr: tuple[str, int] | None = None) -> None:
        self.rank = current_rank().rank
        self.mailbox = current_mailbox()
        opaque.on_worker = True  # OpaqueRef values live here
        keep_freed_memory()
        self.device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
        self.refs: dict[int, Any] = {}
        self.coll = Collectives(self.rank, store_addr, self.device)
        collectives.dead_procs = self.coll.dead  # (DTensor meshes' shared-memory collectives stop waiting for them too)
        self.inbox: dict[int, Any] = {}
        self.inbox_cv = threading.Condition()
        self.borrows: dict[int, list] = {}
        # Failures of ops with no result to hold them (``torch.linalg.cholesky``'s check of its input,
        # ``aten::_linalg_check_errors``): the next fetch from this worker raises the first, as eager torch
        # would have raised at the op, instead of the error being lost.
        self.orphan_failures: list[RemoteException] = []
        self.fetched_here = 0  # fetches answered on the loop's thread (_fetch_here)
        self.orphan_lock = threading.Lock()  # (streams' threads add them; a fetch's takes them)
        self.streams = {0: _Stream(self, 0, "main")}
        self._handlers = {cls: getattr(self, f"handle_{cls.__name__}") for cls in m.INSTRUCTIONS}
        rt = current_runtime()
        if rt is not None:  # the proc's loop polls for messages only while no stream computes
            rt.spin_gates.append(self._idle)
        self.warming = start_warm_up()

    def _idle(self) -> bool:
        return all(s.idle() for s in self.streams.values())  # on the loop thread, which alone adds streams

    # ---- endpoints (run on the proc's loop thread: queue only, never block) -----------
    @endpoint
    def execute(self, batch: list, first: int = 0) -> None:
        """Queue ``batch`` on its streams. ``first``: the controller's sequence number of ``batch[0]`` (the
        others follow it), by which an interrupt withdraws work (see ``pause``)."""
        handlers, streams = self._handlers, self.streams
        for i, instr in enumerate(batch):
            t = type(instr)
            if t is tuple:  # an instruction that could not be read, and why: see mark_unreadable
                streams[instr[0].stream].put(self._unreadable, instr)
            elif t is m.BorrowCreate:
                self.borrows[instr.borrow] = [threading.Event(), threading.Event(), None]
                streams[instr.from_stream].put(self._borrow_ready, instr.borrow)
                streams[instr.to_stream].put(handlers[t], instr)
            elif t is m.BorrowDrop:
                streams[instr.to_stream].put(handlers[t], instr)
                streams[instr.from_stream].put(self._borrow_wait_drop, instr.borrow)
            elif t is m.CreateStream:
                if instr.stream not in streams:
                    streams[instr.stream] = _Stream(self, instr.stream, instr.name)
            elif t is m.CallActor:  # its place in the actor's queue is taken now, in message order
                streams[instr.stream].put(handlers[t], (instr, current_runtime().reserve(instr.actor)))
            elif t is m.FetchValue and self._fetch_here(instr):
                pass
            else:
                if t is m.CallFunction and self.warming is not None and type(instr.fn) is str and \
                        instr.fn.startswith("monarch_tensor.worker.dtensor."):
                    self._after_warm_up(streams[instr.stream])
                streams[instr.stream].put(handlers[t], instr, first + i if first and t in _WITHDRAWABLE else 0)

    @endpoint
    def pause(self) -> int:
        """The script was interrupted (Ctrl-C) while waiting: stop every stream before its next instruction and
        say how far they got (the highest sequence number begun). The controller takes the highest over all
        ranks, and ``withdraw`` drops what comes after it up to the last instruction it sent: what no rank
        began, so every rank drops the same instructions (a collective is run by all of its ranks or by none).

        A stream sets ``started`` before it looks at ``paused``, and this sets ``paused`` before it reads
        ``started``: so an instruction begun is counted, or its stream sees the pause and waits for the
        decision before running it."""
        for s in list(self.streams.values()):
            s.paused = True
        return max(s.started for s in list(self.streams.values()))

    @endpoint
    def withdraw(self, after: int, end: int) -> None:
        """Drop the withdrawable instructions with sequence numbers in ``(after, end]``; streams run on."""
        for s in list(self.streams.values()):
            s.decide(after, end)

    def _drop(self, msg) -> None:
        """A withdrawn instruction: its results fail. The tensors it would have written keep the values they had,
        as after an interrupted local script."""
        op = {m.CallOp: lambda: msg.op, m.CallFunction: lambda: getattr(msg.fn, "__name__", str(msg.fn)),
              m.Reduce: lambda: f"reduce({msg.reduction!r})", m.ReduceMany: lambda: f"reduce({msg.reduction!r})",
              m.RunProgram: lambda: "compiled call"}[type(msg)]()
        outs = msg.outputs if type(msg) is m.RunProgram else (msg.out,) if type(msg) is m.Reduce else msg.outs
        loc = msg.locs[0] if type(msg) is m.ReduceMany else msg.loc
        self._fail(outs, RemoteException(op, loc, self.rank, "withdrawn: the script was interrupted (Ctrl-C) "
                                         "before this ran on the mesh", ""), own=False)

    def _after_warm_up(self, stream: _Stream) -> None:
        """DTensor work waits for the warm-up's imports, which it needs (it would wait on them anyway, on the
        modules' import locks; here it says so when that takes long)."""
        w = self.warming
        if w is not None:
            if w.is_alive():
                stream.put(self._await_warm_up, w)
            else:
                self.warming = None

    def _await_warm_up(self, w: threading.Thread) -> None:
        if not w.is_alive():
            return
        w.join(1.0)
        if w.is_alive() and self.rank == 0:
            sys.stderr.write("monarch_tensor: the procs are still importing torch._dynamo, which DTensor needs "
                             "(once per proc); this first sharded op waits for it\n")
        w.join(WARM_UP_TIMEOUT)

    @endpoint
    def execute_unreadable(self, batch: list, error: BaseException, payload_lost: bool) -> None:
        """A batch that arrived but could not be read whole (``_lost_batch``): its instructions that hold
        what could not be read (pieces that could not be unpickled here, or with ``payload_lost`` any
        tensor or array, whose bytes could not be pulled) fail their results with ``error``, in their
        places on their streams; the others run."""
        self.execute(mark_unreadable(batch, error, payload_lost))

    def _unreadable(self, item: tuple) -> None:
        msg, error, payload_lost = item
        why = f"its data could not be pulled from the controller: {error!r}" if payload_lost else \
            f"cannot unpickle it on this proc: {error.__cause__ or error!r}"
        name = type(msg).__name__
        op = msg.op if name == "CallOp" else f"{msg.actor}.{msg.method}" if name == "CallActor" else \
            getattr(msg.fn, "__qualname__", str(msg.fn)) if name == "CallFunction" else name
        failure = RemoteException(op if isinstance(op, str) else name, getattr(msg, "loc", None), self.rank, why,
                                  "", _picklable(error))
        if name == "CreateValue":
            self.refs[msg.ref] = failure
        elif name in ("FetchValue", "CallActor"):
            if msg.reply is not None:
                self._reply(msg.reply, None, failure)
        else:
            self._fail(msg.outs + msg.mutates, failure)

    @endpoint
    def peers_died(self, ranks: list) -> None:
        """The controller saw the procs of ``ranks`` die: groups with them stop waiting for them to form."""
        self.coll.peers_died(ranks)

    @endpoint
    def deliver(self, xfer: int, value: Any) -> None:
        self._put(xfer, value)

    def _put(self, xfer: int, value: Any) -> None:
        with self.inbox_cv:
            self.inbox[xfer] = value
            self.inbox_cv.notify_all()

    @endpoint
    def deliver_failed(self, xfer: int, error: BaseException) -> None:
        """``to_mesh`` data that never arrived (its payload could not be pulled): the receiving ref fails."""
        self._put(xfer, RemoteException("to_mesh (recv)", None, self.rank, repr(error), "", _picklable(error)))

    def __cleanup__(self) -> None:
        for s in self.streams.values():
            s.decide(0, 0)  # (a stream paused by an interrupt ends too)
            s.put(None, None)
        self.coll.close()

    # ---- helpers ---------------------------------------------------------------------
    def _get(self, ref: int):
        try:
            v = self.refs[ref]
        except KeyError:
            raise RuntimeError(f"tensor ref {ref} does not exist on rank {self.rank} (deleted, or never created)") \
                from None
        if type(v) is RemoteException:
            raise _Propagate(v)
        return v

    def _resolve(self, a, stream: int | None = None):
        """``a`` with its refs replaced by their values, and its process groups (``m.Group``) by this rank's
        group for ``stream``, or by stand-ins where ``stream`` is None (a function run on this rank only)."""
        t = type(a)
        if t is m.Ref:
            return self._get(a.id)
        if t is tuple or t is list:
            return t(self._resolve(x, stream) for x in a)
        if t is dict:
            return {k: self._resolve(v, stream) for k, v in a.items()}
        if t is m.Group:
            return self._group(a, stream)
        if isinstance(a, OpaqueRef):
            return OpaqueRef._create(self._resolve(a._key, stream))
        if isinstance(a, tuple) and hasattr(t, "_fields"):  # a named tuple
            return t(*(self._resolve(x, stream) for x in a))
        if isinstance(a, dict) or is_dataclass_instance(a):  # (OrderedDict, defaultdict...: containers.rebuild)
            return rebuild(a, lambda x: self._resolve(x, stream))
        return a

    def _group(self, g: m.Group, stream: int | None):
        mine = next((ranks for ranks in g.groups if self.rank in ranks), None)
        if mine is None:
            raise RuntimeError(f"rank {self.rank} is in no group of the process group over {g.dims} "
                               f"(groups {g.groups})")
        if stream is None:
            return DummyProcessGroup(g.dims, len(mine), mine.index(self.rank))
        current.gave_group = True  # (handle_CallFunction: the call's end is told to the group's members)
        return self.coll.process_group(mine, stream)

    def _failure(self, op: str, loc, e: BaseException) -> RemoteException:
        tb = e.__traceback__
        while tb is not None and tb.tb_frame.f_code.co_filename in _OWN_FILES:
            tb = tb.tb_next  # the failing code's frames, not the interpreter's
        text = "".join(traceback.format_exception(type(e), e, tb))
        return RemoteException(op, loc, self.rank, repr(e), text, _picklable(e))

    def _fail(self, refs, failure: RemoteException, own: bool = True) -> None:
        """``refs`` hold ``failure``; with none to hold it, the next fetch raises it, if it is the op's ``own``
        (one it took from a failed input is held by that input already)."""
        if not any(r is not None for r in refs):
            if own:
                with self.orphan_lock:
                    self.orphan_failures.append(failure)
            return
        for r in refs:
            if r is not None:
                self.refs[r] = failure

    def _store(self, outs: tuple, result) -> None:
        if len(outs) == 1 and isinstance(result, torch.Tensor):
            self.refs[outs[0]] = result
            return
        for r, v in zip(outs, flat_leaves(result)):
            if r is not None:
                self.refs[r] = v

    def _sharing_memory(self, written: tuple) -> tuple:
        """The refs of every tensor that shares memory with a tensor of ``written``: a view's base and its other
        views (``x[1:].index_put_(...)`` writes ``x``). A write that failed leaves that memory as it was, so
        they hold the failure too: a fetch of ``x`` raised nothing and returned the value from before."""
        memory = {_memory(self.refs.get(r)) for r in written} - {None}
        if not memory:
            return ()
        return tuple(r for r, v in list(self.refs.items()) if _memory(v) in memory)

    def _fail_op(self, msg, failure: RemoteException, own: bool = True) -> None:
        """``failure`` into an op's outputs, the tensors it writes and those sharing their memory. Finding the
        last must not lose the error: the outputs and written tensors would keep their old values silently."""
        try:
            sharing = self._sharing_memory(msg.mutates)
        except Exception:  # a bug here; the op's own failure still reaches its tensors
            log.exception("tensor worker: finding the tensors that share memory with those %s wrote failed",
                          failure.op)
            sharing = ()
        self._fail(msg.outs + msg.mutates + sharing, failure, own)

    def _run(self, what: str, msg, call) -> bool:
        """``call()``'s result stored at ``msg``'s outputs, or its error; False for an error."""
        restore_names()  # DTensors' groups, if user code's destroy_process_group() dropped them since the last op
        try:
            result = call()
        except _Propagate as p:
            self._fail_op(msg, p.failure, own=False)
            return False
        except Exception as e:  # noqa: BLE001 - user code failed: the error becomes the value
            self._fail_op(msg, self._failure(what, msg.loc, e))
            return False
        self._store(msg.outs, result)
        return True

    # ---- handlers, one per instruction ---------------------------------------------------
    def _place(self, msg: m.CallOp):
        """Arguments with ref ids (at ``msg.tpos``) replaced by tensors."""
        args = list(msg.args)
        kwargs = dict(msg.kwargs) if msg.kwargs else {}
        get = self._get
        for p in msg.tpos:
            t = type(p)
            if t is int:
                args[p] = get(args[p])
            elif t is tuple:
                i, j = p
                if type(args[i]) is not list:
                    args[i] = list(args[i])
                args[i][j] = get(args[i][j])
            elif p == m.DEEP:
                args = self._resolve(args)
                kwargs = self._resolve(kwargs)
            else:
                kwargs[p] = get(kwargs[p])
        return args, kwargs

    def handle_CallOp(self, msg: m.CallOp) -> None:
        def call():
            args, kwargs = self._place(msg)
            if "device" in kwargs:
                kwargs["device"] = self.device
            if kwargs.get("pin_memory"):
                kwargs["pin_memory"] = False
            return op_call(msg.op)(*args, **kwargs)

        self._run(msg.op, msg, call)

    def _on_device(self):
        """Where user code runs on this worker (remote functions, opaque objects' constructors and methods):
        its tensors made without a device go where the mesh's tensors are, the worker's device (as factories
        inside ``activate()`` do), so a module made there on a GPU worker takes the GPU's inputs."""
        return torch.device(self.device) if self.device.type == "cuda" else contextlib.nullcontext()

    def handle_CallFunction(self, msg: m.CallFunction) -> None:
        def call():
            fn = resolve_function(msg.fn)
            with self._on_device():
                result = fn(*self._resolve(msg.args, msg.stream), **self._resolve(msg.kwargs, msg.stream))
            _check_result(result, msg.outs, msg.metas)
            return result

        current.gave_group = False
        if not self._run(getattr(msg.fn, "__qualname__", str(msg.fn)), msg, call) or current.gave_group:
            # The call is over here: the other ranks' collectives of it that this rank did not run (it raised, an
            # input had failed, or its code skipped them) fail now, not at the timeout (shm_reduce.left).
            left(current.tag)

    def handle_CreateValue(self, msg: m.CreateValue) -> None:
        v = msg.value
        self.refs[msg.ref] = v.to(self.device) if isinstance(v, torch.Tensor) else v

    def handle_CreateRank(self, msg: m.CreateRank) -> None:
        self.refs[msg.ref] = torch.tensor(msg.coords[self.rank], dtype=torch.int64, device=self.device)

    def handle_DeleteRefs(self, msg: m.DeleteRefs) -> None:
        pop = self.refs.pop
        for r in msg.refs:
            pop(r, None)

    def handle_Reduce(self, msg: m.Reduce) -> None:
        group = next((g for g in msg.groups if self.rank in g), None)
        try:
            if group is None:
                raise RuntimeError(f"rank {self.rank} is in none of the reduce groups {msg.groups}")
            try:
                src, failure = self._get(msg.src), None
            except _Propagate as p:
                src, failure = None, p.failure  # it takes part all the same: the others must not wait for it
            out = self.coll.reduce(src, group, msg.reduction, msg.scatter, msg.inplace, msg.stream, msg.numel,
                                   msg.dtype)
            if failure is not None:
                raise _Propagate(failure)
            if out is None:
                raise _Propagate(RemoteException(f"reduce({msg.reduction!r})", msg.loc, self.rank,
                                                 f"its input failed on another rank of the group {group}", ""))
        except _Propagate as p:
            self._fail((msg.out, msg.src) if msg.inplace else (msg.out,), p.failure)
            return
        except Exception as e:  # noqa: BLE001
            f = self._failure(f"reduce({msg.reduction!r})", msg.loc, e)
            self._fail((msg.out, msg.src) if msg.inplace else (msg.out,), f)
            return
        self.refs[msg.out] = out

    def handle_ReduceMany(self, msg: m.ReduceMany) -> None:
        group = next((g for g in msg.groups if self.rank in g), None)
        what = f"reduce({msg.reduction!r})"
        srcs: list = []
        own: dict = {}  # i -> this rank's failure of input i
        for i, r in enumerate(msg.srcs):
            try:
                srcs.append(self._get(r))
            except _Propagate as p:  # it takes part all the same: the others must not wait for it
                srcs.append(None)
                own[i] = p.failure
        try:
            if group is None:
                raise RuntimeError(f"rank {self.rank} is in none of the reduce groups {msg.groups}")
            outs = self.coll.reduce_many(srcs, group, msg.reduction, msg.inplace, msg.stream, msg.numels, msg.dtype)
        except Exception as e:  # noqa: BLE001
            for src, ref, loc in zip(msg.srcs, msg.outs, msg.locs):
                self._fail((src, ref) if msg.inplace else (ref,), self._failure(what, loc, e))
            return
        for i, (src, ref, out, loc) in enumerate(zip(msg.srcs, msg.outs, outs, msg.locs)):
            if out is not None:
                self.refs[ref] = out
                continue
            failure = own.get(i) or RemoteException(what, loc, self.rank,
                                                   f"its input failed on another rank of the group {group}", "")
            self._fail((src, ref) if msg.inplace else (ref,), failure)

    def _fetch_here(self, msg: m.FetchValue) -> bool:
        """A fetch of a small value that nothing on this worker is computing any more: answered at once, on the
        loop's thread, instead of on its stream's. True when answered.

        Every stream idle (and none paused for an interrupt's decision), nothing runs on them: the value is
        what the stream would read, and the answer is the same. A fetch leaves no work on the streams, so what
        comes after it finds them as it would have. This saves a fetch the hop to the stream's thread, which
        blocked since its last instruction: its wake-up, and its first instructions run on cold caches (on a
        2-core VM about 0.2-0.4 ms of a 0.6-0.9 ms fetch). Only where the reply is small (a tensor up to
        ``FETCH_HERE_BYTES``, or a value holding no tensor), on the CPU, and with no function to run (which
        may take any time): the loop must not block."""
        if msg.fn is not None or self.device.type != "cpu" or type(msg.value) is not m.Ref or self.orphan_failures:
            return False
        for st in self.streams.values():
            if st.dones != st.puts or st.paused or st.withdrawn:
                return False
        v = self.refs.get(msg.value.id)
        if v is None or (isinstance(v, torch.Tensor) and (type(v) is not torch.Tensor or v.device.type != "cpu"
                                                          or v.numel() * v.element_size() > FETCH_HERE_BYTES)):
            return False  # (a missing ref, a DTensor or another subclass, a large tensor: the stream says so)
        if not isinstance(v, (torch.Tensor, RemoteException)) and not _plain_value(v):
            return False
        self.handle_FetchValue(msg)
        self.fetched_here += 1
        return True

    def handle_FetchValue(self, msg: m.FetchValue) -> None:
        if self.orphan_failures:
            with self.orphan_lock:  # the first is raised; the others are most often the same error again
                failures, self.orphan_failures = self.orphan_failures, []
            self._reply(msg.reply, None, failures[0])
            return
        try:
            value = self._resolve(msg.value)
            if msg.fn is not None:
                args, kwargs = value
                with self._on_device():
                    value = resolve_function(msg.fn)(*args, **kwargs)
            value = _to_cpu(value) if type(value) is torch.Tensor else torch.utils._pytree.tree_map(_to_cpu, value)
            error = None
        except _Propagate as p:
            value, error = None, p.failure
        except Exception as e:  # noqa: BLE001
            value, error = None, self._failure("fetch", msg.loc, e)
        self._reply(msg.reply, value, error)

    def handle_SendTensor(self, msg: m.SendTensor) -> None:
        try:
            # Contiguous, as the controller describes the received tensor: a transposed one kept its strides on
            # the wire, and an op that needs contiguous memory there (t.view(n)) failed on the receiving ranks.
            value = _to_cpu(self._get(msg.src)).contiguous()
        except _Propagate as p:
            value = p.failure
        except Exception as e:  # noqa: BLE001
            value = self._failure("to_mesh (send)", msg.loc, e)
        try:
            send_tensor(self.mailbox, msg.dests[self.rank], msg.xfer, value)
        except RuntimeError:
            if not self.mailbox.closed:
                raise
            # This proc is stopping (a script that ended with transfers in flight): the proc closed its mailbox
            # under this stream, and nobody waits for the transfer any more. Not a failure worth a traceback.
            log.debug("to_mesh transfer %d not sent: this proc is stopping", msg.xfer)

    def handle_RecvTensor(self, msg: m.RecvTensor) -> None:
        with self.inbox_cv:
            if not self.inbox_cv.wait_for(lambda: msg.xfer in self.inbox, timeout=msg.timeout):
                err = TimeoutError(f"no data for to_mesh transfer {msg.xfer} within {msg.timeout} s")
                self.refs[msg.out] = RemoteException("to_mesh (recv)", msg.loc, self.rank, repr(err), "", err)
                return
            value = self.inbox.pop(msg.xfer)
        self.refs[msg.out] = value.to(self.device) if isinstance(value, torch.Tensor) else value

    def handle_CreateStream(self, msg: m.CreateStream) -> None:  # routed in execute(); never queued
        pass

    def _borrow_ready(self, borrow: int) -> None:
        entry = self.borrows[borrow]
        if self.device.type == "cuda":
            entry[2] = torch.cuda.Event()
            entry[2].record()
        entry[0].set()

    def handle_BorrowCreate(self, msg: m.BorrowCreate) -> None:
        entry = self.borrows[msg.borrow]
        if not entry[0].wait(RECV_TIMEOUT):
            err = TimeoutError(f"borrow {msg.borrow}: stream {msg.from_stream} never reached it")
            self.refs[msg.dst] = RemoteException("borrow", None, self.rank, repr(err), "", err)
            return
        if entry[2] is not None:
            torch.cuda.current_stream().wait_event(entry[2])
        self.refs[msg.dst] = self.refs.get(msg.src, self.refs.get(msg.dst))
        entry.append(msg.src)  # (lent: a failure written into the borrow goes back to it at the drop)

    def handle_BorrowDrop(self, msg: m.BorrowDrop) -> None:
        entry = self.borrows[msg.borrow]
        held = self.refs.pop(msg.dst, None)
        if isinstance(held, RemoteException) and len(entry) > 3 and entry[3] in self.refs:
            # An op that wrote the (mutable) borrow failed: the lender's tensor holds the failure too, as an
            # in-place op's failure does on its own stream (the lender's stream waits for this drop to go on).
            self.refs[entry[3]] = held
        if self.device.type == "cuda":
            entry[2] = torch.cuda.Event()
            entry[2].record()
        entry[1].set()

    def _borrow_wait_drop(self, borrow: int) -> None:
        entry = self.borrows[borrow]
        entry[1].wait(RECV_TIMEOUT)
        if entry[2] is not None:
            torch.cuda.current_stream().wait_event(entry[2])
        self.borrows.pop(borrow, None)

    def handle_CallActor(self, item: tuple) -> None:
        """``item``: the instruction and the place in its actor's queue that ``execute`` took for it."""
        msg, entry = item
        what = f"{msg.actor}.{msg.method.partition('/')[0]}"
        result = _Result() if msg.outs else None  # rref: the endpoint's tensors become this stream's refs
        reply = self.mailbox.open_port(result) if result is not None else msg.reply
        call = CallEndpoint(msg.actor, msg.method, (), {}, reply)
        error = None
        try:
            call = CallEndpoint(msg.actor, msg.method, self._resolve(msg.args), self._resolve(msg.kwargs), reply)
            if self.device.type == "cuda":
                torch.cuda.current_stream().synchronize()  # the endpoint runs on another thread
        except _Propagate as p:
            error = p.failure
        except Exception as e:  # noqa: BLE001
            error = self._failure(what, msg.loc, e)
        rt = current_runtime()
        rt.loop.call_soon_threadsafe(rt.fill, msg.actor, entry, call, error)
        if not entry.done.wait(RECV_TIMEOUT):
            log.warning("tensor worker: %s still runs after %s s; stream %d goes on without waiting",
                        what, RECV_TIMEOUT, msg.stream)
        if result is None:
            return
        if error is not None:
            self._fail(msg.outs, error)
            return
        if not result.ready.wait(RECV_TIMEOUT):
            self._fail(msg.outs, RemoteException(what, msg.loc, self.rank, f"no result within {RECV_TIMEOUT} s", ""))
            return
        if result.error is not None:
            e = result.error
            if not isinstance(e, RemoteException):  # the endpoint raised (an ActorError), or its proc failed
                e = RemoteException(what, msg.loc, self.rank, getattr(e, "exc_repr", None) or repr(e),
                                    getattr(e, "traceback", "") or "", _picklable(getattr(e, "exception", None) or e))
            self._fail(msg.outs, e)
            return
        try:
            _check_result(result.value, msg.outs, msg.metas)
        except Exception as e:  # noqa: BLE001
            self._fail(msg.outs, self._failure(what, msg.loc, e))
            return
        if self.device.type == "cuda":
            torch.cuda.synchronize()  # the endpoint's kernels ran on its own thread's stream: done before use here
        self._store(msg.outs, result.value)

    def handle_DefineProgram(self, msg: m.DefineProgram) -> None:
        self.refs[msg.program] = Program(self, msg, resolve_op, _Propagate)

    def handle_RunProgram(self, msg: m.RunProgram) -> None:
        program = self.refs.get(msg.program)
        if type(program) is not Program:
            failure = RemoteException("compiled call", msg.loc, self.rank,
                                      f"its program (ref {msg.program}) does not exist on rank {self.rank}", "")
            self._fail(msg.outputs, failure)
            return
        program.run(self, msg)

    def handle_ReportRefs(self, msg: m.ReportRefs) -> None:
        self._reply(msg.reply, {"refs": len(self.refs), "streams": len(self.streams),
                                "borrows": len(self.borrows), "inbox": len(self.inbox),
                                "fetched_here": self.fetched_here}, None)

    def _reply(self, port, value, error) -> None:
        output = self.mailbox.output_before(port.addr)  # (what the remote functions before it printed: first)
        try:
            self.mailbox.send(port.addr, SendToPort(port.port_id, value, error, self.rank, output))
        except Exception as e:  # noqa: BLE001 - e.g. an unpicklable value
            err = RemoteException("fetch", None, self.rank, f"cannot send the value back: {e!r}", "")
            self.mailbox.send(port.addr, SendToPort(port.port_id, None, err, self.rank, output))


class _Result:
    """The reply port of an ``rref`` call on this worker: holds the endpoint's result (or error)."""

    observing = True

    def __init__(self) -> None:
        self.ready = threading.Event()
        self.value = self.error = None

    def deliver(self, msg: SendToPort) -> bool:
        self.value, self.error = msg.value, msg.error
        self.ready.set()
        return True  # the port closes

    def proc_died(self, addr: str, error) -> tuple[bool, bool]:
        return False, False


# The instructions an interrupt may withdraw: those that compute. The others (deletes, fetches, transfers,
# borrows, actor calls) always run, so that nothing waits for ever and nothing leaks.
_WITHDRAWABLE = frozenset({m.CallOp, m.CallFunction, m.Reduce, m.ReduceMany, m.RunProgram})


def _memory(v) -> int | None:
    """Where a ref's tensor's memory starts (views of one tensor share it); None for a value of no memory.

    A DTensor has no storage of its own: its memory is its local shard's. (torch.distributed.tensor is
    looked up, not imported: it is slow to import, and until worker/dtensor.py imports it no DTensor exists.)"""
    dtensor = sys.modules.get("torch.distributed.tensor")
    if dtensor is not None and isinstance(v, dtensor.DTensor):
        v = v.to_local()
    if not isinstance(v, torch.Tensor) or v.layout is not torch.strided:
        return None
    try:
        return v.untyped_storage().data_ptr() or None
    except RuntimeError:  # another wrapper subclass with no storage of its own: no memory to share
        return None


def _check_result(result, outs: tuple, metas: tuple) -> None:
    """A remote function's or an rref endpoint's result against what its propagate said."""
    leaves = flat_leaves(result)
    if outs and len(leaves) != len(outs):  # (no outs: called for its effect, e.g. manual_seed)
        raise TypeError(f"it returned {len(leaves)} value(s) where its propagate said {len(outs)}: "
                        f"propagate must return what the function returns, with the same structure")
    for i, (want, got) in enumerate(zip(metas, leaves)):
        if want is not None and not (isinstance(got, torch.Tensor) and tuple(got.shape) == want[0]
                                     and got.dtype == want[1]):
            what = (f"a tensor of shape {tuple(got.shape)} and {got.dtype}" if isinstance(got, torch.Tensor)
                    else f"a {type(got).__name__}")
            raise TypeError(f"its result {i} is {what}, where its propagate said a tensor of shape "
                            f"{want[0]} and {want[1]}: propagate must return what the function returns")


# The largest tensor a fetch answers on the proc's loop thread (TensorWorker._fetch_here): one that encodes in
# a few µs, so the loop is not held.
FETCH_HERE_BYTES = 1 << 16


def _plain_value(v) -> bool:
    """Whether ``v`` is a number, None, or a string or bytes of up to ``FETCH_HERE_BYTES`` (what a fetch answers on
    the loop thread, besides small tensors)."""
    t = type(v)
    return v is None or t in (int, float, bool, complex) or (t in (str, bytes) and len(v) <= FETCH_HERE_BYTES)


def _to_cpu(v):
    if isinstance(v, torch.Tensor):
        if _is_dtensor(v):  # this rank's shard: a DTensor's mesh means nothing on the controller
            v = v.to_local()
        return v.detach().to("cpu", copy=True)
    return v


def _is_dtensor(v) -> bool:
    # (the module may be half imported, by the proc's warm-up thread: then no DTensor exists yet)
    cls = getattr(sys.modules.get("torch.distributed.tensor"), "DTensor", None)
    return cls is not None and isinstance(v, cls)


def send_tensor(mailbox, dest_addr: str, xfer: int, value) -> None:
    """The data path of ``to_mesh``: one function, so a faster transport can replace it.

    Today: the proc mailbox; a large tensor goes through shared memory to a proc of this host, and
    is pulled over the data plane by a proc of another host (rdma/payload.py).
    """
    mailbox.send(dest_addr, CallEndpoint(WORKER_NAME, "deliver", (xfer, value), {}, None))


def _lost_delivery(msg: CallEndpoint, error: BaseException, payload_lost: bool) -> CallEndpoint:
    return CallEndpoint(WORKER_NAME, "deliver_failed", (msg.args[0], error), {}, None)


# Instructions that carry values from the controller (constants, functions, actor-call arguments).
_VALUE_INSTRUCTIONS = (m.CallOp, m.CallFunction, m.CreateValue, m.FetchValue, m.CallActor)


def mark_unreadable(batch: list, error: BaseException, payload_lost: bool) -> list:
    """``batch`` with each instruction that holds what could not be read replaced by ``(instruction, error,
    payload_lost)``, which fails its results: with ``payload_lost``, those that carry a tensor or an array
    (their bytes were never pulled: they hold zeros), else those holding a piece that could not be
    unpickled (``_wire.holds``). Instructions that carry no values from the controller always run."""
    kinds = (torch.Tensor, np.ndarray, memoryview, pickle.PickleBuffer) if payload_lost else (_wire._Stub,)
    return [(instr, error, payload_lost) if type(instr) in _VALUE_INSTRUCTIONS and _wire.holds(instr, kinds)
            else instr for instr in batch]


def _lost_batch(msg: CallEndpoint, error: BaseException, payload_lost: bool) -> CallEndpoint:
    batch = msg.args[0] if msg.args and type(msg.args[0]) is list else []
    return CallEndpoint(WORKER_NAME, "execute_unreadable", (batch, error, payload_lost), {}, None)


LOST_REWRITES[(WORKER_NAME, "deliver")] = _lost_delivery
LOST_REWRITES[(WORKER_NAME, "execute")] = _lost_batch


def _picklable(e: BaseException) -> BaseException | None:
    import pickle

    try:
        pickle.loads(pickle.dumps(e))
        return e
    except Exception:  # noqa: BLE001
        return None
