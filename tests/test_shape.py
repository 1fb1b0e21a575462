"""Shape: named, strided views over flat ranks, checked against numpy indexing.

Pure unit tests (no processes). ``Shape(names, dims).slice(...)`` must select
exactly what the same selection selects from ``np.arange(n).reshape(dims)``.
"""

from __future__ import annotations

import pickle

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from monarch_tensor.shape import Extent, Point, Shape

pytestmark = pytest.mark.timeout(60)

NAMES = ("hosts", "gpus", "cores", "dp", "tp")


# ---- strategies ----------------------------------------------------------------------
@st.composite
def shapes(draw) -> Shape:
    ndim = draw(st.integers(1, 3))
    names = draw(st.lists(st.sampled_from(NAMES), min_size=ndim, max_size=ndim, unique=True))
    dims = draw(st.lists(st.integers(1, 5), min_size=ndim, max_size=ndim))
    return Shape(tuple(names), tuple(dims))


def _selection(draw, size: int) -> int | slice:
    """An int (negative allowed) or a non-empty slice with a positive step for a dim of ``size``."""
    if draw(st.booleans()):
        return draw(st.integers(-size, size - 1))
    bound = st.one_of(st.none(), st.integers(-size - 2, size + 2))
    sel = slice(draw(bound), draw(bound), draw(st.sampled_from([None, 1, 2, 3])))
    assume(len(range(*sel.indices(size))) > 0)
    return sel


@st.composite
def slicing_chains(draw):
    """A shape and a chain of 1-3 ``slice(**sel)`` selections valid at each step."""
    shape = draw(shapes())
    chain = []
    names, dims = list(shape.names), list(shape.dims)
    for _ in range(draw(st.integers(1, 3))):
        if not names:
            break
        picked = draw(st.lists(st.sampled_from(names), min_size=1, max_size=len(names), unique=True))
        sel = {n: _selection(draw, dims[names.index(n)]) for n in picked}
        chain.append(sel)
        for n, s in sel.items():
            i = names.index(n)
            if isinstance(s, int):
                del names[i], dims[i]
            else:
                dims[i] = len(range(*s.indices(dims[i])))
    return shape, chain


def _numpy_select(arr: np.ndarray, names: list[str], sel: dict) -> tuple[np.ndarray, list[str]]:
    index = tuple(sel.get(n, slice(None)) for n in names)
    return arr[index], [n for n in names if not isinstance(sel.get(n), int)]


# ---- slice composes like numpy indexing -------------------------------------------------
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.filter_too_much])
@given(slicing_chains())
def test_slice_chain_matches_numpy(case):
    shape, chain = case
    arr = np.arange(len(shape)).reshape(shape.dims)
    names = list(shape.names)
    s = shape
    for sel in chain:
        s = s.slice(**sel)
        arr, names = _numpy_select(arr, names, sel)
        assert s.ranks() == arr.flatten().tolist()
        assert list(s.names) == names
        assert s.dims == arr.shape
        assert len(s) == arr.size
        assert s.sizes == dict(zip(names, arr.shape))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.filter_too_much])
@given(slicing_chains())
def test_point_coordinates_and_index_of_agree(case):
    shape, chain = case
    s = shape
    for sel in chain:
        s = s.slice(**sel)
    arr_shape = s.dims
    coords = list(s.coordinates())
    assert coords == [dict(zip(s.names, idx)) for idx in np.ndindex(*arr_shape)]
    ranks = s.ranks()
    for i in range(len(s)):
        p = s.point(i)
        assert isinstance(p, Point)
        assert p.rank == i and int(p) == i and p.size() == len(s) and p.extent == s.extent
        assert all(p.size(n) == d for n, d in s.sizes.items())
        assert p == Point(i, s.extent) == Point(i, s.sizes)  # Monarch's constructor gives the same point
        assert dict(p) == coords[i]
        assert s.index_of(ranks[i]) == i
        # a point's coordinates select exactly its rank
        assert s.slice(**dict(p)).ranks() == [ranks[i]]


