"""The wire version: an edge serves only a verifier of its own (docs/design.md, "The verify wire and its version").

Specification:
- The verifier's /health carries ``wire_version`` (``WIRE_VERSION``: 1 in the first release, 2
  since the advice may be 0, 3 since continuation).
- At start-up an edge refuses a verifier of another wire version, or one whose /health carries
  none: start-up fails with a message naming both versions, before the rest of that /health
  (whose shape may differ) is read.
- While running, a verifier replaced by one of another wire version makes the edge's /health
  say ``"verifier": "incompatible"`` (503, status "degraded") and requests get 503 with code
  ``verifier_incompatible``; once a verifier of its version is back, the edge serves again.
"""

from __future__ import annotations

import json

import httpx
import pytest
from fastapi import FastAPI
from fastapi.responses import JSONResponse

from edge_agent.verifier_client import VerifierIncompatibleError, check_wire_version
from edge_support import RecordingTransport, edge_app, in_process_engine, verifier_app
from servers import LoopbackServer, serve, wait_until
from verifier_service.protocol import WIRE_VERSION

NEXT_VERSION = WIRE_VERSION + 1
URL = "http://verifier"


def test_this_release_speaks_wire_version_3():
    # 2: the advice may be 0 (an edge of version 1 would refuse such a verdict); 3: continuation
    # (an edge of version 2 would digest a verdict without its continued_tokens, and fail it)
    assert WIRE_VERSION == 3


@pytest.mark.parametrize(("body", "refused"), [
    ({"status": "ok", "wire_version": WIRE_VERSION}, False),
    ({"status": "loading", "wire_version": WIRE_VERSION}, False),
    ({"status": "ok", "wire_version": NEXT_VERSION}, True),
    ({"status": "ok", "wire_version": str(WIRE_VERSION)}, True),
    ({"status": "ok"}, True),
    ({"detail": "Bad Gateway"}, False),  # no verifier's /health: a proxy's error, left to the caller
    (["not", "a", "health"], False),
], ids=["same", "same-loading", "next", "a-string", "none", "a-proxy-error", "not-an-object"])  # fmt: skip
def test_which_health_bodies_are_refused(body, refused):
    if not refused:
        check_wire_version(URL, body)
        return
    with pytest.raises(VerifierIncompatibleError) as error:
        check_wire_version(URL, body)
    assert (error.value.code, f"this edge speaks wire version {WIRE_VERSION}" in error.value.message) == ("verifier_incompatible", True)


class NextVersionHealthTransport(RecordingTransport):
    """The verifier as a next release would answer: its /health says another wire version."""

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        response = await super().handle_async_request(request)
        if request.url.path != "/health":
            return response
        health = json.loads(await response.aread())
        return httpx.Response(response.status_code, json=health | {"wire_version": NEXT_VERSION})


async def test_at_start_up_a_verifier_of_another_wire_version_is_refused_naming_both(tiny_pair):
    with pytest.raises(VerifierIncompatibleError) as refused:
        async with in_process_engine(tiny_pair, transport_class=NextVersionHealthTransport):
            pass
    assert f"speaks wire version {NEXT_VERSION}, this edge speaks wire version {WIRE_VERSION}" in refused.value.message


def next_version_verifier() -> FastAPI:
    """A verifier of the next wire version, as this edge sees it: a /health of another shape and
    verify calls it does not understand (400)."""
    app = FastAPI()

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok", "wire_version": NEXT_VERSION, "served": {"model": "target"}}

    @app.post("/v1/verify")
    async def verify() -> JSONResponse:
        error = {"message": "unknown field: draft_tokens", "type": "invalid_request_error", "param": None, "code": None}
        return JSONResponse({"error": error}, status_code=400)

    return app


def test_while_running_a_replaced_verifier_of_another_version_is_named_and_requests_get_503(tiny_pair):
    verifier = LoopbackServer()
    verifier_url = verifier.start(verifier_app(tiny_pair))
    body = {"model": "tiny-target", "prompt": "The edge", "max_tokens": 4, "temperature": 0}
    try:
        with serve(edge_app(tiny_pair, verifier_url)) as edge_url:
            body["model"] = httpx.get(edge_url + "/health", timeout=10).json()["model"]
            assert httpx.post(edge_url + "/v1/completions", json=body, timeout=60).status_code == 200
            verifier.stop()
            verifier.start(next_version_verifier())
            assert wait_until(lambda: httpx.get(edge_url + "/health", timeout=10).json()["verifier"] == "incompatible")
            health = httpx.get(edge_url + "/health", timeout=10)
            refused = httpx.post(edge_url + "/v1/completions", json=body, timeout=60)
            verifier.stop()
            verifier.start(verifier_app(tiny_pair))
            assert wait_until(lambda: httpx.get(edge_url + "/health", timeout=10).json()["verifier"] == "ok")
            served_again = httpx.post(edge_url + "/v1/completions", json=body, timeout=60)
    finally:
        verifier.stop()
    assert (health.status_code, health.json()["status"]) == (503, "degraded")
    error = refused.json()["error"]
    assert (refused.status_code, error["type"], error["code"]) == (503, "service_unavailable_error", "verifier_incompatible")
    assert f"speaks wire version {NEXT_VERSION}" in error["message"]
    assert served_again.status_code == 200
