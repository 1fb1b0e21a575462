"""The template process that procs fork from (one per host per client).

Started by the client with the fds of two pipes as arguments; it imports
torch and the runtime once, then forks a child per spawn request, so a mesh
does not pay the import per proc. It speaks length-prefixed pickles on
those pipes (requests in, replies out), reports every child's exit status, and
when the client goes away (EOF on the request pipe: normal exit, exception or SIGKILL) it
kills every child it made and exits: no orphans.
"""

from __future__ import annotations

import errno
import gc
import mmap
import os
import pickle
import select
import signal
import struct
import sys
import threading
import time

from ..config import setting
from . import _hooks

_LEN = struct.Struct("!I")


def write_msg(fd: int, obj: object) -> None:
    data = pickle.dumps(obj)
    view = memoryview(_LEN.pack(len(data)) + data)
    while view:
        n = os.write(fd, view)
        view = view[n:]


def read_exact(fd: int, n: int) -> bytes | None:
    buf = b""
    while len(buf) < n:
        try:
            chunk = os.read(fd, n - len(buf))
        except InterruptedError:
            continue
        if not chunk:
            return None
        buf += chunk
    return buf


def read_msg(fd: int) -> object | None:
    head = read_exact(fd, _LEN.size)
    if head is None:
        return None
    body = read_exact(fd, _LEN.unpack(head)[0])
    return None if body is None else pickle.loads(body)


def set_pdeathsig(sig: int = signal.SIGKILL) -> None:
    """Ask the kernel to send ``sig`` to this process when its parent dies (Linux)."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, sig, 0, 0, 0)  # PR_SET_PDEATHSIG
    except Exception:  # noqa: BLE001 - best effort on non-Linux
        pass


def describe_status(status: int, pid: int | None = None) -> str:
    """How a child ended; with ``pid``, and why, where it left word of that (``leave_last_words``)."""
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        try:
            name = signal.Signals(sig).name
        except ValueError:
            name = str(sig)
        what = f"killed by signal {name}"
    else:
        what = f"exited with code {os.WEXITSTATUS(status)}"
    words = _take_last_words(pid) if pid is not None else ""
    return f"{what} ({words})" if words else what


LAST_WORDS_MAX = 4000  # characters


def _last_words_path(pid: int) -> str:
    from ..transport.mailbox import socket_dir

    return os.path.join(socket_dir(), f"last-words-{pid}")


def leave_last_words(text: str) -> None:
    """In a proc about to end itself (an unhandled fault): why, for its parent's report of its exit
    (``describe_status``), which its owner's supervision event carries. Best effort."""
    try:
        with open(_last_words_path(os.getpid()), "w") as f:
            f.write(text[:LAST_WORDS_MAX])
    except OSError:
        pass


def _take_last_words(pid: int) -> str:
    path = _last_words_path(pid)
    try:
        with open(path) as f:
            text = f.read()
        os.unlink(path)
    except OSError:
        return ""
    return " ".join(text.split())


