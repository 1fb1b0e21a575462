"""``Future``: a result that is waited on with ``.get()`` or ``await``.

The same object works in a plain script (``fut.get(timeout=5)``), inside an
async endpoint, and in a notebook whose event loop already runs (``await fut``):
results are set by the mailbox's I/O thread, never by the waiter's loop.

Every call makes one, so it is light: a few slots, and a lock only for a thread
that really has to block (``concurrent.futures.Future`` builds a Condition and
an RLock per instance, measured at about a fifth of the client's CPU in a burst
of pipelined calls).
"""

from __future__ import annotations

import asyncio
import logging
import sys
import threading
from typing import Any, Callable, Generic, TypeVar

R = TypeVar("R")
log = logging.getLogger("monarch_tensor.future")

_PENDING, _DONE, _FAILED = 0, 1, 2
_lock = threading.Lock()  # settling, and adding waiters or callbacks (all short)


def wait_limit(timeout: Any) -> float | None:
    """A wait's ``timeout`` as the waits take it: seconds, or None for no limit, which ``math.inf`` (and any
    wait longer than a lock can take, ``threading.TIMEOUT_MAX``: centuries) also means. What is no
    non-negative number is an error naming ``timeout``, rather than one from deep inside the wait
    (``int(inf)``'s OverflowError, nan's "cannot convert float NaN to integer").

    >>> wait_limit(math.inf) is None and wait_limit(5) == 5
    True
    """
    if timeout is None:
        return None
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)):
        raise TypeError(f"timeout must be a number of seconds or None, got {timeout!r}")
    if not timeout >= 0:  # (nan compares false)
        raise ValueError(f"timeout must be a non-negative number of seconds or None, got {timeout!r}")
    return None if timeout > threading.TIMEOUT_MAX else timeout
# Called after every settlement: the mailbox wakes a thread that receives while it waits (its poll
# does not see a Future settled by another thread). Set by mailbox.py.
_settle_hook: Callable[[], None] | None = None
# The calling thread's mailbox, or None (``mailbox.mailbox_here``). Set by mailbox.py.
_mailbox_here: Callable[[], Any] = lambda: None
# Called with a Future's ``_interrupt`` when a wait on it is interrupted. Set by actor.py.
_interrupt_hook: Callable[[Any], None] | None = None


# The client's default folding of procs' output (logs.py) holds lines a moment to fold the same line from
# several ranks; while it holds some, a wait that returns prints them first (``logs.flush``): what an endpoint
# printed comes before its result, in the notebook cell or terminal line that waited for it.
_held_output: Callable[[], None] | None = None


