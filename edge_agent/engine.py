"""Speculative decoding on the edge: draft a block, verify it in the cloud, stream what the
target accepted plus its next token, repeat.

The edge never emits a token the verifier did not accept or produce. The loop ends at EOS, at
the token budget (the last block is drafted no longer than the budget needs, and its output cut
to the budget) or when the consumer closes the stream (stop string, client gone), which also
frees the draft cache and the verifier session.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from edge_agent.draft_length import AdaptiveDraftLength, FixedDraftLength
from edge_agent.drafter import DraftBlock, Drafter, DraftSession
from edge_agent.metrics import EdgeMetrics
from edge_agent.verifier_client import VerifierClient, VerifierSession
from gateway.engine import GeneratedTokens, GenerationRequest
from gateway.errors import ServiceUnavailableError
from gateway.protocol import SpadeStats
from verifier_service.protocol import VerifierHealth, VerifyResponse


@dataclass(frozen=True)
class TargetDescription:
    """What the edge serves is the target's output: its id, limits and end tokens."""

    model_id: str
    max_context_length: int
    max_draft_tokens: int
    eos_token_ids: frozenset[int]
    vocab_size: int

    @classmethod
    def from_health(cls, health: VerifierHealth) -> "TargetDescription":
        return cls(health.model, health.max_context_length, health.max_draft_tokens, frozenset(health.eos_token_ids), health.vocab_size)


class SpeculativeEngine:
    def __init__(
        self,
        drafter: Drafter,
        tokenizer,
        client: VerifierClient,
        target: TargetDescription,
        draft_length: FixedDraftLength | AdaptiveDraftLength,
        metrics: EdgeMetrics,
        fallback_to_draft: bool = False,
    ) -> None:
        self._drafter = drafter
        self._tokenizer = tokenizer
        self._client = client
        self._target = target
        self._draft_length = draft_length
        self._metrics = metrics
        self._fallback_to_draft = fallback_to_draft
        # One drafting thread: draft forwards stay off the event loop, in arrival order.
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="draft-forward")

    @property
    def model_id(self) -> str:
        return self._target.model_id

    @property
    def tokenizer(self):
        return self._tokenizer

    @property
    def max_context_length(self) -> int:
        return self._target.max_context_length

    @property
    def eos_token_ids(self) -> frozenset[int]:
        return self._target.eos_token_ids

    @property
    def vocab_size(self) -> int:
        return self._target.vocab_size

    @property
    def verifier_reachable(self) -> bool:
        return self._client.is_reachable

    async def generate(self, request: GenerationRequest, stats: SpadeStats) -> AsyncIterator[GeneratedTokens]:
        draft_session = self._drafter.start_session()
        verifier_session = self._client.open_session()
        context = list(request.prompt_token_ids)
        num_generated = 0
        self._metrics.requests.inc()
        self._metrics.active_requests.inc()
        try:
            while num_generated < request.max_tokens:
                num_drafted = self.block_length(request.max_tokens - num_generated, len(context))
                block, draft_s = await self._draft(draft_session, context, num_drafted, request)
                verdict = await self._verify(verifier_session, context, block, request)
                if verdict is None:  # verifier unreachable, serving the draft (--fallback draft)
                    emitted, logprobs = block.token_ids, [float("nan")] * len(block.token_ids)
                    stats.fallback_tokens += len(emitted)
                    stats.draft_ms += draft_s * 1e3
                else:
                    draft_session.observe(verdict.num_accepted, verdict.next_token)
                    self._record(stats, verifier_session, block, verdict, draft_s)
                    emitted = block.token_ids[: verdict.num_accepted] + [verdict.next_token]
                    logprobs = verdict.logprobs
                context += emitted
                kept = self.kept_tokens(emitted, request.max_tokens - num_generated, request.eos_token_ids)
                num_generated += kept
                self._metrics.generated_tokens.inc(kept)
                yield GeneratedTokens(emitted[:kept], logprobs[:kept])
                if kept < len(emitted) or emitted[-1] in request.eos_token_ids:
                    return
        finally:
            self._metrics.active_requests.dec()
            self._close_draft_session(draft_session)
            verifier_session.close()

    def block_length(self, remaining: int, context_length: int) -> int:
        """The controller's choice, capped by what the budget can use (a block of d yields up
        to d + 1 tokens), the verifier's block limit and the context left (the verifier feeds
        context + block, which must fit; the next token is not fed)."""
        room = self._target.max_context_length - context_length
        return max(1, min(self._draft_length.next_length(), remaining - 1, self._target.max_draft_tokens, room))

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

    async def _draft(self, session: DraftSession, context: list[int], num_drafted: int, request: GenerationRequest) -> tuple[DraftBlock, float]:
        started = time.perf_counter()
        loop = asyncio.get_running_loop()
        block = await loop.run_in_executor(self._executor, session.propose, list(context), num_drafted, request.sampling)
        return block, time.perf_counter() - started

    async def _verify(self, session: VerifierSession, context: list[int], block: DraftBlock, request: GenerationRequest) -> VerifyResponse | None:
        """The verdict; None when the verifier is unreachable and the edge falls back to the draft."""
        try:
            return await session.verify(context, block, request.sampling)
        except ServiceUnavailableError:
            self._metrics.verify_failures.inc()
            if not self._fallback_to_draft:
                raise
            self._metrics.fallback_tokens.inc(len(block.token_ids))
            return None

    def _record(self, stats: SpadeStats, session: VerifierSession, block: DraftBlock, verdict: VerifyResponse, draft_s: float) -> None:
        call = session.records[-1]
        num_drafted = len(block.token_ids)
        stats.verify_calls += 1
        stats.drafted_tokens += num_drafted
        stats.accepted_tokens += verdict.num_accepted
        stats.target_tokens += verdict.num_target_tokens
        stats.resyncs += int(call.resynced)
        stats.draft_ms += draft_s * 1e3
        stats.verify_ms += call.round_trip_s * 1e3
        stats.verifier_forward_ms += verdict.timings.forward_ms
        self._draft_length.observe(num_drafted, verdict.num_accepted, draft_s, call.round_trip_s)
        metrics = self._metrics
        metrics.verify_calls.inc()
        metrics.resyncs.inc(int(call.resynced))
        metrics.drafted_tokens.inc(num_drafted)
        metrics.accepted_tokens.inc(verdict.num_accepted)
        metrics.bytes_sent.inc(call.bytes_sent)
        metrics.bytes_received.inc(call.bytes_received)
        metrics.draft_length.observe(num_drafted)
        metrics.draft_seconds.observe(draft_s)
        metrics.verify_seconds.observe(call.round_trip_s)
        metrics.verifier_forward_seconds.observe(verdict.timings.forward_ms / 1e3)

    async def aclose(self) -> None:
        with contextlib.suppress(Exception):
            await self._client.aclose()
        self._executor.shutdown(wait=False, cancel_futures=True)