def serve(req_fd: int, rep_fd: int, idle_imports: list[str] | None = None) -> None:
    """Fork procs on request until the client goes away; import ``idle_imports`` when idle; relay the output
    of the procs spawned with ``relay`` (see ``_output_pipes``)."""
    idle_imports = _in_steps(list(idle_imports or []))
    client = os.getppid()
    spawned: list[int] = []  # every proc's pid: their files go when the client died without telling us
    children: dict[int, int] = {}  # pid -> request id
    sockets: dict[int, str] = {}  # pid -> its ipc socket file, removed once it exited (see _remove_socket)
    clients: set[str] = set()  # the client addresses given to its procs (their workspace roots are named so)
    outputs: dict[int, list] = {}  # pid -> [stdout read end, stderr read end] (None once it ended)
    relayed: dict[int, tuple] = {}  # read end -> (pid, stream, OutputCounts) of the procs whose output is relayed
    starting: dict[int, int] = {}  # read end of a start pipe -> the pid of the proc that has not said it started
    sig_r, sig_w = os.pipe()
    os.set_blocking(sig_w, False)
    signal.set_wakeup_fd(sig_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    waits = select.poll()  # (not select.select: two descriptors per proc may pass its limit of 1024)
    waits.register(req_fd, select.POLLIN)
    waits.register(sig_r, select.POLLIN)
    write_msg(rep_fd, ("ready", os.getpid()))
    died = False
    # With the warm-up on, a spawn of procs for the tensor engine waits for the idle imports to finish here,
    # once, so that its procs are forked with them loaded: otherwise each proc imports them anew on a thread
    # of its own (finish_preload), seconds of CPU a proc, competing with its first work and its siblings' on a
    # small machine. Outputs are still relayed between two pieces. Other spawns are forked at once.
    defer = _warm_up_on()
    deferred: list[tuple] = []  # spawn requests waiting for the idle imports

    def fork(req: tuple) -> None:
        _, req_id, entry, args, env, relay = req[:6]
        reads, writes = _output_pipes()
        counts = OutputCounts() if relay else None  # (before the fork: the proc shares it)
        start_r, start_w = os.pipe()
        pid = os.fork()
        if pid == 0:
            others = [fd for pair in outputs.values() for fd in pair if fd is not None]
            others += [*starting, start_r]
            _child(req_fd, rep_fd, sig_r, sig_w, entry, args, env, (reads, writes), others, counts, start_w)
        os.close(start_w)
        starting[start_r] = pid
        waits.register(start_r, select.POLLIN)
        children[pid] = req_id
        spawned.append(pid)
        if isinstance(args[0], str) and args[0].startswith("ipc://"):  # (run_proc's own address,
            sockets[pid] = args[0][len("ipc://"):]  # and its client's)
        if len(args) > 1 and isinstance(args[1], str):
            clients.add(args[1])
        for w in writes:
            os.close(w)
        outputs[pid] = list(reads)
        if relay:
            for stream, fd in enumerate(reads, 1):
                relayed[fd] = (pid, stream, counts)
                waits.register(fd, select.POLLIN)
        write_msg(rep_fd, ("spawned", req_id, pid))

    try:
        while True:
            try:
                readable = [fd for fd, _ in waits.poll(0 if idle_imports or deferred else 1000)]
            except InterruptedError:
                readable = [sig_r]
            if not readable and idle_imports:
                _try_import(idle_imports.pop(0))
                continue
            if deferred and not idle_imports:
                for req in deferred:
                    fork(req)
                deferred.clear()
            if sig_r in readable:
                try:
                    os.read(sig_r, 4096)
                except BlockingIOError:
                    pass
            for fd in readable:
                if fd in relayed:
                    _relay(fd, relayed, outputs, rep_fd, waits)
                elif fd in starting:
                    _started(fd, starting, rep_fd, waits)
            _reap(children, rep_fd, outputs, relayed, waits, sockets, starting)
            if deferred and idle_imports and readable:  # (busy relaying: the imports go on between reads)
                _try_import(idle_imports.pop(0))
            if req_fd in readable:
                req = read_msg(req_fd)
                if req is None or req[0] == "exit":
                    died = req is None
                    break
                if req[0] == "spawn":
                    if defer and idle_imports and (len(req) < 7 or req[6]):  # (req[6]: procs for the engine)
                        deferred.append(req)
                    else:
                        fork(req)
                elif req[0] == "preload":  # the client imported torch after its first procs: later ones get it
                    for mod in req[1]:
                        _try_import(mod)
                    idle_imports.extend(m for m in _in_steps(req[2]) if m not in idle_imports)
                elif req[0] == "kill":
                    _, pid, sig = req
                    if pid in children:
                        try:
                            os.kill(pid, sig)
                        except ProcessLookupError:
                            pass
    except BrokenPipeError:  # the client is gone: nothing to tell it any more
        died = True
    _kill_all(children, rep_fd)
    for pid in list(sockets):  # (those killed just now: a job killed while its procs ran, say)
        _remove_socket(sockets, pid)
    for pid in spawned:  # the last words of procs whose exit nobody described (reaped by _kill_all)
        try:
            os.unlink(_last_words_path(pid))
        except OSError:
            pass
    if died:  # (SIGKILLed, say): what it and its procs left in /dev/shm and the socket directory
        _remove_files_of(client, spawned, clients)


def _remove_files_of(client: int, procs: list[int], client_addrs=()) -> None:
    """The shared-memory segments of ``client`` and ``procs`` (named ``mt-<pid>-...``), the sockets of the
    client and of the procs it named (``client-<pid>-...``, ``proc-<pid>-...``), the client's debug server
    file (``debug-<pid>.json``, which holds its token), and the client session's default workspace root
    (``client_addrs``): a process that was killed removes none of its own. The tools' files go through their
    ``client_gone`` hooks (``_hooks``). Only once the client is gone: its own segments are in use while it
    lives."""
    import glob

    from ..transport.mailbox import socket_dir

    _hooks.client_gone(client, client_addrs)
    paths = [p for pid in (client, *procs) for p in glob.glob(f"/dev/shm/mt-{pid}-*")]
    paths += glob.glob(os.path.join(socket_dir(), f"*-{client}-*"))
    for path in paths:
        try:
            os.unlink(path)
        except OSError:
            pass


# A proc's stdout and stderr are pipes whose read ends this process keeps. For the client's procs
# (``relay``) it reads them and relays the bytes to the client ("output" messages): what a proc writes
# reaches the client even when it dies right after (a thread of its own would lose what it had read and not
# sent: the last lines before an os._exit or a crash). A host agent's procs forward their lines themselves
# (_proc._LogForwarder); when one exits, this process sends what it left unread: up to LEFTOVER_MAX bytes of
# each stream, the last ones.
LEFTOVER_MAX = 64 << 10
LOG_PIPES_ENV = "MONARCH_TENSOR_LOG_PIPES"
# A proc says it started (its mailbox is bound, it is about to serve: ``_proc.run_proc``) with a byte on a
# pipe of its own, whose write end this names; this process then sends "started". A proc that dies first
# closes the pipe with nothing written: its spawn failed (``host.LocalHost.spawn``), as its exit says.
STARTED_ENV = "MONARCH_TENSOR_STARTED_FD"


def _output_pipes() -> tuple[tuple[int, int], tuple[int, int]]:
    """((stdout read end, stderr read end), (stdout write end, stderr write end)) for a new proc."""
    r1, w1 = os.pipe()
    r2, w2 = os.pipe()
    return (r1, r2), (w1, w2)


class OutputCounts:
    """How many bytes the template has read from a relayed proc's stdout and stderr, in memory it shares with
    the proc (an anonymous mapping made before the fork). With what is still unread in its pipes, the proc
    knows how much it has written in all, whoever wrote it (``print``, ``logging``, C code on fds 1 and 2):
    a reply says so, and the client prints that much of the proc's output before it delivers the reply
    (``logs.OutputHandled``), which the output, relayed apart, would otherwise often follow.

    A seqlock: the first counter is odd while the template reads, so the proc can tell a count it took while
    the template read (what it took from the pipe and had not counted yet: in neither) from one it can trust."""

    def __init__(self) -> None:
        self._shared = memoryview(mmap.mmap(-1, 24)).cast("Q")  # [reads begun and ended, stdout, stderr bytes]

    def read(self, fd: int, stream: int) -> bytes:
        """(In the template) read what the proc wrote to ``stream`` (1, 2), counting it."""
        counts = self._shared
        counts[0] += 1
        try:
            chunk = os.read(fd, 65536)
        except OSError:
            chunk = b""
        counts[stream] += len(chunk)
        counts[0] += 1
        return chunk

    def written(self, unread) -> tuple[int, int] | None:
        """(In the proc) the bytes written so far to stdout and to stderr: those the template read, and
        ``unread()``, those still in the pipes. None when the template kept reading while it looked."""
        counts = self._shared
        for _ in range(100):
            seq = counts[0]
            if not seq & 1:
                held_out, held_err = unread()
                out, err = counts[1] + held_out, counts[2] + held_err
                if counts[0] == seq:
                    return out, err
            os.sched_yield()
        return None


# The relayed proc's OutputCounts, in a proc the template forked (see _child).
output_counts: OutputCounts | None = None


def _relay(fd: int, relayed: dict, outputs: dict, rep_fd: int, waits) -> None:
    """Relay what a proc wrote to one of its streams; at its end (every write end closed), stop watching it."""
    pid, stream, counts = relayed[fd]
    chunk = counts.read(fd, stream)
    if chunk:
        write_msg(rep_fd, ("output", pid, stream, chunk))
        return
    del relayed[fd]
    waits.unregister(fd)
    os.close(fd)
    outputs[pid][stream - 1] = None


def _started(fd: int, starting: dict, rep_fd: int, waits) -> None:
    """A proc's start pipe is readable: its byte ("started"), or its end (it died before: no message, its exit
    follows). Either way the pipe is done with."""
    pid = starting.pop(fd)
    waits.unregister(fd)
    try:
        said = os.read(fd, 1)
    except OSError:
        said = b""
    os.close(fd)
    if said:
        write_msg(rep_fd, ("started", pid))


def _drain(fd: int, limit: int | None) -> bytes:
    """What is left unread in a pipe (the last ``limit`` bytes of it), which is then closed."""
    got = b""
    try:
        os.set_blocking(fd, False)
        while True:
            chunk = os.read(fd, 65536)
            if not chunk:
                break
            got += chunk
            if limit is not None:
                got = got[-limit:]
    except OSError:  # (BlockingIOError: nothing more)
        pass
    finally:
        os.close(fd)
    return got


def _reap(children: dict[int, int], rep_fd: int, outputs: dict, relayed: dict, waits, sockets: dict,
          starting: dict) -> None:
    """Report the procs that exited, each after what it wrote and nobody had read yet (and after its
    "started", if it said so since the last poll)."""
    while children:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        if children.pop(pid, None) is not None:
            for fd in [fd for fd, p in starting.items() if p == pid]:
                _started(fd, starting, rep_fd, waits)
            for stream, fd in enumerate(outputs.pop(pid, ()), 1):
                if fd is None:
                    continue
                was_relayed = relayed.pop(fd, None) is not None
                if was_relayed:
                    waits.unregister(fd)
                left = _drain(fd, None if was_relayed else LEFTOVER_MAX)
                if left:
                    write_msg(rep_fd, ("output", pid, stream, left))
            write_msg(rep_fd, ("exited", pid, describe_status(status, pid)))
            _remove_socket(sockets, pid)


def _remove_socket(sockets: dict[int, str], pid: int) -> None:
    """The socket file of a proc that exited: one that was killed (SIGKILL, or SIGTERM when its template
    shuts down) leaves it in the socket directory; one that exited cleanly removed it already."""
    path = sockets.pop(pid, None)
    if path is not None:
        try:
            os.unlink(path)
        except OSError:
            pass


def _kill_all(children: dict[int, int], rep_fd: int) -> None:
    for sig, wait in ((signal.SIGTERM, 2.0), (signal.SIGKILL, 2.0)):
        for pid in list(children):
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + wait
        while children and time.monotonic() < deadline:
            try:
                pid, _ = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                children.clear()
                break
            if pid:
                children.pop(pid, None)
            else:
                time.sleep(0.02)


def _child(req_fd, rep_fd, sig_r, sig_w, entry, args, env, pipes=None, others=(), counts=None,
           started: int | None = None) -> None:
    """Run a proc; ``counts``: its OutputCounts, for a proc whose output the template relays; ``started``:
    the write end of its start pipe (see STARTED_ENV)."""
    global output_counts
    code = 1
    try:
        # What the template made (torch, the runtime) outlives the proc: the proc's collections, its stop's
        # among them (_proc_exit), pass over what the proc itself made only.
        gc.freeze()
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        for fd in (req_fd, rep_fd, sig_r, sig_w, *others):
            os.close(fd)
        set_pdeathsig()
        # A session of its own, as each of torchrun's ranks has: where Linux shares the CPU out by session
        # (autogroup), each proc then gets a session's share beside other work, as a torchrun rank does, instead
        # of all the procs of the template sharing one.
        try:
            os.setsid()
        except OSError:
            pass
        numpy = sys.modules.get("numpy")  # imported here before the fork: every proc would draw the same numbers
        if numpy is not None:
            numpy.random.seed()  # (from the OS's entropy, as a fresh process's numpy; Python's random reseeds itself)
        os.environ.update(env)
        if started is not None:  # the write end of its start pipe (see STARTED_ENV)
            os.environ[STARTED_ENV] = str(started)
        if pipes is not None:  # fds 1 and 2 into the pipes; the proc's log forwarder reads them (and dup's
            (r1, r2), (w1, w2) = pipes  # of the terminal's fds for its fallback)
            relay, output_counts = counts is not None, counts
            terminal = (os.dup(1), os.dup(2))
            os.dup2(w1, 1)
            os.dup2(w2, 2)
            os.close(w1)
            os.close(w2)
            os.environ[LOG_PIPES_ENV] = f"{'relay' if relay else 'pump'},{r1},{r2},{terminal[0]},{terminal[1]}"
        module, _, func = entry.rpartition(".")
        __import__(module)
        getattr(sys.modules[module], func)(*args)
        code = 0
    except BaseException:  # noqa: BLE001 - report, then exit without unwinding the zygote's stack
        import traceback

        traceback.print_exc()
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def _warm_up_on() -> bool:
    """Whether ``MONARCH_TENSOR_NO_WARMUP`` leaves the warm-up on."""
    return not setting("MONARCH_TENSOR_NO_WARMUP")


def _modules(var: str) -> list[str]:
    return [m for m in setting(var).split(",") if m]


# Idle imports run in pieces, so that a spawn request or a proc's output is served between two of them:
# torch._dynamo in one took about 1.9 s here, during which procs' lines waited (arriving cells late in a
# notebook) and so did new procs; in these pieces the longest is about 0.8 s. The pieces are packages its
# import loads, each importable on its own (its internal modules are not: imported out of its order they
# fail on circular imports).
_IMPORT_STEPS = {
    "torch._dynamo": ["mpmath", "sympy", "torch.fx.experimental.symbolic_shapes", "torch.distributed.tensor",
                      "torch.distributed.fsdp", "torch._dynamo"],
}


def _in_steps(mods: list[str]) -> list[str]:
    out: list[str] = []
    for mod in mods:
        out += [m for m in _IMPORT_STEPS.get(mod, [mod]) if m not in out]
    return out


preloading: threading.Thread | None = None  # in a proc: the thread of finish_preload


def finish_preload(mods: list[str]) -> threading.Thread | None:
    """In a proc: import on a thread of its own what importing ``mods`` loads and is not loaded yet (the
    template's idle imports, when it forked this proc before finishing them); that thread (the one started
    before, if any), or None with nothing to import. The pieces go bottom up (each one's own imports loaded
    before it), so another thread importing one of them meanwhile waits for it rather than closing a
    circle of imports with this thread."""
    global preloading
    if preloading is not None:
        return preloading
    steps = [m for m in _in_steps(mods) if m not in sys.modules]
    if not steps:
        return None
    preloading = threading.Thread(target=lambda: [_try_import(m) for m in steps], daemon=True,
                                  name="monarch-tensor-preload")
    preloading.start()
    return preloading


def _try_import(mod: str) -> None:
    """Import ``mod`` ahead of its use; quietly, whatever happens: a proc that exits while this thread imports
    sees its modules' globals cleared under it (``'NoneType' object has no attribute ...``), and a real error
    comes again, at its place, when the proc's own code imports ``mod``."""
    if sys.is_finalizing():
        return
    try:
        __import__(mod)
    except Exception:  # noqa: BLE001 - an import ahead of time is best effort (see above)
        pass


def main(req_fd: int, rep_fd: int) -> None:
    # The protocol runs on its own pipes; stdio stays the client's, so a proc whose
    # output is not forwarded writes to the client's terminal.
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    # No PDEATHSIG here: it fires when the spawning *thread* exits. The client
    # going away closes the request pipe instead, which serve() treats as the end.
    for mod in _modules("MONARCH_TENSOR_PRELOAD"):
        _try_import(mod)
    import monarch_tensor.runtime._proc  # noqa: F401 - the runtime every child runs

    _hooks.load()  # the tools' modules every child serves with

    # torch._dynamo is imported by the first torch.optim optimizer (~2 s per proc, far
    # more when several procs do it at once): import it here once, whenever idle.
    # (A client that has not imported torch starts us with both lists empty, and sends a "preload"
    # request if it imports torch later: see host.LocalHost.)
    idle = _modules("MONARCH_TENSOR_IDLE_PRELOAD")
    try:
        serve(req_fd, rep_fd, idle)
    except OSError as e:
        if e.errno != errno.EPIPE:
            raise
    # Its procs are gone and their files removed: nothing is left to finalize, and the interpreter's teardown
    # of torch (seconds on a busy machine) would only keep the client or agent that waits for this exit.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]))
