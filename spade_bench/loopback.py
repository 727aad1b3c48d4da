"""Real uvicorn servers on loopback ports, for tests and the chaos run's fault proxies: each runs
its app in a thread with its own event loop, as a separate process would."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator

import httpx
import uvicorn


class LoopbackServer:
    """A uvicorn server on 127.0.0.1 that a test can stop mid-request, then start again (with a
    new app) on the same port: an outage and its recovery at one URL."""

    def __init__(self) -> None:
        self.port = 0
        self._server: uvicorn.Server | None = None
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, app, ready_path: str | None = "/health", timeout_s: float = 120.0) -> str:
        """Serve ``app`` (on a free port the first time) and return the base URL once
        ``ready_path`` answers 200 (or once the socket is bound, with ready_path None)."""
        config = uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning", lifespan="on")
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, daemon=True)
        self._thread.start()
        self.port = _wait_bound(self._server, self._thread, timeout_s)
        if ready_path:
            _wait_ready(self.url + ready_path, timeout_s)
        return self.url

    def stop(self, force: bool = False) -> None:
        """Stop serving. ``force``: drop open connections at once, as a crashed or killed
        process would, instead of waiting for their responses to finish (a long-lived SSE stream
        never does: uvicorn waits for it, and sse-starlette's drain hears only signals, which a
        server in a thread does not get)."""
        if self._server is not None:
            self._server.force_exit = force
            self._server.should_exit = True
            if self._thread is not None:
                self._thread.join(timeout=30)
            self._server = self._thread = None


@contextlib.contextmanager
def serve(app, ready_path: str | None = "/health", timeout_s: float = 120.0) -> Iterator[str]:
    """Run ``app`` on a free loopback port for the duration of the block; yield its base URL."""
    server = LoopbackServer()
    try:
        yield server.start(app, ready_path, timeout_s)
    finally:
        server.stop()


def _wait_bound(server: uvicorn.Server, thread: threading.Thread, timeout_s: float) -> int:
    deadline = time.monotonic() + timeout_s
    while not (server.started and server.servers):
        if not thread.is_alive():
            raise RuntimeError("server thread died before binding")
        if time.monotonic() > deadline:
            raise TimeoutError("server did not start")
        time.sleep(0.01)
    return server.servers[0].sockets[0].getsockname()[1]


def _wait_ready(url: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url, timeout=5).status_code == 200:
                return
        time.sleep(0.05)
    raise TimeoutError(f"{url} never answered 200")


def wait_until(condition: Callable[[], bool], timeout_s: float = 60.0, interval_s: float = 0.02) -> bool:
    """Poll ``condition`` until it holds or ``timeout_s`` passes (a bound on waiting, not a speed
    requirement); returns its last value."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            return condition()
        time.sleep(interval_s)
    return True
