"""The edge's side of the pipelined-session wire (``verifier_service.pipeline_protocol``): open a
session, post proposals, read the decided tokens, close. On the verifier client's HTTP client (its
base URL, key and transport).

Every decided event is checked before it is handed on (``checked_event``: it continues the tokens
held, and its digest is the one the verifier seals it with): an event that fails, or does not
parse, is dropped and the stream read again from the tokens held; a stream that breaks, or a
verifier (or the proxy before it) answering 5xx, is read again the same way, each time after a
longer pause (at most ``max_resumes`` failures in a row). So a token changed on the way is never
emitted.

Resume. A verifier that answers that it does not hold the session (404 ``session_not_found``: the
replica restarted, or the pool moved the session to another replica, or its idle TTL closed it),
or ends it as ``closed`` while the edge still reads (a verifier shutting down), gets it opened
again, under the same id, from the prompt and every token held (``RemoteSession.resumed_opening``):
nothing decided is lost or doubled, and the positions the edge proposes at stay absolute. Every
call of a session carries the pool's routing headers (``X-Spade-Session``, and ``X-Spade-Route``
where the request has a prefix key), so the shipped nginx pool keeps it on one replica.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass

import httpx

from gateway.affinity import ROUTE_HEADER, SESSION_HEADER
from gateway.errors import BadGatewayError, InvalidRequestError, OverloadedError, ServiceUnavailableError
from spade_core.params import continued_seed
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


class SessionGone(Exception):
    """The verifier answered that it does not hold the session (404 ``session_not_found``)."""


class BadAnswer(Exception):
    """The verifier, or a proxy before it, answered wrongly: a decided event that failed its check
    or did not parse, or a 5xx. The stream is read again after a pause."""


@dataclass
class RemoteSession:
    """One pipelined session as the edge holds it: what opened it, the routing headers its calls
    carry, and, once it was opened again (a resume), how many generated tokens came before the
    verifier's session now serving it (``offset``: its positions start there)."""

    opening: PipelineOpen
    route_key: str | None = None
    offset: int = 0
    num_resumes: int = 0
    num_bad_events: int = 0
    """Decided events dropped for failing their check (or not parsing), then read again."""

    @property
    def session_id(self) -> str:
        return self.opening.session_id

    @property
    def headers(self) -> dict[str, str]:
        headers = {"content-type": "application/json", SESSION_HEADER: self.session_id}
        return headers | ({ROUTE_HEADER: self.route_key} if self.route_key else {})

    def resumed_opening(self, held: list[int]) -> PipelineOpen:
        """The opening of the session again after ``held`` generated tokens: their prompt is the
        first prompt and ``held``, the rest of max_tokens, and a seed of its own
        (``continued_seed``: an engine restarting its generator must not replay the first draws).

        Example: prompt [5, 6], max_tokens 10, held [7, 8] -> prompt [5, 6, 7, 8], max_tokens 8."""
        sampling = self.opening.sampling.model_copy(update={"seed": continued_seed(self.opening.sampling.seed, len(held))})
        return self.opening.model_copy(
            update={
                "prompt_tokens": self.opening.prompt_tokens + held,
                "max_tokens": self.opening.max_tokens - len(held),
                "sampling": sampling,
            }
        )

    def on_the_wire(self, proposal: PipelineProposal) -> PipelineProposal:
        """``proposal`` (positions absolute, ``seen`` counting every token held) as the serving
        session counts: its ``seen`` from where it started."""
        if not self.offset:
            return proposal
        return proposal.model_copy(update={"seen": max(0, proposal.seen - self.offset)})