def test_monarchs_shape_methods():
    s = Shape(("hosts", "gpus"), (2, 4))
    assert s.labels == ["hosts", "gpus"] and s.coordinates(6) == {"hosts": 1, "gpus": 2}
    assert s.at("gpus", 1).ranks() == [1, 5] and s.at("gpus", 1).labels == ["hosts"]
    assert s.select("gpus", slice(1, 3)).sizes == {"hosts": 2, "gpus": 2}
    assert s.index(hosts=1, gpus=3).ranks() == [7] and s.index(hosts=1, gpus=3).labels == []
    assert s.slice(gpus=slice(0, None, 2)).coordinates(6) == {"hosts": 1, "gpus": 1}
    assert Shape.unity().ranks() == [0] and len(Shape.unity()) == 1
    with pytest.raises(TypeError, match="select\\(\\) takes a slice"):
        s.at("gpus", slice(0, 1))
    with pytest.raises(TypeError, match="at\\(\\) takes an int"):
        s.select("gpus", 1)
    with pytest.raises(TypeError, match="takes an int"):
        s.index(gpus=slice(0, 1))
    with pytest.raises(ValueError, match="rank 1 is not in"):
        s.slice(gpus=0).coordinates(1)


def test_docstring_example():
    s = Shape(("hosts", "gpus"), (2, 4))
    assert s.slice(gpus=1).ranks() == [1, 5]
    assert s.slice(hosts=slice(0, 1)).sizes == {"hosts": 1, "gpus": 4}
    assert s.slice(hosts=1, gpus=slice(1, None, 2)).ranks() == [5, 7]
    assert s.slice(gpus=-1).ranks() == [3, 7]


def test_from_sizes_keeps_order_and_str():
    s = Shape.from_sizes({"hosts": 2, "gpus": 3})
    assert s.names == ("hosts", "gpus") and s.dims == (2, 3)
    assert s.sizes == {"hosts": 2, "gpus": 3}
    assert str(s) == "{'hosts': 2, 'gpus': 3}"
    assert s.ranks() == list(range(6))


def test_zero_dim_shape_is_one_point():
    s = Shape((), ())
    assert len(s) == 1 and s.ranks() == [0] and list(s.coordinates()) == [{}]
    assert s.slice().ranks() == [0]
    p = s.point(0)
    assert p.rank == 0 and dict(p) == {}


def test_int_selection_of_every_dim_gives_a_single_rank():
    s = Shape(("hosts", "gpus"), (3, 4))
    one = s.slice(hosts=2, gpus=-1)
    assert one.names == () and one.ranks() == [11] and len(one) == 1


# ---- Point ----------------------------------------------------------------------------
def test_point_is_a_mapping_and_an_int():
    p = Shape(("hosts", "gpus"), (2, 3)).point(4)
    assert p["hosts"] == 1 and p["gpus"] == 1
    assert dict(p) == {"hosts": 1, "gpus": 1} and list(p) == ["hosts", "gpus"] and len(p) == 2
    assert p == 4 and int(p) == 4 and [10, 11, 12, 13, 14][p] == 14
    assert p == Point(4, Extent(["hosts", "gpus"], [2, 3]))
    assert p != Point(4, {"hosts": 3, "gpus": 2})  # the same rank of another extent
    assert hash(p) == hash(Point(4, {"hosts": 2, "gpus": 3}))
    assert hash(p) == hash(4) and {4: "x"}[p] == "x" and p in {4} and 4 in {p}  # equal, so hashed alike
    with pytest.raises(KeyError, match="'tp'.*hosts.*gpus"):
        p["tp"]
    assert p.size("gpus") == 3 and p.size() == 6 and p.extent.labels == ["hosts", "gpus"]
    assert pickle.loads(pickle.dumps(p)) == p and dict(pickle.loads(pickle.dumps(p))) == dict(p)
    assert str(p) == "{'hosts': 1/2, 'gpus': 1/3}"  # Monarch's str of a point
    assert repr(p) == "Point(rank=4, {'hosts': 1, 'gpus': 1})"


def test_point_refuses_a_rank_outside_its_extent():
    with pytest.raises(IndexError, match="rank 6 is not in extent.*6 ranks"):
        Point(6, {"hosts": 2, "gpus": 3})
    with pytest.raises(IndexError, match="rank -1"):
        Point(-1, {"gpus": 3})
    with pytest.raises(TypeError, match="Extent or a dict"):
        Point(0, [2, 3])
    with pytest.raises(KeyError, match="'tp'"):
        Point(0, {"gpus": 3}).size("tp")


# ---- clear errors ---------------------------------------------------------------------
def test_unknown_dim_is_a_key_error_naming_the_dims():
    s = Shape(("hosts", "gpus"), (2, 4))
    with pytest.raises(KeyError) as ei:
        s.slice(nodes=0)
    msg = str(ei.value)
    assert "nodes" in msg and "hosts" in msg and "gpus" in msg
    # Monarch raises ValueError for an unknown dim (and TypeError from slice): each catches it
    for cls in (ValueError, TypeError, KeyError):
        with pytest.raises(cls):
            s.slice(nodes=0)


