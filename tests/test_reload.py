"""Hot reload in one process (``monarch_tensor.workspace_sync._reload``): what a sync's ``auto_reload`` does in each proc.

Modules live in a fresh directory on ``sys.path``; each test edits their files, says which changed
(``note_changed``, as a sync does) and reloads (``reload_stale``), then checks what old references run.
"""

from __future__ import annotations

import importlib
import pickle
import sys
import textwrap

import pytest

from monarch_tensor.workspace_sync import _reload

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def pkgdir(tmp_path, monkeypatch):
    """A directory on sys.path; the modules imported from it leave sys.modules afterwards."""
    monkeypatch.syspath_prepend(str(tmp_path))
    # No .pyc files: a version written in the same second as the one before, with the same size, would
    # otherwise be read from the cached bytecode of that one.
    monkeypatch.setattr(sys, "dont_write_bytecode", True)
    monkeypatch.setattr(_reload, "_stale", {})
    before = set(sys.modules)
    yield tmp_path
    for name in set(sys.modules) - before:
        del sys.modules[name]


def write(d, name: str, text: str) -> None:
    (d / f"{name}.py").write_text(textwrap.dedent(text))
    importlib.invalidate_caches()


def test_a_failed_reload_fails_the_call_reloads_the_others_and_is_retried_next_time(pkgdir):
    write(pkgdir, "ra", "def f():\n    return 'a1'\n")
    write(pkgdir, "rb", "def g():\n    return 'b1'\n")
    import ra
    import rb

    f, g = ra.f, rb.g
    write(pkgdir, "ra", "def f():\n    return 'a2'\n")
    write(pkgdir, "rb", "def g(:\n")  # a syntax error
    _reload.note_changed(["ra", "rb"])
    with pytest.raises(_reload.ReloadError, match=r"rb: SyntaxError") as e:
        _reload.reload_stale()
    assert "reloaded: ['ra']" in str(e.value)
    assert f() == "a2" and g() == "b1"  # ra reloaded although rb (imported after it) failed
    write(pkgdir, "rb", "def g():\n    return 'b3'\n")
    assert _reload.reload_stale() == ["rb"]  # nothing noted this time: rb was still stale
    assert g() == "b3"
    assert _reload.reload_stale() == []


def test_a_change_synced_without_reload_is_reloaded_by_the_next_reload(pkgdir):
    write(pkgdir, "rc", "X = 1\n")
    write(pkgdir, "rd", "Y = 1\n")
    import rc
    import rd

    write(pkgdir, "rc", "X = 2\n")
    _reload.note_changed(["rc", "not_imported_here"])  # a sync without auto_reload
    write(pkgdir, "rd", "Y = 2\n")
    _reload.note_changed(["rd"])
    assert sorted(_reload.reload_stale()) == ["rc", "rd"]
    assert (rc.X, rd.Y) == (2, 2)


def test_a_deleted_or_renamed_module_leaves_sys_modules_and_is_not_reloaded(pkgdir):
    write(pkgdir, "old_name", "Z = 1\n")
    write(pkgdir, "user", "import old_name\ndef h():\n    return 'h1'\n")
    import user

    (pkgdir / "old_name.py").rename(pkgdir / "new_name.py")
    write(pkgdir, "user", "def h():\n    return 'h2'\n")
    _reload.note_changed(["old_name", "new_name", "user"])
    assert _reload.reload_stale() == ["user"]
    assert user.h() == "h2" and "old_name" not in sys.modules
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("old_name")
    assert importlib.import_module("new_name").Z == 1


def test_a_module_imported_afresh_meanwhile_is_not_reloaded(pkgdir):
    write(pkgdir, "re_", "N = 1\n")
    import re_  # noqa: F401

    write(pkgdir, "re_", "N = 2\n")
    _reload.note_changed(["re_"])
    del sys.modules["re_"]
    assert importlib.import_module("re_").N == 2
    assert _reload.reload_stale() == []


DECORATED = """
import functools
import torch

def deco(fn):
    @functools.wraps(fn)
    def wrapper(*a, **k):
        return fn(*a, **k)
    return wrapper

@deco
def wrapped():
    return "w{v}"

@torch.no_grad()
def evaluate():
    return "e{v}", torch.is_grad_enabled()

@functools.lru_cache(maxsize=None)
def cached(x):
    return "c{v}" + str(x)

def plain():
    return "p{v}"

def recursive(n):
    def inner(k):
        return "r{v}" if k == 0 else inner(k - 1)
    return inner(n)
"""


