"""The verify service: validates a call, checks it against the session, asks the backend for
the verdict and commits it. Bad input is refused before any state changes, and a failed call
leaves the session as it was."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field, replace

import torch

from gateway.engine import TopLogprobs as TopLogprobsOfToken
from gateway.errors import OverloadedError, SessionConflictError
from verifier_service.audit import AuditLog, VerdictAudit
from verifier_service.backends.base import BlockToVerify, BlockVerdict, VerifierBackend
from verifier_service.metrics import VerifierMetrics
from verifier_service.prefix_sharing import PrefixSharing, prefix_namespace
from verifier_service.protocol import (
    SESSION_RESYNC_CODE,
    SessionDeleted,
    TopLogprobs,
    VerifyRequest,
    VerifyResponse,
    VerifyTimings,
    WireSampling,
    context_digest,
    verdict_digest,
)
from verifier_service.sessions import Session, SessionRegistry
from verifier_service.steps_ahead import DecidedAnswer, SessionStepper, answer_from_decided
from verifier_service.verify_input import checked_request

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class VerifyLimits:
    max_draft_length: int = 64
    """Longest draft length (drafted tokens) accepted in one call."""
    max_draft_support: int = 256
    """Most tokens in one drafted position's sparse distribution."""
    max_continued_tokens: int = 64
    """Most tokens one call continues by itself (``continued``), whatever the call allows; 0: never."""
    max_ahead_tokens: int = 0
    """Most tokens decoded ahead of a session's next call (``steps_ahead``), within what each
    call allows (its ``max_continued_tokens``); 0: lock-step."""

    def __post_init__(self) -> None:
        if self.max_draft_length < 1 or self.max_draft_support < 1 or self.max_continued_tokens < 0 or self.max_ahead_tokens < 0:
            raise ValueError("verify limits must be positive (max_continued_tokens, max_ahead_tokens: >= 0)")


@dataclass
class Continuation:
    """The target-only steps one call ran on by itself after its verdict (``VerifierService.continued``)."""

    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[TopLogprobsOfToken] = field(default_factory=list)
    num_target_tokens: int = 0
    forward_s: float = 0.0

    def add(self, verdict: BlockVerdict) -> None:
        """One block-less step's token, with its logprobs and cost."""
        self.token_ids.append(verdict.next_token_id)
        self.logprobs += verdict.logprobs or []
        self.top_logprobs += verdict.top_logprobs or []
        self.num_target_tokens += verdict.num_target_tokens
        self.forward_s += verdict.forward_s