def test_int_out_of_range_is_an_index_error():
    s = Shape(("hosts", "gpus"), (2, 4))
    for bad in (4, 5, -5, 100):
        with pytest.raises(IndexError, match="gpus"):
            s.slice(gpus=bad)


def test_empty_slice_is_a_value_error():
    s = Shape(("hosts", "gpus"), (2, 4))
    for bad in (slice(2, 2), slice(4, None), slice(3, 1), slice(-1, 0), slice(10, 20)):
        with pytest.raises(ValueError, match="gpus"):
            s.slice(gpus=bad)


def test_negative_step_is_a_value_error():
    with pytest.raises(ValueError, match="step"):
        Shape(("gpus",), (4,)).slice(gpus=slice(None, None, -1))


@pytest.mark.parametrize("bad", ["0", 1.0, True, None, [0], (0, 1), np.float64(1.0)])
def test_bad_selection_type_is_a_type_error(bad):
    with pytest.raises(TypeError, match="gpus"):
        Shape(("hosts", "gpus"), (2, 4)).slice(gpus=bad)


def test_slice_with_non_int_bounds_is_a_type_error():
    with pytest.raises(TypeError):
        Shape(("gpus",), (4,)).slice(gpus=slice("a", 2))


def test_duplicate_names_are_refused():
    with pytest.raises(ValueError, match="duplicate"):
        Shape(("gpus", "gpus"), (2, 2))


@pytest.mark.parametrize("size", [0, -1, -8])
def test_non_positive_sizes_are_refused(size):
    with pytest.raises(ValueError, match="gpus"):
        Shape(("hosts", "gpus"), (2, size))
    with pytest.raises(ValueError, match="gpus"):
        Shape.from_sizes({"hosts": 2, "gpus": size})


@pytest.mark.parametrize("names,dims", [
    (("gpus",), (2, 2)),          # lengths differ
    (("",), (2,)),                # empty name
    ((3,), (2,)),                 # not a string
    (("gpus",), (2.0,)),          # not an int size
    (("gpus",), ("2",)),
])
def test_malformed_shapes_are_refused(names, dims):
    with pytest.raises(ValueError):
        Shape(names, dims)


def test_from_sizes_needs_a_mapping():
    with pytest.raises(TypeError, match="dict"):
        Shape.from_sizes([("gpus", 2)])


def test_index_of_a_rank_outside_the_shape():
    s = Shape(("hosts", "gpus"), (2, 4)).slice(hosts=1)
    assert s.index_of(6) == 2
    with pytest.raises(ValueError, match="rank 1"):
        s.index_of(1)


def test_point_out_of_range_is_an_index_error():
    s = Shape(("hosts", "gpus"), (2, 3))
    for bad in (6, 7, 100):
        with pytest.raises(IndexError):
            s.point(bad)


