"""Batched verification on the transformers backend (``backends.transformers``): one ragged
forward over several sessions' real rows, chunked prefill, the scheduler's choice of shares,
holding a forward for sessions due soon, and what happens to sessions that leave mid-batch.

Verdicts of a shared forward equal one-at-a-time verdicts (fp32 greedy and seeded sampling;
bitwise logits in batch-invariant mode), whatever the block lengths, context lengths and
chunking."""

from __future__ import annotations

import asyncio
import copy
import random
import time

import pytest
import torch

from spade_core.params import SamplingConfig
from spade_models.kv_cache import cache_argument_name
from spade_models.loader import ModelSource, load_model
from verifier_service.backends.base import BlockToVerify, ForwardRecord
from verifier_service.backends.transformers.backend import TransformersBackend
from verifier_service.backends.transformers.cpu.kernels import apply_cpu_kernels, cpu_isa, load_kernel_library
from verifier_service.backends.transformers.growing_cache import GrowingLayer, growing_cache
from verifier_service.backends.transformers.plan import PendingCall, SchedulerLimits, plan_forward
from verifier_service.backends.transformers.ragged import RaggedCache, packed_causal_mask, ragged_forward, register_ragged_attention
from verifier_service.backends.transformers.runner import Share
from verifier_service.tuning import TUNING
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


def _filled_cache(model, token_ids: list[int]):
    cache = growing_cache(model.config)
    if token_ids:
        with torch.inference_mode():
            model(input_ids=torch.tensor([token_ids]), use_cache=True, **{cache_argument_name(model): cache})
    return cache


def _ragged(model, cached_lengths: list[int], contexts: list[list[int]], scored: list[int] | None = None, packed: bool = False):
    """A ragged forward of every context's uncached tail; returns (logits, caches, segments)."""
    register_ragged_attention()
    caches = [_filled_cache(model, context[:cached]) for context, cached in zip(contexts, cached_lengths, strict=True)]
    new_ids = [context[cached:] for context, cached in zip(contexts, cached_lengths, strict=True)]
    bounds = [0]
    for ids in new_ids:
        bounds.append(bounds[-1] + len(ids))
    segments = list(zip(bounds, bounds[1:], strict=False))
    rows = list(range(bounds[-1])) if scored is None else scored
    logits = ragged_forward(model, RaggedCache(caches, segments, packed=packed), new_ids, cached_lengths, rows)
    return logits, caches, segments


# --- the ragged forward --------------------------------------------------------------------------


@pytest.mark.parametrize("packed", [False, True], ids=["per-segment", "packed"])
def test_a_ragged_forward_matches_a_plain_forward_per_session(model, vocab_size, packed):
    rng = random.Random(0)
    cached_lengths, new_lengths = [0, 7, 20, 3], [5, 1, 9, 4]
    contexts = [random_tokens(rng, c + n, vocab_size) for c, n in zip(cached_lengths, new_lengths, strict=True)]
    logits, caches, segments = _ragged(model, cached_lengths, contexts, packed=packed)
    assert logits.shape == (sum(new_lengths), vocab_size)  # real rows only: nothing padded
    for context, cached, cache, (start, end) in zip(contexts, cached_lengths, caches, segments, strict=True):
        torch.testing.assert_close(logits[start:end], plain_forward_logits(model, context)[cached:], atol=1e-4, rtol=1e-4)
        assert cache.get_seq_length() == len(context)


def test_each_session_keeps_its_growing_cache_and_grows_it_in_place(model, vocab_size):
    rng = random.Random(1)
    contexts = [random_tokens(rng, 12, vocab_size), random_tokens(rng, 30, vocab_size)]
    caches = [_filled_cache(model, context[:10]) for context in contexts]
    storage = [cache.layers[0].keys.data_ptr() for cache in caches]
    register_ragged_attention()
    new_ids = [context[10:] for context in contexts]
    ragged_forward(model, RaggedCache(caches, [(0, 2), (2, 22)]), new_ids, [10, 10], [1, 21])
    assert all(isinstance(layer, GrowingLayer) for cache in caches for layer in cache.layers)
    assert [cache.layers[0].keys.data_ptr() for cache in caches] == storage  # appended in place: no copy
    follow_up = random_tokens(rng, 3, vocab_size)
    for context, cache in zip(contexts, caches, strict=True):
        with torch.inference_mode():
            rows = model(input_ids=torch.tensor([follow_up]), use_cache=True, **{cache_argument_name(model): cache}).logits[0]
        torch.testing.assert_close(rows, plain_forward_logits(model, context + follow_up)[-3:], atol=1e-4, rtol=1e-4)


def test_the_packed_mask_lets_each_row_see_its_own_sessions_keys_up_to_its_position():
    # the docstring's example (A: 2 rows over 3 keys, B: 1 row over 2 keys), then one session alone
    mask = packed_causal_mask([(0, 2), (2, 3)], [3, 2], torch.device("cpu"))
    assert mask.int().tolist() == [[1, 1, 0, 0, 0], [1, 1, 1, 0, 0], [0, 0, 0, 1, 1]]
    alone = packed_causal_mask([(0, 3)], [5], torch.device("cpu"))
    assert torch.equal(alone, torch.ones(3, 5, dtype=torch.bool).tril(2))
    rng = random.Random(5)
    for _ in range(20):  # random shapes: each row sees exactly its position + 1 keys, all its own
        rows = [rng.randrange(1, 6) for _ in range(rng.randrange(1, 6))]
        keys = [count + rng.randrange(0, 9) for count in rows]
        bounds = [0]
        for count in rows:
            bounds.append(bounds[-1] + count)
        mask = packed_causal_mask(list(zip(bounds, bounds[1:], strict=False)), keys, torch.device("cpu"))
        key_start = 0
        for session, (count, num_keys) in enumerate(zip(rows, keys, strict=True)):
            for row in range(count):
                expected = torch.zeros(sum(keys), dtype=torch.bool)
                expected[key_start : key_start + num_keys - count + row + 1] = True
                assert torch.equal(mask[bounds[session] + row], expected)
            key_start += num_keys


