"""Mesh tensors in the arguments of remote functions, actor calls and fetches: found, checked, put on the wire.

Mesh tensors travel inside the containers ``worker.containers.rebuild`` walks (lists, tuples, named
tuples, dicts and their subclasses such as ``OrderedDict`` and ``defaultdict``, dataclass instances), each
arriving on the workers as that rank's local tensor in a container of the same type. One anywhere else
(an attribute of another object, a set, a dict key) cannot be resolved there: it is refused at the call,
the error naming where it sits.

>>> leaves = mesh_leaves(((model.state_dict(),), {}), "remote('save')")  # doctest: +SKIP
"""

from __future__ import annotations

import types
from typing import Any

import torch
from monarch_tensor.worker import messages as m
from monarch_tensor.worker.containers import ATOMS, Hidden, rebuild
from monarch_tensor.worker.opaque import OpaqueRef

from .errors import MeshTensorError
from .process_group import RemoteProcessGroup
from .tensor import Tensor

SEARCH_LIMIT = 100_000  # objects looked into for a hidden mesh tensor, per argument object
_OPAQUE_LEAVES = (types.ModuleType, types.FunctionType, types.BuiltinFunctionType, types.MethodType, type,
                  torch.dtype, torch.device, torch.layout, torch.memory_format, torch.Generator)


def mesh_leaves(args_kwargs: tuple, what: str) -> list:
    """The mesh tensors of ``(args, kwargs)``, in ``rebuild``'s order (an ``OpaqueRef`` gives its key tensor);
    a mesh tensor where it cannot be carried raises ``MeshTensorError`` naming its place."""
    found: list = []

    def leaf(x):
        t = type(x)
        if t is Tensor:
            found.append(x)
        elif isinstance(x, OpaqueRef):
            if type(x._key) is Tensor:
                found.append(x._key)
        elif t not in ATOMS and t is not RemoteProcessGroup:
            _check_opaque(x)
        return x

    walk(args_kwargs, leaf, what)
    return found


def to_wire(obj: Any, what: str = "") -> Any:
    """``obj`` as it travels: each mesh tensor a ``Ref``, each process group its wire form, containers kept."""
    def leaf(x):
        t = type(x)
        if t is Tensor:
            return m.Ref(x._ref)
        if t is RemoteProcessGroup:
            return x._wire()
        if isinstance(x, OpaqueRef) and type(x._key) is Tensor:
            return OpaqueRef._create(m.Ref(x._key._ref))
        if t not in ATOMS:
            _check_opaque(x)
        return x

    return walk(obj, leaf, what)


def walk(obj: Any, leaf, what: str) -> Any:
    """``rebuild(obj, leaf)``, a ``Hidden`` raised on the way turned into ``MeshTensorError``. ``obj`` is
    ``(args, kwargs)`` of a call, or any value (a fetch's)."""
    try:
        return rebuild(obj, leaf)
    except Hidden as h:
        parts = list(reversed(h.parts))
        if isinstance(obj, tuple) and len(obj) == 2 and isinstance(obj[1], dict) and len(parts) >= 2:
            root = ("args" if parts[0] == "[0]" else "kwargs") + parts[1] + "".join(parts[2:])
        else:
            root = "the value" + "".join(parts)
        raise MeshTensorError(f"{what + ': ' if what else ''}{root}{h.what}") from None


def _check_opaque(x: Any) -> None:
    """Raise ``Hidden`` if ``x`` (an object ``rebuild`` does not enter) holds a mesh tensor."""
    if isinstance(x, (torch.Tensor, *_OPAQUE_LEAVES)):  # (a local tensor holds no mesh tensor)
        return
    if isinstance(x, (set, frozenset)):
        for e in x:
            if _search(e, set(), [0]) is not None:
                raise Hidden(f" is a {type(x).__name__} holding a mesh tensor, which has no order to keep on the "
                             f"workers: pass a list or a tuple")
        return
    inner = _search(x, set(), [0])
    if inner is not None:
        raise Hidden(f"{inner} is a mesh tensor inside a {type(x).__name__} object, which the workers cannot "
                     f"resolve: pass the tensor itself, or in a list, tuple, dict, named tuple or dataclass")


def _search(x: Any, seen: set, count: list) -> str | None:
    """The path from ``x`` to a mesh tensor it holds (``""``: ``x`` is one), else None."""
    t = type(x)
    if t in ATOMS:
        return None
    if isinstance(x, Tensor):
        return ""
    if isinstance(x, (torch.Tensor, *_OPAQUE_LEAVES)) or id(x) in seen:
        return None
    seen.add(id(x))
    count[0] += 1
    if count[0] > SEARCH_LIMIT:
        return None
    if isinstance(x, OpaqueRef):
        return "._key" if isinstance(x._key, Tensor) else None
    if isinstance(x, (list, tuple)):
        items = enumerate(x)
    elif isinstance(x, (set, frozenset)):
        items = ((None, e) for e in x)
    elif isinstance(x, dict):
        for k in x:
            if isinstance(k, Tensor):
                return " (a dict key)"
        items = iter(x.items())
    else:
        items = iter(_attributes(x))
    for k, v in items:
        inner = _search(v, seen, count)
        if inner is not None:
            step = "" if k is None else f".{k}" if isinstance(k, str) and not isinstance(x, dict) else f"[{k!r}]"
            return step + inner
    return None


def _attributes(x: Any) -> list:
    out = list(getattr(x, "__dict__", {}).items())
    for cls in type(x).__mro__:
        for name in getattr(cls, "__slots__", ()):
            if isinstance(name, str) and name not in ("__dict__", "__weakref__") and hasattr(x, name):
                out.append((name, getattr(x, name)))
    return out
