"""Batched verification (``verifier_service.backends.batching``) against one-at-a-time
verification on the tiny target (fp32): the same verdicts for mixed block and context lengths,
greedy and seeded sampling, target-only steps included; logits and caches close to a plain
forward; FIFO batches with at most one call per session; batch sizes on /metrics."""

from __future__ import annotations

import asyncio
import random

import pytest
import torch

from spade_core.params import SamplingConfig
from spade_models.kv_cache import TokenCache, cache_argument_name
from verifier_service.backends import batching
from verifier_service.backends.base import BlockToVerify, BlockVerdict
from verifier_service.backends.batching import MAX_PAD_ROWS, PendingCall, batched_forward, padding_fits, take_batch
from verifier_service.backends.transformers_backend import TransformersBackend
from verifier_support import (
    committed_after,
    new_session_id,
    plain_forward_logits,
    random_tokens,
    running_verifier,
    verify,
    verify_body,
)

GREEDY = SamplingConfig(temperature=0.0)
SEEDED = SamplingConfig(temperature=0.8, top_k=0, top_p=1.0, seed=11)


def _filled_cache(model, token_ids: list[int]) -> TokenCache:
    entry = TokenCache.empty(model)
    if token_ids:
        with torch.inference_mode():
            model(input_ids=torch.tensor([token_ids]), use_cache=True, **{cache_argument_name(model): entry.cache})
        entry.token_ids = list(token_ids)
    return entry


def test_batched_forward_matches_a_plain_forward_for_mixed_cached_and_new_lengths(model, vocab_size):
    rng = random.Random(0)
    cached_lengths, new_lengths = [0, 7, 20, 3], [5, 1, 9, 4]
    contexts = [random_tokens(rng, c + n, vocab_size) for c, n in zip(cached_lengths, new_lengths, strict=True)]
    entries = [_filled_cache(model, context[:c]) for context, c in zip(contexts, cached_lengths, strict=True)]
    new_ids = [context[c:] for context, c in zip(contexts, cached_lengths, strict=True)]
    logits = batched_forward(model, entries, new_ids, cache_argument_name(model), torch.device("cpu"))
    for context, c, rows, entry in zip(contexts, cached_lengths, logits, entries, strict=True):
        assert rows.shape == (len(context) - c, vocab_size)
        torch.testing.assert_close(rows, plain_forward_logits(model, context)[c:], atol=1e-4, rtol=1e-4)
        assert entry.cache.get_seq_length() == len(context)


def test_only_the_scored_rows_reach_the_output_layer(model, vocab_size):
    # A long prefill beside short blocks: each session gets its last k rows, equal to a plain
    # forward's, and the output layer sees only the positions some session scores (not the
    # padded batch's whole length for every session).
    rng = random.Random(2)
    cached_lengths, new_lengths, scored = [0, 12, 5], [40, 3, 6], [1, 3, 2]
    contexts = [random_tokens(rng, c + n, vocab_size) for c, n in zip(cached_lengths, new_lengths, strict=True)]
    entries = [_filled_cache(model, context[:c]) for context, c in zip(contexts, cached_lengths, strict=True)]
    new_ids = [context[c:] for context, c in zip(contexts, cached_lengths, strict=True)]
    projected: list[int] = []
    hook = model.get_output_embeddings().register_forward_hook(lambda module, args, output: projected.append(args[0].shape[1]))
    try:
        logits = batched_forward(model, entries, new_ids, cache_argument_name(model), torch.device("cpu"), scored)
    finally:
        hook.remove()
    assert projected == [len({39} | {0, 1, 2} | {4, 5})]  # positions 39; 0-2; 4-5
    for context, k, rows in zip(contexts, scored, logits, strict=True):
        assert rows.shape == (k, vocab_size)
        torch.testing.assert_close(rows, plain_forward_logits(model, context)[-k:], atol=1e-4, rtol=1e-4)


def test_a_cache_split_back_from_a_batch_serves_the_next_one_session_forward(model, vocab_size):
    rng = random.Random(1)
    contexts = [random_tokens(rng, 6, vocab_size), random_tokens(rng, 15, vocab_size)]
    entries = [TokenCache.empty(model), TokenCache.empty(model)]
    batched_forward(model, entries, contexts, cache_argument_name(model), torch.device("cpu"))
    follow_up = random_tokens(rng, 3, vocab_size)
    for context, entry in zip(contexts, entries, strict=True):
        with torch.inference_mode():
            rows = model(input_ids=torch.tensor([follow_up]), use_cache=True, **{cache_argument_name(model): entry.cache}).logits[0]
        torch.testing.assert_close(rows, plain_forward_logits(model, context + follow_up)[-3:], atol=1e-4, rtol=1e-4)


