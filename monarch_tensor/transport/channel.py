"""Monarch's transport choice (``enable_transport``, ``ChannelTransport``), re-exported by
``monarch_tensor.actor``. Every link picks its own transport here; the choice is checked and recorded."""

from __future__ import annotations

import enum


class ChannelTransport(enum.Enum):
    """Monarch's transports; see ``enable_transport``."""

    Unix = "unix"
    Local = "local"
    TcpWithHostname = "tcp-hostname"
    TcpWithLocalhost = "tcp-localhost"
    Tls = "tls"
    MetaTlsWithHostname = "metatls-hostname"
    MetaTlsWithIpV6 = "metatls-ipv6"
    Quic = "quic"
    MetaQuicWithHostname = "metaquic-hostname"
    MetaQuicWithIpV6 = "metaquic-ipv6"


_TRANSPORT_NAMES = {"ipc": ChannelTransport.Unix, "unix": ChannelTransport.Unix, "local": ChannelTransport.Local,
                    "tcp": ChannelTransport.TcpWithHostname, "tls": ChannelTransport.Tls,
                    "metatls": ChannelTransport.MetaTlsWithIpV6,
                    "metatls-hostname": ChannelTransport.MetaTlsWithHostname}
_SERVED = {ChannelTransport.Unix, ChannelTransport.Local, ChannelTransport.TcpWithHostname,
           ChannelTransport.TcpWithLocalhost}
enabled_transport: ChannelTransport = ChannelTransport.Unix


def enable_transport(transport: ChannelTransport | str) -> None:
    """Monarch's transport choice. Here every link picks its own: ``ipc://`` between the procs of one host,
    TCP with CURVE encryption between hosts, so the Unix and TCP transports (``"ipc"``, ``"tcp"``, a
    ``tcp://`` URL) are what runs anyway and are accepted; TLS and QUIC are not served (CURVE keys stand
    in for TLS certificates) and are refused. Recorded in ``enabled_transport``."""
    global enabled_transport
    if isinstance(transport, str):
        key = transport.lower()
        if key.startswith(("tcp://", "ipc://")):
            chosen = ChannelTransport.TcpWithHostname if key.startswith("tcp") else ChannelTransport.Unix
        elif key in _TRANSPORT_NAMES:
            chosen = _TRANSPORT_NAMES[key]
        else:
            raise ValueError(f"enable_transport({transport!r}): known names are {sorted(_TRANSPORT_NAMES)}, a "
                             f"ChannelTransport, or a tcp:// or ipc:// URL")
    elif isinstance(transport, ChannelTransport):
        chosen = transport
    else:
        raise TypeError(f"enable_transport() takes a ChannelTransport or its name, got {transport!r}")
    if chosen not in _SERVED:
        raise ValueError(f"enable_transport({transport!r}): {chosen.name} is not served here; links use ipc:// "
                         f"within a host and TCP with CURVE keys between hosts (the job's key pair stands in "
                         f"for TLS certificates)")
    enabled_transport = chosen
