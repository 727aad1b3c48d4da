"""The benchmark's delay proxy: delays each direction by half the RTT, counts bytes, caps bandwidth.

Timing assertions here are lower bounds only (a delay proxy must delay at least this much);
nothing asserts that anything is fast.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time

import pytest

from spade_bench.proxy import DelayProxy, LinkConfig, LinkCounters, ProxyThread, parse_host_port


async def _echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    while data := await reader.read(65536):
        writer.write(data)
        await writer.drain()
    writer.close()


@contextlib.asynccontextmanager
async def _linked(link: LinkConfig):
    """An echo server behind a proxy with ``link``; yields the proxy and a client connection."""
    server = await asyncio.start_server(_echo, "127.0.0.1", 0)
    proxy = DelayProxy("127.0.0.1", server.sockets[0].getsockname()[1], link)
    await proxy.start()
    reader, writer = await asyncio.open_connection("127.0.0.1", proxy.port)
    try:
        yield proxy, reader, writer
    finally:
        writer.close()
        await proxy.close()
        server.close()


async def _round_trip(reader, writer, payload: bytes) -> bytes:
    writer.write(payload)
    await writer.drain()
    return await reader.readexactly(len(payload))


async def test_relays_bytes_unchanged_and_counts_them_each_way():
    payloads = [b"hello", b"x" * 100_000, bytes(range(256))]
    async with _linked(LinkConfig()) as (proxy, reader, writer):
        for payload in payloads:
            assert await _round_trip(reader, writer, payload) == payload
        total = sum(len(payload) for payload in payloads)
        assert proxy.counters() == LinkCounters(bytes_up=total, bytes_down=total, connections=1)


async def test_round_trip_takes_at_least_the_rtt_plus_handshake():
    async with _linked(LinkConfig(rtt_ms=80)) as (_, reader, writer):
        started = time.perf_counter()
        await _round_trip(reader, writer, b"ping")
        first = time.perf_counter() - started
        started = time.perf_counter()
        await _round_trip(reader, writer, b"ping")
        second = time.perf_counter() - started
    assert first >= 0.160  # handshake RTT + request RTT on a new connection
    assert second >= 0.080  # one RTT on an open connection


async def test_jitter_never_reorders_chunks():
    async with _linked(LinkConfig(rtt_ms=10, jitter_ms=10, handshake=False)) as (_, reader, writer):
        sent = b""
        for index in range(50):
            chunk = f"[{index}]".encode()
            writer.write(chunk)
            await writer.drain()
            sent += chunk
            await asyncio.sleep(0.001)
        assert await reader.readexactly(len(sent)) == sent


async def test_bandwidth_cap_serialises_bytes():
    link = LinkConfig(bandwidth_mbps=4.0, handshake=False)
    assert link.transmit_s(200_000) == pytest.approx(0.4)  # 1.6 Mbit at 4 Mbit/s
    async with _linked(link) as (_, reader, writer):
        started = time.perf_counter()
        await _round_trip(reader, writer, b"z" * 200_000)
        elapsed = time.perf_counter() - started
    # The echo overlaps the two directions (chunks stream through), so the bound is one direction.
    assert elapsed >= 0.4 * 0.99


async def test_link_change_applies_to_open_connections():
    async with _linked(LinkConfig()) as (proxy, reader, writer):
        await _round_trip(reader, writer, b"a")
        proxy.link = LinkConfig(rtt_ms=100)
        started = time.perf_counter()
        await _round_trip(reader, writer, b"b")
        assert time.perf_counter() - started >= 0.100


async def test_a_link_that_goes_down_drops_open_connections_and_refuses_new_ones_until_it_is_back():
    async with _linked(LinkConfig()) as (proxy, reader, writer):
        assert await _round_trip(reader, writer, b"before") == b"before"
        proxy.link = LinkConfig(down=True)
        writer.write(b"during")
        await writer.drain()
        assert await reader.read() == b""  # dropped: nothing of "during" came back
        refused_reader, refused_writer = await asyncio.open_connection("127.0.0.1", proxy.port)
        assert await refused_reader.read() == b""
        refused_writer.close()
        proxy.link = LinkConfig()
        back_reader, back_writer = await asyncio.open_connection("127.0.0.1", proxy.port)
        assert await _round_trip(back_reader, back_writer, b"after") == b"after"
        back_writer.close()


async def test_unreachable_upstream_closes_the_client():
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        dead_port = probe.getsockname()[1]
    proxy = DelayProxy("127.0.0.1", dead_port, LinkConfig())
    await proxy.start()
    reader, writer = await asyncio.open_connection("127.0.0.1", proxy.port)
    writer.write(b"anyone?")
    assert await reader.read() == b""
    writer.close()
    await proxy.close()


def test_proxy_thread_serves_synchronous_callers():
    with socket.create_server(("127.0.0.1", 0)) as upstream:
        with ProxyThread("127.0.0.1", upstream.getsockname()[1], LinkConfig(rtt_ms=20)) as proxy:
            with socket.create_connection(("127.0.0.1", proxy.port)) as client:
                connection, _ = upstream.accept()
                with connection:
                    client.sendall(b"up-bytes")
                    assert _recv_exactly(connection, 8) == b"up-bytes"
                    connection.sendall(b"down")
                    assert _recv_exactly(client, 4) == b"down"
            assert proxy.counters().bytes_up == 8
            assert proxy.counters().bytes_down == 4


def _recv_exactly(sock: socket.socket, size: int) -> bytes:
    data = b""
    while len(data) < size:
        data += sock.recv(size - len(data))
    return data


@pytest.mark.parametrize("kwargs", [{"rtt_ms": -1}, {"jitter_ms": -0.5}, {"bandwidth_mbps": 0}])
def test_link_config_rejects_impossible_values(kwargs):
    with pytest.raises(ValueError):
        LinkConfig(**kwargs)


def test_parse_host_port():
    assert parse_host_port("127.0.0.1:8001") == ("127.0.0.1", 8001)
    with pytest.raises(ValueError):
        parse_host_port("8001")
