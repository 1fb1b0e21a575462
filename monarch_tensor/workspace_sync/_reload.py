"""Hot reload: re-import changed modules and update their old objects in place.

``importlib.reload`` alone leaves existing objects on the old code: an actor
created before the reload still has its old class. So after re-executing a
module, every function and class the module had before is patched from its new
version (the function's code, defaults and attributes; the class's methods and
attributes; a decorated function's wrapped function too), as IPython's
``autoreload`` does. Existing actors, and anything that did ``from mod import
f``, run the new code from the next call on. The module then names those old
objects again, so they stay the same objects over any number of reloads: the
next reload patches them again, and what live objects hold is what the module
names; dicts, lists and classes that the re-import filled with a new class (a
registry) get the old one too. What cannot be patched in place (a function
whose closure changed, an enum whose members changed, a class whose slots or
metaclass changed or whose new bases Python refuses to set) is left new in the
module, with a warning in the log; a method whose closure changed (one that
starts using ``super()``) is replaced on its class. A class's data attributes
take the new class body's values, even one filled since (a registry that
subclasses fill): a warning says so when a filled container becomes empty.

A module whose file changed stays stale until a reload succeeds: one synced
without ``auto_reload``, or whose reload failed, is reloaded by the next sync
that has it, whatever that sync changed.
"""

from __future__ import annotations

import ast
import enum
import gc
import importlib
import importlib.util
import inspect
import logging
import os
import sys
import types

log = logging.getLogger("monarch_tensor.reload")

# Modules whose files a sync changed after they were imported and that have not been reloaded since: the
# sync had no ``auto_reload``, or their reload failed. The next reload takes them too, unless the module
# was imported afresh meanwhile (another object in ``sys.modules``).
_stale: dict[str, types.ModuleType] = {}


class ReloadError(Exception):
    """Some modules failed to reload; the others were. The failed ones stay stale: the next reload tries them
    again."""


def note_changed(names) -> None:
    """The files of modules ``names`` changed: those imported here are stale until reloaded."""
    for name in names:
        mod = sys.modules.get(name)
        if mod is not None:
            _stale[name] = mod


def reload_stale() -> list[str]:
    """Reload every stale module (``note_changed``) still imported; return those reloaded.

    A module whose file is gone (deleted, or renamed) leaves ``sys.modules`` instead, so that importing it
    fails as it would in a fresh process. Every stale module is tried, even after one fails; then
    ``ReloadError`` names the failed ones, which stay stale.
    """
    for name, mod in list(_stale.items()):
        if sys.modules.get(name) is not mod:  # imported afresh (or dropped) since: not stale any more
            del _stale[name]
            continue
        path = getattr(mod, "__file__", None)
        if path and not os.path.exists(path):
            del sys.modules[name]
            del _stale[name]
    done, failed, replaced = [], [], {}
    for name in _import_order(_stale):
        try:
            replaced.update(_reload_module(name))
        except Exception as e:  # noqa: BLE001 - named in the ReloadError below
            failed.append(f"{name}: {e!r}")
            continue
        _stale.pop(name, None)
        done.append(name)
    _point_at_old(replaced)
    if failed:
        raise ReloadError(f"{len(failed)} module(s) failed to reload and keep their old code until a later reload "
                          f"succeeds (reloaded: {done or 'none'}): " + "; ".join(failed))
    return done


def _import_order(names) -> list[str]:
    """``names`` that are imported, dependencies first: each comes after the others among ``names`` that its
    source imports outside its functions (``import b``, ``from b import x``, ``from . import b``), so that
    ``from b import x`` finds the new ``x`` of a ``b`` changed with it. Otherwise, and within an import cycle,
    modules keep the order in which their first import finished: CPython moves a module to the end of
    ``sys.modules`` when its code has run, after the modules it imported."""
    wanted = set(names)
    order = [n for n in list(sys.modules) if n in wanted and sys.modules[n] is not None]
    deps = {n: (_imports(sys.modules[n]) & set(order)) - {n} for n in order}
    done: list[str] = []
    while len(done) < len(order):
        left = [n for n in order if n not in done]
        done.append(next((n for n in left if deps[n] <= set(done)), left[0]))  # (left[0]: a cycle)
    return done


