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


def test_a_tools_handlers_are_installed_by_load_or_install_and_a_clash_is_an_error(registry, monkeypatch):
    from monarch_tensor.transport import mailbox

    monkeypatch.setattr(mailbox, "SYSTEM_HANDLERS", dict(mailbox.SYSTEM_HANDLERS))
    monkeypatch.setattr(_hooks, "SYSTEM_HANDLERS", mailbox.SYSTEM_HANDLERS)

    class Ping:
        pass

    mod = __import__("sys").modules["mt_fake_tool"]
    mod.HANDLERS = {Ping: lambda mb, msg: None}
    mod.OTHER = {Ping: lambda mb, msg: None}
    mod.NOT_A_DICT = [Ping]
    _hooks.register("pinger", serves=("mt_fake_tool",), handlers=("mt_fake_tool:HANDLERS",))
    assert Ping not in mailbox.SYSTEM_HANDLERS  # (registering installs nothing)
    _hooks.load()
    assert mailbox.SYSTEM_HANDLERS[Ping] is mod.HANDLERS[Ping]
    _hooks.install("pinger")  # again: no change
    _hooks.register("clash", handlers=("mt_fake_tool:OTHER",))
    with pytest.raises(ValueError, match="the clash tool's handler of Ping .* would replace"):
        _hooks.install("clash")
    _hooks.register("odd", handlers=("mt_fake_tool:NOT_A_DICT",))
    with pytest.raises(TypeError, match="not a dict"):
        _hooks.install("odd")
    with pytest.raises(LookupError, match="no tool named 'ghost'"):
        _hooks.install("ghost")


_IMPORT_INSTALLS_NOTHING = """
import monarch_tensor
from monarch_tensor.env import _proc as env_proc
from monarch_tensor.env.messages import ReadEnv
from monarch_tensor.runtime import _hooks
from monarch_tensor.transport.mailbox import SYSTEM_HANDLERS
from monarch_tensor.workspace_sync import _proc as sync_proc
from monarch_tensor.workspace_sync.messages import WriteFiles
from monarch_tensor.debugger.messages import DebugRegister
print(DebugRegister in SYSTEM_HANDLERS, ReadEnv in SYSTEM_HANDLERS, WriteFiles in SYSTEM_HANDLERS)
_hooks.load()
print(SYSTEM_HANDLERS[ReadEnv] is env_proc.HANDLERS[ReadEnv], SYSTEM_HANDLERS[WriteFiles] is sync_proc.HANDLERS[WriteFiles])
"""


def test_importing_a_tools_module_installs_no_handler_and_the_registry_installs_them():
    """The package installs the debugger's handlers in every process; the other tools' handlers come with
    ``load()`` (procs), not with an import of their modules."""
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    p = subprocess.run([sys.executable, "-c", _IMPORT_INSTALLS_NOTHING], capture_output=True, text=True, timeout=60,
                       env=dict(os.environ, PYTHONPATH=root))
    assert p.returncode == 0, p.stderr[-3000:]
    assert p.stdout.split() == ["True", "False", "False", "True", "True"], p.stdout
