"""The distributed debugger, driven through pseudo-terminals (pexpect) like a person at a keyboard.

tests/debug_script.py pauses four ranks at breakpoints on two different lines (tests/debug_loop_script.py
one rank, again and again).
One test drives ``monarch-tensor debug`` from another terminal; one drives the
prompt that opens in the script's own terminal. Tests of single cases drive the
prompt (``Repl``) in this process with scripted lines. Plus unit tests of rank
selections and of the link's authentication.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import socket
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest

from monarch_tensor.actor import Actor, ActorError, SupervisionError, current_rank, endpoint, this_host
from monarch_tensor.debugger import Repl, controller, parse_ranks, table
from monarch_tensor.debugger import _cli as _debug_cli
from monarch_tensor.debugger import _server as _debug_server

pexpect = pytest.importorskip("pexpect", reason="pexpect is a dev extra: pip install -e '.[dev]'")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join("tests", "debug_script.py")
LOOP_SCRIPT = os.path.join("tests", "debug_loop_script.py")
ENV = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])))


def _until_all_listed(p, n: int = 4) -> str:
    """``list`` until the n ranks have registered (they pause at slightly different times)."""
    deadline = time.monotonic() + 60
    while True:
        p.sendline("list")
        p.expect_exact("monarch_dbg> ")
        if p.before.count("| debugee") == n or time.monotonic() > deadline:
            return p.before
        time.sleep(0.2)


class Keys:
    """A person at ``monarch_dbg>`` who types ``lines`` in turn; ``text`` is what the prompt wrote."""

    def __init__(self, lines: list[str]) -> None:
        self.lines, self.text = list(lines), ""

    def write(self, text: str) -> None:
        self.text += text

    def readline(self) -> str | None:
        return self.lines.pop(0) + "\n" if self.lines else None


def _until_paused(n: int) -> None:
    deadline = time.monotonic() + 60
    while len(controller().paused()) < n:
        assert time.monotonic() < deadline, f"{len(controller().paused())} of {n} ranks paused"
        time.sleep(0.05)


class AsyncDebugee(Actor):
    @endpoint
    async def over_await(self) -> int:
        x = 1
        breakpoint()
        await asyncio.sleep(0.01)
        y = x + 1
        return y


class Pauser(Actor):
    @endpoint
    def pause(self) -> int:
        breakpoint()
        return current_rank().rank


def _helper(x: int) -> int:
    breakpoint()
    return x + 1


class Stepper(Actor):
    @endpoint
    def step(self) -> int:
        y = _helper(1)
        z = y * 100
        return z


class Neighbour(Actor):
    @endpoint
    def ping(self) -> str:
        return "sync"

    @endpoint
    async def aping(self) -> str:
        return "async"


@pytest.fixture
def no_local_prompt(monkeypatch):
    """Breakpoints in this process's procs open no prompt in the terminal: the test drives its own."""
    monkeypatch.setenv("MONARCH_TENSOR_DEBUG_LOCAL", "0")


@pytest.mark.timeout(120)
def test_next_over_an_await_stops_at_the_next_line(no_local_prompt):
    """A coroutine pausing at ``await`` is reported to pdb as a return of its frame: that does not end the
    session; ``n`` stops at the line after the ``await``, as plain pdb does."""
    procs = this_host().spawn_procs(per_host={"gpus": 1})
    try:
        fut = procs.spawn("adebugee", AsyncDebugee).over_await.call_one()
        _until_paused(1)
        keys = Keys(["attach adebugee 0", "n", "p x + 10", "detach", "continue"])
        Repl(keys).run()
        assert "-> await asyncio.sleep(0.01)" in keys.text
        assert "-> y = x + 1\n(Pdb) 11\n" in keys.text, keys.text
        assert "continued" not in keys.text and "released 1 paused rank(s)" in keys.text, keys.text
        assert fut.get(timeout=60) == 2
    finally:
        procs.stop().get(timeout=30)