class PipelineClient:
    def __init__(self, http: httpx.AsyncClient, max_resumes: int = 8, pause_s: float = 0.05) -> None:
        """``max_resumes``: failures in a row (events that fail their check, broken streams,
        5xx) before a stream gives up; ``pause_s``: the pause before reading again after the
        first, doubling to 1 s."""
        self._http = http
        self.max_resumes = max_resumes
        self.pause_s = pause_s

    async def open(self, session: RemoteSession) -> PipelineOpened:
        """Open ``session``; raises ``PipelineUnsupported`` on a verifier without the wire, the
        gateway's error for a refusal (429, 400) and ServiceUnavailableError when unreachable."""
        return await self._open(session, session.opening)

    async def propose(self, session: RemoteSession, proposal: PipelineProposal) -> None:
        """Post a proposal; a lost one costs acceptance only, so failures are logged, not raised."""
        path = f"{SESSIONS_PATH}/{session.session_id}/proposals"
        try:
            response = await self._http.post(path, content=session.on_the_wire(proposal).model_dump_json(), headers=session.headers)
            if response.status_code != 204:
                logger.debug("proposal for %s refused: %s %s", session.session_id, response.status_code, response.text[:200])
        except httpx.HTTPError as error:
            logger.debug("proposal for %s lost: %s", session.session_id, error)

    async def decided(self, session: RemoteSession) -> AsyncIterator[DecidedTokens]:
        """The session's decided events, each checked, until the one that finishes it; ``start``
        counts every token generated for it, across resumes. Gives up after ``max_resumes``
        failures in a row: 502 ``verifier_bad_response`` when the verifier kept answering wrongly
        (events failing their check, garbled, 5xx), else 503 ``verifier_unavailable``."""
        held: list[int] = []
        failures, answered_badly = 0, False
        while True:
            if failures:
                await asyncio.sleep(min(1.0, self.pause_s * 2 ** (failures - 1)))
            prompt = session.opening.prompt_tokens + held[: session.offset]
            try:
                async for event in self._stream(session, len(held) - session.offset):
                    if not checked_event(event, prompt, held[session.offset :]):
                        raise BadAnswer("a decided event failed its check")
                    failures, answered_badly = 0, False
                    held += event.token_ids
                    if event.finish_reason == "closed":  # not by this edge: shut down or evicted
                        if event.token_ids:
                            yield event.model_copy(update={"start": event.start + session.offset, "finish_reason": None})
                        raise SessionGone(session.session_id)
                    yield event.model_copy(update={"start": event.start + session.offset})
                    if event.finish_reason is not None:
                        return
                raise httpx.RemoteProtocolError("the stream ended before the session did")
            except SessionGone:
                if len(held) >= session.opening.max_tokens:  # it had decided all it was to: nothing to resume
                    yield DecidedTokens(start=len(held), token_ids=[], finish_reason="length")
                    return
                failures += 1
                try:
                    await self._resume(session, held)
                except ServiceUnavailableError as error:  # the replica taking it is not up yet
                    logger.warning("session %s: opening it again failed (%s)", session.session_id, error)
            except BadAnswer as error:
                failures, answered_badly = failures + 1, True
                session.num_bad_events += 1
                logger.warning("session %s: %s (%d in a row); reading again", session.session_id, error, failures)
            except httpx.HTTPError as error:
                failures += 1
                logger.warning("session %s: the decided stream broke (%s); reading again", session.session_id, error)
            if failures > self.max_resumes:
                message = f"the verifier's decided tokens for session {session.session_id} failed {failures} times in a row"
                if answered_badly:
                    raise BadGatewayError(f"{message}; nothing of them was emitted", code="verifier_bad_response")
                raise ServiceUnavailableError(message, code="verifier_unavailable")

    async def close(self, session: RemoteSession) -> None:
        try:
            await self._http.delete(f"{SESSIONS_PATH}/{session.session_id}", headers=session.headers)
        except httpx.HTTPError as error:  # the verifier's idle TTL frees it anyway
            logger.debug("closing pipelined session %s failed: %s", session.session_id, error)

    async def _open(self, session: RemoteSession, opening: PipelineOpen) -> PipelineOpened:
        try:
            response = await self._http.post(SESSIONS_PATH, content=opening.model_dump_json(), headers=session.headers)
        except httpx.HTTPError as error:
            raise ServiceUnavailableError(f"the verifier is unreachable: {error}", code="verifier_unavailable") from error
        if response.status_code == 404:
            raise PipelineUnsupported("the verifier does not serve /v1/pipeline/sessions (--pipelined-sessions)")
        await _raise_for_status(response)
        return PipelineOpened.model_validate_json(response.content)

    async def _resume(self, session: RemoteSession, held: list[int]) -> None:
        """Open ``session`` again, from every token ``held``, on a verifier that lost it."""
        logger.warning("session %s: the verifier does not hold it; opening it again after %d tokens", session.session_id, len(held))
        try:
            await self._open(session, session.resumed_opening(held))
        except PipelineUnsupported as error:  # a replica without the wire took the session
            message = f"the session moved to a verifier without the wire: {error}"
            raise ServiceUnavailableError(message, code="verifier_unavailable") from error
        session.offset = len(held)
        session.num_resumes += 1

    async def _stream(self, session: RemoteSession, after: int) -> AsyncIterator[DecidedTokens]:
        path = f"{SESSIONS_PATH}/{session.session_id}/decided"
        headers = {name: value for name, value in session.headers.items() if name != "content-type"}
        async with self._http.stream("GET", path, params={"after": after}, headers=headers, timeout=_STREAM_TIMEOUT) as response:
            if response.status_code == 404 and await _error_code(response) == "session_not_found":
                raise SessionGone(session.session_id)
            if response.status_code >= 500:
                await response.aread()
                raise BadAnswer(f"the decided stream was answered {response.status_code}: {response.text[:200]}")
            await _raise_for_status(response)
            async for line in response.aiter_lines():
                if line.startswith("data:"):
                    try:
                        event = DecidedTokens.model_validate_json(line.removeprefix("data:"))
                    except ValueError as error:  # garbled on the way
                        raise BadAnswer(f"a decided event did not parse ({str(error).splitlines()[0]})") from None
                    yield event


_STREAM_TIMEOUT = httpx.Timeout(10.0, read=None)
"""A decided stream waits as long as the session decodes (the verifier pings it every 15 s)."""


async def _error_code(response: httpx.Response) -> str | None:
    await response.aread()
    try:
        return str(response.json()["error"]["code"])
    except (ValueError, KeyError, TypeError):
        return None


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
