"""The edge follows the verifier's advice (``advised_draft_length`` in every verdict): no block,
drafted now or ahead during a verify call, is longer than the last advice, whatever the
draft-length policy chose; the output stays the target's; the request's ``spade`` stats and the
edge's metrics say what the advice did."""

from __future__ import annotations

import pytest

from edge_agent.draft_length import AdaptiveDraftLength, FixedDraftLength
from edge_agent.metrics import EdgeMetrics
from scripted_support import PROMPT, ScriptedDrafter, ScriptedVerifier, generate, scripted_engine, target_continuation


@pytest.mark.parametrize("overlap", [False, True], ids=["in-line", "overlap"])
@pytest.mark.parametrize("policy", ["fixed-6", "auto"])
async def test_no_block_is_longer_than_the_last_advice_and_the_output_stays_the_targets(overlap, policy):
    draft_length = FixedDraftLength(6) if policy == "fixed-6" else AdaptiveDraftLength(max_length=16)
    verifier = ScriptedVerifier(latency_s=0.02, advice=2)
    metrics = EdgeMetrics()
    engine = scripted_engine(ScriptedDrafter(), verifier, draft_length, metrics, overlap=overlap, prefill_first=True)
    tokens, stats = await generate(engine, 40)
    assert tokens == target_continuation(PROMPT, 40)
    blocks = [block for _, block, _, _ in verifier.verdicts]
    assert blocks[0] == []  # the prompt-only first call: no advice yet, nothing drafted
    assert max(len(block) for block in blocks[1:]) == 2
    assert stats.advised_draft_length == 2
    assert 0 < stats.advice_capped_blocks <= len(blocks) - 1  # not those the budget cut anyway
    text = metrics_text(metrics)
    assert f"spade_edge_advice_capped_blocks_total {float(stats.advice_capped_blocks)}" in text
    assert f"spade_edge_verifier_advice_count {float(len(blocks))}" in text


@pytest.mark.parametrize("overlap", [False, True], ids=["in-line", "overlap"])
@pytest.mark.parametrize("policy", ["fixed-6", "auto"])
async def test_an_advice_of_zero_sends_calls_without_blocks_and_drafts_nothing_for_them(overlap, policy):
    # Past the verifier's knee a drafted row costs more than it brings: target-only steps.
    draft_length = FixedDraftLength(6) if policy == "fixed-6" else AdaptiveDraftLength(max_length=16)
    verifier, drafter = ScriptedVerifier(latency_s=0.01, advice=0), ScriptedDrafter()
    tokens, stats = await generate(scripted_engine(drafter, verifier, draft_length, overlap=overlap, prefill_first=True), 20)
    assert tokens == target_continuation(PROMPT, 20)
    assert all(block == [] for _, block, _, _ in verifier.verdicts)
    assert len(verifier.verdicts) == 20  # one token a call
    assert stats.advised_draft_length == 0
    # At most the guess drafted ahead during the prompt-only call (no advice yet); nothing after.
    assert sum(num_tokens for _, num_tokens in drafter.proposals) <= 7


async def test_an_advice_at_the_policys_length_or_above_caps_nothing():
    verifier = ScriptedVerifier(latency_s=0.01, advice=64)
    tokens, stats = await generate(scripted_engine(ScriptedDrafter(), verifier, FixedDraftLength(4), prefill_first=True), 30)
    assert tokens == target_continuation(PROMPT, 30)
    assert max(len(block) for _, block, _, _ in verifier.verdicts) == 4
    assert stats.advice_capped_blocks == 0
    assert stats.advised_draft_length == 64


def metrics_text(metrics: EdgeMetrics) -> str:
    from prometheus_client import generate_latest

    return generate_latest(metrics.registry).decode()
