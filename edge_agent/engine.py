"""Speculative decoding on the edge: draft a block, verify it in the cloud, stream what the
target accepted plus its next token, repeat.

Prefill first: the first verify call of a request carries the prompt alone (an empty block), so
it leaves at once; the verifier prefills the target and answers the target's first token while
the edge prefills its draft model and, with overlap, drafts ahead of that token (``DraftAhead``).
The two prefills overlap instead of following each other. With no drafted token nothing can be
accepted: the first token is the target's own, drawn as its target-only routes draw it.

The edge never emits a token the verifier did not accept or produce, and never computes a
logprob: those of a request that asks come from the verifier, the target's. The loop ends at EOS, at
the token budget (the last block is drafted no longer than the budget needs, and its output cut
to the budget) or when the consumer closes the stream (stop string, client gone), which also
frees the draft cache and the verifier session.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncGenerator
from concurrent.futures import ThreadPoolExecutor

from edge_agent.draft_ahead import EMPTY_BLOCK, DraftAhead, Drafting, join_blocks
from edge_agent.draft_length import BlockOutcome, DraftLengthPolicy
from edge_agent.drafter import DraftBlock, Drafter, DraftSession
from edge_agent.metrics import EdgeMetrics
from edge_agent.verifier_client import VerifierClient, VerifierSession, VerifyCall
from gateway.engine import GeneratedTokens, GenerationRequest, TopLogprobs
from gateway.errors import ServiceUnavailableError
from gateway.model import ModelDescription
from gateway.protocol import SpadeStats


class SpeculativeEngine:
    """The edge's engine: serves OpenAI requests by speculative decoding against a remote
    verifier. It drafts blocks with the small draft model, has the verifier's target check each
    one (the target keeps the longest prefix it accepts and adds its own next token), and streams
    only tokens the target accepted or produced, so the output follows the target's distribution
    (at temperature 0 it is the target's own greedy text). It serves under the model the
    verifier's /health describes, drafts the next block while the verifier checks this one
    (``overlap``), sends the prompt alone first (``prefill_first``) and, with ``--fallback
    draft``, serves the draft alone while the verifier is unreachable."""

    def __init__(
        self,
        drafter: Drafter,
        tokenizer,
        client: VerifierClient,
        target: ModelDescription,
        draft_length_policy: DraftLengthPolicy,
        metrics: EdgeMetrics,
        fallback_to_draft: bool = False,
        overlap: bool = False,
        prefill_first: bool = False,
    ) -> None:
        self._drafter = drafter
        self._tokenizer = tokenizer
        self._client = client
        self._target = target
        self._draft_length_policy = draft_length_policy
        self._metrics = metrics
        self._fallback_to_draft = fallback_to_draft
        self._overlap = overlap
        """Draft the next block while the verifier checks this one."""
        self._prefill_first = prefill_first
        """The first verify call carries the prompt alone (every verifier of this wire version takes an empty block)."""
        # One drafting thread: draft forwards stay off the event loop, in arrival order.
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="draft-forward")

    @property
    def model(self) -> ModelDescription:
        """The target's description (from the verifier's /health): what the edge serves."""
        return self._target

    @property
    def tokenizer(self):
        return self._tokenizer

    @property
    def verifier_reachable(self) -> bool:
        return self._client.is_reachable

    @property
    def prefill_first(self) -> bool:
        """The first verify call of a request carries the prompt alone."""
        return self._prefill_first

    async def generate(self, request: GenerationRequest, stats: SpadeStats) -> AsyncGenerator[GeneratedTokens, None]:
        draft_session = self._drafter.start_session()
        verifier_session = self._client.open_session()
        policy = self._draft_length_policy.for_request()
        context = list(request.prompt_token_ids)
        num_generated = 0
        ahead: DraftAhead | None = None
        is_prompt_only = self._prefill_first
        draft_prefilled = False  # a block was drafted for this request (the first one prefilled the draft)
        self._metrics.requests.inc()
        self._metrics.active_requests.inc()
        try:
            while num_generated < request.max_tokens:
                remaining = request.max_tokens - num_generated
                num_drafted = 0 if is_prompt_only else self.draft_length(policy.next_length(), remaining, len(context))
                is_prompt_only = False
                await self._settle(ahead, stats)
                self._count_overlap(stats, ahead, context)
                block, drafting = await self._next_block(
                    draft_session, context, num_drafted, request, ahead, first_block=not draft_prefilled
                )
                draft_prefilled = draft_prefilled or bool(block.token_ids)
                ahead_limit = self._ahead_limit(policy, remaining, len(context), num_drafted)
                call, ahead = await self._verify_while_drafting_ahead(
                    draft_session, verifier_session, context, block, request, ahead_limit, stats
                )
                emitted = self._committed(stats, policy, block, call, drafting)
                if not emitted:  # the prompt-only call fell back to the draft: draft a block and serve that
                    self._discard(ahead)
                    ahead = None
                    continue
                context += emitted
                kept = self.kept_tokens(emitted, remaining, request.eos_token_ids)
                num_generated += kept
                self._metrics.generated_tokens.inc(kept)
                yield generated_tokens(emitted[:kept], call if request.num_top_logprobs is not None else None)
                if kept < len(emitted) or emitted[-1] in request.eos_token_ids:
                    return
        finally:
            self._discard(ahead)
            self._metrics.active_requests.dec()
            self._close_draft_session(draft_session)
            verifier_session.close()

    def draft_length(self, chosen: int, remaining: int, context_length: int) -> int:
        """The policy's choice, capped by what the budget can use (a block of d yields up
        to d + 1 tokens) and the context left (``gateway.model``: context + block must fit).
        Never below 1 (an empty block is only the prompt-only first call's, decided in ``generate``)."""
        return max(1, min(chosen, remaining - 1, self._target.room(context_length)))

    def _ahead_limit(self, policy, remaining: int, context_length: int, num_drafted: int) -> int:
        """Tokens worth drafting past the block while it is verified: the guess of the target's
        next token, then the next block, within what the budget and the context can still use.
        Example: 10 tokens left, a block of 4 -> at best 5 come back and 5 remain: the guess + 4.
        The prompt-only call (a block of 0), 10 left, length 5 -> the guess + 5; drafting the
        guess is also the draft's prefill of the prompt."""
        left_after_hit = remaining - (num_drafted + 1)
        if not self._overlap or left_after_hit <= 0:
            return 0
        room_after_hit = self._target.room(context_length + num_drafted + 1)
        next_block = min(policy.next_length(), left_after_hit - 1, room_after_hit)
        return 1 + max(0, next_block)

    @staticmethod
    def kept_tokens(emitted: list[int], remaining: int, eos_token_ids: frozenset[int]) -> int:
        """How many of the emitted tokens to deliver: up to the budget and through the first EOS."""
        for index, token_id in enumerate(emitted[:remaining]):
            if token_id in eos_token_ids:
                return index + 1
        return min(len(emitted), remaining)

    def _close_draft_session(self, session: DraftSession) -> None:
        """On the drafting thread, where a draft forward of this request may still be running;
        directly once the engine has shut that thread down."""
        try:
            self._executor.submit(session.close)
        except RuntimeError:
            session.close()

    async def _next_block(
        self,
        session: DraftSession,
        context: list[int],
        num_drafted: int,
        request: GenerationRequest,
        ahead: DraftAhead | None,
        first_block: bool = False,
    ) -> tuple[DraftBlock, Drafting]:
        """The block to verify next: what was drafted ahead for this context, completed by drafting now.
        A request's first drafted block (in line, or ahead during the prompt-only call) also
        prefilled the draft model over the prompt: no measure of drafting per token (t_draft)."""
        reused = ahead.continuation_of(context, num_drafted) if ahead is not None else EMPTY_BLOCK
        per_token_s = ahead.seconds_per_token if ahead is not None and reused.token_ids and not first_block else None
        if len(reused.token_ids) == num_drafted:
            return reused, Drafting(0.0, per_token_s)
        rest, draft_s = await self._draft(session, context + reused.token_ids, num_drafted - len(reused.token_ids), request)
        block = join_blocks(reused, rest)
        return block, Drafting(draft_s, None if first_block else draft_s / len(rest.token_ids))

    async def _draft(
        self, session: DraftSession, context: list[int], num_drafted: int, request: GenerationRequest
    ) -> tuple[DraftBlock, float]:
        started = time.perf_counter()
        loop = asyncio.get_running_loop()
        block = await loop.run_in_executor(self._executor, session.propose, list(context), num_drafted, request.sampling)
        return block, time.perf_counter() - started

    async def _verify_while_drafting_ahead(
        self,
        draft_session: DraftSession,
        verifier_session: VerifierSession,
        context: list[int],
        block: DraftBlock,
        request: GenerationRequest,
        ahead_limit: int,
        stats: SpadeStats,
    ) -> tuple[VerifyCall | None, DraftAhead | None]:
        """Send the block; until the verdict arrives, keep drafting past it one token at a time
        (a guess of the target's next token, then the block after it). A token in progress when
        the verdict lands is left pending (``DraftAhead.settle`` takes it before the next block):
        the drafting thread cannot be interrupted mid-forward, and the verdict need not wait."""
        verifying = asyncio.ensure_future(self._verify(verifier_session, context, block, request))
        ahead = DraftAhead(context + block.token_ids, [], None, 0.0)
        try:
            while len(ahead.token_ids) < ahead_limit and not verifying.done():
                ahead.pending = asyncio.ensure_future(self._draft(draft_session, ahead.sequence, 1, request))
                await asyncio.wait({verifying, ahead.pending}, return_when=asyncio.FIRST_COMPLETED)
                if not ahead.pending.done():
                    break
                await ahead.settle()
            self._metrics.draft_ahead_tokens.inc(len(ahead.token_ids))
            stats.draft_ahead_ms += ahead.seconds * 1e3
            call = await verifying
        except BaseException:
            ahead.discard()
            raise
        finally:
            if not verifying.done():  # the request was cancelled (client gone): so is its call
                verifying.cancel()
        return call, (ahead if ahead.token_ids or ahead.pending is not None else None)

    async def _verify(
        self, session: VerifierSession, context: list[int], block: DraftBlock, request: GenerationRequest
    ) -> VerifyCall | None:
        """The verdict and what the call cost; None when the verifier is unreachable and the edge
        falls back to the draft (never for a request that asked for logprobs: the draft's tokens
        have no target logprob)."""
        try:
            return await session.verify(context, block, request.sampling, request.num_top_logprobs)
        except ServiceUnavailableError:
            self._metrics.verify_failures.inc()
            if not self._fallback_to_draft or request.num_top_logprobs is not None:
                raise
            self._metrics.fallback_tokens.inc(len(block.token_ids))
            return None

    def _committed(self, stats: SpadeStats, policy, block: DraftBlock, call: VerifyCall | None, drafting: Drafting) -> list[int]:
        """The tokens the call commits: the accepted drafts and the next token; with no verdict
        (verifier unreachable, --fallback draft) the draft's own block, unverified."""
        if call is None:
            stats.fallback_tokens += len(block.token_ids)
            stats.draft_ms += drafting.exposed_s * 1e3
            return block.token_ids
        num_drafted = len(block.token_ids)
        count_call(stats, call, num_drafted, drafting)
        self._metrics.observe_call(call, num_drafted, drafting.exposed_s)
        policy.observe(block_outcome(call, num_drafted, drafting))
        return block.token_ids[: call.verdict.num_accepted] + [call.verdict.next_token]

    async def _settle(self, ahead: DraftAhead | None, stats: SpadeStats) -> None:
        """The token still being drafted ahead when the last verdict came, now that it is needed."""
        if ahead is None:
            return
        added, seconds = await ahead.settle()
        self._metrics.draft_ahead_tokens.inc(len(added.token_ids))
        stats.draft_ahead_ms += seconds * 1e3

    @staticmethod
    def _discard(ahead: DraftAhead | None) -> None:
        if ahead is not None:
            ahead.discard()

    def _count_overlap(self, stats: SpadeStats, ahead: DraftAhead | None, context: list[int]) -> None:
        """A hit: the committed context runs through the guess, so what was drafted ahead starts
        the next block (no drafting before it can leave). A miss: it is rolled back, unused."""
        if ahead is None:
            return
        if ahead.is_continued_by(context):
            stats.overlap_hits += 1
            self._metrics.overlap_hits.inc()
        else:
            stats.overlap_misses += 1
            self._metrics.overlap_misses.inc()

    async def aclose(self) -> None:
        with contextlib.suppress(Exception):
            await self._client.aclose()
        self._executor.shutdown(wait=False, cancel_futures=True)
        # A proposal still running in the executor holds the drafter's lock: close waits for it.
        await asyncio.to_thread(self._drafter.close)


def count_call(stats: SpadeStats, call: VerifyCall, num_drafted: int, drafting: Drafting) -> None:
    """The request's own account of one verified block (the ``spade`` object of its response)."""
    verdict = call.verdict
    stats.verify_calls += 1
    stats.drafted_tokens += num_drafted
    stats.accepted_tokens += verdict.num_accepted
    stats.target_tokens += verdict.num_target_tokens
    stats.resyncs += int(call.resynced)
    stats.draft_ms += drafting.exposed_s * 1e3
    stats.verify_ms += call.round_trip_s * 1e3
    stats.verifier_forward_ms += verdict.timings.forward_ms


def block_outcome(call: VerifyCall, num_drafted: int, drafting: Drafting) -> BlockOutcome:
    """What the verified block teaches the draft-length policy."""
    verifier_s = call.verdict.timings.total_ms / 1e3
    verdict = call.verdict
    return BlockOutcome(
        num_drafted, verdict.num_accepted, drafting.seconds_per_token, call.round_trip_s, verifier_s, verdict.num_target_tokens
    )


def generated_tokens(token_ids: list[int], call: VerifyCall | None) -> GeneratedTokens:
    """The tokens to deliver, with the verdict's logprobs for them when the request asked (the
    verdict is then one that carries them: the client checks)."""
    if call is None:
        return GeneratedTokens(token_ids)
    verdict = call.verdict
    top_logprobs: list[TopLogprobs] = [list(zip(top.token_ids, top.logprobs, strict=True)) for top in verdict.top_logprobs or []]
    return GeneratedTokens(token_ids, verdict.logprobs[: len(token_ids)], top_logprobs[: len(token_ids)])