class Future(Generic[R]):
    """``fut.get(timeout=None)`` / ``fut.result()`` / ``await fut``.

    ``Future(coro=some_coroutine)`` (Monarch's) is the Future of a coroutine's result: the coroutine runs
    where the Future is first observed, as a ``@returns_future`` call's body does; ``Future.gather(*futures)``
    is the Future of a list of results."""

    # ``_interrupt`` (unset on most): what to stop on the procs where a wait on this Future is interrupted
    # (Ctrl-C, a notebook's stop button, a cancelled ``await``); see ``_interrupted``.
    __slots__ = ("_state", "_value", "_waiter", "_callbacks", "_what", "_interrupt")
    _by_thread = False  # ThreadFuture: settled by a thread of this process, never by a reply

    def __new__(cls, *args, coro=None, **kwargs):
        if coro is not None and cls is Future:
            return object.__new__(_BodyFuture)  # (Python then runs _BodyFuture.__init__ with these arguments)
        return object.__new__(cls)

    def __init__(self, what: str = "result") -> None:
        self._state = _PENDING
        self._value: Any = None  # the result, or the exception when _FAILED
        self._waiter: threading.Lock | None = None  # held until settled; blocked waiters acquire it
        self._callbacks: list | None = None
        self._what = what

    @classmethod
    def ready(cls, value: Any) -> Future:
        f = cls()
        f._state, f._value = _DONE, value
        return f

    @classmethod
    def failed(cls, error: BaseException) -> Future:
        f = cls()
        f._state, f._value = _FAILED, error
        return f

    def get(self, timeout: float | None = None) -> R:
        """Block until the value is there; raise the remote error, or ``TimeoutError``."""
        timeout = wait_limit(timeout)
        if not self._state:
            _mailbox = _mailbox_here()
            if _mailbox is not None:
                _mailbox.flush()  # a call this waits on may still sit in a batch
            try:
                if _mailbox is not None and _mailbox.receiver_ident == threading.get_ident():
                    # We are the thread that receives replies: receive until ours is in.
                    _mailbox.wait_until(self.done, timeout)
                    settled = self._state != _PENDING
                elif _mailbox is not None and _mailbox.can_lead() and not self._by_thread:
                    # A client's thread: receive ourselves while we wait (one thread hand-off less).
                    _mailbox.lead(self, timeout)
                    settled = self._state != _PENDING
                elif _mailbox is not None and not self._by_thread and _mailbox.helps_here():
                    # Another thread of a proc (its receiving thread may be busy waiting for this one).
                    _mailbox.receive_for(self, timeout)
                    settled = self._state != _PENDING
                else:
                    settled = self._wait(timeout)
            except KeyboardInterrupt:
                self._interrupted()
                raise
            if not settled:
                if timeout is None:  # only a receiving wait returns unsettled without a timeout
                    raise RuntimeError(f"no {self._what}: this process's mailbox closed while waiting for it")
                raise TimeoutError(f"no {self._what} within {timeout} s")
        if _held_output is not None:
            _held_output()
        return self._result()

    result = get

    def done(self) -> bool:
        return self._state != _PENDING

    def exception(self, timeout: float | None = None) -> BaseException | None:
        """The error once settled (None for a value); waits as ``get`` does, ``TimeoutError`` if unsettled."""
        if not self._state:
            try:
                self.get(timeout)
            except BaseException:
                if not self._state:
                    raise
        return self._value if self._state == _FAILED else None

    def add_done_callback(self, fn: Callable[[Future], None]) -> None:
        """Call ``fn(self)`` once settled: at once if it is, else on the thread that settles it."""
        if not self._state:
            with _lock:
                if not self._state:
                    if self._callbacks is None:
                        self._callbacks = []
                    self._callbacks.append(fn)
                    return
        _call(fn, self)

    add_callback = add_done_callback  # the tensor engine's name in Monarch (``monarch.Future``)

    def __await__(self):
        if not self._state:
            _mailbox = _mailbox_here()
            if _mailbox is not None:
                _mailbox.flush()
            loop = asyncio.get_running_loop()
            woken = loop.create_future()

            def wake(_f: Future) -> None:
                try:
                    loop.call_soon_threadsafe(_resolve, woken)
                except RuntimeError:  # the loop closed meanwhile: nobody awaits any more
                    pass

            self.add_done_callback(wake)
            if _mailbox is not None and not self._by_thread and _mailbox.helps_here():
                _mailbox.receive_on_loop(loop, woken)  # (an async __cleanup__ run on a loop of its own)
            try:
                yield from woken.__await__()
            except (asyncio.CancelledError, KeyboardInterrupt):  # the awaiting task was cancelled (a notebook's stop)
                self._interrupted()
                raise
        return self._result()

    def as_asyncio(self) -> asyncio.Future:
        """An ``asyncio.Future`` of the running loop that resolves as this one does (Monarch's); off a loop,
        a ``RuntimeError``. Each call gives a new one, observing the same result."""
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            raise RuntimeError("as_asyncio() needs a running asyncio event loop; use .get() outside one") from None
        out = loop.create_future()
        if not self._state:
            _mailbox = _mailbox_here()
            if _mailbox is not None:
                _mailbox.flush()

        def settle(f: Future) -> None:
            try:
                loop.call_soon_threadsafe(_copy_into, f, out)
            except RuntimeError:  # the loop closed meanwhile: nobody awaits any more
                pass

        self.add_done_callback(settle)
        return out

    # ---- internals --------------------------------------------------------------------------
    def _interrupted(self) -> None:
        """A wait on this Future was interrupted: stop the remote work it waits for, where it knows how (a call
        of actors: ``actor._interrupt_call``). The Future itself stays pending until its procs answer."""
        info = getattr(self, "_interrupt", None)
        if info is not None and not self._state and _interrupt_hook is not None:
            try:
                _interrupt_hook(info)
            except Exception as e:  # noqa: BLE001 - the interrupt itself goes on to the script
                sys.stderr.write(f"monarch_tensor: could not stop the interrupted call on its procs: {e!r}\n")

    def _result(self) -> R:
        if self._state == _FAILED:
            raise self._value
        return self._value

    def _wait(self, timeout: float | None) -> bool:
        """Block until settled or ``timeout`` seconds passed; whether it is settled."""
        if self._state:
            return True
        with _lock:
            if self._state:
                return True
            w = self._waiter
            if w is None:
                w = self._waiter = threading.Lock()
                w.acquire()
        if w.acquire(timeout=-1 if timeout is None else max(timeout, 0)):
            w.release()  # the next blocked waiter (several threads may wait on one Future)
        return self._state != _PENDING

    def _settle(self, state: int, value: Any) -> None:
        with _lock:
            if self._state:
                return
            self._value, self._state = value, state
            waiter, callbacks, self._callbacks = self._waiter, self._callbacks, None
        if waiter is not None:
            waiter.release()
        if _settle_hook is not None:
            _settle_hook()
        if callbacks:
            for fn in callbacks:
                _call(fn, self)

    # set by the runtime
    def _set_result(self, value: Any) -> None:
        self._settle(_DONE, value)

    def _set_exception(self, error: BaseException) -> None:
        self._settle(_FAILED, error)

    @staticmethod
    def gather(*futures: Future, return_exceptions: bool = False) -> Future[list]:
        """The Future of ``futures``' results, in their order (Monarch's); all run at once where it is
        observed. The first error fails it, unless ``return_exceptions``: then errors are among the results."""
        for f in futures:
            if not isinstance(f, Future):
                raise TypeError(f"Future.gather() takes Futures, got {type(f).__name__} {f!r}")

        async def gathered() -> list:
            return list(await asyncio.gather(*futures, return_exceptions=return_exceptions))

        return _BodyFuture(f"results of {len(futures)} futures", coro=gathered())

    def __repr__(self) -> str:
        return f"<Future {self._what} {('pending', 'done', 'failed')[self._state]}>"


