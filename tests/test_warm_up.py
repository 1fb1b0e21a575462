"""Procs are forked after their template imported what DTensor needs (torch._dynamo); a proc imports it on a
thread of its own from its start only where its template had not (the tensor worker, if the proc started
without torch), so a first sharded op on procs that ran a while does not wait for it;
``MONARCH_TENSOR_NO_WARMUP=1`` stops it."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CODE = """
import sys, threading
import torch
assert "torch._dynamo" not in sys.modules
from monarch_tensor.worker.worker import start_warm_up
t = start_warm_up()
if t is None:
    print("off", "torch._dynamo" in sys.modules)
else:
    assert t.daemon and threading.current_thread() is not t
    t.join(300)
    print("done", not t.is_alive(), "torch._dynamo" in sys.modules, start_warm_up() is t)
"""


@pytest.mark.timeout(300)
@pytest.mark.parametrize("off, expected", [("", "done True True True"), ("1", "off False")])
def test_the_worker_imports_dtensors_needs_in_the_background(off, expected):
    env = dict(os.environ, PYTHONPATH=ROOT, MONARCH_TENSOR_NO_WARMUP=off)
    out = subprocess.run([sys.executable, "-c", CODE], env=env, capture_output=True, text=True, timeout=280)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split("\n")[-2] == expected, out.stdout + out.stderr


SPAWN = """
import sys
sys.path.insert(0, {root!r})
{engine}
from monarch_tensor.runtime import _zygote
from monarch_tensor.actor import Actor, endpoint, this_host

class Probe(Actor):
    @endpoint
    def state(self):
        return "torch._dynamo" in sys.modules, _zygote.preloading is not None

procs = this_host().spawn_procs({{"gpus": 2}})
print("STATE", sorted(set(procs.spawn("p", Probe).state.call().get(timeout=120).values())))
procs.stop().get(timeout=60)
"""


@pytest.mark.timeout(200)
@pytest.mark.parametrize("engine, expected", [
    ("import torch; from monarch_tensor import distribute", "STATE [(True, False)]"),
    ("import torch", "STATE [(True, False)]"),
    ("", "STATE [(False, False)]")])
def test_procs_are_forked_after_their_template_imported_what_dtensor_needs(engine, expected):
    """With the warm-up on, a script that imported torch (the tensor engine or not) has its spawn wait for the
    template's idle imports, so its procs start with them loaded and none imports them again (seconds of CPU
    a proc: an optimizer made in an actor's __init__ imports torch._dynamo). A script without torch has its
    procs forked at once, and they import nothing in the background."""
    env = dict(os.environ, PYTHONPATH=ROOT, MONARCH_TENSOR_NO_WARMUP="")
    out = subprocess.run([sys.executable, "-c", SPAWN.format(root=ROOT, engine=engine)], env=env,
                         capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stderr
    assert expected in out.stdout.splitlines(), out.stdout + out.stderr



def test_an_import_ahead_of_time_never_raises(tmp_path, monkeypatch):
    """The background import (``_zygote._try_import``) is best effort: a proc that exits while it runs has its
    modules' globals cleared under it, which raised "'NoneType' object has no attribute 'rand'" out of the
    thread and printed a traceback in the user's terminal. Any error is left for the proc's own import."""
    from monarch_tensor.runtime import _zygote

    (tmp_path / "mt_broken_mod.py").write_text("aten = None\nrand = aten.rand\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    _zygote._try_import("mt_broken_mod")  # AttributeError, as in a proc torn down under the import
    _zygote._try_import("mt_no_such_module")
    assert "mt_broken_mod" not in sys.modules
    with pytest.raises(AttributeError):
        __import__("mt_broken_mod")  # the proc's own import sees the error
