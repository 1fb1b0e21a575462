"""Monarch's ``monarch.tools.network``, ``monarch.tools.utils`` and ``monarch.tools.cli`` at their paths here
(the behaviours of Monarch's python/tests/tools/test_network.py, test_utils.py, test_cli.py); no procs."""

import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from monarch_tensor.tools import cli, network
from monarch_tensor.tools.utils import MONARCH_HOME, conda

pytestmark = pytest.mark.timeout(60)


def _info(family, addr):
    return [(family, socket.SOCK_STREAM, socket.IPPROTO_TCP, "", addr)]


def _fake_getaddrinfo(v6, v4):
    """A resolver with one address per family (None: that family has none)."""

    def getaddrinfo(host, port, family, type):
        addr = v6 if family == socket.AF_INET6 else v4
        if addr is None:
            raise socket.gaierror("no address of that family")
        return _info(family, (addr, port, 0, 0) if family == socket.AF_INET6 else (addr, port))

    return getaddrinfo


@pytest.mark.parametrize("v6, v4, sockaddr, ipaddr", [
    ("1234:ab00:567c:89d:abcd:0:328:0", "10.0.0.1", "[1234:ab00:567c:89d:abcd:0:328:0]:8080",
     "1234:ab00:567c:89d:abcd:0:328:0"),                                   # IPv6 first
    (None, "123.45.67.89", "123.45.67.89:8080", "123.45.67.89"),           # else IPv4
    ("fe80::222:48ff:fe49:ba90", "10.0.0.1", "10.0.0.1:8080", "10.0.0.1"),  # link-local IPv6 skipped
])
def test_network_resolves_ipv6_then_ipv4_skipping_link_local(monkeypatch, v6, v4, sockaddr, ipaddr):
    monkeypatch.setattr(socket, "getaddrinfo", _fake_getaddrinfo(v6, v4))
    assert network.get_sockaddr("foo.example.com", 8080) == sockaddr
    assert network.get_ipaddr("foo.example.com", 8080) == ipaddr
    if v4 is not None:
        assert network.get_ipaddr("foo.example.com", 8080, network.AddrType.IPv4) == v4


def test_network_raises_without_a_usable_address(monkeypatch):
    monkeypatch.setattr(socket, "getaddrinfo", _fake_getaddrinfo("fe80::1", "169.254.1.1"))
    with pytest.raises(RuntimeError, match="Unable to resolve `host`"):
        network.get_ipaddr("host", 8080)
    with pytest.raises(RuntimeError, match="Unable to resolve"):
        network.get_sockaddr("host", 8080)
    with pytest.raises(ValueError, match="Unknown AddrType"):
        network.get_ipaddr("host", 8080, "IPv4")


def test_network_resolves_this_machine():
    assert network.get_sockaddr("127.0.0.1", 8080) == "127.0.0.1:8080"
    assert network.get_sockaddr(socket.getfqdn(), 8080).endswith(":8080")


def test_monarch_home_default_override_and_conda(monkeypatch, tmp_path):
    monkeypatch.delenv("MONARCH_HOME", raising=False)
    monkeypatch.setattr(Path, "home", lambda: tmp_path / "sally")
    assert MONARCH_HOME() == tmp_path / "sally" / ".monarch" and MONARCH_HOME().is_dir()
    monkeypatch.setenv("MONARCH_HOME", str(tmp_path / "other"))
    assert MONARCH_HOME("conda-pack", "out") == tmp_path / "other" / "conda-pack" / "out"
    assert (tmp_path / "other" / "conda-pack" / "out").is_dir()
    monkeypatch.setenv("CONDA_PREFIX", "/home/USER/.conda/envs/bar-py3")
    assert conda.active_env_dir() == "/home/USER/.conda/envs/bar-py3"
    assert conda.active_env_name() == "bar-py3"
    monkeypatch.delenv("CONDA_PREFIX")
    assert conda.active_env_dir() is None and conda.active_env_name() is None


def test_cli_parser_has_monarchs_commands_and_options():
    parser = cli.get_parser()
    assert parser.parse_args(["apply", "jobs.mast"]).module_path == "jobs.mast"
    assert parser.parse_args(["context", "use", "myjob"]).name == "myjob"
    args = parser.parse_args(["exec", "--per-host", "gpus=4", "nvidia-smi"])
    assert (args.per_host, args.run_all, args.cmd) == ("gpus=4", False, ["nvidia-smi"])
    with pytest.raises(SystemExit):
        parser.parse_args(["exec", "--all", "--mesh", "workers", "echo"])
    args = parser.parse_args(["dashboard", "mast", "sample-mast-job", "--dashboard-port", "9000"])
    assert (args.job, args.role_name, args.dashboard_port) == ("sample-mast-job", None, 9000)
    with pytest.raises(SystemExit) as e:
        cli.main(["--help"])
    assert e.value.code == 0


def test_cli_commands_call_the_tools_commands(monkeypatch):
    calls = []
    monkeypatch.setattr(cli, "shell_on_job", lambda **kw: calls.append(("shell", kw)) or 0)
    monkeypatch.setattr(cli, "exec_on_job", lambda cmd, **kw: calls.append(("exec", cmd, kw)) or 3)
    args = cli.get_parser().parse_args(["shell", "--mesh", "workers", "--point", "hosts=2", "-e", "FOO=bar",
                                        "--workdir", "/tmp/work"])
    args.func(args)
    assert calls[-1] == ("shell", dict(mesh_name="workers", point_str="hosts=2", env=["FOO=bar"],
                                       workdir="/tmp/work", kill=False))
    args = cli.get_parser().parse_args(["exec", "--point", "hosts=1", "--per-host", "gpus=2", "--", "ls", "-l"])
    with pytest.raises(SystemExit) as e:  # the command's status is the process's
        args.func(args)
    assert e.value.code == 3
    assert calls[-1][:2] == ("exec", ["ls", "-l"]) and calls[-1][2]["per_host"] == {"gpus": 2}
    assert calls[-1][2]["point_str"] == "hosts=1"


def test_cli_refuses_what_has_no_counterpart(capsys):
    args = cli.get_parser().parse_args(["dashboard", "mast", "job"])
    with pytest.raises(SystemExit) as e:
        args.func(args)
    assert e.value.code == 1 and "MAST" in capsys.readouterr().err
    args = cli.get_parser().parse_args(["debug", "--host", "h", "--port", "27000"])
    with pytest.raises(SystemExit, match="--pid"):
        args.func(args)


def test_cli_main_runs_the_context_commands(tmp_path):
    """``main`` in a process of its own (it shuts the runtime down at the end): a context made, chosen, listed."""
    script = textwrap.dedent("""
        from monarch_tensor.tools.cli import main
        main(["context", "create", "first"])
        main(["context", "use", "first"])
        main(["context", "ls"])
    """)
    out = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, capture_output=True, text=True, timeout=50,
                         env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert out.returncode == 0, out.stderr
    assert "Created context 'first'" in out.stdout and "* first" in out.stdout
