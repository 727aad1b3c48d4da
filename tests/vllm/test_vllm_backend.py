"""The vLLM backend answers the verify contract exactly as sampling from the target alone.

Specification, checked against two references on the same tiny fp32 model: vLLM's own greedy
generation, and one plain transformers forward.
- Temperature 0: num_accepted = the drafted tokens that equal the target's greedy continuation,
  next token = the continuation's next token, logprobs = raw target logprobs of what was emitted;
  the same answer again when the drafted tokens already sit in vLLM's prefix cache (stale rows).
- An empty block is one step of target-only decoding; a block after one (the edge's prompt-only
  first call) answers as on a fresh session.
- Temperature > 0, both exact routes: the first emitted token follows the target's processed
  distribution (total variation within a fixed tolerance over many seeds); one seed, one answer.
- 8 sessions at once: an edge loop drafting with the tiny draft model produces exactly vLLM's
  greedy output.
- Bad blocks raise ValueError; without vLLM the error says how to install it.
"""

from __future__ import annotations

import asyncio
import random
import sys

import pytest
import torch

from spade_core.params import SamplingConfig
from spade_core.sampling import position_uniforms, processed_probs, sample_from
from spade_models.loader import tokenizer_fingerprint
from verifier_service.backends.base import BlockToVerify

pytestmark = [pytest.mark.vllm, pytest.mark.asyncio(loop_scope="session")]

GREEDY = SamplingConfig(temperature=0.0)
SAMPLED = dict(temperature=1.3, top_k=8, top_p=0.95)
ROUTES = ["sample_match", "full_logprobs"]
# Lengths around block boundaries (block size 32): a whole-block context makes row 0 stale.
CONTEXT_LENGTHS = [1, 5, 31, 32, 33, 64, 95, 200]


async def vllm_greedy(backend, context: list[int], count: int) -> list[int]:
    """vLLM's own greedy continuation of ``context`` (the reference for temperature 0)."""
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=count, ignore_eos=True, detokenize=False)
    output = await backend.generate_tokens(context, params)
    return list(output.outputs[0].token_ids)


def random_tokens(rng: random.Random, count: int, vocab_size: int) -> list[int]:
    return [rng.randrange(3, vocab_size) for _ in range(count)]


def block_with_mismatch(rng: random.Random, continuation: list[int], num_accepted: int, vocab_size: int) -> list[int]:
    """The first num_accepted greedy tokens, then (if any room is left) a wrong one and noise."""
    num_drafted = len(continuation) - 1
    block = continuation[:num_accepted]
    if num_accepted < num_drafted:
        wrong = rng.choice([token for token in range(3, vocab_size) if token != continuation[num_accepted]])
        block += [wrong] + random_tokens(rng, num_drafted - num_accepted - 1, vocab_size)
    return block


def emitted_raw_logprobs(logits: torch.Tensor, first_row: int, emitted: list[int]) -> list[float]:
    rows = torch.log_softmax(logits[first_row : first_row + len(emitted)], dim=-1)
    return [float(rows[index, token]) for index, token in enumerate(emitted)]


async def test_the_model_description_describes_the_target(vllm_backend, vllm_pair, hf_target):
    model = vllm_backend.model
    assert vllm_backend.name == "vllm"
    assert model.model_id == "target"
    assert model.vocab_size == hf_target.model.get_output_embeddings().weight.shape[0]
    # One token short of max_model_len: vLLM keeps room for the token a scoring call returns.
    assert model.max_context_length == vllm_backend.engine.model_config.max_model_len - 1 == 1023
    assert model.eos_token_ids == frozenset({hf_target.tokenizer.convert_tokens_to_ids("<|im_end|>")})
    assert model.tokenizer_fingerprint == tokenizer_fingerprint(hf_target.tokenizer)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
async def test_a_block_ending_exactly_at_the_context_limit_is_scored(vllm_backend, temperature):
    """The rule of gateway.model: context + block may fill the context; the next token is
    returned, not fed (regression: vLLM refused such a prompt, a 500 at the edge's last block)."""
    vocab_size = vllm_backend.model.vocab_size
    context = random_tokens(random.Random(8), vllm_backend.model.max_context_length - 2, vocab_size)
    sampling = SamplingConfig(temperature=temperature, seed=4)
    verdict = await vllm_backend.verify_block(BlockToVerify("at-the-limit", context, [5, 6], None, sampling))
    vllm_backend.release_session("at-the-limit")
    assert 0 <= verdict.num_accepted <= 2 and 0 <= verdict.next_token_id < vocab_size


