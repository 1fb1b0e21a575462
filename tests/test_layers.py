"""The layers import downwards only: every import statement (those inside functions too) of the runtime, the
data plane and the workers, checked against the layering rules (no processes: a static check)."""

from __future__ import annotations

import ast
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = ("monarch_tensor", "controller", "worker", "rdma")

# The runtime's seam toward the tensor engine and the data plane (monarch_tensor/_seams.py), and the public
# modules that re-export names of those layers (the package's own monarch_tensor.rdma, Monarch's module paths):
# the only runtime modules that may import them.
SEAM = "monarch_tensor._seams"
PUBLIC_FACES = {
    "monarch_tensor.rdma", "monarch_tensor.fetch", "monarch_tensor.random", "monarch_tensor.profiler",
    "monarch_tensor.cached_remote_function", "monarch_tensor.checkpoint", "monarch_tensor.gradient_generator",
    "monarch_tensor.opaque_module", "monarch_tensor.opaque_object", "monarch_tensor.mesh_controller",
    "monarch_tensor.timer.remote_execution_timer",
}
PUBLIC_PACKAGES = ("monarch_tensor.common", "monarch_tensor.builtins")

# The transport (messages, their encoding, mailboxes) and the values every layer uses: below the proc runtime,
# the actor layer, hosts and jobs.
CORE = {"monarch_tensor." + m for m in ("mailbox", "_wire", "_net", "_shm", "messages", "future", "shape",
                                         "selection", "config", "errors", "_threads", "_ports")}
ABOVE_CORE = tuple("monarch_tensor." + m for m in ("_proc", "_zygote", "actor", "host", "agent", "job",
                                                    "remote_hosts", "debugger", "workspace_sync", "env", "cli"))


def _module(path: str) -> str:
    name = os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".")
    return name[: -len(".__init__")] if name.endswith(".__init__") else name


def _imports() -> list[tuple[str, str, int]]:
    """(importing module, imported module, line) for every import statement of the four packages."""
    out = []
    for pkg in PACKAGES:
        for dirpath, _, files in os.walk(os.path.join(ROOT, pkg)):
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
                            names = [".".join(base + ([node.module] if node.module else []))]
                        else:
                            names = [node.module or ""]
                    else:
                        continue
                    out.extend((mod, n, node.lineno) for n in names if n.split(".")[0] in PACKAGES)
    return out


def _under(name: str, prefixes) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def test_the_runtime_reaches_the_tensor_engine_and_the_data_plane_only_through_its_seam():
    wrong = [(a, b, line) for a, b, line in _imports()
             if _under(a, ("monarch_tensor",)) and _under(b, ("controller", "worker", "rdma"))
             and a != SEAM and a not in PUBLIC_FACES and not _under(a, PUBLIC_PACKAGES)]
    assert not wrong, "runtime modules importing a layer above them (use monarch_tensor._seams):\n" + "\n".join(
        f"  {a}:{line} imports {b}" for a, b, line in wrong)


def test_the_data_plane_and_the_workers_import_no_layer_above_them():
    wrong = [(a, b, line) for a, b, line in _imports()
             if (_under(a, ("rdma",)) and _under(b, ("controller", "worker")))
             or (_under(a, ("worker",)) and _under(b, ("controller",)))]
    assert not wrong, "\n".join(f"  {a}:{line} imports {b}" for a, b, line in wrong)


def test_the_transport_imports_nothing_above_it():
    wrong = [(a, b, line) for a, b, line in _imports() if a in CORE and _under(b, ABOVE_CORE)]
    assert not wrong, "\n".join(f"  {a}:{line} imports {b}" for a, b, line in wrong)


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
    (pkg / "bad.py").write_text("def f():\n    from controller.api import activate\n")
    monkeypatch.setattr(__import__(__name__), "ROOT", str(tmp_path))
    found = _imports()
    assert ("monarch_tensor.bad", "monarch_tensor.controller.api", 2) in found
