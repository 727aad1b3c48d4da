"""Pipelined sessions (experimental, ``--pipelined-sessions``; the wire is
``verifier_service.pipeline_protocol``): the verifier owns each session's decoding and keeps it in
every forward, and the edge's drafts are proposals it reads when they help.

A ``PipelinedSession`` submits one block per forward, the moment the one before is decided:
the drafts of the session's latest proposal that continue what it has decided
(``spade_core.proposals.aligned_proposal``) up to the backend's advice (its cost curve under
the load: ``advised_draft_length``), or none (a target-only step). Each forward's tokens
(the accepted drafts, then the target's own next token) go to the edge's stream at once. On
today's wire a session leaves the forwards for every round trip and every stretch of drafting;
here the edge's proposals arrive while it is decoded, several per round trip if the edge sends
them, and a forward takes whichever is current.

Exactness. Every forward is a verify call of its own on the committed context: drafts after
exactly the decided tokens, under the acceptance rule with a one-hot q (the proposal carries
token ids only: accept x with probability p(x), at a rejection sample p with x removed), so each
token is the target's. Which drafts a forward takes depends on the proposals that arrived (on
timing) and on the decided tokens before them, never on the target's p at the positions it
verifies. Greedy text is the target's at any timing. At temperature > 0 the text follows the
target's distribution, but a seed no longer fixes it: a position decided by a step with nothing
proposed draws the target's seeded sample, one decided by the acceptance rule draws its own.

Bounded work. A session decodes at most ``window_tokens`` past what its edge has acknowledged
(each proposal's ``seen``), then waits: a stalled or vanished edge costs no forward; closing the
session (or its idle TTL, or the service's shutdown) cancels its step. The registry holds at most
``max_sessions``: another open is refused at once (429, Retry-After).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, replace
from typing import Literal, Protocol

import numpy as np

from gateway.errors import InvalidRequestError, OverloadedError, SessionNotFoundError
from spade_core.proposals import Proposal, aligned_proposal
from verifier_service.backends.base import BlockToVerify, BlockVerdict, VerifierBackend
from verifier_service.metrics import VerifierMetrics
from verifier_service.pipeline_protocol import (
    DecidedTokens,
    FinishReason,
    PipelineClosed,
    PipelineOpen,
    PipelineOpened,
    PipelineProposal,
    decided_digest,
)
from verifier_service.prefix_sharing import PrefixSharing, prefix_namespace
from verifier_service.protocol import context_digest
from verifier_service.service import owned_session_id
from verifier_service.verify_input import check_token_ids

logger = logging.getLogger(__name__)

ProposalOutcome = Literal["used", "stale", "superseded", "passed"]
StepObserver = Callable[[BlockToVerify | None, BlockVerdict | None, list[int], int], None]
"""Told of each step's verify block and verdict (None where the engine runs its own steps: vLLM's
session route), the tokens it decided, and how many of them came from the proposal."""


@dataclass(frozen=True)
class PipelineLimits:
    window_tokens: int
    """Tokens a session decodes past its edge's acknowledgement at most."""
    max_draft_length: int
    """Proposed tokens one forward verifies at most."""
    max_sessions: int
    idle_ttl_s: float = 600.0
    """Seconds without a proposal or a stream reader after which a session is closed."""


def decided_events(events: list[DecidedTokens], after: int) -> list[DecidedTokens]:
    """The events that carry generated tokens from index ``after`` on, the first one cut to start
    at ``after`` (its proposal count cut with it).

    Example: events [0:3] (2 from the proposal), [3:4]; after 1 -> [1:3] (1 from it), [3:4]."""
    kept = []
    for event in events:
        end = event.start + len(event.token_ids)
        if end <= after and event.finish_reason is None:
            continue
        skip = max(0, after - event.start)
        if skip:
            event = event.model_copy(
                update={
                    "start": event.start + skip,
                    "token_ids": event.token_ids[skip:],
                    "num_from_proposal": max(0, event.num_from_proposal - skip),
                }
            )
        kept.append(event)
    return kept


def decided_tokens(proposed: list[int], verdict: BlockVerdict, eos_token_ids: frozenset[int], room: int):
    """A forward's tokens (the accepted drafts, then the next token), cut after an end-of-sequence
    token and at ``room``; with how many lead from the proposal and the finish they reach.

    Example: drafts [4, 5, 6], 2 accepted, next 9, room 2 -> ([4, 5], 2, "length")."""
    tokens = proposed[: verdict.num_accepted] + [verdict.next_token_id]
    finish: FinishReason | None = None
    for index, token in enumerate(tokens):
        if token in eos_token_ids:
            tokens, finish = tokens[: index + 1], "stop"
            break
    if len(tokens) >= room:
        tokens, finish = tokens[:room], finish or "length"
    return tokens, min(verdict.num_accepted, len(tokens)), finish


