"""The llama.cpp drafter on a real GGUF (SmolLM2-135M Q4_1, one thread): the same proposals as
llama.cpp's own greedy decoding, whatever the cache held before; sampled tokens drawn from
exactly the distribution sent; sessions isolated, bounded and freed. Also which backend
``--draft-backend`` picks, as a pure function."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from edge_agent.draft_backend import LLAMACPP, TRANSFORMERS, choose_draft_backend
from edge_agent.drafter import DraftLimits
from edge_agent.llamacpp_drafter import LlamaCppDrafter, default_threads, load_llamacpp_draft
from gateway.errors import InvalidRequestError, OverloadedError
from llamacpp_support import Reference
from spade_core.params import SamplingConfig
from spade_core.sampling import position_uniforms, processed_probs, sample_from, truncate_to_top_n
from spade_models.loader import ModelSource

GREEDY = SamplingConfig(temperature=0)
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,"]


@pytest.fixture(scope="module")
def draft(small_gguf):
    return load_llamacpp_draft(ModelSource(small_gguf))


@pytest.fixture(scope="module")
def drafter(draft):
    """Prefix reuse off: these tests count what each session decodes itself, and compare logits
    bitwise with a fresh context's (a prefix decoded in another batch differs in the last bits:
    llama.cpp's CPU kernels are not batch-invariant). Reuse: tests/test_llamacpp_prefixes.py."""
    return LlamaCppDrafter(draft, 1024, threads=1, max_sessions=4, max_retained=0)


@pytest.fixture(scope="module")
def prompts(draft) -> list[list[int]]:
    return [draft.tokenizer(text).input_ids for text in PROMPTS]


@pytest.fixture(scope="module")
def reference(draft) -> Reference:
    return Reference(draft)


def test_greedy_blocks_are_llama_cpps_own_greedy_continuation(drafter, prompts, reference):
    session = drafter.start_session()
    try:
        for prompt in prompts:
            assert session.propose(prompt, 8, GREEDY).token_ids == reference.greedy(prompt, 8)
    finally:
        session.close()


def test_the_cache_ends_one_short_of_the_block_and_matches_llama_cpps_state(drafter, prompts):
    session = drafter.start_session()
    try:
        block = session.propose(prompts[0], 5, GREEDY)
        assert session.cached_token_ids == prompts[0] + block.token_ids[:-1]
        assert session.num_kv_tokens == len(prompts[0]) + 4
    finally:
        session.close()


@pytest.mark.parametrize("kept", [0, 1, 4, 7], ids=lambda kept: f"keep-{kept}")
def test_a_context_diverging_from_the_cache_drafts_what_a_fresh_session_drafts(drafter, prompts, reference, kept):
    """The cache holds prompt + block; the next context keeps only part of that, then differs
    (a verdict that rejected drafts, or another request's text)."""
    session = drafter.start_session()
    try:
        block = session.propose(prompts[2], 6, GREEDY)
        context = (prompts[2] + block.token_ids)[: len(prompts[2]) - 4 + kept] + prompts[1][:3]
        assert session.propose(context, 6, GREEDY).token_ids == reference.greedy(context, 6)
        assert session.cached_token_ids == context + reference.greedy(context, 6)[:5]
        assert session.num_kv_tokens == len(session.cached_token_ids)
    finally:
        session.close()


def test_a_context_that_is_a_prefix_of_the_cache_is_drafted_again_correctly(drafter, prompts, reference):
    session = drafter.start_session()
    try:
        session.propose(prompts[1], 8, GREEDY)
        shorter = prompts[1][:-2]
        assert session.propose(shorter, 4, GREEDY).token_ids == reference.greedy(shorter, 4)
    finally:
        session.close()


