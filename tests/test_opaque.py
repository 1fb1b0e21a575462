"""OpaqueRef and OpaqueObject (Monarch's): objects that live on the workers, held by the controller."""

import gc

import pytest
import torch

from monarch_tensor import OpaqueObject, OpaqueRef, call_on_shard_and_fetch, inspect, opaque_method, remote

pytestmark = pytest.mark.timeout(120)


class _Tracked:
    def __init__(self, scale: float) -> None:
        self.scale = scale


@remote(propagate=lambda scale: OpaqueRef())
def _make(scale):
    return OpaqueRef(_Tracked(scale))


@remote(propagate=lambda ref, x: x.clone())
def _apply(ref, x):
    return x * ref.value.scale


@remote(propagate=lambda refs: refs[0])
def _grow(refs):  # an OpaqueRef in a list, and one returned as it came in
    for r in refs:
        r.value.scale += 1
    return refs[0]


def _live_objects():
    from monarch_tensor.worker import opaque

    return sum(1 for v in opaque._table.values() if isinstance(v, _Tracked))


def test_an_object_made_on_the_workers_is_used_changed_and_freed_from_the_controller(mesh):
    with mesh.activate():
        before = call_on_shard_and_fetch(remote(_live_objects), shard={"gpus": 1}).result(timeout=30)
        ref = _make(2.0)
        assert isinstance(ref, OpaqueRef)
        x = torch.ones(3) * (mesh.rank("gpus") + 1)
        assert inspect(_apply(ref, x), gpus=1).tolist() == [4.0, 4.0, 4.0]
        other = _make(10.0)
        same = _grow([ref, other])
        assert inspect(_apply(same, x), gpus=0).tolist() == [3.0, 3.0, 3.0]  # the same object, grown
        with pytest.raises(RuntimeError, match="controller cannot read the value of an OpaqueRef"):
            _ = ref.value
        with pytest.raises(RuntimeError, match="controller cannot create"):
            OpaqueRef(5)
        assert call_on_shard_and_fetch(remote(_live_objects), shard={"gpus": 1}).result(timeout=30) == before + 2
        del ref, same, other
        gc.collect()
        inspect(x.sum(), gpus=0)  # (deletes leave with the next batch for every rank)
        # the handles are gone: the engine deletes the keys on the workers, and the objects go with them
        assert call_on_shard_and_fetch(remote(_live_objects), shard={"gpus": 1}).result(timeout=30) == before


def _make_accumulator(n):
    class Accumulator:
        def __init__(self):
            self.total = torch.zeros(n)

        def add(self, t):
            self.total += t
            return self.total.clone()

        def count(self):
            return float(self.total.sum())

    return Accumulator()


class Accumulator(OpaqueObject):
    @opaque_method
    def add(self, t):  # the propagate rule: add returns a tensor shaped like t
        return t.clone()


def test_opaque_object_constructs_on_every_rank_and_calls_methods(mesh):
    with mesh.activate():
        acc = Accumulator(_make_accumulator, 3)
        acc.add(torch.ones(3) * (mesh.rank("gpus") + 1))
        total = acc.add(torch.ones(3))
        assert inspect(total, gpus=1).tolist() == [3.0, 3.0, 3.0]
        assert acc.call_method_on_shard_and_fetch("count", shard={"gpus": 0}).result(timeout=30) == 6.0
        linear = OpaqueObject("torch.nn.Linear", 3, 2)  # a dotted path
        y = linear.call_method("__call__", lambda self, x: torch.empty(x.shape[0], 2), torch.ones(4, 3))
        assert inspect(y, gpus=0).shape == (4, 2)
        wrapped = Accumulator(acc)  # a wrapper of an existing reference: the same object
        assert wrapped.call_method_on_shard_and_fetch("count", shard={"gpus": 1}).result(timeout=30) == 9.0
