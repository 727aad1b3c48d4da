"""The verifier's advice (``backends.transformers.advice``): the block length each session should
draft next, from the target's load, measured forward cost and each session's acceptance; and
the service's side of it: every answer carries it, and a longer block is cut to it and still
verified exactly."""

from __future__ import annotations

import math
import random

import pytest

from verifier_service.backends.transformers.advice import (
    AcceptanceRate,
    BusyFraction,
    CostLine,
    ForwardCurve,
    ForwardLoad,
    Saturation,
    TimeAway,
    advised_lengths,
    departure_length,
    departure_pays,
    forwards_missed,
    newcomer_length,
    plan_load,
    row_price,
)
from verifier_service.tuning import TUNING
from verifier_support import (
    MAX_DRAFT,
    committed_after,
    greedy_continuation,
    new_session_id,
    random_tokens,
    running_client,
    verifier_app,
    verify,
    verify_body,
)

# --- the arithmetic ------------------------------------------------------------------------------


def expected_tokens(alpha: float, num_drafted: int) -> float:
    """E(d) of advice.py's glossary, summed term by term: tokens a block of d commits on average."""
    return sum(alpha**k for k in range(num_drafted + 1))


def test_expected_tokens_of_a_block():
    assert expected_tokens(0.5, 0) == 1.0
    assert expected_tokens(0.5, 3) == 1.0 + 0.5 + 0.25 + 0.125
    assert expected_tokens(1.0, 4) == 5.0


def test_below_the_knee_rows_are_nearly_free_and_blocks_stay_long():
    assert advised_lengths({"a": 0.8, "b": 0.8}, CostLine(0.25, 0.0), 0, 64) == {"a": 64, "b": 64}
    assert min(advised_lengths({"a": 0.8, "b": 0.8}, CostLine(0.25, 1e-6), 0, 64).values()) >= 40


def test_past_the_knee_blocks_shorten_toward_one_row_per_token():
    alphas = {session: 0.75 for session in range(8)}
    assert set(advised_lengths(alphas, CostLine(0.26, 0.03), 0, 64).values()) == {1}
    assert set(advised_lengths(alphas, CostLine(0.26, 0.011), 0, 64).values()) == {3}


def test_a_session_that_has_not_drafted_yet_is_advised_as_one_more_drafter_at_its_prior():
    alphas = {session: 0.75 for session in range(8)}
    past_the_knee, below_it = CostLine(0.26, 0.03), CostLine(0.25, 0.0)
    assert newcomer_length(alphas, 0.6, past_the_knee, 0, 64) == advised_lengths(alphas | {"new": 0.6}, past_the_knee, 0, 64)["new"] <= 1
    assert newcomer_length(alphas, 0.6, below_it, 0, 64) == 64
    assert newcomer_length({}, 0.6, past_the_knee, 0, 64) == advised_lengths({"new": 0.6}, past_the_knee, 0, 64)["new"]


def test_rows_go_to_the_sessions_whose_drafts_the_target_keeps():
    # The docstring's worked example: t(R) = 0.25 + 0.02 R.
    assert advised_lengths({"a": 0.8, "b": 0.5}, CostLine(0.25, 0.02), 0, 64) == {"a": 6, "b": 1}


def test_the_advice_maximises_the_committed_tokens_per_second():
    # Brute force over every pair of lengths: none beats the advice.
    alphas, cost = {"a": 0.85, "b": 0.6}, CostLine(0.3, 0.015)

    def rate(lengths: dict[str, int]) -> float:
        rows = sum(length + 1 for length in lengths.values())
        return sum(expected_tokens(alphas[s], d) for s, d in lengths.items()) / cost.seconds(rows)

    advice = advised_lengths(alphas, cost, 0, 32)
    best = max(rate({"a": a, "b": b}) for a in range(33) for b in range(33))
    assert rate(advice) == pytest.approx(best, rel=1e-9)


def test_a_forward_already_long_with_a_prompt_chunk_makes_a_drafted_row_relatively_cheaper():
    alone = advised_lengths({"a": 0.7}, CostLine(0.2, 0.01), 0, 64)["a"]
    beside_a_prompt = advised_lengths({"a": 0.7}, CostLine(0.2, 0.01), 100, 64)["a"]
    assert beside_a_prompt > alone