def test_only_the_scored_rows_reach_the_output_layer(model, vocab_size):
    rng = random.Random(2)
    contexts = [random_tokens(rng, n, vocab_size) for n in (40, 3, 6)]
    projected: list[int] = []
    hook = model.get_output_embeddings().register_forward_hook(lambda module, args, output: projected.append(args[0].shape[1]))
    try:
        logits, _, _ = _ragged(model, [0, 0, 0], contexts, scored=[39, 40, 41, 42, 47, 48])
    finally:
        hook.remove()
    assert projected == [6]
    torch.testing.assert_close(logits[0], plain_forward_logits(model, contexts[0])[39], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(logits[4:], plain_forward_logits(model, contexts[2])[4:], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize(("batch_invariant", "packed"), [(False, False), (True, False), (False, True)])
def test_a_ragged_forward_makes_every_tensor_on_the_models_device(model, vocab_size, batch_invariant, packed):
    """The verifier also runs on CUDA, where a tensor made on the CPU (a mask, say) fails the
    forward. A copy of the model on the meta device fails the same way on any machine."""
    meta_model = copy.deepcopy(model).to("meta")
    register_ragged_attention()
    caches = [growing_cache(meta_model.config) for _ in range(2)]
    new_ids = [[1, 2, 3], [4, 5]]  # several rows per session: the causal mask is built
    ragged_cache = RaggedCache(caches, [(0, 3), (3, 5)], batch_invariant=batch_invariant, packed=packed)
    logits = ragged_forward(meta_model, ragged_cache, new_ids, [0, 0], [0, 1, 2, 3, 4])
    assert logits.device.type == "meta" and logits.shape == (5, vocab_size)
    assert all(cache.layers[0].keys.device.type == "meta" for cache in caches)


@pytest.fixture(params=["torch-rowwise", "kernel"])
def invariant_model(request, tiny_pair, tmp_path):
    """A fresh tiny target in batch-invariant mode, with and without the compiled kernel."""
    library = None
    if request.param == "kernel":
        library = load_kernel_library(tmp_path, cpu_isa())
        if library is None:
            pytest.skip("the CPU kernel cannot be built here (needs AVX2 or AVX-512 and gcc/cc); see the warning logged")
    model = load_model(ModelSource(str(tiny_pair.target_dir))).model
    apply_cpu_kernels(model, library, batch_invariant=True)
    return model


def test_batch_invariant_rows_are_bitwise_equal_whatever_shares_the_forward(invariant_model):
    # Session A's 5 rows alone, then beside B's 9 rows and C's 2: bitwise the same logits,
    # and each equal to a one-token forward at its position.
    rng = random.Random(4)
    vocab_size = invariant_model.get_output_embeddings().weight.shape[0]
    a, b, c = (random_tokens(rng, n, vocab_size) for n in (17, 25, 6))

    def rows_of_a(shares: list[tuple[str, list[int], list[int]]]) -> torch.Tensor:
        """A's scored rows when the shares' rows (after 12 cached tokens each) share one forward."""
        caches = [_filled_cache(invariant_model, context[:12]) for _, context, _ in shares]
        new_ids = [context[12:] + block for _, context, block in shares]
        bounds = [0]
        for ids in new_ids:
            bounds.append(bounds[-1] + len(ids))
        segments = list(zip(bounds, bounds[1:], strict=False))
        logits = ragged_forward(
            invariant_model, RaggedCache(caches, segments, batch_invariant=True), new_ids, [12] * len(shares), list(range(bounds[-1]))
        )
        return logits[: bounds[1]]

    alone = rows_of_a([("a", a, [])])
    shared = rows_of_a([("a", a, []), ("b", b, [3, 4, 5, 6]), ("c", c + [1] * 8, [])])
    assert torch.equal(alone, shared)
    for row in range(5):  # a one-token forward at each of A's positions
        step = rows_of_a([("a", a[: 13 + row], [])])
        assert torch.equal(step[-1], alone[row])


# --- verdicts: shared forwards, chunked prefills -----------------------------------------------------


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
    """Sessions with contexts of 1-60 tokens, several rounds through their caches; returns
    every verdict (num_accepted, next token, sessions in its forward, rows fed) in session order."""
    rng = random.Random(7)
    contexts = {f"s{index}": random_tokens(rng, rng.randrange(1, 61), vocab_size) for index in range(6)}
    verdicts = []
    for _ in range(num_rounds):
        blocks = _round_of_blocks(rng, contexts, sampling, vocab_size)
        if concurrently:
            answers = await asyncio.gather(*(backend.verify_block(block) for block in blocks))
        else:
            answers = [await backend.verify_block(block) for block in blocks]
        for block, answer in zip(blocks, answers, strict=True):
            verdicts.append((answer.num_accepted, answer.next_token_id, answer.num_batched, answer.num_target_tokens))
            emitted = block.draft_token_ids[: answer.num_accepted] + [answer.next_token_id]
            contexts[block.session_id] = block.context_token_ids + emitted
    return verdicts


def _backend(target_model, packed_attention: bool | None = None, **limits) -> TransformersBackend:
    backend = TransformersBackend(target_model, packed_attention=packed_attention)
    backend.configure(SchedulerLimits(**limits))
    return backend


async def _rounds(target_model, sampling, vocab_size, concurrently: bool, records: list | None = None, **limits):
    backend = _backend(target_model, **limits)  # limits may name packed_attention
    if records is not None:
        backend.observe_forwards(records.append)
    try:
        return await _verify_rounds(backend, sampling, vocab_size, concurrently)
    finally:
        await backend.aclose()


@pytest.mark.parametrize("packed", [False, True], ids=["per-segment", "packed"])
@pytest.mark.parametrize("sampling", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_shared_forward_verdicts_equal_one_at_a_time_verdicts(target_model, vocab_size, sampling, packed):
    alone = asyncio.run(_rounds(target_model, sampling, vocab_size, False, max_batch_sessions=1))
    shared = asyncio.run(
        _rounds(
            target_model, sampling, vocab_size, True, max_batch_sessions=6, max_forward_rows=512, batch_wait_s=1.0, packed_attention=packed
        )
    )
    assert [v[:2] for v in shared] == [v[:2] for v in alone]
    assert [v[3] for v in shared] == [v[3] for v in alone]  # the same rows fed per call
    assert {v[2] for v in alone} == {1}
    assert {v[2] for v in shared} == {6}  # every round ran as one forward of all six sessions


@pytest.mark.parametrize("sampling", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_chunked_prefills_give_the_verdicts_of_whole_ones(target_model, vocab_size, sampling):
    # Forwards of at most 8 rows: prompts of up to 60 tokens are fed in chunks across forwards
    # (sharing them with other sessions' blocks); every verdict is the unchunked one.
    whole = asyncio.run(_rounds(target_model, sampling, vocab_size, True, max_batch_sessions=6, max_forward_rows=512, batch_wait_s=1.0))
    records: list[ForwardRecord] = []
    chunked = asyncio.run(
        _rounds(
            target_model, sampling, vocab_size, True, records, max_batch_sessions=6, max_forward_rows=8, max_block_rows=7, batch_wait_s=1.0
        )
    )
    assert [v[:2] for v in chunked] == [v[:2] for v in whole]
    assert [v[3] for v in chunked] == [v[3] for v in whole]  # every chunk's rows counted for its call
    assert max(record.num_rows for record in records) <= 8
    assert any(record.num_sessions > 1 for record in records)


def test_a_long_prompt_shares_forwards_with_blocks_and_delays_them_by_one_chunk_at_most(target_model, vocab_size):
    # Four sessions verify blocks round after round while a 200-token prompt arrives: the prompt
    # is prefilled in chunks inside their forwards; no forward is longer than the row budget and
    # every block is answered by the first forward after it arrives.
    rng = random.Random(9)
    limits = {"max_batch_sessions": 8, "max_forward_rows": 40, "max_block_rows": 9}

    async def run():
        backend = _backend(target_model, **limits)
        records: list[ForwardRecord] = []
        backend.observe_forwards(records.append)
        contexts = {f"s{index}": random_tokens(rng, 6, vocab_size) for index in range(4)}

        async def one_round() -> int:
            """Every session verifies a block of 4; returns the forwards run meanwhile."""
            blocks = [BlockToVerify(s, context, random_tokens(rng, 4, vocab_size), None, GREEDY) for s, context in contexts.items()]
            forwards_before = len(records)
            answers = await asyncio.gather(*(backend.verify_block(block) for block in blocks))
            for block, answer in zip(blocks, answers, strict=True):
                contexts[block.session_id] = block.context_token_ids + block.draft_token_ids[: answer.num_accepted] + [answer.next_token_id]
            return len(records) - forwards_before

        try:
            await one_round()  # the sessions' contexts are cached: each block then feeds 5 rows
            prompt = asyncio.create_task(backend.verify_block(BlockToVerify("long", random_tokens(rng, 200, vocab_size), [], None, GREEDY)))
            forwards_per_round = []
            while not prompt.done():
                forwards_per_round.append(await one_round())
            return records, forwards_per_round, await prompt
        finally:
            await backend.aclose()

    records, forwards_per_round, verdict = asyncio.run(run())
    assert verdict.num_target_tokens == 200
    assert len(forwards_per_round) >= 3  # the blocks kept being answered while the prompt was prefilled
    assert max(forwards_per_round) <= 2  # each round's blocks: the next forward (one prompt chunk may be running)
    assert max(record.num_rows for record in records) <= 40
    assert sum(record.num_sessions == 5 for record in records) >= 3  # chunks shared forwards with all four sessions


# --- choosing each forward's shares ------------------------------------------------------------------


def _call(session_id: str, need: int) -> PendingCall:
    """A call feeding ``need`` rows (all context, nothing cached)."""
    return PendingCall(BlockToVerify(session_id, list(range(need)), [], None, GREEDY), 0.0, future=None)


def _need(call: PendingCall) -> int:
    return len(call.block.context_token_ids)


def _planned(queue, **limits) -> list[tuple[str, int]]:
    return [(call.block.session_id, allowance) for call, allowance in plan_forward(queue, _need, SchedulerLimits(**limits))]


def test_a_forward_takes_the_oldest_calls_and_at_most_one_per_session():
    queue = [_call(s, 1) for s in ("a", "b", "a", "c", "d", "b")]
    assert _planned(queue, max_batch_sessions=3) == [("a", 1), ("b", 1), ("c", 1)]
    assert _planned(queue, max_batch_sessions=8) == [("a", 1), ("b", 1), ("c", 1), ("d", 1)]


def test_blocks_go_first_and_a_long_prompt_gets_the_rest_of_the_row_budget_as_a_chunk():
    queue = [_call("p", 300), _call("a", 9), _call("b", 9), _call("q", 200)]
    assert _planned(queue, max_forward_rows=64, max_block_rows=9) == [("a", 9), ("b", 9), ("p", 46)]
    # With little room, TUNING.min_chunk_rows are kept for the prompt: only the first block runs beside it.
    assert _planned(queue, max_forward_rows=TUNING.min_chunk_rows, max_block_rows=9) == [("a", 9), ("p", TUNING.min_chunk_rows - 9)]
    assert _planned(queue, max_forward_rows=TUNING.min_chunk_rows + 9, max_block_rows=9) == [("a", 9), ("p", TUNING.min_chunk_rows)]


def test_a_long_prompt_keeps_a_place_among_as_many_blocks_as_a_forward_takes():
    """Sessions the verifier continues are queued again the moment they are answered: with as
    many of them as a forward takes, a prompt that came after them once got no place until one
    ended (at N = 16 users its first token came 1.2-1.7x later than target-only's, p99)."""
    queue = [_call(s, 2) for s in "abcdefgh"] + [_call("p", 300)]
    assert _planned(queue, max_forward_rows=128, max_block_rows=9) == [(s, 2) for s in "abcdefg"] + [("p", 128 - 14)]
    assert _planned(queue[:8], max_forward_rows=128, max_block_rows=9) == [(s, 2) for s in "abcdefgh"]  # no prompt: all eight
    assert _planned(queue, max_forward_rows=128, max_block_rows=9, max_batch_sessions=1) == [("a", 2)]  # one call a forward


def test_after_a_big_chunk_the_blocks_get_the_next_forward_nearly_to_themselves():
    queue = [_call("p", 300), _call("a", 9), _call("b", 9)]
    assert _planned(queue, max_forward_rows=64, max_block_rows=9) == [("a", 9), ("b", 9), ("p", 46)]
    after = plan_forward(queue, _need, SchedulerLimits(max_forward_rows=64, max_block_rows=9), after_chunk=True)
    assert [(call.block.session_id, rows) for call, rows in after] == [("a", 9), ("b", 9), ("p", TUNING.min_chunk_rows)]
    alone = plan_forward(queue[:1], _need, SchedulerLimits(max_forward_rows=64, max_block_rows=9), after_chunk=True)
    assert [(call.block.session_id, rows) for call, rows in alone] == [("p", 64)]  # no block waits: the whole budget


def test_the_first_block_runs_even_past_the_row_budget():
    assert _planned([_call("a", 30), _call("b", 5)], max_forward_rows=8, max_block_rows=40) == [("a", 30)]


# --- sessions that leave mid-batch ---------------------------------------------------------------------

WAIT_FOR_COMPANY_S = 0.5
"""Long enough that a lone call is still waiting for company when the test acts on it."""


async def _queued_then(backend: TransformersBackend, act):
    """Queue a call of session "left", ``act`` on it while it waits, then verify session "next";
    returns what the "left" caller got and "next"'s verdict."""
    waiting = asyncio.create_task(backend.verify_block(BlockToVerify("left", [5, 6, 7], [8], None, GREEDY)))
    await asyncio.sleep(WAIT_FOR_COMPANY_S / 5)
    act(waiting)
    next_verdict = await backend.verify_block(BlockToVerify("next", [9, 10], [11], None, GREEDY))
    (outcome,) = await asyncio.gather(waiting, return_exceptions=True)
    return outcome if isinstance(outcome, BaseException) else None, next_verdict


def _left_behind(target_model, act):
    async def run():
        backend = _backend(target_model, max_batch_sessions=4, batch_wait_s=WAIT_FOR_COMPANY_S)
        try:
            error, next_verdict = await _queued_then(backend, lambda task: act(backend, task))
            return error, next_verdict, backend.num_cached_sessions
        finally:
            await backend.aclose()

    return asyncio.run(run())


def test_a_session_released_while_its_call_waits_is_answered_and_keeps_no_cache(target_model):
    # The session is released (the edge ended it, or the registry evicted it) while its call
    # waits: the call is still answered, but must not store a cache nobody frees.
    error, next_verdict, num_cached = _left_behind(target_model, lambda backend, task: backend.release_session("left"))
    assert error is None
    assert next_verdict.num_batched == 2  # the released call ran, in the same forward
    assert num_cached == 1  # "next" only


def test_a_call_whose_caller_left_costs_no_forward(target_model):
    error, next_verdict, num_cached = _left_behind(target_model, lambda backend, task: task.cancel())
    assert isinstance(error, asyncio.CancelledError)
    assert next_verdict.num_batched == 1
    assert num_cached == 1


def test_a_session_released_mid_prefill_frees_its_cache(target_model, vocab_size):
    async def run():
        backend = _backend(target_model, max_forward_rows=16, max_block_rows=4)
        try:
            prompt = asyncio.create_task(
                backend.verify_block(BlockToVerify("long", random_tokens(random.Random(5), 120, vocab_size), [], None, GREEDY))
            )
            await asyncio.sleep(0.05)
            prompt.cancel()
            backend.release_session("long")
            await asyncio.gather(prompt, return_exceptions=True)
            await backend.verify_block(BlockToVerify("next", [9, 10], [11], None, GREEDY))
            return backend.num_cached_sessions
        finally:
            await backend.aclose()

    assert asyncio.run(run()) == 1  # "next" only


def test_a_session_released_mid_prefill_is_still_answered_and_keeps_no_cache(target_model, vocab_size):
    # Released while its prompt is prefilled in chunks: the chunks go on from the partial cache
    # (not from scratch, forever), the call is answered, and no cache stays behind.
    async def run():
        backend = _backend(target_model, max_forward_rows=16, max_block_rows=4)
        records: list[ForwardRecord] = []
        backend.observe_forwards(records.append)
        try:
            prompt = asyncio.create_task(
                backend.verify_block(BlockToVerify("long", random_tokens(random.Random(6), 120, vocab_size), [], None, GREEDY))
            )
            while not records:
                await asyncio.sleep(0.005)
            backend.release_session("long")
            verdict = await prompt
            await asyncio.sleep(0.05)  # the release runs on the worker thread
            return verdict, len(records), backend.num_cached_sessions
        finally:
            await backend.aclose()

    verdict, num_forwards, num_cached = asyncio.run(run())
    assert verdict.num_target_tokens == 120
    assert num_forwards == 8  # 120 rows in chunks of 16: 7 chunks + the answering forward
    assert num_cached == 0


# --- holding a forward for sessions due soon -----------------------------------------------------------


class SlowRunner:
    """A stand-in for the model runner: every forward takes ``forward_s`` (sleeping, not
    computing) and answers each call with a bonus token; it records each forward's sessions."""

    shares_prefixes = False

    def __init__(self, forward_s: float) -> None:
        self.forward_s = forward_s
        self.sessions_per_forward: list[int] = []

    def cached_length(self, block: BlockToVerify) -> int:
        return len(block.context_token_ids) - 1

    def run(self, shares: list[Share]):
        from spade_core.acceptance import Acceptance
        from verifier_service.backends.transformers.runner import ShareResult

        time.sleep(self.forward_s)
        self.sessions_per_forward.append(len(shares))
        results = [ShareResult(1 + share.block.num_drafted, Acceptance(share.block.num_drafted, 0, True)) for share in shares]
        return results, ForwardRecord(len(shares), len(shares) * 2 + len(self.sessions_per_forward) % 3, self.forward_s)


class NamingRunner(SlowRunner):
    """``SlowRunner`` that also records the sessions of each forward."""

    def __init__(self, forward_s: float) -> None:
        super().__init__(forward_s)
        self.forwards: list[set[str]] = []

    def run(self, shares):
        self.forwards.append({share.block.session_id for share in shares})
        return super().run(shares)


def _alternating_edges(limits: SchedulerLimits, gaps_s: tuple[float, ...] = (0.03,), num_calls: int = 8) -> list[int]:
    """Two edges, calling again ``gaps_s[i % len(gaps_s)]`` after their i-th answer (30 ms by
    default; the second edge runs through ``gaps_s`` backwards; their first calls 60 ms apart),
    against forwards of 150 ms; returns the sessions of each forward."""
    from concurrent.futures import ThreadPoolExecutor

    from verifier_service.backends.transformers.scheduler import Scheduler

    async def edge(scheduler, session_id: str, delay_s: float, gaps: tuple[float, ...]) -> None:
        await asyncio.sleep(delay_s)
        for index in range(num_calls):
            await scheduler.submit(BlockToVerify(session_id, [1, 2], [3], None, GREEDY), time.perf_counter())
            await asyncio.sleep(gaps[index % len(gaps)])

    async def run() -> list[int]:
        runner = SlowRunner(0.15)
        with ThreadPoolExecutor(max_workers=1) as executor:
            scheduler = Scheduler(runner, executor, limits)
            await asyncio.gather(edge(scheduler, "a", 0.0, gaps_s), edge(scheduler, "b", 0.06, gaps_s[::-1]))
            await scheduler.aclose()
        return runner.sessions_per_forward

    return asyncio.run(run())


def test_holding_a_forward_lets_two_edges_share_their_forwards():
    # Without holding, each edge's call arrives while the other's forward runs: they alternate,
    # one session per forward. Holding for a session due within the forward's fixed part (here
    # all of its 150 ms) merges them after the first rounds.
    alternating = _alternating_edges(SchedulerLimits(max_batch_sessions=4, hold_scale=0.0))
    assert alternating.count(2) <= 2
    held = _alternating_edges(SchedulerLimits(max_batch_sessions=4))
    assert sum(held) == sum(alternating) == 16
    # Once both edges' gaps are learnt (three forwards), every forward serves both, until the
    # edge that started first makes its last call alone.
    assert held.count(2) >= 5


def test_a_session_a_little_late_after_its_mean_gap_is_still_waited_for():
    # Edges whose gap alternates between 10 and 70 ms, out of step with each other (an edge's gap
    # varies with its block length): each round one of them comes 30 ms after its mean gap. A
    # forward that waits only until the expected time leaves the late one behind, and the two
    # fall out of phase again and again; awaited two mean deviations past it, they stay together.
    jitter = (0.01, 0.07)
    until_expected = _alternating_edges(SchedulerLimits(max_batch_sessions=4, hold_late_deviations=0.0), jitter, 12)
    a_little_past = _alternating_edges(SchedulerLimits(max_batch_sessions=4), jitter, 12)
    assert sum(until_expected) == sum(a_little_past) == 24
    assert a_little_past.count(2) >= 7  # both, from their fourth or fifth round on
    assert a_little_past.count(2) > until_expected.count(2)


class KneeRunner:
    """A stand-in runner whose forward of R rows takes 0.1 + 0.005 R s up to 9 rows and 0.03 s
    a row past them (a CPU's knee, scaled down); a session's first call is its whole prompt."""

    shares_prefixes = False

    def __init__(self) -> None:
        self.seen: set[str] = set()
        self.sessions_per_forward: list[int] = []

    def cached_length(self, block: BlockToVerify) -> int:
        return len(block.context_token_ids) - 1 if block.session_id in self.seen else 0

    def run(self, shares: list[Share]):
        from spade_core.acceptance import Acceptance
        from verifier_service.backends.transformers.runner import ShareResult

        rows = [len(share.block.context_token_ids) - self.cached_length(share.block) + share.block.num_drafted for share in shares]
        num_rows = sum(rows)
        forward_s = 0.1 + 0.005 * min(num_rows, 9) + 0.03 * max(0, num_rows - 9)
        time.sleep(forward_s)
        self.seen.update(share.block.session_id for share in shares)
        self.sessions_per_forward.append(len(shares))
        results = [ShareResult(n, Acceptance(share.block.num_drafted, 0, True)) for n, share in zip(rows, shares, strict=True)]
        return results, ForwardRecord(len(shares), num_rows, forward_s)


def _stepped_edge(gap_s: float, num_rounds: int = 10) -> list[str]:
    """One session stepped ahead (``steps_ahead``): after each answer the service submits a step
    of it, and its edge's call comes ``gap_s`` later (the KneeRunner's one-row forward: ~0.1 s of
    fixed part); the call withdraws the step if it has not reached a forward, else waits for it.
    Returns, per round, what became of the step."""
    from concurrent.futures import ThreadPoolExecutor

    from verifier_service.backends.transformers.scheduler import Scheduler

    async def run() -> list[str]:
        outcomes = []
        with ThreadPoolExecutor(max_workers=1) as executor:
            scheduler = Scheduler(KneeRunner(), executor, SchedulerLimits(max_batch_sessions=4))
            context = list(range(1, 20))
            await scheduler.submit(BlockToVerify("a", context, [], None, GREEDY), time.perf_counter())
            for _ in range(num_rounds):
                step = BlockToVerify("a", [*context, 1], [], None, GREEDY, ahead_step=True)
                stepping = asyncio.ensure_future(scheduler.submit(step, time.perf_counter()))
                await asyncio.sleep(gap_s)
                scheduler.call_arrived("a", time.perf_counter(), 3)
                if scheduler.is_in_forward("a") or stepping.done():
                    await stepping
                    outcomes.append("stepped")
                else:
                    stepping.cancel()
                    outcomes.append("withdrawn")
                await scheduler.submit(BlockToVerify("a", context, [5, 6, 7], None, GREEDY), time.perf_counter())
            await scheduler.aclose()
        return outcomes

    return asyncio.run(run())


def test_a_stepped_session_s_edge_due_within_the_fixed_part_is_held_for_not_delayed_by_a_step():
    # An edge back 30 ms after its answer, against a forward whose fixed part is ~0.1 s: a step
    # run meanwhile would hold its block back by a whole forward for one token, so the forward
    # waits for the block instead (from the second round, once the gap is learnt).
    assert _stepped_edge(0.03).count("withdrawn") >= 8
    # An edge away longer than a forward leaves the verifier idle otherwise: the step runs.
    assert _stepped_edge(0.25, num_rounds=5).count("stepped") >= 4


def test_prompts_past_the_knee_do_not_turn_holding_off():
    # Two edges: a 30-token prompt each, then blocks of 1-3 drafted tokens, each drafted in
    # 30 ms after a 20 ms round trip (the two edges' lengths out of step, so their calls drift
    # apart unless a forward waits). Their blocks' forwards cost ~0.1 s of fixed part; the
    # prompts' forwards far more per row (past the knee). Fitting one line through both made
    # the fixed part look tiny and no hold worth it: the edges alternated. The line learns from
    # block forwards.
    from concurrent.futures import ThreadPoolExecutor

    from verifier_service.backends.transformers.scheduler import Scheduler

    prompt = list(range(30))

    async def edge(scheduler, session_id: str, delay_s: float, lengths: tuple[int, ...]) -> None:
        await asyncio.sleep(delay_s)
        await scheduler.submit(BlockToVerify(session_id, prompt, [], None, GREEDY), time.perf_counter())
        for index in range(12):
            num_drafted = lengths[index % len(lengths)]
            await asyncio.sleep(0.02 + 0.03 * num_drafted)
            context = prompt + [1] * (index + 1)
            await scheduler.submit(BlockToVerify(session_id, context, [7] * num_drafted, None, GREEDY), time.perf_counter())

    async def run() -> list[int]:
        runner = KneeRunner()
        with ThreadPoolExecutor(max_workers=1) as executor:
            scheduler = Scheduler(runner, executor, SchedulerLimits(max_batch_sessions=4))
            await asyncio.gather(edge(scheduler, "a", 0.0, (1, 2, 3)), edge(scheduler, "b", 0.3, (3, 1, 2)))
            await scheduler.aclose()
        return runner.sessions_per_forward

    sessions_per_forward = asyncio.run(run())
    assert sum(sessions_per_forward) == 26
    assert sessions_per_forward.count(2) >= 6, sessions_per_forward


def _advice_after_busy_blocks(num_edges: int) -> list[int | None]:
    """Edges calling back to back (the target never idle) with blocks of 10-12 drafted tokens,
    all accepted, against ``KneeRunner`` (past its 9-row knee); each edge's advice at the end."""
    from concurrent.futures import ThreadPoolExecutor

    from verifier_service.backends.transformers.scheduler import Scheduler

    prompt = list(range(20))

    async def edge(scheduler, session_id: str) -> None:
        await scheduler.submit(BlockToVerify(session_id, prompt, [], None, GREEDY), time.perf_counter())
        context = prompt + [1]
        for index in range(9):
            block = [7] * (10 + index % 3)
            await scheduler.submit(BlockToVerify(session_id, context, block, None, GREEDY), time.perf_counter())
            context = context + block + [0]

    async def run() -> list[int | None]:
        with ThreadPoolExecutor(max_workers=1) as executor:
            scheduler = Scheduler(KneeRunner(), executor, SchedulerLimits(max_batch_sessions=4, max_draft_length=16))
            edges = [f"e{k}" for k in range(num_edges)]
            await asyncio.gather(*(edge(scheduler, session_id) for session_id in edges))
            advice = [scheduler.advice_for(session_id) for session_id in edges]
            await scheduler.aclose()
        return advice

    return asyncio.run(run())


def test_one_session_alone_is_advised_the_limit_even_while_the_target_never_idles():
    # Its rows delay nobody else; its edge's own policy chooses its speed (past the knee too).
    # Two such sessions are advised shorter blocks.
    assert _advice_after_busy_blocks(1) == [16]
    assert all(advice is not None and advice < 16 for advice in _advice_after_busy_blocks(2))


def _advice_after_continuing(last_call: str, max_batch_sessions: int = 4) -> dict[str, int | None]:
    """Against ``KneeRunner`` (below its knee here: a drafted row is cheap), the target never
    idle: edges e1 and e2 send blocks of 1 drafted token back to back, all kept; session c sends
    four such blocks, is then continued (steps back to back), and its last call is ``last_call``:
    "continued" (one more continued step), "empty" (its edge's call without a block) or "block"
    (its edge's block of 1). The verifier's limit is 1, so the advice is 0 or 1. Returns each
    session's advice at the end. ``max_batch_sessions`` below 3: the forwards are full."""
    from concurrent.futures import ThreadPoolExecutor

    from verifier_service.backends.transformers.scheduler import Scheduler

    prompt = list(range(20))

    async def edge(scheduler, session_id: str, num_blocks: int) -> list[int]:
        await scheduler.submit(BlockToVerify(session_id, prompt, [], None, GREEDY), time.perf_counter())
        context = prompt + [1]
        for _ in range(num_blocks):
            await scheduler.submit(BlockToVerify(session_id, context, [7], None, GREEDY), time.perf_counter())
            context = context + [7, 0]
        return context

    async def continued_session(scheduler) -> None:
        context = await edge(scheduler, "c", 4)
        for _ in range(6):
            await scheduler.submit(BlockToVerify("c", context, [], None, GREEDY, continued_step=True), time.perf_counter())
            context = context + [0]
        last = {
            "continued": BlockToVerify("c", context, [], None, GREEDY, continued_step=True),
            "empty": BlockToVerify("c", context, [], None, GREEDY),
            "block": BlockToVerify("c", context, [7], None, GREEDY),
        }[last_call]
        await scheduler.submit(last, time.perf_counter())

    async def run() -> dict[str, int | None]:
        with ThreadPoolExecutor(max_workers=1) as executor:
            limits = SchedulerLimits(max_batch_sessions=max_batch_sessions, max_draft_length=1)
            scheduler = Scheduler(KneeRunner(), executor, limits)
            await asyncio.gather(continued_session(scheduler), edge(scheduler, "e1", 14), edge(scheduler, "e2", 14))
            advice = {session_id: scheduler.advice_for(session_id) for session_id in ("c", "e1", "e2")}
            await scheduler.aclose()
        return advice

    return asyncio.run(run())


@pytest.mark.parametrize("max_batch_sessions", [4, 2])
@pytest.mark.parametrize(("last_call", "advice_of_c"), [("continued", 0), ("empty", 0), ("block", 1)])
def test_a_continued_session_goes_back_to_drafting_only_where_that_pays_for_the_forward_it_misses(
    last_call, advice_of_c, max_batch_sessions
):
    # Every session keeps nearly every drafted token and a drafted row is cheap, so the row plan
    # gives each a block of 1 (the limit), and the edges get it. But a continued session that
    # left to draft that block would miss the forward that starts when it is answered: 1 + alpha
    # tokens in two forwards against 2 continued ones (``advice.departure_length`` on the
    # forwards as measured), so it stays continued, also through its edge's call without a block
    # (its allowance ran out). Once its edge sends a block again, it is an edge like the others.
    # The same where the forwards are full (two sessions a forward: ``advice.departure_pays`` on
    # the row plan).
    advice = _advice_after_continuing(last_call, max_batch_sessions)
    assert advice == {"c": advice_of_c, "e1": 1, "e2": 1}


def test_a_continued_sessions_next_step_joins_the_next_forward():
    # Session "a" is continued by its service: its next step comes the moment it is answered,
    # with no round trip. Edge "b" calls again 30 ms after each answer, during the next forward
    # (no holding here). Each of a's steps must make the forward that starts right after its
    # answer: planned before the step was submitted, that forward ran b's call alone and a
    # missed it.
    from concurrent.futures import ThreadPoolExecutor

    from verifier_service.backends.transformers.scheduler import Scheduler

    async def continued(scheduler) -> None:
        await scheduler.submit(BlockToVerify("a", [1, 2], [3], None, GREEDY), time.perf_counter())
        for index in range(8):
            step = BlockToVerify("a", [1, 2] + [4] * (index + 1), [], None, GREEDY, continued_step=True)
            await scheduler.submit(step, time.perf_counter())

    async def edge(scheduler) -> None:
        await asyncio.sleep(0.01)
        for _ in range(8):
            await scheduler.submit(BlockToVerify("b", [5, 6], [7], None, GREEDY), time.perf_counter())
            await asyncio.sleep(0.03)

    async def run() -> list[set[str]]:
        runner = NamingRunner(0.05)
        with ThreadPoolExecutor(max_workers=1) as executor:
            scheduler = Scheduler(runner, executor, SchedulerLimits(max_batch_sessions=4, hold_scale=0.0))
            await asyncio.gather(continued(scheduler), edge(scheduler))
            await scheduler.aclose()
        return runner.forwards

    forwards = asyncio.run(run())
    assert sum(len(sessions) for sessions in forwards) == 17
    last_of_a = max(index for index, sessions in enumerate(forwards) if "a" in sessions)
    assert all("a" in sessions for sessions in forwards[: last_of_a + 1]), forwards


def _forwards_beside_continued_sessions(edge_gap_s: float) -> list[set[str]]:
    """Sessions a1-a3 are continued (their steps back to back, no round trip); edge b calls
    again ``edge_gap_s`` after each answer with a block of 1; forwards of 150 ms whatever their
    rows (the target saturated). Returns the sessions of each forward while b runs, past the
    first four (while the curve and the gaps are learnt)."""
    from concurrent.futures import ThreadPoolExecutor

    from verifier_service.backends.transformers.scheduler import Scheduler

    async def continued(scheduler, session_id: str, done: asyncio.Event) -> None:
        await scheduler.submit(BlockToVerify(session_id, [1, 2], [3], None, GREEDY), time.perf_counter())
        context = [1, 2, 3, 0]
        while not done.is_set():
            await scheduler.submit(BlockToVerify(session_id, context, [], None, GREEDY, continued_step=True), time.perf_counter())
            context = context + [0]

    async def edge(scheduler, done: asyncio.Event) -> None:
        for _ in range(12):
            await scheduler.submit(BlockToVerify("b", [5, 6], [7], None, GREEDY), time.perf_counter())
            await asyncio.sleep(edge_gap_s)
        done.set()

    async def run() -> list[set[str]]:
        runner = NamingRunner(0.15)
        done = asyncio.Event()
        with ThreadPoolExecutor(max_workers=1) as executor:
            scheduler = Scheduler(runner, executor, SchedulerLimits(max_batch_sessions=4))
            await asyncio.gather(*(continued(scheduler, f"a{k}", done) for k in (1, 2, 3)), edge(scheduler, done))
            await scheduler.aclose()
        return runner.forwards

    forwards = asyncio.run(run())
    last_of_b = max(index for index, sessions in enumerate(forwards) if "b" in sessions)
    return forwards[4 : last_of_b + 1]


def test_beside_continued_sessions_a_forward_waits_for_an_edge_only_while_that_commits_more_per_second():
    # Holding w for b commits the three steps and b's block (~4.9 tokens) in w + 0.15 s; not
    # holding runs the steps, then the steps and b's block: ~7.9 tokens in 0.3 s. So hold while
    # w < ~0.036 s (``hold.hold_is_worth`` with ``returning``); the rule that ignores that the
    # continued sessions come back at once held up to 0.15 s, and the target idled 50 ms of
    # every 200.
    near = _forwards_beside_continued_sessions(0.01)
    assert sum("b" in sessions for sessions in near) >= 0.8 * len(near), near
    far = _forwards_beside_continued_sessions(0.05)
    assert sum("b" not in sessions for sessions in far) >= 0.35 * len(far), far


# --- the service: metrics and timings -------------------------------------------------------------------


def test_forwards_and_their_sessions_are_on_metrics_and_in_timings(tiny_pair, vocab_size):
    rng = random.Random(3)
    with running_verifier(tiny_pair, max_batch_sessions=4, batch_wait_ms=0.0) as client:
        context = random_tokens(rng, 8, vocab_size)
        answer = verify(client, verify_body(new_session_id(), [], random_tokens(rng, 3, vocab_size), new_tokens=context))
        metrics = client.get("/metrics").text
    assert answer["timings"]["queue_ms"] >= 0.0
    assert "spade_verifier_batch_sessions_count 1.0" in metrics
    assert "spade_verifier_forward_sessions_count 1.0" in metrics
    assert "spade_verifier_model_forwards_total 1.0" in metrics
    assert "spade_verifier_model_forward_rows_total 11.0" in metrics  # 8 context + 3 drafted
    assert "spade_verifier_queue_seconds_count 1.0" in metrics
    assert committed_after(context, [], answer)[:8] == context


def test_a_failing_forward_reaches_every_caller_of_it_and_the_next_forward_runs(target_model, monkeypatch):
    async def run():
        backend = _backend(target_model, max_batch_sessions=4, batch_wait_s=0.2)
        runner = backend._runner
        original = runner.run
        monkeypatch.setattr(runner, "run", lambda shares: (_ for _ in ()).throw(RuntimeError("the forward failed")))
        try:
            failed = await asyncio.gather(
                backend.verify_block(BlockToVerify("a", [5, 6], [7], None, GREEDY)),
                backend.verify_block(BlockToVerify("b", [8, 9], [], None, GREEDY)),
                return_exceptions=True,
            )
            monkeypatch.setattr(runner, "run", original)
            verdict = await backend.verify_block(BlockToVerify("a", [5, 6], [7], None, GREEDY))
            return failed, verdict
        finally:
            await backend.aclose()

    failed, verdict = asyncio.run(run())
    assert [str(error) for error in failed] == ["the forward failed"] * 2
    assert verdict.num_target_tokens == 3


def test_a_fault_of_the_scheduler_itself_reaches_every_waiting_caller():
    # A bug outside the forward (here the runner cannot tell a call's cached length) must fail
    # the calls, not leave their callers waiting forever; the next call starts a fresh worker.
    from concurrent.futures import ThreadPoolExecutor

    from verifier_service.backends.transformers.scheduler import Scheduler

    class BrokenRunner(SlowRunner):
        def cached_length(self, block: BlockToVerify) -> int:
            raise RuntimeError("cannot read the cache")

    async def run() -> list[BaseException | None]:
        with ThreadPoolExecutor(max_workers=1) as executor:
            scheduler = Scheduler(BrokenRunner(0.0), executor, SchedulerLimits(max_batch_sessions=4))
            calls = [scheduler.submit(BlockToVerify(f"s{n}", [1, 2], [3], None, GREEDY), time.perf_counter()) for n in range(3)]
            outcomes = await asyncio.wait_for(asyncio.gather(*calls, return_exceptions=True), timeout=10)
            again = await asyncio.wait_for(
                asyncio.gather(scheduler.submit(BlockToVerify("t", [1], [], None, GREEDY), 0.0), return_exceptions=True), 10
            )
            await scheduler.aclose()
        return [*outcomes, *again]

    outcomes = asyncio.run(run())
    assert len(outcomes) == 4 and all(isinstance(outcome, RuntimeError) for outcome in outcomes)
