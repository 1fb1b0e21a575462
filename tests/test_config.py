"""Runtime settings by Monarch's names (monarch_tensor.config): the layers, bad input, and each setting's
effect: on the script's log lines, on procs spawned afterwards, and on the data plane."""

import dataclasses
import re
import warnings

import pytest
from monarch_tensor.rdma import RDMABuffer, RDMATcpFallbackWarning
from monarch_tensor.rdma.backends import verbs
from monarch_tensor.rdma.errors import BackendUnavailableError
from test_logs import lines, run_script

import monarch_tensor
from monarch_tensor import config

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(autouse=True)
def _clean_runtime_layer():
    config.clear_runtime_config()
    yield
    config.clear_runtime_config()


def test_layers_defaults_environment_runtime_and_configured(monkeypatch):
    assert monarch_tensor.configure is config.configure and monarch_tensor.configured is config.configured
    assert config.get_global_config() == {"enable_log_forwarding": True, "prefix_with_rank": True,
                                          "fold_repeated_lines": True, "rdma_allow_tcp_fallback": True,
                                          "rdma_disable_ibverbs": False, "rdma_backend": "",
                                          "spawn_timeout": 60.0, "job_start_timeout": 0.0, "stop_timeout": 5.0,
                                          "payload_timeout": 60.0, "agent_heartbeat_timeout": 5.0}
    monkeypatch.setenv("MONARCH_TENSOR_PREFIX_WITH_RANK", "0")
    assert config.get("prefix_with_rank") is False and config.get_runtime_config() == {}
    config.configure(prefix_with_rank=True)  # the runtime layer wins over the environment
    assert config.get("prefix_with_rank") is True and config.get_runtime_config() == {"prefix_with_rank": True}
    with config.configured(rdma_allow_tcp_fallback=False) as merged:
        assert merged["rdma_allow_tcp_fallback"] is False and merged["prefix_with_rank"] is True
        assert config.proc_env()["MONARCH_TENSOR_RDMA_ALLOW_TCP_FALLBACK"] == "0"
    assert config.get_runtime_config() == {"prefix_with_rank": True}  # as it was before the block
    config.clear_runtime_config()
    assert config.get("prefix_with_rank") is False
    from monarch_tensor.actor import this_host

    assert this_host().stream_logs is True  # Monarch's HostMesh.stream_logs reads the setting
    with config.configured(enable_log_forwarding=False):
        assert this_host().stream_logs is False


def test_bad_settings_are_refused_before_anything_changes(monkeypatch):
    with pytest.raises(ValueError, match="no such setting; the settings are"):
        config.configure(prefix_with_rank=False, colour=True)
    with pytest.raises(TypeError, match="takes a bool, got 'no'"):
        config.configure(enable_log_forwarding="no")
    assert config.get_runtime_config() == {}
    monkeypatch.setenv("MONARCH_TENSOR_ENABLE_LOG_FORWARDING", "maybe")
    with pytest.raises(ValueError, match="must be 1 or 0"):
        config.get("enable_log_forwarding")
    with pytest.raises(KeyError, match="no setting 'colour'"):
        config.get("colour")


_seen: list = []


@config.parametrize_config(prefix_with_rank={True, False}, rdma_disable_ibverbs={True, False})
def test_parametrize_config_runs_every_combination_inside_configured(tmp_path):
    got = config.get_global_config()
    _seen.append((got["prefix_with_rank"], got["rdma_disable_ibverbs"]))
    assert tmp_path.exists()  # the test's own fixtures still arrive


@config.parametrize_config_pointwise(prefix_with_rank=[True, False], enable_log_forwarding=[False, True])
def test_parametrize_config_pointwise_zips_the_values():
    got = config.get_global_config()
    assert (got["prefix_with_rank"], got["enable_log_forwarding"]) in {(True, False), (False, True)}


def test_parametrize_config_saw_each_combination_and_refuses_bad_sweeps():
    assert sorted(_seen) == [(False, False), (False, True), (True, False), (True, True)]
    assert config.get_runtime_config() == {}  # each run's settings ended with it
    with pytest.raises(ValueError, match="no such setting"):
        config.parametrize_config(colour={True})
    with pytest.raises(TypeError, match="takes a bool"):
        config.parametrize_config(prefix_with_rank={"yes"})
    with pytest.raises(TypeError, match="collection of values"):
        config.parametrize_config(prefix_with_rank=True)
    with pytest.raises(ValueError, match="as many values"):
        config.parametrize_config_pointwise(prefix_with_rank=[True], enable_log_forwarding=[True, False])
    with pytest.raises(ValueError, match="at least one setting"):
        config.parametrize_config()


