"""Prefill first: the first verify call of a request carries the prompt alone (an empty block).

Specification:
- The first call's block is empty and answers the target's first token; every later call
  carries a drafted block; the output is the target's (scripted drafter and verifier here; the
  greedy-equality and chi-square suites run the real models with it on and off).
- While that call is in flight the draft prefills the prompt and, with overlap, drafts ahead of
  the first token (a hit starts the next block); with overlap off the draft waits for it.
- It counts as a verify call with 0 drafted tokens, and the adaptive block length learns
  nothing from it (its verifier time is the target's prefill, not a block's).
- With ``--no-prefill-first`` the first call carries a drafted block (every verifier of this
  wire version takes an empty block: whether to send one is the edge's setting alone).
- With ``--fallback draft`` and the verifier unreachable, the failed prompt-only call is
  followed by a drafted block, served unverified.
- Seeds: the empty block's token at position n is drawn with position n's seeded draw, the very
  draw of the verifier's target-only route, so for one seed the first token of a prefill-first
  generation IS the target-only first token (not only equal in distribution); with prefill
  first off the first token goes through the acceptance rule and may differ.
"""

from __future__ import annotations

import dataclasses
import threading
from dataclasses import dataclass, field

import pytest

from edge_agent.draft_length import AdaptiveDraftLength
from edge_agent.estimates import EdgeEstimates
from edge_agent.metrics import EdgeMetrics
from edge_agent.verifier_client import VerifyCall
from edge_support import in_process_engine
from gateway.engine import GenerationRequest
from gateway.errors import ServiceUnavailableError
from gateway.protocol import SpadeStats
from scripted_support import (
    EOS,
    GREEDY,
    PROMPT,
    ScriptedDrafter,
    ScriptedVerifier,
    draft_continuation,
    draft_rule,
    generate,
    scripted_engine,
    target_continuation,
    target_rule,
)
from spade_core.params import SamplingConfig
from verifier_service.protocol import VerifyTimings

GATE_S = 30.0
"""How long a held draft forward waits for the test before giving up (a failure, not a timing)."""
PREFILL_S = 5.0
"""What the scripted verifier reports for the prompt-only call (the target's prefill)."""


class PrefillTimingVerifier(ScriptedVerifier):
    """Reports a long verifier time for the prompt-only call, 1 ms for every block."""

    async def verify(self, context, block, sampling, num_top_logprobs=None, max_continued_tokens=0) -> VerifyCall:
        call = await super().verify(context, block, sampling, num_top_logprobs, max_continued_tokens)
        if block.token_ids:
            return call
        timings = VerifyTimings(queue_ms=0.0, forward_ms=PREFILL_S * 1e3, total_ms=PREFILL_S * 1e3)
        return dataclasses.replace(call, verdict=call.verdict.model_copy(update={"timings": timings}))


@dataclass
class UnreachableVerifier(ScriptedVerifier):
    """Every call fails as an unreachable verifier does; the blocks tried are kept."""

    tried: list[list[int]] = field(default_factory=list)

    async def verify(self, context, block, sampling, num_top_logprobs=None, max_continued_tokens=0) -> VerifyCall:
        self.tried.append(list(block.token_ids))
        raise ServiceUnavailableError("the verifier is gone", code="verifier_unavailable")


def _engine(drafter, verifier, *, overlap=True, prefill_first=True, draft_length=None, fallback=False, metrics=None, **options):
    return scripted_engine(
        drafter,
        verifier,
        draft_length,
        metrics,
        fallback_to_draft=fallback,
        overlap=overlap,
        prefill_first=prefill_first,
        **options,
    )


# --- the first call, scripted ---------------------------------------------------------------------


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "in-turn"])
async def test_the_first_call_carries_the_prompt_alone_and_the_rest_drafted_blocks(overlap):
    verifier = ScriptedVerifier(latency_s=0.05)
    tokens, stats = await generate(_engine(ScriptedDrafter(), verifier, overlap=overlap), 30)
    assert tokens == target_continuation(PROMPT, 30)
    assert verifier.verdicts[0] == (PROMPT, [], 0, target_rule(PROMPT))
    assert all(block for _, block, _, _ in verifier.verdicts[1:])
    # Counted as a verify call with 0 drafted tokens.
    assert (stats.verify_calls, stats.drafted_tokens, stats.accepted_tokens) == (
        len(verifier.verdicts),
        sum(len(block) for _, block, _, _ in verifier.verdicts),
        sum(accepted for _, _, accepted, _ in verifier.verdicts),
    )


