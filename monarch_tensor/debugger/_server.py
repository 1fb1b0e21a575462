"""Where the ``monarch_dbg>`` prompt runs: a local TCP server for ``monarch-tensor debug``, or this terminal.

The server starts at the first breakpoint, on 127.0.0.1 (``MONARCH_TENSOR_DEBUG_HOST``
/ ``MONARCH_TENSOR_DEBUG_PORT`` to change), and writes its port and a random
token to ``<socket dir>/debug-<pid>.json`` (mode 0600, in the user's 0700 socket
directory). A connection must answer a challenge with HMAC-SHA256(token,
nonce) before it gets a prompt, so only this user's processes can drive it.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import secrets
import select
import socket
import sys
import threading

from ..config import setting
from ..transport._at_exit import at_exit
from ..transport.mailbox import socket_dir

MAGIC = "MTDBG1"
AUTH_TIMEOUT = 5.0

_lock = threading.Lock()
_server: socket.socket | None = None
_token = ""
_remote = 0  # connected debuggers
_local: threading.Thread | None = None
_told = False
_pauses = 0  # ranks that paused so far: a prompt that closes after some paused gets a successor (_closed)


def _pause_count() -> int:
    with _lock:
        return _pauses


def info_path(pid: int | None = None) -> str:
    return os.path.join(socket_dir(), f"debug-{pid or os.getpid()}.json")


def answer(token: str, nonce: str) -> str:
    return hmac.new(token.encode(), nonce.encode(), hashlib.sha256).hexdigest()


def ensure_server() -> tuple[str, int]:
    """Start the debug server once; return its (host, port)."""
    global _server, _token
    with _lock:
        if _server is None:
            host = setting("MONARCH_TENSOR_DEBUG_HOST")
            port = setting("MONARCH_TENSOR_DEBUG_PORT")
            srv = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            srv.bind((host, port))
            srv.listen(4)
            _token = secrets.token_hex(32)
            path = info_path()
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "w") as f:
                json.dump({"pid": os.getpid(), "host": host, "port": srv.getsockname()[1], "token": _token,
                           "script": " ".join(sys.argv)}, f)
            at_exit(_remove_info, path)
            _server = srv
            threading.Thread(target=_accept, args=(srv,), daemon=True, name="monarch-tensor-debug").start()
        return _server.getsockname()


def _remove_info(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def on_client_gone(client_pid: int, client_addrs) -> None:
    """A client that was killed left its debug server's file (which holds its token): removed by the host's
    template process once the client is gone (a hook: ``runtime/_hooks.py``)."""
    _remove_info(info_path(client_pid))


def _accept(srv: socket.socket) -> None:
    while True:
        try:
            conn, _ = srv.accept()
        except OSError:
            return
        threading.Thread(target=_serve, args=(conn,), daemon=True, name="monarch-tensor-debug-conn").start()


class _SocketIO:
    def __init__(self, conn: socket.socket) -> None:
        self.conn = conn
        # (bytes that are not UTF-8 read as U+FFFD: a bad command or token, not the end of the link)
        self.r = conn.makefile("r", encoding="utf-8", errors="replace", newline="\n")
        self.seen = _pause_count()  # the pauses before the last line read: what its command could see

    def write(self, text: str) -> None:
        self.conn.sendall(text.encode())

    def readline(self) -> str | None:
        line = self.r.readline()
        self.seen = _pause_count()
        return line if line else None


def _serve(conn: socket.socket) -> None:
    global _remote, _told
    from . import Repl

    with conn:
        try:
            conn.settimeout(AUTH_TIMEOUT)
            nonce = secrets.token_hex(16)
            conn.sendall(f"{MAGIC} {nonce}\n".encode())
            io = _SocketIO(conn)
            reply = (io.readline() or "").strip()
            if not hmac.compare_digest(reply.encode(), answer(_token, nonce).encode()):  # (str: ASCII only)
                conn.sendall(b"DENIED bad token\n")
                return
            conn.sendall(b"OK\n")
            conn.settimeout(None)
            with _lock:
                _remote += 1
            try:
                Repl(io).run()
            finally:
                with _lock:
                    _remote -= 1
                    _told = False  # the next rank to pause without a debugger says so again
            _closed(io.seen)
        except OSError:
            return


class _TerminalIO:
    """The script's own terminal; reading stops once no rank is paused any more."""

    def __init__(self) -> None:
        self.fd = sys.stdin.fileno()
        self.buf = b""
        self.seen = _pause_count()  # the pauses before the last line read: what its command could see

    def write(self, text: str) -> None:
        sys.stdout.write(text)
        sys.stdout.flush()

    def readline(self) -> str | None:
        from . import controller

        while b"\n" not in self.buf:
            self.seen = _pause_count()  # (read first: a rank counted here is already in paused())
            if not controller().paused():
                self.write("\n")
                return None
            r, _, _ = select.select([self.fd], [], [], 0.2)
            if r:
                chunk = os.read(self.fd, 4096)
                if not chunk:
                    return None
                self.buf += chunk
        line, _, self.buf = self.buf.partition(b"\n")
        return line.decode(errors="replace") + "\n"


def _run_local() -> None:
    global _local
    from . import Repl

    io = _TerminalIO()
    try:
        Repl(io).run()
    finally:
        with _lock:
            _local = None
    _closed(io.seen)


def _closed(seen: int) -> None:
    """A prompt closed; ``seen`` pauses had happened before its last command.

    A rank that paused after that command (a rank that stops again right after ``continue``, say) found
    the prompt still open, so nothing was opened or printed for it: do that now, as for a new pause.
    """
    if _pause_count() != seen and _any_paused():
        _offer()


def on_breakpoint() -> None:
    """A rank paused: make sure a debugger can reach it (called on the client's I/O thread)."""
    global _pauses
    ensure_server()
    with _lock:
        _pauses += 1
        if _local is not None or _remote > 0:
            return  # an open prompt lists it (one closing after its last command calls _closed)
    _offer()


def _offer() -> None:
    """No prompt is open and a rank is paused: open the prompt in this terminal, or say how to reach it."""
    global _local, _told
    host, port = ensure_server()
    interactive = setting("MONARCH_TENSOR_DEBUG_LOCAL") and _isatty()
    with _lock:
        if _local is not None or _remote > 0:
            return
        if interactive:
            _local = threading.Thread(target=_run_local, daemon=True, name="monarch-tensor-debug-local")
            _local.start()
            return
        if _told:
            return
        _told = True
    print(f"monarch_tensor: a rank is paused at breakpoint(); run `monarch-tensor debug` in another terminal "
          f"(debug server on {host}:{port})", file=sys.stderr, flush=True)


def _any_paused() -> bool:
    from . import controller

    return bool(controller().paused())


def _isatty() -> bool:
    try:
        return sys.stdin is not None and os.isatty(sys.stdin.fileno())
    except (ValueError, OSError):
        return False
