"""Speculative decoding on the edge: draft a block, verify it in the cloud, stream what the
target accepted plus its next token, repeat.

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

    async def generate(self, request: GenerationRequest, stats: SpadeStats) -> AsyncGenerator[GeneratedTokens, None]:
        draft_session = self._drafter.start_session()
        verifier_session = self._client.open_session()
        policy = self._draft_length_policy.for_request()
        context = list(request.prompt_token_ids)
        num_generated = 0
        ahead: DraftAhead | None = None
        self._metrics.requests.inc()
        self._metrics.active_requests.inc()
        try:
            while num_generated < request.max_tokens:
                remaining = request.max_tokens - num_generated
                num_drafted = self.draft_length(policy.next_length(), remaining, len(context))
                self._count_overlap(stats, ahead, context)
                block, drafting = await self._next_block(draft_session, context, num_drafted, request, ahead)
                ahead_limit = self._ahead_limit(policy, remaining, len(context), num_drafted)
                call, ahead = await self._verify_while_drafting_ahead(
                    draft_session, verifier_session, context, block, request, ahead_limit, stats
                )
                if call is None:  # verifier unreachable, serving the draft (--fallback draft)
                    emitted = block.token_ids
                    stats.fallback_tokens += len(emitted)
                    stats.draft_ms += drafting.exposed_s * 1e3
                else:
                    count_call(stats, call, num_drafted, drafting)
                    self._metrics.observe_call(call, num_drafted, drafting.exposed_s)
                    policy.observe(block_outcome(call, num_drafted, drafting))
                    emitted = block.token_ids[: call.verdict.num_accepted] + [call.verdict.next_token]
                context += emitted
                kept = self.kept_tokens(emitted, remaining, request.eos_token_ids)
                num_generated += kept
                self._metrics.generated_tokens.inc(kept)
                yield generated_tokens(emitted[:kept], call if request.num_top_logprobs is not None else None)
                if kept < len(emitted) or emitted[-1] in request.eos_token_ids:
                    return
        finally:
            self._metrics.active_requests.dec()
            self._close_draft_session(draft_session)
            verifier_session.close()

    def draft_length(self, chosen: int, remaining: int, context_length: int) -> int:
        """The policy's choice, capped by what the budget can use (a block of d yields up
        to d + 1 tokens) and the context left (``gateway.model``: context + block must fit).
        Never below 1: the wire refuses empty blocks (the budget leaves room for that one)."""
        return max(1, min(chosen, remaining - 1, self._target.room(context_length)))

    def _ahead_limit(self, policy, remaining: int, context_length: int, num_drafted: int) -> int:
        """Tokens worth drafting past the block while it is verified: the guess of the target's
        next token, then the next block, within what the budget and the context can still use.
        Example: 10 tokens left, a block of 4 -> at best 5 come back and 5 remain: the guess + 4."""
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
        self, session: DraftSession, context: list[int], num_drafted: int, request: GenerationRequest, ahead: DraftAhead | None
    ) -> tuple[DraftBlock, Drafting]:
        """The block to verify next: what was drafted ahead for this context, completed by drafting now."""
        reused = ahead.continuation_of(context, num_drafted) if ahead is not None else EMPTY_BLOCK
        per_token_s = ahead.seconds_per_token if ahead is not None and reused.token_ids else None
        if len(reused.token_ids) == num_drafted:
            return reused, Drafting(0.0, per_token_s)
        rest, draft_s = await self._draft(session, context + reused.token_ids, num_drafted - len(reused.token_ids), request)
        block = join_blocks(reused, rest)
        return block, Drafting(draft_s, draft_s / len(rest.token_ids))

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
        the verdict lands is finished (the drafting thread cannot be interrupted mid-forward)."""
        verifying = asyncio.ensure_future(self._verify(verifier_session, context, block, request))
        try:
            ahead = DraftAhead(context + block.token_ids, [], None, 0.0)
            while len(ahead.token_ids) < ahead_limit and not verifying.done():
                drafting = asyncio.ensure_future(self._draft(draft_session, ahead.sequence, 1, request))
                await asyncio.wait({verifying, drafting}, return_when=asyncio.FIRST_COMPLETED)
                ahead.extend(*await drafting)
            self._metrics.draft_ahead_tokens.inc(len(ahead.token_ids))
            stats.draft_ahead_ms += ahead.seconds * 1e3
            return await verifying, (ahead if ahead.token_ids else None)
        finally:
            if not verifying.done():  # the request was cancelled (client gone): so is its call
                verifying.cancel()

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
    return BlockOutcome(num_drafted, call.verdict.num_accepted, drafting.seconds_per_token, call.round_trip_s, verifier_s)


def generated_tokens(token_ids: list[int], call: VerifyCall | None) -> GeneratedTokens:
    """The tokens to deliver, with the verdict's logprobs for them when the request asked (the
    verdict is then one that carries them: the client checks)."""
    if call is None:
        return GeneratedTokens(token_ids)
    verdict = call.verdict
    top_logprobs: list[TopLogprobs] = [list(zip(top.token_ids, top.logprobs, strict=True)) for top in verdict.top_logprobs or []]
    return GeneratedTokens(token_ids, verdict.logprobs[: len(token_ids)], top_logprobs[: len(token_ids)])
