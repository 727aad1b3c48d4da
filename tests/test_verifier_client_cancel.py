"""A verify call whose caller is cancelled (its client hung up) never cancels the request inside
the HTTP stack: it finishes in the background. httpcore 1.0 can lose a pool slot for good when a
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
