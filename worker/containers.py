"""The containers that carry mesh tensors through remote functions, actor calls and fetches.

The controller replaces each mesh tensor of an argument by its ``Ref`` and the worker each ``Ref`` by its
local tensor; both walk the same containers with ``rebuild``, which keeps each container's type: lists,
tuples and named tuples, dicts and their subclasses (an ``OrderedDict`` stays one, a ``defaultdict`` keeps
its ``default_factory``), and dataclass instances (each field). What ``rebuild`` does not enter is a leaf.

>>> rebuild({"w": 1, "b": (2, 3)}, lambda x: x * 10)
{'w': 10, 'b': (20, 30)}
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

# Leaves that hold nothing: ``rebuild`` hands them to ``leaf`` without looking inside.
ATOMS = frozenset({int, float, bool, complex, str, bytes, type(None), type(Ellipsis), slice, range})


class Hidden(Exception):  # internal: unwinds to the call, gathering where the value sits
    """A value that cannot be carried sits at ``path`` (built as the exception unwinds, innermost first)."""

    def __init__(self, what: str) -> None:
        super().__init__(what)
        self.what = what
        self.parts: list[str] = []

    def path(self, root: str) -> str:
        return root + "".join(reversed(self.parts))


def is_dataclass_instance(a: Any) -> bool:
    return hasattr(type(a), "__dataclass_fields__") and not isinstance(a, type)


def rebuild(a: Any, leaf: Callable[[Any], Any]) -> Any:
    """``a`` with each leaf ``x`` replaced by ``leaf(x)``, its containers rebuilt with their own types.

    Order of the leaves (which callers that pair leaves with a flat list rely on): sequences in order,
    dicts in their order, dataclass fields in declaration order."""
    t = type(a)
    if t in ATOMS:
        return leaf(a)
    if t is list or t is tuple:
        return t([_at(x, leaf, i) for i, x in enumerate(a)])
    if t is dict:
        return {k: _at(v, leaf, k) for k, v in a.items()}
    if isinstance(a, tuple) and hasattr(t, "_fields"):  # a named tuple
        return t(*(_at(x, leaf, f) for f, x in zip(t._fields, a)))
    if isinstance(a, dict):  # a subclass: a shallow copy (its type, default_factory, attributes), new values
        out = copy.copy(a)
        for k, v in a.items():
            dict.__setitem__(out, k, _at(v, leaf, k))
        return out
    if is_dataclass_instance(a):
        out = copy.copy(a)
        for name in t.__dataclass_fields__:
            if hasattr(a, name):  # (a field with no default that __post_init__ left unset)
                object.__setattr__(out, name, _at(getattr(a, name), leaf, name, attr=True))
        return out
    return leaf(a)


def _at(x: Any, leaf: Callable[[Any], Any], key: Any, attr: bool = False) -> Any:
    try:
        return rebuild(x, leaf)
    except Hidden as h:
        h.parts.append(f".{key}" if attr else f"[{key!r}]")
        raise