def _draft_probs(rng: random.Random, block: list[int], vocab_size: int) -> torch.Tensor:
    """Each row a random distribution that gives its drafted token some mass."""
    probs = torch.rand(len(block), vocab_size, generator=torch.Generator().manual_seed(rng.randrange(1 << 30)))
    probs[torch.arange(len(block)), torch.tensor(block)] += 5.0
    return probs / probs.sum(dim=-1, keepdim=True)


def _round_of_blocks(rng, contexts: dict[str, list[int]], sampling: SamplingConfig, vocab_size: int) -> list[BlockToVerify]:
    """One block per session: lengths 0 (a target-only step) to 6, greedy or sampled drafts."""
    blocks = []
    for session_id, context in contexts.items():
        block = random_tokens(rng, rng.randrange(0, 7), vocab_size)
        probs = _draft_probs(rng, block, vocab_size) if sampling.temperature > 0 and block else None
        blocks.append(BlockToVerify(session_id, context, block, probs, sampling))
    return blocks


async def _verify_rounds(backend, sampling: SamplingConfig, vocab_size: int, concurrently: bool, num_rounds: int = 3):
    """Sessions with contexts of 1-30 tokens, several rounds through their caches; returns
    every verdict (num_accepted, next token, batch size) in session order."""
    rng = random.Random(7)
    contexts = {f"s{index}": random_tokens(rng, rng.randrange(1, 31), vocab_size) for index in range(6)}
    verdicts = []
    for _ in range(num_rounds):
        blocks = _round_of_blocks(rng, contexts, sampling, vocab_size)
        if concurrently:
            answers = await asyncio.gather(*(backend.verify_block(block) for block in blocks))
        else:
            answers = [await backend.verify_block(block) for block in blocks]
        for block, answer in zip(blocks, answers, strict=True):
            verdicts.append((answer.num_accepted, answer.next_token_id, answer.num_batched))
            emitted = block.draft_token_ids[: answer.num_accepted] + [answer.next_token_id]
            contexts[block.session_id] = block.context_token_ids + emitted
    return verdicts


