"""Speculative decoding on the edge: draft a block, verify it in the cloud, stream what the
target accepted plus its next token, repeat.

Prefill first: the first verify call of a request carries the prompt alone (an empty block), so
it leaves at once; the verifier prefills the target and answers the target's first token while
the edge prefills its draft model and, with overlap, drafts ahead of that token (``DraftAhead``).
The two prefills overlap instead of following each other. With no drafted token nothing can be
accepted: the first token is the target's own, drawn as its target-only routes draw it.

A saturated verifier (advice 0: no drafting pays) may answer a call with more of the target's
tokens, decoded by itself (``max_continued_tokens``, within what the request's budget leaves):
they are committed and streamed with the verdict's.

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
from dataclasses import dataclass, field
from typing import Any

from edge_agent.accounting import BlockEntry, record_block, record_request_ended, record_request_started
from edge_agent.draft_ahead import EMPTY_BLOCK, DraftAhead, Drafting, join_blocks
from edge_agent.draft_length import DraftLengthPolicy
from edge_agent.draft_prefixes import request_prefix_owner
from edge_agent.drafter import DraftBlock, Drafter, DraftSession
from edge_agent.edge_power import DraftAheadPolicy
from edge_agent.estimates import EdgeEstimates
from edge_agent.generation import Generation, ahead_length, draft_length
from edge_agent.metrics import EdgeMetrics
from edge_agent.verifier_client import VerifierClient, VerifyCall, wire_cache_salt
from gateway.affinity import route_key
from gateway.engine import GeneratedTokens, GenerationRequest, TopLogprobs
from gateway.errors import ServiceUnavailableError
from gateway.model import ModelDescription
from gateway.protocol import SpadeStats


@dataclass(frozen=True)
class ServedModel:
    """What the edge serves: the target's description (from the verifier's /health) and the
    tokenizer of its token ids (the draft's, checked at start-up to be the target's)."""

    description: ModelDescription
    tokenizer: Any


@dataclass(frozen=True)
class EngineOptions:
    """How the engine drafts (``spade-edge``'s ``--draft-length``, ``--fallback``, ``--overlap``,
    ``--prefill-first``, ``--max-continued-tokens``)."""

    draft_length_policy: DraftLengthPolicy
    """Chooses each block's length (service-wide; each request gets its own ``for_request``)."""
    draft_ahead_policy: DraftAheadPolicy = field(default_factory=lambda: DraftAheadPolicy("performance"))
    """How far to draft ahead under a verify call (``--edge-power``; each request gets its own
    ``for_request``); it changes when the edge drafts, never what it outputs."""
    estimates: EdgeEstimates = field(default_factory=EdgeEstimates)
    """What the edge has measured (timings, the acceptance prior, the guess rate), service-wide;
    each request's estimate starts from it and teaches it, and both policies read that."""
    fallback_to_draft: bool = field(default=False, kw_only=True)
    """With the verifier unreachable, serve the draft's block unverified instead of failing."""
    overlap: bool = field(default=False, kw_only=True)
    """Draft the next block while the verifier checks this one."""
    prefill_first: bool = field(default=False, kw_only=True)
    """The first verify call carries the prompt alone (every verifier of this wire version takes an empty block)."""
    max_continued_tokens: int = field(default=0, kw_only=True)
    """Most tokens a verify call lets a saturated verifier decode on by itself (``--max-continued-tokens``)."""


