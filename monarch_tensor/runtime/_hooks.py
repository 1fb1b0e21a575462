"""How the tools (workspace sync, the debugger, env) plug into every proc without the runtime importing them.

A tool is one ``Tool`` entry, registered by name with ``register``. The entries are made in one place,
``monarch_tensor/__init__.py``, which every process of the package imports before anything else of it (a
script, a proc, a template process, a host agent): a proc serves the tools whether or not its own code ever
imported them. An entry names the tool's modules and functions as dotted strings, data that the runtime imports
itself when it needs them:

* ``serves``: the tool's modules in a proc, imported in each proc before it serves anything (``load``; the
  template process imports them too, so the procs it forks start with them loaded);
* ``handlers``: ``"module:NAME"`` of the dicts ``{message type: handler(mailbox, msg)}`` that answer the tool's
  messages, installed in the transport's ``SYSTEM_HANDLERS`` where the tool serves (``load``: procs, the
  template, the script's own proc), or in any process that asks (``install``). Importing a tool's module
  installs nothing;
* ``start``: ``"module:function"``, called with the proc's runtime in each new proc before it serves;
* ``client_gone``: ``"module:function"``, called in a host's template process with the pid and the addresses
  of a client that went away without cleaning up (killed): the tool removes what that client's session left
  on the host.
* ``session_end``: ``"module:function"``, called with the addresses of a client session whose procs on this
  host are gone (a host agent ends the session; a script exits, for the tools it used): the tool removes what
  it keeps for that session here.
* ``api``: ``{name: "module:function"}``, what the layers below the tool delegate to (``api(tool, name)``):
  ``HostMesh.sync_workspace`` is workspace sync's ``sync_this_host``, ``ProcMesh.env`` the env tool's
  ``ProcEnv``. The hosts layer keeps the public methods (Monarch's names) and imports no tool.

>>> register("example", serves=("json",), start="json:dumps", api={"dump": "json:dumps"})  # doctest: +SKIP
>>> api("example", "dump")({"a": 1})  # doctest: +SKIP
'{"a": 1}'
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Callable, Iterable

from ..transport.mailbox import SYSTEM_HANDLERS
from . import _names


@dataclass(frozen=True, slots=True)
class Tool:
    """One tool's hooks in the proc runtime (see the module's docstring)."""

    name: str
    serves: tuple[str, ...] = ()
    start: str | None = None
    client_gone: str | None = None
    session_end: str | None = None
    api: tuple[tuple[str, str], ...] = ()  # (name, "module:function"), sorted by name
    handlers: tuple[str, ...] = ()


_tools: dict[str, Tool] = {}


def _check_function(ref: str | None, what: str, name: str) -> None:
    if ref is not None:
        _names.check(ref, f"tool {name!r}: {what}")


def register(name: str, *, serves: Iterable[str] = (), start: str | None = None,
             client_gone: str | None = None, session_end: str | None = None,
             api: Mapping[str, str] | None = None, handlers: Iterable[str] = ()) -> Tool:
    """Register the tool ``name``'s hooks (see the module's docstring). Registering a name again with other
    hooks is an error: two tools under one name would leave one of them out of every proc."""
    if api is not None and not isinstance(api, Mapping):
        raise ValueError(f"tool {name!r}: api maps names to 'package.module:function', got {api!r}")
    tool = Tool(name, tuple(serves), start, client_gone, session_end, tuple(sorted((api or {}).items())),
                tuple(handlers))
    for module in tool.serves:
        if not isinstance(module, str) or not module or ":" in module:
            raise ValueError(f"tool {name!r}: serves takes module names ('package.module'), got {module!r}")
    _check_function(start, "start", name)
    _check_function(client_gone, "client_gone", name)
    _check_function(session_end, "session_end", name)
    for ref in tool.handlers:
        _check_function(ref, "handlers", name)
    for key, ref in tool.api:
        if not isinstance(key, str) or not key.isidentifier():
            raise ValueError(f"tool {name!r}: api names are identifiers, got {key!r}")
        _check_function(ref, f"api {key!r}", name)
    known = _tools.get(name)
    if known is not None and known != tool:
        raise ValueError(f"a tool named {name!r} is registered already, with other hooks: {known}")
    _tools[name] = tool
    return tool


def tools() -> list[Tool]:
    """The registered tools, in the order they were registered."""
    return list(_tools.values())


def _function(ref: str) -> Callable[..., Any]:
    return _names.resolve(ref)


def load() -> None:
    """Import every tool's ``serves`` modules and install its ``handlers`` (its messages are then answered in
    this process). A module that cannot be imported is an error naming its tool: a proc without it would
    leave the tool's messages unanswered."""
    for tool in tools():
        for module in tool.serves:
            try:
                importlib.import_module(module)
            except ImportError as e:
                raise ImportError(f"the {tool.name} tool's module {module} cannot be imported in this proc: {e}") from e
        install(tool.name)


def install(name: str) -> None:
    """Install tool ``name``'s ``handlers`` in this process (again: no change). A message type that another
    function handles already is an error: one of the two would never be called."""
    tool = _tools.get(name)
    if tool is None:
        raise LookupError(f"no tool named {name!r} is registered (monarch_tensor/__init__.py registers the tools)")
    for ref in tool.handlers:
        try:
            table = _function(ref)
        except ImportError as e:
            raise ImportError(f"the {tool.name} tool's handlers {ref} cannot be imported in this process: {e}") from e
        if not isinstance(table, dict):
            raise TypeError(f"the {tool.name} tool's handlers {ref} are not a dict of message type -> handler")
        for msg_type, handler in table.items():
            known = SYSTEM_HANDLERS.get(msg_type)
            if known is not None and known is not handler:
                raise ValueError(f"the {tool.name} tool's handler of {msg_type.__name__} ({ref}) would replace "
                                 f"{known!r}")
        SYSTEM_HANDLERS.update(table)


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


def api(tool: str, name: str) -> Callable[..., Any]:
    """The function that tool ``tool`` registered as ``name`` in its ``api``, its module imported on first
    use: what a facade of a lower layer delegates to. A tool or name not registered is a ``LookupError``."""
    entry = _tools.get(tool)
    if entry is None:
        raise LookupError(f"no tool named {tool!r} is registered (monarch_tensor/__init__.py registers the tools)")
    for key, ref in entry.api:
        if key == name:
            return _function(ref)
    raise LookupError(f"the {tool} tool has no api function {name!r} (it has {[k for k, _ in entry.api]})")


def session_end(client_addrs: Iterable[str], loaded_only: bool = False) -> None:
    """A client session's procs on this host are gone: each tool's ``session_end`` removes what it keeps for
    it here. ``loaded_only``: only the tools whose hook's module this process imported (a script exiting: a
    tool it never used has nothing of its session). Best effort, as ``client_gone``."""
    addrs = tuple(client_addrs)
    for tool in tools():
        if tool.session_end is None:
            continue
        if loaded_only and tool.session_end.partition(":")[0] not in sys.modules:
            continue
        try:
            _function(tool.session_end)(addrs)
        except Exception as e:  # noqa: BLE001 - cleanup after a session is best effort
            print(f"monarch_tensor: the {tool.name} tool's cleanup after session {addrs} failed: {e!r}",
                  file=sys.stderr)
