"""The edge's client of the verifier: one keep-alive httpx connection pool per verifier, the
session protocol (send only the unseen tail, resend the whole context on 409), retries of lost
calls (safe: the verifier answers a repeated call from memory), and session cleanup."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import Literal

import httpx

from edge_agent.drafter import DraftBlock
from gateway.errors import GatewayError, ServiceUnavailableError
from spade_core.params import SamplingConfig
from verifier_service.protocol import (
    SESSION_RESYNC_CODE,
    WIRE_VERSION,
    VerifierHealth,
    VerifyRequest,
    VerifyResponse,
    WireSampling,
    context_digest,
)

logger = logging.getLogger(__name__)

VerifierState = Literal["ok", "unreachable", "incompatible"]

RETRYABLE_STATUSES = {429, 502, 503, 504}
SESSION_HEADER = "X-Spade-Session"
"""The session id again, as a header: a proxy in front of several verifier replicas pins each
session to one of them without reading the body (docker/nginx/verifier-pool.conf)."""


class VerifierProtocolError(GatewayError):
    """The verifier refused a call the edge built: a bug on our side, reported as a 500."""


class VerifierIncompatibleError(ServiceUnavailableError):
    """The verifier speaks another version of the edge <-> verifier wire: the edge serves only a
    verifier of its own (README, "Compatibility"). At start-up it stops the edge; while running,
    requests get 503 ``verifier_incompatible`` (or the draft alone with --fallback draft)."""

    def __init__(self, base_url: str, wire_version: object) -> None:
        verifier_speaks = "no wire version" if wire_version is None else f"wire version {wire_version!r}"
        super().__init__(
            f"the verifier at {base_url} speaks {verifier_speaks}, this edge speaks wire version {WIRE_VERSION}: "
            "run an edge and a verifier of the same release",
            code="verifier_incompatible",
        )


def check_wire_version(base_url: str, health_body: object) -> None:
    """Refuse a verifier of another wire version before reading the rest of its /health, whose
    shape may differ. A body without ``status`` is no verifier's /health (a proxy's error while the
    verifier starts) and is left to the caller."""
    if not isinstance(health_body, dict) or "status" not in health_body:
        return
    wire_version = health_body.get("wire_version")
    if wire_version != WIRE_VERSION:
        raise VerifierIncompatibleError(base_url, wire_version)


class TokenizerMismatchError(RuntimeError):
    """The verifier's tokenizer differs from the draft's: drafted ids would mean other text."""


@dataclass(frozen=True)
class ClientSettings:
    timeout_s: float = 60.0
    connect_timeout_s: float = 5.0
    retries: int = 2
    """Extra attempts after a lost call or a retryable status, with exponential backoff."""
    backoff_s: float = 0.2
    circuit_open_s: float = 5.0
    """After the verifier is found unreachable, calls fail at once for this long instead of
    each waiting for timeouts and retries; then the next call tries the verifier again."""
    api_key: str | None = field(default=None, repr=False)
    """Sent as ``Authorization: Bearer <key>`` on every call to the verifier."""


@dataclass(frozen=True)
class VerifyCall:
    """One verify exchange: the verifier's verdict and what the exchange cost."""

    verdict: VerifyResponse
    round_trip_s: float
    """From sending the call to reading its answer (a 409 and the resent call included)."""
    bytes_sent: int
    bytes_received: int
    resynced: bool
    """The verifier had lost the session: the call was repeated with the whole context."""