class ThreadFuture(Future):
    """A Future that a thread of this process settles (a workspace sync's), not a reply: a thread that
    waits on it blocks, rather than receive replies meanwhile (``Mailbox.lead``), so that the thread at
    work receives its own replies. (A script's main thread receiving them for it added a thread hand-off
    to each of the sync's round trips.)"""

    __slots__ = ()
    _by_thread = True


class CoroutineFuture(Future):
    """A Future that is also a coroutine object, for the methods that are ``async def`` in Monarch
    (``logging_option``): ``asyncio.run(procs.logging_option(...))`` and ``asyncio.create_task`` accept
    it, as they do Monarch's; ``await`` and ``.get()`` work as on any Future. Driven as a coroutine
    (``send``/``throw``/``close``) it runs once, as a coroutine does."""

    __slots__ = ("_steps",)

    def __init__(self, what: str = "result") -> None:
        super().__init__(what)
        self._steps = None

    @classmethod
    def of(cls, fut: Future) -> CoroutineFuture:
        out = cls(fut._what)
        fut.add_done_callback(lambda f: out._settle(f._state, f._value))
        return out

    def _iter(self):
        if self._steps is None:
            self._steps = self.__await__()
        return self._steps

    def send(self, value):
        return self._iter().send(value)

    def throw(self, *exc):
        return self._iter().throw(*exc)

    def close(self) -> None:
        if self._steps is not None:
            self._steps.close()


