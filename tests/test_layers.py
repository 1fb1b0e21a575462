"""The layers import downwards only: every import statement (those inside functions too) of the runtime, the
data plane and the workers, checked against the layering rules (no processes: a static check)."""

from __future__ import annotations

import ast
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The repository's folders and the packages they install as (the last three are sub-packages of the first).
FOLDERS = {"monarch_tensor": "monarch_tensor", "controller": "monarch_tensor.controller",
           "worker": "monarch_tensor.worker", "rdma": "monarch_tensor.rdma"}
ENGINE, WORKERS, DATA_PLANE = "monarch_tensor.controller", "monarch_tensor.worker", "monarch_tensor.rdma"
UPPER = (ENGINE, WORKERS, DATA_PLANE)

# The runtime's seam toward the tensor engine and the data plane (monarch_tensor/_seams.py), and the public
# modules that re-export names of those layers (Monarch's module paths): the only runtime modules that may
# import them.
SEAM = "monarch_tensor._seams"
PUBLIC_FACES = {
    "monarch_tensor.fetch", "monarch_tensor.random", "monarch_tensor.profiler",
    "monarch_tensor.cached_remote_function", "monarch_tensor.checkpoint", "monarch_tensor.gradient_generator",
    "monarch_tensor.opaque_module", "monarch_tensor.opaque_object", "monarch_tensor.mesh_controller",
    "monarch_tensor.timer.remote_execution_timer",
}
PUBLIC_PACKAGES = ("monarch_tensor.common", "monarch_tensor.builtins")

# The runtime's folders, bottom up (docs/how-it-works.md): the transport and the values every layer uses, the
# proc runtime, the actor layer, hosts and host agents, the tools. A layer imports the ones below it.
TRANSPORT = "monarch_tensor.transport"
VALUES = {"monarch_tensor." + m for m in ("future", "shape", "selection", "config", "errors", "exceptions",
                                          "_settings", "_seams")}
RUNTIME, ACTOR, HOSTS = "monarch_tensor.runtime", "monarch_tensor.actor", "monarch_tensor.hosts"
TOOLS = tuple("monarch_tensor." + m for m in ("debugger", "workspace_sync", "env"))
ABOVE_CORE = (RUNTIME, ACTOR, HOSTS, *TOOLS, "monarch_tensor.job", "monarch_tensor.tools", "monarch_tensor.cli",
              "monarch_tensor.spmd", "monarch_tensor.utils", "monarch_tensor.distributed")


def _module(path: str) -> str:
    folder, _, rest = os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".").partition(".")
    name = FOLDERS[folder] + "." + rest
    return name[: -len(".__init__")] if name.endswith(".__init__") else name


def _all_modules() -> set[str]:
    return {_module(os.path.join(dirpath, f)) for folder in FOLDERS
            for dirpath, _, files in os.walk(os.path.join(ROOT, folder)) for f in files if f.endswith(".py")}


def _imports() -> list[tuple[str, str, int]]:
    """(importing module, imported module, line) for every import statement of the four folders; ``from pkg
    import name`` imports module ``pkg.name`` where that is a module."""
    out = []
    modules = _all_modules()
    for folder in FOLDERS:
        for dirpath, _, files in os.walk(os.path.join(ROOT, folder)):
            for f in files:
                if not f.endswith(".py"):
                    continue
                path = os.path.join(dirpath, f)
                mod = _module(path)
                with open(path) as fh:
                    tree = ast.parse(fh.read(), path)
                for node in ast.walk(tree):
                    if isinstance(node, ast.Import):
                        names = [a.name for a in node.names]
                    elif isinstance(node, ast.ImportFrom):
                        if node.level:
                            base = mod.split(".")[: None if f == "__init__.py" else -1]
                            base = base[: len(base) - node.level + 1]
                            frm = ".".join(base + ([node.module] if node.module else []))
                        else:
                            frm = node.module or ""
                        names = [f"{frm}.{a.name}" if f"{frm}.{a.name}" in modules else frm for a in node.names]
                    else:
                        continue
                    out.extend((mod, n, node.lineno) for n in names if n.split(".")[0] in FOLDERS)
    return out


