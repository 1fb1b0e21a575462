"""Monarch's module paths for the tensor engine's names (code written for Monarch imports them with the package
renamed), and an install that carries every package of this project."""

import importlib
import os
import shutil
import sys

import pytest
import tomllib

import monarch_tensor
from monarch_tensor.errors import MeshStoppedError
from monarch_tensor.hosts.host import ProcMesh

pytestmark = pytest.mark.timeout(60)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Monarch's path -> names, each the same object as monarch_tensor's top-level name
PATHS = {
    "fetch": ["fetch_shard", "inspect", "show", "call_on_shard_and_fetch"],
    "common.remote": ["remote", "call_on_shard_and_fetch"],
    "common.opaque_ref": ["OpaqueRef"],
    "common.stream": ["Stream", "get_active_stream"],
    "common.device_mesh": ["no_mesh", "get_active_mesh", "to_mesh", "slice_mesh", "RemoteProcessGroup",
                           "DeviceMesh"],
    "common.tensor": ["Tensor", "reduce", "reduce_"],
    "common.future": ["Future"],
    "common.selection": ["Selection"],
    "opaque_object": ["OpaqueObject", "opaque_method"],
    "mesh_controller": ["spawn_tensor_engine", "RemoteException"],
}
# Names of Monarch's paths that are no top-level name of monarch_tensor: what each is here.
OWN = {"DeviceMesh": lambda: ProcMesh,
       "spawn_tensor_engine": lambda: importlib.import_module("monarch_tensor.mesh_controller").spawn_tensor_engine}


@pytest.mark.parametrize("path", sorted(PATHS))
def test_monarchs_paths_give_the_same_objects(path):
    mod = importlib.import_module(f"monarch_tensor.{path}")
    for name in PATHS[path]:
        want = OWN[name]() if name in OWN else getattr(monarch_tensor, name)
        assert getattr(mod, name) is want, (path, name)
    assert sorted(mod.__all__) == sorted(PATHS[path])


def test_spawn_tensor_engine_gives_the_mesh_to_activate():
    import torch

    from monarch_tensor import fetch_shard, this_host
    from monarch_tensor.common.device_mesh import DeviceMesh
    from monarch_tensor.mesh_controller import spawn_tensor_engine

    procs = this_host().spawn_procs({"gpus": 2})
    try:
        dm = spawn_tensor_engine(procs)
        assert isinstance(dm, DeviceMesh) and this_host().is_fake_in_process is False
        with dm.activate():
            t = torch.ones(3) + dm.rank("gpus")
        assert fetch_shard(t, gpus=1).result().tolist() == [2.0, 2.0, 2.0]
        with pytest.raises(TypeError, match="takes a proc mesh.*got HostMesh"):
            spawn_tensor_engine(this_host())
    finally:
        procs.stop().get(timeout=30)
    with pytest.raises(MeshStoppedError):
        spawn_tensor_engine(procs)


def test_opaque_module_path():
    from monarch_tensor.controller.opaque_module import OpaqueModule

    from monarch_tensor.opaque_module import OpaqueModule as via_path

    assert via_path is OpaqueModule


def test_show_without_torchshow_says_how_to_get_it():
    try:
        import torchshow  # noqa: F401
    except ImportError:
        with pytest.raises(ImportError, match="pip install torchshow"):
            monarch_tensor.show(object())
    else:
        pytest.skip("torchshow is installed here")


def test_the_install_lists_every_package():
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        listed = set(tomllib.load(f)["tool"]["setuptools"]["packages"])
    found = set()
    for top in ("monarch_tensor", "controller", "worker", "rdma"):  # (the last three install inside the first)
        for d, _, files in os.walk(os.path.join(ROOT, top)):
            if "__init__.py" in files:
                name = os.path.relpath(d, ROOT).replace(os.sep, ".")
                found.add(name if top == "monarch_tensor" else "monarch_tensor." + name)
    assert found == listed


@pytest.mark.timeout(120)
def test_the_wheel_installs_one_top_level_package(tmp_path):
    """Nothing named controller, worker or rdma lands in site-packages: the repository's folders install as
    sub-packages of monarch_tensor (pyproject.toml's package-dir)."""
    import subprocess
    import zipfile

    build = tmp_path / "src"
    shutil.copytree(ROOT, build, ignore=shutil.ignore_patterns(".venv", ".git", "build", "*.egg-info", "bench",
                                                                "tests", "docs", "examples"))
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w",
                        str(tmp_path / "dist"), str(build)], capture_output=True, text=True, timeout=110)
    assert r.returncode == 0, r.stderr
    (wheel,) = (tmp_path / "dist").glob("*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")} == {"monarch_tensor"}
    for path in ("monarch_tensor/controller/api.py", "monarch_tensor/worker/worker.py",
                 "monarch_tensor/rdma/backends/tcp.py", "monarch_tensor/rdma/__init__.py"):
        assert path in names, path
