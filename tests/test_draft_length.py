"""The draft-length policy: the speed model, the optimum it picks with injected acceptance
and timings, adaptation within a request, the prior carried across requests, and its bounds."""

from __future__ import annotations

import random

import pytest

from edge_agent.draft_length import (
    AdaptiveDraftLength,
    FixedDraftLength,
    RequestDraftLength,
    draft_length_policy,
    exposed_draft_s,
    parse_draft_length,
    tokens_per_s,
)
from edge_agent.estimates import BlockOutcome, EdgeEstimates, VerifyTimeCurve
from edge_agent.settings import EdgeSettings
from spade_core.block_yield import expected_tokens

# The speed model --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("acceptance_rate", "num_drafted", "expected"),
    [(0.8, 3, (1 - 0.8**4) / 0.2), (0.5, 1, 1.5), (0.0, 4, 1.0), (1.0, 5, 6.0)],
)
def test_expected_tokens_is_accepted_drafts_plus_the_next_token(acceptance_rate, num_drafted, expected):
    assert expected_tokens(acceptance_rate, num_drafted) == pytest.approx(expected)


def test_without_overlap_all_drafting_is_exposed():
    assert exposed_draft_s(4, 0.9, 0.02, 0.5, overlap=False) == pytest.approx(0.08)


def test_with_overlap_a_hit_hides_drafting_under_the_round_trip():
    # a = 0.5, d = 1: hit probability 0.25; ahead 2 x 20 ms fits in 100 ms, so only misses pay.
    assert exposed_draft_s(1, 0.5, 0.02, 0.1, overlap=True) == pytest.approx(0.75 * 0.02)


def test_with_overlap_a_hit_pays_what_outlasts_the_round_trip():
    # a = 1: always a hit; 5 ahead x 30 ms = 150 ms against a 100 ms round trip -> 50 ms exposed.
    assert exposed_draft_s(4, 1.0, 0.03, 0.1, overlap=True) == pytest.approx(0.05)


def _brute_force_best(acceptance_rate, draft_s, link_s, verify_line, max_length, overlap) -> int:
    """The optimum by the issue's formula E(a, d) / (d t_draft + t_link + t_verify(d)) (exposed
    drafting under overlap), computed here independently of the controller."""
    intercept, slope = verify_line
    best, best_rate = None, -1.0
    for d in range(1, max_length + 1):
        round_trip = link_s + intercept + slope * d
        if overlap:
            hit = acceptance_rate ** (d + 1)
            drafting = hit * max(0.0, (d + 1) * draft_s - round_trip) + (1 - hit) * d * draft_s
        else:
            drafting = d * draft_s
        rate = (1 - acceptance_rate ** (d + 1)) / (1 - acceptance_rate) / (drafting + round_trip)
        if rate > best_rate:
            best, best_rate = d, rate
    return best


class _Controller:
    """The adaptive rule on injected estimates: timings set, the verify curve two exact points."""

    def __init__(self, draft_s, link_s, verify_line, max_length=16, overlap=False) -> None:
        self.rule = AdaptiveDraftLength(max_length=max_length, overlap=overlap)
        self.estimates = EdgeEstimates(draft_s_per_token=draft_s, link_s=link_s)
        intercept, slope = verify_line
        self.estimates.verify_curve.points = {1: (intercept + slope, 5), 8: (intercept + 8 * slope, 5)}

    def best_length(self, acceptance_rate: float) -> int:
        return self.rule.best_length(acceptance_rate, self.estimates)


def _controller(acceptance_rate, draft_s, link_s, verify_line, max_length=16, overlap=False) -> _Controller:
    return _Controller(draft_s, link_s, verify_line, max_length, overlap)


def _request(estimates: EdgeEstimates | None = None, max_length: int = 16, overlap: bool = False) -> RequestDraftLength:
    """One request's adaptive rule on its own estimate, started from ``estimates``."""
    return AdaptiveDraftLength(max_length=max_length, overlap=overlap).for_request((estimates or EdgeEstimates()).for_request())


@pytest.mark.parametrize("overlap", [False, True], ids=["no-overlap", "overlap"])
@pytest.mark.parametrize(
    ("acceptance_rate", "draft_s", "link_s", "verify_line"),
    [
        (0.8, 0.02, 0.0, (0.1, 0.0)),  # the docstring's example: d = 4 without overlap
        (0.8, 0.02, 0.2, (0.1, 0.0)),  # long round trip -> long blocks
        (0.3, 0.02, 0.01, (0.3, 0.03)),  # poor acceptance -> short blocks
        (0.9, 0.025, 0.05, (0.33, 0.035)),  # the real pair on a CPU: t(9 rows) ~ 1.8 t(1)
        (0.95, 0.001, 0.1, (0.05, 0.0)),  # cheap drafting, flat verify -> the longest block
        (0.6, 0.15, 0.0, (0.2, 0.02)),  # slow drafting (transformers fp32)
    ],
)
def test_the_controller_picks_the_optimum_of_the_speed_model(acceptance_rate, draft_s, link_s, verify_line, overlap):
    controller = _controller(acceptance_rate, draft_s, link_s, verify_line, overlap=overlap)
    expected = _brute_force_best(acceptance_rate, draft_s, link_s, verify_line, 16, overlap)
    assert controller.best_length(acceptance_rate) == expected


