"""NDSlice and Region (Monarch's), and Shape's Monarch form Shape(labels, NDSlice): checked against a plain
enumeration of offset + sum(i * stride)."""

import itertools
import pickle

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from monarch_tensor import NDSlice, Shape
from monarch_tensor.shape import Extent, Region

pytestmark = pytest.mark.timeout(60)


def _reference(offset, sizes, strides):
    return [offset + sum(i * s for i, s in zip(idx, strides)) for idx in itertools.product(*(range(d) for d in sizes))]


@st.composite
def slices(draw, nested=True):
    sizes = draw(st.lists(st.integers(1, 4), min_size=0, max_size=3))
    if nested:  # a row-major block, then sliced: what meshes make
        steps = [draw(st.integers(1, 3)) for _ in sizes]
        strides, acc = [], 1
        for d, k in zip(reversed(sizes), reversed(steps)):
            strides.append(acc * k)
            acc *= d * k
        strides.reverse()
    else:
        strides = [draw(st.integers(0, 5)) for _ in sizes]
    return draw(st.integers(0, 20)), sizes, strides


@settings(max_examples=200, deadline=None)
@given(slices(nested=True) | slices(nested=False))
def test_values_positions_and_coordinates_match_the_enumeration(spec):
    offset, sizes, strides = spec
    s = NDSlice(offset=offset, sizes=sizes, strides=strides)
    ref = _reference(offset, sizes, strides)
    assert list(s) == ref and len(s) == len(ref) and s.ndim == len(sizes)
    assert (s.offset, s.sizes, s.strides) == (offset, sizes, strides)
    for i, v in enumerate(ref):
        assert s.get(i) == v == s[i]
        assert s.nditem(s.coordinates(v)) == v
        assert s.get(s.index(v)) == v  # (the first position of v where strides let values repeat)
    assert s[1:3] == tuple(ref[1:3])
    missing = max(ref) + 1
    with pytest.raises(ValueError, match="is not in"):
        s.coordinates(missing)
    with pytest.raises(IndexError):
        s.get(len(ref))
    assert pickle.loads(pickle.dumps(s)) == s and hash(pickle.loads(pickle.dumps(s))) == hash(s)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(0, 40), max_size=20))
def test_from_list_covers_exactly_the_ranks(ranks):
    got = [v for sl in NDSlice.from_list(ranks) for v in sl]
    assert sorted(got) == sorted(set(ranks)) and len(got) == len(set(got))


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(1, 4), min_size=1, max_size=3), st.data())
def test_shapes_in_monarchs_form_are_the_same_shapes(sizes, data):
    names = [f"d{i}" for i in range(len(sizes))]
    shape = Shape(tuple(names), tuple(sizes))
    dim = data.draw(st.sampled_from(names))
    sub = shape.slice(**{dim: slice(data.draw(st.integers(0, shape.sizes[dim] - 1)), None)})
    again = Shape(sub.labels, sub.ndslice)  # Monarch's constructor
    assert again == sub and again.ranks() == list(sub.ndslice)
    assert sub.region.as_shape() == sub and sub.region.labels == sub.labels
    assert NDSlice.new_row_major(sizes) == shape.ndslice
    assert Extent(names, sizes).region == Region(names, NDSlice.new_row_major(sizes))
    last = sub.ranks()[-1]
    assert sub.region.point_of_base_rank(last).rank == len(sub) - 1


def test_bad_slices_say_what_was_wrong():
    with pytest.raises(ValueError, match="2 sizes but 1 strides"):
        NDSlice(offset=0, sizes=[2, 2], strides=[1])
    with pytest.raises(ValueError, match="positive"):
        NDSlice(offset=0, sizes=[0], strides=[1])
    with pytest.raises(ValueError, match="non-negative"):
        NDSlice(offset=-1, sizes=[1], strides=[1])
    with pytest.raises(IndexError, match="out of range"):
        NDSlice(offset=0, sizes=[2], strides=[1]).nditem([2])
    with pytest.raises(ValueError, match="2 labels for a slice of 1 dims"):
        Region(["a", "b"], NDSlice(offset=0, sizes=[2], strides=[1]))
