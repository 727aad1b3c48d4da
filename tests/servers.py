"""Real uvicorn servers on loopback ports for tests: each runs its app in a thread with its own
event loop, as a separate process would."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator

import httpx
import uvicorn


@contextlib.contextmanager
def serve(app, ready_path: str | None = "/health", timeout_s: float = 120.0) -> Iterator[str]:
    """Run ``app`` on 127.0.0.1 (a free port) and yield its base URL once ``ready_path`` answers
    200 (or once the socket is bound, with ready_path None)."""
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", lifespan="on"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        base_url = _wait_bound(server, thread, timeout_s)
        if ready_path:
            _wait_ready(base_url + ready_path, timeout_s)
        yield base_url
    finally:
        server.should_exit = True
        thread.join(timeout=30)


def _wait_bound(server: uvicorn.Server, thread: threading.Thread, timeout_s: float) -> str:
    deadline = time.monotonic() + timeout_s
    while not (server.started and server.servers):
        if not thread.is_alive():
            raise RuntimeError("server thread died before binding")
        if time.monotonic() > deadline:
            raise TimeoutError("server did not start")
        time.sleep(0.01)
    port = server.servers[0].sockets[0].getsockname()[1]
    return f"http://127.0.0.1:{port}"


def _wait_ready(url: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url, timeout=5).status_code == 200:
                return
        time.sleep(0.05)
    raise TimeoutError(f"{url} never answered 200")