def test_the_docstring_examples():
    lengths = [_controller(0.8, 0.02, 0.0, (verify_s, 0.0)).best_length(0.8) for verify_s in (0.01, 0.1, 0.3)]
    assert lengths == [1, 4, 7]


def test_poor_acceptance_chooses_the_shortest_block():
    assert _controller(0.1, 0.02, 0.01, (0.1, 0.01)).best_length(0.1) == 1


def test_overlap_never_predicts_a_slower_block():
    for d in range(1, 17):
        assert tokens_per_s(d, 0.9, 0.05, 0.1, 0.3, overlap=True) >= tokens_per_s(d, 0.9, 0.05, 0.1, 0.3, overlap=False)


def test_overlap_favours_blocks_whose_ahead_drafting_is_likely_used():
    # Slow drafting, good acceptance: a shorter block is more often a hit (a^(d+1)), and a hit
    # hides its drafting under the round trip, so overlap picks 4 where drafting in turn picks 8.
    lengths = [_controller(0.95, 0.1, 0.1, (0.3, 0.02), overlap=overlap).best_length(0.95) for overlap in (False, True)]
    assert lengths == [8, 4]


@pytest.mark.parametrize("max_length", [1, 3, 8])
def test_the_choice_stays_within_its_bounds(max_length):
    for acceptance_rate in (0.0, 0.5, 0.99):
        assert 1 <= _controller(acceptance_rate, 1e-4, 1.0, (0.5, 0.0), max_length=max_length).best_length(acceptance_rate) <= max_length


def test_tokens_per_s_of_one_block():
    # a = 0.5, d = 2: 1.75 tokens per (2 x 10 + 30 + 50) ms = 100 ms.
    assert tokens_per_s(2, 0.5, 0.01, 0.03, 0.05, overlap=False) == pytest.approx(17.5)


# The verify-time curve --------------------------------------------------------------------------


def test_the_curve_fits_a_line_through_the_measured_lengths():
    curve = VerifyTimeCurve(smoothing=1.0)
    for d in (1, 4, 8):
        curve.observe(d, 0.3 + 0.02 * d)
    assert curve.line() == (pytest.approx(0.3), pytest.approx(0.02))
    assert curve.seconds(16) == pytest.approx(0.62)


def test_one_measured_length_gets_the_default_relative_slope():
    curve = VerifyTimeCurve(smoothing=1.0)
    curve.observe(1, 0.4)
    assert (curve.seconds(1), curve.seconds(11)) == (pytest.approx(0.4), pytest.approx(0.8))


def test_a_longer_block_never_reads_as_cheaper():
    curve = VerifyTimeCurve(smoothing=1.0)
    curve.observe(2, 0.5)
    curve.observe(8, 0.3)  # noise
    assert curve.line()[1] == 0.0


# Learning: within a request, and across requests --------------------------------------------------


def _feed(
    request_controller,
    acceptance: float,
    blocks: int,
    seed: int = 0,
    draft_s: float = 0.02,
    link_s: float = 0.01,
    verify_line: tuple[float, float] = (0.2, 0.01),
) -> list[int]:
    """Blocks of the controller's length whose drafted tokens are each accepted with probability
    ``acceptance`` until the first rejection, as a verifier answers them; returns the lengths."""
    rng = random.Random(seed)
    lengths = []
    for _ in range(blocks):
        num_drafted = request_controller.next_length()
        num_accepted = 0
        while num_accepted < num_drafted and rng.random() < acceptance:
            num_accepted += 1
        verifier_s = verify_line[0] + verify_line[1] * num_drafted
        request_controller.estimate.observe(BlockOutcome(num_drafted, num_accepted, draft_s, verifier_s + link_s, verifier_s))
        lengths.append(num_drafted)
    return lengths


def test_acceptance_estimate_converges_to_the_true_rate():
    # Regression: averaging per-block estimates k / (k + 1) read a rate of 0.8 as about 0.6.
    request = _request(EdgeEstimates(smoothing=0.02))
    _feed(request, acceptance=0.8, blocks=2000)
    assert request.estimate.acceptance_rate == pytest.approx(0.8, abs=0.05)


def test_the_controller_learns_the_measured_times():
    shared = EdgeEstimates()
    _feed(_request(shared), acceptance=0.5, blocks=300, draft_s=0.004, link_s=0.03, verify_line=(0.2, 0.01))
    assert (shared.draft_s_per_token, shared.link_s) == (pytest.approx(0.004), pytest.approx(0.03))
    assert shared.verify_curve.line() == (pytest.approx(0.2), pytest.approx(0.01))


def test_the_length_adapts_within_a_request_when_acceptance_changes():
    request = _request(max_length=16)
    high = _feed(request, acceptance=0.95, blocks=60)
    low = _feed(request, acceptance=0.1, blocks=60, seed=1)
    assert sum(high[-10:]) / 10 >= 8 and low[-10:] == [1] * 10