def test_tcp_fallback_to_another_host_can_be_forbidden():
    src = bytearray(b"across hosts")
    buf = RDMABuffer(memoryview(src))
    far = RDMABuffer._from_desc(dataclasses.replace(buf._desc, host="elsewhere/boot-id"))
    out = bytearray(len(src))
    try:
        with config.configured(rdma_allow_tcp_fallback=False):
            with pytest.raises(BackendUnavailableError, match=r"rdma_allow_tcp_fallback=False\) forbids"):
                far.read_into(out).get(timeout=10)
            buf.read_into(out).get(timeout=10)  # this host's buffers move as before
        with pytest.warns(RDMATcpFallbackWarning):
            far.read_into(out).get(timeout=10)
        assert out == src
    finally:
        buf.drop()


def test_ibverbs_can_be_disabled(monkeypatch):
    monkeypatch.setattr(verbs, "unavailable_reason", lambda: None)  # as on a machine with an RDMA NIC
    assert verbs.available()
    with config.configured(rdma_disable_ibverbs=True):
        assert not verbs.available() and not monarch_tensor.rdma.is_ibverbs_available()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert verbs.available()


def test_log_settings_reach_the_script_and_procs_spawned_afterwards(tmp_path):
    out = run_script(tmp_path, '''
        from monarch_tensor import configure, configured
        procs = this_host().spawn_procs(per_host={"gpus": 2})
        talkers = procs.spawn("talker", Talker)
        with configured(prefix_with_rank=False):
            talkers.say.call("no prefix here").get(timeout=30)
            deadline = time.monotonic() + 15
            while sys.stdout.text.count("no prefix here\\n") < 2 and time.monotonic() < deadline:
                time.sleep(0.01)  # both ranks' lines, printed while the setting holds
        configure(enable_log_forwarding=False)
        quiet = this_host().spawn_procs(per_host={"gpus": 1})
        quiet.spawn("talker", Talker).say.call("from a quiet proc").get(timeout=30)
        talkers.say.call("still forwarded").get(timeout=30)  # spawned before: forwarding as it was
        wait_for(sys.stdout, "[1] still forwarded\\n")
        quiet.logging_option(stream_to_client=True).get(timeout=30)  # switched on for a running mesh
        quiet.spawn("talker2", Talker).say.call("now forwarded").get(timeout=30)
        wait_for(sys.stdout, "[0] now forwarded\\n")  # (its proc wrote the quiet line before this one)
        print("QUIET LINE FORWARDED" if "from a quiet proc" in sys.stdout.text else "QUIET LINE KEPT")
        procs.stop().get(timeout=30)
        quiet.stop().get(timeout=30)
        print("SCRIPT DONE")
    ''')
    stdout = lines(out.stdout)
    assert stdout.count("no prefix here") == 2 and "[0] no prefix here" not in stdout
    # Not forwarded: the quiet proc's line went to its own stdout (here the same pipe), without a prefix.
    assert "QUIET LINE KEPT" in stdout and "from a quiet proc" in stdout and "[0] from a quiet proc" not in stdout
    assert "SCRIPT DONE" in stdout


def test_env_number_names_the_variable_and_what_it_takes(monkeypatch):
    monkeypatch.delenv("MONARCH_TENSOR_X", raising=False)
    assert config.env_number("MONARCH_TENSOR_X", 7, "a number") == 7
    monkeypatch.setenv("MONARCH_TENSOR_X", "12")
    assert config.env_number("MONARCH_TENSOR_X", 7, "a whole number", integer=True) == 12
    for raw, kw in (("abc", {}), ("1.5", {"integer": True}), ("-1", {}), ("nan", {}), ("inf", {}),
                    ("0", {"least": 1})):
        monkeypatch.setenv("MONARCH_TENSOR_X", raw)
        with pytest.raises(ValueError, match=r"MONARCH_TENSOR_X must be a thing \(0: none\)"):
            config.env_number("MONARCH_TENSOR_X", 7, "a thing (0: none)", **kw)


