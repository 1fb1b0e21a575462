"""Monarch's module paths for the tensor engine's names (code written for Monarch imports them with the package
renamed), and an install that carries every package of this project."""

import importlib
import os

import pytest
import tomllib

import monarch_tensor

pytestmark = pytest.mark.timeout(60)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Monarch's path -> names, each the same object as monarch_tensor's top-level name
PATHS = {
    "fetch": ["fetch_shard", "inspect", "show", "call_on_shard_and_fetch"],
    "common.remote": ["remote", "call_on_shard_and_fetch"],
    "common.opaque_ref": ["OpaqueRef"],
    "common.stream": ["Stream", "get_active_stream"],
    "common.device_mesh": ["no_mesh", "get_active_mesh", "to_mesh", "slice_mesh", "RemoteProcessGroup"],
    "common.tensor": ["Tensor", "reduce", "reduce_"],
    "common.future": ["Future"],
    "common.selection": ["Selection"],
    "opaque_object": ["OpaqueObject", "opaque_method"],
}


@pytest.mark.parametrize("path", sorted(PATHS))
def test_monarchs_paths_give_the_same_objects(path):
    mod = importlib.import_module(f"monarch_tensor.{path}")
    for name in PATHS[path]:
        assert getattr(mod, name) is getattr(monarch_tensor, name), (path, name)
    assert sorted(mod.__all__) == sorted(PATHS[path])


def test_opaque_module_path():
    from controller.opaque_module import OpaqueModule
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
    for top in ("monarch_tensor", "controller", "worker", "rdma"):
        for d, _, files in os.walk(os.path.join(ROOT, top)):
            if "__init__.py" in files:
                found.add(os.path.relpath(d, ROOT).replace(os.sep, "."))
    assert found == listed
