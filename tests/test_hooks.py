"""The tools' hooks in every proc (``monarch_tensor/runtime/_hooks.py``): the registry's checks, a failing hook
reported without stopping the others, and the template's cleanup after a killed client reaching the tools
(no procs: unit tests)."""

from __future__ import annotations

import os
import types

import pytest

from monarch_tensor.debugger import _server as debug_server
from monarch_tensor.runtime import _hooks, _zygote
from monarch_tensor.workspace_sync import _proc as sync_proc


@pytest.fixture
def registry(monkeypatch):
    """An empty registry for the test, and a module ``mt_fake_tool`` whose hooks record their calls."""
    monkeypatch.setattr(_hooks, "_tools", {})
    calls: list = []
    mod = types.ModuleType("mt_fake_tool")
    mod.start = lambda rt: calls.append(("start", rt))
    mod.fail = lambda rt: 1 / 0
    mod.gone = lambda pid, addrs: calls.append(("gone", pid, addrs))
    mod.gone_fails = lambda pid, addrs: [][0]
    monkeypatch.setitem(__import__("sys").modules, "mt_fake_tool", mod)
    return calls


def test_register_refuses_what_it_could_not_call(registry):
    for bad in ({"start": "mt_fake_tool.start"}, {"start": ":start"}, {"client_gone": "mt_fake_tool:"},
                {"start": 3}, {"serves": ("mt_fake_tool:start",)}, {"serves": ("",)}):
        with pytest.raises(ValueError, match="tool 'x'"):
            _hooks.register("x", **bad)
    assert _hooks.tools() == []
    _hooks.register("x", serves=("mt_fake_tool",), start="mt_fake_tool:start")
    _hooks.register("x", serves=("mt_fake_tool",), start="mt_fake_tool:start")  # the same again: no change
    with pytest.raises(ValueError, match="registered already"):
        _hooks.register("x", serves=("mt_fake_tool",))
    assert [t.name for t in _hooks.tools()] == ["x"]


def test_a_failing_start_hook_is_reported_and_the_other_tools_still_start(registry, capsys):
    _hooks.register("first", start="mt_fake_tool:fail")
    _hooks.register("second", serves=("mt_fake_tool",), start="mt_fake_tool:start")
    _hooks.start("rt")
    assert registry == [("start", "rt")]
    assert "the first tool's start hook failed in this proc: ZeroDivisionError" in capsys.readouterr().err


def test_a_tool_module_that_cannot_be_imported_is_an_error_naming_the_tool(registry):
    _hooks.register("ghost", serves=("mt_no_such_tool_module",))
    with pytest.raises(ImportError, match="the ghost tool's module mt_no_such_tool_module cannot be imported"):
        _hooks.load()
    with pytest.raises(ImportError, match="ghost"):
        _hooks.start("rt")


def test_client_gone_runs_every_tools_cleanup_even_after_one_fails(registry, capsys):
    _hooks.register("a", client_gone="mt_fake_tool:gone_fails")
    _hooks.register("b", client_gone="mt_fake_tool:gone")
    _hooks.client_gone(123, iter(["ipc://x"]))
    assert registry == [("gone", 123, ("ipc://x",))]
    assert "the a tool's cleanup after client 123 failed: IndexError" in capsys.readouterr().err


def test_the_templates_cleanup_after_a_killed_client_reaches_the_tools():
    """With the package's own registry: the client's default workspace root and its debug server's file go."""
    pid = (1 << 22) + os.getpid()  # above Linux's largest pid: no live process has it
    addr = f"ipc:///nowhere/client-{pid}-test"
    root = sync_proc.default_root(sync_proc.client_key(addr))
    os.makedirs(os.path.join(root, "d"))
    with open(debug_server.info_path(pid), "w") as f:
        f.write("{}")
    _zygote._remove_files_of(pid, [], [addr])
    assert not os.path.exists(root)
    assert not os.path.exists(debug_server.info_path(pid))


def test_a_tools_api_is_what_a_facade_calls_and_an_unknown_one_is_named(registry):
    mod = __import__("sys").modules["mt_fake_tool"]
    mod.double = lambda x: 2 * x
    _hooks.register("calc", api={"double": "mt_fake_tool:double"})
    assert _hooks.api("calc", "double")(21) == 42
    with pytest.raises(LookupError, match="the calc tool has no api function 'triple'"):
        _hooks.api("calc", "triple")
    with pytest.raises(LookupError, match="no tool named 'nothing'"):
        _hooks.api("nothing", "double")
    for bad in ({"double": "mt_fake_tool.double"}, {"not a name": "mt_fake_tool:double"}, ["double"]):
        with pytest.raises(ValueError, match="tool 'y'"):
            _hooks.register("y", api=bad)


def test_session_end_reaches_the_tools_and_loaded_only_skips_those_this_process_never_imported(registry, capsys):
    mod = __import__("sys").modules["mt_fake_tool"]
    mod.ended = lambda addrs: registry.append(("ended", addrs))
    mod.ended_fails = lambda addrs: 1 / 0
    _hooks.register("used", session_end="mt_fake_tool:ended_fails")
    _hooks.register("used_too", session_end="mt_fake_tool:ended")
    _hooks.register("never_imported", session_end="mt_no_such_tool_module:ended")
    _hooks.session_end(iter(["ipc://a"]), loaded_only=True)
    assert registry == [("ended", ("ipc://a",))]
    assert "the used tool's cleanup after session ('ipc://a',) failed: ZeroDivisionError" in capsys.readouterr().err
    _hooks.session_end(["ipc://b"])  # every tool: the one whose module is missing says so, the others run
    assert registry[-1] == ("ended", ("ipc://b",))
    assert "the never_imported tool's cleanup" in capsys.readouterr().err


def test_the_packages_facades_reach_the_tools_functions():
    """With the package's own registry: what ``ProcMesh.sync_workspace``, ``HostMesh.sync_workspace`` and
    ``ProcMesh.env`` delegate to, and a session's end removing its default workspace root."""
    import monarch_tensor.env
    import monarch_tensor.workspace_sync

    assert _hooks.api("workspace_sync", "sync_workspace") is monarch_tensor.workspace_sync.sync_workspace
    assert _hooks.api("workspace_sync", "sync_this_host") is monarch_tensor.workspace_sync.sync_this_host
    assert _hooks.api("env", "ProcEnv") is monarch_tensor.env.ProcEnv
    addr = f"ipc:///nowhere/client-{(1 << 22) + os.getpid()}-session"
    root = sync_proc.default_root(sync_proc.client_key(addr))
    os.makedirs(os.path.join(root, "d"))
    _hooks.session_end([addr], loaded_only=True)
    assert not os.path.exists(root)
