"""Resolving a host name to an address that TCP can bind (Monarch's ``monarch.tools.network``).

>>> from monarch_tensor.tools.network import AddrType, get_ipaddr, get_sockaddr
>>> get_sockaddr("127.0.0.1", 8080)        # a name: its IPv6 address first ('[::1]:8080'), else its IPv4 one
'127.0.0.1:8080'
>>> get_ipaddr("127.0.0.1", 8080, AddrType.IPv4)
'127.0.0.1'

Link-local addresses (``fe80::/10``, ``169.254.0.0/16``) are skipped: they route only on one segment and
need a scope id, so procs on other hosts (or in containers) could not reach them.
"""

from __future__ import annotations

import ipaddress
import logging
import socket
from enum import Enum, auto

logger = logging.getLogger(__name__)

__all__ = ["AddrType", "get_ipaddr", "get_sockaddr"]


class AddrType(Enum):
    """Which address family ``get_ipaddr`` resolves: ``Default`` is IPv6, else IPv4."""

    Default = auto()
    IPv4 = auto()
    IPv6 = auto()


_FAMILIES = {
    AddrType.Default: (socket.AF_INET6, socket.AF_INET),
    AddrType.IPv4: (socket.AF_INET,),
    AddrType.IPv6: (socket.AF_INET6,),
}


def _unresolvable(hostname: str) -> RuntimeError:
    return RuntimeError(f"Unable to resolve `{hostname}` to ipv6 or ipv4 address that can bind TCP socket."
                        " Check the network configuration on the host.")


def get_sockaddr(hostname: str, port: int) -> str:
    """``hostname:port`` as a TCP socket address: ``[ipv6]:port`` if the host has a (not link-local) IPv6
    address, else ``ipv4:port``. ``RuntimeError`` if it has neither.

    >>> get_sockaddr("127.0.0.1", 80)
    '127.0.0.1:80'
    """
    for family in _FAMILIES[AddrType.Default]:
        if (addr := _resolve_ipaddr(hostname, port, family)) is not None:
            sockaddr = f"[{addr}]:{port}" if family == socket.AF_INET6 else f"{addr}:{port}"
            logger.info("resolved %s address `%s` for `%s:%d`", family.name, sockaddr, hostname, port)
            return sockaddr
    raise _unresolvable(hostname)


def get_ipaddr(hostname: str, port: int, addr_type: AddrType = AddrType.Default) -> str:
    """The IP address alone (no brackets, no port) that ``get_sockaddr`` would use, of the family
    ``addr_type`` asks for. ``RuntimeError`` if there is none.

    >>> get_ipaddr("127.0.0.1", 80, AddrType.IPv4)
    '127.0.0.1'
    """
    if not isinstance(addr_type, AddrType):
        raise ValueError(f"Unknown AddrType: {addr_type!r} (one of {[t.name for t in AddrType]})")
    for family in _FAMILIES[addr_type]:
        if (addr := _resolve_ipaddr(hostname, port, family)) is not None:
            logger.info("resolved %s address `%s` for `%s:%d`", family.name, addr, hostname, port)
            return addr
    raise _unresolvable(hostname)


def _resolve_ipaddr(hostname: str, port: int, family: socket.AddressFamily) -> str | None:
    """The first address of ``family`` for ``hostname`` that is not link-local; None if there is none."""
    try:
        addrs = socket.getaddrinfo(hostname, port, family, type=socket.SOCK_STREAM)
    except socket.gaierror as e:
        logger.info("no %s address that can bind TCP sockets for `%s:%d` (error: %s)", family.name, hostname,
                    port, e)
        return None
    if not addrs:
        return None
    addr = str(addrs[0][4][0])  # sockaddr: (host, port) for IPv4, (host, port, flow, scope) for IPv6
    if ipaddress.ip_address(addr.split("%")[0]).is_link_local:
        logger.info("skipping link-local address `%s` for `%s:%d` (not usable between hosts)", addr, hostname,
                    port)
        return None
    return addr
