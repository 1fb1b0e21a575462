"""Thread state an actor's constructor leaves, kept for that actor's endpoints.

Monarch runs each actor, constructor and endpoints, on a thread of its own. Here the constructor runs on a
thread of its own (``ProcRuntime._construct``) and the endpoints on the proc's loop thread, which the proc's
actors share. What the constructor left in its thread's state is taken once it returns (``capture``, on its
thread) and put in place around each of that actor's calls only (``ActorThreadState.run``), then taken back
with what the endpoint changed: so the actor sees its own state, as on its own thread, and the proc's other
actors do not. An actor whose constructor left none has no record, and its calls cost nothing more.

Kept: torch's grad mode (``torch.set_grad_enabled(False)``), torch's default device
(``torch.set_default_device``), and the attributes set on this thread in a ``threading.local`` held at module
level by the user's own code (not by the standard library's or an installed package's modules: their
thread-locals may mirror native per-thread state, as torch's default-device context does, which copying
the Python side of would break). An actor's own ``threading.local`` attributes and its CUDA device are
carried over once instead (``_proc._thread_locals``, ``_proc._cuda_device``).
"""

from __future__ import annotations

import os
import sys
import sysconfig
import threading
from collections.abc import Callable, Generator
from typing import Any

_CPU = "cpu"
# Modules whose global thread-locals are carried: the user's own code (classified once per module object).
_ours: dict[str, tuple[object, bool]] = {}
_SKIPPED = ("monarch_tensor", "torch")


def _installed_dirs() -> tuple[str, ...]:
    """The standard library's and installed packages' dirs, as named and as resolved."""
    paths = sysconfig.get_paths()
    dirs = {paths[k] for k in ("stdlib", "platstdlib", "purelib", "platlib") if paths.get(k)}
    dirs |= {p for p in sys.path if p.endswith(("site-packages", "dist-packages"))}
    return tuple({os.path.join(f(d), "") for d in dirs for f in (os.path.abspath, os.path.realpath)})


_INSTALLED = _installed_dirs()


def _users(name: str, module: object) -> bool:
    """Whether ``module`` is the user's own code: a file outside the interpreter's and its packages' dirs."""
    seen = _ours.get(name)
    if seen is not None and seen[0] is module:
        return seen[1]
    top = name.partition(".")[0]
    ours = False
    if top not in _SKIPPED and top not in sys.stdlib_module_names:  # (first: some of torch's are lazy)
        file = getattr(module, "__file__", None)
        ours = isinstance(file, str) and not file.startswith(_INSTALLED)  # (no realpath: a first capture
    _ours[name] = (module, ours)  # looks at every module)
    return ours


def _module_locals() -> list[tuple[threading.local, dict]]:
    """The user's module-level ``threading.local`` objects that hold attributes on this thread, with them."""
    out = []
    for name, module in list(sys.modules.items()):
        if module is None or not _users(name, module):
            continue
        for value in list(getattr(module, "__dict__", {}).values()):
            if isinstance(value, threading.local):
                try:
                    attrs = dict(value.__dict__)
                except Exception:  # noqa: BLE001 - a subclass whose __init__ fails on this thread: nothing set
                    continue
                if attrs:
                    out.append((value, attrs))
    return out


class ActorThreadState:
    """One actor's thread state: what its constructor left, then what its endpoints changed."""

    __slots__ = ("grad", "device", "locals")

    def __init__(self, grad: bool | None, device: Any, local_attrs: list[tuple[threading.local, dict]]) -> None:
        self.grad = grad  # None: not kept (the constructor left it as a new thread has it)
        self.device = device
        self.locals = local_attrs

    def _swap_in(self) -> tuple:
        torch: Any = sys.modules.get("torch")
        grad = device = None
        if self.grad is not None:
            grad = torch.is_grad_enabled()
            torch._C._set_grad_enabled(self.grad)
        if self.device is not None:
            device = torch.get_default_device()
            torch.set_default_device(self.device)
        outer = []
        for local, attrs in self.locals:
            d = local.__dict__
            outer.append(dict(d))
            d.clear()
            d.update(attrs)
        return grad, device, outer

    def _swap_out(self, saved: tuple) -> None:
        grad, device, outer = saved
        torch: Any = sys.modules.get("torch")
        if self.grad is not None:
            self.grad = torch.is_grad_enabled()
            torch._C._set_grad_enabled(grad)
        if self.device is not None:
            self.device = torch.get_default_device()
            torch.set_default_device(None if device.type == _CPU else device)
        for (local, attrs), before in zip(self.locals, outer):
            d = local.__dict__
            attrs.clear()
            attrs.update(d)
            d.clear()
            d.update(before)

    def run(self, rt, fn: Callable, args: tuple, kwargs: dict):
        """``fn(*args, **kwargs)`` in this actor's state, on the loop's thread (``rt``: the proc's runtime,
        whose ``thread_state`` says whose state is in place, for a wait that runs other calls meanwhile)."""
        outer = rt.thread_state
        here = rt.thread_state = [self, self._swap_in()]
        try:
            return fn(*args, **kwargs)
        finally:
            rt.thread_state = outer
            self._swap_out(here[1])

    def wrap(self, rt, coro) -> _InState:
        """An async endpoint's coroutine, each of whose steps runs in this actor's state."""
        return _InState(self, rt, coro)


class _InState:
    __slots__ = ("state", "rt", "coro")

    def __init__(self, state: ActorThreadState, rt, coro) -> None:
        self.state, self.rt, self.coro = state, rt, coro

    def __await__(self) -> Generator[Any, Any, Any]:
        it = self.coro.__await__()
        value: Any = None
        error: BaseException | None = None
        while True:
            try:
                if error is None:
                    step = self.state.run(self.rt, it.send, (value,), {})
                else:
                    step = self.state.run(self.rt, it.throw, (error,), {})
            except StopIteration as e:
                return e.value
            error = value = None
            try:
                value = yield step
            except BaseException as e:  # noqa: BLE001 - (a cancellation, ...) goes into the coroutine
                error = e

    def close(self) -> None:
        self.coro.close()


def leave(rt) -> list | None:
    """Before a wait runs other calls on the loop's thread: the state in place goes back to the loop's;
    returns what ``resume`` puts back after."""
    here = rt.thread_state
    if here is not None:
        here[0]._swap_out(here[1])
        rt.thread_state = None
    return here


def resume(rt, here: list | None) -> None:
    if here is not None:
        here[1] = here[0]._swap_in()
        rt.thread_state = here


def capture() -> ActorThreadState | None:
    """On the constructor's thread, once it returned: the state it left there, or None (none to keep)."""
    torch: Any = sys.modules.get("torch")
    grad = device = None
    if torch is not None:
        try:
            if not torch.is_grad_enabled():  # (a new thread's grad mode is on)
                grad = False
            if torch.get_default_device().type != _CPU:
                device = torch.get_default_device()
        except Exception:  # noqa: BLE001 - a broken torch: nothing of it to keep
            grad = device = None
    local_attrs = _module_locals()
    if grad is None and device is None and not local_attrs:
        return None
    return ActorThreadState(grad, device, local_attrs)