class SpeculativeEngine:
    """The edge's engine: serves OpenAI requests by speculative decoding against a remote
    verifier. It drafts blocks with the small draft model, has the verifier's target check each
    one (the target keeps the longest prefix it accepts and adds its own next token), and streams
    only tokens the target accepted or produced, so the output follows the target's distribution
    (at temperature 0 it is the target's own greedy text). It serves under the model the
    verifier's /health describes, drafts the next block while the verifier checks this one
    (``overlap``), sends the prompt alone first (``prefill_first``) and, with ``--fallback
    draft``, serves the draft alone while the verifier is unreachable. Each request is one
    ``Generation``, handed from step to step of the loop."""

    def __init__(self, drafter: Drafter, client: VerifierClient, served: ServedModel, metrics: EdgeMetrics, options: EngineOptions) -> None:
        self._drafter = drafter
        self._client = client
        self._served = served
        self._metrics = metrics
        self._options = options
        # One drafting thread: draft forwards stay off the event loop, in arrival order.
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="draft-forward")

    @property
    def model(self) -> ModelDescription:
        """The target's description (from the verifier's /health): what the edge serves."""
        return self._served.description

    @property
    def tokenizer(self):
        return self._served.tokenizer

    @property
    def verifier_reachable(self) -> bool:
        return self._client.is_reachable

    @property
    def prefill_first(self) -> bool:
        """The first verify call of a request carries the prompt alone."""
        return self._options.prefill_first

    async def generate(self, request: GenerationRequest, stats: SpadeStats) -> AsyncGenerator[GeneratedTokens, None]:
        """Per block: draft it, verify it (drafting ahead meanwhile), commit the verdict, stream
        what it delivers; until EOS or the budget. Closing the stream early ends it too."""
        generation = self._start(request, stats)
        entry = BlockEntry()
        try:
            while not generation.is_finished:
                entry = BlockEntry()
                block, drafting = await self._draft(generation, entry)
                call = await self._verify_while_drafting_ahead(generation, block, entry)
                delivered = self._commit(generation, block, call, drafting, entry)
                if delivered:  # none when the prompt-only call fell back to the draft
                    yield generated_tokens(delivered, call if generation.wants_logprobs else None)
        finally:
            self._finish(generation, entry)

    def _start(self, request: GenerationRequest, stats: SpadeStats) -> Generation:
        cache_salt = wire_cache_salt(request.cache_owner, request.cache_salt)
        estimate = self._options.estimates.for_request()
        generation = Generation(
            request,
            stats,
            draft_session=self._drafter.start_session(request_prefix_owner(request)),
            verifier_session=self._client.open_session(cache_salt, route_key(request.prefix_key, cache_salt)),
            estimate=estimate,
            policy=self._options.draft_length_policy.for_request(estimate),
            ahead_policy=self._options.draft_ahead_policy.for_request(estimate),
            context=list(request.prompt_token_ids),
            sends_prompt_only=self._options.prefill_first,
        )
        record_request_started(self._metrics, len(request.prompt_token_ids))
        return generation

    def _finish(self, generation: Generation, last_entry: BlockEntry) -> None:
        """Whatever ended the loop (EOS, budget, the consumer gone): record its last round if it
        never reached its commit, free the draft cache and the verifier session."""
        record_request_ended(self._metrics, generation, last_entry)
        self.close_draft_session(generation.draft_session)
        generation.verifier_session.close()

    # --- draft ---------------------------------------------------------------------------------

    async def _draft(self, generation: Generation, entry: BlockEntry) -> tuple[DraftBlock, Drafting]:
        """The block to verify next: what was drafted ahead for the committed context (a hit),
        completed by drafting now."""
        num_drafted, policy_length = self._block_length(generation)
        entry.advice_capped = num_drafted < policy_length
        await self._settle_ahead(generation, entry)
        block, drafting = await self._complete_block(generation, num_drafted, entry)
        generation.is_draft_prefilled = generation.is_draft_prefilled or bool(block.token_ids)
        return block, drafting

    def _block_length(self, generation: Generation) -> tuple[int, int]:
        """(the next block's length, what it would be without the verifier's advice): 0 for the
        prompt-only first call; otherwise the policy's choice within every cap."""
        if generation.sends_prompt_only:
            return 0, 0
        room = self.model.room(len(generation.context))
        policy_length = draft_length(generation.policy.next_length(), generation.num_left, room)
        return draft_length(policy_length, generation.num_left, room, generation.verifier_advice), policy_length

    async def _settle_ahead(self, generation: Generation, entry: BlockEntry) -> None:
        """Take the token still being drafted ahead when the last verdict came, now that it is
        needed, and count whether the committed context ran through the guess."""
        ahead = generation.ahead
        if ahead is None:
            return
        added, seconds = await ahead.settle()
        entry.add_drafted_ahead(len(added.token_ids), seconds)
        is_hit = entry.overlap_hit = ahead.is_continued_by(generation.context)
        if ahead.token_ids and ahead.accepts_whole_block(generation.context):
            generation.estimate.shared.observe_guess(is_hit)

    async def _complete_block(self, generation: Generation, num_drafted: int, entry: BlockEntry) -> tuple[DraftBlock, Drafting]:
        """What was drafted ahead for this context, completed by drafting now. A request's first
        drafted block (in line, or ahead during the prompt-only call) also prefilled the draft
        model over the prompt: no measure of drafting per token (t_draft)."""
        ahead, context, is_first_block = generation.ahead, generation.context, not generation.is_draft_prefilled
        reused = ahead.continuation_of(context, num_drafted) if ahead is not None else EMPTY_BLOCK
        if ahead is not None:
            num_confirmed = ahead.num_confirmed(context)
            entry.add_ahead_outcome(num_confirmed, len(ahead.token_ids) - num_confirmed - len(reused.token_ids))
            generation.ahead = None  # counted once: what is left of it starts the block below
        per_token_s = ahead.seconds_per_token if ahead is not None and reused.token_ids and not is_first_block else None
        if len(reused.token_ids) == num_drafted:
            return reused, Drafting(0.0, per_token_s)
        rest, draft_s = await self._propose(generation, context + reused.token_ids, num_drafted - len(reused.token_ids))
        return join_blocks(reused, rest), Drafting(draft_s, None if is_first_block else draft_s / len(rest.token_ids))

    async def _propose(self, generation: Generation, context: list[int], num_tokens: int) -> tuple[DraftBlock, float]:
        """``num_tokens`` drafted after ``context`` on the drafting thread, and the seconds it took."""
        started = time.perf_counter()
        loop = asyncio.get_running_loop()
        propose = generation.draft_session.propose
        block = await loop.run_in_executor(self._executor, propose, list(context), num_tokens, generation.request.sampling)
        return block, time.perf_counter() - started

    # --- verify --------------------------------------------------------------------------------

    async def _verify_while_drafting_ahead(self, generation: Generation, block: DraftBlock, entry: BlockEntry) -> VerifyCall | None:
        """Send the block; until the verdict arrives, keep drafting past it one token at a time
        (a guess of the target's next token, then the block after it). A token in progress when
        the verdict lands is left pending (``DraftAhead.settle`` takes it before the next block):
        the drafting thread cannot be interrupted mid-forward, and the verdict need not wait.
        The generation's ``ahead`` is what was drafted (discarded with it if the request ends)."""
        ahead_limit = self._ahead_limit(generation, len(block.token_ids))
        worth_limit = generation.ahead_policy.ahead_limit(len(block.token_ids), ahead_limit, not generation.is_draft_prefilled)
        entry.ahead_skipped = worth_limit < ahead_limit
        ahead_limit = worth_limit
        verifying = asyncio.ensure_future(self._verify(generation, block, entry))
        ahead = generation.ahead = DraftAhead(generation.context + block.token_ids, [], None, 0.0)
        try:
            while len(ahead.token_ids) < ahead_limit and not verifying.done():
                ahead.pending = asyncio.ensure_future(self._propose(generation, ahead.sequence, 1))
                await asyncio.wait({verifying, ahead.pending}, return_when=asyncio.FIRST_COMPLETED)
                if not ahead.pending.done():
                    break
                await ahead.settle()
            entry.add_drafted_ahead(len(ahead.token_ids), ahead.seconds)
            call = await verifying
        finally:
            if not verifying.done():  # the request was cancelled (client gone): so is its call
                verifying.cancel()
        if not ahead.token_ids and ahead.pending is None:
            generation.ahead = None
        return call

    def _ahead_limit(self, generation: Generation, num_drafted: int) -> int:
        """Tokens worth drafting past the block while it is verified (``ahead_length``); none
        without ``--overlap``."""
        if not self._options.overlap:
            return 0
        room_after_hit = self.model.room(len(generation.context) + num_drafted + 1)
        return ahead_length(generation.policy.next_length(), generation.num_left, num_drafted, room_after_hit, generation.verifier_advice)

    async def _verify(self, generation: Generation, block: DraftBlock, entry: BlockEntry) -> VerifyCall | None:
        """The verdict and what the call cost; None when the verifier is unreachable and the edge
        falls back to the draft (never for a request that asked for logprobs: the draft's tokens
        have no target logprob)."""
        request = generation.request
        max_continued = continued_allowance(
            self._options.max_continued_tokens, generation.num_left, len(block.token_ids), brings_first_token=generation.num_generated == 0
        )
        try:
            return await generation.verifier_session.verify(
                generation.context, block, request.sampling, request.num_top_logprobs, max_continued
            )
        except ServiceUnavailableError:
            entry.verifier_unreachable = True
            if not self._options.fallback_to_draft or generation.wants_logprobs:
                raise
            return None

    # --- commit --------------------------------------------------------------------------------

    def _commit(
        self, generation: Generation, block: DraftBlock, call: VerifyCall | None, drafting: Drafting, entry: BlockEntry
    ) -> list[int]:
        """The call's tokens join the context; returns those to deliver. The round is recorded
        (stats, metrics, the policies' lessons, the verifier's advice) here, once."""
        committed = committed_tokens(block, call)
        if not committed:  # the prompt-only call fell back to the draft: nothing drafted ahead follows
            entry.add_ahead_outcome(0, generation.drop_ahead())
        delivered = generation.commit(committed)
        entry.block, entry.call, entry.drafting, entry.delivered = block, call, drafting, delivered
        record_block(self._metrics, generation, entry)
        return delivered

    @property
    def draft_executor(self) -> ThreadPoolExecutor:
        """The one drafting thread: draft forwards of every request run there, in arrival order."""
        return self._executor

    def close_draft_session(self, session: DraftSession) -> None:
        """On the drafting thread, where a draft forward of this request may still be running;
        directly once the engine has shut that thread down."""
        try:
            self._executor.submit(session.close)
        except RuntimeError:
            session.close()

    async def aclose(self) -> None:
        with contextlib.suppress(Exception):
            await self._client.aclose()
        self._executor.shutdown(wait=False, cancel_futures=True)
        # A proposal still running in the executor holds the drafter's lock: close waits for it.
        await asyncio.to_thread(self._drafter.close)


