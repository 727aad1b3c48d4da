"""Units of the edge agent: a generation's block and budget arithmetic, the account of a verified
block (stats, metrics, policy), and the model drafter (greedy proposals, KV cache reuse,
sampled distributions)."""

from __future__ import annotations

import pytest
import torch

from edge_agent.accounting import BlockEntry, block_outcome, count_call, record_block, record_request_ended, record_request_started
from edge_agent.draft_ahead import Drafting
from edge_agent.draft_length import FixedDraftLength
from edge_agent.drafter import DraftLimits, ModelDrafter
from edge_agent.edge_power import DraftAheadPolicy
from edge_agent.estimates import BlockOutcome, EdgeEstimates
from edge_agent.generation import Generation, draft_length, num_delivered
from edge_agent.metrics import EdgeMetrics
from edge_agent.verifier_client import VerifyCall
from gateway.protocol import SpadeStats
from spade_core.params import SamplingConfig
from verifier_service.protocol import VerifyResponse, VerifyTimings

EOS = 9

# A generation's block and budget arithmetic ---------------------------------------------------


@pytest.mark.parametrize(
    ("committed", "num_left", "delivered"),
    [
        ([5, 6, 7], 10, 3),  # all of them
        ([5, 6, 7], 2, 2),  # cut to the budget
        ([5, EOS, 7], 10, 2),  # through the EOS, not past it
        ([EOS, 5], 10, 1),  # EOS first
        ([5, EOS, 7], 2, 2),  # EOS is the last token the budget allows
        ([5, 6, EOS], 2, 2),  # EOS past the budget
    ],
)
def test_num_delivered(committed, num_left, delivered):
    assert num_delivered(committed, num_left, frozenset({EOS})) == delivered


@pytest.mark.parametrize(
    ("chosen", "num_left", "room", "verifier_advice", "length"),
    [
        (5, 100, 990, None, 5),  # the policy's choice
        (5, 4, 990, None, 3),  # a block of 3 yields up to the 4 tokens left
        (5, 1, 990, None, 1),  # never an empty block
        (5, 100, 4, None, 4),  # a context of 60 in 64: 60 + 4 drafted fed = 64
        (5, 100, 990, 2, 2),  # the verifier advised blocks of 2 at most
        (5, 100, 990, 8, 5),  # advice above the choice changes nothing
        (5, 3, 990, 4, 2),  # the tightest cap wins: the budget
        (5, 100, 990, 0, 0),  # advice of 0: a call without a block (a target-only step)
    ],
)
def test_draft_length_is_the_choice_within_every_cap(chosen, num_left, room, verifier_advice, length):
    assert draft_length(chosen, num_left, room, verifier_advice) == length


# One verified block: the request's stats, the service's metrics, the policy's lesson ------------


def test_a_verified_block_is_counted_in_the_stats_the_metrics_and_the_policy():
    verdict = VerifyResponse(
        session_id="s",
        num_accepted=2,
        next_token=7,
        next_token_kind="correction",
        context_length=13,
        num_target_tokens=4,
        advised_draft_length=64,
        timings=VerifyTimings(queue_ms=1.0, forward_ms=30.0, total_ms=40.0),
    )
    call = VerifyCall(verdict, round_trip_s=0.5, bytes_sent=100, bytes_received=200, resynced=True, rejected_answers=2)
    drafting = Drafting(exposed_s=0.25, seconds_per_token=0.125)
    stats = SpadeStats()
    count_call(stats, call, 3, drafting)
    expected = dict(verify_calls=1, drafted_tokens=3, accepted_tokens=2, target_tokens=4, resyncs=1)
    expected |= dict(used_draft_tokens=2, rejected_draft_tokens=1)
    assert stats == SpadeStats(**expected, draft_ms=250.0, verify_ms=500.0, verifier_forward_ms=30.0)
    assert block_outcome(call, 3, drafting) == BlockOutcome(3, 2, 0.125, 0.5, 0.04, num_target_tokens=4)
    metrics = EdgeMetrics()
    metrics.observe_call(call, 3, drafting.exposed_s)
    samples = {
        name: metrics.registry.get_sample_value(f"spade_edge_{name}")
        for name in (
            "verify_calls_total",
            "resyncs_total",
            "rejected_answers_total",
            "drafted_tokens_total",
            "accepted_tokens_total",
            "bytes_sent_total",
        )
    }
    assert samples == {
        "verify_calls_total": 1,
        "resyncs_total": 1,
        "rejected_answers_total": 2,
        "drafted_tokens_total": 3,
        "accepted_tokens_total": 2,
        "bytes_sent_total": 100,
    }
    assert metrics.registry.get_sample_value("spade_edge_draft_length_sum") == 3


