"""``monarch_tensor.hosts.host`` gathers the modules host meshes and proc meshes are made of: every name they
define reads through it as the very same object, and the globals they rebind read live (no procs)."""

from __future__ import annotations

import inspect

import pytest

from monarch_tensor.hosts import (
    _failures,
    _script_proc,
    _shutdown,
    _spawn,
    _supervision,
    host,
    host_mesh,
    proc_mesh,
)

PARTS = (proc_mesh, host_mesh, _spawn, _script_proc, _failures, _supervision, _shutdown)


def test_every_function_and_class_of_the_parts_reads_through_host():
    missing = []
    for part in PARTS:
        for name, value in vars(part).items():
            if (inspect.isfunction(value) or inspect.isclass(value)) and value.__module__ == part.__name__:
                if getattr(host, name, None) is not value:
                    missing.append(f"{part.__name__}.{name}")
    assert not missing, missing


def test_the_public_names_and_the_state_others_read_are_there():
    for name in ("ProcMesh", "HostMesh", "ScriptProc", "this_host", "this_proc", "proc_mesh", "heal_mesh",
                 "shutdown_context", "local_host", "local_procs", "bootstrap_plan", "HOST_PYTHON_ENV"):
        assert getattr(host, name) is not None, name
    assert host._live_meshes is proc_mesh._live_meshes and host.stopped_addrs is proc_mesh.stopped_addrs
    assert host._interrupted_for is _supervision._interrupted_for


def test_rebound_globals_read_live(monkeypatch):
    for module, name in ((proc_mesh, "_local_host"), (_script_proc, "_script_mesh"), (_supervision, "_supervisor")):
        marker = object()
        monkeypatch.setattr(module, name, marker)
        assert getattr(host, name) is marker, name
    with pytest.raises(AttributeError, match="has no attribute '_no_such_name'"):
        host._no_such_name  # noqa: B018
