"""The edge's client of the verifier: one keep-alive httpx connection pool per verifier, the
session protocol (send only the unseen tail, resend the whole context on 409), retries of lost
calls (safe: the verifier answers a repeated call from memory), and session cleanup.

No verdict reaches the engine unchecked (``checked_verdict``): it must parse, belong to the call
and carry the ``verdict_digest`` the edge recomputes over the request it sent, the verdict and
its OWN committed context + accepted + next + continued (verifier_service.protocol). An answer
that fails (garbled, truncated, schema-invalid, rewritten on the way, a 5xx) is treated as lost:
the same call again (the verifier replays it from memory, so the session never advances
twice), then the whole context resent from the edge's own committed tokens (never the
verifier's), then a 502 (``BadGatewayError``). The engine's context therefore only ever grows
by verified tokens."""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import logging
import time
import uuid
from collections.abc import Coroutine
from dataclasses import dataclass, field
from typing import Any, Literal

import httpx

from edge_agent.drafter import DraftBlock
from edge_agent.pipeline_client import PipelineClient
from gateway.affinity import ROUTE_HEADER, SESSION_HEADER
from gateway.errors import BadGatewayError, GatewayError, RequestTooLargeError, ServiceUnavailableError
from spade_core.params import SamplingConfig
from verifier_service.protocol import (
    SESSION_RESYNC_CODE,
    WIRE_VERSION,
    VerifierHealth,
    VerifyRequest,
    VerifyResponse,
    WireSampling,
    context_digest,
    verdict_digest,
)

logger = logging.getLogger(__name__)

VerifierState = Literal["ok", "unreachable", "incompatible"]

RETRYABLE_STATUSES = {429, 502, 503, 504}


class VerifierProtocolError(GatewayError):
    """The verifier refused a call the edge built: a bug on our side, reported as a 500."""


class UntrustedAnswerError(Exception):
    """A verify answer the edge cannot use (garbled, invalid, failing its digest, a 5xx): treated as lost."""


class SessionLostError(Exception):
    """The verifier answered 409 session_resync_required: the whole context must be resent."""


class VerifierKeyError(RuntimeError):
    """The verifier requires a key the edge does not have: start-up fails at once, not after a timeout."""


