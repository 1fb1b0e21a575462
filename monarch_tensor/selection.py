"""Monarch's ``Selection``: expressions that pick points of a multi-dimensional mesh.

The syntax is hyperactor's (``ndslice``'s), parsed by ``Selection.from_string``::

    expression   ::= intersection ( "|" intersection )*     union; "&" binds tighter
    intersection ::= chain ( "&" chain )*
    chain        ::= group ( "," group )*                   "," descends to the next dim
    group        ::= range | index | "*" | "?" | "(" expression ")"
    range        ::= number? ":" number? ( ":" number )?    start:end:step (0, the dim's size, 1)
    index        ::= number                                 n is n:n+1

``*`` takes every index of its dim, ``?`` one index at random; a selection shorter than the mesh's dims
takes every index of the dims left, one deeper than them is an error. ``eval`` gives the ranks selected,
in order (``Selection.eval`` is this library's; Monarch keeps evaluation in its Rust runtime)::

    >>> s = Selection.from_string("*, 0:2 | 1, 3")
    >>> s
    Union(All(Range(Range(0, Some(2), 1), True)), Range(Range(1, Some(2), 1), Range(Range(3, Some(4), 1), True)))
    >>> s.eval(Shape(("hosts", "gpus"), (2, 4)))
    [0, 1, 4, 5, 7]

``repr`` is Monarch's (its Rust runtime's ``Debug`` form). Unlike Monarch's, a ``Selection`` pickles
and compares by structure.
"""

from __future__ import annotations

import random
import re
from collections.abc import Mapping, Sequence
from typing import NoReturn

from .shape import Extent, NDSlice, Shape

# A node is a tuple: ("True",), ("False",), ("All", inner), ("Any", inner), ("Range", start, end, step, inner)
# with end None for the dim's size, ("Union", a, b), ("Intersection", a, b).
_TRUE = ("True",)
_FALSE = ("False",)
_TOKENS = re.compile(r"\d+|[*?:,|&()]")


class Selection:
    """A selection expression (see the module docstring); make one with ``from_string``, ``all`` or ``any``."""

    __slots__ = ("_node",)

    def __init__(self, node: tuple) -> None:
        self._node = node

    @classmethod
    def from_string(cls, s: str) -> Selection:
        """Parse ``s`` (whitespace is ignored); a ValueError says where it stops making sense."""
        if not isinstance(s, str):
            raise TypeError(f"Selection.from_string needs a str, got {type(s).__name__}")
        return cls(_Parser(s).parse())

    @classmethod
    def all(cls) -> Selection:
        """Every point of the mesh (``*``)."""
        return cls(("All", _TRUE))

    @classmethod
    def any(cls) -> Selection:
        """One index of the first dim at random, and everything under it (``?``)."""
        return cls(("Any", _TRUE))

    def eval(self, mesh) -> list[int]:
        """The ranks this selection picks in ``mesh``, in increasing order: a ``Shape`` (its ranks), an
        ``NDSlice`` (its values), an ``Extent`` or a mapping of dim sizes (ranks 0..n-1 in row-major
        order), or a mesh (its shape). ``?`` draws anew each time."""
        view = _as_ndslice(mesh)
        if _depth(self._node) > view.ndim:
            raise ValueError(f"selection {self!r} goes {_depth(self._node)} dims deep, but the mesh has "
                             f"{view.ndim} ({view.sizes})")
        return sorted(_eval(self._node, view, [0] * view.ndim, 0))

    def __repr__(self) -> str:
        return _repr(self._node)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Selection) and self._node == other._node

    def __hash__(self) -> int:
        return hash(self._node)

    def __reduce__(self):
        return (Selection, (self._node,))


def _as_ndslice(mesh) -> NDSlice:
    if isinstance(mesh, NDSlice):
        return mesh
    if isinstance(mesh, Shape):
        return mesh.ndslice
    if isinstance(mesh, (Extent, Mapping)):
        sizes = list(mesh.values())
        return NDSlice.new_row_major(sizes) if sizes else NDSlice(offset=0, sizes=[], strides=[])
    shape = getattr(mesh, "shape", None) or getattr(mesh, "_shape", None)
    if isinstance(shape, Shape):
        return shape.ndslice
    raise TypeError(f"Selection.eval needs a Shape, NDSlice, Extent, dict of dim sizes or a mesh, got {mesh!r}")


def _depth(node: tuple) -> int:
    """How many dims ``node`` consumes at most."""
    kind = node[0]
    if kind in ("True", "False"):
        return 0
    if kind in ("Union", "Intersection"):
        return max(_depth(node[1]), _depth(node[2]))
    return 1 + _depth(node[-1])


