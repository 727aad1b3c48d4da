"""Shared prefixes on the transformers backend (``prefix_cache``): a session without a cache
starts from a copy of the longest prefix another session of its namespace cached, live or
ended, and feeds only the rest.

Exactness: in batch-invariant mode every verdict, logprob and alternative is bitwise the one
the backend gives with no prefix store, whether the prefix came from a live session, a retained
one, or the remainder was fed in chunks; a prefix shared by sessions is never changed by one of
them (each holds its own copy)."""

from __future__ import annotations

import asyncio
import random

import pytest
import torch

from spade_core.params import SamplingConfig
from spade_models.loader import ModelSource, load_model
from verifier_service.backends.base import BlockToVerify, BlockVerdict
from verifier_service.backends.transformers.backend import TransformersBackend
from verifier_service.backends.transformers.plan import PendingCall, SchedulerLimits, waiting_for_shared_prefix
from verifier_service.kv_budget import DEFAULT_KV_CACHE_BYTES
from verifier_service.prefix_sharing import prefix_namespace
from verifier_support import random_tokens

GREEDY = SamplingConfig(temperature=0.0)
SEEDED = SamplingConfig(temperature=0.8, top_k=0, top_p=1.0, seed=11)
NAMESPACE = prefix_namespace("per-key", "", None)


@pytest.fixture(scope="module")
def invariant_backends(tiny_pair):
    """Factory of batch-invariant backends on a fresh tiny target, with or without a store."""

    def build(sharing: bool, **limits) -> TransformersBackend:
        loaded = load_model(ModelSource(str(tiny_pair.target_dir)))
        backend = TransformersBackend(loaded, batch_invariant="required", max_retained_kv_bytes=DEFAULT_KV_CACHE_BYTES if sharing else None)
        backend.configure(SchedulerLimits(**limits))
        return backend

    return build


def _block(session_id: str, context: list[int], drafts: list[int], sampling: SamplingConfig, namespace=NAMESPACE) -> BlockToVerify:
    return BlockToVerify(session_id, context, drafts, None, sampling, num_top_logprobs=3, cache_namespace=namespace)


async def _steps(backend, session_id: str, context: list[int], sampling, rng: random.Random, vocab_size: int, num_steps: int = 3):
    """A prompt-only call, then blocks of random drafts (mostly rejected: crops); the verdicts
    and the committed context."""
    verdicts: list[BlockVerdict] = []
    drafts: list[int] = []
    for _ in range(num_steps):
        verdict = await backend.verify_block(_block(session_id, context, drafts, sampling))
        verdicts.append(verdict)
        context = context + drafts[: verdict.num_accepted] + [verdict.next_token_id]
        drafts = random_tokens(rng, 3, vocab_size)
    return verdicts, context


def _outcome(verdicts: list[BlockVerdict]) -> list[tuple]:
    """What a client sees of the verdicts (bitwise: floats compared exactly)."""
    return [(v.num_accepted, v.next_token_id, v.logprobs, v.top_logprobs) for v in verdicts]


async def _conversation(backend, sampling, vocab_size: int) -> tuple[list[BlockVerdict], list[int]]:
    """Sessions sharing a 40-token prefix: A; B while A lives; A ended, then C continuing A's
    committed context (a chat's next turn); D with an unrelated prompt."""
    rng = random.Random(5)
    prefix = random_tokens(rng, 40, vocab_size)
    a_verdicts, a_context = await _steps(backend, "a", prefix + random_tokens(rng, 5, vocab_size), sampling, rng, vocab_size)
    b_verdicts, _ = await _steps(backend, "b", prefix + random_tokens(rng, 9, vocab_size), sampling, rng, vocab_size)
    backend.release_session("a")
    c_verdicts, _ = await _steps(backend, "c", a_context + random_tokens(rng, 4, vocab_size), sampling, rng, vocab_size)
    d_verdicts, _ = await _steps(backend, "d", random_tokens(rng, 30, vocab_size), sampling, rng, vocab_size)
    verdicts = a_verdicts + b_verdicts + c_verdicts + d_verdicts
    return verdicts, [verdict.num_cached_tokens for verdict in verdicts[::3]]


