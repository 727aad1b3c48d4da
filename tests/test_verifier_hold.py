"""Holding a forward for sessions due soon (``backends.transformers.hold``): the rule against
explicit timelines of both plans, and its cases on this CPU's and a GPU's cost lines."""

from __future__ import annotations

import random

from verifier_service.backends.transformers.advice import CostLine, ForwardCurve
from verifier_service.backends.transformers.hold import Sessions, hold_is_worth, latest_worth_holding

AVX2_CPU = CostLine(0.37, 0.056)
"""t(R) = 0.37 + 0.056 R s: the 1.5B target's cost line on the AVX2 box (docs/runs/2026-12-04-hold-rule.md)."""
GPU = CostLine(0.007, 0.00003)
"""A small forward on a GPU: nearly all fixed part."""


def summed_answer_times(
    hold: bool, wait_s: float, cost: CostLine | ForwardCurve, queued: Sessions, due: Sessions, saturated: bool
) -> float:
    """The two plans as timelines from now: the seconds until each session's answer, summed;
    saturated, plus what the queued sessions' next round then waits behind the due sessions'
    own forward (they are back before it ends)."""
    forward_s = cost.seconds

    if hold:
        return (queued.count + due.count) * (wait_s + forward_s(queued.rows + due.rows))
    queued_answered = forward_s(queued.rows)
    due_answered = queued_answered + forward_s(due.rows)  # they arrived during the first forward
    pushed = (due_answered - queued_answered) if saturated else 0.0
    return queued.count * (queued_answered + pushed) + due.count * due_answered


def random_knee(rng: random.Random) -> ForwardCurve:
    """A measured curve with a knee: nearly flat up to it, a row's arithmetic past it."""
    fixed_s, knee = rng.uniform(0.001, 0.5), rng.randint(2, 16)
    flat_s, steep_s = rng.uniform(0.0, 0.01), rng.uniform(0.01, 0.1)
    return ForwardCurve(points={1: fixed_s, knee: fixed_s + flat_s * knee, 4 * knee: fixed_s + flat_s * knee + steep_s * 3 * knee})


def test_the_rule_holds_exactly_when_holding_shortens_the_summed_answer_times():
    rng = random.Random(5)
    for _ in range(4000):
        cost = CostLine(rng.uniform(0.001, 0.5), rng.uniform(0.0, 0.1)) if rng.random() < 0.5 else random_knee(rng)
        queued = Sessions(rng.randint(1, 8), 0)
        queued = Sessions(queued.count, queued.count * rng.randint(1, 9))
        due = Sessions(rng.randint(1, 8), 0)
        due = Sessions(due.count, due.count * rng.randint(1, 9))
        saturated = rng.random() < 0.5
        wait_s = rng.uniform(0.0, cost.seconds(queued.rows))  # due before the queued forward ends
        held = summed_answer_times(True, wait_s, cost, queued, due, saturated)
        started = summed_answer_times(False, wait_s, cost, queued, due, saturated)
        if abs(held - started) > 1e-9:
            assert hold_is_worth(wait_s, cost, queued, due, saturated) == (held < started)


def test_saturated_a_forward_waits_for_company_due_within_its_fixed_part():
    one, many = Sessions(1, 3), Sessions(7, 21)
    for queued in (one, many):
        assert hold_is_worth(0.30, AVX2_CPU, queued, one, saturated=True)
        assert not hold_is_worth(0.40, AVX2_CPU, queued, one, saturated=True)


def test_not_saturated_the_queued_sessions_delay_counts():
    # Two edges on this CPU: worth (0.37 - 0.056 * 3) / 2 = 0.101 s of waiting.
    assert hold_is_worth(0.09, AVX2_CPU, Sessions(1, 3), Sessions(1, 3), saturated=False)
    assert not hold_is_worth(0.12, AVX2_CPU, Sessions(1, 3), Sessions(1, 3), saturated=False)
    # Past the knee, four queued sessions never wait for one more session's 5 rows ...
    assert not hold_is_worth(0.001, AVX2_CPU, Sessions(4, 12), Sessions(1, 5), saturated=False)
    # ... while on a GPU, where rows are nearly free, they wait nearly a fifth of the fixed part:
    # (0.007 - 4 * 0.00003 * 5) / 5 = 0.00128 s.
    assert hold_is_worth(0.0012, GPU, Sessions(4, 12), Sessions(1, 5), saturated=False)
    assert not hold_is_worth(0.0014, GPU, Sessions(4, 12), Sessions(1, 5), saturated=False)


