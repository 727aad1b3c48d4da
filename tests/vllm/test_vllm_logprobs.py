"""Logprobs from the vLLM backend (blocks with ``num_top_logprobs``), against the same fp32 target
through transformers (``spade_core.sampling.reported_logprobs`` of its logits).

Specification:
- Temperature 0, both routes: each emitted token's logprob is the target's raw log-softmax, and
  its N alternatives are the target's N most likely tokens, most likely first; the same answer
  again when the rows come from vLLM's prefix cache (stale rows refetched).
- Temperature > 0, full_logprobs: the log of the distribution sampled from (temperature, top-k,
  top-p); tokens top-k removes are never listed.
- Temperature > 0, sample_match: refused (ValueError here; the service answers 400 first),
  and ``logprobs_support`` says so: "greedy" for sample_match, "all" for full_logprobs.
- Not asked: no logprobs.
"""

from __future__ import annotations

import random

import pytest
import torch

from spade_core.params import SamplingConfig
from spade_core.sampling import reported_logprobs
from verifier_service.backends.base import BlockToVerify

pytestmark = [pytest.mark.vllm, pytest.mark.asyncio(loop_scope="session")]

GREEDY = SamplingConfig(temperature=0.0)
SAMPLED = dict(temperature=1.3, top_k=3, top_p=0.95)
ROUTES = ["sample_match", "full_logprobs"]
TOLERANCE = 1e-3
"""vLLM's CPU kernels against a plain transformers forward (as in test_vllm_backend)."""
# Lengths around block boundaries (block size 32): a whole-block context makes row 0 stale.
CONTEXT_LENGTHS = [5, 32, 33, 64]


def random_tokens(rng: random.Random, count: int, vocab_size: int) -> list[int]:
    return [rng.randrange(3, vocab_size) for _ in range(count)]


def assert_reports(verdict, rows: torch.Tensor, emitted: list[int], num_top: int) -> None:
    """The verdict's logprobs and alternatives against reported logprob rows [len(emitted), vocab]."""
    assert verdict.logprobs == pytest.approx([float(rows[index, token]) for index, token in enumerate(emitted)], abs=TOLERANCE)
    assert len(verdict.top_logprobs) == len(emitted)
    for index, listed in enumerate(verdict.top_logprobs):
        kept = int(torch.isfinite(rows[index]).sum())
        top = torch.topk(rows[index], min(num_top, kept))
        assert [token_id for token_id, _ in listed] == top.indices.tolist()
        assert [logprob for _, logprob in listed] == pytest.approx(top.values.tolist(), abs=TOLERANCE)


@pytest.mark.parametrize("route", ROUTES)
async def test_greedy_logprobs_are_the_target_log_softmax_with_its_top_tokens(vllm_backend, target_logits, route):
    backend = vllm_backend.with_route(route)
    rng = random.Random(31)
    for case, length in enumerate(CONTEXT_LENGTHS):
        context = random_tokens(rng, length, backend.model.vocab_size)
        block = random_tokens(rng, 4, backend.model.vocab_size)
        request = BlockToVerify(f"lp-greedy-{route}-{case}", context, block, None, GREEDY, num_top_logprobs=3)
        verdict = await backend.verify_block(request)
        emitted = block[: verdict.num_accepted] + [verdict.next_token_id]
        rows = torch.log_softmax(target_logits(context + block)[length - 1 : length - 1 + len(emitted)], dim=-1)
        assert_reports(verdict, rows, emitted, 3)
        assert all(listed[0][0] == token for listed, token in zip(verdict.top_logprobs, emitted, strict=True))  # greedy: the top one
        again = await backend.verify_block(request)  # now some rows come from the prefix cache
        assert (again.next_token_id, again.logprobs, again.top_logprobs) == (verdict.next_token_id, verdict.logprobs, verdict.top_logprobs)


async def test_full_logprobs_reports_the_sampled_distribution(vllm_backend, target_logits):
    backend = vllm_backend.with_route("full_logprobs")
    rng = random.Random(37)
    context = random_tokens(rng, 40, backend.model.vocab_size)
    block = random_tokens(rng, 3, backend.model.vocab_size)
    for seed in range(4):
        sampling = SamplingConfig(**SAMPLED, seed=seed)
        verdict = await backend.verify_block(BlockToVerify("lp-sampled", context, block, None, sampling, num_top_logprobs=5))
        emitted = block[: verdict.num_accepted] + [verdict.next_token_id]
        rows = reported_logprobs(target_logits(context + block)[len(context) - 1 : len(context) - 1 + len(emitted)], sampling)
        assert_reports(verdict, rows, emitted, 5)
        assert all(len(listed) <= 3 for listed in verdict.top_logprobs)  # top_k 3: what it removes is not listed


async def test_sample_match_refuses_logprobs_at_temperature_above_zero(vllm_backend):
    supports = (vllm_backend.model.logprobs_support, vllm_backend.with_route("full_logprobs").model.logprobs_support)
    assert supports == ("greedy", "all")
    context = random_tokens(random.Random(41), 20, vllm_backend.model.vocab_size)
    sampled = BlockToVerify("lp-refused", context, [5], None, SamplingConfig(**SAMPLED, seed=1), num_top_logprobs=0)
    with pytest.raises(ValueError, match="sample_match"):
        await vllm_backend.verify_block(sampled)


@pytest.mark.parametrize("route", ROUTES)
async def test_not_asked_no_logprobs(vllm_backend, route):
    context = random_tokens(random.Random(43), 20, vllm_backend.model.vocab_size)
    for sampling in (GREEDY, SamplingConfig(**SAMPLED, seed=2)):
        verdict = await vllm_backend.with_route(route).verify_block(BlockToVerify("lp-none", context, [5, 6], None, sampling))
        assert (verdict.logprobs, verdict.top_logprobs) == (None, None)
