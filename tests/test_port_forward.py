"""``PortForwarder`` (Monarch's ``monarch.job.PortForwarder``, its tests' behaviours: python/tests/test_port_forward.py):
real TCP connections forwarded between two procs of one shared mesh."""

import asyncio
import socket

import pytest

from monarch_tensor.actor import ActorError, this_host, this_proc
from monarch_tensor.job import PortForwarder

H = "127.0.0.1"
T = 30


@pytest.fixture(scope="module")
def procs():
    m = this_host().spawn_procs(per_host={"procs": 2})
    yield m
    m.stop().get(timeout=30)


def _unused_ports(count: int) -> list[int]:
    socks = [socket.socket() for _ in range(count)]
    try:
        for s in socks:
            s.bind((H, 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _bindable(port: int) -> bool:
    with socket.socket() as probe:
        try:
            probe.bind((H, port))
            return True
        except OSError:
            return False


async def _echo(reader, writer) -> None:
    try:
        while data := await reader.read(64 * 1024):
            writer.write(data)
            await writer.drain()
    finally:
        writer.close()


async def _round_trip(port: int, payload: bytes) -> bytes:
    reader, writer = await asyncio.open_connection(H, port)
    try:
        writer.write(payload)
        writer.write_eof()
        await writer.drain()
        response = await asyncio.wait_for(reader.readexactly(len(payload)), T)
        assert await asyncio.wait_for(reader.read(), T) == b""  # the server's EOF came through
        return response
    finally:
        writer.close()


async def _forward(procs, dst_port, src_address, sliced=True):
    forwarder = this_proc().spawn("port_forwarder", PortForwarder)
    dst, src = (procs.slice(procs=0), procs.slice(procs=1)) if sliced else (procs, procs)
    await asyncio.wait_for(forwarder.forward.call_one(dst, dst_port, src, src_address), T)
    return forwarder


def test_round_trip_two_forwards_and_stop(procs):
    async def main():
        server = await asyncio.start_server(_echo, H, 0)
        dst_port = server.sockets[0].getsockname()[1]
        src_ports = _unused_ports(2)
        forwarder = this_proc().spawn("port_forwarder", PortForwarder)
        try:
            for p in src_ports:
                await asyncio.wait_for(forwarder.forward.call_one(
                    procs.slice(procs=0), dst_port, procs.slice(procs=1), f"{H}:{p}"), T)
            payload = bytes(range(256)) * 1024
            assert await _round_trip(src_ports[0], payload) == payload
            assert await _round_trip(src_ports[1], b"hello") == b"hello"
            await forwarder.stop()
            await forwarder.stop()  # (a second stop is a no-op)
            for p in src_ports:
                with pytest.raises(OSError):
                    await asyncio.open_connection(H, p)
        finally:
            server.close()

    asyncio.run(main())


def test_setup_failure_fails_the_call_and_stops_what_it_started(procs):
    """One source cannot listen (its port is taken): the call fails, and the other source's listener is gone."""

    async def main():
        dst_port, *src_ports = _unused_ports(3)
        blocker = socket.socket()
        blocker.bind((H, src_ports[1]))
        blocker.listen()
        forwarder = this_proc().spawn("port_forwarder", PortForwarder)
        try:
            with pytest.raises(ActorError):
                await asyncio.wait_for(forwarder.forward.call_one(
                    procs, dst_port, procs, lambda point: f"{H}:{src_ports[point['procs']]}"), T)
        finally:
            blocker.close()
            await forwarder.stop()
        assert all(_bindable(p) for p in src_ports)

    asyncio.run(main())


def test_invalid_destination_port_of_one_rank_fails_the_call(procs):
    async def main():
        dst_port, *src_ports = _unused_ports(3)
        forwarder = this_proc().spawn("port_forwarder", PortForwarder)
        try:
            with pytest.raises(ActorError, match="dst_port must be an integer from 1 through 65535"):
                await asyncio.wait_for(forwarder.forward.call_one(
                    procs, lambda point: dst_port if point["procs"] == 0 else 0,
                    procs, lambda point: f"{H}:{src_ports[point['procs']]}"), T)
        finally:
            await forwarder.stop()
        assert all(_bindable(p) for p in src_ports)

    asyncio.run(main())


def test_meshes_of_different_shapes_and_bad_addresses_are_refused(procs):
    async def main():
        forwarder = this_proc().spawn("port_forwarder", PortForwarder)
        try:
            with pytest.raises(ActorError, match="must have the same shape"):
                await forwarder.forward.call_one(procs, 1234, procs.slice(procs=0), f"{H}:5678")
            with pytest.raises(ActorError, match="'address:port' form"):
                await forwarder.forward.call_one(procs, 1234, procs, "5678")
            with pytest.raises(ActorError, match="from 1 through 65535"):
                await forwarder.forward.call_one(procs, 70000, procs, f"{H}:5678")
        finally:
            await forwarder.stop()

    asyncio.run(main())


def test_each_rank_reaches_its_own_destination_and_a_shared_source_address(procs):
    """Per-rank functions pick each rank's ports; concurrent connections go to the rank that accepted them.
    Then both ranks listen on one shared address (SO_REUSEPORT), each connection echoed whole."""

    async def main():
        async def identify(rank, _reader, writer):
            writer.write(bytes([rank]))
            await writer.drain()
            writer.close()

        servers = [await asyncio.start_server(lambda r, w, rank=rank: identify(rank, r, w), H, 0) for rank in (0, 1)]
        echo = await asyncio.start_server(_echo, H, 0)
        dst_ports = [s.sockets[0].getsockname()[1] for s in servers]
        src_ports = _unused_ports(3)
        f1 = await _forward(procs, lambda p: dst_ports[p["procs"]], lambda p: f"{H}:{src_ports[p['procs']]}", False)
        f2 = await _forward(procs, echo.sockets[0].getsockname()[1], f"{H}:{src_ports[2]}", False)
        try:
            async def read_identity(port):
                reader, writer = await asyncio.open_connection(H, port)
                try:
                    return await asyncio.wait_for(reader.readexactly(1), T)
                finally:
                    writer.close()

            got = await asyncio.gather(*(read_identity(src_ports[r]) for r in (0, 1) for _ in range(3)))
            assert got == [b"\x00"] * 3 + [b"\x01"] * 3
            payloads = [bytes([i]) * (64 * 1024) for i in range(1, 7)]
            assert await asyncio.gather(*(_round_trip(src_ports[2], p) for p in payloads)) == payloads
        finally:
            await f1.stop()
            await f2.stop()
            for s in (*servers, echo):
                s.close()

    asyncio.run(main())


def test_slow_reader_gets_every_byte_and_a_reset_reaches_the_destination(procs):
    async def main():
        received = asyncio.get_running_loop().create_future()
        connected, disconnected = asyncio.Event(), asyncio.Event()

        async def slow_sink(reader, writer):
            total = 0
            while data := await reader.read(64 * 1024):
                total += len(data)
                await asyncio.sleep(0.001)
            received.set_result(total)
            writer.close()

        async def stream(_reader, writer):
            connected.set()
            try:
                while True:
                    writer.write(b"x" * (64 * 1024))
                    await writer.drain()
            except OSError:
                pass
            finally:
                writer.close()
                disconnected.set()

        sink, streamer = await asyncio.start_server(slow_sink, H, 0), await asyncio.start_server(stream, H, 0)
        p1, p2 = _unused_ports(2)
        f1 = await _forward(procs, sink.sockets[0].getsockname()[1], f"{H}:{p1}")
        f2 = await _forward(procs, streamer.sockets[0].getsockname()[1], f"{H}:{p2}")
        try:
            reader, writer = await asyncio.open_connection(H, p1)
            size = 4 * 1024 * 1024
            writer.write(b"x" * size)
            writer.write_eof()
            await writer.drain()
            assert await asyncio.wait_for(received, T) == size
            assert await asyncio.wait_for(reader.read(), T) == b""
            writer.close()

            _reader, writer = await asyncio.open_connection(H, p2)
            await asyncio.wait_for(connected.wait(), T)
            writer.transport.abort()  # a reset at the source ends the destination's connection
            await asyncio.wait_for(disconnected.wait(), T)
        finally:
            await f1.stop()
            await f2.stop()
            sink.close()
            streamer.close()

    asyncio.run(main())


def test_stop_with_a_connection_whose_destination_does_not_read(procs):
    async def main():
        connected, release = asyncio.Event(), asyncio.Event()

        async def do_not_read(_reader, writer):
            writer.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1024)
            connected.set()
            await release.wait()
            writer.close()

        server = await asyncio.start_server(do_not_read, H, 0)
        (src_port,) = _unused_ports(1)
        forwarder = await _forward(procs, server.sockets[0].getsockname()[1], f"{H}:{src_port}")
        reader, writer = await asyncio.open_connection(H, src_port)
        try:
            await asyncio.wait_for(connected.wait(), T)
            writer.write(b"x" * (4 * 1024 * 1024))
            await asyncio.sleep(0.3)
            await asyncio.wait_for(forwarder.stop(), T)  # returns though a relay is blocked writing
            with pytest.raises(OSError):  # no longer listening
                await asyncio.open_connection(H, src_port)
            try:  # and the forwarded connection was closed: EOF, or a reset
                assert await asyncio.wait_for(reader.read(), T) == b""
            except ConnectionResetError:
                pass
        finally:
            release.set()
            writer.transport.abort()
            server.close()

    asyncio.run(main())
