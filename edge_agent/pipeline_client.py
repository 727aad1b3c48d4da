"""The edge's side of the pipelined-session wire (``verifier_service.pipeline_protocol``): open a
session, post proposals, read the decided tokens, close. On the verifier client's HTTP client (its
base URL, key and transport).

Every decided event is checked before it is handed on (``checked_event``: it continues the tokens
held, and its digest is the one the verifier seals it with): an event that fails, or does not
parse, is dropped and the stream read again from the tokens held, at most ``max_resumes`` times in
a row; a stream that breaks is read again the same way. So a token changed on the way is never
emitted.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator

import httpx

from gateway.errors import InvalidRequestError, OverloadedError, ServiceUnavailableError
from verifier_service.pipeline_protocol import (
    DecidedTokens,
    PipelineOpen,
    PipelineOpened,
    PipelineProposal,
    checked_event,
)

logger = logging.getLogger(__name__)

SESSIONS_PATH = "/v1/pipeline/sessions"


class PipelineUnsupported(Exception):
    """The verifier does not serve the pipelined-session wire (started without ``--pipelined-sessions``)."""


class PipelineClient:
    def __init__(self, http: httpx.AsyncClient, max_resumes: int = 8) -> None:
        self._http = http
        self.max_resumes = max_resumes
        self.num_bad_events = 0
        """Decided events this client dropped for failing their check."""

    async def open(self, request: PipelineOpen) -> PipelineOpened:
        """Open a session; raises ``PipelineUnsupported`` on a verifier without the wire, the
        gateway's error for a refusal (429, 400) and ServiceUnavailableError when unreachable."""
        try:
            response = await self._http.post(SESSIONS_PATH, content=request.model_dump_json(), headers=_JSON)
        except httpx.HTTPError as error:
            raise ServiceUnavailableError(f"the verifier is unreachable: {error}", code="verifier_unavailable") from error
        if response.status_code == 404:
            raise PipelineUnsupported("the verifier does not serve /v1/pipeline/sessions (--pipelined-sessions)")
        await _raise_for_status(response)
        return PipelineOpened.model_validate_json(response.content)

    async def propose(self, session_id: str, proposal: PipelineProposal) -> None:
        """Post a proposal; a lost one costs acceptance only, so failures are logged, not raised."""
        try:
            response = await self._http.post(f"{SESSIONS_PATH}/{session_id}/proposals", content=proposal.model_dump_json(), headers=_JSON)
            if response.status_code != 204:
                logger.debug("proposal for %s refused: %s %s", session_id, response.status_code, response.text[:200])
        except httpx.HTTPError as error:
            logger.debug("proposal for %s lost: %s", session_id, error)

    async def decided(self, session_id: str, prompt: list[int]) -> AsyncIterator[DecidedTokens]:
        """The session's decided events, each checked, until the one that finishes it."""
        held: list[int] = []
        failures = 0
        while True:
            try:
                async for event in self._stream(session_id, len(held)):
                    if not checked_event(event, prompt, held):
                        failures += 1
                        self.num_bad_events += 1
                        logger.warning("session %s: a decided event failed its check (%d in a row); reading again", session_id, failures)
                        break
                    failures = 0
                    held += event.token_ids
                    yield event
                    if event.finish_reason is not None:
                        return
                else:
                    failures += 1  # the stream ended before the session did
            except httpx.HTTPError as error:
                failures += 1
                logger.warning("session %s: the decided stream broke (%s); reading again", session_id, error)
            except ValueError as error:  # an event that is not a DecidedTokens (garbled on the way)
                failures += 1
                self.num_bad_events += 1
                logger.warning("session %s: a decided event did not parse (%s); reading again", session_id, str(error).splitlines()[0])
            if failures > self.max_resumes:
                raise ServiceUnavailableError(
                    f"the verifier's decided tokens for session {session_id} failed {failures} times in a row",
                    code="verifier_unavailable",
                )

    async def close(self, session_id: str) -> None:
        try:
            await self._http.delete(f"{SESSIONS_PATH}/{session_id}")
        except httpx.HTTPError as error:  # the verifier's idle TTL frees it anyway
            logger.debug("closing pipelined session %s failed: %s", session_id, error)

    async def _stream(self, session_id: str, after: int) -> AsyncIterator[DecidedTokens]:
        async with self._http.stream(
            "GET", f"{SESSIONS_PATH}/{session_id}/decided", params={"after": after}, timeout=_STREAM_TIMEOUT
        ) as response:
            await _raise_for_status(response)
            async for line in response.aiter_lines():
                if line.startswith("data:"):
                    yield DecidedTokens.model_validate_json(line.removeprefix("data:"))


_JSON = {"content-type": "application/json"}
_STREAM_TIMEOUT = httpx.Timeout(10.0, read=None)
"""A decided stream waits as long as the session decodes (the verifier pings it every 15 s)."""


async def _raise_for_status(response: httpx.Response) -> None:
    """A refusal in the gateway's words, so the edge's caller gets an honest status: the
    verifier's 400 is the request's (a prompt it cannot take), its 429 an overload to retry, a
    refused key or anything else an unavailable verifier."""
    if response.is_success:
        return
    await response.aread()
    try:
        message = str(response.json()["error"]["message"])
    except (ValueError, KeyError, TypeError):
        message = response.text[:300]
    detail = f"the verifier answered {response.status_code}: {message}"
    if response.status_code == 400:
        raise InvalidRequestError(detail)
    if response.status_code == 429:
        retry_after = response.headers.get("retry-after", "1")
        raise OverloadedError(detail, retry_after_s=int(retry_after) if retry_after.isdigit() else 1)
    if response.status_code in (401, 403):
        raise ServiceUnavailableError(f"{detail}; check --verifier-api-key", code="verifier_auth_failed")
    raise ServiceUnavailableError(detail, code="verifier_unavailable")