def test_env_flag_reads_the_usual_spellings_and_names_the_variable_otherwise(monkeypatch):
    monkeypatch.delenv("MONARCH_TENSOR_X", raising=False)
    assert config.env_flag("MONARCH_TENSOR_X", True) is True and config.env_flag("MONARCH_TENSOR_X", False) is False
    for raw, on in (("1", True), ("true", True), ("Yes", True), (" ON ", True), ("0", False), ("FALSE", False),
                    ("no", False), ("off", False)):
        monkeypatch.setenv("MONARCH_TENSOR_X", raw)
        assert config.env_flag("MONARCH_TENSOR_X", not on) is on, raw
    monkeypatch.setenv("MONARCH_TENSOR_X", "")
    assert config.env_flag("MONARCH_TENSOR_X", True) is True
    monkeypatch.setenv("MONARCH_TENSOR_X", "maybe")
    with pytest.raises(ValueError, match=r"MONARCH_TENSOR_X must be 1 or 0 \(true or false\), got 'maybe'"):
        config.env_flag("MONARCH_TENSOR_X", True)


_SWITCHES = [  # (variable, the module that reads it at import, the module's name for it)
    ("MONARCH_TENSOR_SYNC_PULL_SAME_HOST", "monarch_tensor.workspace_sync", "PULL_SAME_HOST"),
    ("MONARCH_TENSOR_SYNC_COPY_LOCAL", "monarch_tensor.workspace_sync", "COPY_LOCAL"),
    ("MONARCH_TENSOR_RECEIVE_ON_WAIT", "monarch_tensor.transport.mailbox", "RECEIVE_ON_WAIT"),
]


_SWITCH_WORDS = (("true", True), ("false", False), ("On", True), ("off", False))


@pytest.mark.parametrize("var,module,attr", _SWITCHES, ids=[c[0][15:] for c in _SWITCHES])
def test_documented_switches_read_true_and_false_and_refuse_other_words(var, module, attr, fresh_imports):
    """``=true`` turned PULL_SAME_HOST off (only ``1`` was on), ``=false`` left COPY_LOCAL and RECEIVE_ON_WAIT
    on (only ``0`` was off), with no error; a word that is neither is an error naming the variable."""
    for raw, on in _SWITCH_WORDS:
        assert fresh_imports[(var, raw, module, attr)] == str(on), raw
    last = fresh_imports[(var, "maybe", module, None)]
    assert last == f"ValueError: {var} must be 1 or 0 (true or false), got 'maybe'", last


_ENV_CASES = [  # (variable, bad value, the module that reads it at import, what the error says it takes)
    ("MONARCH_TENSOR_KEEP_FREED_MB", "abc", "monarch_tensor.worker.worker", "a whole number of MiB"),
    ("MONARCH_TENSOR_KEEP_FREED_MB", "-5", "monarch_tensor.worker.worker", "a whole number of MiB"),
    ("MONARCH_TENSOR_RDMA_TCP_SPIN_US", "abc", "monarch_tensor.rdma.backends.tcp", "a number of microseconds"),
    ("MONARCH_TENSOR_PAYLOAD_THRESHOLD", "abc", "monarch_tensor.rdma.payload", "a whole number of bytes"),
    ("MONARCH_TENSOR_PAYLOAD_TTL", "abc", "monarch_tensor.rdma.payload", "a number of seconds"),
    ("MONARCH_TENSOR_PAYLOAD_TTL", "0", "monarch_tensor.rdma.payload", "at least 1"),
    ("MONARCH_TENSOR_PAYLOAD_TTL", "-1", "monarch_tensor.rdma.payload", "at least 1"),
    ("MONARCH_TENSOR_COLLECTIVE_TIMEOUT", "abc", "monarch_tensor.worker.collectives", "a number of seconds"),
    ("MONARCH_TENSOR_COLLECTIVE_TIMEOUT", "-5", "monarch_tensor.worker.collectives", "at least 1"),
]