@pytest.mark.parametrize("sampling", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_batched_verdicts_equal_one_at_a_time_verdicts(target_model, vocab_size, sampling, monkeypatch):
    # Every round as ONE padded forward of all six sessions, however different their lengths
    # (the gatherer would otherwise split them): padding must not change any verdict.
    monkeypatch.setattr(batching, "padding_fits", lambda rows: True)

    async def run(max_batch_sessions: int, concurrently: bool):
        backend = TransformersBackend(target_model)
        backend.enable_batching(max_batch_sessions, batch_wait_s=1.0)
        try:
            return await _verify_rounds(backend, sampling, vocab_size, concurrently)
        finally:
            await backend.aclose()

    alone = asyncio.run(run(1, concurrently=False))
    batched = asyncio.run(run(6, concurrently=True))
    assert [v[:2] for v in batched] == [v[:2] for v in alone]
    assert {v[2] for v in alone} == {1}
    assert {v[2] for v in batched} == {6}  # every round ran as one forward of all six sessions


def _pending(session_id: str) -> PendingCall:
    return PendingCall(BlockToVerify(session_id, [5], [], None, GREEDY), 0.0, future=None)


def test_a_batch_takes_the_oldest_calls_and_at_most_one_per_session():
    queue = [_pending(s) for s in ("a", "b", "a", "c", "d", "b")]
    batch = take_batch(queue, max_batch_sessions=3)
    assert [call.block.session_id for call in batch] == ["a", "b", "c"]
    assert [call.block.session_id for call in queue] == ["a", "d", "b"]  # in arrival order
    assert [call.block.session_id for call in take_batch(queue, 3)] == ["a", "d", "b"]


def _sized(session_id: str, rows: int) -> PendingCall:
    """A call whose block feeds ``rows`` rows (all context, nothing cached)."""
    return PendingCall(BlockToVerify(session_id, list(range(rows)), [], None, GREEDY), 0.0, future=None)


def _rows(block: BlockToVerify) -> int:
    return len(block.context_token_ids) + block.num_drafted


def test_a_prompt_is_not_padded_onto_blocks_nor_blocks_onto_a_prompt():
    queue = [_sized("a", 300), _sized("b", 9), _sized("c", 5), _sized("d", 280), _sized("e", 1)]
    assert [call.block.session_id for call in take_batch(queue, 8, _rows)] == ["a", "d"]
    assert [call.block.session_id for call in take_batch(queue, 8, _rows)] == ["b", "c", "e"]
    assert queue == []


def test_a_call_left_out_opens_the_next_batch():
    queue = [_sized("a", 9), _sized("b", 300), _sized("c", 9)]
    assert [call.block.session_id for call in take_batch(queue, 8, _rows)] == ["a", "c"]
    queue.append(_sized("a", 9))  # a's next call arrives before b has run
    assert [call.block.session_id for call in take_batch(queue, 8, _rows)] == ["b"]
    assert [call.block.session_id for call in take_batch(queue, 8, _rows)] == ["a"]


@pytest.mark.parametrize(
    "rows,fits",
    [
        ([9, 9, 9], True),
        ([9, 1], True),
        ([1] * 7 + [MAX_PAD_ROWS + 1], False),
        ([9] * 7 + [13], True),
        ([300, 9], False),
        ([300, 280], True),
    ],
)
def test_padding_fits_within_max_of_the_constant_and_half_the_real_rows(rows, fits):
    assert padding_fits(rows) is fits


def test_batch_sizes_and_queue_times_are_on_metrics_and_in_timings(tiny_pair, vocab_size):
    rng = random.Random(3)
    with running_verifier(tiny_pair, max_batch_sessions=4, batch_wait_ms=0.0) as client:
        context = random_tokens(rng, 8, vocab_size)
        answer = verify(client, verify_body(new_session_id(), [], random_tokens(rng, 3, vocab_size), new_tokens=context))
        metrics = client.get("/metrics").text
    assert answer["timings"]["queue_ms"] >= 0.0
    assert "spade_verifier_batch_sessions_count 1.0" in metrics
    assert "spade_verifier_queue_seconds_count 1.0" in metrics
    assert committed_after(context, [], answer)[:8] == context


# A session that ends, or a caller that leaves, while its call waits for a batch ---------------

WAIT_FOR_COMPANY_S = 0.5
"""Long enough that a lone call is still waiting for company when the test acts on it."""


async def _queued_then(backend: TransformersBackend, act) -> tuple[BaseException | None, BlockVerdict]:
    """Queue a call of session "left", ``act`` on it while it waits, then verify session "next";
    returns what the "left" caller got and "next"'s verdict."""
    waiting = asyncio.create_task(backend.verify_block(BlockToVerify("left", [5, 6, 7], [8], None, GREEDY)))
    await asyncio.sleep(WAIT_FOR_COMPANY_S / 5)
    act(waiting)
    next_verdict = await backend.verify_block(BlockToVerify("next", [9, 10], [11], None, GREEDY))
    (outcome,) = await asyncio.gather(waiting, return_exceptions=True)
    return outcome if isinstance(outcome, BaseException) else None, next_verdict


def _batching_backend(target_model) -> TransformersBackend:
    backend = TransformersBackend(target_model)
    backend.enable_batching(4, batch_wait_s=WAIT_FOR_COMPANY_S)
    return backend


def test_a_session_released_while_its_call_waits_is_answered_and_keeps_no_cache(target_model):
    # The session is released (the edge ended it, or the registry evicted it) while its call
    # sits in the gatherer: the call is still answered, but must not store a cache nobody frees.
    async def run():
        backend = _batching_backend(target_model)
        try:
            error, next_verdict = await _queued_then(backend, lambda task: backend.release_session("left"))
            return error, next_verdict, backend.num_cached_sessions
        finally:
            await backend.aclose()

    error, next_verdict, num_cached = asyncio.run(run())
    assert error is None
    assert next_verdict.num_batched == 2  # the released call ran, in the same forward
    assert num_cached == 1  # "next" only


def test_a_call_whose_caller_left_costs_no_forward(target_model):
    async def run():
        backend = _batching_backend(target_model)
        try:
            error, next_verdict = await _queued_then(backend, lambda task: task.cancel())
            return error, next_verdict, backend.num_cached_sessions
        finally:
            await backend.aclose()

    error, next_verdict, num_cached = asyncio.run(run())
    assert isinstance(error, asyncio.CancelledError)
    assert next_verdict.num_batched == 1
    assert num_cached == 1
