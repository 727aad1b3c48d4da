"""The edge's bookkeeping, in one place: what each round of a generation records in the
request's ``spade`` stats, in the service's metrics, and in its policies (the lesson of each
verified block, the verifier's advice). The engine fills one ``BlockEntry`` a round and records it
once (``record_block``); nothing here decides what the loop does next."""

from __future__ import annotations

from dataclasses import dataclass, field

from edge_agent.draft_ahead import Drafting
from edge_agent.drafter import DraftBlock
from edge_agent.estimates import BlockOutcome
from edge_agent.generation import Generation
from edge_agent.metrics import EdgeMetrics
from edge_agent.verifier_client import VerifyCall
from gateway.protocol import SpadeStats


@dataclass
class BlockEntry:
    """The ledger entry of one round of the loop (draft a block, verify it while drafting ahead,
    commit the verdict): what the engine learns as the round goes, recorded once at its end
    (``record_block``), or by the request's end if the round never finished (the caller left, the
    verifier went away)."""

    advice_capped: bool = False
    """The block was drafted shorter than the policy chose, because the verifier advised so."""
    ahead_skipped: bool = False
    """Drafting ahead under the verify call was not worth its CPU (``--edge-power``)."""
    drafted_ahead_tokens: int = 0
    """Tokens drafted while a verify call was in flight (or finished after its verdict)."""
    drafted_ahead_s: float = 0.0
    overlap_hit: bool | None = None
    """Whether what was drafted ahead for this block starts it (None: nothing was drafted ahead)."""
    ahead_confirmed: int = 0
    """Tokens drafted ahead that the committed context ran through (the guess, on a hit: used)."""
    ahead_discarded: int = 0
    """Tokens drafted ahead thrown away (the rest start the block, counted with it)."""
    verifier_unreachable: bool = False
    """The verify call failed for good (the generation ends, or falls back to the draft)."""
    block: DraftBlock | None = None
    """The block sent; None while the round has not reached its commit."""
    call: VerifyCall | None = None
    """Its verdict and cost; None with a block: served unverified (``--fallback draft``)."""
    drafting: Drafting | None = None
    delivered: list[int] = field(default_factory=list)
    is_recorded: bool = False

    def add_drafted_ahead(self, num_tokens: int, seconds: float) -> None:
        self.drafted_ahead_tokens += num_tokens
        self.drafted_ahead_s += seconds

    def add_ahead_outcome(self, num_confirmed: int, num_discarded: int) -> None:
        self.ahead_confirmed += num_confirmed
        self.ahead_discarded += num_discarded


def record_request_started(metrics: EdgeMetrics, num_prompt_tokens: int) -> None:
    metrics.requests.inc()
    metrics.prompt_tokens.inc(num_prompt_tokens)
    metrics.active_requests.inc()


def record_request_ended(metrics: EdgeMetrics, generation: Generation, last_entry: BlockEntry) -> None:
    """The request's end: its last round if it never reached its commit, what was still drafted
    ahead (thrown away), and how much of its context the draft took from other requests' cached
    prefixes (counted once, here; nothing when the draft never ran)."""
    if last_entry.is_recorded:
        last_entry = BlockEntry()
    last_entry.add_ahead_outcome(0, generation.drop_ahead())
    record_block(metrics, generation, last_entry)
    metrics.active_requests.dec()
    if generation.is_draft_prefilled:
        num_cached = generation.draft_session.num_cached_tokens
        generation.stats.draft_cached_tokens = num_cached
        metrics.draft_prompt_tokens.inc(len(generation.request.prompt_token_ids))
        metrics.draft_prefix_hit_tokens.inc(num_cached)


def record_block(metrics: EdgeMetrics, generation: Generation, entry: BlockEntry) -> None:
    """One round's entry, in the request's stats, the metrics and (with a verdict) the policies'
    lessons and the advice the next blocks keep to; once."""
    if entry.is_recorded:
        return
    entry.is_recorded = True
    stats = generation.stats
    if entry.advice_capped:
        stats.advice_capped_blocks += 1
        metrics.advice_capped_blocks.inc()
    if entry.ahead_skipped:
        stats.skipped_ahead_blocks += 1
        metrics.skipped_ahead_blocks.inc()
    metrics.draft_ahead_tokens.inc(entry.drafted_ahead_tokens)
    stats.draft_ahead_tokens += entry.drafted_ahead_tokens
    stats.draft_ahead_ms += entry.drafted_ahead_s * 1e3
    if entry.overlap_hit is not None:
        record_overlap(metrics, stats, entry.overlap_hit)
    stats.used_draft_tokens += entry.ahead_confirmed
    stats.discarded_ahead_tokens += entry.ahead_discarded
    metrics.used_draft_tokens.inc(entry.ahead_confirmed)
    metrics.discarded_ahead_tokens.inc(entry.ahead_discarded)
    if entry.verifier_unreachable:
        metrics.verify_failures.inc()
    if entry.block is not None and entry.drafting is not None:
        record_verified_block(metrics, generation, entry.block, entry.call, entry.drafting)
    metrics.generated_tokens.inc(len(entry.delivered))


def record_overlap(metrics: EdgeMetrics, stats: SpadeStats, is_hit: bool) -> None:
    """A hit: what was drafted ahead starts the next block. A miss: it is rolled back, unused."""
    if is_hit:
        stats.overlap_hits += 1
        metrics.overlap_hits.inc()
    else:
        stats.overlap_misses += 1
        metrics.overlap_misses.inc()


def record_verified_block(
    metrics: EdgeMetrics, generation: Generation, block: DraftBlock, call: VerifyCall | None, drafting: Drafting
) -> None:
    """One block sent for verification: its verdict counted in the request's stats and the
    metrics, and taught to the request's estimate (both policies read it); with no verdict (verifier unreachable,
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
    generation.estimate.observe(block_outcome(call, num_drafted, drafting))
    record_advice(metrics, generation, call.verdict.advised_draft_length)


def record_advice(metrics: EdgeMetrics, generation: Generation, advice: int) -> None:
    """The verdict's advice: the cap of the generation's next blocks (``generation.draft_length``)."""
    generation.verifier_advice = advice
    generation.stats.advised_draft_length = advice
    metrics.verifier_advice.observe(advice)


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
    """What the verified block teaches the request's estimate."""
    verdict = call.verdict
    verifier_s = verdict.timings.total_ms / 1e3
    return BlockOutcome(
        num_drafted, verdict.num_accepted, drafting.seconds_per_token, call.round_trip_s, verifier_s, verdict.num_target_tokens
    )