def committed_tokens(block: DraftBlock, call: VerifyCall | None) -> list[int]:
    """The tokens a call commits: the accepted drafts, the target's next token and the tokens
    it continued with; with no verdict (verifier unreachable, ``--fallback draft``) the draft's
    own block, unverified."""
    if call is None:
        return block.token_ids
    verdict = call.verdict
    return block.token_ids[: verdict.num_accepted] + [verdict.next_token] + verdict.continued_tokens


def continued_allowance(max_continued_tokens: int, num_left: int, num_drafted: int, brings_first_token: bool = False) -> int:
    """How many tokens a call lets the verifier continue with: the setting, within what the
    budget leaves after the block's best case (its drafts and the next token). Example: 10
    left, a block of 0 -> up to 9 (with the setting at 8: 8); a block of 4 -> 5. None for the
    call that brings the request's first token: that token reaches the caller as soon as the
    target has it, where a saturated verifier would first continue the call by the allowance
    (8 forwards later: the time to first token above target-only's)."""
    if brings_first_token:
        return 0
    return max(0, min(max_continued_tokens, num_left - num_drafted - 1))


def generated_tokens(token_ids: list[int], call: VerifyCall | None) -> GeneratedTokens:
    """The tokens to deliver, with the verdict's logprobs for them when the request asked (the
    verdict is then one that carries them: the client checks)."""
    if call is None:
        return GeneratedTokens(token_ids)
    verdict = call.verdict
    top_logprobs: list[TopLogprobs] = [list(zip(top.token_ids, top.logprobs, strict=True)) for top in verdict.top_logprobs or []]
    return GeneratedTokens(token_ids, verdict.logprobs[: len(token_ids)], top_logprobs[: len(token_ids)])
