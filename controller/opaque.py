"""``OpaqueObject``: controller-side sugar over an ``OpaqueRef`` (Monarch's ``monarch.opaque_object``).

>>> class Counter(OpaqueObject):
...     @opaque_method
...     def add(self, t):               # the body is the propagate rule: what add returns, in shapes
...         return t.clone()
>>> c = Counter("collections.Counter")  # constructed on every rank (a dotted path, or a function)
>>> c.add(torch.ones(3))                 # runs Counter.add on each rank's object
>>> c.call_method_on_shard_and_fetch("most_common", 1, shard={"gpus": 0}).result()
"""

from __future__ import annotations

import functools

from monarch_tensor.worker.interface import resolve_function
from monarch_tensor.worker.opaque import OpaqueRef

from .remote_functions import call_on_shard_and_fetch, remote


def _construct_object(constructor, *args, **kwargs) -> OpaqueRef:
    return OpaqueRef(resolve_function(constructor)(*args, **kwargs))


_construct = remote(_construct_object, propagate=lambda *args, **kwargs: OpaqueRef())


def _invoke_method(obj: OpaqueRef, method_name: str, *args, **kwargs):
    return getattr(obj.value, method_name)(*args, **kwargs)


class OpaqueObject(OpaqueRef):
    """An object made on every rank of the active mesh by ``constructor`` (a function or a dotted path such
    as ``"torch.nn.Linear"``) with the given arguments; or a wrapper of an existing ``OpaqueRef``."""

    __slots__ = ()

    def __init__(self, constructor, *args, **kwargs) -> None:
        if isinstance(constructor, OpaqueRef):
            self._key = constructor._key
        else:
            self._key = _construct(constructor, *args, **kwargs)._key

    def call_method(self, method_name: str, propagation, *args, **kwargs):
        """``method_name`` of each rank's object; ``propagation(self, *args, **kwargs)`` returns what it
        returns (in shapes)."""
        return remote(_invoke_method, propagate=lambda obj, _name, *a, **k: propagation(obj, *a, **k))(
            self, method_name, *args, **kwargs)

    def call_method_on_shard_and_fetch(self, method_name: str, *args, shard: dict | None = None, **kwargs):
        """``method_name`` of one rank's object; a future of its result."""
        return call_on_shard_and_fetch(remote(_invoke_method), self, method_name, *args, shard=shard, **kwargs)


def opaque_method(fn):
    """Declare a method of the remote object on an ``OpaqueObject`` subclass; the body is its propagate rule."""
    name = fn.__name__

    @functools.wraps(fn)
    def impl(self, *args, **kwargs):
        return self.call_method(name, fn, *args, **kwargs)

    return impl
