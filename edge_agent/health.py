"""The edge's /health: whether requests can be served now, in a status code a load balancer
can use. The verifier is probed (its /health, short timeout), the answer cached briefly so a
health-check storm does not become a verifier storm; an open circuit counts as unreachable
(requests are being refused until it closes), a verifier of another wire version as
incompatible."""

from __future__ import annotations

import asyncio
import time
from typing import Literal

from pydantic import BaseModel, Field

from edge_agent.tuning import TUNING
from edge_agent.verifier_client import VerifierClient, VerifierState


class VerifierProbe:
    def __init__(self, client: VerifierClient, ttl_s: float = TUNING.probe_ttl_s, timeout_s: float = TUNING.probe_timeout_s) -> None:
        self._client = client
        self._ttl_s = ttl_s
        self._timeout_s = timeout_s
        self._checked_at = float("-inf")
        self._state: VerifierState = "unreachable"
        self._lock = asyncio.Lock()

    async def state(self) -> VerifierState:
        async with self._lock:  # concurrent health checks share one probe
            if time.monotonic() - self._checked_at > self._ttl_s:
                self._state = await self._client.probe(self._timeout_s)
                self._checked_at = time.monotonic()
            return self._state

    async def aclose(self) -> None:
        await self._client.aclose()


class EdgeHealth(BaseModel):
    """The edge's /health body: whether it serves, what it drafts with and for which verifier.
    While the draft loads and the verifier is checked, only ``status`` ("loading", HTTP 503)."""

    status: Literal["ok", "degraded", "loading"] = Field(
        description='"degraded": the verifier cannot be used; HTTP 503 unless --fallback draft serves the draft alone.'
    )
    verifier: VerifierState | None = Field(
        None, description='"unreachable" (or its circuit is open) or "incompatible" (another wire version) when not "ok".'
    )
    fallback: Literal["error", "draft"] | None = None
    model: str | None = Field(None, description="The target's id, adopted from the verifier's /health: the model clients name.")
    draft_model: str | None = Field(None, description="The draft's name or path: only for a caller with a valid API key.")
    draft_backend: str | None = Field(None, description="llamacpp or transformers: the runtime the draft loaded in.")
    verifier_url: str | None = Field(None, description="The verifier's address: only for a caller with a valid API key.")
    draft_length: int | Literal["auto"] | None = None
    overlap: bool | None = None
    prefill_first: bool | None = None


def health_status(verifier: VerifierState, fallback: str) -> tuple[Literal["ok", "degraded"], int]:
    """(status, HTTP status): 200 "ok"; without a usable verifier "degraded", 503 unless the edge
    keeps serving the draft alone (--fallback draft)."""
    if verifier == "ok":
        return "ok", 200
    return "degraded", 200 if fallback == "draft" else 503