def _under(name: str, prefixes) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def test_the_runtime_reaches_the_tensor_engine_and_the_data_plane_only_through_its_seam():
    wrong = [(a, b, line) for a, b, line in _imports()
             if not _under(a, UPPER) and _under(b, UPPER)
             and a != SEAM and a not in PUBLIC_FACES and not _under(a, PUBLIC_PACKAGES)]
    assert not wrong, "runtime modules importing a layer above them (use monarch_tensor._seams):\n" + "\n".join(
        f"  {a}:{line} imports {b}" for a, b, line in wrong)


def test_the_data_plane_and_the_workers_import_no_layer_above_them():
    wrong = [(a, b, line) for a, b, line in _imports()
             if (_under(a, (DATA_PLANE,)) and _under(b, (ENGINE, WORKERS)))
             or (_under(a, (WORKERS,)) and _under(b, (ENGINE,)))]
    assert not wrong, "\n".join(f"  {a}:{line} imports {b}" for a, b, line in wrong)


def test_the_transport_imports_nothing_above_it():
    """The transport (and the values every layer uses) imports no proc runtime, actors, hosts or tools."""
    core = [(a, b, line) for a, b, line in _imports() if _under(a, (TRANSPORT,)) or a in VALUES]
    assert core, "no module of the transport found"
    wrong = [(a, b, line) for a, b, line in core if _under(b, ABOVE_CORE)]
    assert not wrong, "\n".join(f"  {a}:{line} imports {b}" for a, b, line in wrong)


def test_the_proc_runtime_imports_no_actors_hosts_or_tools():
    """The tools plug into a proc through ``runtime/_hooks.py``; the actor layer and hosts through hooks the
    runtime defines (``_context.this_proc_hook``)."""
    wrong = [(a, b, line) for a, b, line in _imports()
             if _under(a, (RUNTIME,)) and _under(b, (ACTOR, HOSTS, *TOOLS, "monarch_tensor.job"))]
    assert not wrong, "\n".join(f"  {a}:{line} imports {b}" for a, b, line in wrong)


def test_the_actor_layer_and_the_tools_import_no_job_or_cli():
    wrong = [(a, b, line) for a, b, line in _imports() if _under(a, (ACTOR, HOSTS, *TOOLS))
             and _under(b, ("monarch_tensor.job", "monarch_tensor.cli"))]
    assert not wrong, "\n".join(f"  {a}:{line} imports {b}" for a, b, line in wrong)


def _tool_names_in_strings() -> list[tuple[str, str, int]]:
    """(module, string, line) for every string constant of the transport, the proc runtime, the actor layer and
    hosts that names a tool's module (``sys.modules.get("monarch_tensor.workspace_sync._proc")``, an
    ``importlib`` call): an import by another name. (The protocol modules whose records a salvage may rebuild
    are named to the transport from above: ``_wire.add_envelope_modules``.)"""
    out = []
    for dirpath, _, files in os.walk(os.path.join(ROOT, "monarch_tensor")):
        for f in files:
            if not f.endswith(".py"):
                continue
            path = os.path.join(dirpath, f)
            mod = _module(path)
            if not _under(mod, (TRANSPORT, RUNTIME, ACTOR, HOSTS)):
                continue
            with open(path) as fh:
                tree = ast.parse(fh.read(), path)
            out += [(mod, node.value, node.lineno) for node in ast.walk(tree)
                    if isinstance(node, ast.Constant) and isinstance(node.value, str) and _under(node.value, TOOLS)]
    return out