# The threads that run a proc's event loop. A synchronous endpoint running there sees no running loop
# (Monarch's), yet blocking there stalls the loop all the same.
loop_threads: set[int] = set()


def in_event_loop() -> bool:
    """Whether this thread runs an asyncio event loop now (blocking here would stall it): a running one, or a
    proc's loop that the synchronous endpoint running on it does not see."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return threading.get_ident() in loop_threads
    return True


def run_to_end(awaitable) -> Any:
    """Run ``awaitable`` to its end on an event loop of its own, on a helper thread (this one may be running
    a loop), in this thread's context (``current_rank()``); its result, or its exception raised here."""
    import concurrent.futures
    import contextvars

    async def wait():
        return await awaitable

    with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="monarch-tensor-await") as pool:
        return pool.submit(contextvars.copy_context().run, asyncio.run, wait()).result()


def _call(fn: Callable[[Future], None], fut: Future) -> None:
    try:
        fn(fut)
    except Exception:  # like concurrent.futures: a callback's error is logged, not raised
        log.exception("exception calling callback for %r", fut)


def _resolve(f: asyncio.Future) -> None:
    if not f.done():
        f.set_result(None)


def _copy_into(f: Future, out: asyncio.Future) -> None:
    if out.done():  # cancelled by its waiter
        return
    if f._state == _FAILED:
        err = f._value
        # asyncio refuses StopIteration as an exception (PEP 479): hand it over as `raise` would.
        out.set_exception(RuntimeError(repr(err)) if isinstance(err, StopIteration) else err)
    else:
        out.set_result(f._value)


