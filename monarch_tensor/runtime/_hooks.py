"""How the tools (workspace sync, the debugger, env) plug into every proc without the runtime importing them.

A tool is one ``Tool`` entry, registered by name with ``register``. The entries are made in one place,
``monarch_tensor/__init__.py``, which every process of the package imports before anything else of it (a
script, a proc, a template process, a host agent): a proc serves the tools whether or not its own code ever
imported them. An entry names the tool's modules and functions as dotted strings, data that the runtime imports
itself when it needs them:

* ``serves``: the tool's modules in a proc (those that handle its messages among them), imported in each
  proc before it serves anything (``load``; the template process imports them too, so the procs it forks
  start with them loaded);
* ``start``: ``"module:function"``, called with the proc's runtime in each new proc before it serves;
* ``client_gone``: ``"module:function"``, called in a host's template process with the pid and the addresses
  of a client that went away without cleaning up (killed): the tool removes what that client's session left
  on the host.

>>> register("example", serves=("json",), start="json:dumps")  # doctest: +SKIP
"""

from __future__ import annotations

import importlib
import sys
from dataclasses import dataclass
from typing import Any, Callable, Iterable


@dataclass(frozen=True, slots=True)
class Tool:
    """One tool's hooks in the proc runtime (see the module's docstring)."""

    name: str
    serves: tuple[str, ...] = ()
    start: str | None = None
    client_gone: str | None = None


_tools: dict[str, Tool] = {}


def _check_function(ref: str | None, what: str, name: str) -> None:
    if ref is None:
        return
    module, sep, func = ref.partition(":") if isinstance(ref, str) else ("", "", "")
    if not (sep and module and func.isidentifier()):
        raise ValueError(f"tool {name!r}: {what} must be 'package.module:function', got {ref!r}")


def register(name: str, *, serves: Iterable[str] = (), start: str | None = None,
             client_gone: str | None = None) -> Tool:
    """Register the tool ``name``'s hooks (see the module's docstring). Registering a name again with other
    hooks is an error: two tools under one name would leave one of them out of every proc."""
    tool = Tool(name, tuple(serves), start, client_gone)
    for module in tool.serves:
        if not isinstance(module, str) or not module or ":" in module:
            raise ValueError(f"tool {name!r}: serves takes module names ('package.module'), got {module!r}")
    _check_function(start, "start", name)
    _check_function(client_gone, "client_gone", name)
    known = _tools.get(name)
    if known is not None and known != tool:
        raise ValueError(f"a tool named {name!r} is registered already, with other hooks: {known}")
    _tools[name] = tool
    return tool


def tools() -> list[Tool]:
    """The registered tools, in the order they were registered."""
    return list(_tools.values())


def _function(ref: str) -> Callable[..., Any]:
    module, _, func = ref.partition(":")
    return getattr(importlib.import_module(module), func)


def load() -> None:
    """Import every tool's ``serves`` modules (their message handlers then answer in this process). A module
    that cannot be imported is an error naming its tool: a proc without it would leave the tool's messages
    unanswered."""
    for tool in tools():
        for module in tool.serves:
            try:
                importlib.import_module(module)
            except ImportError as e:
                raise ImportError(f"the {tool.name} tool's module {module} cannot be imported in this proc: {e}") from e


def start(rt: Any) -> None:
    """A new proc, before it serves anything: load the tools' modules, then run their ``start`` hooks. A hook
    that raises is reported on stderr and the proc starts without it (the other tools still run)."""
    load()
    for tool in tools():
        if tool.start is None:
            continue
        try:
            _function(tool.start)(rt)
        except Exception as e:  # noqa: BLE001 - one tool's start must not keep the proc from serving
            print(f"monarch_tensor: the {tool.name} tool's start hook failed in this proc: {e!r}", file=sys.stderr)


def client_gone(client_pid: int, client_addrs: Iterable[str]) -> None:
    """A client went away without cleaning up (its procs are gone): each tool removes what its session left on
    this host. Best effort: a hook that raises is reported on stderr and the others still run."""
    addrs = tuple(client_addrs)
    for tool in tools():
        if tool.client_gone is None:
            continue
        try:
            _function(tool.client_gone)(client_pid, addrs)
        except Exception as e:  # noqa: BLE001 - cleanup after a dead client is best effort
            print(f"monarch_tensor: the {tool.name} tool's cleanup after client {client_pid} failed: {e!r}",
                  file=sys.stderr)
