import os
import signal
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

# Procs of a script that imported torch import torch._dynamo in the background from their start (the first
# DTensor op then need not wait for it): some 2 CPU-seconds a proc, which hundreds of spawns in this suite
# would pay on CI's 2 cores for nothing. The tests of the warm-up (and of what it must not break) set the
# variable themselves.
os.environ.setdefault("MONARCH_TENSOR_NO_WARMUP", "1")

# A runner started as a background job of a script (`bash .ci/run &`) inherits SIGINT ignored, and so would
# every process the tests start, whose Ctrl-C tests (tests/test_job_cli.py) then wait in vain: take it back.
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


@pytest.fixture(autouse=True, scope="session")
def _report_unhandled_faults_instead_of_exiting():
    """The default ``unhandled_fault_hook`` ends the script's process: in the test runner that would end
    every remaining test at once, with its message lost in pytest's captured stderr. Here it reports the
    failure on the real stderr instead; tests that expect a failure replace the hook themselves."""
    import monarch_tensor.actor as actor_mod

    default = actor_mod.unhandled_fault_hook

    def report(failure) -> None:
        print(f"\nunhandled supervision failure (the test runner goes on): {failure}", file=sys.__stderr__,
              flush=True)

    actor_mod.unhandled_fault_hook = report
    yield
    actor_mod.unhandled_fault_hook = default


@pytest.fixture(scope="module")
def mesh():
    """A mesh of two procs, {"gpus": 2}, for a test module (a module may define its own ``mesh``)."""
    from monarch_tensor import this_host

    m = this_host().spawn_procs(per_host={"gpus": 2})
    yield m
    m.stop()
