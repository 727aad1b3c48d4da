"""The edge's verifier client under a failing HTTP stack. A verify call whose caller is cancelled
(its client hung up) never cancels the request inside the HTTP stack: it finishes in the
background. httpcore 1.0 can lose a pool slot for good when a
request is cancelled mid-flight (encode/httpcore#1093); the chaos run saw an edge's connections
to the verifier grow from 2 to 28 in 30 minutes, and a script that cancels half of many
contending calls left a one-connection pool answering every later call with a pool timeout (503)."""

from __future__ import annotations

import asyncio

import httpx

from edge_agent.verifier_client import ClientSettings, VerifierClient
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