async def _run(backend, coroutine):
    try:
        return await coroutine
    finally:
        await backend.aclose()


@pytest.mark.parametrize("sampling", [GREEDY, SEEDED], ids=["greedy", "seeded"])
@pytest.mark.parametrize("max_forward_rows", [512, 8], ids=["whole", "chunked"])
def test_verdicts_are_bitwise_those_without_the_cache(invariant_backends, vocab_size, sampling, max_forward_rows):
    limits = {"max_forward_rows": max_forward_rows, "max_block_rows": 7}
    on = invariant_backends(True, **limits)
    off = invariant_backends(False, **limits)
    with_cache, cached_on = asyncio.run(_run(on, _conversation(on, sampling, vocab_size)))
    without, cached_off = asyncio.run(_run(off, _conversation(off, sampling, vocab_size)))
    assert _outcome(with_cache) == _outcome(without)
    # A: nothing cached; B: A's live 40-token prefix, found by its 2 whole blocks, then token by
    # token; C: A's retained cache, all of it (A's 48 committed tokens but the last, never fed);
    # D: nothing.
    assert cached_on == [0, 40, 47, 0] and cached_off == [0, 0, 0, 0]
    b_first = with_cache[3]
    assert b_first.num_target_tokens == 49 - 40  # the prompt's remainder only
    assert without[3].num_target_tokens == 49


def test_namespaces_do_not_share_and_a_call_without_one_shares_nothing(invariant_backends, vocab_size):
    backend = invariant_backends(True)
    prefix = random_tokens(random.Random(8), 40, vocab_size)

    async def scenario():
        await backend.verify_block(_block("a", prefix + [1], [], GREEDY))
        other_salt = await backend.verify_block(_block("b", prefix + [2], [], GREEDY, prefix_namespace("per-key", "", "salt")))
        other_key = await backend.verify_block(_block("c", prefix + [3], [], GREEDY, prefix_namespace("per-key", "key-2", None)))
        unshared = await backend.verify_block(_block("d", prefix + [4], [], GREEDY, None))
        same = await backend.verify_block(_block("e", prefix + [5], [], GREEDY))
        return [v.num_cached_tokens for v in (other_salt, other_key, unshared, same)]

    assert asyncio.run(_run(backend, scenario())) == [0, 0, 0, 40]


def test_a_shared_prefix_is_never_changed_by_a_session_holding_it(invariant_backends, vocab_size):
    # B starts from A's prefix; A then diverges inside that prefix (a resync with another
    # context crops A's cache into it and writes new rows there) and rejects drafts. B's rows
    # stay bitwise what they were, and its next verdicts are those of a backend without sharing.
    rng = random.Random(9)
    prefix = random_tokens(rng, 40, vocab_size)
    b_context = prefix + random_tokens(rng, 6, vocab_size)
    diverged = prefix[:20] + random_tokens(rng, 30, vocab_size)
    a_drafts = random_tokens(rng, 4, vocab_size)

    async def scenario(backend, check_rows: bool):
        await backend.verify_block(_block("a", prefix + [7], [], GREEDY))
        b_first = await backend.verify_block(_block("b", b_context, [], GREEDY))
        b_keys = backend._runner._caches["b"].cache.layers[0].keys.clone()
        await backend.verify_block(_block("a", diverged, a_drafts, GREEDY))
        if check_rows:
            assert b_first.num_cached_tokens == 40
            assert torch.equal(backend._runner._caches["b"].cache.layers[0].keys, b_keys)
        verdicts, _ = await _steps(backend, "b", b_context, GREEDY, random.Random(3), vocab_size)
        return verdicts

    on = invariant_backends(True)
    off = invariant_backends(False)
    assert _outcome(asyncio.run(_run(on, scenario(on, True)))) == _outcome(asyncio.run(_run(off, scenario(off, False))))


