"""How generations end when their client or the service goes away: a client that drops a
non-streamed request stops its generation (on the edge and on the verifier's own route), and
SIGTERM lets streams finish within the grace period, then ends the others with an error event
and [DONE]. The SIGTERM tests run the edge as a real process (``python -m edge_agent.cli``)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from edge_support import DONE, edge_app, metric_value, sse_payloads, verifier_app
from servers import serve, wait_until
from spade_bench.proxy import LinkConfig, ProxyThread

XDIST_HEAVY = True
"""Real service processes, started and signalled: queued first (conftest.py)."""

MAX_TOKENS = 1500
ROOT = Path(__file__).resolve().parents[1]


def _send_then_drop(url: str, path: str, body: dict, running: callable) -> None:
    """POST a non-streamed request on a raw socket and close it once ``running()`` holds."""
    port = int(url.rsplit(":", 1)[1])
    payload = json.dumps(body).encode()
    head = f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nContent-Length: {len(payload)}\r\n\r\n"
    with socket.create_connection(("127.0.0.1", port), timeout=60) as connection:
        connection.sendall(head.encode() + payload)
        assert wait_until(running)


def _settled(read: callable) -> float:
    """The value of a counter once it stops moving (two reads 0.5 s apart agree)."""
    previous = read()
    while True:
        time.sleep(0.5)
        current = read()
        if current == previous:
            return current
        previous = current


def test_a_dropped_non_streamed_edge_request_stops_generating(tiny_pair):
    with serve(verifier_app(tiny_pair)) as verifier_url, serve(edge_app(tiny_pair, verifier_url)) as edge_url:
        calls = lambda: metric_value(verifier_url, "spade_verifier_verify_calls_total")  # noqa: E731
        before = calls()
        body = {"model": "target", "prompt": "The edge drafts", "max_tokens": MAX_TOKENS, "temperature": 0}
        _send_then_drop(edge_url, "/v1/completions", body, lambda: calls() > before + 3)
        assert wait_until(lambda: metric_value(edge_url, "spade_edge_active_requests") == 0)
        made = _settled(calls) - before
        generated = metric_value(edge_url, "spade_edge_generated_tokens_total")
    # 1500 tokens need at least 375 verify calls of 3 drafted + 1; the generation stopped long before.
    assert (made < MAX_TOKENS / 4, generated < MAX_TOKENS) == (True, True)


def test_a_dropped_non_streamed_verifier_request_stops_generating(tiny_pair):
    with serve(verifier_app(tiny_pair)) as verifier_url:
        passes = lambda: metric_value(verifier_url, "spade_verifier_forward_passes_total")  # noqa: E731
        before = passes()
        body = {"model": "target", "prompt": "The edge drafts", "max_tokens": MAX_TOKENS, "temperature": 0}
        _send_then_drop(verifier_url, "/v1/completions", body, lambda: passes() > before + 3)
        made = _settled(passes) - before
    assert made < MAX_TOKENS


# --- SIGTERM -----------------------------------------------------------------------------------

GRACE_S = 1.5


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.fixture
def edge_process(tiny_pair):
    """The edge as its own process, in front of a verifier 100 ms of RTT away (so a long stream
    takes many seconds)."""
    with serve(verifier_app(tiny_pair)) as verifier_url:
        upstream_port = int(verifier_url.rsplit(":", 1)[1])
        with ProxyThread("127.0.0.1", upstream_port, LinkConfig(rtt_ms=100)) as proxy:
            port = _free_port()
            command = [
                sys.executable,
                "-m",
                "edge_agent.cli",
                "--draft-model",
                str(tiny_pair.draft_dir),
                "--verifier-url",
                f"http://127.0.0.1:{proxy.port}",
                "--port",
                str(port),
                "--draft-length",
                "3",
                "--shutdown-grace-s",
                str(GRACE_S),
                "--log-level",
                "warning",
            ]
            environment = os.environ | {"HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}
            process = subprocess.Popen(command, cwd=ROOT, env=environment)
            try:
                url = f"http://127.0.0.1:{port}"
                assert wait_until(lambda: _is_up(url), timeout_s=120)
                yield process, url
            finally:
                if process.poll() is None:
                    process.kill()
                process.wait(timeout=30)


def _is_up(url: str) -> bool:
    try:
        return httpx.get(url + "/health", timeout=5).status_code == 200
    except httpx.HTTPError:
        return False


class StreamReader(threading.Thread):
    """Reads one streamed completion into ``payloads``."""

    def __init__(self, url: str, max_tokens: int) -> None:
        super().__init__(daemon=True)
        self.url, self.max_tokens = url, max_tokens
        self.payloads: list[str] = []

    def run(self) -> None:
        body = {"model": "target", "prompt": "The edge drafts", "max_tokens": self.max_tokens, "temperature": 0, "stream": True}
        with httpx.stream("POST", self.url + "/v1/completions", json=body, timeout=120) as response:
            for line in response.iter_lines():
                self.payloads += sse_payloads([line])


def _finish_reason(payload: str) -> str | None:
    return None if payload == DONE else json.loads(payload)["choices"][0]["finish_reason"]


def test_sigterm_lets_short_streams_finish_and_ends_long_ones_with_an_error_then_done(edge_process):
    process, url = edge_process
    short, long = StreamReader(url, 6), StreamReader(url, MAX_TOKENS)
    long.start()
    assert wait_until(lambda: len(long.payloads) >= 2)
    short.start()
    assert wait_until(lambda: len(short.payloads) >= 1)
    received_at_signal = len(long.payloads)
    process.send_signal(signal.SIGTERM)
    short.join(timeout=60)
    long.join(timeout=60)
    error = json.loads(long.payloads[-2])["error"]
    assert (short.payloads[-1], _finish_reason(short.payloads[-2])) == (DONE, "length")
    assert (long.payloads[-1], error["type"], error["code"]) == (DONE, "service_unavailable_error", "shutting_down")
    assert len(long.payloads) > received_at_signal + 2  # the long stream kept going during the grace period
    assert process.wait(timeout=60) in (0, -signal.SIGTERM)
