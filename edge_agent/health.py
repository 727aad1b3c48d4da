"""The edge's /health: whether requests can be served now, in a status code a load balancer
can use. The verifier is probed (its /health, short timeout), the answer cached briefly so a
health-check storm does not become a verifier storm; an open circuit counts as unreachable
(requests are being refused until it closes)."""

from __future__ import annotations

import asyncio
import time

from edge_agent.verifier_client import VerifierClient

PROBE_TTL_S = 1.5
PROBE_TIMEOUT_S = 1.0


class VerifierProbe:
    def __init__(self, client: VerifierClient, ttl_s: float = PROBE_TTL_S, timeout_s: float = PROBE_TIMEOUT_S) -> None:
        self._client = client
        self._ttl_s = ttl_s
        self._timeout_s = timeout_s
        self._checked_at = float("-inf")
        self._is_ok = False
        self._lock = asyncio.Lock()

    async def is_ok(self) -> bool:
        async with self._lock:  # concurrent health checks share one probe
            if time.monotonic() - self._checked_at > self._ttl_s:
                self._is_ok = await self._client.probe(self._timeout_s)
                self._checked_at = time.monotonic()
            return self._is_ok

    async def aclose(self) -> None:
        await self._client.aclose()


def health_status(verifier_ok: bool, fallback: str) -> tuple[str, int]:
    """(status, HTTP status): 200 "ok"; without the verifier "degraded", 503 unless the edge
    keeps serving the draft alone (--fallback draft)."""
    if verifier_ok:
        return "ok", 200
    return "degraded", 200 if fallback == "draft" else 503