def test_a_new_request_starts_from_the_prior_of_earlier_requests():
    shared = EdgeEstimates()
    for seed in range(5):
        _feed(_request(shared), acceptance=0.2, blocks=60, seed=seed)
    assert shared.acceptance_prior == pytest.approx(0.2, abs=0.07)
    assert _request(shared).next_length() == 1


def test_a_requests_own_acceptance_does_not_leak_into_another_request():
    shared = EdgeEstimates()
    first, second = _request(shared), _request(shared)
    _feed(first, acceptance=0.05, blocks=30)
    assert first.estimate.acceptance_rate < 0.2 and second.estimate.acceptance_rate == pytest.approx(0.7)


def test_an_empty_block_teaches_nothing():
    shared = EdgeEstimates()
    request = _request(shared)
    request.estimate.observe(BlockOutcome(0, 0, None, 0.0, 0.0))
    assert (request.estimate.acceptance_rate, shared) == (pytest.approx(0.7), EdgeEstimates())


def test_fixed_length_reads_no_estimate():
    estimate = EdgeEstimates().for_request()
    estimate.observe(BlockOutcome(5, 0, 10.0, 10.0, 1.0))
    assert FixedDraftLength(5).for_request(estimate).next_length() == 5


@pytest.mark.parametrize(("value", "expected"), [("auto", "auto"), (" AUTO ", "auto"), ("5", 5), (" 7 ", 7), (3, 3)])
def test_parse_draft_length(value, expected):
    assert parse_draft_length(value) == expected


@pytest.mark.parametrize("value", ["0", "-2", "2.5", "five", "", 0, 2.5, True, None])
def test_parse_draft_length_refuses_anything_but_a_positive_integer_or_auto(value):
    with pytest.raises(ValueError, match="positive integer or 'auto'"):
        parse_draft_length(value)


@pytest.mark.parametrize(
    ("draft_length", "expected"),
    [("auto", AdaptiveDraftLength(max_length=12, overlap=True)), (5, FixedDraftLength(5))],
)
def test_the_policy_follows_the_setting(draft_length, expected):
    assert draft_length_policy(draft_length, 12, overlap=True) == expected


def test_the_setting_is_parsed_once_into_its_value(monkeypatch):
    """The settings hold the parsed value (an int or "auto"), which the policy takes as it is."""
    monkeypatch.setenv("SPADE_EDGE_DRAFT_LENGTH", " Auto ")
    assert EdgeSettings().draft_length == "auto"
    assert EdgeSettings(draft_length="4").draft_length_policy() == FixedDraftLength(4)
    with pytest.raises(ValueError, match="positive integer or 'auto'"):
        EdgeSettings(draft_length="0")


@pytest.mark.parametrize(
    ("policy", "expected"),
    [
        (FixedDraftLength(8), FixedDraftLength(2)),
        (FixedDraftLength(1), FixedDraftLength(1)),
        (AdaptiveDraftLength(max_length=16, overlap=True), AdaptiveDraftLength(max_length=2, overlap=True)),
    ],
)
def test_the_verifiers_limit_caps_the_policy(policy, expected):
    assert policy.within(2) == expected


def test_adaptive_length_refuses_a_length_below_one():
    with pytest.raises(ValueError):
        AdaptiveDraftLength(max_length=0)


@pytest.mark.parametrize("arguments", [dict(smoothing=0.0), dict(smoothing=1.5), dict(initial_acceptance=1.0)])
def test_the_estimates_refuse_bad_settings(arguments):
    with pytest.raises(ValueError):
        EdgeEstimates(**arguments)


def test_a_call_that_prefilled_the_prompt_teaches_acceptance_but_not_the_verify_curve():
    # Regression: a request's first call (600 prompt tokens + a block of 4: seconds of prefill)
    # was averaged into t_verify(4), which bent the fitted line for many blocks after: here the
    # controller then chose blocks of 1 for a request that had just accepted 4 of 4.
    measured, poisoned = EdgeEstimates(), EdgeEstimates()
    for shared in (measured, poisoned):
        _feed(_request(shared), acceptance=0.6, blocks=200, verify_line=(0.4, 0.03))
    before = poisoned.verify_curve.line()
    request = _request(poisoned)
    request.estimate.observe(BlockOutcome(4, 4, 0.02, 30.01, 30.0, num_target_tokens=604))
    assert poisoned.verify_curve.line() == before
    assert poisoned.acceptance_prior > measured.acceptance_prior  # 4 of 4 accepted: learnt
    assert request.next_length() > 1


def test_a_block_only_call_is_timed():
    shared = EdgeEstimates()
    _request(shared).estimate.observe(BlockOutcome(4, 2, 0.02, 0.6, 0.5, num_target_tokens=5))
    assert shared.verify_curve.points == {4: (0.5, 1)}
    assert shared.round_trip_s == pytest.approx(0.8 * 0.1 + 0.2 * 0.6)  # a block's round trip, for the drafting-ahead policy