def test_one_token_proposals_chained_equal_one_block_and_decode_one_token_each(drafter, prompts):
    block = drafter.start_session()
    chained = drafter.start_session()
    try:
        expected = block.propose(prompts[0], 6, GREEDY).token_ids
        context = list(prompts[0])
        decoded_before = drafter.num_decoded_tokens
        context += chained.propose(context, 1, GREEDY).token_ids
        assert drafter.num_decoded_tokens - decoded_before == len(prompts[0])
        for _ in range(5):
            decoded_before = drafter.num_decoded_tokens
            context += chained.propose(context, 1, GREEDY).token_ids
            assert drafter.num_decoded_tokens - decoded_before == 1
        assert context[len(prompts[0]) :] == expected
    finally:
        block.close()
        chained.close()


def test_drafting_past_a_block_feeds_only_its_last_token_and_the_guess(drafter, prompts):
    """The overlap pattern: propose(context + block + [guess], n) while the block is verified."""
    session = drafter.start_session()
    try:
        block = session.propose(prompts[1], 4, GREEDY).token_ids
        guess = 13
        decoded_before = drafter.num_decoded_tokens
        session.propose(prompts[1] + block + [guess], 3, GREEDY)
        assert drafter.num_decoded_tokens - decoded_before == 2 + 2
    finally:
        session.close()


def test_two_interleaved_sessions_do_not_disturb_each_other(drafter, prompts, reference):
    first, second = drafter.start_session(), drafter.start_session()
    try:
        first_context, second_context = list(prompts[0]), list(prompts[2])
        for _ in range(3):
            first_context += first.propose(first_context, 3, GREEDY).token_ids
            second_context += second.propose(second_context, 3, GREEDY).token_ids
        assert first_context[len(prompts[0]) :] == reference.greedy(prompts[0], 9)
        assert second_context[len(prompts[2]) :] == reference.greedy(prompts[2], 9)
    finally:
        first.close()
        second.close()


def test_a_sampled_token_is_drawn_from_exactly_the_distribution_sent(drafter, prompts, reference):
    sampling = SamplingConfig(temperature=0.8, top_k=50, top_p=0.95, seed=11)
    session = drafter.start_session()
    try:
        block = session.propose(prompts[0], 4, sampling)
    finally:
        session.close()
    uniforms = position_uniforms(sampling.seed, len(prompts[0]), 4, stream="draft")
    assert len(block.probs) == 4
    for index, (token_id, distribution) in enumerate(zip(block.token_ids, block.probs, strict=True)):
        logits = torch.from_numpy(reference.logits_after(prompts[0] + block.token_ids[:index]))
        support_ids, support_probs = truncate_to_top_n(processed_probs(logits, sampling), drafter.limits.max_support)
        assert (distribution.token_ids, distribution.probs) == (support_ids.tolist(), support_probs.tolist())
        assert token_id == int(support_ids[sample_from(support_probs, float(uniforms[index, 0]))])
        assert token_id in distribution.token_ids


def test_no_token_at_or_beyond_the_vocab_limit_is_drafted(draft, prompts, reference):
    limit = 500  # SmolLM2's greedy continuation of these prompts uses higher ids
    unrestricted = reference.greedy(prompts[0], 6)
    assert max(unrestricted) >= limit
    limited = LlamaCppDrafter(draft, 256, threads=1, max_sessions=1, limits=DraftLimits(vocab_limit=limit))
    session = limited.start_session()
    try:
        greedy = session.propose(prompts[0], 6, GREEDY)
        sampled = session.propose(prompts[0], 6, SamplingConfig(temperature=1.5, seed=2))
    finally:
        limited.close()
    assert greedy.token_ids[0] == int(np.argmax(reference.logits_after(prompts[0])[:limit]))
    assert max(greedy.token_ids + sampled.token_ids) < limit
    assert all(max(distribution.token_ids) < limit for distribution in sampled.probs)


def test_sessions_are_bounded_and_close_frees_their_cache_and_their_slot(draft, prompts):
    bounded = LlamaCppDrafter(draft, 256, threads=1, max_sessions=2, max_retained=0)
    try:
        first, second = bounded.start_session(), bounded.start_session()
        with pytest.raises(OverloadedError, match="all 2 llama.cpp draft sessions are in use"):
            bounded.start_session()
        first.propose(prompts[0], 3, GREEDY)
        assert first.num_kv_tokens == len(prompts[0]) + 2
        first.close()
        first.close()  # idempotent
        assert (first.cached_token_ids, first.num_kv_tokens, bounded.num_sessions) == ([], 0, 1)
        third = bounded.start_session()
        assert third.seq_id == first.seq_id and third.num_kv_tokens == 0
        with pytest.raises(RuntimeError, match="closed"):
            first.propose(prompts[0], 1, GREEDY)
        second.close()
        third.close()
    finally:
        bounded.close()


