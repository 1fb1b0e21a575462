"""This machine's template process (``runtime/_zygote.py``), as the client and host agents drive it: it
already imported torch and forks procs on request; its exit reports are how the runtime learns, within
milliseconds, that a proc died. Also the output of the client's procs, which the template relays."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
from dataclasses import dataclass, field
from typing import Any, Callable

from .. import config
from ..config import setting
from ..future import Future
from ..runtime import _zygote
from ..transport import logs

log = logging.getLogger("monarch_tensor.hosts.host")

# Who hears of the exit of one of the client's own procs (a ``LocalHost`` made with no ``on_exit``): the
# client's supervision, which hosts/host.py registers here when it is imported.
client_proc_exited: Callable[[ProcInfo, str], None] | None = None


# PyTorch's switch for transparent huge pages: with it, CPU tensors of 2 MiB and more are allocated with
# madvise(MADV_HUGEPAGE) (NumPy does the same for its large arrays by default). Procs get it unless the script's
# environment sets it: their large tensors are what the data plane moves, and the kernel pins a cma
# transfer's memory page by page, so 2 MiB pages made reads of a proc's tensor 1.3-2x faster from
# 1 MiB up (bench/rdma_bench.py, README). It goes in the template's environment: c10 reads it when torch loads.
THP_ENV = "THP_MEM_ALLOC_ENABLE"


_actors_spawned_here: dict[str, set] = {}  # a proc's address -> names of the actors this process spawned there


@dataclass
class ProcInfo:
    """One proc of an allocation, as the client sees it."""

    addr: str
    rank: int
    pid: int = 0
    alive: bool = True
    stopping: bool = False
    starting: bool = False  # forked here, not yet said it started: its death is no supervision failure (_proc_exited)
    exit_status: str = ""
    owner: Any = None  # the ProcMesh allocation that made it
    actors: set = field(default_factory=set)  # names of the actors spawned on it from here (not pickled)

    def __post_init__(self) -> None:
        # "From here" is this process: every handle of the proc here (each unpickled ProcMesh makes its own)
        # shares one set, so that two actors of this process spawning a mesh of the same name there get two.
        self.actors = _actors_spawned_here.setdefault(self.addr, self.actors)

    def __getstate__(self):
        return {"addr": self.addr, "rank": self.rank, "pid": self.pid, "alive": self.alive}

    def __setstate__(self, state):
        self.__init__(**state)


def forget_earlier_proc(info: ProcInfo) -> None:
    """``info`` is a proc just spawned: what this process recorded under its address was an earlier proc's,
    whose host agent had the same port (the system hands ports out again): its death, and the names of the
    actors spawned there."""
    from ..transport.mailbox import local_mailboxes

    for mailbox in local_mailboxes():
        mailbox.proc_born(info.addr)
    info.actors = _actors_spawned_here[info.addr] = set()


def _gpu_count() -> int:
    """GPUs on this host, without initialising CUDA in this process."""
    try:
        return len([d for d in os.listdir("/proc/driver/nvidia/gpus")])
    except OSError:
        return 0


def python_path() -> str:
    """``PYTHONPATH`` for processes we start, maybe with another interpreter: this one's ``sys.path``, after
    the directory this ``monarch_tensor`` is in (an editable install imports it through a finder hook, not a
    ``sys.path`` entry, and another interpreter would not find it)."""
    here = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    return os.pathsep.join(dict.fromkeys([here, *(p for p in sys.path if p)]))


class LocalHost:
    """The zygote of this machine, spawning procs for this client process."""

    def __init__(self, on_exit=None, python_exe: str | None = None, on_output=None) -> None:
        # on_exit(info, status): who hears of a proc's exit (a host agent); the client's supervision otherwise.
        # python_exe: the interpreter the template (and so every proc it forks) runs; this one's by default.
        self._on_exit = on_exit or client_proc_exited
        if self._on_exit is None:
            raise RuntimeError("LocalHost() with no on_exit reports to the client's supervision, which registers "
                               "itself when monarch_tensor.hosts.host is imported: import it first")
        # The client's procs have their output relayed by the template (what they write reaches the script
        # even when they die right after); a host agent's procs forward their own (see _proc._LogForwarder),
        # and on_output(info, stream, data) gets what one left unread when it exited.
        self._relay = on_exit is None
        self._on_output = on_output or _print_output
        self._infos: dict[int, ProcInfo] = {}  # request id -> the proc it spawns
        env = dict(os.environ)
        env["PYTHONPATH"] = python_path()
        env.setdefault(THP_ENV, "1")
        # A script that has not imported torch (actors only, so far) gets its procs forked at once, and a
        # proc that needs torch imports it (as Monarch's do); the template imports it before forking
        # again once the script has imported it too (spawn() asks). Nothing imports in the background:
        # on a small machine that competed with the script's first seconds of work.
        self._bare = on_exit is None and "torch" not in sys.modules and "MONARCH_TENSOR_PRELOAD" not in env
        if self._bare:
            env["MONARCH_TENSOR_PRELOAD"] = env["MONARCH_TENSOR_IDLE_PRELOAD"] = ""
        self._python_exe = python_exe  # (None: this interpreter)
        req_r, self._req_fd = os.pipe()
        self._rep_fd, rep_w = os.pipe()
        self.proc = subprocess.Popen(
            [python_exe or sys.executable, "-c", "import sys; from monarch_tensor.runtime._zygote import main; "
             "main(int(sys.argv[1]), int(sys.argv[2]))", str(req_r), str(rep_w)],
            # In a session of its own: Ctrl-C at a terminal (and Jupyter's "interrupt kernel", os.killpg) signals
            # the whole foreground process group, which killed the template and every proc while the script
            # caught its KeyboardInterrupt to carry on. (The client's exit still ends them: see _zygote.main.)
            pass_fds=(req_r, rep_w), env=env, close_fds=True, start_new_session=True)
        os.close(req_r)
        os.close(rep_w)
        self._lock = threading.Lock()
        self.dead = False
        self._warmed = on_exit is not None  # a host agent runs no tensor engine
        self._next = 0
        self._spawned: dict[int, Future] = {}
        self._by_pid: dict[int, ProcInfo] = {}
        self._ready = Future("zygote start")
        self._started = False  # it said it is ready: its interpreter runs monarch_tensor
        self._reader = threading.Thread(target=self._read, daemon=True, name="monarch-tensor-host")
        self._reader.start()

    def _read(self) -> None:
        while True:
            msg = _zygote.read_msg(self._rep_fd)
            if msg is None:
                break
            try:
                self._handle(msg)
            except Exception:
                # Every spawn, proc output and death report of this host comes through this one thread: a
                # failure handling one message (printing a proc's output) must not end it.
                log.exception("handling the template's %r message", msg[0])
        self.dead = True  # local_host() starts a new template for later meshes
        err = RuntimeError(self._exited())
        self._ready._set_exception(err)
        for fut in self._spawned.values():
            fut._set_exception(err)
        lost = list(self._by_pid.values())
        # Its procs die with it (PDEATHSIG), killed: the template removed the socket file of each proc it
        # reaped, and now nobody would remove theirs, nor those of procs it was still starting.
        for info in [*lost, *self._infos.values()]:
            if info.addr.startswith("ipc://"):
                if info.starting and info.pid and os.path.exists(info.addr[len("ipc://"):]):
                    # Its mailbox was bound (it may have answered calls): it started, and its word of it died
                    # with the template, which relays it. Its loss is a fault of its mesh, not a failed start.
                    info.starting = False
                try:
                    os.unlink(info.addr[len("ipc://"):])
                except OSError:
                    pass
        for info in lost:
            self._on_exit(info, "lost with the template process")

    def _handle(self, msg: tuple) -> None:
        """One message from the template (on the reader thread)."""
        kind = msg[0]
        if kind == "ready":
            self._started = True
            self._ready._set_result(msg[1])
        elif kind == "spawned":
            _, req_id, pid = msg
            info = self._infos.pop(req_id, None)
            if info is not None:
                self._by_pid[pid] = info  # (before its first output)
            if self._relay:
                logs.output_handled.begin(pid)
            fut = self._spawned.pop(req_id)
            fut._set_result(pid)
        elif kind == "started":
            info = self._by_pid.get(msg[1])
            if info is not None:
                info.starting = False  # (here, in order with its exit: from now on a death is supervised)
        elif kind == "output":
            _, pid, stream, data = msg
            info = self._by_pid.get(pid)
            try:
                if info is not None:
                    self._on_output(info, stream, data)
            finally:
                if self._relay:  # (its replies wait for it: see logs.OutputHandled)
                    logs.output_handled.add(pid, stream, len(data))
        elif kind == "exited":
            _, pid, status = msg
            info = self._by_pid.pop(pid, None)
            if self._relay:  # (all its output came before this)
                logs.output_handled.end(pid)
            if info is not None:
                try:
                    self._on_output(info, 0, b"")  # the end of its output: a last partial line
                finally:
                    self._on_exit(info, status)

    def spawn(self, infos: list[ProcInfo], client_addr: str, envs: list[dict]) -> None:
        # No wait for the template to be ready: requests queue in the pipe, and are
        # served before anything it would import while idle.
        futs = []
        # (Read before the warm-up thread starts: a bad value is an error at the spawn, not that thread's.)
        warm = not setting("MONARCH_TENSOR_NO_WARMUP")
        with self._lock:
            if self.dead:
                raise RuntimeError(f"{self._exited()}; a new mesh starts a new one")
            try:
                self._request_spawns(infos, client_addr, envs, futs)
            except BrokenPipeError:  # the template exited before reading them (an interpreter that does not run)
                raise RuntimeError(self._exited()) from None
        try:
            if warm and not self._warmed:  # the template is still importing torch: meanwhile, on another core, warm up
                self._warmed = True
                # On a thread of its own, out of a Ctrl-C's reach: the interrupt ends the wait for it, not its
                # imports (torch._dynamo, sympy), which a KeyboardInterrupt leaves half done, breaking every
                # later mesh tensor op of the script ("module 'sympy' has no attribute 'core'").
                warm_up = threading.Thread(target=_warm_tensor_engine, daemon=True, name="monarch-tensor-warm-up")
                warm_up.start()
                warm_up.join()
            for info, fut in futs:
                info.pid = fut.get(timeout=config.get("spawn_timeout"))
        except BaseException:  # interrupted (Ctrl-C), or a spawn failed: none of these procs is wanted now
            for info, fut in futs:
                info.stopping = True  # (their exits are no supervision failures)
                fut.add_done_callback(lambda f: f.exception() is None and self.kill(f.result(), signal.SIGKILL))
            raise

    def _request_spawns(self, infos: list[ProcInfo], client_addr: str, envs: list[dict], futs: list) -> None:
        if self._bare and "torch" in sys.modules:
            self._bare = self._warmed = False  # and warm up the tensor engine meanwhile (spawn)
            _zygote.write_msg(self._req_fd, ("preload", ["torch"], ["torch._dynamo"]))
        # Where the script has imported torch (its procs then have it too), the spawn waits for the template's
        # idle imports (torch._dynamo, what DTensor needs), so that the procs start with them loaded: the first
        # torch.optim optimizer imports torch._dynamo, seconds of CPU in each proc that makes one (an actor per
        # proc building its optimizer in __init__: all at once, on the same cores), against once in the
        # template. A script without torch gets its procs forked at once; they import nothing in the background.
        engine = "monarch_tensor.controller" in sys.modules or "torch" in sys.modules
        for info, env in zip(infos, envs):
            self._next += 1
            fut = Future("proc spawn")
            self._spawned[self._next] = fut
            self._infos[self._next] = info
            info.starting = True
            if not engine:
                env = {**env, "MONARCH_TENSOR_IDLE_PRELOAD": ""}
            _zygote.write_msg(self._req_fd, ("spawn", self._next, "monarch_tensor.runtime._proc.run_proc",
                                             (info.addr, client_addr, info.rank), env, self._relay, engine))
            futs.append((info, fut))

    def _exited(self) -> str:
        """What became of the template process, which closed its pipes: its exit status, and for an interpreter
        other than this one (``with_python_executable``) that it may be no working Python."""
        try:
            rc = self.proc.wait(timeout=5)  # (it closed its pipes as it exited)
        except subprocess.TimeoutExpired:
            rc = None
        how = "closed its pipes" if rc is None else \
            f"was killed by signal {-rc}" if rc < 0 else f"exited with code {rc}"
        what = f"this host's template process (pid {self.proc.pid}) {how}"
        if self._python_exe is not None and not self._started:
            what += (f" before it started: {self._python_exe} (with_python_executable) is not a working Python "
                     f"with monarch_tensor importable? (what it wrote went to the stderr of the process that started it)")
        return what

    def kill(self, pid: int, sig: int) -> None:
        with self._lock:
            try:
                _zygote.write_msg(self._req_fd, ("kill", pid, sig))
            except OSError:
                pass

    def close(self) -> None:
        try:
            with self._lock:
                _zygote.write_msg(self._req_fd, ("exit",))
        except OSError:
            pass
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def _warm_tensor_engine() -> None:
    """Build the tensor engine's fake-tensor mode now, while the first procs start: it imports
    torch._dynamo, 1.6-2.2 s here, which the script's first mesh-tensor op would pay otherwise. Only in a
    script that imported torch itself; a failure here is left for that op to report."""
    if "torch" not in sys.modules or "torch._dynamo" in sys.modules or \
            setting("MONARCH_TENSOR_NO_WARMUP"):
        return
    try:
        from .. import _seams

        _seams.get("fake_mode")()
    except Exception as e:  # noqa: BLE001
        log.debug("tensor engine warm-up: %r", e)


_out_lines: dict[tuple[int, int], Any] = {}  # (pid, stream) -> logs.StreamLines of the client's procs


def _print_output(info: ProcInfo, stream: int, data: bytes) -> None:
    """Bytes a proc wrote to ``stream`` (1, 2; 0 with no bytes: its output ended), printed as forwarded lines
    are (``logs.client_log_sink``; in a proc that spawned procs, sent on to its own client), or, where
    ``logging_option`` turned forwarding off, written as they are to this process's own stdout or stderr
    (the terminal the proc would write to)."""
    from ..transport import logs
    from ..transport import mailbox as _mb
    from ..transport.messages import ForwardLogs

    if stream == 0:
        runs = [(s, r) for s in (1, 2) if (lines := _out_lines.pop((info.pid, s), None)) for r in lines.end()]
    else:
        lines = _out_lines.get((info.pid, stream))
        if lines is None:
            lines = _out_lines[(info.pid, stream)] = logs.StreamLines(bool(config.get("enable_log_forwarding")))
        runs = [(stream, r) for r in lines.feed(data)]
    mb = _mb._mailbox
    sink = mb.on_logs if mb is not None and mb.on_logs is not None else logs.client_log_sink  # (a proc: up)
    for s, (on, run) in runs:
        text = tuple(ln.decode(errors="replace") for ln in run)
        if on:
            sink(ForwardLogs(info.rank, s, text))
        else:
            os.write(s, ("\n".join(text) + "\n").encode())
