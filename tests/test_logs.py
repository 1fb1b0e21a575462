"""Procs' stdout/stderr reach the client with a rank prefix; logging_option folds and mutes them.

The lines are written by the client process, so each test runs a small script
as a subprocess and reads what it wrote. Inside the script, ``sys.stdout`` and
``sys.stderr`` are wrapped to record what the client printed, so the script can
wait for the forwarded lines (with a deadline) instead of sleeping and hoping.
"""

import os
import re
import subprocess
import sys
import textwrap
import threading

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

PRELUDE = textwrap.dedent('''
    import logging, os, sys, threading, time
    import monarch_tensor.actor
    from monarch_tensor.actor import Actor, current_rank, endpoint, this_host


    class Tee:
        """Pass writes through, and keep them so the script can wait for lines."""

        def __init__(self, stream):
            self.stream, self.text, self.lock = stream, "", threading.Lock()

        def write(self, s):
            with self.lock:
                self.text += s
            return self.stream.write(s)

        def __getattr__(self, name):
            return getattr(self.stream, name)


    sys.stdout, sys.stderr = Tee(sys.stdout), Tee(sys.stderr)


    def wait_for(stream, needle, timeout=15.0):
        deadline = time.monotonic() + timeout
        while needle not in stream.text:
            if time.monotonic() > deadline:
                raise SystemExit(f"timed out waiting for {needle!r} on the client's {stream.stream.name}")
            time.sleep(0.01)


    class Talker(Actor):
        @endpoint
        def talk(self, tag: str) -> None:
            r = current_rank().rank
            print(f"{tag} print rank {r}")
            print(f"{tag} print-stderr rank {r}", file=sys.stderr)
            os.write(1, f"{tag} fd1 rank {r}\\n".encode())
            os.write(2, f"{tag} fd2 rank {r}\\n".encode())

        @endpoint
        def say(self, text: str) -> None:
            print(text)

        @endpoint
        def partial(self, text: str) -> None:
            os.write(1, text.encode())  # no newline: forwarded when the proc stops
''')