def test_a_full_cache_drops_the_other_sessions_which_still_draft_correctly(draft, reference):
    small = LlamaCppDrafter(draft, 256, threads=1, max_sessions=2)  # 256 cells for both
    long_context = draft.tokenizer("one two three four five six seven eight nine ten " * 30).input_ids[:140]
    other_context = draft.tokenizer("alpha beta gamma delta epsilon zeta eta theta " * 30).input_ids[:120]
    assert (len(long_context), len(other_context)) == (140, 120)  # 143 + 123 cached > 256
    try:
        first, second = small.start_session(), small.start_session()
        before_eviction = first.propose(long_context, 4, GREEDY).token_ids
        assert second.propose(other_context, 4, GREEDY).token_ids == reference.greedy(other_context, 4)
        assert (first.cached_token_ids, first.num_kv_tokens) == ([], 0)
        assert first.propose(long_context, 4, GREEDY).token_ids == before_eviction
    finally:
        small.close()


def test_a_closed_drafter_refuses_instead_of_crashing(draft, prompts):
    closing = LlamaCppDrafter(draft, 256, threads=1, max_sessions=1)
    session = closing.start_session()
    closing.close()
    with pytest.raises(RuntimeError, match="closed"):
        session.propose(prompts[0], 2, GREEDY)
    with pytest.raises(RuntimeError, match="closed"):
        closing.start_session()
    session.close()


def test_contexts_that_cannot_be_drafted_are_refused_clearly(drafter):
    session = drafter.start_session()
    try:
        with pytest.raises(InvalidRequestError, match="empty context"):
            session.propose([], 3, GREEDY)
        with pytest.raises(InvalidRequestError, match="holds 1024 tokens; this block needs 1027"):
            session.propose([1] * 1025, 3, GREEDY)
    finally:
        session.close()


# --- which backend ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("requested", "model", "gguf_file", "device", "available", "expected"),
    [
        ("auto", "smollm2-135m-instruct", None, "cpu", True, LLAMACPP),
        ("auto", "/models/draft.gguf", None, "cpu", True, LLAMACPP),
        ("auto", "/models/dir", "draft.gguf", "cpu", True, LLAMACPP),
        ("auto", "smollm2-135m-instruct", None, "cpu", False, TRANSFORMERS),
        ("auto", "smollm2-135m-instruct", None, "cuda", True, TRANSFORMERS),
        ("auto", "/models/checkpoint-dir", None, "cpu", True, TRANSFORMERS),
        ("transformers", "smollm2-135m-instruct", None, "cpu", True, TRANSFORMERS),
        ("llamacpp", "smollm2-135m-instruct", None, "cpu", True, LLAMACPP),
    ],
)
def test_choose_draft_backend(requested, model, gguf_file, device, available, expected):
    backend, why = choose_draft_backend(requested, ModelSource(model, gguf_file), device, available)
    assert backend == expected and why


@pytest.mark.parametrize(
    ("model", "available", "message"),
    [("/models/checkpoint-dir", True, "needs a GGUF draft"), ("smollm2-135m-instruct", False, "needs cyllama==0.2.18")],
)
def test_an_explicit_llamacpp_backend_that_cannot_run_is_refused(model, available, message):
    with pytest.raises(ValueError, match=message):
        choose_draft_backend("llamacpp", ModelSource(model), "cpu", available)


@pytest.mark.parametrize(("cores", "threads"), [(1, 1), (2, 1), (3, 1), (4, 2), (8, 4), (64, 4)])
def test_default_threads_are_half_the_cores_from_one_to_four(cores, threads):
    assert default_threads(cores) == threads