def test_old_references_to_decorated_functions_run_the_new_code(pkgdir):
    write(pkgdir, "ev", DECORATED.format(v=1))
    from ev import cached, evaluate, plain, recursive, wrapped  # as another module would hold them

    assert (wrapped(), evaluate(), cached(0), plain(), recursive(3)) == ("w1", ("e1", False), "c10", "p1", "r1")
    write(pkgdir, "ev", DECORATED.format(v=2))
    _reload.note_changed(["ev"])
    assert _reload.reload_stale() == ["ev"]
    assert wrapped() == "w2"
    assert evaluate() == ("e2", False)  # still under no_grad
    assert cached(0) == "c20"  # the cache of the old code's results was cleared
    assert plain() == "p2" and recursive(3) == "r2"


def test_a_reload_that_raises_part_way_leaves_the_module_as_it_was(pkgdir):
    write(pkgdir, "rg", "CACHE = {}\ndef version():\n    return 'v1'\n")
    import rg

    version = rg.version
    rg.CACHE["calls"] = 1
    write(pkgdir, "rg", """
        CACHE = {}
        def version():
            return 'v2'
        ADDED = 1
        raise RuntimeError('config file missing')
    """)
    _reload.note_changed(["rg"])
    with pytest.raises(_reload.ReloadError, match="config file missing"):
        _reload.reload_stale()
    assert rg.version is version and version() == "v1"  # not the new code that ran before the error
    assert rg.CACHE == {"calls": 1} and not hasattr(rg, "ADDED")
    write(pkgdir, "rg", "CACHE = {}\ndef version():\n    return 'v3'\n")
    assert _reload.reload_stale() == ["rg"]  # still stale
    assert version() == "v3"


def test_every_reload_reaches_old_references_and_the_module_keeps_naming_them(pkgdir):
    source = "def f():\n    return 'f{v}'\nclass K:\n    def m(self):\n        return 'm{v}'\n"
    write(pkgdir, "rf", source.format(v=1))
    import rf
    from rf import f  # as another module would hold it

    k = rf.K()  # as a live actor is
    for v in (2, 3, 4):
        write(pkgdir, "rf", source.format(v=v))
        _reload.note_changed(["rf"])
        assert _reload.reload_stale() == ["rf"]
        assert (f(), k.m()) == (f"f{v}", f"m{v}")
    assert rf.f is f and rf.K is type(k)


VALUES = """
import dataclasses
import enum

class State(enum.Enum):
    IDLE = 1
    RUNNING = 2

    def label(self):
        return "{v}" + self.name

@dataclasses.dataclass
class Cfg:
    lr: float = 0.1

DEFAULT = Cfg()

class Perm(enum.Flag):
    R = 1
    W = 2

READ_WRITE = Perm.R | Perm.W
"""


def test_values_made_before_a_reload_still_match_the_modules_names(pkgdir, caplog):
    write(pkgdir, "rh", VALUES.format(v=1))
    import rh

    state, cfg = rh.State.RUNNING, rh.Cfg()  # as a live actor holds them
    write(pkgdir, "rh", VALUES.format(v=2))
    _reload.note_changed(["rh"])
    assert _reload.reload_stale() == ["rh"]
    assert state.label() == "2RUNNING"
    assert state is rh.State.RUNNING is rh.State(2) is rh.State["RUNNING"]
    assert list(rh.State) == [rh.State.IDLE, state]
    assert rh.READ_WRITE is rh.Perm.R | rh.Perm.W  # (a composite Flag value has no member name)
    assert isinstance(cfg, rh.Cfg) and cfg == rh.Cfg() == rh.DEFAULT and isinstance(rh.DEFAULT, rh.Cfg)
    assert pickle.loads(pickle.dumps((state, cfg))) == (state, cfg)  # as in a message to or from an actor
    # An enum cannot gain members in place: the module names a new one, and says so.
    write(pkgdir, "rh", VALUES.format(v=3).replace("RUNNING = 2", "RUNNING = 2\n    DONE = 3"))
    _reload.note_changed(["rh"])
    with caplog.at_level("WARNING", logger="monarch_tensor.reload"):
        assert _reload.reload_stale() == ["rh"]
    assert rh.State.DONE.value == 3 and "rh: State is an enum whose members changed" in caplog.text
    assert isinstance(cfg, rh.Cfg) and cfg == rh.DEFAULT  # the rest of the module as before


SUPER_V1 = """
class Base:
    def hello(self):
        return "base"

class Worker(Base):
    def hello(self):
        return "worker1"

    def ping(self):
        return "ping1"

def f():
    return "f1"
"""

