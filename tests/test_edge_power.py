"""``--edge-power``: how far the edge drafts ahead under a verify call, CPU against wait.

The rule (``edge_agent.edge_power``) on worked numbers; through the scripted engine: the output
is the target's in every mode, performance drafts ahead as the engine always did, saver only the
prompt's prefill, and every drafted token is counted exactly once as used, rejected or
discarded ahead (in the request's ``spade`` stats and on /metrics)."""

from __future__ import annotations

import math

import pytest

from edge_agent.accounting import BlockEntry
from edge_agent.draft_length import AdaptiveDraftLength
from edge_agent.edge_power import DraftAheadPolicy, expected_saving_per_cpu_s
from edge_agent.engine import SpeculativeEngine
from edge_agent.estimates import BlockOutcome, EdgeEstimates
from edge_agent.metrics import EdgeMetrics
from edge_agent.settings import EdgeSettings
from gateway.engine import GenerationRequest
from gateway.protocol import SpadeStats
from scripted_support import EOS, GREEDY, PROMPT, ScriptedDrafter, ScriptedVerifier, generate, scripted_engine, target_continuation

POWERS = ("performance", "balanced", "saver")


def test_the_saving_per_cpu_second_follows_the_worked_examples():
    assert expected_saving_per_cpu_s(0.4, 6) == pytest.approx((0.4 * 5 - 0.6 * 0.5) / 6)
    assert expected_saving_per_cpu_s(0.7, 6) == pytest.approx((0.7 * 5 - 0.3 * 0.5) / 6)
    assert expected_saving_per_cpu_s(0.0, 6) < 0
    assert expected_saving_per_cpu_s(1.0, 1) == 0.0  # the guess alone saves no drafting
    assert expected_saving_per_cpu_s(0.9, 0) == 0.0


def test_more_tokens_ahead_never_save_less_per_cpu_second():
    for hit in (0.1, 0.4, 0.8):
        savings = [expected_saving_per_cpu_s(hit, num_ahead) for num_ahead in range(1, 17)]
        assert savings == sorted(savings)


def _request(power: str, acceptance: float, guess_rate: float = 0.9, draft_s: float = 0.02, round_trip_s: float = 0.2):
    """One request's drafting-ahead policy on injected estimates (its acceptance starts at the prior)."""
    estimates = EdgeEstimates(draft_s_per_token=draft_s, round_trip_s=round_trip_s, initial_acceptance=acceptance, guess_rate=guess_rate)
    return DraftAheadPolicy(power).for_request(estimates.for_request())


def test_performance_always_drafts_the_whole_limit():
    assert _request("performance", 0.1).ahead_limit(4, 5, prefills_draft=False) == 5


def test_saver_drafts_ahead_only_the_prefill():
    request = _request("saver", 0.99, guess_rate=0.99)
    assert request.ahead_limit(4, 5, prefills_draft=False) == 0
    assert request.ahead_limit(0, 6, prefills_draft=True) == 1


def test_balanced_drafts_ahead_all_or_nothing_by_the_hit_probability():
    # a = 0.95, d = 2, g = 0.9: h = 0.81; 10 tokens fit the round trip, L = min(5, 10) = 5:
    # (0.81 * 4 - 0.19 * 0.5) / 5 = 0.63 >= 0.5 -> all 5.
    assert _request("balanced", 0.95).ahead_limit(2, 5, prefills_draft=False) == 5
    # a = 0.6, d = 4: h = 0.117 -> none (the prefill's forward alone when it is one).
    assert _request("balanced", 0.6).ahead_limit(4, 5, prefills_draft=False) == 0
    # The prompt-only call (d = 0): h is the guess rate; 0.3 -> the prefill's forward alone.
    assert _request("balanced", 0.6, guess_rate=0.3).ahead_limit(0, 5, prefills_draft=True) == 1
    assert _request("balanced", 0.6, guess_rate=0.9).ahead_limit(0, 5, prefills_draft=True) == 5


def test_a_round_trip_too_short_for_drafting_ahead_makes_it_not_worth_it():
    # h = 0.81 again, but one draft forward fills the round trip: L = 1, the guess alone, no saving.
    assert _request("balanced", 0.95, draft_s=0.05, round_trip_s=0.04).ahead_limit(2, 5, prefills_draft=False) == 0


def test_the_policy_reads_the_requests_acceptance_as_its_blocks_teach_it():
    # The estimate the draft-length policy reads too (``estimates``): one per request.
    request = _request("balanced", 0.7)
    for _ in range(30):
        request.estimate.observe(BlockOutcome(4, 4, 0.02, 0.2, 0.15))
    assert request.estimate.acceptance_rate > 0.95
    assert request.ahead_limit(2, 5, prefills_draft=False) == 5
    for _ in range(30):
        request.estimate.observe(BlockOutcome(4, 0, 0.02, 0.2, 0.15))
    assert request.estimate.acceptance_rate < 0.05
    assert request.ahead_limit(2, 5, prefills_draft=False) == 0
    request.estimate.observe(BlockOutcome(0, 0, None, 1.0, 0.9))  # the prompt-only call tries no drafted token