async def test_while_the_prompt_only_call_is_out_the_draft_prefills_and_drafts_ahead():
    drafter, verifier = ScriptedDrafter(), ScriptedVerifier(latency_s=0.2)
    tokens, stats = await generate(_engine(drafter, verifier), 30)
    assert tokens == target_continuation(PROMPT, 30)
    # The first draft forward runs over the prompt alone (the draft's prefill), one token at a
    # time: the guess of the target's first token, then the block after it.
    assert drafter.proposals[:5] == [(len(PROMPT) + offset, 1) for offset in range(5)]
    # The guess was right (draft and target agree at this position): the second call's block is
    # what was drafted ahead, with no drafting in line before it.
    assert target_rule(PROMPT) == draft_rule(PROMPT) and stats.overlap_hits >= 1
    first_token = verifier.verdicts[0][3]
    assert verifier.verdicts[1][:2] == (PROMPT + [first_token], draft_continuation(PROMPT + [first_token], 4))
    assert (len(PROMPT) + 1, 4) not in drafter.proposals


@dataclass
class GatedDrafter(ScriptedDrafter):
    """Its first proposal (the draft's prefill of the prompt) is held until the test opens the gate."""

    gate: threading.Event = field(default_factory=threading.Event)
    opened: list[bool] = field(default_factory=list)
    """Per held proposal: True when the gate opened, False when it was still shut after GATE_S."""

    def propose(self, context, num_tokens, sampling):
        if not self.proposals:
            self.opened.append(self.gate.wait(timeout=GATE_S))
        return super().propose(context, num_tokens, sampling)


async def test_the_first_token_does_not_wait_for_the_drafts_prefill():
    """A target prefill shorter than the draft's (a GPU target): the first token goes out when
    the verdict lands; the draft forward in progress joins what was drafted ahead afterwards."""
    drafter = GatedDrafter()
    engine = _engine(drafter, ScriptedVerifier(latency_s=0.01))
    batches = engine.generate(GenerationRequest("r", PROMPT, 20, GREEDY, frozenset({EOS})), SpadeStats())
    first = await anext(batches)  # had the engine waited for the held forward, this would take GATE_S
    drafter.gate.set()
    rest = [token async for batch in batches for token in batch.token_ids]
    await engine.aclose()
    assert first.token_ids + rest == target_continuation(PROMPT, 20)
    assert drafter.opened == [True]
    assert drafter.proposals[0] == (len(PROMPT), 1)


async def test_without_overlap_the_draft_waits_for_the_first_token():
    drafter = ScriptedDrafter()
    tokens, stats = await generate(_engine(drafter, ScriptedVerifier(latency_s=0.01), overlap=False), 20)
    assert tokens == target_continuation(PROMPT, 20)
    assert drafter.proposals[0] == (len(PROMPT) + 1, 4)
    assert (stats.overlap_hits, stats.overlap_misses) == (0, 0)


async def test_a_one_token_budget_is_the_prompt_only_call_alone():
    drafter, verifier = ScriptedDrafter(), ScriptedVerifier(latency_s=0.01)
    tokens, stats = await generate(_engine(drafter, verifier), 1)
    assert (tokens, stats.verify_calls, stats.drafted_tokens, drafter.proposals) == ([target_rule(PROMPT)], 1, 0, [])


async def test_the_call_is_a_block_of_zero_on_metrics():
    verifier, metrics = ScriptedVerifier(latency_s=0.01), EdgeMetrics()
    _, stats = await generate(_engine(ScriptedDrafter(), verifier, metrics=metrics), 20)
    sample = metrics.registry.get_sample_value
    assert sample("spade_edge_verify_calls_total") == stats.verify_calls == len(verifier.verdicts)
    assert sample("spade_edge_draft_length_count") == stats.verify_calls
    assert sample("spade_edge_draft_length_sum") == stats.drafted_tokens
    assert sample("spade_edge_draft_length_bucket", {"le": "1.0"}) >= 1  # the block of 0


