"""``OpaqueRef``: an object that lives on the workers, held by the controller (Monarch's).

A remote function makes one around any Python object (a module, an optimizer,
a data loader) and returns it; the controller gets an ``OpaqueRef`` whose key
is a mesh tensor, and passes it to later remote functions, where ``.value`` is
that rank's object::

    @remote(propagate=lambda: OpaqueRef())
    def make_model():
        return OpaqueRef(torch.nn.Linear(3, 4))

    @remote(propagate=lambda ref, x: torch.empty(x.shape[0], 4))
    def forward(ref, x):
        return ref.value(x)

    model = make_model()            # on the controller: a handle, its object on every rank
    y = forward(model, torch.rand(2, 3))

The key is a 0-dim int64 tensor and the object is kept in a table weakly keyed
by it: when the controller's handle is gone, the engine deletes the key on
the workers and the object goes with it. The controller cannot read or set
``.value`` (there is no object there), except in a propagate function, which
runs on fake tensors.
"""

from __future__ import annotations

import itertools
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._pytree import register_pytree_node
from torch.utils.weak import WeakTensorKeyDictionary

_table: WeakTensorKeyDictionary = WeakTensorKeyDictionary()
_counter = itertools.count(1)
on_worker = False  # set by the TensorWorker of this process


class OpaqueRef:
    """A reference to an object that only the workers hold; ``.value`` inside remote functions."""

    __slots__ = ("_key",)

    def __init__(self, value: Any = None) -> None:
        self._key = torch.tensor(next(_counter), dtype=torch.int64)
        _check_worker(self._key, "create")
        _table[self._key] = value

    @classmethod
    def _create(cls, key) -> OpaqueRef:
        ref = OpaqueRef.__new__(OpaqueRef)  # a subclass degrades to the plain reference on the wire
        ref._key = key
        return ref

    def __reduce__(self):
        return (OpaqueRef._create, (self._key,))

    @property
    def value(self) -> Any:
        _check_worker(self._key, "read the value of")
        try:
            return _table[self._key]
        except KeyError:
            raise RuntimeError("this OpaqueRef's object is gone from this worker") from None

    @value.setter
    def value(self, v: Any) -> None:
        _check_worker(self._key, "set the value of")
        _table[self._key] = v

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self._key!r})"


def _check_worker(key, what: str) -> None:
    if not (on_worker or isinstance(key, FakeTensor)):
        raise RuntimeError(f"the controller cannot {what} an OpaqueRef: its object lives on the workers; use it "
                           f"inside a remote function")


register_pytree_node(OpaqueRef, lambda r: ((r._key,), None), lambda kids, _ctx: OpaqueRef._create(kids[0]),
                     serialized_type_name="monarch_tensor.OpaqueRef")