_IMPORT_SCRIPT = """
import importlib, json, os, sys, traceback
out = []
for var, raw, module, attr in json.loads(sys.argv[1]):
    os.environ[var] = raw
    sys.modules.pop(module, None)  # (a module an earlier case or another module imported: read it afresh)
    try:
        m = importlib.import_module(module)
        out.append(str(getattr(m, attr)) if attr else "imported")
    except BaseException:
        out.append(traceback.format_exc().strip().splitlines()[-1])
    del os.environ[var]
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def fresh_imports() -> dict:
    """Each module that reads a variable at import, imported afresh with the variable set, all in one fresh
    process: (variable, value, module, attribute or None) -> the attribute's str, "imported", or the last line
    of what the import raised. The cases of _SWITCHES (each word, and "maybe") and of _ENV_CASES."""
    import json
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    cases = [(var, raw, module, attr) for var, module, attr in _SWITCHES for raw, _ in _SWITCH_WORDS]
    cases += [(var, "maybe", module, None) for var, module, _ in _SWITCHES]
    cases += [(var, raw, module, None) for var, raw, module, _ in _ENV_CASES]
    r = subprocess.run([sys.executable, "-c", _IMPORT_SCRIPT, json.dumps(cases)], capture_output=True, text=True,
                       env=dict(os.environ, PYTHONPATH=root), timeout=120)
    assert r.returncode == 0, r.stderr
    return dict(zip(cases, json.loads(r.stdout.strip().splitlines()[-1])))


@pytest.mark.parametrize("var,raw,module,takes", _ENV_CASES, ids=[f"{c[0][15:]}={c[1]}" for c in _ENV_CASES])
def test_documented_variables_with_a_bad_value_are_a_clear_error(var, raw, module, takes, fresh_imports):
    """A documented ``MONARCH_TENSOR_*`` number that is not one (or out of range) fails where it is read, with
    the variable's name and what it takes (bare int()/float() errors named neither; a TTL of 0 failed every
    cross-host payload later)."""
    last = fresh_imports[(var, raw, module, None)]
    assert last.startswith(f"ValueError: {var} must be ") and takes in last, last


@pytest.mark.parametrize("raw,warms", [("0", True), ("1", False), ("", True), ("false", True), ("TRUE", False),
                                       ("off", True), ("yes", False)])
def test_no_warmup_reads_0_as_off_as_the_other_switches(raw, warms, monkeypatch):
    """``MONARCH_TENSOR_NO_WARMUP=0`` (or ``false``) leaves the warm-up on (it turned it off: any value other
    than 0 did). Every reader of it (the spawn's warm-up, the template's, the procs') reads it through ``setting``."""
    from monarch_tensor.runtime import _zygote

    monkeypatch.setenv("MONARCH_TENSOR_NO_WARMUP", raw)
    assert _zygote._warm_up_on() is warms
    assert (not config.setting("MONARCH_TENSOR_NO_WARMUP")) is warms


def test_no_warmup_0_warms_the_tensor_engine_up():
    """End to end, in a fresh process: with ``MONARCH_TENSOR_NO_WARMUP=0`` the warm-up imports torch._dynamo."""
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    code = ("import sys, torch\nfrom monarch_tensor.hosts import host, local\nlocal._warm_tensor_engine()\n"
            "print('torch._dynamo' in sys.modules)\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=90,
                       env=dict(os.environ, PYTHONPATH=root, MONARCH_TENSOR_NO_WARMUP="0"))
    assert r.stdout.strip() == "True", r.stderr


def test_monarchs_runtime_settings_map_to_their_counterparts_or_warn_that_they_are_ignored(monkeypatch):
    # Monarch's names for its Rust runtime's settings: durations in humantime; those with a counterpart here
    # set it, the others are ignored with a warning naming them (nothing changes for them).
    with pytest.warns(config.IgnoredSettingWarning, match="tail_log_lines, codec_max_frame_length"):
        config.configure(message_delivery_timeout="1m 30s", mesh_proc_spawn_max_idle="45s", tail_log_lines=100,
                         mesh_terminate_timeout="2500ms", host_spawn_ready_timeout="2min",
                         supervision_watchdog_timeout=3, codec_max_frame_length=1 << 20)
    assert config.get_runtime_config() == {"payload_timeout": 90.0, "spawn_timeout": 45.0, "stop_timeout": 2.5,
                                           "job_start_timeout": 120.0, "agent_heartbeat_timeout": 3.0}
    assert config.proc_env()["MONARCH_TENSOR_PAYLOAD_TIMEOUT"] == "90.0"  # procs pull payloads too
    from monarch_tensor.job.local import LocalJob

    assert LocalJob(meshes={"m": 1}).start_timeout == 120.0
    config.clear_runtime_config()
    assert LocalJob(meshes={"m": 1}).start_timeout == 60.0  # the job's own default
    monkeypatch.setenv("MONARCH_TENSOR_SPAWN_TIMEOUT", "7")
    assert config.get("spawn_timeout") == 7.0
    for bad, match in ((dict(message_delivery_timeout="soon"), "not a duration"),
                       (dict(mesh_proc_spawn_max_idle="0s"), "at least"),
                       (dict(process_exit_timeout=[1]), "takes a duration"),
                       (dict(default_transport="quic"), "default_transport")):
        with pytest.raises((ValueError, TypeError), match=match):
            config.configure(prefix_with_rank=False, **bad)
        assert config.get_runtime_config() == {}  # refused before anything changed
    from monarch_tensor import actor

    before = actor.enabled_transport
    with config.configured(default_transport="tcp"):
        assert actor.enabled_transport is actor.ChannelTransport.TcpWithHostname
        assert config.get_global_config()["default_transport"] is actor.ChannelTransport.TcpWithHostname
    assert actor.enabled_transport is before



def test_a_string_that_is_not_a_duration_is_the_type_error_monarch_raises():
    # Monarch's test_config.py::test_duration_config_invalid_format: pytest.raises(TypeError) around
    # configured(host_spawn_ready_timeout="invalid"); here it is a ValueError too, as before.
    for key in ("host_spawn_ready_timeout", "mesh_proc_spawn_max_idle", "spawn_timeout"):
        with pytest.raises(TypeError, match="is not a duration") as info:
            with config.configured(**{key: "invalid"}):
                pass
        assert isinstance(info.value, ValueError) and type(info.value) is config.DurationError
        assert config.get_runtime_config() == {}  # refused before anything changed
    with pytest.raises(ValueError, match="'abc123' is not a duration"):
        config.humantime_seconds("abc123")


def test_every_declared_setting_is_well_formed_and_checks_its_values(monkeypatch):
    """Each registry entry: a known kind and place, a default of its kind, unset and empty read as the
    default, a good value read as such, and a bad one refused with the variable, the value and what it takes."""
    from monarch_tensor import _settings

    assert len(_settings.REGISTRY) == len(_settings._DECLARED) > 50, "a variable declared twice"
    for s in _settings.REGISTRY.values():
        assert s.name.startswith("MONARCH_TENSOR_") and s.kind in _settings.KINDS and s.acts in _settings.ACTS, s
        assert s.section in _settings.SECTIONS and s.doc, s
        monkeypatch.delenv(s.name, raising=False)
        assert config.setting(s.name) == s.default
        if s.kind == "text":
            monkeypatch.setenv(s.name, "a,b")
            assert config.setting(s.name) == "a,b"
            monkeypatch.delenv(s.name)
            continue
        if s.kind == "choice":
            assert s.default in s.choices
            good, bad = s.choices[-1], "nonesuch"
        elif s.kind == "flag":
            assert isinstance(s.default, bool)
            good, bad = ("off" if s.default else "on"), "maybe"
            monkeypatch.setenv(s.name, "")
            assert config.setting(s.name) is s.default
        else:
            assert s.default is None or (s.default >= s.least and isinstance(s.default, int if s.kind == "int"
                                                                            else float)), s
            good, bad = str(int(s.least) + 3), "abc"
            monkeypatch.setenv(s.name, str(s.least - 1))
            with pytest.raises(ValueError, match=f"{s.name} must be .*at least {s.least:g}, got "):
                config.setting(s.name)
        monkeypatch.setenv(s.name, good)
        want = good if s.kind == "choice" else (not s.default) if s.kind == "flag" else \
            int(good) if s.kind == "int" else float(good)
        assert config.setting(s.name) == want and type(config.setting(s.name)) is type(want), s
        monkeypatch.setenv(s.name, bad)
        with pytest.raises(ValueError, match=f"^{s.name} must be {re.escape(s.accepts())}, got '{bad}'$"):
            config.setting(s.name)
        monkeypatch.delenv(s.name)


def test_an_undeclared_setting_is_refused_by_name():
    with pytest.raises(KeyError, match="MONARCH_TENSOR_NOPE is not a declared setting"):
        config.setting("MONARCH_TENSOR_NOPE")
    with pytest.raises(KeyError, match="MONARCH_TENSOR_NOPE is not a declared setting"):
        config.take("MONARCH_TENSOR_NOPE")