def test_the_advice_is_within_zero_and_the_verifiers_limit():
    assert advised_lengths({"a": 0.01}, CostLine(0.0001, 1.0), 0, 8) == {"a": 0}
    assert advised_lengths({"a": 0.99}, CostLine(10.0, 0.0), 0, 8) == {"a": 8}
    assert advised_lengths({}, CostLine(0.2, 0.01), 50, 8) == {}


def test_the_forward_cost_is_the_curve_measured_per_row_count():
    cost = ForwardCurve()
    assert not cost.is_known
    cost.observe(9, 0.43)
    cost.observe(9, 0.43)
    assert not cost.is_known  # one row count: no slope yet
    # The docstring's example: 0.24, 0.26 and 0.38 s at 2, 6 and 12 rows.
    cost = ForwardCurve()
    for rows, seconds in ((2, 0.24), (6, 0.26), (12, 0.38)):
        cost.observe(rows, seconds)
    assert cost.is_known
    assert cost.seconds(4) == pytest.approx(0.25)
    assert cost.seconds(1) == pytest.approx(0.235)
    assert cost.seconds(16) == pytest.approx(0.46)
    assert cost.seconds(12) == pytest.approx(0.38)


def test_the_curve_follows_a_cpus_knee_where_a_line_cannot():
    # The AVX-512 box's forwards (spade_bench.micro.rows_bench, 2026-12-04): ~6 ms a row up to 8
    # rows, ~27 ms past them. Merging two forwards of 4 rows saves nearly a whole forward;
    # merging two of 12 saves little; a drafted row below the knee is nearly free.
    measured = {1: 0.231, 2: 0.247, 3: 0.253, 4: 0.238, 6: 0.266, 8: 0.274, 12: 0.391, 16: 0.484}
    cost = ForwardCurve(points=dict(measured))
    assert cost.seconds(4) >= cost.seconds(3)  # the noisy 4-row point pooled with its neighbour
    assert cost.seconds(4) + cost.seconds(4) - cost.seconds(8) > 0.2
    assert cost.seconds(12) + cost.seconds(12) - cost.seconds(24) < 0.2
    assert cost.seconds(7) - cost.seconds(6) < 0.01
    assert cost.seconds(24) - cost.seconds(16) > 8 * 0.02
    # The moving mean per row count follows a change of the machine's speed.
    for _ in range(20):
        cost.observe(16, 0.6)
    assert cost.seconds(16) == pytest.approx(0.6, rel=0.02)


def test_row_counts_not_seen_for_long_leave_the_curve():
    cost = ForwardCurve()
    cost.observe(40, 5.0)  # a forward long ago, on a slower moment of the machine
    for index in range(600):
        cost.observe(4 + index % 2, 0.24 + 0.01 * (index % 2))
    assert 40 not in cost.points and sorted(cost.points) == [4, 5]
    lonely = ForwardCurve()
    lonely.observe(2, 0.2)
    for _ in range(600):
        lonely.observe(4, 0.25)
    assert sorted(lonely.points) == [2, 4]  # two row counts stay, however old: the curve needs them


def test_where_every_row_costs_its_full_arithmetic_no_block_pays():
    # t(R) = 0.03 R: a call without a block buys its one token with one row; a block of 1 buys
    # 1 + alpha tokens with two (0.85 a row at alpha 0.7), so target-only's steps are cheaper.
    alphas = {session: 0.7 for session in range(8)}
    assert set(advised_lengths(alphas, CostLine(0.0, 0.03), 0, 64).values()) == {0}
    # A forward's fixed part still makes drafted rows pay while it dominates.
    assert min(advised_lengths(alphas, CostLine(0.5, 0.03), 0, 64).values()) >= 1


def test_the_advice_keeps_blocks_long_below_the_knee_and_short_past_it():
    measured = ForwardCurve(points={1: 0.231, 2: 0.247, 3: 0.253, 4: 0.238, 6: 0.266, 8: 0.274, 12: 0.391, 16: 0.484})
    two = advised_lengths({"a": 0.7, "b": 0.7}, measured, 0, 64)
    eight = advised_lengths({session: 0.7 for session in range(8)}, measured, 0, 64)
    assert min(two.values()) >= 3  # 2 sessions x 4 rows: below the knee
    assert max(eight.values()) <= 1  # 8 sessions: already past it