def test_the_scale_stretches_or_turns_off_the_hold():
    assert not hold_is_worth(0.0, AVX2_CPU, Sessions(1, 3), Sessions(1, 3), saturated=True, scale=0.0)
    assert not hold_is_worth(0.5, AVX2_CPU, Sessions(1, 3), Sessions(1, 3), saturated=True)
    assert hold_is_worth(0.5, AVX2_CPU, Sessions(1, 3), Sessions(1, 3), saturated=True, scale=1.5)
    assert not hold_is_worth(0.1, AVX2_CPU, Sessions(1, 3), Sessions(0, 0), saturated=True)


def test_the_latest_session_worth_waiting_for_brings_the_sooner_ones_along():
    queued = Sessions(1, 3)
    assert latest_worth_holding([], AVX2_CPU, queued, saturated=True) is None
    assert latest_worth_holding([(0.9, 3, 1.0), (0.2, 3, 1.0), (0.05, 3, 1.0)], AVX2_CPU, queued, saturated=True) == 0.2
    # Not saturated, waiting 0.15 s is not worth it for one session of 2 rows
    # ((0.37 - 0.056 * 2) / 2 = 0.129 s), but is for two of a row each ((0.74 - 0.056 * 2) / 3 = 0.209 s).
    assert latest_worth_holding([(0.15, 2, 1.0)], AVX2_CPU, Sessions(1, 2), saturated=False) is None
    assert latest_worth_holding([(0.14, 1, 1.0), (0.15, 1, 1.0)], AVX2_CPU, Sessions(1, 2), saturated=False) == 0.15


# --- queued sessions that return at once (continued steps) ----------------------------------------

AVX512_CPU = ForwardCurve(points={1: 0.231, 2: 0.247, 6: 0.266, 8: 0.274, 12: 0.391, 16: 0.484})
"""The 1.5B target's measured forward on this machine (docs/runs/run-j.md): knee at 8 rows."""


def committed_per_second(hold: bool, wait_s: float, cost, queued: Sessions, due: Sessions, returning: Sessions) -> float:
    """The two plans as timelines, saturated: hold waits, then one forward for all; now runs the
    queued, during which the due arrive, then a forward of the due and the queued that came back
    at once (the others are away on their round trips). Tokens committed over each plan's span."""
    if hold:
        return (queued.tokens + due.tokens) / (wait_s + cost.seconds(queued.rows + due.rows))
    span_s = cost.seconds(queued.rows) + cost.seconds(returning.rows + due.rows)
    return (queued.tokens + returning.tokens + due.tokens) / span_s


def test_saturated_with_sessions_returning_at_once_the_rule_holds_exactly_when_that_commits_more_per_second():
    rng = random.Random(11)
    for _ in range(4000):
        cost = CostLine(rng.uniform(0.001, 0.5), rng.uniform(0.0, 0.1)) if rng.random() < 0.5 else random_knee(rng)
        count = rng.randint(1, 8)
        queued = Sessions(count, count * rng.randint(1, 9), count * rng.uniform(1.0, 4.0))
        back = rng.randint(0, count)
        returning = Sessions(back, back)
        due_count = rng.randint(1, 8)
        due = Sessions(due_count, due_count * rng.randint(1, 9), due_count * rng.uniform(1.0, 4.0))
        wait_s = rng.uniform(0.0, cost.seconds(queued.rows))
        held = committed_per_second(True, wait_s, cost, queued, due, returning)
        started = committed_per_second(False, wait_s, cost, queued, due, returning)
        if abs(held - started) > 1e-9 * started:
            assert hold_is_worth(wait_s, cost, queued, due, True, returning=returning) == (held > started)


