"""Drafting that overlaps verification, with a scripted drafter and verifier: what was drafted
ahead starts the next block only when the verdict runs through the draft's guess, the output
is the target's whatever happens, and hits and misses are counted."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import pytest

from edge_agent.draft_ahead import DraftAhead, join_blocks
from edge_agent.draft_length import BlockOutcome, FixedDraftLength
from edge_agent.drafter import DraftBlock
from edge_agent.engine import SpeculativeEngine
from edge_agent.metrics import EdgeMetrics
from edge_agent.verifier_client import VerifyCall
from gateway.engine import GenerationRequest
from gateway.model import ModelDescription
from gateway.protocol import SpadeStats
from spade_core.params import SamplingConfig
from verifier_service.protocol import SparseDistribution, VerifyResponse, VerifyTimings

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

    def start_session(self) -> ScriptedDrafter:
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
    calls: list[VerifyCall] = field(default_factory=list)
    verdicts: list[tuple[list[int], list[int], int, int]] = field(default_factory=list)
    """(context, block, accepted, next token) of every answered call."""
    cancelled: list[int] = field(default_factory=list)

    def open_session(self) -> ScriptedVerifier:
        return self

    async def verify(
        self, context: list[int], block: DraftBlock, sampling: SamplingConfig, num_top_logprobs: int | None = None
    ) -> VerifyCall:
        call = len(self.calls)
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
        verdict = VerifyResponse(
            session_id="s",
            num_accepted=num_accepted,
            next_token=next_token,
            next_token_kind="bonus" if num_accepted == len(block.token_ids) else "correction",
            logprobs=[0.0] * (num_accepted + 1),
            context_length=len(committed) + 1,
            num_target_tokens=len(block.token_ids) + 1,
            advised_draft_length=64,
            timings=VerifyTimings(queue_ms=0.0, forward_ms=1.0, total_ms=1.0),
        )
        self.calls.append(VerifyCall(verdict, self.latency_s, 0, 0, False))
        return self.calls[-1]

    def close(self) -> None:
        pass

    async def aclose(self) -> None:
        pass


PROMPT = [5, 11, 2]


def _engine(drafter, verifier, overlap: bool, draft_length: int = 4) -> SpeculativeEngine:
    target = ModelDescription("target", VOCAB, 10_000, frozenset({EOS}))
    return SpeculativeEngine(drafter, None, verifier, target, FixedDraftLength(draft_length), EdgeMetrics(), overlap=overlap)


async def _generate(engine: SpeculativeEngine, max_tokens: int) -> tuple[list[int], SpadeStats]:
    stats = SpadeStats()
    request = GenerationRequest("r", PROMPT, max_tokens, GREEDY, frozenset({EOS}))
    tokens = [token for batch in [batch async for batch in engine.generate(request, stats)] for token in batch.token_ids]
    await engine.aclose()
    return tokens, stats


def _expected_overlap(verdicts, max_tokens: int) -> tuple[int, int]:
    """(hits, misses) the engine must count: after each call but the last for which it drafted
    ahead (a full hit would leave tokens to generate), a hit when all drafts were accepted and
    the next token is the draft's own guess."""
    hits = misses = 0
    for context, block, num_accepted, next_token in verdicts[:-1]:
        remaining = max_tokens - (len(context) - len(PROMPT))
        if remaining - (len(block) + 1) <= 0:
            continue
        if num_accepted == len(block) and next_token == draft_rule(context + block):
            hits += 1
        else:
            misses += 1
    return hits, misses


@pytest.mark.parametrize("overlap", [False, True], ids=["in-turn", "overlap"])
async def test_the_output_is_the_targets_with_and_without_overlap(overlap):
    tokens, stats = await _generate(_engine(ScriptedDrafter(), ScriptedVerifier(latency_s=0.05), overlap), 40)
    assert tokens == target_continuation(PROMPT, 40)
    assert stats.verify_calls < 40


async def test_a_hit_starts_the_next_block_with_what_was_drafted_ahead():
    drafter, verifier = ScriptedDrafter(), ScriptedVerifier()
    tokens, stats = await _generate(_engine(drafter, verifier, overlap=True), 30)
    assert tokens == target_continuation(PROMPT, 30)
    assert stats.overlap_hits >= 1
    # Ahead drafting asks one token at a time; a block drafted in line asks for several. After a
    # hit, the whole next block came from ahead: no in-line proposal at that context length.
    inline = [length for length, asked in drafter.proposals if asked > 1]
    assert len(inline) == stats.verify_calls - stats.overlap_hits


async def test_hits_and_misses_follow_the_verdicts():
    verifier = ScriptedVerifier()
    tokens, stats = await _generate(_engine(ScriptedDrafter(), verifier, overlap=True), 30)
    hits, misses = _expected_overlap(verifier.verdicts, 30)
    assert (stats.overlap_hits, stats.overlap_misses) == (hits, misses)
    assert hits > 0 and misses > 0


async def test_without_overlap_nothing_is_drafted_ahead():
    drafter = ScriptedDrafter()
    _, stats = await _generate(_engine(drafter, ScriptedVerifier(latency_s=0.01), overlap=False), 20)
    assert (stats.overlap_hits, stats.overlap_misses) == (0, 0)
    assert len(drafter.proposals) == stats.verify_calls