# --- a continued session going back to drafting ----------------------------------------------------


def test_a_session_away_misses_at_least_the_forward_that_starts_when_it_is_answered():
    assert forwards_missed(0.0, 0.3) == 1
    assert forwards_missed(0.03, 0.3) == 1  # a CPU: a round trip is a tenth of a forward
    assert forwards_missed(0.07, 0.015) == 5  # a GPU: a forward is shorter than the round trip
    assert forwards_missed(0.07, 0.0) == 1


def test_the_load_is_the_moving_mean_of_the_forwards_rows_and_tokens():
    load = ForwardLoad(decay=0.5)
    assert load.rows is None
    load.observe(4, 6)
    assert (load.rows, load.tokens) == (4.0, 6.0)
    load.observe(8, 2)
    assert (load.rows, load.tokens) == (6.0, 4.0)


def test_a_rows_price_is_what_the_forwards_sessions_commit_in_the_time_it_adds():
    # t(R) = 0.25 + 0.02 R: a ninth row adds 0.02 s to a 0.41 s forward that commits 8 tokens.
    assert row_price(CostLine(0.25, 0.02), 8, 8.0) == pytest.approx(8 * 0.02 / 0.41)
    assert row_price(CostLine(0.25, 0.0), 8, 8.0) == 0.0  # below a knee: rows are free
    assert row_price(CostLine(0.0, 0.0), 8, 8.0) == 0.0


def test_a_plans_load_is_its_rows_and_expected_tokens():
    rows, tokens = plan_load({"a": 0.5, "b": 0.8}, {"a": 2, "b": 0}, 3, 1.0)
    assert rows == 3 + 3 + 1
    assert tokens == pytest.approx(1.0 + expected_tokens(0.5, 2) + 1.0)


def test_where_forwards_are_full_going_back_to_drafting_must_pay_for_the_forwards_missed():
    # The docstring's example: past this CPU's knee, alpha 0.93, one forward missed.
    assert not departure_pays(0.93, 1, 1, 0.7)
    assert departure_pays(0.93, 3, 1, 0.7)
    assert not departure_pays(0.93, 0, 1, 0.0)  # no block: nothing to go back for
    # Rows free: E(d) tokens against the missed + 1 continued ones.
    assert departure_pays(0.7, 3, 1, 0.0)  # 2.53 > 2
    assert not departure_pays(0.7, 3, 2, 0.0)  # 2.53 < 3
    assert not departure_pays(0.7, 64, 3, 0.0)  # never more than 1 / (1 - 0.7) = 3.3 < 4


def test_the_time_away_is_a_line_in_the_block_drafted():
    away = TimeAway()
    assert away.seconds(4) == 0.0  # nothing seen
    for _ in range(3):
        away.observe(0, 0.04)
    assert away.per_token_s == 0.0 and away.base_s == pytest.approx(0.04)  # one length: no slope yet
    for num_drafted, gap_s in ((2, 0.104), (0, 0.04), (1, 0.072), (3, 0.136)):
        away.observe(num_drafted, gap_s)
    assert away.per_token_s == pytest.approx(0.032) and away.base_s == pytest.approx(0.04)
    assert away.seconds(5) == pytest.approx(0.2)
    ahead = TimeAway()
    for num_drafted, gap_s in ((0, 0.05), (4, 0.03), (1, 0.045), (5, 0.025)):  # drafted ahead: longer blocks came sooner
        ahead.observe(num_drafted, gap_s)
    assert ahead.per_token_s == 0.0 and ahead.base_s > 0.0


RUN_J_CPU = ForwardCurve(points={1: 0.231, 2: 0.247, 3: 0.253, 6: 0.266, 8: 0.274, 12: 0.391, 16: 0.484})
"""The 1.5B target's forward on the AVX-512 CPU (docs/runs/run-j.md), 27 ms a row past 8 rows."""


def edges_away(base_s: float, per_token_s: float) -> TimeAway:
    away = TimeAway()
    for num_drafted in (0, 1, 2, 3):
        away.observe(num_drafted, base_s + per_token_s * num_drafted)
    return away