@pytest.mark.timeout(120)
def test_a_rank_that_dies_while_paused_leaves_the_debugger(no_local_prompt):
    """The proc of a paused rank dies: its session ends at once (the attached prompt says so), ``list`` no
    longer shows it and ``continue`` releases the others without waiting on it."""
    procs = this_host().spawn_procs(per_host={"gpus": 2})
    try:
        fut = procs.spawn("dying", Pauser).pause.call()
        _until_paused(2)
        keys = Keys(["attach dying 1", "!import os; os._exit(3)", "list", "continue"])
        Repl(keys).run()
        assert "rank 1 of 'dying' died (" in keys.text and "exited with code 3" in keys.text, keys.text
        rows = [ln for ln in keys.text.splitlines() if ln.startswith("| dying")]
        assert [r.split("|")[2].strip() for r in rows] == ["0"], keys.text
        assert "no answer from rank" not in keys.text and "did not acknowledge" not in keys.text, keys.text
        assert "released 1 paused rank(s)" in keys.text, keys.text
        with pytest.raises(SupervisionError, match="exited with code 3"):
            fut.get(timeout=60)
        assert controller().paused() == []
    finally:
        procs.stop().get(timeout=30)


@pytest.mark.timeout(120)
def test_next_out_of_a_helper_stops_in_its_caller(no_local_prompt):
    """``n`` out of a helper that called breakpoint() stops at the caller's next line, as plain pdb does; the
    session ends when the endpoint itself returns to the runtime."""
    procs = this_host().spawn_procs(per_host={"gpus": 1})
    try:
        fut = procs.spawn("stepper", Stepper).step.call_one()
        _until_paused(1)
        keys = Keys(["attach stepper 0", "n", "n", "p y", "n", "n", "n", "continue"])
        Repl(keys).run()
        assert "_helper()->2" in keys.text and "-> z = y * 100\n(Pdb) 2\n" in keys.text, keys.text
        assert "step()->200" in keys.text and "rank 0 of 'stepper' continued" in keys.text, keys.text
        assert fut.get(timeout=60) == 200
    finally:
        procs.stop().get(timeout=30)


@pytest.mark.timeout(120)
def test_pdb_quit_says_the_call_raises(no_local_prompt):
    """pdb's ``q`` quits the endpoint as it quits a program in plain pdb (``BdbQuit``): the prompt says so,
    not that the rank continued, and the call fails."""
    procs = this_host().spawn_procs(per_host={"gpus": 1})
    try:
        fut = procs.spawn("quitter", Pauser).pause.call_one()
        _until_paused(1)
        keys = Keys(["attach quitter 0", "q", "continue"])
        Repl(keys).run()
        assert "rank 0 of 'quitter' quit: its call raises BdbQuit" in keys.text, keys.text
        assert "continued" not in keys.text, keys.text
        with pytest.raises(ActorError, match="BdbQuit"):
            fut.get(timeout=60)
    finally:
        procs.stop().get(timeout=30)


@pytest.mark.timeout(120)
def test_each_attach_shows_where_the_rank_is_paused(no_local_prompt):
    """Attaching again (after a detach, or after a cast read the rank's output) shows where the rank stands,
    as the first attach does: its last location, after a step the new one."""
    procs = this_host().spawn_procs(per_host={"gpus": 2})
    try:
        fut = procs.spawn("again", Pauser).pause.call()
        _until_paused(2)
        keys = Keys(["attach again 0", "detach", "cast again ranks(1) p 1", "attach again 1", "detach",
                     "attach again 0", "n", "detach", "attach again 0", "detach", "continue"])
        Repl(keys).run()
        attaches = keys.text.split("Attached to debug session for rank ")[1:]
        assert len(attaches) == 4, keys.text
        for text in attaches[:3]:
            assert re.search(r"\n> .*test_debugger\.py\(\d+\)pause\(\)\n-> return current_rank\(\)\.rank\n"
                             r"\(Pdb\) ", text), keys.text
        assert re.search(r"\n> .*test_debugger\.py\(\d+\)pause\(\)->0\n-> return current_rank\(\)\.rank\n"
                         r"\(Pdb\) Detached", attaches[3]), keys.text
        assert fut.get(timeout=60).values() == [0, 1]
    finally:
        procs.stop().get(timeout=30)