class PipelinedSession:
    """One session decoded forward after forward from its prompt (see the module's docstring).

    Example: prompt [5, 6], window 4, no proposal: it steps t0 on [5, 6], t1 on [5, 6, t0], ...
    and waits after t3 until a proposal acknowledges some; a proposal [t1, d1, d2] from position
    3 then has its next forward verify [d1, d2] after t1 (if t1 is what it decided)."""

    def __init__(
        self,
        backend: VerifierBackend,
        template: BlockToVerify,
        max_tokens: int,
        limits: PipelineLimits,
        on_step: StepObserver = lambda block, verdict, tokens, num_proposed: None,
        on_proposal: Callable[[ProposalOutcome], None] = lambda outcome: None,
    ) -> None:
        """``template``: the session's id, prompt (its context), sampling and namespace;
        ``on_step``: told of each forward's block, verdict, decided tokens and how many of
        them came from the proposal; ``on_proposal``: of what became of each proposal."""
        self._backend = backend
        self.template = template
        self.prompt = list(template.context_token_ids)
        self.max_tokens = max_tokens
        self.limits = limits
        self.generated: list[int] = []
        self.events: list[DecidedTokens] = []
        self.acknowledged = 0
        self.finish_reason: FinishReason | None = None
        self.last_active = time.monotonic()
        self._proposal: Proposal | None = None
        self._proposal_read = False
        self._proposal_sequence = -1
        self._on_step = on_step
        self._on_proposal = on_proposal
        self._changed = asyncio.Event()
        self._task = asyncio.get_running_loop().create_task(self._run())

    @property
    def session_id(self) -> str:
        return self.template.session_id

    def propose(self, proposal: PipelineProposal) -> None:
        """Take the edge's acknowledgement and, unless a later-numbered one came first, its
        proposal (replacing an unread one)."""
        self.last_active = time.monotonic()
        self.acknowledged = max(self.acknowledged, min(proposal.seen, len(self.generated)))
        if proposal.draft_tokens and proposal.sequence >= self._proposal_sequence:
            self._proposal_sequence = proposal.sequence
            self._drop_proposal("superseded")
            self._proposal = Proposal(proposal.start, np.asarray(proposal.draft_tokens, dtype=np.int64))
            self._proposal_read = False
        self._notify()

    async def decided(self, after: int) -> AsyncIterator[DecidedTokens]:
        """The decided tokens from generated index ``after`` on, as they are decided, until the
        session's finish (the last event carries ``finish_reason``)."""
        events, sent = decided_events(self.events, after), len(self.events)  # then only the events after those
        while True:
            self.last_active = time.monotonic()
            for event in events:
                yield self._sealed(event)
                if event.finish_reason is not None:
                    return
            changed = self._changed
            if len(self.events) > sent:  # decided while the events above were sent
                events, sent = self.events[sent:], len(self.events)
                continue
            if self.finish_reason is not None:  # finished with no event of its own (closed, error)
                yield self._sealed(DecidedTokens(start=len(self.generated), token_ids=[], finish_reason=self.finish_reason))
                return
            await changed.wait()
            events, sent = self.events[sent:], len(self.events)

    def _sealed(self, event: DecidedTokens) -> DecidedTokens:
        """``event`` with its digest (``decided_digest``), over the context through its last token."""
        end = event.start + len(event.token_ids)
        return event.model_copy(update={"digest": decided_digest(event, context_digest(self.prompt + self.generated[:end]))})

    def window_full(self) -> bool:
        """Whether the session has decoded its window past its edge's acknowledgement."""
        return len(self.generated) - self.acknowledged >= self.limits.window_tokens

    def close(self, reason: FinishReason = "closed") -> None:
        """Stop decoding now (a step in a forward is dropped by the scheduler, or its result is)."""
        self._finish(reason)
        self._task.cancel()

    async def aclose(self) -> None:
        self.close()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task

    # --- the decoding loop ----------------------------------------------------------------------

    async def _run(self) -> None:
        """Decode until the session finishes: past the window, wait for the edge; else advance
        by one step of the backend's (``_advance``) on the decided context."""
        try:
            while self.finish_reason is None:
                if self.window_full():
                    changed = self._changed
                    await changed.wait()
                    continue
                context = self.prompt + self.generated
                room = min(self.max_tokens - len(self.generated), self._backend.model.room(len(context)))
                if room <= 0:
                    self._finish("length")
                    break
                await self._advance(context, room)
        except asyncio.CancelledError:
            raise
        except Exception:  # what was decided before stands; the stream ends with "error"
            logger.warning("pipelined session %s: a step failed after %d tokens", self.session_id, len(self.generated), exc_info=True)
            self._finish("error")
        finally:
            self._ended()

    async def _advance(self, context: list[int], room: int) -> None:
        """One forward: the current proposal's drafts after ``context`` (or none) verified as a
        block, its tokens decided (at most ``room``)."""
        proposed = self._proposed(context, self._draft_limit(room))
        block = replace(self.template, context_token_ids=context, draft_token_ids=proposed, draft_probs=None)
        verdict = await self._backend.verify_block(block)
        if self.finish_reason is not None:
            return
        tokens, num_from_proposal, finish = decided_tokens(proposed, verdict, self._backend.model.eos_token_ids, room)
        self._on_step(block, verdict, tokens, num_from_proposal)
        self._decide(tokens, num_from_proposal, finish)

    def _ended(self) -> None:
        """Called once the decoding loop has stopped, however it stopped."""

    def _draft_limit(self, room: int) -> int:
        """Drafts the next forward may verify: the verifier's bound and the room left, and the
        backend's advice from its cost curve and load where it gives one (fewer rows each while
        forwards are full, none where a drafted row costs more than it brings)."""
        advice = self._backend.advised_draft_length(self.session_id)
        limit = min(self.limits.max_draft_length, room - 1)
        return limit if advice is None else min(limit, advice)

    def _proposed(self, context: list[int], limit: int) -> list[int]:
        """The current proposal's drafts after ``context`` (at most ``limit``); a proposal the
        decided tokens contradicted or passed is dropped."""
        proposal = self._proposal
        if proposal is None:
            return []
        drafts = aligned_proposal(context, len(context), proposal, limit)
        if drafts:
            self._proposal_read = True
            return drafts
        passed = len(context) - proposal.start
        if passed >= len(proposal.token_ids):
            self._drop_proposal("passed")
        elif passed >= 0 and limit > 0:
            self._drop_proposal("stale")
        return []

    def _drop_proposal(self, outcome: ProposalOutcome) -> None:
        if self._proposal is not None:
            self._on_proposal("used" if self._proposal_read else outcome)
        self._proposal = None

    def _decide(self, tokens: list[int], num_from_proposal: int, finish: FinishReason | None) -> None:
        event = DecidedTokens(start=len(self.generated), token_ids=tokens, num_from_proposal=num_from_proposal, finish_reason=finish)
        self.generated += tokens
        self.events.append(event)
        if finish is not None:
            self._finish(finish)
        self._notify()

    def _finish(self, reason: FinishReason) -> None:
        if self.finish_reason is None:
            self.finish_reason = reason
            self._drop_proposal("passed")
        self._notify()

    def _notify(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()


class KvHolder(Protocol):
    """Where pipelined sessions' caches count against the verifier's KV budget
    (``--max-kv-cache-bytes``), beside the verify sessions' (``VerifierService.hold_kv``)."""

    def hold_kv(self, key: str, owner: str, num_tokens: int) -> None: ...

    def release_kv(self, key: str) -> None: ...


def kv_key(owned_id: str) -> str:
    """The KV budget's key of a pipelined session (apart from the verify sessions' ids)."""
    return f"pipeline:{owned_id}"


class PipelineSessions:
    """The verifier's pipelined sessions by owned id: open, propose, stream, close. Each session's
    cache counts against the KV budget for its whole life (prompt + max_tokens, held at open: a
    verifier whose budget is spoken for answers 429 ``kv_cache_full`` at once)."""

    def __init__(
        self,
        backend: VerifierBackend,
        limits: PipelineLimits,
        metrics: VerifierMetrics,
        prefix_sharing: PrefixSharing = "per-key",
        kv: KvHolder | None = None,
        session_type: type[PipelinedSession] = PipelinedSession,
    ) -> None:
        """``kv``: where the sessions' caches are counted (None: nowhere, as in unit tests);
        ``session_type``: what decodes a session (``verifier_service.backends.pipelined_session_type``)."""
        self.backend = backend
        self.session_type = session_type
        self.limits = limits
        self.metrics = metrics
        self.prefix_sharing: PrefixSharing = prefix_sharing
        self.kv = kv
        self._sessions: dict[str, PipelinedSession] = {}
        metrics.pipeline_sessions.set_function(lambda: len(self._sessions))

    def open(self, request: PipelineOpen, owner: str = "") -> PipelineOpened:
        self.drop_idle()
        owned_id = owned_session_id(owner, request.session_id)
        model = self.backend.model
        if owned_id in self._sessions:
            raise InvalidRequestError(
                f"pipelined session {request.session_id!r} is open already", param="session_id", code="session_exists"
            )
        if len(self._sessions) >= self.limits.max_sessions:
            raise OverloadedError(
                f"{len(self._sessions)} pipelined sessions are open, the most this verifier holds", code="too_many_sessions"
            )
        check_token_ids(request.prompt_tokens, model.vocab_size, "prompt_tokens", code="invalid_token_id")
        model.check_fits(len(request.prompt_tokens), 1, "prompt_tokens")
        namespace = prefix_namespace(self.prefix_sharing, owner, request.cache_salt)
        template = BlockToVerify(owned_id, list(request.prompt_tokens), [], None, request.sampling.to_config(), None, namespace)
        if self.kv is not None:  # last: a refused open holds nothing
            self.kv.hold_kv(kv_key(owned_id), owner, len(request.prompt_tokens) + request.max_tokens)
        self._sessions[owned_id] = self.session_type(
            self.backend, template, request.max_tokens, self.limits, self._stepped, self._proposal_done
        )
        self.metrics.prompt_tokens.inc(len(request.prompt_tokens))
        return PipelineOpened(
            session_id=request.session_id, window_tokens=self.limits.window_tokens, max_draft_length=self.limits.max_draft_length
        )

    def propose(self, session_id: str, proposal: PipelineProposal, owner: str = "") -> None:
        if len(proposal.draft_tokens) > self.limits.window_tokens + self.limits.max_draft_length:
            raise InvalidRequestError(
                f"a proposal holds at most {self.limits.window_tokens + self.limits.max_draft_length} tokens",
                param="draft_tokens",
                code="proposal_too_long",
            )
        check_token_ids(proposal.draft_tokens, self.backend.model.vocab_size, "draft_tokens", code="invalid_token_id")
        self._session(session_id, owner).propose(proposal)

    def decided(self, session_id: str, after: int, owner: str = "") -> AsyncIterator[DecidedTokens]:
        session = self._session(session_id, owner)
        if after > len(session.generated):
            raise InvalidRequestError(
                f"after={after}, but the session has decided {len(session.generated)} tokens", param="after", code="invalid_position"
            )
        return session.decided(after)

    def close(self, session_id: str, owner: str = "") -> PipelineClosed:
        owned_id = owned_session_id(owner, session_id)
        session = self._sessions.pop(owned_id, None)
        if session is None:
            raise SessionNotFoundError(f"no pipelined session {session_id!r}", param="session_id", code="session_not_found")
        session.close()
        self._release(owned_id)
        return PipelineClosed(session_id=session_id, num_generated=len(session.generated))

    def drop_idle(self) -> None:
        """Close sessions idle past the TTL (no proposal, no stream reader)."""
        deadline = time.monotonic() - self.limits.idle_ttl_s
        for owned_id, session in list(self._sessions.items()):
            if session.last_active < deadline:
                self._sessions.pop(owned_id).close()
                self._release(owned_id, retain=False)

    async def aclose(self) -> None:
        sessions, self._sessions = dict(self._sessions), {}
        for owned_id, session in sessions.items():
            await session.aclose()
            if self.kv is not None:
                self.kv.release_kv(kv_key(owned_id))

    def _release(self, owned_id: str, retain: bool = True) -> None:
        """A closed session's cache: freed in the backend (kept as a shared prefix if ``retain``)
        and no longer counted in the KV budget."""
        self.backend.release_session(owned_id, retain)
        if self.kv is not None:
            self.kv.release_kv(kv_key(owned_id))

    def _session(self, session_id: str, owner: str) -> PipelinedSession:
        session = self._sessions.get(owned_session_id(owner, session_id))
        if session is None:
            raise SessionNotFoundError(f"no pipelined session {session_id!r}", param="session_id", code="session_not_found")
        return session

    def _proposal_done(self, outcome: ProposalOutcome) -> None:
        self.metrics.pipeline_proposals.labels(outcome).inc()

    def _stepped(self, block: BlockToVerify | None, verdict: BlockVerdict | None, tokens: list[int], num_from_proposal: int) -> None:
        if block is not None and verdict is not None:
            self.metrics.observe_forward(verdict, block.num_drafted)
            self.metrics.drafted_tokens.inc(block.num_drafted)
            self.metrics.accepted_tokens.inc(verdict.num_accepted)
        self.metrics.pipeline_tokens.labels("proposal").inc(num_from_proposal)
        self.metrics.pipeline_tokens.labels("verifier").inc(len(tokens) - num_from_proposal)