def test_a_continued_session_goes_back_for_the_block_that_pays_for_the_forwards_it_misses():
    cpu_edges = edges_away(0.035, 0.034)
    # The docstring's examples: below the knee a long block pays for the forward missed ...
    assert departure_length(0.75, cpu_edges, RUN_J_CPU, ForwardLoad(rows=3, tokens=3), 64) == 5
    # ... at it, not even for a session whose drafts the target nearly always keeps.
    assert departure_length(0.75, cpu_edges, RUN_J_CPU, ForwardLoad(rows=7, tokens=7), 64) == 0
    assert departure_length(0.93, cpu_edges, RUN_J_CPU, ForwardLoad(rows=7, tokens=7), 64) == 0
    # Rows free (a GPU's 15 ms forward): a block commits at most 1 / (1 - alpha) = 3.3 tokens
    # at alpha 0.7, against the missed + 1 continued ones; edges away 20 ms + 1 ms a token miss
    # two forwards, edges away 5 ms one.
    flat = CostLine(0.015, 0.0)
    assert departure_length(0.7, edges_away(0.005, 0.0005), flat, ForwardLoad(rows=8, tokens=8), 64) >= 3
    assert departure_length(0.7, edges_away(0.02, 0.001), flat, ForwardLoad(rows=8, tokens=8), 64) == 0
    assert departure_length(0.7, cpu_edges, flat, ForwardLoad(), 64) == 0  # no forward seen yet
    assert departure_length(0.7, cpu_edges, CostLine(0.0, 0.0), ForwardLoad(rows=8, tokens=8), 64) == 0  # no cost known
    assert departure_length(0.9, cpu_edges, RUN_J_CPU, ForwardLoad(rows=3, tokens=3), 2) <= 2  # the verifier's limit


def test_the_departure_is_the_fastest_plan_on_explicit_timelines():
    # Random lines and knees and times away: over the m + 1 forwards a departure spans, staying
    # adds a row and a token to each; leaving, the session is absent from m of them and feeds
    # its block to the last. The rule's length commits the most per second of all lengths, and
    # beats staying by the margin (0: none does).
    rng = random.Random(7)
    for _ in range(2000):
        if rng.random() < 0.5:
            cost = CostLine(rng.uniform(0.01, 0.5), rng.uniform(0.0, 0.03))
        else:
            fixed_s, knee = rng.uniform(0.01, 0.5), rng.randint(2, 16)
            cost = ForwardCurve(points={1: fixed_s, knee: fixed_s * 1.1, 4 * knee: fixed_s * 1.1 + rng.uniform(0.005, 0.05) * 3 * knee})
        rows = rng.randint(1, 16)
        load = ForwardLoad(rows=rows, tokens=rows * rng.uniform(1.0, 2.0))
        away = edges_away(rng.uniform(0.0, 0.1), rng.uniform(0.0, 0.05))
        alpha = rng.uniform(0.3, 0.98)
        staying = load.tokens / cost.seconds(rows)

        def leaving(length: int, cost=cost, rows=rows, load=load, alpha=alpha, away=away) -> float:
            missed = max(1, math.ceil((away.base_s + away.per_token_s * length) / cost.seconds(rows)))
            others_s = missed * cost.seconds(rows - 1) if rows > 1 else 0.0
            committed = (missed + 1) * (load.tokens - 1) + expected_tokens(alpha, length)
            return committed / (others_s + cost.seconds(rows + length))

        best = max(range(1, 33), key=leaving)
        chosen = departure_length(alpha, away, cost, load, 32)
        if chosen == 0:
            assert leaving(best) <= (1 + TUNING.departure_margin) * staying * (1 + 1e-9)
        else:
            assert leaving(chosen) > (1 + TUNING.departure_margin) * staying and leaving(chosen) >= leaving(best) * (1 - 1e-9)


def test_acceptance_counts_the_rejected_draft_and_forgets_slowly():
    rate = AcceptanceRate()
    for _ in range(40):
        rate.observe(num_drafted=4, num_accepted=4)  # all kept: no rejection judged
    assert rate.alpha == pytest.approx(0.99)
    for _ in range(40):
        rate.observe(num_drafted=4, num_accepted=1)  # one kept, one rejected
    assert rate.alpha == pytest.approx(0.5, abs=0.03)
    target_only = AcceptanceRate()
    target_only.observe(num_drafted=0, num_accepted=0)
    assert target_only.alpha == pytest.approx(0.6)  # nothing judged: the prior stands


