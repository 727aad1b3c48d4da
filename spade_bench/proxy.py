"""A loopback TCP delay proxy: the emulated network between the edge and the cloud.

Every byte that crosses the proxy is held back by half the round-trip time in its direction
(plus jitter), after waiting its turn on a link of limited bandwidth. Bytes are counted each way.

Glossary:
    up      client -> upstream (edge -> cloud: prompts, drafted blocks)
    down    upstream -> client (cloud -> edge: verdicts, streamed tokens)
    due     the loop time at which a chunk is written out on the far side

Worked example, ``rtt_ms=100``, no jitter, 8 Mbit/s: a 1,000-byte chunk read at t=0 occupies the
up link for 1 ms (8,000 bits / 8 Mbit/s) and is written upstream at t = 0.001 + 0.050. A reply
read at t=0.060 is written back to the client at t >= 0.110. A request therefore costs at least
one RTT; a new connection costs one more (the TCP handshake, see ``LinkConfig.handshake``).

Chunks of one connection leave in the order they arrived (TCP is in-order), so jitter can delay
a chunk but never reorder it. The bandwidth is shared by every connection going the same way.

Use it in-process (``DelayProxy`` inside a running loop, or ``ProxyThread`` from synchronous
code) or as a command: ``python -m spade_bench.proxy --upstream 127.0.0.1:8001 --rtt-ms 50``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import random
import threading
from dataclasses import dataclass, field

logger = logging.getLogger(__name__)

READ_SIZE = 65536


@dataclass(frozen=True)
class LinkConfig:
    """The emulated link's properties; replace the proxy's config to change them live."""

    rtt_ms: float = 0.0
    """Round-trip time: each direction adds half of it."""
    jitter_ms: float = 0.0
    """Each chunk's one-way delay varies uniformly within +/- this much (never below zero)."""
    bandwidth_mbps: float | None = None
    """Link capacity per direction in Mbit/s; None is unlimited."""
    handshake: bool = True
    """A new connection's first bytes wait one RTT more (the TCP three-way handshake)."""
    down: bool = False
    """The link is cut: a new connection is closed at once, an open one is dropped as soon as a
    byte crosses it in either direction (the chaos run's "link dropped for seconds")."""

    def __post_init__(self) -> None:
        if self.rtt_ms < 0 or self.jitter_ms < 0:
            raise ValueError("rtt_ms and jitter_ms must be >= 0")
        if self.bandwidth_mbps is not None and self.bandwidth_mbps <= 0:
            raise ValueError("bandwidth_mbps must be positive (or None for unlimited)")

    @property
    def one_way_s(self) -> float:
        return self.rtt_ms / 2000.0

    def transmit_s(self, num_bytes: int) -> float:
        """Seconds the link is busy sending ``num_bytes``."""
        if self.bandwidth_mbps is None:
            return 0.0
        return num_bytes * 8 / (self.bandwidth_mbps * 1e6)


@dataclass(frozen=True)
class LinkCounters:
    """Totals since the proxy started; subtract two snapshots for one request's share."""

    bytes_up: int = 0
    bytes_down: int = 0
    connections: int = 0

    def __sub__(self, other: LinkCounters) -> LinkCounters:
        return LinkCounters(
            self.bytes_up - other.bytes_up,
            self.bytes_down - other.bytes_down,
            self.connections - other.connections,
        )


@dataclass
class _Direction:
    """One direction of the link, shared by all connections: its queue and its byte count."""

    num_bytes: int = 0
    free_at: float = 0.0
    """Loop time when the link has finished sending what was queued before."""

    def schedule(self, now: float, num_bytes: int, link: LinkConfig, jitter: float) -> float:
        """Account ``num_bytes`` read at ``now``; return when they may leave the far side."""
        self.num_bytes += num_bytes
        start = max(now, self.free_at)
        self.free_at = start + link.transmit_s(num_bytes)
        return self.free_at + max(0.0, link.one_way_s + jitter)


@dataclass
class _Pipe:
    """One direction of one connection: chunks in flight, in order."""

    direction: _Direction
    not_before: float
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    last_due: float = 0.0


