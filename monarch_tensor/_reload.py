"""Hot reload: re-import changed modules and update their old objects in place.

``importlib.reload`` alone leaves existing objects on the old code: an actor
created before the reload still has its old class. So after re-executing a
module, every function and class the module had before is patched from its new
version (the function's code, defaults and attributes; the class's methods and
attributes), as IPython's ``autoreload`` does. Existing actors, and anything
that did ``from mod import f``, run the new code from the next call on.
"""

from __future__ import annotations

import importlib
import sys
import types


def reload_modules(names: list[str]) -> list[str]:
    """Reload the imported ones among ``names``; return those reloaded.

    Dependencies first: a module imported by another one entered ``sys.modules``
    after it, so imported modules are reloaded in reverse order of import.
    """
    wanted = set(names)
    order = [n for n in reversed(list(sys.modules)) if n in wanted and sys.modules[n] is not None]
    done = []
    for name in order:
        mod = sys.modules[name]
        before = dict(mod.__dict__)
        importlib.reload(mod)
        for attr, old in before.items():
            new = mod.__dict__.get(attr)
            if new is not None and new is not old:
                _update(old, new, name)
        done.append(name)
    return done


def _update(old, new, module: str) -> None:
    if isinstance(old, types.FunctionType) and isinstance(new, types.FunctionType):
        _update_function(old, new)
    elif isinstance(old, type) and isinstance(new, type) and getattr(old, "__module__", None) == module:
        _update_class(old, new)


def _update_function(old: types.FunctionType, new: types.FunctionType) -> None:
    if len(old.__code__.co_freevars) != len(new.__code__.co_freevars):
        return  # a different closure shape: the old function keeps its code
    old.__code__ = new.__code__
    old.__defaults__ = new.__defaults__
    old.__kwdefaults__ = new.__kwdefaults__
    old.__doc__ = new.__doc__
    old.__dict__.update(new.__dict__)


def _update_class(old: type, new: type) -> None:
    skip = {"__dict__", "__weakref__", "__module__", "__qualname__"}
    for name in list(old.__dict__):
        if name not in new.__dict__ and name not in skip:
            try:
                delattr(old, name)
            except (AttributeError, TypeError):
                pass
    for name, value in new.__dict__.items():
        if name in skip:
            continue
        current = old.__dict__.get(name)
        if isinstance(current, types.FunctionType) and isinstance(value, types.FunctionType):
            _update_function(current, value)
            continue
        if isinstance(current, (classmethod, staticmethod)) and type(current) is type(value):
            if isinstance(current.__func__, types.FunctionType) and isinstance(value.__func__, types.FunctionType):
                _update_function(current.__func__, value.__func__)
                continue
        try:
            setattr(old, name, value)
        except (AttributeError, TypeError):
            pass