@pytest.mark.parametrize("num_drafted", [1, 4, 8])
async def test_greedy_matches_vllm_generate_and_transformers(vllm_backend, target_logits, num_drafted):
    vocab_size = vllm_backend.model.vocab_size
    rng = random.Random(num_drafted)
    for case, length in enumerate(CONTEXT_LENGTHS):
        context = random_tokens(rng, length, vocab_size)
        continuation = await vllm_greedy(vllm_backend, context, num_drafted + 1)
        logits = target_logits(context + continuation[:num_drafted])
        assert logits[length - 1 :].argmax(dim=-1).tolist() == continuation, "vLLM and transformers disagree"
        num_accepted = num_drafted if case % 3 == 0 else rng.randint(0, num_drafted)
        block = block_with_mismatch(rng, continuation, num_accepted, vocab_size)
        request = BlockToVerify(f"greedy-{num_drafted}-{case}", context, block, None, GREEDY, num_top_logprobs=0)
        verdict = await vllm_backend.verify_block(request)
        assert (verdict.num_accepted, verdict.next_token_id) == (num_accepted, continuation[num_accepted])
        assert verdict.is_bonus == (num_accepted == num_drafted)
        emitted = block[:num_accepted] + [verdict.next_token_id]
        reference = emitted_raw_logprobs(target_logits(context + block), length - 1, emitted)
        assert verdict.logprobs == pytest.approx(reference, abs=1e-3)
        # Again: now the drafted tokens' blocks may be cached, so some prompt rows are stale.
        again = await vllm_backend.verify_block(request)
        assert (again.num_accepted, again.next_token_id, again.logprobs) == (verdict.num_accepted, verdict.next_token_id, verdict.logprobs)


@pytest.mark.parametrize("route", ROUTES)
async def test_empty_block_is_one_target_step(vllm_backend, route):
    context = random_tokens(random.Random(5), 40, vllm_backend.model.vocab_size)
    (expected,) = await vllm_greedy(vllm_backend, context, 1)
    verdict = await vllm_backend.with_route(route).verify_block(BlockToVerify("empty", context, [], None, GREEDY, num_top_logprobs=0))
    assert (verdict.num_accepted, verdict.next_token_id, verdict.is_bonus) == (0, expected, True)
    assert len(verdict.logprobs) == 1
    sampled = BlockToVerify("empty", context, [], None, SamplingConfig(**SAMPLED, seed=4))
    verdict = await vllm_backend.with_route(route).verify_block(sampled)
    assert (verdict.num_accepted, verdict.is_bonus, verdict.logprobs) == (0, True, None)  # not asked


@pytest.mark.parametrize("route", ROUTES)
async def test_a_block_after_an_empty_one_answers_as_on_a_fresh_session(vllm_backend, route):
    """The edge's prompt-only first call leaves its session known and the prompt in the prefix
    cache; the next block's verdict must not depend on that (sample_match then skips its
    cold-context request). One seed, one answer, either way."""
    backend = vllm_backend.with_route(route)
    context = random_tokens(random.Random(17), 45, backend.model.vocab_size)
    outcomes = []
    for seed in range(6):
        sampling = SamplingConfig(**SAMPLED, seed=seed)
        first = await backend.verify_block(BlockToVerify(f"opened-{route}-{seed}", context, [], None, sampling))
        assert (first.num_accepted, first.is_bonus) == (0, True)
        committed = context + [first.next_token_id]
        block = await vllm_greedy(backend, committed, 3)
        after = await backend.verify_block(BlockToVerify(f"opened-{route}-{seed}", committed, block, None, sampling))
        fresh = await backend.verify_block(BlockToVerify(f"fresh-{route}-{seed}", committed, block, None, sampling))
        assert (after.num_accepted, after.next_token_id) == (fresh.num_accepted, fresh.next_token_id)
        outcomes.append((first.next_token_id, after.num_accepted, after.next_token_id))
    assert len(set(outcomes)) > 1, "different seeds should give different outcomes"


@pytest.mark.parametrize("route", ROUTES)
async def test_emitted_token_follows_target_distribution(vllm_backend, hf_draft, target_logits, route):
    """Drafts sampled from the draft model's own distribution q (so both acceptances and
    corrections happen); the first emitted token must be distributed as the target's p."""
    num_seeds, tolerance = 800, 0.07
    context = random_tokens(random.Random(7), 24, vllm_backend.model.vocab_size)
    target_p = processed_probs(target_logits(context)[-1], SamplingConfig(**SAMPLED))
    with torch.inference_mode():
        draft_logits = hf_draft.model(input_ids=torch.tensor([context])).logits[0, -1].float()
    draft_q = processed_probs(draft_logits, SamplingConfig(**SAMPLED))
    backend = vllm_backend.with_route(route)

    async def first_emitted(seed: int) -> tuple[int, int]:
        uniform = float(position_uniforms(seed, len(context), 1, stream="draft")[0, 1])
        drafted = sample_from(draft_q, uniform)
        block = BlockToVerify("dist", context, [drafted], draft_q[None], SamplingConfig(**SAMPLED, seed=seed))
        verdict = await backend.verify_block(block)
        return (drafted if verdict.num_accepted else verdict.next_token_id), verdict.num_accepted

    results = []
    for start in range(0, num_seeds, 50):
        results += await asyncio.gather(*[first_emitted(seed) for seed in range(start, start + 50)])
    counts = torch.bincount(torch.tensor([token for token, _ in results]), minlength=target_p.shape[0])
    assert int(counts[target_p == 0].sum()) == 0, "emitted a token the target gives no mass"
    total_variation = 0.5 * float((counts / num_seeds - target_p).abs().sum())
    assert total_variation < tolerance
    acceptance = sum(accepted for _, accepted in results) / num_seeds
    assert 0.0 < acceptance < 1.0, "expected both acceptances and corrections"