def test_hosts_and_actors_reach_the_tools_only_through_the_runtimes_hooks():
    """The public methods of hosts that a tool serves (``ProcMesh.sync_workspace``, ``ProcMesh.env``,
    ``HostMesh.sync_workspace``) delegate to what the tool registered (``_hooks.api``), and a host agent's
    cleanup after a session calls the tools' ``session_end``: the hosts layer imports no tool, not even by
    its name in a string."""
    wrong = [f"  {a}:{line} imports {b}" for a, b, line in _imports()
             if _under(a, (ACTOR, HOSTS)) and _under(b, TOOLS)]
    wrong += [f"  {a}:{line} names {b!r}" for a, b, line in _tool_names_in_strings()]
    assert not wrong, "\n".join(wrong)


def test_the_string_check_finds_a_tool_named_in_a_lower_layer(tmp_path, monkeypatch):
    pkg = tmp_path / "monarch_tensor" / "hosts"
    pkg.mkdir(parents=True)
    (pkg / "bad.py").write_text("import sys\nsync = sys.modules.get('monarch_tensor.workspace_sync._proc')\n")
    monkeypatch.setattr(__import__(__name__), "ROOT", str(tmp_path))
    assert _tool_names_in_strings() == [("monarch_tensor.hosts.bad", "monarch_tensor.workspace_sync._proc", 2)]


def test_every_tool_plugs_into_the_procs_through_the_runtimes_hooks():
    """Each tool package has an entry in ``runtime/_hooks.py``'s registry (made in ``monarch_tensor/__init__.py``)
    whose modules import and whose hooks are functions: its proc side is loaded in every proc."""
    from monarch_tensor.runtime import _hooks

    tools = {t.name: t for t in _hooks.tools()}
    assert set(tools) == {pkg.rsplit(".", 1)[1] for pkg in TOOLS}, sorted(tools)
    for pkg in TOOLS:
        tool = tools[pkg.rsplit(".", 1)[1]]
        assert pkg + "._proc" in tool.serves, tool
        for module in tool.serves:
            assert _under(module, (pkg,)), (tool.name, module)
        for ref in (tool.start, tool.client_gone, tool.session_end, *(r for _, r in tool.api)):
            if ref is not None:
                assert _under(ref.partition(":")[0], (pkg,)) and callable(_hooks._function(ref)), (tool.name, ref)
        for ref in tool.handlers:
            assert _under(ref.partition(":")[0], (pkg,)) and isinstance(_hooks._function(ref), dict), (tool.name, ref)
    # (a tool's module that handles messages says so in its entry: importing it installs nothing)
    import importlib

    for pkg in TOOLS:
        for name in (pkg, pkg + "._proc"):
            if isinstance(getattr(importlib.import_module(name), "HANDLERS", None), dict):
                assert name + ":HANDLERS" in tools[pkg.rsplit(".", 1)[1]].handlers, name


def test_every_seam_entry_exists():
    import importlib

    from monarch_tensor import _seams

    for name, (module, attr) in _seams.ENTRIES.items():
        m = importlib.import_module(module)
        assert attr is None or hasattr(m, attr), (name, module, attr)


def test_the_check_finds_an_upward_import(tmp_path, monkeypatch):
    """The rules are not vacuous: a runtime module importing the engine is caught."""
    pkg = tmp_path / "monarch_tensor"
    pkg.mkdir()
    (pkg / "bad.py").write_text("def f():\n    from monarch_tensor.controller.api import activate\n")
    monkeypatch.setattr(__import__(__name__), "ROOT", str(tmp_path))
    found = _imports()
    assert ("monarch_tensor.bad", "monarch_tensor.controller.api", 2) in found


def test_the_engines_folders_are_imported_only_as_sub_packages():
    """``controller``, ``worker`` and ``rdma`` are imported as ``monarch_tensor.controller`` (...) everywhere:
    the same file imported under its folder's name too would be a second module (a second ``Tensor`` class,
    a second registry), and an install has no top-level packages of those names."""
    wrong = []
    for top in ("monarch_tensor", "controller", "worker", "rdma", "tests", "bench", "examples"):
        for dirpath, _, files in os.walk(os.path.join(ROOT, top)):
            for f in files:
                if not f.endswith(".py"):
                    continue
                path = os.path.join(dirpath, f)
                with open(path) as fh:
                    tree = ast.parse(fh.read(), path)
                for node in ast.walk(tree):
                    if isinstance(node, ast.Import):
                        names = [a.name for a in node.names]
                    elif isinstance(node, ast.ImportFrom) and not node.level:
                        names = [node.module or ""]
                    else:
                        continue
                    wrong += [f"{os.path.relpath(path, ROOT)}:{node.lineno} imports {n}" for n in names
                              if n.split(".")[0] in ("controller", "worker", "rdma")]
    assert not wrong, "\n".join(wrong)