class VerifierService:
    """The cloud half's verify service: answers the edge's verify calls. It validates a call
    against the wire's limits, checks it against the edge's session (the committed length and
    digest; 409 ``session_resync_required`` when they differ, and a repeated call answered from
    memory), has the backend's target accept the longest prefix of the drafted block and add its
    own next token, and commits that verdict to the session, so the next call carries only its
    new block. Bad input changes nothing, and a failed call leaves the session as it was."""

    def __init__(
        self,
        backend: VerifierBackend,
        sessions: SessionRegistry,
        limits: VerifyLimits,
        metrics: VerifierMetrics,
        prefix_sharing: PrefixSharing = "per-key",
        audit: AuditLog | None = None,
    ) -> None:
        """``prefix_sharing``: which calls may share cached prefixes (``prefix_sharing``);
        ``audit``: where every verdict and its inputs are recorded (None: nowhere)."""
        self.audit = audit
        self.backend = backend
        self.sessions = sessions
        self.limits = limits
        self.metrics = metrics
        self.prefix_sharing: PrefixSharing = prefix_sharing
        self._steppers: dict[str, SessionStepper] = {}
        """The sessions decoded ahead of their next call (``steps_ahead``), by owned session id."""
        metrics.kv_cache_bytes.set_function(lambda: sessions.kv_bytes)  # read at each scrape
        retained, budget = sessions.retained, sessions.kv_budget
        if retained is not None and budget is not None:
            metrics.prefix_store_bytes.set_function(lambda: retained.num_retained_tokens * budget.bytes_per_token)
            metrics.prefix_store_entries.set_function(lambda: retained.num_retained)

    async def verify(self, request: VerifyRequest, owner: str = "") -> VerifyResponse:
        """``owner``: the caller's key id (``gateway.security.key_id``; "" without keys): each
        owner has its own namespace of sessions, so another key's session is simply unknown."""
        received_at = time.perf_counter()
        draft_probs = checked_request(request, self.backend.model, self.limits.max_draft_length, self.limits.max_draft_support)
        session = self._session_for(request, owned_session_id(owner, request.session_id), owner)
        fingerprint = request.fingerprint()
        async with session.lock:
            if session.last_fingerprint == fingerprint and session.last_response is not None:
                self.metrics.replayed_calls.inc()
                return session.last_response.model_copy(update={"replayed": True})
            self._check_prefix(session, request)
            context = session.token_ids[: request.prefix_length] + request.new_tokens
            namespace = prefix_namespace(self.prefix_sharing, owner, request.cache_salt)
            sampling = request.sampling.to_config()
            whole = BlockToVerify(
                session.session_id, context, request.draft_tokens, draft_probs, sampling, request.num_top_logprobs, namespace
            )
            confirmed: list[BlockVerdict] = []
            stepper = self._steppers.pop(session.session_id, None)
            if stepper is not None:
                self.backend.call_arrived(session.session_id, received_at, len(request.draft_tokens))
                try:
                    settled = await self._settle(stepper, whole, request.max_continued_tokens)
                except BaseException:  # the caller went away while a step was awaited: nothing steps on unowned
                    stepper.cancel()
                    raise
                if isinstance(settled, DecidedAnswer):
                    response = self._answer_from_decided(session, request, stepper, settled, fingerprint, received_at)
                    return self._answered(request, session, response, len(context))
                confirmed = settled
            num_confirmed = len(confirmed)
            context_after = context + [verdict.next_token_id for verdict in confirmed]
            remaining_probs = None if draft_probs is None or num_confirmed >= len(request.draft_tokens) else draft_probs[num_confirmed:]
            draft_tokens, remaining_probs = self._cut_to_advice(session, request.draft_tokens[num_confirmed:], remaining_probs)
            block = replace(whole, context_token_ids=context_after, draft_token_ids=draft_tokens, draft_probs=remaining_probs)
            self._release(self.sessions.reserve(session, len(context_after) + len(draft_tokens)), retain=False)
            try:
                verdict = await self.backend.verify_block(block)
            finally:
                session.reserved_tokens = 0
            self.metrics.observe_verify(len(draft_tokens), verdict)
            if self.audit is not None:
                rows = (
                    None
                    if request.draft_probs is None or not draft_tokens
                    else request.draft_probs[num_confirmed : num_confirmed + len(draft_tokens)]
                )
                self.audit.record(
                    VerdictAudit(
                        context=context_after,
                        draft_tokens=draft_tokens,
                        draft_probs=rows,
                        sampling=request.sampling,
                        num_accepted=verdict.num_accepted,
                        next_token=verdict.next_token_id,
                    )
                )
            verdict = after_confirmed(confirmed, verdict)
            advice = self._advice(session.session_id)
            committed = context + request.draft_tokens[: verdict.num_accepted] + [verdict.next_token_id]
            continuation = Continuation()
            if advice == 0 and verdict.next_token_id not in self.backend.model.eos_token_ids:
                continuation = await self.continued(
                    session, block, committed, min(request.max_continued_tokens, self.limits.max_continued_tokens)
                )
                committed += continuation.token_ids
                advice = self._advice(session.session_id)
            committed_digest = context_digest(committed)
            response = self._response(request, len(context), verdict, continuation, received_at, advice)
            response = sealed(response, fingerprint, committed_digest)
            session.commit(committed, committed_digest, fingerprint, response)
            session.advised_draft_length = advice
            self._step_ahead(session, block, committed, request)
        return self._answered(request, session, response, len(context))

    def _answered(self, request: VerifyRequest, session: Session, response: VerifyResponse, context_length: int) -> VerifyResponse:
        """What every answered call counts and frees (``response`` is already committed)."""
        self.metrics.advised_draft_length.observe(response.advised_draft_length)
        if request.prefix_length == 0:
            self.metrics.prompt_tokens.inc(context_length)
        self._evict(keep=session.session_id)
        return response

    # --- stepping ahead (``steps_ahead``) ---------------------------------------------------------

    def _step_ahead(self, session: Session, block: BlockToVerify, committed: list[int], request: VerifyRequest) -> None:
        """Start decoding ``session`` on after ``committed`` while its edge drafts (within the
        call's allowance and the context's room, where the KV budget has room for it now: the
        session stays evictable, and eviction stops it). A request's first call allows no
        continuation (its first token goes out at once), but the steps ahead delay nothing: it
        steps the verifier's whole window, which a request shorter than that wastes at most."""
        allowed = self.limits.max_ahead_tokens if request.prefix_length == 0 else request.max_continued_tokens
        max_ahead = min(self.limits.max_ahead_tokens, allowed)
        room = self.backend.model.room(len(committed))
        if max_ahead <= 0 or room <= 0 or committed[-1] in self.backend.model.eos_token_ids:
            return
        try:
            self._release(self.sessions.reserve(session, len(committed) + min(max_ahead, room)), retain=False)
        except OverloadedError:
            return  # no room to grow its cache now: lock-step until the next call
        finally:
            session.reserved_tokens = 0
        sampling = request.sampling
        self._steppers[session.session_id] = SessionStepper(
            self.backend, block, committed, max_ahead, room, lambda context, verdict: self._stepped(context, verdict, sampling)
        )

    def _stepped(self, context: list[int], verdict: BlockVerdict, sampling: WireSampling) -> None:
        self.metrics.observe_forward(verdict)
        self.metrics.ahead_steps.inc()
        if self.audit is not None:
            self.audit.record(
                VerdictAudit(
                    context=context, draft_tokens=[], draft_probs=None, sampling=sampling, num_accepted=0, next_token=verdict.next_token_id
                )
            )

    async def _settle(self, stepper: SessionStepper, block: BlockToVerify, max_continued: int) -> DecidedAnswer | list[BlockVerdict]:
        """The tokens decided ahead against the call's block (``answer_from_decided``): the
        answer they give, or the decided steps that each confirm a draft (the stepper stopped;
        the rest of the block goes to a forward after them). A step in the forward running now
        is waited for (it is decided at that forward's end, before the block could be verified);
        one only queued is withdrawn, unless no draft is left past the decided ones (then it is
        the very step the call needs)."""
        if not stepper.continues(block.context_token_ids, block):
            self.metrics.ahead_tokens.labels("dropped").inc(len(await stepper.stop()))
            return []
        while True:
            answer = answer_from_decided(block.draft_token_ids, stepper.decided_tokens, max_continued)
            if answer is not None:
                logger.debug("session %s: %d drafted, answered from %d decided ahead", block.session_id, block.num_drafted, answer.num_used)
                return answer
            drafts_left = block.num_drafted > len(stepper.decided)
            if stepper.is_stepping and (not drafts_left or self.backend.is_in_forward(block.session_id)):
                logger.debug(
                    "session %s: %d drafted, %d decided: waits for the step under way",
                    block.session_id,
                    block.num_drafted,
                    len(stepper.decided),
                )
                await stepper.next_step()
                continue
            logger.debug(
                "session %s: %d drafted, %d decided confirm them (a step %s)",
                block.session_id,
                block.num_drafted,
                len(stepper.decided),
                "withdrawn" if stepper.is_stepping else "none under way",
            )
            confirmed = await stepper.stop()
            self.metrics.ahead_tokens.labels("used").inc(len(confirmed))
            self.metrics.ahead_drafts.labels("confirmed").inc(len(confirmed))
            return confirmed

    def _answer_from_decided(
        self, session: Session, request: VerifyRequest, stepper: SessionStepper, answer: DecidedAnswer, fingerprint: str, received_at: float
    ) -> VerifyResponse:
        """Answer and commit the call from the decided steps alone; the stepper goes on after them."""
        context = list(stepper.committed)
        used = stepper.take(answer.num_used)
        tokens = [verdict.next_token_id for verdict in used]
        self.metrics.ahead_answers.inc()
        self.metrics.ahead_tokens.labels("used").inc(len(used))
        self.metrics.ahead_drafts.labels("confirmed").inc(answer.num_accepted)
        self.metrics.ahead_drafts.labels("stale").inc(len(request.draft_tokens) - answer.num_accepted)
        advice = self._advice(session.session_id)
        verdict, continuation = decided_verdict(used, answer.num_accepted, len(request.draft_tokens))
        response = self._response(request, len(context), verdict, continuation, received_at, advice)
        committed = context + tokens
        committed_digest = context_digest(committed)
        response = sealed(response, fingerprint, committed_digest)
        session.commit(committed, committed_digest, fingerprint, response)
        session.advised_draft_length = advice
        self._steppers[session.session_id] = stepper
        self.backend.answered_without_forward(session.session_id)
        return response

    def _drop_stepper(self, session_id: str) -> None:
        stepper = self._steppers.pop(session_id, None)
        if stepper is not None:
            self.metrics.ahead_tokens.labels("dropped").inc(len(stepper.cancel()))

    def _advice(self, session_id: str) -> int:
        advised = self.backend.advised_draft_length(session_id)
        return self.limits.max_draft_length if advised is None else advised

    async def continued(self, session: Session, block: BlockToVerify, committed: list[int], max_tokens: int) -> Continuation:
        """Target-only steps of ``session`` after its committed context, while the backend's
        advice for it stays 0 (no drafted row pays), at most ``max_tokens``, through an
        end-of-sequence token, within the context limit. Each step is the call a block-less
        verify call would make (the same scheduler, cache and seeded draws), so the tokens are
        exactly those. A step that fails ends the continuation: what came before it stands."""
        continuation = Continuation()
        max_tokens = min(max_tokens, self.backend.model.room(len(committed)))
        if max_tokens <= 0:
            return continuation
        context = list(committed)
        try:
            self._release(self.sessions.reserve(session, len(committed) + max_tokens), retain=False)
        except OverloadedError:
            return continuation  # no room to grow the cache now: the edge's next call asks again
        try:
            while len(continuation.token_ids) < max_tokens:
                step = replace(block, context_token_ids=context, draft_token_ids=[], draft_probs=None, continued_step=True)
                try:
                    verdict = await self.backend.verify_block(step)
                except Exception:  # the verdict already answered stands; the next call goes on
                    logger.warning(
                        "session %s: continuing failed after %d tokens", session.session_id, len(continuation.token_ids), exc_info=True
                    )
                    break
                self.metrics.observe_forward(verdict)
                self.metrics.continued_tokens.inc()
                continuation.add(verdict)
                context.append(verdict.next_token_id)
                if verdict.next_token_id in self.backend.model.eos_token_ids or self._advice(session.session_id) > 0:
                    break
        finally:
            session.reserved_tokens = 0
        return continuation

    def _cut_to_advice(
        self, session: Session, draft_tokens: list[int], draft_probs: torch.Tensor | None
    ) -> tuple[list[int], torch.Tensor | None]:
        """A block longer than the session's last advice loses its tail: verifying a prefix of a
        block is exact (the verdict is the one a block of that length would get), so an edge that
        ignores the advice is served exactly but cannot make everyone's forwards longer."""
        advice = session.advised_draft_length
        if advice is None or len(draft_tokens) <= advice:
            return draft_tokens, draft_probs
        self.metrics.cut_blocks.inc()
        self.metrics.cut_tokens.inc(len(draft_tokens) - advice)
        return draft_tokens[:advice], None if draft_probs is None or advice == 0 else draft_probs[:advice]

    def end_session(self, session_id: str, owner: str = "") -> SessionDeleted:
        """Another owner's session is left alone (``deleted: false``, as for an unknown one)."""
        owned_id = owned_session_id(owner, session_id)
        self._drop_stepper(owned_id)
        deleted = self.sessions.remove(owned_id)
        self.backend.release_session(owned_id)
        self.metrics.sessions.set(len(self.sessions))
        return SessionDeleted(session_id=session_id, deleted=deleted)

    def _session_for(self, request: VerifyRequest, owned_id: str, owner: str) -> Session:
        if request.prefix_length == 0:
            return self.sessions.get_or_create(owned_id, owner)
        session = self.sessions.get(owned_id)
        if session is None:
            self.metrics.resyncs.inc()
            raise SessionConflictError(
                f"unknown session {request.session_id!r}: resend the full context with prefix_length 0",
                param="session_id",
                code=SESSION_RESYNC_CODE,
            )
        return session

    def _check_prefix(self, session: Session, request: VerifyRequest) -> None:
        if request.prefix_length == 0 or session.matches(request.prefix_length, request.prefix_digest):
            return
        self.metrics.resyncs.inc()
        raise SessionConflictError(
            f"session {request.session_id!r} does not hold the committed context that prefix_length and prefix_digest "
            "describe: resend the full context with prefix_length 0",
            param="prefix_digest",
            code=SESSION_RESYNC_CODE,
        )

    def _response(
        self,
        request: VerifyRequest,
        context_length: int,
        verdict: BlockVerdict,
        continuation: Continuation,
        received_at: float,
        advice: int,
    ) -> VerifyResponse:
        """The verdict on the wire; the timings' queue and model times are the verdict's, the
        forward time covers the continued steps' forwards too."""
        num_continued = len(continuation.token_ids)
        return VerifyResponse(
            session_id=request.session_id,
            num_accepted=verdict.num_accepted,
            next_token=verdict.next_token_id,
            next_token_kind="bonus" if verdict.is_bonus else "correction",
            # [] when not asked (the wire's logprobs is always a list)
            logprobs=(verdict.logprobs or []) + continuation.logprobs,
            top_logprobs=None
            if verdict.top_logprobs is None
            else [
                TopLogprobs(token_ids=[token_id for token_id, _ in top], logprobs=[logprob for _, logprob in top])
                for top in verdict.top_logprobs + continuation.top_logprobs
            ],
            continued_tokens=continuation.token_ids,
            context_length=context_length + verdict.num_accepted + 1 + num_continued,
            num_target_tokens=verdict.num_target_tokens + continuation.num_target_tokens,
            advised_draft_length=advice,
            num_cached_tokens=verdict.num_cached_tokens,
            timings=VerifyTimings(
                queue_ms=verdict.queue_s * 1e3,
                forward_ms=(verdict.forward_s + continuation.forward_s) * 1e3,
                total_ms=(time.perf_counter() - received_at) * 1e3,
                model_ms=None if verdict.model_s is None else verdict.model_s * 1e3,
            ),
        )

    def hold_kv(self, key: str, owner: str, num_tokens: int) -> None:
        """Hold ``num_tokens`` of the KV budget for a cache outside the verify sessions (a pipelined
        session's), evicting idle sessions as a verify call would; 429 ``kv_cache_full`` when no
        room can be made. ``release_kv`` gives it back."""
        self._release(self.sessions.hold(key, owner, num_tokens), retain=False)

    def release_kv(self, key: str) -> None:
        self.sessions.release_hold(key)

    def drop_expired_sessions(self) -> None:
        """Evict what is past its TTL or beyond the limits, as a call would before it runs."""
        self._release(self.sessions.evict())

    def _evict(self, keep: str) -> None:
        self._release(self.sessions.evict(keep=keep))

    def _release(self, session_ids: list[str], retain: bool = True) -> None:
        """``retain``: False for sessions evicted to make room (their memory is what is wanted)."""
        for session_id in session_ids:
            self._drop_stepper(session_id)
            self.backend.release_session(session_id, retain)
        self.metrics.sessions.set(len(self.sessions))