@pytest.mark.parametrize("route", ROUTES)
async def test_one_seed_one_answer(vllm_backend, route):
    backend = vllm_backend.with_route(route)
    rng = random.Random(9)
    context = random_tokens(rng, 50, backend.model.vocab_size)
    block = (await vllm_greedy(backend, context, 4))[:3] + [7]

    async def verdict_for(seed: int):
        verdict = await backend.verify_block(BlockToVerify("seeded", context, block, None, SamplingConfig(**SAMPLED, seed=seed)))
        return verdict.num_accepted, verdict.next_token_id, verdict.logprobs

    first = [await verdict_for(seed) for seed in range(12)]
    assert [await verdict_for(seed) for seed in range(12)] == first
    assert len({outcome[:2] for outcome in first}) > 1, "different seeds should give different outcomes"


async def test_num_target_tokens_counts_only_uncached_tokens(vllm_backend):
    vocab_size = vllm_backend.model.vocab_size
    rng = random.Random(13)
    context, block = random_tokens(rng, 101, vocab_size), random_tokens(rng, 4, vocab_size)
    first = await vllm_backend.verify_block(BlockToVerify("count", context, block, None, GREEDY))
    assert first.num_target_tokens == len(context) + len(block)
    context = context + block[: first.num_accepted] + [first.next_token_id]
    second = await vllm_backend.verify_block(BlockToVerify("count", context, [3, 4], None, GREEDY))
    assert 0 < second.num_target_tokens <= 32 + 2 + 1


async def edge_greedy_loop(backend, draft_model, session_id: str, prompt: list[int], num_new: int, num_drafted: int) -> list[int]:
    """What the edge does at temperature 0: draft greedily, verify, commit, repeat."""
    context = list(prompt)
    while len(context) < len(prompt) + num_new:
        with torch.inference_mode():
            drafted = draft_model.model.generate(
                torch.tensor([context]),
                max_new_tokens=num_drafted,
                do_sample=False,
                attention_mask=torch.ones(1, len(context), dtype=torch.long),
                eos_token_id=None,
                pad_token_id=0,
            )[0, len(context) :].tolist()
        verdict = await backend.verify_block(BlockToVerify(session_id, context, drafted, None, GREEDY))
        context += drafted[: verdict.num_accepted] + [verdict.next_token_id]
    return context[len(prompt) : len(prompt) + num_new]


async def test_eight_concurrent_sessions_reproduce_vllm_greedy(vllm_backend, hf_draft):
    rng = random.Random(21)
    prompts = [random_tokens(rng, rng.randint(8, 80), vllm_backend.model.vocab_size) for _ in range(8)]
    outputs = await asyncio.gather(
        *[edge_greedy_loop(vllm_backend, hf_draft, f"edge-{index}", prompt, 24, 4) for index, prompt in enumerate(prompts)]
    )
    expected = await asyncio.gather(*[vllm_greedy(vllm_backend, prompt, 24) for prompt in prompts])
    assert outputs == expected


async def test_bad_blocks_raise_value_error(vllm_backend):
    with pytest.raises(ValueError, match="maximum context length"):
        await vllm_backend.verify_block(BlockToVerify("bad", [4] * vllm_backend.model.max_context_length, [5], None, GREEDY))
    with pytest.raises(ValueError, match="at least one token"):
        await vllm_backend.verify_block(BlockToVerify("bad", [], [5], None, GREEDY))
    with pytest.raises(ValueError, match="draft_probs"):
        await vllm_backend.verify_block(BlockToVerify("bad", [4], [5], torch.ones(2, 3), GREEDY))
    with pytest.raises(ValueError, match="exact_route"):
        vllm_backend.with_route("rejection")


async def test_missing_vllm_says_how_to_install(monkeypatch):
    from verifier_service.backends.vllm import backend as vllm_backend_module

    monkeypatch.setitem(sys.modules, "vllm.v1.engine.async_llm", None)
    with pytest.raises(ImportError, match=r"pip install '\.\[vllm\]'"):
        vllm_backend_module._import_vllm()


async def test_prefix_cache_hits_are_reported_and_kept_within_a_salt(vllm_backend):
    # vLLM's prefix cache is shared by every request: only blocks of one namespace (cache_salt)
    # meet; a session's first call reports its hit, in blocks of 32.
    vocab_size = vllm_backend.model.vocab_size
    context = random_tokens(random.Random(21), 70, vocab_size)

    async def first_call(session_id: str, namespace: str | None) -> int:
        verdict = await vllm_backend.verify_block(BlockToVerify(session_id, context, [], None, GREEDY, cache_namespace=namespace))
        return verdict.num_cached_tokens

    assert await first_call("salted-1", "tenant-1") == 0
    assert await first_call("salted-2", "tenant-2") == 0
    assert await first_call("salted-3", "tenant-1") == 64
    assert await first_call("unshared-1", None) == 0  # --prefix-sharing off: a salt per session