async def test_the_adaptive_length_learns_nothing_from_the_prompt_only_call():
    """Its verifier time is the prefill of the prompt: as a point of t_verify(d) it would make
    blocks look seconds long."""
    shared = EdgeEstimates()
    verifier = PrefillTimingVerifier(latency_s=0.01)
    tokens, _ = await generate(
        _engine(ScriptedDrafter(), verifier, draft_length=AdaptiveDraftLength(max_length=8, overlap=True), estimates=shared), 30
    )
    assert tokens == target_continuation(PROMPT, 30)
    assert verifier.verdicts[0][1] == [] and len(verifier.verdicts) > 1
    assert 0 not in shared.verify_curve.points
    assert max(average for average, _ in shared.verify_curve.points.values()) < PREFILL_S / 100


# --- when not to: the setting off ----------------------------------------------------------------


async def test_with_the_setting_off_the_first_call_carries_a_drafted_block():
    verifier = ScriptedVerifier(latency_s=0.01)
    engine = _engine(ScriptedDrafter(), verifier, prefill_first=False)
    assert not engine.prefill_first
    tokens, _ = await generate(engine, 20)
    assert tokens == target_continuation(PROMPT, 20)
    assert verifier.verdicts[0][:2] == (PROMPT, draft_continuation(PROMPT, 4))


# --- fallback to the draft ------------------------------------------------------------------------


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "in-turn"])
async def test_with_the_verifier_unreachable_a_drafted_block_is_served_instead(overlap):
    verifier = UnreachableVerifier()
    tokens, stats = await generate(_engine(ScriptedDrafter(), verifier, overlap=overlap, fallback=True), 12)
    assert tokens == draft_continuation(PROMPT, 12)
    assert (stats.fallback_tokens, stats.verify_calls) == (12, 0)
    assert verifier.tried[0] == [] and all(verifier.tried[1:])


async def test_without_fallback_the_failed_prompt_only_call_ends_the_request():
    with pytest.raises(ServiceUnavailableError):
        await generate(_engine(ScriptedDrafter(), UnreachableVerifier()), 12)


# --- the real models ------------------------------------------------------------------------------


async def _first_tokens(pair, prefill_first: bool, seeds: range) -> tuple[list[int], list[int], list[dict]]:
    """(the edge's first token, the verifier's target-only first token) per seed at temperature 1,
    and the edge's verify calls."""
    async with in_process_engine(pair, draft_length="3", edge_settings={"prefill_first": prefill_first}) as stack:
        engine, target_only = stack.engine, stack.verifier.state.engine
        prompt = engine.tokenizer.encode("The edge drafts")
        edge, reference = [], []
        for seed in seeds:
            request = GenerationRequest(f"seed-{seed}", prompt, 2, SamplingConfig(temperature=1.0, seed=seed), engine.model.eos_token_ids)
            edge.append(await _first_token(engine, request))
            reference.append(await _first_token(target_only, request))
        return edge, reference, stack.transport.verify_bodies


async def _first_token(engine, request: GenerationRequest) -> int:
    batches = engine.generate(request, SpadeStats())
    try:
        return (await anext(batches)).token_ids[0]
    finally:
        await batches.aclose()


async def test_for_one_seed_the_first_token_is_the_target_only_first_token(tiny_pair):
    edge, reference, bodies = await _first_tokens(tiny_pair, prefill_first=True, seeds=range(12))
    assert edge == reference
    assert len(set(reference)) > 1  # the seeds do draw different tokens
    firsts = {}
    for body in bodies:
        firsts.setdefault(body["session_id"], body)
    assert [body["draft_tokens"] for body in firsts.values()] == [[]] * 12


async def test_without_prefill_first_the_first_token_goes_through_the_acceptance_rule(tiny_pair):
    """The negative control: a drafted first block changes which draw picks the first token
    (still the target's distribution), so some seeds give another token."""
    edge, reference, bodies = await _first_tokens(tiny_pair, prefill_first=False, seeds=range(12))
    assert edge != reference
    assert all(body["draft_tokens"] for body in bodies)


async def test_against_a_real_verifier_the_first_call_is_prompt_only(tiny_pair):
    async with in_process_engine(tiny_pair) as stack:
        assert stack.engine.prefill_first
        prompt = stack.engine.tokenizer.encode("The edge drafts")
        request = GenerationRequest("current", prompt, 12, GREEDY, stack.engine.model.eos_token_ids)
        _ = [batch async for batch in stack.engine.generate(request, SpadeStats())]
    assert stack.transport.verify_bodies[0]["draft_tokens"] == []
