"""Point-to-point TCP port forwarding between proc meshes (Monarch's ``monarch.job.PortForwarder``).

>>> from monarch_tensor.actor import this_host, this_proc
>>> from monarch_tensor.job import PortForwarder
>>> procs = this_host().spawn_procs(per_host={"procs": 2})
>>> forwarder = this_proc().spawn("port_forwarder", PortForwarder)
>>> forwarder.forward.call_one(procs.slice(procs=0), 8000, procs.slice(procs=1), "127.0.0.1:9000").get()
>>> # a connection to 127.0.0.1:9000 on procs=1's host now reaches 127.0.0.1:8000 on procs=0's
>>> forwarder.stop().get()                     # closes every forward it started

Each forward spawns a source actor on every proc of the source mesh, which listens on its address, and a
destination actor on every proc of the destination mesh. A connection accepted by a source opens a TCP
connection to ``127.0.0.1:dst_port`` on the destination at the same coordinates; the bytes travel both ways
as actor messages over the job's (authenticated, encrypted) control plane, so the destination port need not
be reachable from the source's host. An end of file is passed on (half close); a connection reset or an
actor that stops aborts the other side's connection.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Callable
from typing import NamedTuple

from ..actor import Actor, ActorError, Channel, Point, Port, PortReceiver, ProcMesh, current_rank, endpoint

__all__ = ["PortForwarder"]

_HOST = "127.0.0.1"  # destinations are services of the destination's own host, on its loopback
_READ_SIZE = 64 * 1024
_CLOSE_TIMEOUT = 1.0

_PortSpec = int | Callable[[Point], int]
_AddressSpec = str | Callable[[Point], str]


class _Data(NamedTuple):
    """Bytes read from one end's socket, to be written to the other's."""

    data: bytes


class _Eof(NamedTuple):
    """One end read end of file: the other writes EOF (half close)."""


class _Abort(NamedTuple):
    """One end failed or was stopped: the other resets its connection."""


async def _close_writer(writer: asyncio.StreamWriter) -> None:
    writer.close()
    try:
        await asyncio.wait_for(writer.wait_closed(), timeout=_CLOSE_TIMEOUT)
    except (OSError, asyncio.TimeoutError):
        writer.transport.abort()


def _send_abort(port: Port) -> None:
    try:
        port.send(_Abort())
    except (RuntimeError, OSError):
        pass  # (the other end is gone already)


async def _pump_socket(reader: asyncio.StreamReader, port: Port) -> None:
    while data := await reader.read(_READ_SIZE):
        port.send(_Data(data))
    port.send(_Eof())


async def _pump_channel(receiver: PortReceiver, writer: asyncio.StreamWriter, got_eof: asyncio.Event) -> None:
    while True:
        message = await receiver.recv()
        if isinstance(message, _Data):
            writer.write(message.data)
            await writer.drain()
        elif isinstance(message, _Eof):
            if not got_eof.is_set():
                if writer.can_write_eof():
                    writer.write_eof()
                    await writer.drain()
                else:
                    writer.close()
                got_eof.set()
        elif isinstance(message, _Abort):
            writer.transport.abort()
            raise ConnectionAbortedError("the other end of the forwarded connection was reset")
        else:
            raise RuntimeError(f"a port forward received {type(message).__name__}, not one of its messages")


async def _both_eofs(send_task: asyncio.Task, got_eof: asyncio.Event) -> None:
    await send_task
    await got_eof.wait()


async def _relay(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, send: Port,
                 receive: PortReceiver) -> None:
    """Relay one connection until both directions ended (EOF each way), or one failed (then abort both)."""
    got_eof = asyncio.Event()
    send_task = asyncio.create_task(_pump_socket(reader, send))
    receive_task = asyncio.create_task(_pump_channel(receive, writer, got_eof))
    closed_task = asyncio.create_task(_both_eofs(send_task, got_eof))
    tasks = [send_task, receive_task, closed_task]
    try:
        done, _ = await asyncio.wait((receive_task, closed_task), return_when=asyncio.FIRST_COMPLETED)
        await (receive_task if receive_task in done else closed_task)
    except asyncio.CancelledError:
        _send_abort(send)
        writer.transport.abort()
        raise
    except (ActorError, OSError, RuntimeError):
        _send_abort(send)
        writer.transport.abort()
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await _close_writer(writer)


class _Connections:
    """The relays an actor runs. ``close()`` ends them all at once, from the proc's loop thread (an actor's
    ``__cleanup__`` runs there, between the loop's steps): each connection is reset and its other end told."""

    def __init__(self) -> None:
        self._relays: dict[asyncio.Task, tuple[asyncio.StreamWriter, Port]] = {}

    def add(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, send: Port,
            receive: PortReceiver) -> None:
        task = asyncio.create_task(_relay(reader, writer, send, receive))
        self._relays[task] = (writer, send)
        task.add_done_callback(lambda t: self._relays.pop(t, None))

    def close(self) -> None:
        relays, self._relays = self._relays, {}
        for task, (writer, send) in relays.items():
            _send_abort(send)
            writer.transport.abort()
            task.cancel()


