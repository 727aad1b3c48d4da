"""Drafting that overlaps verification, with a scripted drafter and verifier: what was drafted
ahead starts the next block only when the verdict runs through the draft's guess, the output
is the target's whatever happens, and hits and misses are counted."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import pytest

from edge_agent.draft_ahead import DraftAhead, join_blocks
from edge_agent.draft_length import FixedDraftLength
from edge_agent.drafter import DraftBlock
from edge_agent.estimates import BlockOutcome, EdgeEstimates, RequestEstimate
from gateway.engine import GenerationRequest
from gateway.protocol import SpadeStats
from scripted_support import (
    EOS,
    GREEDY,
    PROMPT,
    ScriptedDrafter,
    ScriptedVerifier,
    draft_rule,
    generate,
    scripted_engine,
    target_continuation,
)
from verifier_service.protocol import SparseDistribution


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
    tokens, stats = await generate(scripted_engine(ScriptedDrafter(), ScriptedVerifier(latency_s=0.05), overlap=overlap), 40)
    assert tokens == target_continuation(PROMPT, 40)
    assert stats.verify_calls < 40


async def test_a_hit_starts_the_next_block_with_what_was_drafted_ahead():
    drafter, verifier = ScriptedDrafter(), ScriptedVerifier()
    tokens, stats = await generate(scripted_engine(drafter, verifier, overlap=True), 30)
    assert tokens == target_continuation(PROMPT, 30)
    assert stats.overlap_hits >= 1
    # Ahead drafting asks one token at a time; a block drafted in line asks for several. After a
    # hit, the whole next block came from ahead: no in-line proposal at that context length.
    inline = [length for length, asked in drafter.proposals if asked > 1]
    assert len(inline) == stats.verify_calls - stats.overlap_hits


async def test_hits_and_misses_follow_the_verdicts():
    verifier = ScriptedVerifier()
    tokens, stats = await generate(scripted_engine(ScriptedDrafter(), verifier, overlap=True), 30)
    hits, misses = _expected_overlap(verifier.verdicts, 30)
    assert (stats.overlap_hits, stats.overlap_misses) == (hits, misses)
    assert hits > 0 and misses > 0


async def test_without_overlap_nothing_is_drafted_ahead():
    drafter = ScriptedDrafter()
    _, stats = await generate(scripted_engine(drafter, ScriptedVerifier(latency_s=0.01), overlap=False), 20)
    assert (stats.overlap_hits, stats.overlap_misses) == (0, 0)
    assert len(drafter.proposals) == stats.verify_calls


async def test_a_cancelled_request_cancels_its_verify_call_in_flight():
    verifier = ScriptedVerifier(latency_s=0.01, hang_on_call=1)
    engine = scripted_engine(ScriptedDrafter(), verifier, overlap=True)
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
class RecordingEstimates(EdgeEstimates):
    """The edge's estimates, keeping every outcome the engine teaches a request's estimate."""

    outcomes: list[BlockOutcome] = field(default_factory=list)

    def for_request(self) -> RequestEstimate:
        return RecordingEstimate(self)


@dataclass
class RecordingEstimate(RequestEstimate):
    def observe(self, outcome: BlockOutcome) -> None:
        self.shared.outcomes.append(outcome)
        super().observe(outcome)


@pytest.mark.parametrize("prefill_first", [False, True], ids=["block-first", "prefill-first"])
@pytest.mark.parametrize("overlap", [False, True], ids=["in-turn", "overlap"])
async def test_the_controller_gets_no_draft_rate_from_the_block_that_prefilled_the_draft(overlap, prefill_first):
    # The first drafted block (in line, or drafted ahead during the prompt-only call) includes the
    # draft model's prefill over the prompt (seconds on a long prompt): as a per-token rate it
    # would tell the controller drafting is that slow.
    estimates = RecordingEstimates()
    engine = scripted_engine(
        ScriptedDrafter(),
        ScriptedVerifier(latency_s=0.01),
        FixedDraftLength(4),
        overlap=overlap,
        prefill_first=prefill_first,
        estimates=estimates,
    )
    await generate(engine, 30)
    drafted = [outcome for outcome in estimates.outcomes if outcome.num_drafted > 0]
    assert (len(drafted) < len(estimates.outcomes)) == prefill_first  # the prompt-only call: a block of 0
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

    def start_session(self, prefix_owner: str = "") -> ScriptedDrafter:
        return ScriptedDrafter(self.proposals)

    def close(self) -> None:
        self.drafter_closes += 1


async def test_shutting_the_engine_down_closes_the_drafter_once():
    """The llama.cpp drafter holds a native context (hundreds of MB of KV): the engine frees it
    at shutdown instead of leaving it to the garbage collector."""
    drafter = CountingDrafter()
    tokens, _ = await generate(scripted_engine(drafter, ScriptedVerifier(latency_s=0.01), overlap=True), 12)
    assert tokens == target_continuation(PROMPT, 12)
    assert drafter.drafter_closes == 1