@pytest.mark.timeout(120)
def test_debug_cli_keeps_characters_that_span_two_reads(no_local_prompt):
    """Large output of non-ASCII text reaches ``monarch-tensor debug`` in several reads, some of which end in
    the middle of a character: it comes out whole, not with U+FFFD where the reads were cut."""
    procs = this_host().spawn_procs(per_host={"gpus": 1})
    cli = None
    try:
        fut = procs.spawn("wide", Pauser).pause.call_one()
        _until_paused(1)
        cli = pexpect.spawn(sys.executable, ["-m", "monarch_tensor.cli", "debug", "--pid", str(os.getpid())],
                            cwd=ROOT, env=ENV, encoding="utf-8", timeout=60)
        cli.expect_exact("monarch_dbg> ")
        cli.sendline("attach wide 0")
        cli.expect_exact("(Pdb) ")
        cli.sendline("p 'é' * 100000")
        cli.expect_exact("(Pdb) ")
        assert "\ufffd" not in cli.before and "'" + "é" * 100000 + "'" in cli.before
        cli.sendline("c")
        cli.expect_exact("monarch_dbg> ")
        cli.sendline("quit")
        cli.expect(pexpect.EOF)
        assert fut.get(timeout=60) == 0
    finally:
        if cli is not None:
            cli.close(force=True)
        procs.stop().get(timeout=30)


@pytest.mark.timeout(120)
def test_other_actors_on_a_paused_proc(no_local_prompt):
    """While a rank is paused, another actor on its proc answers, sync and async endpoints alike: pdb's wait
    for its next command runs the proc's event loop meanwhile, untraced."""
    procs = this_host().spawn_procs(per_host={"gpus": 1})
    try:
        paused = procs.spawn("held", Pauser).pause.call_one()
        _until_paused(1)
        neighbour = procs.spawn("neighbour", Neighbour)
        assert neighbour.ping.call_one().get(timeout=30) == "sync"
        assert neighbour.aping.call_one().get(timeout=30) == "async"
        keys = Keys(["continue"])
        Repl(keys).run()
        assert "released 1 paused rank(s)" in keys.text, keys.text
        assert paused.get(timeout=30) == 0
    finally:
        procs.stop().get(timeout=30)