def test_an_ended_session_is_retained_within_its_bound_least_recently_used_out(invariant_backends, vocab_size):
    backend = invariant_backends(True)
    rng = random.Random(12)
    prompts = [random_tokens(rng, 40, vocab_size) for _ in range(3)]

    async def scenario():
        for index, prompt in enumerate(prompts):
            await backend.verify_block(_block(f"s{index}", prompt, [], GREEDY))
        backend.limit_retained(90)  # room for two of the three 41-token caches
        for index in range(3):
            backend.release_session(f"s{index}")
        await asyncio.sleep(0)
        again = [await backend.verify_block(_block(f"t{index}", prompt + [1], [], GREEDY)) for index, prompt in enumerate(prompts)]
        return [verdict.num_cached_tokens for verdict in again]

    hits = asyncio.run(_run(backend, scenario()))
    assert hits == [0, 40, 40]  # s0 went first (least recently used) when s2 was retained


@pytest.mark.parametrize("max_forward_rows", [512, 16], ids=["whole", "chunked"])
def test_users_of_one_prefix_arriving_together_prefill_it_once(invariant_backends, vocab_size, max_forward_rows):
    # Four sessions send one 64-token prefix with their own 5-token suffix at the same moment:
    # with sharing the first prefills the prefix and the others wait, then copy it and feed only
    # their suffix; without, each feeds all 69. Verdicts are bitwise the same either way.
    rng = random.Random(21)
    prefix = random_tokens(rng, 64, vocab_size)
    contexts = [prefix + random_tokens(rng, 5, vocab_size) for _ in range(4)]

    async def scenario(backend):
        rows: list[int] = []
        backend.observe_forwards(lambda record: rows.append(record.num_rows))
        blocks = [_block(f"u{index}", context, [], GREEDY) for index, context in enumerate(contexts)]
        verdicts = await asyncio.gather(*[backend.verify_block(block) for block in blocks])
        return list(verdicts), sum(rows)

    on = invariant_backends(True, max_forward_rows=max_forward_rows)
    off = invariant_backends(False, max_forward_rows=max_forward_rows)
    shared, rows_on = asyncio.run(_run(on, scenario(on)))
    alone, rows_off = asyncio.run(_run(off, scenario(off)))
    assert _outcome(shared) == _outcome(alone)
    assert [verdict.num_cached_tokens for verdict in shared] == [0, 64, 64, 64]
    assert rows_off == 4 * 69 and rows_on == 69 + 3 * 5


def test_only_a_new_cache_waits_and_only_for_a_longer_prefix_of_its_own_namespace():
    prefix = list(range(100, 164))
    other_namespace = prefix_namespace("per-key", "key-2", None)

    def call(session_id: str, context: list[int], namespace=NAMESPACE) -> PendingCall:
        return PendingCall(_block(session_id, context, [], GREEDY, namespace), 0.0, None)  # type: ignore[arg-type]

    leader, follower = call("a", prefix + [1]), call("b", prefix + [2])
    stranger, unshared, own_cache = call("c", prefix + [3], other_namespace), call("d", prefix + [4], None), call("e", prefix + [5])
    short = call("f", prefix[:10] + [6])  # shares less than a block more than it has
    queue = [leader, follower, stranger, unshared, own_cache, short]
    waiting = waiting_for_shared_prefix(queue, lambda block: 0, lambda session_id: session_id == "e")
    assert waiting == {id(follower)}

    # Once the leader's cache holds the shared 64 tokens, every call of its namespace can copy
    # them (the store's hit), and nobody waits.
    def copied(block) -> int:
        return 64 if block.cache_namespace == NAMESPACE and block.session_id != "f" else 0

    assert waiting_for_shared_prefix(queue, copied, lambda session_id: session_id == "a") == set()