def run_script(tmp_path, body: str, timeout: float = 90, args=()) -> subprocess.CompletedProcess:
    path = tmp_path / "script.py"
    path.write_text(PRELUDE + textwrap.dedent(body))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])))
    proc = subprocess.run([sys.executable, str(path), *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)
    assert proc.returncode == 0, f"script failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
    return proc


def lines(text: str) -> list[str]:
    return text.splitlines()


@pytest.mark.timeout(120)
def test_print_and_raw_fd_writes_reach_the_client_with_a_rank_prefix(tmp_path):
    out = run_script(tmp_path, '''
        procs = this_host().spawn_procs(per_host={"gpus": 2})
        try:
            talkers = procs.spawn("talker", Talker)
            talkers.talk.call("hello").get(timeout=30)
            for r in (0, 1):
                wait_for(sys.stdout, f"[{r}] hello print rank {r}\\n")
                wait_for(sys.stdout, f"[{r}] hello fd1 rank {r}\\n")
                wait_for(sys.stderr, f"[{r}] hello print-stderr rank {r}\\n")
                wait_for(sys.stderr, f"[{r}] hello fd2 rank {r}\\n")
            talkers.slice(gpus=1).partial.call_one("a last line without a newline").get(timeout=30)
        finally:
            procs.stop().get(timeout=30)
        wait_for(sys.stdout, "[1] a last line without a newline\\n")
        print("SCRIPT DONE")
    ''')
    stdout, stderr = lines(out.stdout), lines(out.stderr)
    for r in (0, 1):
        assert f"[{r}] hello print rank {r}" in stdout
        assert f"[{r}] hello fd1 rank {r}" in stdout
        assert f"[{r}] hello print-stderr rank {r}" in stderr
        assert f"[{r}] hello fd2 rank {r}" in stderr
        # each line on its own stream only
        assert f"[{r}] hello fd2 rank {r}" not in stdout
        assert f"[{r}] hello fd1 rank {r}" not in stderr
    assert stdout.count("[0] hello print rank 0") == 1  # forwarded once, not duplicated
    assert "[1] a last line without a newline" in stdout
    assert "SCRIPT DONE" in stdout


@pytest.mark.timeout(120)
def test_the_last_lines_of_a_proc_that_dies_reach_the_client(tmp_path):
    """What a proc writes right before it dies (os._exit here; a crash's traceback alike) reaches the client:
    the template relays the proc's pipes, so nothing the proc read and had not sent dies with it (5 of 8 such
    lines arrived before). And a proc whose own child died, and whose default fault hook explains that and
    exits, gets its explanation to the client too."""
    out = run_script(tmp_path, '''
        class Dier(Actor):
            @endpoint
            def die(self, i):
                print(f"last words {i}", flush=True)
                print(f"last error {i}", file=sys.stderr, flush=True)
                os._exit(3)

            @endpoint
            def spawn_and_lose_a_child(self):
                self.procs = this_host().spawn_procs(per_host={"gpus": 1})
                self.procs.spawn("child", Dier).die.broadcast(99)

        monarch_tensor.actor.unhandled_fault_hook = lambda failure: print("hook:", failure)
        for i in range(4):
            procs = this_host().spawn_procs(per_host={"gpus": 1})
            try:
                procs.spawn("dier", Dier).die.call_one(i).get(timeout=30)
            except Exception:
                pass
            wait_for(sys.stdout, f"[0] last words {i}\\n")
            wait_for(sys.stderr, f"[0] last error {i}\\n")
            procs.stop()
        procs = this_host().spawn_procs(per_host={"gpus": 1})
        procs.spawn("parent", Dier).spawn_and_lose_a_child.call_one().get(timeout=60)
        wait_for(sys.stderr, "unhandled supervision failure, exiting")
        wait_for(sys.stdout, "[0] last words 99\\n")  # (the parent's two streams reach the client in no set order)
        procs.stop()
        print("SCRIPT DONE")
    ''')
    assert "SCRIPT DONE" in out.stdout
    assert "[0] last words 99" in lines(out.stdout)  # the grandchild's, through its parent, prefixed once
    assert re.search(r"^\[0\] monarch_tensor: unhandled supervision failure, exiting: .*exited with code 3",
                     out.stderr, re.M), out.stderr


@pytest.mark.timeout(120)
def test_aggregation_folds_identical_lines_from_four_ranks(tmp_path):
    # The window is a fixed period of the client's flusher, so the 4 copies of a
    # line can (rarely) straddle two flushes; try a few distinct lines and
    # require that one of them came out as a single folded line.
    out = run_script(tmp_path, '''
        import re
        procs = this_host().spawn_procs(per_host={"gpus": 4})
        try:
            talkers = procs.spawn("talker", Talker)
            procs.logging_option(stream_to_client=True, aggregate_window_sec=1).get(timeout=30)

            def copies(text):
                n = 0
                for line in sys.stdout.text.splitlines():
                    m = re.fullmatch(r"\\[(\\d+) similar lines\\] \\[rank [\\d,-]+\\] " + re.escape(text), line)
                    n += int(m.group(1)) if m else bool(re.fullmatch(r"\\[\\d\\] " + re.escape(text), line))
                return n

            for attempt in range(3):
                text = f"the same line, attempt {attempt}"
                talkers.say.call(text).get(timeout=30)
                deadline = time.monotonic() + 15
                while copies(text) < 4 and time.monotonic() < deadline:
                    time.sleep(0.02)
                assert copies(text) == 4, (text, sys.stdout.text)
                if f"[4 similar lines] [rank 0-3] {text}" in sys.stdout.text:
                    print(f"FOLDED attempt {attempt}")
                    break
            talkers.talk.call("distinct").get(timeout=30)
            for r in range(4):
                wait_for(sys.stdout, f"[{r}] distinct print rank {r}\\n")
            # a long window: what it holds when the procs stop is printed then, not lost
            procs.logging_option(stream_to_client=True, aggregate_window_sec=60).get(timeout=30)
            talkers.say.call("held when they stop").get(timeout=30)
        finally:
            procs.stop().get(timeout=30)
    ''')
    stdout = lines(out.stdout)
    assert "[4 similar lines] [rank 0-3] held when they stop" in stdout, out.stdout
    folded = [ln for ln in stdout if ln.startswith("FOLDED attempt ")]
    assert folded, out.stdout
    attempt = folded[0].split()[-1]
    text = f"the same line, attempt {attempt}"
    assert stdout.count(f"[4 similar lines] [rank 0-3] {text}") == 1
    assert not [ln for ln in stdout if re.fullmatch(r"\[\d\] " + re.escape(text), ln)]  # no unfolded copy
    for r in range(4):  # lines that differ stay apart
        assert f"[{r}] distinct print rank {r}" in stdout


@pytest.mark.timeout(120)
def test_stream_to_client_false_stops_forwarding_and_true_resumes_it(tmp_path):
    out = run_script(tmp_path, '''
        procs = this_host().spawn_procs(per_host={"gpus": 2})
        try:
            talkers = procs.spawn("talker", Talker)
            procs.logging_option(stream_to_client=False).get(timeout=30)
            talkers.talk.call("muted").get(timeout=30)
            # Monarch's level: the procs' root logger level
            procs.logging_option(stream_to_client=False, level=logging.WARNING).get(timeout=30)
            assert procs.execute(lambda: logging.getLogger().level).values() == [logging.WARNING] * 2
            procs.logging_option(stream_to_client=False, level=logging.DEBUG).get(timeout=30)
            assert procs.execute(lambda: logging.getLogger().level).values() == [logging.DEBUG] * 2
            # At once: the switch goes through the pipes behind the muted lines.
            procs.logging_option(stream_to_client=True).get(timeout=30)
            talkers.talk.call("unmuted").get(timeout=30)
            for r in (0, 1):
                # Lines of one proc's stream are forwarded in order: once these are
                # in, the muted lines (written earlier) would be in too.
                wait_for(sys.stdout, f"[{r}] unmuted fd1 rank {r}\\n")
                wait_for(sys.stderr, f"[{r}] unmuted fd2 rank {r}\\n")
        finally:
            procs.stop().get(timeout=30)
        print("SCRIPT DONE")
    ''')
    assert "SCRIPT DONE" in out.stdout
    # Not forwarded: muted lines go to the procs' own stdout/stderr (here the
    # terminal the client was started from), without a rank prefix.
    assert not re.search(r"^\[\d\] muted", out.stdout, re.M), out.stdout
    assert not re.search(r"^\[\d\] muted", out.stderr, re.M), out.stderr
    assert "muted print rank 0" in lines(out.stdout) and "muted fd2 rank 1" in lines(out.stderr)
    for r in (0, 1):
        assert f"[{r}] unmuted print rank {r}" in lines(out.stdout)
        assert f"[{r}] unmuted print-stderr rank {r}" in lines(out.stderr)


ORDER_CHECK = textwrap.dedent('''
    class Hello(Actor):
        @endpoint
        def hello(self, i):
            r = current_rank().rank
            print(f"hello {i} from {r}")
            os.write(2, f"raw {i} from {r}\\n".encode())  # as C code writes: not through sys.stderr
            return r

    def late_lines(procs, calls=50):
        """Calls whose result came before a line its endpoint printed (on any rank, either stream)."""
        hello = procs.spawn("hello", Hello)
        ranks = hello.hello.call(-1).get(timeout=30).values()
        late = []
        for i in range(calls):
            hello.hello.call(i).get(timeout=30)
            for r in ranks:
                if f"[{r}] hello {i} from {r}\\n" not in sys.stdout.text or \\
                        f"[{r}] raw {i} from {r}\\n" not in sys.stderr.text:
                    late.append(i)
        return late
''')


@pytest.mark.timeout(120)
def test_what_an_endpoint_printed_comes_before_its_result(tmp_path):
    """What an endpoint prints travels apart from its reply (the proc's pipe, the template, the client's
    reader thread; the reply over the mailbox): the reply says how much its proc had written, and the client
    prints that much first. Before, about a third of the calls had a line printed after their result."""
    out = run_script(tmp_path, ORDER_CHECK + textwrap.dedent('''
        procs = this_host().spawn_procs(per_host={"gpus": 2})
        try:
            print("LATE", late_lines(procs))
        finally:
            procs.stop().get(timeout=30)
    '''))
    assert "LATE []" in lines(out.stdout), out.stdout


@pytest.mark.timeout(120)
def test_what_pipelined_calls_printed_comes_before_each_result(tmp_path):
    """Replies that leave in one batch are checked for their proc's output once for the whole batch
    (Mailbox.output_mark): still, each call's lines are printed before its result is delivered."""
    out = run_script(tmp_path, ORDER_CHECK + textwrap.dedent('''
        from monarch_tensor.runtime._proc import current_runtime

        class Counted(Hello):
            @endpoint
            def quiet(self, i):
                return i

            @endpoint
            def sent(self):
                return current_runtime().mailbox.batches_sent

        procs = this_host().spawn_procs(per_host={"gpus": 1})
        try:
            hello = procs.spawn("hello", Counted).slice(gpus=0)
            hello.hello.call_one(-1).get(timeout=30)
            late, before = [], hello.sent.call_one().get(timeout=30)
            for rnd in range(4):
                futs = [hello.hello.call_one(rnd * 1000 + i) for i in range(200)]
                for i, f in enumerate(futs):
                    f.get(timeout=30)
                    if f"[0] hello {rnd * 1000 + i} from 0\\n" not in sys.stdout.text or \\
                            f"[0] raw {rnd * 1000 + i} from 0\\n" not in sys.stderr.text:
                        late.append(rnd * 1000 + i)
            futs = [hello.quiet.call_one(i) for i in range(200)]
            assert [f.get(timeout=30) for f in futs] == list(range(200))
            print("LATE", late)
            print("BATCHED", hello.sent.call_one().get(timeout=30) > before)
        finally:
            procs.stop().get(timeout=30)
    '''))
    assert "LATE []" in lines(out.stdout), out.stdout
    assert "BATCHED True" in lines(out.stdout), out.stdout


@pytest.mark.timeout(180)
def test_what_a_host_agents_proc_printed_comes_before_its_result(tmp_path):
    """A job's procs stream nothing to the script by default (Monarch's job host meshes: stream_logs=False);
    logging_option(stream_to_client=True), or log forwarding configured on explicitly, turns it on. A host
    agent's procs send their lines themselves (a pump thread per stream), on the mailbox the reply takes next:
    the reply waits until the pumps sent what the pipes held."""
    out = run_script(tmp_path, ORDER_CHECK + textwrap.dedent('''
        import asyncio

        from monarch_tensor.config import configure
        from monarch_tensor.job import LocalJob

        job = LocalJob(meshes={"m": 1}, root_dir=sys.argv[1], ttl=60)
        try:
            hosts = job.state(cached_path=None).m
            print("STREAMS", hosts.stream_logs)
            procs = hosts.spawn_procs(per_host={"gpus": 2})
            procs.spawn("talker", Talker).say.call("job default muted").get(timeout=30)
            asyncio.run(procs.logging_option(stream_to_client=True))
            print("LATE", late_lines(procs))
            procs.stop().get(timeout=30)
            configure(enable_log_forwarding=True)
            print("STREAMS", hosts.stream_logs)
            procs = hosts.spawn_procs(per_host={"gpus": 1})
            procs.spawn("talker", Talker).say.call("configured on").get(timeout=30)
            wait_for(sys.stdout, "[0] configured on")
            procs.stop().get(timeout=30)
        finally:
            job.kill()
    '''), args=[str(tmp_path / "job")], timeout=150)
    assert lines(out.stdout)[:1] == ["STREAMS False"] and "STREAMS True" in lines(out.stdout), out.stdout
    assert "job default muted" not in out.stdout  # (it went to the agent's output)
    assert "LATE []" in lines(out.stdout), out.stdout


@pytest.mark.timeout(120)
def test_a_stuck_relay_holds_a_reply_only_a_while(tmp_path):
    """A reply waits for its proc's output a bounded time (logs.OUTPUT_WAIT_S): with the template stopped, its
    procs' lines cannot come, and the calls still return; the lines follow once it runs again."""
    out = run_script(tmp_path, '''
        import signal
        from monarch_tensor.hosts import host

        procs = this_host().spawn_procs(per_host={"gpus": 1})
        try:
            talkers = procs.spawn("talker", Talker)
            talkers.say.call("before").get(timeout=30)
            template = host.local_host().proc.pid
            os.kill(template, signal.SIGSTOP)
            try:
                for i in range(3):
                    talkers.say.call(f"stuck {i}").get(timeout=30)
                print("RETURNED")
            finally:
                os.kill(template, signal.SIGCONT)
            wait_for(sys.stdout, "[0] stuck 2\\n")
        finally:
            procs.stop().get(timeout=30)
    ''')
    stdout = lines(out.stdout)
    assert stdout.index("RETURNED") < stdout.index("[0] stuck 0"), out.stdout


@pytest.mark.timeout(30)
def test_a_switch_applies_in_order_with_the_lines_around_it():
    """A proc's forwarder switches a stream when its pump reads the switch's marker in the pipe: lines
    written before the switch are handled as before it, however late the pump reads them (here all at
    once, after every write), and a partial line that the marker comes behind ends there."""
    from monarch_tensor.runtime._proc import _LogForwarder

    sent: list = []
    fw = _LogForwarder.__new__(_LogForwarder)  # no fds taken over: the pump reads a pipe of the test's own
    fw.mailbox = type("M", (), {"send": staticmethod(lambda addr, msg: sent.extend(msg.lines))})()
    fw.client_addr, fw.rank, fw.enabled, fw.flushed = "client", 0, {1: True, 2: True}, False
    fw.pumped, fw.pumping = {1: 0, 2: 0}, threading.Condition()
    term_r, term_w = os.pipe()  # stands for the proc's own terminal
    fw.originals = {1: term_w}
    from monarch_tensor.transport.logs import StreamLines

    off, on = StreamLines.MARK_OF[False], StreamLines.MARK_OF[True]
    r, w = os.pipe()
    os.write(w, b"before\npartial" + off + b"muted\n" + on + b"after\n")
    os.close(w)
    fw._pump(r, 1)
    os.close(r)
    os.close(term_w)
    with os.fdopen(term_r, "rb") as f:
        terminal = f.read()
    assert sent == ["before", "partial", "after"]
    assert terminal == b"muted\n"
    assert fw.enabled == {1: True, 2: True}


def _fold(monkeypatch, capsys, batches, flush_at=None, older_than=None) -> list[str]:
    """What the client prints for ``batches`` of a proc's stdout lines ``(rank, [lines], seen at)``, folded by
    a 60 s aggregation window, when flushed (at ``flush_at``, with ``older_than``; the rest is dropped)."""
    from monarch_tensor.transport import logs
    from monarch_tensor.transport.messages import ForwardLogs

    clock = [0.0]
    monkeypatch.setattr(logs, "time", type("Clock", (), {"monotonic": staticmethod(lambda: clock[0])}))
    monkeypatch.setattr(logs, "_window", 60.0)  # (no flusher thread: the test flushes)
    monkeypatch.setattr(logs, "_explicit", True)
    for rank, batch, seen in batches:
        clock[0] = seen
        logs.client_log_sink(ForwardLogs(rank=rank, stream=1, lines=tuple(batch)))
    if flush_at is not None:
        clock[0] = flush_at
    logs.flush(older_than)
    printed = capsys.readouterr().out.splitlines()
    monkeypatch.setattr(logs, "_window", None)
    logs.flush()
    capsys.readouterr()
    return printed


def _each_ranks_lines(printed: list[str]) -> dict[int, list[str]]:
    """The lines of each rank, in the order they were printed, from folded and single lines."""
    got: dict[int, list[str]] = {}
    for line in printed:
        m = re.fullmatch(r"\[\d+ similar lines\] \[rank ([\d,-]+)\] (.*)|\[(\d+)\] (.*)", line)
        assert m, line
        if m[3] is not None:
            ranks, text = [int(m[3])], m[4]
        else:
            ranks = [r for part in m[1].split(",")
                     for r in (range(int(part.split("-")[0]), int(part.split("-")[-1]) + 1))]
            text = m[2]
        for r in ranks:
            got.setdefault(r, []).append(text)
    return got


@pytest.mark.timeout(30)
def test_aggregation_keeps_each_ranks_lines_in_order(monkeypatch, capsys):
    """Folding identical lines never shows a rank's line before one it printed earlier: a line of the rank's
    own between two folded ones prints between them."""
    printed = _fold(monkeypatch, capsys, [
        (r, ["step 1 start", f"rank-specific value {r * 17}", "step 1 end"], 0.0) for r in range(3)])
    assert printed[0] == "[3 similar lines] [rank 0-2] step 1 start"
    assert sorted(printed[1:4]) == ["[0] rank-specific value 0", "[1] rank-specific value 17",
                                    "[2] rank-specific value 34"]
    assert printed[4:] == ["[3 similar lines] [rank 0-2] step 1 end"]

    # lines arriving one at a time, from ranks that print shared lines in different orders (rank 0 "a" twice)
    sequences = {0: ["a", "b", "c", "a"], 1: ["b", "a", "c"], 2: ["x", "a", "y", "b", "c"], 3: ["c", "a", "b"]}
    batches = [(r, [seq[i]], 0.0) for i in range(5) for r, seq in sequences.items() if i < len(seq)]
    printed = _fold(monkeypatch, capsys, batches)
    assert _each_ranks_lines(printed) == sequences
    assert len(printed) < sum(map(len, sequences.values()))  # still folded where the order allows


@pytest.mark.timeout(30)
def test_a_window_that_ends_prints_the_lines_before_its_old_ones_too(monkeypatch, capsys):
    """A group whose window ended prints with the lines its ranks printed before it, however new those are."""
    printed = _fold(monkeypatch, capsys, [(0, ["start", "end"], 0.0), (1, ["start", "own 1", "end", "more"], 2.0)],
                    flush_at=3.0, older_than=3.0)
    assert printed == ["[2 similar lines] [rank 0-1] start", "[1] own 1", "[2 similar lines] [rank 0-1] end"]


@pytest.mark.timeout(120)
def test_logging_option_is_a_coroutine_as_in_monarch(tmp_path):
    # Monarch's logging_option is `async def`: scripts hand it to asyncio.run or create_task.
    out = run_script(tmp_path, '''
        import asyncio
        procs = this_host().spawn_procs(per_host={"procs": 2})
        try:
            assert asyncio.run(procs.logging_option(stream_to_client=True, level=logging.WARNING)) is None
            assert procs.execute(lambda: logging.getLogger().level).values() == [logging.WARNING] * 2

            async def main():
                await asyncio.create_task(procs.logging_option(level=logging.DEBUG))
                await procs.logging_option(level=logging.ERROR)  # plain await still works
                return procs.execute(lambda: logging.getLogger().level).values()

            assert asyncio.run(main()) == [logging.ERROR] * 2
        finally:
            procs.stop().get(timeout=30)
        print("SCRIPT DONE")
    ''')
    assert "SCRIPT DONE" in out.stdout


@pytest.mark.timeout(120)
def test_a_terminal_sees_a_line_every_rank_printed_once(tmp_path):
    """By default, output to a terminal (or a notebook) folds the same line from several ranks (a warning each
    rank prints) into one, with the ranks; lines of one rank stay as they are. ``fold_repeated_lines=False``
    prints every line; output to a pipe is never folded (the other tests here read per-rank lines)."""
    pexpect = pytest.importorskip("pexpect", reason="pexpect is a dev extra: pip install -e '.[dev]'")
    script = tmp_path / "fold.py"
    script.write_text(PRELUDE + textwrap.dedent('''
        import sys
        from monarch_tensor import configure
        if sys.argv[1] == "off":
            configure(fold_repeated_lines=False)

        class Warner(Actor):
            @endpoint
            def warn(self):
                print("UserWarning: this op is slow", flush=True)
                print(f"rank {current_rank().rank} own line", flush=True)

        procs = this_host().spawn_procs(per_host={"gpus": 4})
        procs.spawn("w", Warner).warn.call().get(timeout=60)
        time.sleep(1.0)
        procs.stop().get(timeout=30)
        print("done")
    '''))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])))

    def run(mode: str) -> list[str]:
        child = pexpect.spawn(sys.executable, [str(script), mode], cwd=ROOT, env=env, encoding="utf-8", timeout=90)
        child.expect(pexpect.EOF)
        out = [line.strip() for line in child.before.splitlines()]
        child.close()
        assert child.exitstatus == 0, "\n".join(out)
        assert sorted(x for x in out if "own line" in x) == [f"[{r}] rank {r} own line" for r in range(4)]
        return out

    def warned(out: list[str]) -> list[list[int]]:
        """The ranks of each printed warning line: "[2] ..." one, "[3 similar lines] [rank 0-1,3] ..." three."""
        groups = []
        for x in out:
            if x.endswith("UserWarning: this op is slow"):
                if m := re.match(r"\[(\d+)\] UserWarning", x):
                    groups.append([int(m[1])])
                else:
                    m = re.match(r"\[(\d+) similar lines\] \[rank ([\d,-]+)\] UserWarning", x)
                    assert m, x
                    ranks = [r for part in m[2].split(",")
                             for r in (range(int(part.split("-")[0]), int(part.split("-")[-1]) + 1))]
                    assert len(ranks) == int(m[1]), x
                    groups.append(ranks)
        return groups

    # The fold takes the lines that reach this process within its window (or before the wait returns): on a
    # loaded machine one rank's line may come later and print on its own. Every rank's warning prints exactly
    # once either way; all four fold into one line in one of a few tries.
    for _ in range(3):
        out = run("on")
        groups = warned(out)
        assert sorted(r for g in groups for r in g) == [0, 1, 2, 3], out
        if len(groups) == 1:
            break
    assert "[4 similar lines] [rank 0-3] UserWarning: this op is slow" in out, out
    out = run("off")
    assert sorted(x for x in out if "UserWarning" in x) == [f"[{r}] UserWarning: this op is slow" for r in range(4)]