def _generation() -> Generation:
    """A generation whose draft never ran (no draft session or verifier session is touched)."""
    estimate = EdgeEstimates().for_request()
    return Generation(None, SpadeStats(), None, None, estimate, FixedDraftLength(4), DraftAheadPolicy().for_request(estimate), [])


def test_a_rounds_ledger_entry_is_recorded_once_in_the_stats_and_the_metrics():
    metrics, generation = EdgeMetrics(), _generation()
    entry = BlockEntry(advice_capped=True, ahead_skipped=True, overlap_hit=False, delivered=[5, 6])
    entry.add_drafted_ahead(3, 0.5)
    entry.add_ahead_outcome(1, 2)
    record_block(metrics, generation, entry)
    record_block(metrics, generation, entry)  # a second time changes nothing
    record_request_ended(metrics, generation, entry)  # the round reached its commit: not counted again
    stats = generation.stats
    assert (stats.advice_capped_blocks, stats.skipped_ahead_blocks, stats.overlap_misses) == (1, 1, 1)
    assert (stats.draft_ahead_tokens, stats.draft_ahead_ms, stats.used_draft_tokens, stats.discarded_ahead_tokens) == (3, 500.0, 1, 2)
    value = metrics.registry.get_sample_value
    assert value("spade_edge_generated_tokens_total") == 2
    assert value("spade_edge_draft_ahead_tokens_total") == 3
    assert value("spade_edge_discarded_ahead_tokens_total") == 2


def test_a_round_cut_short_is_recorded_by_the_requests_end():
    # The verifier went away mid-call (no --fallback draft): the round never reached its commit,
    # and what it drafted ahead and the failed call still count.
    metrics, generation = EdgeMetrics(), _generation()
    record_request_started(metrics, 10)
    entry = BlockEntry(verifier_unreachable=True)
    entry.add_drafted_ahead(2, 0.1)
    record_request_ended(metrics, generation, entry)
    value = metrics.registry.get_sample_value
    assert value("spade_edge_verify_failures_total") == 1
    assert value("spade_edge_draft_ahead_tokens_total") == 2
    assert value("spade_edge_active_requests") == 0
    assert generation.stats.verify_calls == 0  # no verdict: no call counted


# The model drafter ------------------------------------------------------------------------------

GREEDY = SamplingConfig(temperature=0.0)


@pytest.fixture(scope="module")
def drafter(draft_model) -> ModelDrafter:
    return ModelDrafter(draft_model, DraftLimits(max_support=8))


@pytest.fixture(scope="module")
def context(draft_model) -> list[int]:
    return draft_model.tokenizer.encode("The edge drafts a block")


def greedy_continuation(model, token_ids: list[int], num_tokens: int) -> list[int]:
    """The draft model's greedy continuation, recomputed from scratch at every step."""
    token_ids = list(token_ids)
    with torch.inference_mode():
        for _ in range(num_tokens):
            token_ids.append(int(model.model(input_ids=torch.tensor([token_ids])).logits[0, -1].argmax()))
    return token_ids[-num_tokens:]


def test_greedy_proposals_are_the_draft_models_greedy_continuation(drafter, draft_model, context):
    block = drafter.start_session().propose(context, 6, GREEDY)
    assert block.token_ids == greedy_continuation(draft_model, context, 6)


