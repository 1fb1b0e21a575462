"""Which of this machine's addresses other hosts reach it at (no packet is sent)."""

from __future__ import annotations

import socket

LOOPBACK = ("127.0.0.1", "localhost", "::1")


def host_of(addr: str) -> str:
    """``"10.0.0.2"`` for ``"tcp://10.0.0.2:26600"`` (or a bare host)."""
    if addr.startswith("tcp://"):
        addr = addr[len("tcp://"):].rpartition(":")[0]
    return addr.strip("[]")


_routes: dict[str, str] = {}


def ip_towards(addr: str) -> str:
    """This machine's address on the route to ``addr`` (``tcp://HOST:PORT`` or a host): the one that host
    can reach us at. Loopback for a loopback peer; ``0.0.0.0`` when there is no route."""
    host = host_of(addr)
    if host in LOOPBACK or host.startswith("127."):
        return "127.0.0.1"
    found = _routes.get(host)
    if found is not None:
        return found
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((host, 9))  # a UDP connect only picks the route
            found = _routes[host] = s.getsockname()[0]  # remembered: messages ask per send
            return found
    except OSError:
        return "0.0.0.0"
