"""A scripted drafter and verifier for the edge's engine: each token is a rule of the one before,
and the target's rule departs from the draft's at every 7th position, so blocks are partly
accepted, drafting ahead both hits and misses, and the expected output is known exactly."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

from edge_agent.draft_length import DraftLengthPolicy, FixedDraftLength
from edge_agent.drafter import DraftBlock, DraftContexts
from edge_agent.engine import EngineOptions, ServedModel, SpeculativeEngine
from edge_agent.metrics import EdgeMetrics
from edge_agent.verifier_client import VerifyCall
from gateway.engine import GenerationRequest
from gateway.model import ModelDescription
from gateway.protocol import SpadeStats
from spade_core.params import SamplingConfig
from verifier_service.protocol import VerifyResponse, VerifyTimings

VOCAB = 50
EOS = 49
GREEDY = SamplingConfig(temperature=0.0)


def draft_rule(context: list[int]) -> int:
    return (context[-1] * 3 + 1) % 48


def target_rule(context: list[int]) -> int:
    """The draft's rule, except at every 7th position."""
    return (context[-1] * 3 + (2 if len(context) % 7 == 0 else 1)) % 48


def target_continuation(prompt: list[int], num_tokens: int) -> list[int]:
    context = list(prompt)
    for _ in range(num_tokens):
        context.append(target_rule(context))
    return context[len(prompt) :]


@dataclass
class ScriptedDrafter:
    proposals: list[tuple[int, int]] = field(default_factory=list)
    """(context length, tokens asked) of every proposal."""

    num_cached_tokens: int = 0
    """No prefix reuse here (the draft's reuse: tests/test_drafter_prefixes.py)."""

    def contexts(self) -> DraftContexts:
        return DraftContexts(0, 0, 0)  # holds no cache

    def start_session(self, prefix_owner: str = "") -> ScriptedDrafter:
        return self

    def propose(self, context: list[int], num_tokens: int, sampling: SamplingConfig) -> DraftBlock:
        self.proposals.append((len(context), num_tokens))
        tokens = list(context)
        for _ in range(num_tokens):
            tokens.append(draft_rule(tokens))
        return DraftBlock(tokens[len(context) :], None)

    def close(self) -> None:
        pass


@dataclass
class ScriptedVerifier:
    """Greedy verification by ``target_rule``; each call takes ``latency_s`` (the edge drafts ahead meanwhile)."""

    latency_s: float = 0.2
    hang_on_call: int | None = None
    advice: int = 64
    """Every verdict's advised_draft_length (64: a verifier with idle time advises its limit)."""
    calls: list[VerifyCall] = field(default_factory=list)
    verdicts: list[tuple[list[int], list[int], int, int]] = field(default_factory=list)
    """(context, block, accepted, next token) of every answered call."""
    cancelled: list[int] = field(default_factory=list)
    allowed_continuations: list[int] = field(default_factory=list)
    """Every call's max_continued_tokens."""

    def open_session(self, cache_salt: str | None = None, route_key: str | None = None) -> ScriptedVerifier:
        return self

    async def verify(
        self,
        context: list[int],
        block: DraftBlock,
        sampling: SamplingConfig,
        num_top_logprobs: int | None = None,
        max_continued_tokens: int = 0,
    ) -> VerifyCall:
        """Under an advice of 0 it continues ``max_continued_tokens`` tokens, as a saturated verifier does."""
        call = len(self.calls)
        self.allowed_continuations.append(max_continued_tokens)
        try:
            await asyncio.sleep(3600 if call == self.hang_on_call else self.latency_s)
        except asyncio.CancelledError:
            self.cancelled.append(call)
            raise
        committed, num_accepted = list(context), 0
        for token in block.token_ids:
            if token != target_rule(committed):
                break
            committed.append(token)
            num_accepted += 1
        next_token = target_rule(committed)
        self.verdicts.append((list(context), list(block.token_ids), num_accepted, next_token))
        continued: list[int] = []
        for _ in range(max_continued_tokens if self.advice == 0 else 0):
            continued.append(target_rule(committed + [next_token] + continued))
        verdict = VerifyResponse(
            session_id="s",
            num_accepted=num_accepted,
            next_token=next_token,
            next_token_kind="bonus" if num_accepted == len(block.token_ids) else "correction",
            logprobs=[0.0] * (num_accepted + 1 + len(continued)),
            continued_tokens=continued,
            context_length=len(committed) + 1 + len(continued),
            num_target_tokens=len(block.token_ids) + 1 + len(continued),
            advised_draft_length=self.advice,
            timings=VerifyTimings(queue_ms=0.0, forward_ms=1.0, total_ms=1.0),
        )
        self.calls.append(VerifyCall(verdict, self.latency_s, 0, 0, False))
        return self.calls[-1]

    def close(self) -> None:
        pass

    async def aclose(self) -> None:
        pass


PROMPT = [5, 11, 2]


def draft_continuation(prompt: list[int], num_tokens: int) -> list[int]:
    context = list(prompt)
    for _ in range(num_tokens):
        context.append(draft_rule(context))
    return context[len(prompt) :]


def scripted_engine(
    drafter, verifier, draft_length: DraftLengthPolicy | None = None, metrics: EdgeMetrics | None = None, **options: Any
) -> SpeculativeEngine:
    """The engine over a scripted drafter and verifier (blocks of 4 unless ``draft_length``);
    ``options`` are ``EngineOptions``' keyword fields (its switches, ``draft_ahead_policy``)."""
    served = ServedModel(ModelDescription("target", VOCAB, 10_000, frozenset({EOS})), None)
    engine_options = EngineOptions(draft_length or FixedDraftLength(4), **options)
    return SpeculativeEngine(drafter, verifier, served, metrics or EdgeMetrics(), engine_options)


async def generate(engine: SpeculativeEngine, max_tokens: int) -> tuple[list[int], SpadeStats]:
    """The tokens the engine generates after PROMPT (greedy), and the request's stats; then the
    engine is closed."""
    stats = SpadeStats()
    request = GenerationRequest("r", PROMPT, max_tokens, GREEDY, frozenset({EOS}))
    tokens = [token for batch in [batch async for batch in engine.generate(request, stats)] for token in batch.token_ids]
    await engine.aclose()
    return tokens, stats