def test_nothing_returning_the_rate_rule_is_the_fixed_part_rule():
    rng = random.Random(12)
    for _ in range(500):
        cost = random_knee(rng)
        queued, due = Sessions(rng.randint(1, 8), rng.randint(1, 40)), Sessions(rng.randint(1, 8), rng.randint(1, 40))
        saving_s = cost.seconds(queued.rows) + cost.seconds(due.rows) - cost.seconds(queued.rows + due.rows)
        for wait_s in (0.0, 0.9 * max(saving_s, 0.0), 1.1 * max(saving_s, 0.0) + 1e-6):
            assert hold_is_worth(wait_s, cost, queued, due, True) == (wait_s < saving_s)


def test_six_continued_sessions_wait_only_briefly_for_an_edge_past_the_knee():
    # docs/runs/run-n.md: forwards at N = 8 waited 60-80 ms for edges under the rule
    # that ignores the continued sessions, which would allow t(6) + t(2) - t(8) = 238 ms.
    queued, returning, edge = Sessions(6, 6, 6.0), Sessions(6, 6), Sessions(1, 2, 1.9)
    assert hold_is_worth(0.2, AVX512_CPU, queued, edge, True)
    assert hold_is_worth(0.025, AVX512_CPU, queued, edge, True, returning=returning)
    assert not hold_is_worth(0.06, AVX512_CPU, queued, edge, True, returning=returning)


# --- when a session's next call is expected (``scheduler.expected_arrival``) -----------------------------


def test_a_session_is_expected_after_its_mean_gap_and_awaited_a_little_past_it():
    from verifier_service.backends.transformers.pace import GapEstimate, expected_arrival

    gap = GapEstimate(mean_s=0.1, deviation_s=0.02)
    early = expected_arrival(10.0, gap, 10.05, late_s=0.04)
    assert early is not None and abs(early.expected_s - 0.05) < 1e-9 and abs(early.latest_s - 0.09) < 1e-9
    late = expected_arrival(10.0, gap, 10.12, late_s=0.04)
    assert late is not None and abs(late.latest_s - 0.02) < 1e-9 and abs(late.expected_s - 0.01) < 1e-9
    assert expected_arrival(10.0, gap, 10.15, late_s=0.04) is None  # past its window: not awaited
    assert expected_arrival(10.0, gap, 10.11, late_s=0.0) is None  # no window: the rule before
    assert expected_arrival(10.0, GapEstimate(), 10.0, late_s=0.04) is None  # no gap known


def test_gaps_learn_their_mean_and_spread():
    from verifier_service.backends.transformers.pace import GapEstimate

    gap = GapEstimate(decay=0.5)
    for gap_s in (0.1, 0.2, 0.1, 0.2, 0.1, 0.2, 0.1, 0.2):
        gap.observe(gap_s)
    assert 0.12 < gap.mean_s < 0.18
    assert 0.03 < gap.deviation_s < 0.07
    steady = GapEstimate(decay=0.5)
    for _ in range(8):
        steady.observe(0.1)
    assert steady.mean_s == 0.1 and steady.deviation_s == 0.0


def test_a_session_without_gaps_of_its_own_is_expected_after_the_typical_gap():
    from verifier_service.backends.transformers.pace import GapEstimate, SessionPace

    typical = GapEstimate(mean_s=0.2, deviation_s=0.05)
    pace = SessionPace(answered_at=5.0)
    arrival = pace.arrival(5.1, typical, late_deviations=2.0, max_late_s=1.0)
    assert arrival is not None and abs(arrival.expected_s - 0.1) < 1e-9 and abs(arrival.latest_s - 0.2) < 1e-9
    # The window past the expected time is bounded by the forward's fixed part.
    arrival = pace.arrival(5.1, typical, late_deviations=2.0, max_late_s=0.03)
    assert arrival is not None and abs(arrival.latest_s - 0.13) < 1e-9
    assert SessionPace().arrival(5.1, typical, 2.0, 1.0) is None  # not answered: its call is not awaited