def owned_session_id(owner: str, session_id: str) -> str:
    """The registry's (and the backend's) id of a caller's session: the caller's namespace, then its id."""
    return f"{owner}/{session_id}" if owner else session_id


def sealed(response: VerifyResponse, fingerprint: str, committed_digest: str) -> VerifyResponse:
    """The response with its ``verdict_digest`` (over the call, the verdict and the committed context)."""
    return response.model_copy(update={"verdict_digest": verdict_digest(fingerprint, response, committed_digest)})


def after_confirmed(confirmed: list[BlockVerdict], verdict: BlockVerdict) -> BlockVerdict:
    """The verdict of a whole block whose first drafts were confirmed by decided steps
    (``confirmed``) and whose rest got ``verdict``: their tokens accepted, logprobs in order."""
    if not confirmed:
        return verdict
    logprobs = None if verdict.logprobs is None else [lp for step in confirmed for lp in step.logprobs or []] + verdict.logprobs
    top = None if verdict.top_logprobs is None else [t for step in confirmed for t in step.top_logprobs or []] + verdict.top_logprobs
    return replace(
        verdict,
        num_accepted=len(confirmed) + verdict.num_accepted,
        logprobs=logprobs,
        top_logprobs=top,
        num_target_tokens=verdict.num_target_tokens + sum(step.num_target_tokens for step in confirmed),
    )


def decided_verdict(used: list[BlockVerdict], num_accepted: int, num_drafted: int) -> tuple[BlockVerdict, Continuation]:
    """A call answered from the steps decided ahead (``used``, in order): the first
    ``num_accepted`` confirmed its drafts, the next is its next token, the rest continue it. No
    forward of its own: no queue time, the steps' forward time."""
    next_step = used[num_accepted]
    verdict = replace(
        after_confirmed(used[:num_accepted], next_step),
        is_bonus=num_accepted == num_drafted,
        queue_s=0.0,
        forward_s=sum(step.forward_s for step in used[: num_accepted + 1]),
        model_s=None,
        num_cached_tokens=0,
    )
    continuation = Continuation()
    for step in used[num_accepted + 1 :]:
        continuation.add(step)
    return verdict, continuation