class DelayProxy:
    """Accepts on ``host:port`` and relays every connection to ``upstream`` through the link."""

    def __init__(
        self, upstream_host: str, upstream_port: int, link: LinkConfig = LinkConfig(), host: str = "127.0.0.1", port: int = 0, seed: int = 0
    ) -> None:
        self.upstream = (upstream_host, upstream_port)
        self.listen = (host, port)
        self.link = link
        self._rng = random.Random(seed)
        self._up = _Direction()
        self._down = _Direction()
        self._num_connections = 0
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task] = set()

    @property
    def port(self) -> int:
        if self._server is None:
            raise ValueError("proxy not started")
        return self._server.sockets[0].getsockname()[1]

    def counters(self) -> LinkCounters:
        return LinkCounters(self._up.num_bytes, self._down.num_bytes, self._num_connections)

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._accept, *self.listen)

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _accept(self, client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        if task is None:  # asyncio runs each connection's callback in a task of its own
            raise RuntimeError("a proxy connection outside a task")
        self._tasks.add(task)
        try:
            await self._relay(client_reader, client_writer)
        except asyncio.CancelledError:
            pass  # the proxy is closing; ending quietly keeps asyncio from logging the cancel
        finally:
            self._tasks.discard(task)

    async def _relay(self, client_reader, client_writer) -> None:
        self._num_connections += 1
        if self.link.down:
            client_writer.close()
            return
        loop = asyncio.get_running_loop()
        not_before = loop.time() + (self.link.rtt_ms / 1000.0 if self.link.handshake else 0.0)
        try:
            upstream_reader, upstream_writer = await asyncio.open_connection(*self.upstream)
        except OSError as error:
            logger.warning("upstream %s:%d unreachable: %s", *self.upstream, error)
            client_writer.close()
            return
        up = _Pipe(self._up, not_before)
        down = _Pipe(self._down, not_before)
        workers = [
            asyncio.create_task(self._read(client_reader, up)),
            asyncio.create_task(self._write(up, upstream_writer)),
            asyncio.create_task(self._read(upstream_reader, down)),
            asyncio.create_task(self._write(down, client_writer)),
        ]
        try:
            await asyncio.gather(*workers)
        except (OSError, asyncio.IncompleteReadError):
            pass  # one side reset the connection: drop the other side too
        finally:
            for worker in workers:
                worker.cancel()
            await asyncio.gather(*workers, return_exceptions=True)
            for writer in (client_writer, upstream_writer):
                writer.close()

    async def _read(self, reader: asyncio.StreamReader, pipe: _Pipe) -> None:
        loop = asyncio.get_running_loop()
        while True:
            data = await reader.read(READ_SIZE)
            if self.link.down:
                raise ConnectionResetError("the emulated link is down")
            jitter = self._rng.uniform(-1.0, 1.0) * self.link.jitter_ms / 1000.0
            due = pipe.direction.schedule(max(loop.time(), pipe.not_before), len(data), self.link, jitter)
            pipe.last_due = max(pipe.last_due, due)  # in order: never before the previous chunk
            await pipe.queue.put((pipe.last_due, data))
            if not data:
                return

    @staticmethod
    async def _write(pipe: _Pipe, writer: asyncio.StreamWriter) -> None:
        loop = asyncio.get_running_loop()
        while True:
            due, data = await pipe.queue.get()
            await asyncio.sleep(max(0.0, due - loop.time()))
            if not data:
                if writer.can_write_eof():
                    writer.write_eof()
                return
            writer.write(data)
            await writer.drain()


class ProxyThread:
    """A ``DelayProxy`` on its own event loop in a daemon thread, for synchronous callers.

    >>> with ProxyThread("127.0.0.1", 8001, LinkConfig(rtt_ms=50)) as proxy:
    ...     url = f"http://127.0.0.1:{proxy.port}"
    """

    def __init__(self, upstream_host: str, upstream_port: int, link: LinkConfig = LinkConfig(), seed: int = 0) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="delay-proxy", daemon=True)
        self.proxy = DelayProxy(upstream_host, upstream_port, link, seed=seed)

    @property
    def port(self) -> int:
        return self.proxy.port

    @property
    def link(self) -> LinkConfig:
        return self.proxy.link

    def set_link(self, link: LinkConfig) -> None:
        """Takes effect for every chunk read from now on, on open connections too."""
        self.proxy.link = link

    def counters(self) -> LinkCounters:
        return self.proxy.counters()

    def start(self) -> ProxyThread:
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self.proxy.start(), self._loop).result(timeout=30)
        return self

    def close(self) -> None:
        if not self._thread.is_alive():
            return
        with contextlib.suppress(Exception):
            asyncio.run_coroutine_threadsafe(self.proxy.close(), self._loop).result(timeout=30)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=30)
        self._loop.close()

    def __enter__(self) -> ProxyThread:
        return self.start()

    def __exit__(self, *exc_info) -> None:
        self.close()


def parse_host_port(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"expected HOST:PORT, got {text!r}")
    return host, int(port)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m spade_bench.proxy", description=__doc__.split("\n")[0])
    parser.add_argument("--upstream", required=True, help="HOST:PORT to relay to")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (loopback)")
    parser.add_argument("--port", type=int, default=0, help="port to listen on (0: any free port)")
    parser.add_argument("--rtt-ms", type=float, default=0.0)
    parser.add_argument("--jitter-ms", type=float, default=0.0)
    parser.add_argument("--bandwidth-mbps", type=float, default=None)
    parser.add_argument("--no-handshake", action="store_true", help="no extra RTT for a new connection")
    parser.add_argument("--seed", type=int, default=0, help="seeds the jitter")
    return parser


async def serve(args: argparse.Namespace) -> None:
    link = LinkConfig(args.rtt_ms, args.jitter_ms, args.bandwidth_mbps, not args.no_handshake)
    proxy = DelayProxy(*parse_host_port(args.upstream), link, host=args.host, port=args.port, seed=args.seed)
    await proxy.start()
    print(f"delay proxy on {args.host}:{proxy.port} -> {args.upstream} ({link})", flush=True)
    try:
        await asyncio.Event().wait()
    finally:
        counters = proxy.counters()
        print(f"bytes up {counters.bytes_up}, down {counters.bytes_down}, connections {counters.connections}")
        await proxy.close()


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(serve(args))


if __name__ == "__main__":
    main()