def _imports(mod: types.ModuleType) -> set[str]:
    """The modules that ``mod``'s source file imports when it runs (not in its functions), with their parent
    packages; none where the source cannot be read or parsed (its reload then says why)."""
    path = getattr(mod, "__file__", None)
    if not path or not path.endswith(".py"):
        return set()
    try:
        with open(path, "rb") as f:
            tree = ast.parse(f.read(), path)
    except (OSError, SyntaxError, ValueError):
        return set()
    found = set()
    for node in _run_at_import(tree.body):
        if isinstance(node, ast.Import):
            for alias in node.names:
                found |= _with_parents(alias.name)
        elif isinstance(node, ast.ImportFrom):
            try:
                base = importlib.util.resolve_name("." * node.level + (node.module or ""), mod.__package__ or "")
            except (ImportError, ValueError):  # (a relative import beyond the top-level package)
                continue
            found |= _with_parents(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)  # (``from pkg import submodule``)
    return found


def _run_at_import(nodes):
    """The statements of ``nodes`` and those nested in them, but not the bodies of functions."""
    for node in nodes:
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            yield node
            yield from _run_at_import(ast.iter_child_nodes(node))


def _with_parents(name: str) -> set[str]:
    """``a.b.c`` -> ``{a, a.b, a.b.c}``: importing a submodule runs its packages first."""
    parts = name.split(".")
    return {".".join(parts[:i]) for i in range(1, len(parts) + 1)}


def reload_modules(names: list[str]) -> list[str]:
    """Reload the imported ones among ``names`` (dependencies first, ``_import_order``); return those
    reloaded. The first failure raises."""
    done, replaced = [], {}
    try:
        for name in _import_order(names):
            replaced.update(_reload_module(name))
            done.append(name)
    finally:
        _point_at_old(replaced)
    return done


def _reload_module(name: str) -> dict[type, type]:
    """Re-execute module ``name`` and patch its old functions and classes from their new versions, which it
    names again; return its new classes -> the old ones it names (for ``_point_at_old``)."""
    mod = sys.modules[name]
    before = dict(mod.__dict__)
    try:
        importlib.reload(mod)
    except BaseException:
        # The new code ran in the module's own namespace up to the error: put the old names back, so that
        # the module keeps its old code and state until a reload succeeds. (What that code did outside
        # the module, such as registering something elsewhere, stays done.)
        mod.__dict__.clear()
        mod.__dict__.update(before)
        raise
    replaced = {}  # new class -> the old one the module names again
    for attr, old in before.items():
        new = mod.__dict__.get(attr)
        if new is not None and new is not old and _update(old, new, name, replaced):
            # The module names the old object again, which runs the new code now: it is the one that live
            # objects and ``from mod import f`` hold, and the one the next reload patches.
            mod.__dict__[attr] = old
            if isinstance(old, type):
                replaced[new] = old
    _adopt_instances(mod, replaced)
    return replaced


def _adopt_instances(mod: types.ModuleType, replaced: dict[type, type]) -> None:
    """The module's values that its new code made of a class it then named the old version of again
    (``DEFAULT = Cfg()``) become the old class's: instances of it, or for an enum its old member of that value.
    (Such instances kept elsewhere, in a list say, stay the new class's.)"""
    for attr, value in list(mod.__dict__.items()):
        old = replaced.get(type(value))
        if old is None:
            continue
        if isinstance(value, enum.Enum):
            mod.__dict__[attr] = old(value.value)  # (members compare by identity; a Flag's may be composite)
            continue
        try:
            value.__class__ = old
        except TypeError:  # a layout that __class__ assignment refuses (other __slots__, say)
            pass


def _point_at_old(replaced: dict[type, type]) -> None:
    """Dicts, lists and classes that hold a new class of ``replaced`` hold its old version instead, which runs
    the new code and which its module names: a registry that a decorator or ``__init_subclass__`` filled as
    the module was re-executed then holds ``models.Linear`` itself, as in a fresh process, and the next
    reload patches what it holds. (Dict keys stay: the old class is a key there too, since its module was
    first imported.)

    One pass over the objects the garbage collector tracks (a second one where a class's namespace holds a
    new class): tens of milliseconds in a proc that has imported torch, so only when a reload replaced
    classes."""
    if not replaced:
        return
    old_of = {id(new): old for new, old in replaced.items()}
    holders = [h for h in gc.get_referrers(*replaced) if type(h) in (dict, list) and h is not replaced]
    # A class's namespace changes through setattr only (which keeps its method caches right): find the class.
    maybe_namespaces = [h for h in holders if type(h) is dict and "__module__" in h]  # (every class statement's)
    owner = {id(d): t for t in (gc.get_referrers(*maybe_namespaces) if maybe_namespaces else ())
             if isinstance(t, type) for d in gc.get_referents(t) if type(d) is dict}
    for holder in holders:
        if type(holder) is list:
            for i, value in enumerate(holder):
                if id(value) in old_of:
                    holder[i] = old_of[id(value)]
            continue
        cls = owner.get(id(holder))
        if cls in replaced:  # (a new class itself: dropped)
            continue
        for key, value in list(holder.items()):
            if id(value) in old_of:
                if cls is None:
                    holder[key] = old_of[id(value)]
                else:
                    try:
                        setattr(cls, key, old_of[id(value)])
                    except (AttributeError, TypeError):
                        pass