# controller/api.py gathers the engine's public functions from the modules of their concerns. Those import one
# another in this order (each only earlier ones), and no module of the engine imports api: it is the face that
# the runtime's seam, Monarch's paths and users import.
API = ENGINE + ".api"
API_PARTS = [f"{ENGINE}.{m}" for m in ("streams", "activation", "collectives", "fetching", "moving",
                                        "remote_functions", "actor_calls")]
# activation installs torch's patches (torch_patches), which use moving and remote functions: in that cycle a
# module imports its siblings as modules (``from . import activation``), never their names, so that it
# imports whichever of them comes first.
PATCH_CYCLE = {f"{ENGINE}.{m}" for m in ("activation", "torch_patches", "moving", "remote_functions", "fetching")}


def _engine_imports() -> list[tuple[str, str, int, bool]]:
    """(module, engine module it imports, line, whether it imports names from it) for the engine's folder,
    ``from . import x`` read as an import of module ``x``."""
    out = []
    folder = os.path.join(ROOT, "controller")
    for f in sorted(os.listdir(folder)):
        if not f.endswith(".py"):
            continue
        path = os.path.join(folder, f)
        mod = _module(path)
        with open(path) as fh:
            tree = ast.parse(fh.read(), path)
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.level == 1 and node.module is None:
                out += [(mod, f"{ENGINE}.{a.name}", node.lineno, False) for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 1:
                out.append((mod, f"{ENGINE}.{node.module}", node.lineno, True))
            elif isinstance(node, ast.ImportFrom) and node.module and _under(node.module, (ENGINE,)):
                out.append((mod, node.module, node.lineno, True))
    return out


def test_the_engines_api_is_gathered_from_its_parts_which_import_downwards():
    found = _engine_imports()
    assert any(a == API for a, *_ in found) and all(p.rsplit(".", 1)[1] + ".py" in os.listdir(
        os.path.join(ROOT, "controller")) for p in API_PARTS)
    wrong = [f"  {a}:{line} imports {b} (api is the engine's face; import the module of the concern)"
             for a, b, line, _ in found if b == API]
    order = {p: i for i, p in enumerate(API_PARTS)}
    wrong += [f"  {a}:{line} imports {b}, which comes after it ({[p.rsplit('.', 1)[1] for p in API_PARTS]})"
              for a, b, line, _ in found if a in order and b in order and order[b] >= order[a]]
    wrong += [f"  {a}:{line} imports names from {b}: import the module (`from . import x`), as its cycle needs"
              for a, b, line, by_name in found if a in PATCH_CYCLE and b in PATCH_CYCLE and by_name]
    assert not wrong, "\n".join(wrong)


def test_every_part_of_the_engines_api_imports_first():
    """Each module of the patch cycle imports first without an error (the order the cycle allows does not
    depend on which module a script reaches first): in one fresh interpreter, the engine's modules are
    forgotten between tries."""
    import subprocess
    import sys

    code = f"""
import importlib, sys, torch
import monarch_tensor
for first in {sorted(PATCH_CYCLE | set(API_PARTS))!r}:
    for name in [n for n in sys.modules if n.startswith("{ENGINE}.") or n == "{ENGINE}"]:
        del sys.modules[name]
    importlib.import_module(first)
    print("ok", first)
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert r.returncode == 0 and r.stdout.count("ok ") == len(PATCH_CYCLE | set(API_PARTS)), r.stderr[-3000:]