# ---- returns_future ------------------------------------------------------------------------------
class _BodyFuture(Future):
    """The Future of a ``@returns_future`` call: its body runs where it is first observed (``get``,
    ``exception``, ``await`` or ``as_asyncio``), once; later observers share the outcome."""

    __slots__ = ("_body", "_ctx")

    def __init__(self, what: str = "result", *, coro, ctx=None) -> None:
        import contextvars
        import inspect

        self._body: list = []  # the coroutine, or a _Paused one
        if not inspect.isawaitable(coro):
            raise TypeError(f"Future(coro=...) needs a coroutine, got {type(coro).__name__} {coro!r}")
        super().__init__(what)
        self._body = [coro]  # taken (``list.pop``, atomic) by the first observer
        self._ctx = ctx if ctx is not None else contextvars.copy_context()

    def _take(self):
        try:
            return self._body.pop()
        except IndexError:
            return None

    async def _run_body(self, coro, timeout: float | None = None) -> None:
        try:
            value = await (coro if timeout is None else asyncio.wait_for(coro, timeout))  # cancelled at it
        except asyncio.CancelledError as e:
            # Its task was cancelled (by the loop it ran on: an asyncio.run that ended, a cancelled awaiter's
            # loop) or the body itself ended in a cancellation: observers elsewhere get an Exception saying so,
            # not a bare CancelledError that `except Exception` misses. The task ends cancelled all the same.
            err = RuntimeError(f"{self._what}: cancelled before it ended (its body ran as a task of an event loop "
                               f"that cancelled it, or cancelled itself)")
            err.__cause__ = e
            self._set_exception(err)
            raise
        except BaseException as e:  # the observers get it
            if timeout is not None and type(e) is TimeoutError and not e.args:  # wait_for's, at the timeout
                e = TimeoutError(f"no {self._what} within {timeout} s (the body was cancelled)")
            self._set_exception(e)
            if isinstance(e, (KeyboardInterrupt, SystemExit)):
                raise
        else:
            self._set_result(value)

    def _drive(self, coro, timeout: float | None) -> None:
        """Run the body on a loop of this thread, as ``asyncio.run`` does; at the timeout it is cancelled."""
        loop = asyncio.new_event_loop()
        self._run_loop(loop, self._ctx.run(loop.create_task, self._run_body(coro, timeout)))

    def _run_loop(self, loop: asyncio.AbstractEventLoop, task: asyncio.Task) -> None:
        """Run ``loop`` until the body's ``task`` ends. Interrupted (Ctrl-C in the waiting ``get``), the body
        is kept, paused with its loop, for the next observer to run on: the Future does not stay pending for
        ever, with the loop's work lost."""
        try:
            loop.run_until_complete(task)
        except BaseException:
            if not task.done():
                self._body.append(_Paused(loop, task))
            raise
        finally:
            if task.done():
                loop.run_until_complete(loop.shutdown_asyncgens())
                loop.close()

    def get(self, timeout: float | None = None):
        timeout = wait_limit(timeout)
        body = self._take()
        if body is not None:
            run, args = (self._run_loop, (body.loop, body.task)) if type(body) is _Paused else \
                (self._drive, (body, timeout))
            if in_event_loop():  # never a second loop inside a running one: a helper thread runs it
                threading.Thread(target=run, args=args, daemon=True, name="mt-returns-future").start()
            else:
                run(*args)
        return Future.get(self, timeout)

    result = get

    def _start_on_loop(self) -> None:
        body = self._take()
        if type(body) is _Paused:  # (its task belongs to a loop of its own: that loop runs on, on a thread)
            threading.Thread(target=self._run_loop, args=(body.loop, body.task), daemon=True,
                             name="mt-returns-future").start()
        elif body is not None:
            loop = asyncio.get_running_loop()
            task = self._ctx.run(loop.create_task, self._run_body(body))
            _running_bodies.add(task)  # asyncio holds tasks only weakly
            task.add_done_callback(_running_bodies.discard)

    def __await__(self):
        self._start_on_loop()
        return (yield from Future.__await__(self))

    def as_asyncio(self) -> asyncio.Future:
        try:
            asyncio.get_running_loop()
        except RuntimeError:  # the body stays unstarted: a later get() or await still runs it
            raise RuntimeError("as_asyncio() needs a running asyncio event loop; use .get() outside one") from None
        self._start_on_loop()
        return Future.as_asyncio(self)

    def __del__(self) -> None:
        body = self._take()
        if type(body) is _Paused:  # interrupted and never observed again: its task is cancelled, its loop closed
            body.task.cancel()
            try:
                body.loop.run_until_complete(asyncio.gather(body.task, return_exceptions=True))
            except BaseException:  # noqa: BLE001 - at garbage collection: nothing to tell
                pass
            body.loop.close()
        elif body is not None:
            body.close()  # never observed: its code never runs


class _Paused:
    """A body interrupted in a ``get`` (Ctrl-C): its task and the loop it runs on, to go on with later."""

    __slots__ = ("loop", "task")

    def __init__(self, loop: asyncio.AbstractEventLoop, task: asyncio.Task) -> None:
        self.loop, self.task = loop, task


_running_bodies: set = set()


def returns_future(fn: Callable[..., Any]) -> Callable[..., Future]:
    """Make an ``async def`` return a ``Future`` (Monarch's): ``f(...).get()`` from plain code, ``await f(...)``
    from async code. Calling it does not start the body: the first observer runs it (``get`` on this thread's
    own loop, as ``asyncio.run``, and cancels it at its timeout; ``await`` as a task of the awaiting loop);
    a Future never observed never runs. The body sees the caller's context variables."""
    import contextvars
    import functools
    import inspect

    if not inspect.iscoroutinefunction(fn):
        raise TypeError(f"returns_future needs an async def, got {getattr(fn, '__qualname__', fn)!r}")

    @functools.wraps(fn)
    def wrapped(*args, **kwargs) -> Future:
        return _BodyFuture(f"result of {fn.__qualname__}", coro=fn(*args, **kwargs), ctx=contextvars.copy_context())

    return wrapped