def _not_patched(module: str, old, why: str) -> None:
    log.warning("reload of %s: %s %s; the module names its new version, and what holds the old one keeps the "
                "old code", module, getattr(old, "__qualname__", repr(old)), why)


def _update(old, new, module: str, replaced: dict[type, type]) -> bool:
    """Make ``old`` run ``new``'s code; return whether it does (else the module keeps ``new``). ``replaced``:
    the module's new classes patched so far -> their old versions, which the module names again."""
    if isinstance(old, types.FunctionType) and isinstance(new, types.FunctionType):
        if _update_function(old, new):
            return True
        _not_patched(module, old, _CLOSURE_CHANGED)
        return False
    if isinstance(old, type) and isinstance(new, type) and getattr(old, "__module__", None) == module:
        why = _update_class(old, new, replaced, module)
        if not why:
            return True
        _not_patched(module, old, why)
        return False
    if type(old) is type(new) and isinstance(getattr(old, "__wrapped__", None), types.FunctionType) \
            and isinstance(getattr(new, "__wrapped__", None), types.FunctionType):
        if not _update_function(old.__wrapped__, new.__wrapped__):  # a wrapper object, as lru_cache makes
            _not_patched(module, old, _CLOSURE_CHANGED)
            return False
        clear = getattr(old, "cache_clear", None)
        if callable(clear):
            clear()  # (its results came from the old code)
        return True
    return False


_CLOSURE_CHANGED = "cannot be patched in place: it, or a function it wraps, closes over other variables now"


def _update_function(old: types.FunctionType, new: types.FunctionType, seen: set | None = None) -> bool:
    """``old`` runs ``new``'s code from now on; so does every function its closure holds that ``new``'s holds
    a new version of: a decorator's wrapper (``functools.wraps``, ``torch.no_grad()``) holds the function
    it wraps there, and the old wrapper would call the old function.

    Return whether all of them could be patched. A function's closure cannot change, so one whose new code
    has other free variables (a method that starts using ``super()`` needs a ``__class__`` cell; a function
    that is now decorated is now the decorator's wrapper) keeps its old code."""
    if old.__code__.co_freevars != new.__code__.co_freevars:
        return False
    seen = set() if seen is None else seen
    if id(old) in seen:  # (a closure may hold its own function)
        return True
    seen.add(id(old))
    old.__code__ = new.__code__
    old.__defaults__ = new.__defaults__
    old.__kwdefaults__ = new.__kwdefaults__
    old.__doc__ = new.__doc__
    ok = True
    wrapped = old.__dict__.get("__wrapped__")
    old.__dict__.update(new.__dict__)
    if isinstance(wrapped, types.FunctionType) and isinstance(new.__dict__.get("__wrapped__"), types.FunctionType):
        old.__wrapped__ = wrapped  # the old wrapper names the function it calls, which runs the new code now
        ok = _update_function(wrapped, new.__wrapped__, seen) and ok
    for a, b in zip(old.__closure__ or (), new.__closure__ or ()):
        try:
            x, y = a.cell_contents, b.cell_contents
        except ValueError:  # an empty cell
            continue
        if x is not y and isinstance(x, types.FunctionType) and isinstance(y, types.FunctionType) \
                and x.__qualname__ == y.__qualname__:
            ok = _update_function(x, y, seen) and ok
    return ok