@pytest.mark.timeout(120)
def test_debug_cli_in_another_terminal():
    script = subprocess.Popen([sys.executable, SCRIPT], cwd=ROOT, env=ENV, stdin=subprocess.DEVNULL,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    cli = pexpect.spawn(sys.executable, ["-m", "monarch_tensor.cli", "debug", "--pid", str(script.pid)],
                        cwd=ROOT, env=ENV, encoding="utf-8", timeout=60)
    try:
        cli.expect_exact("monarch_dbg> ")
        listing = _until_all_listed(cli)
        rows = [ln for ln in listing.splitlines() if ln.startswith("| debugee")]
        assert [r.split("|")[2].strip() for r in rows] == ["0", "1", "2", "3"], listing
        assert [r.split("|")[6].strip() for r in rows] == ["13", "16", "13", "16"], listing  # different lines
        assert "{'gpus': 3}" in rows[3] and "to_debug" in rows[3]

        cli.sendline("attach debugee 1")
        cli.expect_exact("(Pdb) ")
        assert "debug_script.py(16)to_debug()" in cli.before
        cli.sendline("p value")
        cli.expect_exact("(Pdb) ")
        assert cli.before.splitlines()[-1].strip() == "10"
        cli.sendline("n")  # step: value += 2
        cli.expect_exact("(Pdb) ")
        assert "-> return value" in cli.before
        cli.sendline("p value")
        cli.expect_exact("(Pdb) ")
        assert cli.before.splitlines()[-1].strip() == "12"
        cli.sendline("l")
        cli.expect_exact("(Pdb) ")
        assert "17  ->\t        return value" in cli.before
        cli.sendline("s")  # step: the function returns
        cli.expect_exact("(Pdb) ")
        assert "--Return--" in cli.before and "to_debug()->12" in cli.before
        cli.sendline("detach")
        cli.expect_exact("monarch_dbg> ")

        cli.sendline("cast debugee ranks(0,2) p rank")
        cli.expect_exact("monarch_dbg> ")
        assert "[debugee rank 0] 0" in cli.before and "[debugee rank 2] 2" in cli.before
        cli.sendline("cast debugee ranks(gpus=2:4) p value")
        cli.expect_exact("monarch_dbg> ")
        assert "[debugee rank 2] 20" in cli.before and "[debugee rank 3] 30" in cli.before
        assert "rank 1]" not in cli.before
        cli.sendline("cast debugee ranks(0:2) p value")
        cli.expect_exact("monarch_dbg> ")
        assert "[debugee rank 0] 0" in cli.before and "[debugee rank 1] 12" in cli.before
        cli.sendline("attach debugee 9")
        cli.expect_exact("monarch_dbg> ")
        assert "no paused rank 9 of actor 'debugee'" in cli.before

        cli.sendline("quit")  # leaves the ranks paused for the next debugger
        cli.expect(pexpect.EOF)
        cli.close()
        cli = pexpect.spawn(sys.executable, ["-m", "monarch_tensor.cli", "debug", "--pid", str(script.pid)],
                            cwd=ROOT, env=ENV, encoding="utf-8", timeout=60)
        cli.expect_exact("monarch_dbg> ")
        listing = _until_all_listed(cli)
        assert [r.split("|")[2].strip() for r in listing.splitlines() if r.startswith("| debugee")] == \
            ["0", "1", "2", "3"], listing
        assert script.poll() is None

        cli.sendline("continue")
        cli.expect(pexpect.EOF)
        assert "released 4 paused rank(s)" in cli.before
        out, err = script.communicate(timeout=60)
        assert script.returncode == 0, err
        assert "RESULT [1, 12, 21, 32]" in out and "DONE" in out
        assert "run `monarch-tensor debug` in another terminal" in err
    finally:
        cli.close(force=True)
        if script.poll() is None:
            script.kill()


@pytest.mark.timeout(120)
def test_prompt_in_the_scripts_own_terminal():
    p = pexpect.spawn(sys.executable, [SCRIPT], cwd=ROOT, env=ENV, encoding="utf-8", timeout=60)
    try:
        p.expect_exact("monarch_dbg> ")
        _until_all_listed(p)
        p.sendline("attach debugee 0")
        p.expect_exact("(Pdb) ")
        assert "debug_script.py(13)to_debug()" in p.before
        p.sendline("p value * 7 + 3")
        p.expect_exact("(Pdb) ")
        assert p.before.splitlines()[-1].strip() == "3"  # (the line before it is the command's echo)
        p.sendline("c")  # this rank goes on; back to monarch_dbg>
        p.expect_exact("monarch_dbg> ")
        assert "rank 0 of 'debugee' continued" in p.before
        listing = _until_all_listed(p, 3)
        assert listing.count("| debugee") == 3
        p.sendline("help")
        p.expect_exact("monarch_dbg> ")
        assert "cast <actor> ranks(...) <cmd>" in p.before
        p.sendline("continue")
        p.expect_exact("DONE")
        assert "RESULT [1, 12, 21, 32]" in p.before
        p.expect(pexpect.EOF)
    finally:
        p.close(force=True)


@pytest.mark.timeout(120)
def test_the_prompt_in_the_scripts_terminal_reopens_for_each_pause():
    """A rank that pauses again right after ``continue`` (a breakpoint in a loop) gets the prompt again: it
    can pause before the prompt that released it has closed, which must then reopen, not leave it paused
    with nothing on the screen."""
    n = 25
    p = pexpect.spawn(sys.executable, [LOOP_SCRIPT, str(n)], cwd=ROOT, env=ENV, encoding="utf-8", timeout=30)
    try:
        for _ in range(n):
            p.expect_exact("monarch_dbg> ")
            p.sendline("continue")
        p.expect_exact("DONE")
        assert f"RESULT {sum(range(n))}" in p.before
        p.expect(pexpect.EOF)
    finally:
        p.close(force=True)


@pytest.mark.timeout(120)
def test_a_killed_scripts_debug_file_is_removed():
    """``debug-<pid>.json`` (the debug server's port and token) of a script SIGKILLed while ranks are paused
    is removed by its template process, as the rest of what it left in the socket directory."""
    script = subprocess.Popen([sys.executable, SCRIPT], cwd=ROOT, env=ENV, stdin=subprocess.DEVNULL,
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        line = ""
        while "run `monarch-tensor debug`" not in line:  # printed after the file is written
            line = script.stderr.readline()
            assert line, "the script ended before a rank paused"
        path = _debug_server.info_path(script.pid)
        assert os.path.exists(path)
        script.kill()
        script.wait(timeout=30)
        deadline = time.monotonic() + 30
        while os.path.exists(path) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not os.path.exists(path)
    finally:
        if script.poll() is None:
            script.kill()
        script.wait(timeout=30)
        script.stderr.close()


def test_rank_selections():
    sessions = [SimpleNamespace(rank=r, coords={"hosts": r // 4, "gpus": r % 4}) for r in range(8)]

    def pick(spec: str) -> list[int]:
        pred = parse_ranks(spec)
        return [s.rank for s in sessions if pred(s)]

    assert pick("3") == [3]
    assert pick("0,1,2") == [0, 1, 2]
    assert pick("0:4") == [0, 1, 2, 3]
    assert pick("1:8:3") == [1, 4, 7]
    assert pick(":2") == [0, 1]
    assert pick("*") == list(range(8))
    assert pick("gpus=0:2") == [0, 1, 4, 5]
    assert pick("hosts=1, gpus=(0,3)") == [4, 7]
    assert pick("0:8:") == list(range(8))
    assert pick("5:2") == []
    with pytest.raises(ValueError, match="cannot read ranks"):
        parse_ranks("a,b")
    # Only the paused ranks are known, not a dimension's size: no counting from the end, no backward steps
    for spec in ("-1", "-3:", "0,-1", "gpus=-2:", "hosts=(0,-1)"):
        with pytest.raises(ValueError, match="is negative: ranks and coordinates count from 0"):
            parse_ranks(spec)
    for spec in ("3:0:-1", "0:4:0", "gpus=0:4:0"):
        with pytest.raises(ValueError, match="step must be positive"):
            parse_ranks(spec)
    assert "| debugee    | 2    |" in table([SimpleNamespace(actor="debugee", rank=2, coords={}, hostname="h",
                                                              function="m.f", lineno=7)])


def test_debug_link_refuses_a_wrong_token(tmp_path):
    host, port = _debug_server.ensure_server()
    path = _debug_server.info_path()
    assert os.stat(path).st_mode & 0o777 == 0o600  # the token is readable by this user only
    info = json.load(open(path))
    with pytest.raises(PermissionError, match="refused"):
        _debug_cli.connect(dict(info, token="0" * 64))
    s = _debug_cli.connect(info)  # the right token gets the prompt
    s.settimeout(30)
    data = b""
    while b"monarch_dbg> " not in data:
        chunk = s.recv(4096)
        assert chunk, f"the debug server closed the link before its prompt: {data!r}"
        data += chunk
    s.sendall(b"quit\n")
    s.close()
    with socket.create_connection((host, port)) as raw:  # a client that never answers is dropped
        raw.settimeout(_debug_server.AUTH_TIMEOUT + 5)
        assert raw.recv(100).startswith(b"MTDBG1 ")
        assert raw.recv(100) in (b"", b"DENIED bad token\n")


@pytest.mark.timeout(60)
def test_debug_link_reads_bytes_that_are_not_utf8():
    """Bytes that are not UTF-8 (a Latin-1 terminal, a stray client) are a wrong token or an unknown command,
    not a traceback: in the script's server thread, or in ``monarch-tensor debug`` under the C locale."""
    host, port = _debug_server.ensure_server()
    with socket.create_connection((host, port)) as raw:
        raw.settimeout(30)
        assert raw.recv(100).startswith(b"MTDBG1 ")
        raw.sendall(b"\xff\xfe\n")
        assert raw.recv(100) == b"DENIED bad token\n"
    cli = subprocess.run([sys.executable, "-m", "monarch_tensor.cli", "debug", "--pid", str(os.getpid())],
                         cwd=ROOT, env={**ENV, "LC_ALL": "C", "LANG": "C"}, input=b"p\xe9t\xe9\nquit\n",
                         capture_output=True, timeout=50)
    assert b"unknown command 'p\xef\xbf\xbdt\xef\xbf\xbd'" in cli.stdout, cli
    assert cli.returncode == 0 and b"Traceback" not in cli.stderr, cli


@pytest.mark.timeout(60)
def test_ctrl_c_leaves_the_debug_cli_without_a_traceback(tmp_path, short_tmp_path):
    """Ctrl-C while ``monarch-tensor debug`` waits for a script (or at its prompt) exits with 130 and a line,
    not Python's KeyboardInterrupt traceback."""
    import signal

    cli = subprocess.Popen([sys.executable, "-m", "monarch_tensor.cli", "debug", "--wait", "30"], cwd=tmp_path,
                           env={**ENV, "TMPDIR": str(short_tmp_path)}, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 30
        line = ""
        while "waiting for a script" not in line and time.monotonic() < deadline:
            line = cli.stderr.readline()
        cli.send_signal(signal.SIGINT)
        _, err = cli.communicate(timeout=20)
    finally:
        if cli.poll() is None:
            cli.kill()
            cli.wait()
    assert cli.returncode == 130 and "interrupted" in err and "Traceback" not in err, err