# ---- split, rename and flatten relabel the same ranks (Monarch's MeshTrait) ------------------------
@st.composite
def splits(draw):
    """A sliced shape, one of its dims split in two (a factorisation of its size), and a selection of the
    result: ``(shape, dim, (a, b), sizes_given, selection)``."""
    shape, chain = draw(slicing_chains())
    for sel in chain:
        shape = shape.slice(**sel)
    assume(shape.names)
    dim = draw(st.sampled_from(shape.names))
    size = shape.sizes[dim]
    outer = draw(st.sampled_from([d for d in range(1, size + 1) if size % d == 0]))
    a, b = draw(st.lists(st.sampled_from(["x", "y", "z"]), min_size=2, max_size=2, unique=True))
    given = draw(st.sampled_from([{a: outer}, {b: size // outer}, {a: outer, b: size // outer}]))
    names = [n for n in shape.names if n != dim]
    new_names = names[:shape.names.index(dim)] + [a, b] + names[shape.names.index(dim):]
    new_dims = {**shape.sizes, a: outer, b: size // outer}
    picked = draw(st.lists(st.sampled_from(new_names), max_size=len(new_names), unique=True))
    return shape, dim, (a, b), given, {n: _selection(draw, new_dims[n]) for n in picked}


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.filter_too_much])
@given(splits())
def test_split_then_slice_matches_numpy_reshape(case):
    shape, dim, (a, b), given, sel = case
    s = shape.split(**{dim: (a, b)}, **given)
    i = shape.names.index(dim)
    arr = np.array(shape.ranks()).reshape(shape.dims)
    outer = given[a] if a in given else shape.sizes[dim] // given[b]
    arr = arr.reshape(shape.dims[:i] + (outer, shape.dims[i] // outer) + shape.dims[i + 1:])
    names = list(shape.names[:i]) + [a, b] + list(shape.names[i + 1:])
    assert list(s.names) == names and s.dims == arr.shape
    assert s.ranks() == arr.flatten().tolist()
    sub, sub_arr = s.slice(**sel), _numpy_select(arr, names, sel)[0]
    assert sub.ranks() == sub_arr.flatten().tolist()


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.filter_too_much])
@given(slicing_chains(), st.data())
def test_flatten_keeps_the_ranks_or_says_they_are_not_evenly_spaced(case, data):
    shape, chain = case
    for sel in chain:
        shape = shape.slice(**sel)
    ranks = shape.ranks()
    even = len({q - p for p, q in zip(ranks, ranks[1:])}) <= 1
    if not even:
        with pytest.raises(ValueError, match="not evenly spaced"):
            shape.flatten("all")
        return
    flat = shape.flatten("all")
    assert flat.names == ("all",) and flat.ranks() == ranks
    sel = _selection(data.draw, len(ranks))
    assert flat.slice(all=sel).ranks() == np.array(ranks)[sel].flatten().tolist()


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.filter_too_much])
@given(slicing_chains())
def test_rename_keeps_ranks_and_sizes(case):
    shape, chain = case
    for sel in chain:
        shape = shape.slice(**sel)
    assume(shape.names)
    new = {n: n.upper() for n in shape.names[:1]}
    r = shape.rename(**new)
    assert r.ranks() == shape.ranks() and r.dims == shape.dims
    assert list(r.names) == [new.get(n, n) for n in shape.names]


def test_split_examples_and_extent():
    s = Shape(("hosts", "gpus"), (2, 8))
    t = s.split(hosts=("dp", "pp"), gpus=("tp", "cp"), pp=2, cp=2)
    assert t.sizes == {"dp": 1, "pp": 2, "tp": 4, "cp": 2} and t.ranks() == list(range(16))
    assert t.slice(cp=1, tp=0).ranks() == [1, 9]
    assert s.rename(gpus="g").slice(g=3).ranks() == [3, 11]
    e = s.extent
    assert e["gpus"] == 8 and e.labels == ["hosts", "gpus"] and e.sizes == [2, 8] and e.nelements == 16
    assert dict(e) == {"hosts": 2, "gpus": 8} and e == Shape(("hosts", "gpus"), (2, 8)).extent
    assert e != s.rename(gpus="g").extent and repr(e) == "{'hosts': 2, 'gpus': 8}"
    with pytest.raises(KeyError, match="no dimension 'x'"):
        e["x"]


@pytest.mark.parametrize("kwargs, match", [
    (dict(gpus=("a", "b")), "cannot infer the sizes of both 'a' and 'b'"),
    (dict(gpus=("a", "b"), a=3), "not divisible into"),
    (dict(gpus=("a", "b"), a=2, b=2), r"does not split into \('a', 'b'\) with sizes \(2, 2\)"),
    (dict(gpus="ab"), "a non-empty sequence of new dimension names"),
    (dict(gpus=()), "a non-empty sequence of new dimension names"),
    (dict(gpus=("hosts", "b"), b=2), "duplicate dimension name 'hosts'"),
    (dict(x=2), r"sizes given for dimensions that no split made: \['x'\]"),
    (dict(x="a"), "'x' is not a dimension of mesh"),
    (dict(gpus=("a", "b"), a=0), "must be positive"),
])
def test_bad_splits_say_what_was_wrong(kwargs, match):
    with pytest.raises(ValueError, match=match):
        Shape(("hosts", "gpus"), (2, 8)).split(**kwargs)


def test_bad_renames_and_flattens_say_what_was_wrong():
    s = Shape(("hosts", "gpus"), (2, 4))
    with pytest.raises(KeyError, match="no dimension 'zz' to rename"):
        s.rename(zz="a")
    with pytest.raises(ValueError, match="duplicate dimension name 'hosts'"):
        s.rename(gpus="hosts")
    with pytest.raises(ValueError, match="new name"):
        s.rename(gpus=3)
    with pytest.raises(ValueError, match="non-empty str"):
        s.flatten("")
    with pytest.raises(ValueError, match="not evenly spaced"):
        s.slice(gpus=slice(0, 2)).flatten("all")