def _eval(node: tuple, view: NDSlice, coords: list[int], dim: int) -> set[int]:
    kind = node[0]
    if kind == "False":
        return set()
    if dim == view.ndim:  # (deeper nodes were refused by eval)
        return {view.nditem(coords)}
    size = view.sizes[dim]
    indices: Sequence[int]
    if kind == "True":
        indices, inner = range(size), _TRUE
    elif kind == "All":
        indices, inner = range(size), node[1]
    elif kind == "Any":
        indices, inner = [random.randrange(size)], node[1]
    elif kind == "Range":
        _, start, end, step, inner = node
        indices = range(start, size if end is None else min(end, size), step)
    elif kind == "Union":
        return _eval(node[1], view, coords, dim) | _eval(node[2], view, coords, dim)
    else:
        return _eval(node[1], view, coords, dim) & _eval(node[2], view, coords, dim)
    out: set[int] = set()
    for i in indices:
        out |= _eval(inner, view, coords[:dim] + [i] + coords[dim + 1:], dim + 1)
    return out


def _repr(node: tuple) -> str:
    kind = node[0]
    if kind in ("True", "False"):
        return kind
    if kind in ("All", "Any"):
        return f"{kind}({_repr(node[1])})"
    if kind == "Range":
        _, start, end, step, inner = node
        return f"Range(Range({start}, {'None' if end is None else f'Some({end})'}, {step}), {_repr(inner)})"
    return f"{kind}({_repr(node[1])}, {_repr(node[2])})"


def _nest(dim: tuple, tail: tuple) -> tuple:
    """Put ``tail`` under the innermost ``True`` of ``dim`` (the chain ``a,b`` is ``a`` with ``b`` below it)."""
    kind = dim[0]
    if kind == "True":
        return tail
    if kind == "False":
        return _FALSE
    if kind in ("Union", "Intersection"):
        return (kind, _nest(dim[1], tail), _nest(dim[2], tail))
    return (*dim[:-1], _nest(dim[-1], tail))


class _Parser:
    def __init__(self, text: str) -> None:
        self.text = "".join(text.split())
        pos, self.tokens = 0, []
        for m in _TOKENS.finditer(self.text):
            if m.start() != pos:
                break
            self.tokens.append(m.group())
            pos = m.end()
        if pos != len(self.text):
            self._fail(f"unexpected character {self.text[pos]!r} at {pos}")
        self.i = 0

    def _fail(self, why: str) -> NoReturn:
        raise ValueError(f"cannot parse selection {self.text!r}: {why}")

    def _peek(self) -> str | None:
        return self.tokens[self.i] if self.i < len(self.tokens) else None

    def _take(self, tok: str) -> bool:
        if self._peek() == tok:
            self.i += 1
            return True
        return False

    def _number(self) -> int | None:
        tok = self._peek()
        if tok is not None and tok.isdigit():
            self.i += 1
            return int(tok)
        return None

    def parse(self) -> tuple:
        if not self.tokens:
            self._fail("it is empty")
        node = self._expression()
        if self.i != len(self.tokens):
            self._fail(f"unexpected {self.tokens[self.i]!r} after {''.join(self.tokens[:self.i])!r}")
        return node

    def _expression(self) -> tuple:
        node = self._intersection()
        while self._take("|"):
            node = ("Union", node, self._intersection())
        return node

    def _intersection(self) -> tuple:
        node = self._chain()
        while self._take("&"):
            node = ("Intersection", node, self._chain())
        return node

    def _chain(self) -> tuple:
        dims = [self._group()]
        while self._take(","):
            dims.append(self._group())
        node = _TRUE
        for d in reversed(dims):
            node = _nest(d, node)
        return node

    def _group(self) -> tuple:
        if self._take("("):
            node = self._expression()
            if not self._take(")"):
                self._fail(f"a '(' is not closed after {''.join(self.tokens[:self.i])!r}")
            return node
        if self._take("*"):
            return ("All", _TRUE)
        if self._take("?"):
            return ("Any", _TRUE)
        start = self._number()
        if not self._take(":"):
            if start is None:
                got = self._peek()
                self._fail(f"expected an index, a range, '*', '?' or '(' but found {'the end' if got is None else repr(got)}")
            return ("Range", start, start + 1, 1, _TRUE)
        end = self._number()
        step = 1
        if self._peek() == ":" and self.i + 1 < len(self.tokens) and self.tokens[self.i + 1].isdigit():
            self.i += 1
            step = self._number() or 0  # (a digit follows: a number)
            if step == 0:
                self._fail("a range's step must be positive")
        return ("Range", start or 0, end, step, _TRUE)
