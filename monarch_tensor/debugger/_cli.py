"""``monarch-tensor debug``: connect this terminal to a running script's ``monarch_dbg>`` prompt.

Finds the newest live script of this user that has a debug server (its
``debug-<pid>.json`` in the socket directory), or the one given by ``--pid``,
waits for one to appear (``--wait``), authenticates with its token and relays
lines both ways until the prompt closes.
"""

from __future__ import annotations

import codecs
import glob
import json
import os
import socket
import sys
import threading
import time

from ..transport.mailbox import socket_dir
from ._server import MAGIC, answer


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


def find_server(pid: int | None) -> dict | None:
    paths = [os.path.join(socket_dir(), f"debug-{pid}.json")] if pid else \
        glob.glob(os.path.join(socket_dir(), "debug-*.json"))
    found = []
    for p in paths:
        try:
            with open(p) as f:
                info = json.load(f)
            mtime = os.path.getmtime(p)
        except (OSError, ValueError):
            continue
        if _alive(int(info.get("pid", 0))):
            found.append((mtime, info))
    return max(found, key=lambda x: x[0])[1] if found else None


def connect(info: dict, timeout: float = 5.0) -> socket.socket:
    """Open and authenticate a connection; raises ``PermissionError`` when refused."""
    s = socket.create_connection((info["host"], info["port"]), timeout=timeout)
    f = s.makefile("r", encoding="utf-8", newline="\n")
    magic, _, nonce = f.readline().strip().partition(" ")
    if magic != MAGIC:
        s.close()
        raise ConnectionError(f"{info['host']}:{info['port']} is not a monarch-tensor debug server")
    s.sendall((answer(info["token"], nonce) + "\n").encode())
    status = f.readline().strip()
    if status != "OK":
        s.close()
        raise PermissionError(f"debug server refused the connection: {status}")
    s.settimeout(None)
    return s


def main(pid: int | None = None, wait: float = 60.0) -> int:
    try:
        return _main(pid, wait)
    except KeyboardInterrupt:  # leaves the prompt; paused ranks stay paused (a later `debug` finds them)
        print("\nmonarch-tensor debug: interrupted (paused ranks stay paused)", file=sys.stderr)
        return 130


def _main(pid: int | None, wait: float) -> int:
    deadline = time.monotonic() + wait
    info = find_server(pid)
    if info is None:
        print("waiting for a script with a paused rank (breakpoint()) ...", file=sys.stderr, flush=True)
    while info is None and time.monotonic() < deadline:
        time.sleep(0.2)
        info = find_server(pid)
    if info is None:
        print(f"monarch-tensor debug: no running script with breakpoints found in {socket_dir()} "
              f"within {wait:.0f} s", file=sys.stderr)
        return 1
    try:
        conn = connect(info)
    except (OSError, PermissionError) as e:
        print(f"monarch-tensor debug: cannot connect to pid {info['pid']}: {e}", file=sys.stderr)
        return 1

    def pump() -> None:
        text = codecs.getincrementaldecoder("utf-8")(errors="replace")  # a character may span two reads
        while True:
            try:
                data = conn.recv(65536)
            except OSError:
                data = b""
            if not data:
                os._exit(0)  # the prompt closed (continue/quit) or the script ended
            sys.stdout.write(text.decode(data))
            sys.stdout.flush()

    threading.Thread(target=pump, daemon=True).start()
    for line in sys.stdin.buffer:  # the bytes as typed: the server reads what is not UTF-8 as U+FFFD
        conn.sendall(line)
    conn.shutdown(socket.SHUT_WR)
    time.sleep(0.5)
    return 0