def test_busy_fraction_of_the_recent_past():
    busy = BusyFraction()
    clock = 0.0
    for _ in range(50):  # forwards back to back
        busy.observe(clock, clock + 0.3)
        clock += 0.3
    assert busy.fraction == pytest.approx(1.0)
    for _ in range(50):  # then 0.3 s of work every 0.6 s
        busy.observe(clock + 0.3, clock + 0.6)
        clock += 0.6
    assert busy.fraction == pytest.approx(0.5, abs=0.02)


def test_saturation_has_hysteresis_so_the_advice_does_not_flicker():
    saturation = Saturation()
    assert [saturation.observe(fraction) for fraction in (0.8, 0.86, 0.8, 0.72, 0.69, 0.8, 0.85)] == [
        False,  # not yet
        True,  # reached
        True,  # a gap of answering between forwards: still saturated
        True,
        False,  # idle for real
        False,  # not yet again
        True,
    ]


# --- the service ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def client(tiny_pair):
    with running_client(verifier_app(tiny_pair)) as client:
        yield client


def test_every_answer_carries_the_advice_and_an_idle_verifier_advises_its_limit(client):
    rng = random.Random(1)
    context = random_tokens(rng, 6, 300)
    answer = verify(client, verify_body(new_session_id(), [], random_tokens(rng, 3, 300), new_tokens=context))
    assert answer["advised_draft_length"] == MAX_DRAFT
    assert "spade_verifier_advised_draft_length_count" in client.get("/metrics").text


def test_a_block_longer_than_the_advice_is_cut_to_it_and_verified_exactly(client, target_model, monkeypatch):
    # The backend advises 2: the session's next block of 6 target tokens is verified as its
    # first 2, which the target accepts, plus the bonus: exactly the target's greedy text.
    model = target_model.model
    backend = client.app.state.service.backend
    monkeypatch.setattr(backend, "advised_draft_length", lambda session_id: 2)
    session_id, context = new_session_id(), random_tokens(random.Random(2), 7, 300)
    first = verify(client, verify_body(session_id, [], [], new_tokens=context))
    assert first["advised_draft_length"] == 2
    held = committed_after(context, [], first)
    block = greedy_continuation(model, held, 6)
    cuts_before = _metric(client, "spade_verifier_cut_tokens_total")
    second = verify(client, verify_body(session_id, held, block))
    assert (second["num_accepted"], second["next_token"], second["next_token_kind"]) == (2, block[2], "bonus")
    assert second["context_length"] == len(held) + 3
    assert _metric(client, "spade_verifier_cut_tokens_total") - cuts_before == 4
    third = verify(client, verify_body(session_id, committed_after(held, block, second), []))  # the session goes on in step
    assert third["num_accepted"] == 0


@pytest.mark.parametrize("sampling", [None, {"temperature": 0.8, "top_k": 0, "top_p": 1.0, "seed": 5}], ids=["greedy", "sampled"])
def test_an_advice_of_zero_is_sent_as_zero_and_a_block_is_then_cut_to_nothing_exactly(client, target_model, monkeypatch, sampling):
    # Past the knee the backend advises 0: the answer says 0 (not the verifier's limit), and a
    # block sent anyway is verified as an empty one: the target's own next token, nothing accepted.
    backend = client.app.state.service.backend
    monkeypatch.setattr(backend, "advised_draft_length", lambda session_id: 0)
    session_id, context = new_session_id(), random_tokens(random.Random(3), 7, 300)
    extra = {} if sampling is None else {"sampling": sampling}
    first = verify(client, verify_body(session_id, [], [], new_tokens=context, **extra))
    assert first["advised_draft_length"] == 0
    held = committed_after(context, [], first)
    block = greedy_continuation(target_model.model, held, 4)
    probs = None if sampling is None else [{"token_ids": [token], "probs": [1.0]} for token in block]
    cut = verify(client, verify_body(session_id, held, block, draft_probs=probs, **extra))
    reference = verify(client, verify_body(new_session_id(), [], [], new_tokens=held, **extra))
    assert (cut["num_accepted"], cut["next_token"]) == (0, reference["next_token"])
    assert cut["context_length"] == len(held) + 1


def _metric(client, name: str) -> float:
    for line in client.get("/metrics").text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"{name} not on /metrics")