SUPER_V2 = """
class Base:
    def hello(self):
        return "base"

class Worker(Base):
    def hello(self):
        return "worker2 / " + super().hello()  # a __class__ cell now

    def ping(self):
        return "ping2 / " + self.helper()

    def helper(self):  # a new method with one
        return "helper / " + super().hello()

def exclaim(fn):
    def wrapper():
        return fn() + "!"
    return wrapper

@exclaim
def f():  # a closure now: cannot be patched in place
    return "f2"
"""


def test_methods_that_start_using_super_run_the_new_code_and_a_function_left_old_is_logged(pkgdir, caplog):
    write(pkgdir, "rs", SUPER_V1)
    import rs

    w, f = rs.Worker(), rs.f
    write(pkgdir, "rs", SUPER_V2)
    _reload.note_changed(["rs"])
    with caplog.at_level("WARNING", logger="monarch_tensor.reload"):
        assert _reload.reload_stale() == ["rs"]
    assert w.hello() == "worker2 / base"
    assert w.ping() == "ping2 / helper / base"
    assert isinstance(w, rs.Worker)
    assert rs.f() == "f2!" and f() == "f1"  # the old function is not patched, and the log says so
    assert "reload of rs: f " in caplog.text and "hello" not in caplog.text


def test_changed_modules_reload_after_the_changed_modules_they_import(pkgdir):
    # A chain (top -> mid -> low), a diamond (dia -> left, right -> base_), a package whose __init__ re-exports
    # from its submodule, and a cycle: each edit adds a name that a module imports from one changed with it.
    (pkgdir / "pkg").mkdir()
    files = {
        "low": "LR = {v}\n", "mid": "from low import LR\nMID = ('mid', LR)\n",
        "top": "from mid import MID\nTOP = ('top', MID)\n",
        "base_": "B = {v}\n", "left": "import base_\nL = base_.B\n", "right": "from base_ import B\nR = B\n",
        "dia": "from left import L\nfrom right import R\nD = (L, R)\n",
        "pkg/__init__": "from .core import old_fn\n", "pkg/core": "def old_fn():\n    return 1\n",
        "cy_a": "import cy_b\nA = {v}\n", "cy_b": "import cy_a\ndef get():\n    return cy_a.A\n",
    }
    for name, text in files.items():
        write(pkgdir, name, text.format(v=1))
    import cy_b
    import dia
    import pkg
    import top

    assert (top.TOP, dia.D, pkg.old_fn(), cy_b.get()) == (("top", ("mid", 1)), (1, 1), 1, 1)
    files["mid"] = "from low import LR, NEW\nMID = ('mid', LR, NEW)\n"
    files["low"] = "LR = {v}\nNEW = 'new'\n"
    files["pkg/__init__"] = "from .core import old_fn, new_fn\n"
    files["pkg/core"] = "def old_fn():\n    return 1\ndef new_fn():\n    return 2\n"
    for name, text in files.items():
        write(pkgdir, name, text.format(v=2))
    names = [n.replace("/__init__", "").replace("/", ".") for n in files]
    _reload.note_changed(names)
    done = _reload.reload_stale()
    assert sorted(done) == sorted(names)
    for before, after in [("low", "mid"), ("mid", "top"), ("base_", "left"), ("base_", "right"), ("left", "dia"),
                          ("right", "dia"), ("pkg.core", "pkg")]:
        assert done.index(before) < done.index(after), (before, after, done)
    assert top.TOP == ("top", ("mid", 2, "new")) and dia.D == (2, 2)
    assert pkg.new_fn() == 2 and cy_b.get() == 2


SLOTS = """
import dataclasses

class Point:
    __slots__ = {slots}

    def __init__(self, x, y):
        self.x, self.y = x, y

    def norm(self):
        return ("{v}", self.x + self.y)

@dataclasses.dataclass(slots=True)
class Item:
    name: str
    qty: int = 1

    def label(self):
        return ("{v}", self.name, self.qty)
"""


def test_a_class_with_slots_is_patched_and_one_whose_slots_changed_is_left_with_a_warning(pkgdir, caplog):
    write(pkgdir, "rslot", SLOTS.format(v=1, slots="('x', 'y')"))
    import rslot

    p, i = rslot.Point(1, 2), rslot.Item("a", 3)
    write(pkgdir, "rslot", SLOTS.format(v=2, slots="('x', 'y')"))
    _reload.note_changed(["rslot"])
    assert _reload.reload_stale() == ["rslot"]
    assert (p.norm(), p.x, i.label()) == (("2", 3), 1, ("2", "a", 3))
    assert rslot.Point(3, 4).norm() == ("2", 7) and rslot.Item("b").label() == ("2", "b", 1)
    assert type(p) is rslot.Point and type(i) is rslot.Item
    # Other slots: the old instances cannot take the new class; they keep the old one, and the log says so.
    write(pkgdir, "rslot", SLOTS.format(v=3, slots="('x', 'y', 'z')"))
    _reload.note_changed(["rslot"])
    with caplog.at_level("WARNING", logger="monarch_tensor.reload"):
        assert _reload.reload_stale() == ["rslot"]
    assert "reload of rslot: Point has other __slots__ now" in caplog.text
    assert p.norm() == ("2", 3) and rslot.Point(3, 4).norm() == ("3", 7)
    assert i.label() == ("3", "a", 3)  # (Item's slots did not change)


