"""Mesh tensors inside any container a user passes (OrderedDict, defaultdict, named tuple, dataclass, nested)
arrive on the workers as local tensors in a container of the same type; one where it cannot be resolved
(an object's attribute, a set) is refused at the call, the error naming where it sits."""

from __future__ import annotations

import collections
import dataclasses
import typing

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from monarch_tensor.worker.containers import rebuild

from monarch_tensor import MeshTensorError, fetch_shard, remote

pytestmark = pytest.mark.timeout(120)


class Pair(typing.NamedTuple):
    a: typing.Any
    b: typing.Any


@dataclasses.dataclass
class Box:
    x: typing.Any
    y: typing.Any = None


@dataclasses.dataclass(frozen=True)
class Frozen:
    x: typing.Any


class Holder:
    def __init__(self, w) -> None:
        self.w = w


def _make(spec):
    """The tree ``spec`` describes, its tensors made where the code runs (the mesh inside activate())."""
    kind, body = spec
    if kind == "t":
        return torch.tensor(body)
    if kind == "v":
        return body
    items = [_make(s) for s in body]
    if kind == "list":
        return items
    if kind == "tuple":
        return tuple(items)
    if kind == "dict":
        return {f"k{i}": x for i, x in enumerate(items)}
    if kind == "odict":
        return collections.OrderedDict((f"k{len(items) - i}", x) for i, x in enumerate(items))
    if kind == "ddict":
        d = collections.defaultdict(list)
        d.update((f"k{i}", x) for i, x in enumerate(items))
        return d
    if kind == "pair":
        return Pair(items[0] if items else None, items[1:])
    if kind == "box":
        return Box(items, items[0] if items else 0)
    return Frozen(tuple(items))


_leaf = st.one_of(
    st.tuples(st.just("t"), st.lists(st.floats(-100, 100, width=32), min_size=1, max_size=4)),
    st.tuples(st.just("v"), st.one_of(st.integers(-5, 5), st.text(max_size=3), st.none())),
)
_spec = st.recursive(_leaf, lambda kids: st.tuples(
    st.sampled_from(["list", "tuple", "dict", "odict", "ddict", "pair", "box", "frozen"]),
    st.lists(kids, max_size=3)), max_leaves=8)


def _same(got, want) -> None:
    assert type(got) is type(want), (got, want)
    if isinstance(want, torch.Tensor):
        assert torch.equal(got, want)
    elif isinstance(want, dict):
        assert list(got) == list(want)
        assert getattr(got, "default_factory", None) is getattr(want, "default_factory", None)
        for k in want:
            _same(got[k], want[k])
    elif isinstance(want, (list, tuple)):
        assert len(got) == len(want)
        for g, w in zip(got, want):
            _same(g, w)
    elif dataclasses.is_dataclass(want):
        for f in dataclasses.fields(want):
            _same(getattr(got, f.name), getattr(want, f.name))
    else:
        assert got == want


def _tensors(tree) -> list:
    found = []
    rebuild(tree, lambda x: found.append(x) if isinstance(x, torch.Tensor) else x)
    return found


def _identity(tree):
    return tree


def _total(tree):
    return sum((t.double().sum() for t in _tensors(tree)), torch.zeros((), dtype=torch.float64))


total = remote(_total, propagate=lambda tree: torch.zeros((), dtype=torch.float64))


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(_spec)
def test_any_container_of_mesh_tensors_arrives_resolved_with_its_type(mesh, spec):
    want = _make(spec)
    with mesh.activate():
        tree = _make(spec)
        fetched = fetch_shard(tree, gpus=1).result(timeout=60)
        ran = mesh.execute(_identity, tree)
        summed = fetch_shard(total(tree), gpus=0).result(timeout=60)
    _same(fetched, want)
    _same(ran.item(gpus=0), want)
    _same(ran.item(gpus=1), want)
    assert torch.equal(summed, _total(want))


def test_a_state_dict_reaches_a_function_on_the_procs_as_tensors(mesh):
    local = torch.nn.Linear(3, 2)
    with mesh.activate():
        model = torch.nn.Linear(3, 2)
        with torch.no_grad():
            model.weight.copy_(local.weight.detach())
            model.bias.copy_(local.bias.detach())
        sd = model.state_dict()
        assert type(sd) is collections.OrderedDict
        got = mesh.execute(_identity, sd).item(gpus=1)
        via_remote = fetch_shard(total(sd), gpus=1).result(timeout=60)
    _same(got, local.state_dict())
    assert torch.equal(via_remote, _total(local.state_dict()))


def test_a_mesh_tensor_the_workers_cannot_resolve_is_refused_naming_its_place(mesh):
    with mesh.activate():
        t = torch.ones(2)
        inside = r"execute\(_identity\): args\[0\]\['cfg'\]\.w is a mesh tensor inside a Holder"
        with pytest.raises(MeshTensorError, match=inside):
            mesh.execute(_identity, {"cfg": Holder(t)})
        with pytest.raises(MeshTensorError, match=r"kwargs\['tree'\]\[1\]\.w\[0\] is a mesh tensor inside a Holder"):
            total(tree=[t, Holder([t])])
        with pytest.raises(MeshTensorError, match=r"args\[0\] is a set holding a mesh tensor"):
            mesh.execute(_identity, {t})
        with pytest.raises(MeshTensorError, match=r"the value\[0\]\.w is a mesh tensor"):
            fetch_shard([Holder(t)])
        assert mesh.execute(_identity, {"s": {1, 2}, "h": Holder(3)}).item(gpus=0)["s"] == {1, 2}
        assert torch.equal(fetch_shard(t * 2).result(timeout=60), torch.full((2,), 2.0))  # the mesh is fine