def test_greedy_proposals_send_no_distributions(drafter, context):
    assert drafter.start_session().propose(context, 3, GREEDY).probs is None


def _after_a_rejection(context: list[int], block: list[int], num_accepted: int) -> tuple[list[int], int]:
    """The committed context after a verdict that accepts ``num_accepted`` drafts and corrects
    the next one to a different token."""
    correction = (block[num_accepted] + 1) % 300
    return context + block[:num_accepted] + [correction], correction


@pytest.mark.parametrize("sampling", [GREEDY, SamplingConfig(temperature=1.0, seed=11)], ids=["greedy", "sampled"])
def test_a_reused_cache_proposes_what_a_fresh_session_proposes(drafter, context, sampling):
    session = drafter.start_session()
    first = session.propose(context, 4, sampling)
    committed, _ = _after_a_rejection(context, first.token_ids, num_accepted=1)
    reused = session.propose(committed, 4, sampling)
    fresh = drafter.start_session().propose(committed, 4, sampling)
    assert reused.token_ids == fresh.token_ids


def test_a_reused_cache_proposes_the_same_distributions(drafter, context):
    sampling = SamplingConfig(temperature=1.0, seed=11)
    session = drafter.start_session()
    first = session.propose(context, 4, sampling)
    committed, _ = _after_a_rejection(context, first.token_ids, num_accepted=2)
    reused, fresh = session.propose(committed, 3, sampling), drafter.start_session().propose(committed, 3, sampling)
    assert [row.token_ids for row in reused.probs] == [row.token_ids for row in fresh.probs]
    assert all(
        torch.allclose(torch.tensor(a.probs), torch.tensor(b.probs), atol=1e-5) for a, b in zip(reused.probs, fresh.probs, strict=True)
    )


def test_a_session_follows_a_context_it_did_not_draft(drafter, draft_model, context):
    session = drafter.start_session()
    session.propose(context, 4, GREEDY)
    other = draft_model.tokenizer.encode("def add(a, b):")
    assert session.propose(other, 4, GREEDY).token_ids == greedy_continuation(draft_model, other, 4)


@pytest.fixture(scope="module")
def sampled_block(drafter, context):
    return drafter.start_session().propose(context, 6, SamplingConfig(temperature=1.0, seed=5))


def test_sampled_distributions_sum_to_one(sampled_block):
    assert [sum(row.probs) for row in sampled_block.probs] == pytest.approx([1.0] * 6, abs=1e-5)


def test_sampled_distributions_keep_at_most_max_support_tokens(sampled_block):
    assert [len(row.token_ids) <= 8 for row in sampled_block.probs] == [True] * 6


def test_each_sampled_token_lies_inside_its_distribution(sampled_block):
    masses = [
        dict(zip(row.token_ids, row.probs, strict=True)).get(token_id, 0.0)
        for row, token_id in zip(sampled_block.probs, sampled_block.token_ids, strict=True)
    ]
    assert all(mass > 0 for mass in masses)


def test_top_k_bounds_the_sampled_support(drafter, context):
    block = drafter.start_session().propose(context, 4, SamplingConfig(temperature=1.0, top_k=3, seed=5))
    assert max(len(row.token_ids) for row in block.probs) <= 3


def test_the_same_seed_drafts_the_same_block(drafter, context):
    sampling = SamplingConfig(temperature=1.0, seed=21)
    assert drafter.start_session().propose(context, 6, sampling) == drafter.start_session().propose(context, 6, sampling)


@pytest.mark.parametrize("sampling", [GREEDY, SamplingConfig(temperature=2.0, seed=3)], ids=["greedy", "sampled"])
def test_no_drafted_token_reaches_the_verifiers_vocabulary_limit(draft_model, context, sampling):
    limited = ModelDrafter(draft_model, DraftLimits(max_support=384, vocab_limit=100))
    block = limited.start_session().propose(context, 16, sampling)
    support = [token_id for row in block.probs or [] for token_id in row.token_ids]
    assert max(block.token_ids + support) < 100