async def test_both_policies_of_a_request_read_one_estimate():
    engine = scripted_engine(ScriptedDrafter(), ScriptedVerifier(latency_s=0.01), AdaptiveDraftLength(max_length=8), overlap=True)
    generation = engine._start(GenerationRequest("r", PROMPT, 5, GREEDY, frozenset({EOS})), SpadeStats())
    try:
        assert generation.policy.estimate is generation.estimate is generation.ahead_policy.estimate
    finally:
        engine._finish(generation, BlockEntry())
        await engine.aclose()


def test_an_unknown_power_is_refused():
    with pytest.raises(ValueError, match="edge power"):
        DraftAheadPolicy("turbo")  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        EdgeSettings(edge_power="turbo")


def _engine(power: str, drafter, verifier, metrics=None, prefill_first: bool = True) -> SpeculativeEngine:
    return scripted_engine(
        drafter, verifier, metrics=metrics, overlap=True, prefill_first=prefill_first, draft_ahead_policy=DraftAheadPolicy(power)
    )


def _num_drafted(drafter: ScriptedDrafter) -> int:
    return sum(asked for _, asked in drafter.proposals)


@pytest.mark.parametrize("prefill_first", [True, False], ids=["prefill-first", "block-first"])
@pytest.mark.parametrize("power", POWERS)
async def test_the_output_is_the_targets_in_every_power_mode(power, prefill_first):
    drafter = ScriptedDrafter()
    tokens, stats = await generate(_engine(power, drafter, ScriptedVerifier(latency_s=0.02), prefill_first=prefill_first), 40)
    assert tokens == target_continuation(PROMPT, 40)


@pytest.mark.parametrize("power", POWERS)
async def test_every_drafted_token_is_used_rejected_or_discarded_ahead(power):
    drafter, metrics = ScriptedDrafter(), EdgeMetrics()
    _, stats = await generate(_engine(power, drafter, ScriptedVerifier(latency_s=0.02), metrics), 40)
    num_drafted = _num_drafted(drafter)
    assert stats.used_draft_tokens + stats.rejected_draft_tokens + stats.discarded_ahead_tokens == num_drafted
    assert stats.rejected_draft_tokens == stats.drafted_tokens - stats.accepted_tokens
    assert stats.used_draft_tokens == stats.accepted_tokens + stats.overlap_hits
    counted = sum(
        metrics.registry.get_sample_value(f"spade_edge_{name}_total") or 0.0
        for name in ("used_draft_tokens", "rejected_draft_tokens", "discarded_ahead_tokens")
    )
    assert counted == num_drafted
    assert metrics.registry.get_sample_value("spade_edge_skipped_ahead_blocks_total") == stats.skipped_ahead_blocks


async def test_performance_drafts_ahead_as_the_engine_always_did():
    drafted = {}
    for name, options in (("before", {}), ("performance", {"power": "performance"})):
        drafter = ScriptedDrafter()
        if options:
            engine = _engine("performance", drafter, ScriptedVerifier(latency_s=0.02))
        else:
            engine = scripted_engine(drafter, ScriptedVerifier(latency_s=0.02), overlap=True, prefill_first=True)
        _, stats = await generate(engine, 40)
        drafted[name] = (drafter.proposals, stats.skipped_ahead_blocks)
    assert drafted["performance"] == drafted["before"]
    assert drafted["performance"][1] == 0


async def test_saver_drafts_ahead_only_the_prompts_prefill_and_spends_less():
    drafted = {}
    for power in ("performance", "saver"):
        drafter = ScriptedDrafter()
        _, stats = await generate(_engine(power, drafter, ScriptedVerifier(latency_s=0.02)), 40)
        drafted[power] = (_num_drafted(drafter), stats)
    saver = drafted["saver"][1]
    assert saver.draft_ahead_tokens == 1  # the guess that came with the draft's prefill
    assert saver.skipped_ahead_blocks >= saver.verify_calls // 2  # all but the prompt-only call and the last ones
    assert drafted["saver"][0] < drafted["performance"][0]
    assert drafted["performance"][1].discarded_ahead_tokens > saver.discarded_ahead_tokens


async def test_a_cancelled_request_counts_what_it_drafted_ahead_as_discarded():
    drafter, verifier, stats = ScriptedDrafter(), ScriptedVerifier(latency_s=0.02, hang_on_call=2), SpadeStats()
    engine = _engine("performance", drafter, verifier)
    stream = engine.generate(GenerationRequest("r", PROMPT, 40, GREEDY, frozenset({EOS})), stats)
    async for _ in stream:
        if stats.verify_calls == 2:
            break
    await stream.aclose()
    await engine.aclose()
    assert stats.discarded_ahead_tokens >= 1
    total = stats.used_draft_tokens + stats.rejected_draft_tokens + stats.discarded_ahead_tokens
    assert math.isclose(total, _num_drafted(drafter))