def test_a_class_given_other_base_classes_takes_them_where_python_allows_and_else_says_so(pkgdir, caplog):
    write(pkgdir, "rmix", "class Loud:\n    def shout(self):\n        return self.speak().upper()\n")
    animals = """
        from rmix import Loud

        class Pet:
            def name(self):
                return "pet"

        class Dog{dog}:
            def speak(self):
                return "woof"

        class Puppy(Dog):
            pass

        class Cat{cat}:
            def speak(self):
                return "meow"
    """
    write(pkgdir, "ranimals", animals.format(dog="(Pet)", cat=""))
    import ranimals
    import rmix

    dog, puppy, cat = ranimals.Dog(), ranimals.Puppy(), ranimals.Cat()
    write(pkgdir, "ranimals", animals.format(dog="(Pet, Loud)", cat="(Loud)"))
    _reload.note_changed(["ranimals"])
    with caplog.at_level("WARNING", logger="monarch_tensor.reload"):
        assert _reload.reload_stale() == ["ranimals"]
    assert ranimals.Dog.__mro__ == (ranimals.Dog, ranimals.Pet, rmix.Loud, object)  # as in a fresh process
    assert (dog.shout(), dog.name(), puppy.shout()) == ("WOOF", "pet", "WOOF")
    assert type(dog) is ranimals.Dog and type(puppy) is ranimals.Puppy
    # Python refuses other bases to a class that had none but object: the module names the new class, what
    # holds the old one keeps it, and the log says so.
    assert "reload of ranimals: Cat has other base classes now, which Python does not let it take" in caplog.text
    assert ranimals.Cat().shout() == "MEOW" and type(cat) is not ranimals.Cat and not hasattr(cat, "shout")


def test_a_registry_filled_by_the_reload_holds_the_class_the_module_names(pkgdir):
    # The registries live in a module that is not reloaded, as in a fresh process they would be filled by
    # models' import; the reload fills them with the new classes.
    write(pkgdir, "rreg", """
        REG, PLUGINS = {}, []

        def register(cls):
            REG[cls.__name__] = cls
            PLUGINS.append(cls)
            setattr(Holder, cls.__name__, cls)
            return cls

        class Holder:
            pass
    """)
    models = "from rreg import register\n\n@register\nclass Linear:\n    def name(self):\n        return 'v{v}'\n"
    write(pkgdir, "rmodels", models.format(v=1))
    import rmodels
    import rreg

    for v in (2, 3):
        write(pkgdir, "rmodels", models.format(v=v))
        _reload.note_changed(["rmodels"])
        assert _reload.reload_stale() == ["rmodels"]
        assert rreg.REG["Linear"] is rmodels.Linear and isinstance(rreg.REG["Linear"](), rmodels.Linear)
        assert rreg.REG["Linear"]().name() == f"v{v}"
        assert rreg.Holder.Linear is rmodels.Linear
        assert rreg.PLUGINS == [rmodels.Linear] * v  # (appended to at each import: once in a fresh process)


def test_a_class_attribute_filled_after_its_class_statement_takes_the_new_value_with_a_warning(pkgdir, caplog):
    base = """
        class Plugin:
            registry = {{}}

            def __init_subclass__(cls, **kw):
                super().__init_subclass__(**kw)
                Plugin.registry[cls.__name__] = cls

            def run(self):
                return "base v{v}"
    """
    write(pkgdir, "rplug", base.format(v=1))
    write(pkgdir, "rimpl", "from rplug import Plugin\nclass A(Plugin):\n    pass\n")
    import rimpl
    import rplug

    write(pkgdir, "rplug", base.format(v=2))
    _reload.note_changed(["rplug"])
    with caplog.at_level("WARNING", logger="monarch_tensor.reload"):
        assert _reload.reload_stale() == ["rplug"]
    assert rimpl.A().run() == "base v2"
    # A fresh process would have {"A": A}: the reload does not say otherwise silently.
    assert rplug.Plugin.registry == {}
    assert "reload of rplug: Plugin.registry is the new class body's empty dict" in caplog.text