class VerifierClient:
    def __init__(
        self, base_url: str, settings: ClientSettings = ClientSettings(), transport: httpx.AsyncBaseTransport | None = None
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.settings = settings
        timeout = httpx.Timeout(settings.timeout_s, connect=settings.connect_timeout_s)
        headers = {"authorization": f"Bearer {settings.api_key}"} if settings.api_key else None
        self._http = httpx.AsyncClient(base_url=self.base_url, timeout=timeout, transport=transport, headers=headers)
        self._background: set[asyncio.Task] = set()
        self._unreachable_until = 0.0

    @property
    def is_reachable(self) -> bool:
        """False while the circuit is open (the last call found the verifier unreachable)."""
        return time.monotonic() >= self._unreachable_until

    async def health(self, timeout_s: float | None = None) -> VerifierHealth:
        """The verifier's /health; ``VerifierIncompatibleError`` from one of another wire version."""
        response = await self._http.get("/health", timeout=timeout_s or self._http.timeout)
        body = response.json()
        check_wire_version(self.base_url, body)
        return VerifierHealth.model_validate(body)

    async def probe(self, timeout_s: float) -> VerifierState:
        """Whether the verifier answers its /health with ok, in this edge's wire version, within ``timeout_s``."""
        try:
            health = await self.health(timeout_s)
        except VerifierIncompatibleError:
            return "incompatible"
        except (httpx.HTTPError, ValueError):
            return "unreachable"
        return "ok" if health.status == "ok" else "unreachable"

    async def raise_if_incompatible(self) -> None:
        """After a refused or unreadable verify answer: a verifier replaced by one of another wire
        version is named as such (503), not taken for a bug of ours (500)."""
        try:
            await self.health()
        except (httpx.HTTPError, ValueError):
            pass  # unreadable too: the caller reports what it has

    async def wait_until_ready(self, timeout_s: float) -> VerifierHealth:
        """Poll /health until the verifier reports ok (it may still be loading its model)."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                health = await self.health()
                if health.status == "ok":
                    return health
                reason = "still loading its model"
            except (httpx.HTTPError, ValueError) as error:
                reason = f"{type(error).__name__}: {error}"
            if time.monotonic() > deadline:
                raise ServiceUnavailableError(f"verifier at {self.base_url} not ready after {timeout_s:.0f} s ({reason})")
            logger.info("waiting for verifier at %s: %s", self.base_url, reason)
            await asyncio.sleep(1.0)

    def open_session(self) -> VerifierSession:
        return VerifierSession(self, f"edge-{uuid.uuid4().hex}")

    def end_session_soon(self, session_id: str) -> None:
        """DELETE the session in the background: a finishing (or cancelled) request must not wait."""
        task = asyncio.get_running_loop().create_task(self._end_session(session_id))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _end_session(self, session_id: str) -> None:
        try:
            await self._http.delete(f"/v1/sessions/{session_id}", headers={SESSION_HEADER: session_id})
        except httpx.HTTPError as error:  # the verifier's TTL frees it anyway
            logger.debug("ending session %s failed: %s", session_id, error)

    async def post_verify(self, request: VerifyRequest) -> tuple[httpx.Response, int]:
        """POST with retries of lost calls and retryable statuses; returns (response, bytes sent)."""
        if not self.is_reachable:
            raise ServiceUnavailableError(f"the verifier at {self.base_url} is unreachable (retrying shortly)", code="verifier_unavailable")
        body = request.model_dump_json(exclude_none=True).encode()
        headers = {"content-type": "application/json", SESSION_HEADER: request.session_id}
        for attempt in range(self.settings.retries + 1):
            try:
                response = await self._http.post("/v1/verify", content=body, headers=headers)
            except httpx.TransportError as error:
                failure = f"{type(error).__name__}: {error}"
            else:
                if response.status_code not in RETRYABLE_STATUSES:
                    return response, len(body)
                failure = f"HTTP {response.status_code}"
            if attempt < self.settings.retries:
                await asyncio.sleep(self.settings.backoff_s * 2**attempt)
        self._unreachable_until = time.monotonic() + self.settings.circuit_open_s
        raise ServiceUnavailableError(f"the verifier at {self.base_url} is unavailable ({failure})", code="verifier_unavailable")

    async def aclose(self) -> None:
        if self._background:
            await asyncio.gather(*self._background, return_exceptions=True)
        await self._http.aclose()


@dataclass
class VerifierSession:
    """One generation's session on the verifier; remembers how much of the context it holds."""

    client: VerifierClient
    session_id: str
    verifier_length: int = 0
    has_called: bool = False
    """A verify call was sent: the verifier may hold the session even without an answer here
    (the first call cancelled in flight, when the client went away)."""

    async def verify(
        self, context: list[int], block: DraftBlock, sampling: SamplingConfig, num_top_logprobs: int | None = None
    ) -> VerifyCall:
        """``num_top_logprobs``: None asks for no logprobs; N for the emitted tokens' and N
        alternatives each."""
        started = time.perf_counter()
        resynced = False
        self.has_called = True
        request = self._request(context, block, sampling, num_top_logprobs)
        response, bytes_sent = await self.client.post_verify(request)
        if response.status_code == 409 and _error_code(response) == SESSION_RESYNC_CODE:
            resynced = True
            self.verifier_length = 0
            request = self._request(context, block, sampling, num_top_logprobs)
            response, resent = await self.client.post_verify(request)
            bytes_sent += resent
        verdict = await self._read_verdict(response)
        if num_top_logprobs is not None and not has_logprobs(verdict):
            raise VerifierProtocolError("the verifier answered a call asking for logprobs without one per emitted token")
        self.verifier_length = verdict.context_length
        return VerifyCall(verdict, time.perf_counter() - started, bytes_sent, len(response.content), resynced)

    async def _read_verdict(self, response: httpx.Response) -> VerifyResponse:
        try:
            if response.status_code != 200:
                raise VerifierProtocolError(f"the verifier refused a verify call: HTTP {response.status_code} {response.text[:500]}")
            return VerifyResponse.model_validate_json(response.content)
        except (VerifierProtocolError, ValueError):
            await self.client.raise_if_incompatible()
            raise

    def close(self) -> None:
        if self.has_called:
            self.client.end_session_soon(self.session_id)

    def _request(self, context: list[int], block: DraftBlock, sampling: SamplingConfig, num_top_logprobs: int | None) -> VerifyRequest:
        known = self.verifier_length
        return VerifyRequest(
            session_id=self.session_id,
            prefix_length=known,
            prefix_digest=context_digest(context[:known]),
            new_tokens=context[known:],
            draft_tokens=block.token_ids,
            draft_probs=block.probs,
            sampling=WireSampling.from_config(sampling),
            num_top_logprobs=num_top_logprobs,
        )


def has_logprobs(verdict: VerifyResponse) -> bool:
    num_emitted = verdict.num_accepted + 1
    return len(verdict.logprobs) == num_emitted and verdict.top_logprobs is not None and len(verdict.top_logprobs) == num_emitted


def _error_code(response: httpx.Response) -> str | None:
    try:
        return response.json()["error"]["code"]
    except (ValueError, KeyError, TypeError):
        return None


def check_tokenizer(health: VerifierHealth, draft_fingerprint: str) -> None:
    if health.tokenizer_fingerprint != draft_fingerprint:
        raise TokenizerMismatchError(
            f"the verifier's model {health.model!r} has a different tokenizer than the draft model "
            f"(fingerprint {health.tokenizer_fingerprint} vs {draft_fingerprint}); drafted token ids would "
            "mean different text. Use a draft model that shares the target's tokenizer."
        )
