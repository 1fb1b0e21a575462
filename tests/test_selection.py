"""Monarch's Selection: its parser against Monarch's own parse trees, and evaluation against a brute-force
reference (every point of the mesh checked against the expression's meaning, dim by dim)."""

import itertools
import pickle

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from monarch_tensor import Selection, Shape
from monarch_tensor.common.selection import Selection as via_path

pytestmark = pytest.mark.timeout(120)

# repr of Monarch 0.7's Selection.from_string (its Rust runtime's Debug form), recorded from torchmonarch 0.7.0
MONARCH = {
    "*": "All(True)",
    "?": "Any(True)",
    "*,*": "All(All(True))",
    "0": "Range(Range(0, Some(1), 1), True)",
    "4:": "Range(Range(4, None, 1), True)",
    ":": "Range(Range(0, None, 1), True)",
    "1::2": "Range(Range(1, None, 2), True)",
    "*,*,(1:4|5:6)": "All(All(Union(Range(Range(1, Some(4), 1), True), Range(Range(5, Some(6), 1), True))))",
    "*,*,1:4|5:6": "Union(All(All(Range(Range(1, Some(4), 1), True))), Range(Range(5, Some(6), 1), True))",
    "(0,*,*)&(0,(1|3),*)": "Intersection(Range(Range(0, Some(1), 1), All(All(True))), Range(Range(0, Some(1), 1), "
                           "Union(Range(Range(1, Some(2), 1), All(True)), Range(Range(3, Some(4), 1), All(True)))))",
    "((1:4),2)": "Range(Range(1, Some(4), 1), Range(Range(2, Some(3), 1), True))",
    " * , 0 ": "All(Range(Range(0, Some(1), 1), True))",
}


@pytest.mark.parametrize("text", sorted(MONARCH))
def test_parse_trees_are_monarchs(text):
    assert repr(Selection.from_string(text)) == MONARCH[text]


def test_all_any_path_pickle_and_equality():
    assert repr(Selection.all()) == "All(True)" and repr(Selection.any()) == "Any(True)"
    assert via_path is Selection
    s = Selection.from_string("*,1:3|0")
    assert pickle.loads(pickle.dumps(s)) == s and s != Selection.all()
    assert Selection.from_string("*") == Selection.all()


@pytest.mark.parametrize("bad, why", [
    ("", "empty"), ("x", "unexpected character 'x'"), ("1:2:3:4", "unexpected ':'"), ("(*", "not closed"),
    ("*,", "found the end"), ("-1", "unexpected character '-'"), ("1::0", "step must be positive"),
    ("1::", "unexpected ':'"), ("*)", r"unexpected '\)'"),
])
def test_bad_expressions_are_clear_errors(bad, why):
    with pytest.raises(ValueError, match=why):
        Selection.from_string(bad)
    with pytest.raises(TypeError, match="needs a str"):
        Selection.from_string(3)


def test_eval_takes_shapes_slices_sizes_and_refuses_too_deep_selections():
    shape = Shape(("hosts", "gpus"), (2, 4))
    assert Selection.from_string("*, 0:2 | 1, 3").eval(shape) == [0, 1, 4, 5, 7]
    sliced = shape.slice(gpus=slice(1, 4, 2))  # ranks 1, 3, 5, 7
    assert Selection.all().eval(sliced) == [1, 3, 5, 7]
    assert Selection.from_string("1").eval(sliced) == [5, 7]
    assert Selection.from_string("*,1").eval(sliced.ndslice) == [3, 7]
    assert Selection.from_string("1:,2:").eval({"a": 3, "b": 3}) == [5, 8]
    assert Selection.from_string("5:").eval({"a": 3}) == []  # past the end: nothing, as Monarch's lenient eval
    with pytest.raises(ValueError, match="3 dims deep, but the mesh has 2"):
        Selection.from_string("*,*,*").eval(shape)
    with pytest.raises(TypeError, match="needs a Shape"):
        Selection.all().eval(42)