class _Destination(Actor):
    """On each destination proc: opens a connection to ``127.0.0.1:dst_port`` per forwarded connection."""

    def __init__(self) -> None:
        self._port: int | None = None
        self._connections = _Connections()

    @endpoint
    async def configure(self, dst_port: _PortSpec) -> None:
        self._port = _resolve_port("dst_port", dst_port, current_rank())

    @endpoint
    async def open(self, send: Port) -> Port:
        if self._port is None:
            raise RuntimeError("the port forward's destination is not configured")
        reader, writer = await asyncio.open_connection(_HOST, self._port)
        try:
            source_send, receive = Channel.open()
            self._connections.add(reader, writer, send, receive)
            return source_send
        except BaseException:
            await _close_writer(writer)
            raise

    def __cleanup__(self, exc: Exception | None) -> None:
        self._connections.close()


class _Source(Actor):
    """On each source proc: listens on its address; each connection it accepts is relayed to the
    destination at the same coordinates."""

    def __init__(self) -> None:
        self._destination = None
        self._connections = _Connections()
        self._server: asyncio.AbstractServer | None = None

    @endpoint
    async def start(self, destination, src_address: _AddressSpec) -> None:
        point = current_rank()
        self._destination = destination.slice(**dict(point))
        host, port = _parse_address(src_address(point) if callable(src_address) else src_address)
        self._server = await asyncio.start_server(self._accept, host, port, reuse_port=True)

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self._destination is None:
            await _close_writer(writer)
            return
        try:
            send, receive = Channel.open()
            source_send = await self._destination.open.call_one(send)
            self._connections.add(reader, writer, source_send, receive)
        except BaseException:
            await _close_writer(writer)
            raise

    def __cleanup__(self, exc: Exception | None) -> None:
        server, self._server = self._server, None
        if server is not None:
            server.close()  # (its listening sockets close at once)
        self._connections.close()


class PortForwarder(Actor):
    """An actor that owns point-to-point port forwards: spawn it (``this_proc().spawn("fwd", PortForwarder)``),
    call ``forward`` once per forward, and stop it to close every forward it started."""

    def __init__(self) -> None:
        self._forwards: list = []  # the (source, destination) actor meshes of each forward, stopped with this

    @endpoint
    async def forward(self, dst_proc_mesh: ProcMesh, dst_port: int | Callable[[Point], int],
                      src_proc_mesh: ProcMesh, src_address: str | Callable[[Point], str]) -> None:
        """Start a pointwise TCP forward: each proc of ``src_proc_mesh`` listens on ``src_address``
        (``"address:port"``, or a function of the proc's ``Point`` giving one) and forwards each connection
        to ``127.0.0.1:dst_port`` (an int, or a function of the ``Point``) on the proc of ``dst_proc_mesh`` at
        the same coordinates. The meshes must have the same dimensions and sizes.

        Fails (an ``ActorError`` at the caller, wrapping a ``ValueError``) for meshes of different shapes or an
        invalid address or port; a source that cannot listen or a destination whose port is invalid fails the
        call too, and whatever the forward had started is stopped first."""
        if dst_proc_mesh.extent != src_proc_mesh.extent:
            raise ValueError("destination and source process meshes must have the same shape: "
                             f"{dst_proc_mesh.extent} != {src_proc_mesh.extent}")
        if not callable(dst_port):
            _validate_port("dst_port", dst_port)
        if not callable(src_address):
            _parse_address(src_address)
        suffix = uuid.uuid4().hex
        source = destination = None
        try:
            source = src_proc_mesh.spawn(f"port_forward_source_{suffix}", _Source)
            destination = dst_proc_mesh.spawn(f"port_forward_destination_{suffix}", _Destination)
            await destination.configure.call(dst_port)
            await source.start.call(destination, src_address)
        except Exception as error:
            failures = await _stop_all([m for m in (source, destination) if m is not None])
            if failures:
                error.add_note("port-forward setup cleanup failed: " + "; ".join(
                    f"{type(f).__name__}: {f}" for f in failures))
            raise
        self._forwards.append((source, destination))

    async def __cleanup__(self, exc: Exception | None) -> None:
        forwards, self._forwards = self._forwards, []
        await _stop_all([mesh for pair in forwards for mesh in pair])


async def _stop_all(meshes: list) -> list[BaseException]:
    """Stop the actor meshes (sources first: they stop accepting); the failures."""
    results = await asyncio.gather(*(mesh.stop() for mesh in meshes), return_exceptions=True)
    return [r for r in results if isinstance(r, BaseException)]


def _validate_port(name: str, port: object) -> None:
    if isinstance(port, bool) or not isinstance(port, int) or not 1 <= port <= 65535:
        raise ValueError(f"{name} must be an integer from 1 through 65535, got {port!r}")


def _resolve_port(name: str, port: _PortSpec, point: Point) -> int:
    resolved = port(point) if callable(port) else port
    _validate_port(name, resolved)
    return resolved


def _parse_address(address: object) -> tuple[str, int]:
    """``"host:port"`` (``"[::1]:port"`` for IPv6) as ``(host, port)``."""
    if not isinstance(address, str):
        raise ValueError(f"src_address must resolve to a string in 'address:port' form, got {address!r}")
    host, sep, port_text = address.rpartition(":")
    if not sep or not host:
        raise ValueError(f"src_address must use 'address:port' form, got {address!r}")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    try:
        port = int(port_text)
    except ValueError:
        raise ValueError(f"src_address port must be an integer, got {address!r}") from None
    _validate_port("src_address port", port)
    return host, port