@pytest.mark.timeout(30)
def test_a_wait_that_returns_prints_what_the_default_folding_holds_first(monkeypatch, capsys):
    """In a terminal or a notebook the default folding holds lines DEFAULT_WINDOW_S to fold the same line from
    several ranks; the wait for the call's result prints them first, so they land in the cell that waited
    (printed later by the folding's thread, a notebook showed them under another cell, or not at all). A window
    the script chose (logging_option) is kept as it is."""
    from monarch_tensor import future
    from monarch_tensor.future import Future
    from monarch_tensor.transport import logs
    from monarch_tensor.transport.messages import ForwardLogs

    monkeypatch.setattr(logs, "_interactive", lambda: True)
    monkeypatch.setattr(logs, "_explicit", False)
    monkeypatch.setattr(logs, "_flusher", object())  # (no thread: only the wait prints)
    for rank in (0, 1):
        logs.client_log_sink(ForwardLogs(rank=rank, stream=1, lines=("a warning every rank prints",
                                                                        f"rank {rank} says hello")))
    assert capsys.readouterr().out == ""  # held, to fold
    assert Future.ready(7).get() == 7
    printed = capsys.readouterr().out.splitlines()
    assert printed[0] == "[2 similar lines] [rank 0-1] a warning every rank prints"
    assert sorted(printed[1:]) == ["[0] rank 0 says hello", "[1] rank 1 says hello"]
    assert future._held_output is None  # nothing held: a wait costs one check

    monkeypatch.setattr(logs, "_explicit", True)
    monkeypatch.setattr(logs, "_window", 60.0)
    logs.client_log_sink(ForwardLogs(rank=0, stream=1, lines=("kept for the chosen window",)))
    assert Future.ready(8).get() == 8
    assert capsys.readouterr().out == ""
    logs.flush()
    assert capsys.readouterr().out.splitlines() == ["[0] kept for the chosen window"]
