"""The edge's verifier client under a failing HTTP stack. A verify call whose caller is cancelled
(its client hung up) never cancels the request inside the HTTP stack: it finishes in the
background. httpcore 1.0 can lose a pool slot for good when a
request is cancelled mid-flight (encode/httpcore#1093); the chaos run saw an edge's connections
to the verifier grow from 2 to 28 in 30 minutes, and a script that cancels half of many
contending calls left a one-connection pool answering every later call with a pool timeout (503)."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from edge_agent import verifier_client
from edge_agent.verifier_client import ClientSettings, VerifierClient
from gateway.errors import ServiceUnavailableError
from verifier_service.protocol import VerifyRequest


class HeldTransport(httpx.AsyncBaseTransport):
    """Answers each request once ``release`` is set; records whether a request was cancelled
    inside it or ran to its answer."""

    def __init__(self) -> None:
        self.entered = asyncio.Event()
        self.release = asyncio.Event()
        self.outcomes: list[str] = []

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        self.entered.set()
        try:
            await self.release.wait()
        except asyncio.CancelledError:
            self.outcomes.append("cancelled inside the transport")
            raise
        self.outcomes.append("answered")
        return httpx.Response(200, json={"ok": True})


async def cancel_mid_request() -> list[str]:
    transport = HeldTransport()
    client = VerifierClient("http://verifier", ClientSettings(retries=0), transport=transport)
    request = VerifyRequest(session_id="s", prefix_length=0, prefix_digest="", new_tokens=[1, 2, 3], draft_tokens=[4])
    caller = asyncio.create_task(client.post_verify(request))
    await transport.entered.wait()
    caller.cancel()
    await asyncio.gather(caller, return_exceptions=True)
    assert caller.cancelled()  # the caller itself stops at once
    transport.release.set()
    await client.aclose()  # waits for what runs in the background
    return transport.outcomes


def test_a_cancelled_caller_leaves_its_verify_request_to_finish():
    assert asyncio.run(cancel_mid_request()) == ["answered"]


class BrokenOnceTransport(httpx.AsyncBaseTransport):
    """Fails its first request the way httpcore over anyio did when nginx restarted under a
    chaos run (the socket gone as it connects: an AttributeError, not a transport error), then
    answers."""

    def __init__(self) -> None:
        self.calls = 0

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        self.calls += 1
        if self.calls == 1:
            raise AttributeError("'NoneType' object has no attribute 'getpeername'")
        return httpx.Response(200, json={"ok": True})


async def call_through(transport: httpx.AsyncBaseTransport) -> int:
    client = VerifierClient("http://verifier", ClientSettings(retries=1, backoff_s=0.0), transport=transport)
    request = VerifyRequest(session_id="s", prefix_length=0, prefix_digest="", new_tokens=[1, 2, 3], draft_tokens=[4])
    try:
        return (await client.post_verify(request))[0].status_code
    finally:
        await client.aclose()


def test_a_connection_lost_inside_the_http_stack_is_retried_like_any_lost_call():
    # It reached a client as an HTTP 500 ("internal error: AttributeError") once in a 30-minute run.
    assert asyncio.run(call_through(BrokenOnceTransport())) == 200


class OutageTransport(httpx.AsyncBaseTransport):
    """Refuses connections while ``down``, else answers."""

    def __init__(self) -> None:
        self.down = True
        self.calls = 0

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        self.calls += 1
        if self.down:
            raise httpx.ConnectError("connection refused")
        return httpx.Response(200, json={"ok": True})


def test_the_circuit_opens_briefly_then_for_longer_while_the_verifier_stays_down(monkeypatch):
    """A blip costs half a second of fast failures; a verifier that stays down is tried at
    0.5, 1, 2, 4, 4 s intervals; an answer starts the count again."""
    clock = [100.0]
    monkeypatch.setattr(verifier_client.time, "monotonic", lambda: clock[0])
    transport = OutageTransport()
    request = VerifyRequest(session_id="s", prefix_length=0, prefix_digest="", new_tokens=[1, 2, 3], draft_tokens=[4])

    async def scenario() -> list[float]:
        client = VerifierClient("http://verifier", ClientSettings(retries=0, circuit_open_s=4.0), transport=transport)
        open_for = []
        for _ in range(5):
            with pytest.raises(ServiceUnavailableError):
                await client.post_verify(request)
            calls = transport.calls
            with pytest.raises(ServiceUnavailableError):
                await client.post_verify(request)  # the circuit is open: failed without a call
            assert transport.calls == calls
            open_for.append(client._unreachable_until - clock[0])
            clock[0] = client._unreachable_until
        transport.down = False
        assert (await client.post_verify(request))[0].status_code == 200
        transport.down = True
        with pytest.raises(ServiceUnavailableError):
            await client.post_verify(request)
        open_for.append(client._unreachable_until - clock[0])
        await client.aclose()
        return open_for

    assert asyncio.run(scenario()) == [0.5, 1.0, 2.0, 4.0, 4.0, 0.5]
