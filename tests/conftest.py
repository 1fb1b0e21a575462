import json
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


# Seconds each test file took in a recent full run, and each test of the files handed out test by test
# (ONE_TEST_AT_A_TIME; keyed by node id); .ci/durations.py writes it from a JUnit XML. A file it does not list counts
# as DEFAULT_FILE_SECONDS; a test it does not list as its file's seconds not listed by test, shared evenly.
DURATIONS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "durations.json")
DEFAULT_FILE_SECONDS = 20.0


# The tiers (docs/quick-start.md): files whose tests spawn no procs (no template process, host agent or job),
# marked ``unit``; every other test is marked ``procs``. ``pytest -m unit`` runs in seconds; a unit test that
# starts this machine's template process fails (see _unit_tests_spawn_no_procs).
UNIT_FILES = ("test_engine_wire.py", "test_future.py", "test_hooks.py", "test_layers.py", "test_ndslice.py", "test_opaque.py",
              "test_profiler.py", "test_rdma_verbs.py", "test_reload.py", "test_remote_autograd_function.py",
              "test_selection.py", "test_shape.py", "test_shard_batch.py", "test_slurm_script.py",
              "test_staged_group.py")


def pytest_configure(config):
    config.addinivalue_line("markers", "unit: spawns no procs (tests/conftest.py's UNIT_FILES); `pytest -m unit`")
    config.addinivalue_line("markers", "procs: runs procs, host agents or jobs; `pytest -m procs`")


def _mark_tiers(items) -> None:
    for item in items:
        unit = os.path.basename(str(item.fspath)) in UNIT_FILES
        item.add_marker(pytest.mark.unit if unit else pytest.mark.procs)


@pytest.fixture(autouse=True)
def _unit_tests_spawn_no_procs(request):
    """A test marked ``unit`` that started this machine's template process (so procs) is in the wrong tier."""
    if request.node.get_closest_marker("unit") is None:
        yield
        return
    host = sys.modules.get("monarch_tensor.hosts.host")
    before = host is not None and host._local_host is not None
    yield
    host = sys.modules.get("monarch_tensor.hosts.host")
    if not before and host is not None and host._local_host is not None:
        pytest.fail(f"{request.node.nodeid} is marked unit (tests/conftest.py's UNIT_FILES) but spawned procs")


def pytest_collection_modifyitems(session, config, items):
    """Marks each test with its tier (``unit`` or ``procs``). Under pytest-xdist (``--dist loadfile``: each file runs
    whole on one worker, but the tests of ONE_TEST_AT_A_TIME one by one) the units of work that take longest come
    first, so that no worker starts a long one while the others run out of work. The tests of a file run whole keep
    their order; a run without workers keeps the collected order."""
    _mark_tiers(items)
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return
    try:
        with open(DURATIONS) as f:
            seconds = json.load(f)
    except (OSError, ValueError):
        return
    estimate = _unit_seconds(items, seconds)
    first: dict[str, int] = {}
    for i, item in enumerate(items):
        first.setdefault(_unit(item.nodeid), i)
    items.sort(key=lambda it: (-estimate[_unit(it.nodeid)], first[_unit(it.nodeid)]))


def _unit(nodeid: str) -> str:
    """What pytest-xdist hands a worker at once: the test's file, or the test itself in ONE_TEST_AT_A_TIME."""
    file = nodeid.split("::", 1)[0]
    return nodeid if file in ONE_TEST_AT_A_TIME else file


def _unit_seconds(items, seconds: dict) -> dict[str, float]:
    """Each unit's expected seconds: a file's from durations.json; a test of ONE_TEST_AT_A_TIME its own, or else
    an even share of what its file's listed tests leave of the file's seconds."""
    per_file: dict[str, list[str]] = {}
    for item in items:
        per_file.setdefault(item.nodeid.split("::", 1)[0], []).append(item.nodeid)
    out: dict[str, float] = {}
    for file, ids in per_file.items():
        total = float(seconds.get(file, DEFAULT_FILE_SECONDS))
        if file not in ONE_TEST_AT_A_TIME:
            out[file] = total
            continue
        listed = {i: float(seconds[i]) for i in ids if i in seconds}
        rest = [i for i in ids if i not in listed]
        share = max(total - sum(listed.values()), 0.0) / len(rest) if rest else 0.0
        out.update(listed)
        out.update({i: share for i in rest})
    return out


# Files whose tests are long and share nothing but module fixtures (each runs its own subprocess or job):
# pytest-xdist hands out their tests one at a time, not the whole file to one worker.
ONE_TEST_AT_A_TIME = ("tests/test_bench_smoke.py", "tests/test_dtensor_examples.py", "tests/test_examples.py",
                      "tests/test_job_cli.py")


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """``--dist loadfile``, except for the files of ONE_TEST_AT_A_TIME, whose tests are scheduled one by one."""
    if config.getoption("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class Scheduling(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            file = nodeid.split("::", 1)[0]
            return nodeid if file in ONE_TEST_AT_A_TIME else file

    return Scheduling(config, log)


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


@pytest.fixture
def short_tmp_path():
    """A directory with a short path, for a test that makes it a process's TMPDIR: the sockets under it stay
    within the 107 characters of a socket's path (``tmp_path`` is long, longer under pytest-xdist's workers)."""
    import pathlib
    import shutil
    import tempfile

    d = tempfile.mkdtemp(prefix="mt-t-")
    yield pathlib.Path(d)
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture(scope="module")
def mesh():
    """A mesh of two procs, {"gpus": 2}, for a test module (a module may define its own ``mesh``)."""
    from monarch_tensor import this_host

    m = this_host().spawn_procs(per_host={"gpus": 2})
    yield m
    m.stop()


@pytest.fixture(scope="module")
def procs(request):
    """A mesh of procs for a test module: the module's ``PROCS`` sizes, else two procs, {"gpus": 2} (a module
    may define its own ``procs``)."""
    from monarch_tensor import this_host

    m = this_host().spawn_procs(per_host=getattr(request.module, "PROCS", {"gpus": 2}))
    yield m
    m.stop()


@pytest.fixture
def faults(monkeypatch):
    """The unhandled supervision failures of a test, collected in a list (instead of the default hook)."""
    import monarch_tensor.actor as actor_mod

    seen = []
    monkeypatch.setattr(actor_mod, "unhandled_fault_hook", seen.append)
    return seen
