"""Thread state an actor's ``__init__`` leaves is its endpoints' (Monarch runs an actor's constructor and
endpoints on one thread of its own): torch's grad mode and default device, and a module's ``threading.local``,
each seen by that actor only, though here the proc's actors share the loop's thread
(``monarch_tensor/runtime/_thread_state.py``)."""

from __future__ import annotations

import threading

import torch

from monarch_tensor.actor import Actor, endpoint

T = 60
_TLS = threading.local()  # a module's thread-local, as a library of the user's keeps per-thread context


PROCS = {"gpus": 1}  # conftest's procs fixture: one proc


class Plain(Actor):
    """Sets nothing in __init__: sees the loop thread's state."""

    @endpoint
    def state(self) -> tuple:
        return torch.is_grad_enabled(), torch.empty(1).device.type, getattr(_TLS, "name", None)

    @endpoint
    async def state_async(self) -> tuple:
        return torch.is_grad_enabled(), torch.empty(1).device.type, getattr(_TLS, "name", None)


class Stateful(Actor):
    """Turns grad off, sets a default device and a module thread-local's attributes in __init__."""

    def __init__(self, name: str) -> None:
        torch.set_grad_enabled(False)
        torch.set_default_device("meta")
        _TLS.name = name
        _TLS.count = 0

    @endpoint
    def state(self) -> tuple:
        return torch.is_grad_enabled(), torch.empty(1).device.type, getattr(_TLS, "name", None)

    @endpoint
    async def state_async(self) -> tuple:
        import asyncio

        await asyncio.sleep(0.01)  # (its state holds across an await, while other calls run)
        return torch.is_grad_enabled(), torch.empty(1).device.type, getattr(_TLS, "name", None)

    @endpoint
    def count(self) -> int:
        _TLS.count += 1
        return _TLS.count

    @endpoint
    def grad_on(self) -> None:
        torch.set_grad_enabled(True)

    @endpoint
    def ask(self, other) -> tuple:
        """Waits on another actor of this proc: it runs meanwhile, in its own state; this one's comes back."""
        theirs = other.state.call_one().get(timeout=T)
        return theirs, _state_here()


def _state_here() -> tuple:
    return torch.is_grad_enabled(), torch.empty(1).device.type, getattr(_TLS, "name", None)


def test_state_set_in_init_is_the_actors_own(procs):
    a, b = procs.spawn("ts_a", Stateful, "a"), procs.spawn("ts_b", Stateful, "b")
    plain = procs.spawn("ts_plain", Plain)
    try:
        for _ in range(2):  # (calls of the three interleaved on the proc's one loop thread)
            assert a.state.call_one().get(timeout=T) == (False, "meta", "a")
            assert plain.state.call_one().get(timeout=T) == (True, "cpu", None)
            assert b.state_async.call_one().get(timeout=T) == (False, "meta", "b")
            assert plain.state_async.call_one().get(timeout=T) == (True, "cpu", None)
            assert a.state_async.call_one().get(timeout=T) == (False, "meta", "a")
        # async calls of both at once, each awaiting while the other runs
        futs = [x.state_async.call_one() for x in (a, b, a, b)]
        assert [f.get(timeout=T) for f in futs] == [(False, "meta", "a"), (False, "meta", "b")] * 2
        # what an endpoint changes stays the actor's, as on a thread of its own
        assert [a.count.call_one().get(timeout=T) for _ in range(3)] == [1, 2, 3]
        assert b.count.call_one().get(timeout=T) == 1
        a.grad_on.call_one().get(timeout=T)
        assert a.state.call_one().get(timeout=T) == (True, "meta", "a")
        assert b.state.call_one().get(timeout=T) == (False, "meta", "b")
        assert plain.state.call_one().get(timeout=T) == (True, "cpu", None)
    finally:
        for m in (a, b, plain):
            m.stop().get(timeout=T)


def test_a_wait_runs_the_other_actors_calls_in_their_own_state(procs):
    a, plain = procs.spawn("tw_a", Stateful, "a"), procs.spawn("tw_plain", Plain)
    try:
        theirs, mine = a.ask.call_one(plain).get(timeout=T)
        assert theirs == (True, "cpu", None) and mine == (False, "meta", "a")
        assert plain.state.call_one().get(timeout=T) == (True, "cpu", None)
    finally:
        for m in (a, plain):
            m.stop().get(timeout=T)


def test_only_the_users_own_modules_thread_locals_are_kept():
    """A thread-local of the standard library's or an installed package's modules may mirror native
    per-thread state (torch's default-device context; asyncio's running loop): never copied."""
    import asyncio.events
    import sys

    import zmq

    from monarch_tensor.runtime import _thread_state

    assert _thread_state._users(__name__, sys.modules[__name__])
    for mod in (asyncio.events, torch, zmq, _thread_state):
        assert not _thread_state._users(mod.__name__, mod), mod
    seen = []
    t = threading.Thread(target=lambda: (setattr(_TLS, "here", 1), seen.append(_thread_state.capture())))
    t.start()
    t.join()
    state = seen[0]
    assert state is not None and state.grad is None and state.device is None
    assert [(local, attrs) for local, attrs in state.locals] == [(_TLS, {"here": 1})]
