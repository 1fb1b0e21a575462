"""A proc imports what DTensor needs (torch._dynamo) on a thread of its own from its start, where its
template had not imported it before forking it (the tensor worker, if the proc started without torch),
so a first sharded op on procs that ran a while does not wait for it; ``MONARCH_TENSOR_NO_WARMUP=1``
stops it."""

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
from worker.worker import start_warm_up
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
