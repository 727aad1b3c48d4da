"""The edge's bookkeeping, in one place: what each step of a generation records in the
request's ``spade`` stats, in the service's metrics, and in the draft-length policy (the lesson
of each verified block). Nothing here decides what the loop does next."""

from __future__ import annotations

from edge_agent.draft_ahead import Drafting
from edge_agent.draft_length import BlockOutcome
from edge_agent.drafter import DraftBlock
from edge_agent.generation import Generation
from edge_agent.metrics import EdgeMetrics
from edge_agent.verifier_client import VerifyCall
from gateway.protocol import SpadeStats


def record_request_started(metrics: EdgeMetrics, num_prompt_tokens: int) -> None:
    metrics.requests.inc()
    metrics.prompt_tokens.inc(num_prompt_tokens)
    metrics.active_requests.inc()


def record_request_ended(metrics: EdgeMetrics) -> None:
    metrics.active_requests.dec()


def record_draft_prefix_reuse(metrics: EdgeMetrics, generation: Generation) -> None:
    """How much of its context the request's draft took from other requests' cached prefixes
    (counted once, at the end; nothing when the draft never ran)."""
    if not generation.is_draft_prefilled:
        return
    num_cached = generation.draft_session.num_cached_tokens
    generation.stats.draft_cached_tokens = num_cached
    metrics.draft_prompt_tokens.inc(len(generation.request.prompt_token_ids))
    metrics.draft_prefix_hit_tokens.inc(num_cached)


def record_drafted_ahead(metrics: EdgeMetrics, generation: Generation, num_tokens: int, seconds: float) -> None:
    """Tokens drafted while a verify call was in flight (or finished after its verdict)."""
    metrics.draft_ahead_tokens.inc(num_tokens)
    generation.stats.draft_ahead_tokens += num_tokens
    generation.stats.draft_ahead_ms += seconds * 1e3


def record_ahead_outcome(metrics: EdgeMetrics, generation: Generation, num_confirmed: int, num_discarded: int) -> None:
    """What became of the tokens drafted past a block: ``num_confirmed`` the committed context
    ran through (the guess, on a hit: used), ``num_discarded`` thrown away; the rest start the
    next block (counted with it, as accepted or rejected)."""
    generation.stats.used_draft_tokens += num_confirmed
    generation.stats.discarded_ahead_tokens += num_discarded
    metrics.used_draft_tokens.inc(num_confirmed)
    metrics.discarded_ahead_tokens.inc(num_discarded)


def record_ahead_skipped(metrics: EdgeMetrics, generation: Generation) -> None:
    """A verify call under which drafting ahead was not worth its CPU (``--edge-power``)."""
    generation.stats.skipped_ahead_blocks += 1
    metrics.skipped_ahead_blocks.inc()


def record_overlap(metrics: EdgeMetrics, generation: Generation, is_hit: bool) -> None:
    """A hit: what was drafted ahead starts the next block. A miss: it is rolled back, unused."""
    if is_hit:
        generation.stats.overlap_hits += 1
        metrics.overlap_hits.inc()
    else:
        generation.stats.overlap_misses += 1
        metrics.overlap_misses.inc()


def record_unreachable_verifier(metrics: EdgeMetrics) -> None:
    """A verify call failed for good (the generation ends, or falls back to the draft)."""
    metrics.verify_failures.inc()


def record_verified_block(
    metrics: EdgeMetrics, generation: Generation, block: DraftBlock, call: VerifyCall | None, drafting: Drafting
) -> None:
    """One block sent for verification: its verdict counted in the request's stats and the
    metrics, and taught to the draft-length policy; with no verdict (verifier unreachable,
    ``--fallback draft``) its tokens counted as served unverified."""
    num_drafted = len(block.token_ids)
    if call is None:
        generation.stats.fallback_tokens += num_drafted
        generation.stats.used_draft_tokens += num_drafted  # served unverified: used all the same
        metrics.used_draft_tokens.inc(num_drafted)
        generation.stats.draft_ms += drafting.exposed_s * 1e3
        metrics.fallback_tokens.inc(num_drafted)
        return
    count_call(generation.stats, call, num_drafted, drafting)
    metrics.observe_call(call, num_drafted, drafting.exposed_s)
    outcome = block_outcome(call, num_drafted, drafting)
    generation.policy.observe(outcome)
    teach_ahead_policy(generation, outcome)
    record_advice(metrics, generation, call.verdict.advised_draft_length)


def teach_ahead_policy(generation: Generation, outcome: BlockOutcome) -> None:
    """The drafting-ahead policy learns the request's acceptance, the draft's speed and the
    round trip of a block (a call that also prefilled context is no block's round trip)."""
    generation.ahead_policy.observe_block(outcome.num_drafted, outcome.num_accepted)
    round_trip_s = outcome.round_trip_s if outcome.is_block_only and outcome.num_drafted > 0 else None
    generation.ahead_policy.shared.observe_times(outcome.draft_s_per_token, round_trip_s)


def record_advice(metrics: EdgeMetrics, generation: Generation, advice: int) -> None:
    """The verdict's advice: the cap of the generation's next blocks (``generation.draft_length``)."""
    generation.verifier_advice = advice
    generation.stats.advised_draft_length = advice
    metrics.verifier_advice.observe(advice)


def record_advice_cap(metrics: EdgeMetrics, generation: Generation) -> None:
    """A block drafted shorter than the policy chose, because the verifier advised so."""
    generation.stats.advice_capped_blocks += 1
    metrics.advice_capped_blocks.inc()


def record_delivered(metrics: EdgeMetrics, delivered: list[int]) -> None:
    metrics.generated_tokens.inc(len(delivered))


def count_call(stats: SpadeStats, call: VerifyCall, num_drafted: int, drafting: Drafting) -> None:
    """The request's own account of one verified block (the ``spade`` object of its response)."""
    verdict = call.verdict
    stats.verify_calls += 1
    stats.drafted_tokens += num_drafted
    stats.accepted_tokens += verdict.num_accepted
    stats.continued_tokens += len(verdict.continued_tokens)
    stats.used_draft_tokens += verdict.num_accepted
    stats.rejected_draft_tokens += num_drafted - verdict.num_accepted
    stats.target_tokens += verdict.num_target_tokens
    stats.resyncs += int(call.resynced)
    stats.draft_ms += drafting.exposed_s * 1e3
    stats.verify_ms += call.round_trip_s * 1e3
    stats.verifier_forward_ms += verdict.timings.forward_ms
    stats.verifier_cached_tokens += verdict.num_cached_tokens


def block_outcome(call: VerifyCall, num_drafted: int, drafting: Drafting) -> BlockOutcome:
    """What the verified block teaches the draft-length policy."""
    verdict = call.verdict
    verifier_s = verdict.timings.total_ms / 1e3
    return BlockOutcome(
        num_drafted, verdict.num_accepted, drafting.seconds_per_token, call.round_trip_s, verifier_s, verdict.num_target_tokens
    )