async def test_a_cancelled_request_cancels_its_verify_call_in_flight():
    verifier = ScriptedVerifier(latency_s=0.01, hang_on_call=1)
    engine = _engine(ScriptedDrafter(), verifier, overlap=True)
    request = GenerationRequest("r", PROMPT, 40, GREEDY, frozenset({EOS}))
    received = []

    async def consume():
        async for batch in engine.generate(request, SpadeStats()):
            received.append(batch)

    task = asyncio.ensure_future(consume())
    while not received:
        await asyncio.sleep(0.01)
    await asyncio.sleep(0.1)  # the second call hangs; the edge drafts ahead meanwhile
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await engine.aclose()
    assert verifier.cancelled == [1]


@dataclass
class RecordingLength(FixedDraftLength):
    """A fixed length that keeps what the engine tells the controller."""

    outcomes: list[BlockOutcome] = field(default_factory=list)

    def observe(self, outcome: BlockOutcome) -> None:
        self.outcomes.append(outcome)


@pytest.mark.parametrize("prefill_first", [False, True], ids=["block-first", "prefill-first"])
@pytest.mark.parametrize("overlap", [False, True], ids=["in-turn", "overlap"])
async def test_the_controller_gets_no_draft_rate_from_the_block_that_prefilled_the_draft(overlap, prefill_first):
    # The first drafted block (in line, or drafted ahead during the prompt-only call) includes the
    # draft model's prefill over the prompt (seconds on a long prompt): as a per-token rate it
    # would tell the controller drafting is that slow.
    lengths = RecordingLength(4)
    engine = SpeculativeEngine(
        ScriptedDrafter(),
        None,
        ScriptedVerifier(latency_s=0.01),
        ModelDescription("target", VOCAB, 10_000, frozenset({EOS})),
        lengths,
        EdgeMetrics(),
        overlap=overlap,
        prefill_first=prefill_first,
    )
    await _generate(engine, 30)
    drafted = [outcome for outcome in lengths.outcomes if outcome.num_drafted > 0]
    assert (len(drafted) < len(lengths.outcomes)) == prefill_first  # the prompt-only call: a block of 0
    first, *later = drafted
    assert first.draft_s_per_token is None
    assert later and all(outcome.num_target_tokens == outcome.num_drafted + 1 for outcome in later)
    assert any(outcome.draft_s_per_token is not None for outcome in later)


# The pieces ---------------------------------------------------------------------------------------


def test_draft_ahead_continues_a_context_that_runs_through_the_guess():
    ahead = DraftAhead(follows=[1, 2, 3, 4], token_ids=[5, 6, 7], probs=None, seconds=0.3)
    assert ahead.continuation_of([1, 2, 3, 4, 5], 8) == DraftBlock([6, 7], None)
    assert ahead.continuation_of([1, 2, 3, 4, 5, 6], 8) == DraftBlock([7], None)
    assert ahead.continuation_of([1, 2, 3, 4, 5], 1) == DraftBlock([6], None)
    assert ahead.seconds_per_token == pytest.approx(0.1)


@pytest.mark.parametrize(
    "context",
    [[1, 2, 3, 4, 9], [1, 2, 3, 8], [1, 2, 3, 4], [1, 2, 3, 4, 5, 6, 7, 8]],
    ids=["wrong-guess", "rejection", "no-next", "past-the-end"],
)
def test_draft_ahead_is_unusable_for_any_other_context(context):
    ahead = DraftAhead(follows=[1, 2, 3, 4], token_ids=[5, 6, 7], probs=None, seconds=0.3)
    assert not ahead.is_continued_by(context) or context == [1, 2, 3, 4, 5, 6, 7]
    assert ahead.continuation_of(context, 8).token_ids == []


def test_sampled_ahead_tokens_keep_their_distributions():
    rows = [SparseDistribution(token_ids=[token, token + 1], probs=[0.5, 0.5]) for token in (5, 6, 7)]
    ahead = DraftAhead(follows=[1, 2], token_ids=[], probs=None, seconds=0.0)
    for token, row in zip((5, 6, 7), rows, strict=True):
        ahead.extend(DraftBlock([token], [row]), 0.01)
    block = ahead.continuation_of([1, 2, 5], 8)
    assert block == DraftBlock([6, 7], rows[1:])
    assert join_blocks(block, DraftBlock([8], [rows[0]])) == DraftBlock([6, 7, 8], [*rows[1:], rows[0]])
    assert join_blocks(DraftBlock([], None), DraftBlock([8], None)) == DraftBlock([8], None)


@dataclass
class CountingDrafter(ScriptedDrafter):
    """A drafter whose sessions are separate objects, so the drafter's own close is counted."""

    drafter_closes: int = 0

    def start_session(self) -> ScriptedDrafter:
        return ScriptedDrafter(self.proposals)

    def close(self) -> None:
        self.drafter_closes += 1


async def test_shutting_the_engine_down_closes_the_drafter_once():
    """The llama.cpp drafter holds a native context (hundreds of MB of KV): the engine frees it
    at shutdown instead of leaving it to the garbage collector."""
    drafter = CountingDrafter()
    tokens, _ = await _generate(_engine(drafter, ScriptedVerifier(latency_s=0.01), overlap=True), 12)
    assert tokens == target_continuation(PROMPT, 12)
    assert drafter.drafter_closes == 1