def _update_class(old: type, new: type, replaced: dict[type, type], module: str) -> str:
    """Give ``old`` ``new``'s methods, attributes and base classes (each patched base as its old version,
    ``replaced``); return why it cannot be done in place, or ``""`` when it was.

    An enum whose members changed (or a class that became or stopped being an enum) cannot be, nor a class
    whose metaclass or ``__slots__`` changed (the instances of ``old`` hold its slots, which ``new``'s slot
    descriptors refuse), nor one given bases that Python refuses to put in ``old.__bases__``."""
    skip = {"__dict__", "__weakref__", "__module__", "__qualname__", "__slots__"}
    if isinstance(old, enum.EnumMeta) or isinstance(new, enum.EnumMeta):
        if not (isinstance(old, enum.EnumMeta) and isinstance(new, enum.EnumMeta)) \
                or _members(old) != _members(new):
            return "is an enum whose members changed, which cannot be done in place"
        # Live objects hold the old members, and members compare by identity: keep them, and the maps to them.
        skip |= {"_member_names_", "_member_map_", "_value2member_map_", "_unhashable_values_", *old.__members__}
    if type(old) is not type(new):
        return "has another metaclass now, which cannot be changed in place"
    if _slots(old) != _slots(new):
        return "has other __slots__ now, which its instances cannot take in place"
    bases = tuple(replaced.get(base, base) for base in new.__bases__)
    if bases != old.__bases__:
        try:
            old.__bases__ = bases  # (its subclasses' method resolution order follows)
        except TypeError:  # (Python refuses it for a class that had no base but ``object``, or another layout)
            return "has other base classes now, which Python does not let it take in place"
    _point_class_cell(new, old)
    for name in list(old.__dict__):
        if name not in new.__dict__ and name not in skip and not isinstance(old.__dict__[name], _SLOT):
            try:
                delattr(old, name)
            except (AttributeError, TypeError):
                pass
    for name, value in new.__dict__.items():
        if name in skip or isinstance(value, _SLOT):  # (``old``'s own slot descriptors stay: same slots)
            continue
        current = old.__dict__.get(name)
        # A method that cannot be patched in place is replaced on the class, as a new one is added: calls
        # through the class and its instances run the new code.
        if isinstance(current, types.FunctionType) and isinstance(value, types.FunctionType) \
                and _update_function(current, value):
            continue
        if isinstance(current, (classmethod, staticmethod)) and type(current) is type(value):
            if isinstance(current.__func__, types.FunctionType) and isinstance(value.__func__, types.FunctionType) \
                    and _update_function(current.__func__, value.__func__):
                continue
        if isinstance(current, (dict, list, set)) and current and type(value) is type(current) and not value:
            # Most likely filled after the class statement (a registry that subclasses or a decorator fill):
            # the new empty one is not refilled by modules that are not reloaded. (Telling that apart from an
            # edit of its definition would need the source the module was imported from.)
            log.warning("reload of %s: %s.%s is the new class body's empty %s; what was added to the old one "
                        "since its class statement ran (a registry's entries, say) is dropped", module,
                        old.__qualname__, name, type(value).__name__)
        try:
            setattr(old, name, value)
        except (AttributeError, TypeError):
            pass
    return ""


_SLOT = types.MemberDescriptorType  # what a class's ``__slots__`` puts in its namespace, one per slot


def _slots(cls: type) -> tuple[str, ...] | None:
    """The slots ``cls`` itself declares (``None``: no ``__slots__``, its instances have a ``__dict__``)."""
    slots = cls.__dict__.get("__slots__")
    return None if slots is None else ((slots,) if isinstance(slots, str) else tuple(slots))


def _point_class_cell(new: type, old: type) -> None:
    """Make ``new``'s methods that use ``super()`` or ``__class__`` see ``old``: the methods of a class body
    share one ``__class__`` cell holding the class, and those of ``new`` that ``old`` takes as they are (a new
    method, or one that cannot be patched in place) would call ``super(new, self)``, which fails on the
    instances of ``old``. (``new`` itself is dropped: the module names ``old``.)"""
    for value in new.__dict__.values():
        for fn in (value, *(getattr(value, a, None) for a in ("__func__", "fget", "fset", "fdel"))):
            if not callable(fn):
                continue
            try:
                fn = inspect.unwrap(fn)  # (a decorated method: the class body's function)
            except ValueError:  # a cycle of __wrapped__
                continue
            if isinstance(fn, types.FunctionType) and "__class__" in fn.__code__.co_freevars:
                cell = fn.__closure__[fn.__code__.co_freevars.index("__class__")]
                if cell.cell_contents is new:
                    cell.cell_contents = old
                    return  # (the one cell of the class body)


def _members(cls: enum.EnumMeta) -> dict:
    return {name: member.value for name, member in cls.__members__.items()}