class VerifierIncompatibleError(ServiceUnavailableError):
    """The verifier speaks another version of the edge <-> verifier wire: the edge serves only a
    verifier of its own (docs/design.md, "The verify wire and its version"). At start-up it stops the edge; while running,
    requests get 503 ``verifier_incompatible`` (or the draft alone with --fallback draft)."""

    def __init__(self, base_url: str, wire_version: object) -> None:
        verifier_speaks = "no wire version" if wire_version is None else f"wire version {wire_version!r}"
        # Clients see this message: it names no address (the log does, for the operator).
        logger.warning("the verifier at %s speaks %s, this edge wire version %s", base_url, verifier_speaks, WIRE_VERSION)
        super().__init__(
            f"the verifier speaks {verifier_speaks}, this edge speaks wire version {WIRE_VERSION}: "
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
    """After the verifier is found unreachable, calls fail at once for a while instead of each
    waiting for timeouts and retries; then the next call tries the verifier again. The while
    starts at ``circuit_first_open_s`` and doubles each time the verifier is found unreachable
    again, up to this; an answer resets it (a one-second blip costs a second of fast failures,
    not five; a verifier that stays down is tried every five seconds)."""
    circuit_first_open_s: float = 0.5
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
    rejected_answers: int = 0
    """Answers to this call the edge rejected (garbled, invalid, failing the digest, a 5xx) and asked again."""


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
        self._open_s = self.first_open_s

    def pipeline_client(self) -> PipelineClient:
        """The pipelined-session wire on this client's connection (base URL, key, transport)."""
        return PipelineClient(self._http)

    @property
    def first_open_s(self) -> float:
        return min(self.settings.circuit_first_open_s, self.settings.circuit_open_s)

    @property
    def is_reachable(self) -> bool:
        """False while the circuit is open (the last call found the verifier unreachable)."""
        return time.monotonic() >= self._unreachable_until

    async def health(self, timeout_s: float | None = None) -> VerifierHealth:
        """The verifier's /health. Raises VerifierKeyError when it answers the status alone (it
        shows its details only to a caller with a valid key: the edge's key is missing or wrong),
        ``VerifierIncompatibleError`` from a verifier of another wire version."""
        response = await self._http.get("/health", timeout=timeout_s or self._http.timeout)
        body = response.json()
        if isinstance(body, dict) and set(body) == {"status"} and body["status"] == "ok":
            raise VerifierKeyError(
                f"the verifier at {self.base_url} does not accept the edge's key (its /health gives the status alone): "
                "set --verifier-api-key (or --verifier-api-key-file) to one of the verifier's keys"
            )
        check_wire_version(self.base_url, body)
        return VerifierHealth.model_validate(body)

    async def probe(self, timeout_s: float) -> VerifierState:
        """Whether the verifier answers its /health with ok, in this edge's wire version, within ``timeout_s``."""
        try:
            health = await self.health(timeout_s)
        except VerifierIncompatibleError:
            return "incompatible"
        except (httpx.HTTPError, ValueError, VerifierKeyError):
            return "unreachable"
        return "ok" if health.status == "ok" else "unreachable"

    async def raise_if_incompatible(self) -> None:
        """After a refused or unreadable verify answer: a verifier replaced by one of another wire
        version is named as such (503), not taken for a bug of ours (500)."""
        try:
            await self.health()
        except (httpx.HTTPError, ValueError, VerifierKeyError):
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

    def open_session(self, cache_salt: str | None = None, route_key: str | None = None) -> VerifierSession:
        """A new session. ``cache_salt``: its verify calls' (``wire_cache_salt``); ``route_key``: the
        request's prefix key (``gateway.affinity.route_key``), on its every call."""
        return VerifierSession(self, f"edge-{uuid.uuid4().hex}", cache_salt=cache_salt, route_key=route_key)

    def end_session_soon(self, session: VerifierSession) -> None:
        """DELETE the session in the background: a finishing (or cancelled) request must not wait."""
        task = asyncio.get_running_loop().create_task(self._end_session(session))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _end_session(self, session: VerifierSession) -> None:
        try:
            await self._http.delete(f"/v1/sessions/{session.session_id}", headers=session.routing_headers)
        except httpx.HTTPError as error:  # the verifier's TTL frees it anyway
            logger.debug("ending session %s failed: %s", session.session_id, error)

    async def post_verify(self, request: VerifyRequest, routing_headers: dict[str, str] | None = None) -> tuple[httpx.Response, int]:
        """POST with retries of lost calls and retryable statuses; returns (response, bytes sent)."""
        if not self.is_reachable:
            raise ServiceUnavailableError("the verifier is unreachable (retrying shortly)", code="verifier_unavailable")
        body = request.model_dump_json(exclude_none=True).encode()
        headers = {"content-type": "application/json", SESSION_HEADER: request.session_id} | (routing_headers or {})
        for attempt in range(self.settings.retries + 1):
            try:
                response = await self._uncancelled(self._http.post("/v1/verify", content=body, headers=headers))
            except httpx.TransportError as error:
                failure, detail = type(error).__name__, f"{type(error).__name__}: {error}"
            except AttributeError as error:  # anyio's socket gone under httpcore as it connects (a peer reset): a lost call too
                failure, detail = "ConnectionLost", f"{type(error).__name__} in the HTTP stack: {error}"
            else:
                if response.status_code not in RETRYABLE_STATUSES:
                    self._open_s = self.first_open_s
                    return response, len(body)
                failure = detail = f"HTTP {response.status_code}"
            if attempt < self.settings.retries:
                await asyncio.sleep(self.settings.backoff_s * 2**attempt)
        self._unreachable_until = time.monotonic() + self._open_s
        self._open_s = min(2 * self._open_s, self.settings.circuit_open_s)
        # Clients see the kind of failure only: a transport error's text may carry the address.
        logger.warning("the verifier at %s is unavailable: %s", self.base_url, detail)
        raise ServiceUnavailableError(f"the verifier is unavailable ({failure})", code="verifier_unavailable")

    async def _uncancelled(self, call: Coroutine[Any, Any, httpx.Response]) -> httpx.Response:
        """``call``'s response; a caller cancelled meanwhile (its client went away) leaves the
        request to finish in the background. httpcore 1.0 can lose a pool slot for good when a
        request is cancelled mid-flight (encode/httpcore#1093): an edge whose clients hang up
        would run out of connections to its verifier and answer every call 503."""
        task = asyncio.ensure_future(call)
        self._background.add(task)
        task.add_done_callback(_settled)
        task.add_done_callback(self._background.discard)
        return await asyncio.shield(task)

    async def aclose(self) -> None:
        if self._background:
            await asyncio.gather(*self._background, return_exceptions=True)
        await self._http.aclose()


def _settled(task: asyncio.Task) -> None:
    """Retrieve a background request's outcome, so a failure nobody awaited is not logged as lost."""
    if not task.cancelled():
        task.exception()


@dataclass
class VerifierSession:
    """One generation's session on the verifier; remembers how much of the context it holds."""

    client: VerifierClient
    session_id: str
    verifier_length: int = 0
    has_called: bool = False
    """A verify call was sent: the verifier may hold the session even without an answer here
    (the first call cancelled in flight, when the client went away)."""
    checked_digest: tuple[int, str] = (0, context_digest([]))
    """(length, context_digest) of the committed context the last verdict was checked against:
    the next call's prefix_digest, so each call hashes the context once, not twice."""
    cache_salt: str | None = None
    """Sent with every call: the verifier shares cached prefixes only among calls with the same."""
    route_key: str | None = None
    """The request's prefix key (``ROUTE_HEADER``); None: the pool routes by the session id."""

    @property
    def routing_headers(self) -> dict[str, str]:
        """What a proxy in front of verifier replicas routes this session's calls by."""
        headers = {SESSION_HEADER: self.session_id}
        return headers | ({ROUTE_HEADER: self.route_key} if self.route_key else {})

    async def verify(
        self,
        context: list[int],
        block: DraftBlock,
        sampling: SamplingConfig,
        num_top_logprobs: int | None = None,
        max_continued_tokens: int = 0,
    ) -> VerifyCall:
        """``num_top_logprobs``: None asks for no logprobs; N for the emitted tokens' and N
        alternatives each. ``max_continued_tokens``: how many tokens a saturated verifier may
        decode on by itself after the verdict (the wire's continuation). Returns only a verdict
        that passed ``checked_verdict``."""
        started = time.perf_counter()
        self.has_called = True
        traffic = Traffic()
        resynced = False
        try:
            request = self._request(context, block, sampling, num_top_logprobs, max_continued_tokens)
            verdict, committed_digest = await self._trusted_verdict(request, context, traffic)
        except VerifierProtocolError:
            await self.client.raise_if_incompatible()
            raise
        except (SessionLostError, UntrustedAnswerError) as error:
            logger.debug("session %s: resending the whole context (%s)", self.session_id, type(error).__name__)
            resynced = True
            self.verifier_length = 0
            request = self._request(context, block, sampling, num_top_logprobs, max_continued_tokens)
            verdict, committed_digest = await self._resynced_verdict(request, context, traffic)
        self.verifier_length = verdict.context_length
        self.checked_digest = (verdict.context_length, committed_digest)
        return VerifyCall(
            verdict, time.perf_counter() - started, traffic.bytes_sent, traffic.bytes_received, resynced, traffic.num_rejected
        )

    async def _resynced_verdict(self, request: VerifyRequest, context: list[int], traffic: Traffic) -> tuple[VerifyResponse, str]:
        """The resent call's verdict; when none comes, a verifier replaced by one of another wire
        version is named as such (503), not taken for a bug of ours (500) or a bad gateway (502)."""
        try:
            return await self._trusted_verdict(request, context, traffic)
        except SessionLostError as error:
            await self.client.raise_if_incompatible()
            raise VerifierProtocolError("the verifier answered 409 to a call carrying the whole context") from error
        except VerifierProtocolError:
            await self.client.raise_if_incompatible()
            raise
        except UntrustedAnswerError as error:
            await self.client.raise_if_incompatible()
            raise BadGatewayError(
                f"no valid answer from the verifier ({error}); nothing of it was emitted",
                code=BAD_RESPONSE_CODE,
            ) from None

    async def _trusted_verdict(self, request: VerifyRequest, context: list[int], traffic: Traffic) -> tuple[VerifyResponse, str]:
        """The verdict of ``request``, the same call posted again while answers fail the checks
        (``ClientSettings.retries`` times): the verifier replays its answer from memory."""
        fingerprint = request.fingerprint()
        failure = UntrustedAnswerError("no answer")
        for attempt in range(self.client.settings.retries + 1):
            response, bytes_sent = await self.client.post_verify(request, self.routing_headers)
            traffic.add(bytes_sent, len(response.content))
            try:
                return checked_verdict(response, request, fingerprint, context)
            except UntrustedAnswerError as error:
                logger.debug("session %s: verify answer rejected (%s)", self.session_id, error)
                traffic.num_rejected += 1
                failure = error
            if attempt < self.client.settings.retries:
                await asyncio.sleep(self.client.settings.backoff_s * 2**attempt)
        raise failure

    def close(self) -> None:
        if self.has_called:
            self.client.end_session_soon(self)

    def _request(
        self, context: list[int], block: DraftBlock, sampling: SamplingConfig, num_top_logprobs: int | None, max_continued_tokens: int
    ) -> VerifyRequest:
        known = self.verifier_length
        checked_length, checked_digest = self.checked_digest
        return VerifyRequest(
            session_id=self.session_id,
            prefix_length=known,
            prefix_digest=checked_digest if known == checked_length else context_digest(context[:known]),
            new_tokens=context[known:],
            draft_tokens=block.token_ids,
            draft_probs=block.probs,
            sampling=WireSampling.from_config(sampling),
            num_top_logprobs=num_top_logprobs,
            cache_salt=self.cache_salt,
            max_continued_tokens=max_continued_tokens,
        )


def wire_cache_salt(owner: str, cache_salt: str | None) -> str | None:
    """The salt an edge's verify calls carry: the request's ``cache_salt``, with the edge's
    caller (its API key id) folded in where the edge has keys. The verifier sees one caller,
    the edge, so the edge keeps its own keys apart: their prompts never share a prefix there
    (the time to first token would tell one key what another's prompts begin with)."""
    if not owner:
        return cache_salt
    return hashlib.blake2b(json.dumps([owner, cache_salt or ""]).encode(), digest_size=16).hexdigest()


BAD_RESPONSE_CODE = "verifier_bad_response"


@dataclass
class Traffic:
    """Bytes one verify exchange moved, over all its attempts."""

    bytes_sent: int = 0
    bytes_received: int = 0
    num_rejected: int = 0

    def add(self, sent: int, received: int) -> None:
        self.bytes_sent += sent
        self.bytes_received += received


def checked_verdict(response: httpx.Response, request: VerifyRequest, fingerprint: str, context: list[int]) -> tuple[VerifyResponse, str]:
    """The verdict in ``response`` if it passes every check, with the context_digest of the
    committed context after it (the next call's prefix_digest); raises UntrustedAnswerError for an
    answer to treat as lost, SessionLostError for a 409 resync, ``refusal_error``'s for a
    refusal of the call itself (another 4xx).

    ``context``: the edge's own committed context the call continues. The digest binds the
    verdict to ``fingerprint`` (this request) and to context + accepted + next + continued: a
    rewritten ``next_token``, ``num_accepted`` or continued token, a flipped bit, a stale or
    foreign answer all fail it."""
    if response.status_code == 409 and _error_code(response) == SESSION_RESYNC_CODE:
        raise SessionLostError()
    if response.status_code >= 500:
        raise UntrustedAnswerError(f"HTTP {response.status_code}")
    if response.status_code != 200:
        raise refusal_error(response)
    try:
        verdict = VerifyResponse.model_validate_json(response.content)
    except ValueError as error:  # pydantic's ValidationError: not JSON, or not a verdict
        raise UntrustedAnswerError(f"invalid answer: {str(error).splitlines()[0]}") from None
    if (
        verdict.session_id != request.session_id
        or not 0 <= verdict.num_accepted <= len(request.draft_tokens)
        or len(verdict.continued_tokens) > request.max_continued_tokens
    ):
        raise UntrustedAnswerError("an answer for another call")
    committed_digest = context_digest(committed_after(context, request, verdict))
    expected = verdict_digest(fingerprint, verdict, committed_digest)
    if not hmac.compare_digest(expected, verdict.verdict_digest):
        raise UntrustedAnswerError("verdict digest mismatch")
    if request.num_top_logprobs is not None and not has_logprobs(verdict):
        raise VerifierProtocolError("the verifier answered a call asking for logprobs without one per emitted token")
    return verdict, committed_digest


def refusal_error(response: httpx.Response) -> GatewayError:
    """What the caller is told when the verifier refuses a verify call (a 4xx other than a
    resync): its key refused (rotated on the verifier while the edge runs) is the operator's to
    fix, a 503; a body over the verifier's size limit is the prompt's, a 413 with the verifier's
    words; anything else means the edge built a call the verifier cannot take, a bug of ours (500)."""
    detail = f"HTTP {response.status_code} {response.text[:500]}"
    if response.status_code in (401, 403):
        return ServiceUnavailableError(
            f"the verifier refused this edge's API key ({detail}); check --verifier-api-key", code="verifier_auth_failed"
        )
    if response.status_code == 413:
        return RequestTooLargeError(f"the verifier refuses a call this large ({detail}): shorten the prompt", code="request_too_large")
    return VerifierProtocolError(f"the verifier refused a verify call: {detail}")


def committed_after(context: list[int], request: VerifyRequest, verdict: VerifyResponse) -> list[int]:
    """The committed context once the verdict is taken: context + accepted drafts + next token
    + the tokens the verifier continued with."""
    return context + request.draft_tokens[: verdict.num_accepted] + [verdict.next_token] + verdict.continued_tokens


def has_logprobs(verdict: VerifyResponse) -> bool:
    num_emitted = verdict.num_accepted + 1 + len(verdict.continued_tokens)
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