def test_any_picks_one_index_of_its_dim_at_random():
    shape = Shape(("hosts", "gpus"), (3, 2))
    rows = set()
    for _ in range(60):
        got = Selection.from_string("?").eval(shape)
        assert len(got) == 2 and got[1] == got[0] + 1 and got[0] % 2 == 0  # one host, every gpu
        rows.add(got[0] // 2)
        one = Selection.from_string("*,?").eval(shape)
        assert len(one) == 3 and [r // 2 for r in one] == [0, 1, 2]
    assert rows == {0, 1, 2}  # (each host missed in 60 draws: about 1e-10)


# ---- property test: random expressions against a reference -----------------------------------------------
# A test expression: ("chain", [dim, ...]) | ("or", a, b) | ("and", a, b); a dim: ("*",) | ("i", n) |
# ("r", start | None, end | None, step | None) | ("g", expression).
def _dims():
    return st.one_of(
        st.just(("*",)),
        st.tuples(st.just("i"), st.integers(0, 4)),
        st.tuples(st.just("r"), st.none() | st.integers(0, 4), st.none() | st.integers(0, 5), st.none() | st.integers(1, 3)),
    )


_expr = st.recursive(
    st.lists(_dims(), min_size=1, max_size=3).map(lambda ds: ("chain", ds)),
    lambda inner: st.one_of(
        st.tuples(st.just("or"), inner, inner), st.tuples(st.just("and"), inner, inner),
        st.lists(st.one_of(_dims(), inner.map(lambda e: ("g", e))), min_size=1, max_size=3).map(lambda ds: ("chain", ds)),
        # a group with more dims after it: the tail goes under every branch of the group
        st.tuples(inner, st.lists(_dims(), min_size=1, max_size=2)).map(lambda t: ("chain", [("g", t[0]), *t[1]])),
    ),
    max_leaves=6,
)


def _render(e) -> str:
    if e[0] == "or":
        return f"({_render(e[1])})|({_render(e[2])})"
    if e[0] == "and":
        return f"({_render(e[1])})&({_render(e[2])})"
    parts = []
    for d in e[1]:
        if d[0] == "*":
            parts.append("*")
        elif d[0] == "i":
            parts.append(str(d[1]))
        elif d[0] == "r":
            _, a, b, s = d
            parts.append(f"{'' if a is None else a}:{'' if b is None else b}" + ("" if s is None else f":{s}"))
        else:
            parts.append(f"({_render(d[1])})")
    return ",".join(parts)


def _depth(e) -> int:
    if e[0] in ("or", "and"):
        return max(_depth(e[1]), _depth(e[2]))
    return sum(_depth(d[1]) if d[0] == "g" else 1 for d in e[1])


def _match(e, point, sizes, dim, then) -> bool:
    """Whether ``point`` matches ``e`` from ``dim`` on, ``then`` matching what follows it (continuations)."""
    if e[0] == "or":
        return _match(e[1], point, sizes, dim, then) or _match(e[2], point, sizes, dim, then)
    if e[0] == "and":
        return _match(e[1], point, sizes, dim, then) and _match(e[2], point, sizes, dim, then)
    return _match_chain(e[1], 0, point, sizes, dim, then)


def _match_chain(dims, i, point, sizes, dim, then) -> bool:
    if i == len(dims):
        return then(dim)
    d = dims[i]
    if d[0] == "g":
        return _match(d[1], point, sizes, dim, lambda k: _match_chain(dims, i + 1, point, sizes, k, then))
    x = point[dim]
    if d[0] == "i":
        ok = x == d[1]
    elif d[0] == "r":
        start = d[1] or 0
        end = sizes[dim] if d[2] is None else d[2]
        ok = start <= x < end and (x - start) % (d[3] or 1) == 0
    else:
        ok = True
    return ok and _match_chain(dims, i + 1, point, sizes, dim + 1, then)


@settings(max_examples=600, deadline=None)
@given(e=_expr, sizes=st.lists(st.integers(1, 4), min_size=1, max_size=4).filter(lambda s: sum(d > 1 for d in s) > 1))
def test_eval_matches_a_pointwise_reference(e, sizes):
    text = _render(e)
    sel = Selection.from_string(text)
    shape = Shape(tuple(f"d{k}" for k in range(len(sizes))), tuple(sizes))
    if _depth(e) > len(sizes):
        with pytest.raises(ValueError, match="dims deep"):
            sel.eval(shape)
        return
    want = [rank for rank, point in enumerate(itertools.product(*map(range, sizes)))
            if _match(e, point, sizes, 0, lambda k: True)]
    assert sel.eval(shape) == want, text
