"""Prefix reuse in the llama.cpp drafter, on a real GGUF (SmolLM2-135M Q4_1, one thread): a
session starts from the longest prefix a live or retained sequence of its owner holds and decodes
only the rest; the drafts stay llama.cpp's own greedy continuation; cells shared by several
sequences count once against the bound, and freeing one sequence keeps what others hold;
retained prefixes leave least recently used first; owners never share."""

from __future__ import annotations

import pytest

from edge_agent.llamacpp_drafter import LlamaCppDrafter, load_llamacpp_draft
from llamacpp_support import Reference
from spade_core.params import SamplingConfig
from spade_models.loader import ModelSource

GREEDY = SamplingConfig(temperature=0)
SYSTEM = "You are a careful assistant. Answer briefly, cite sources, and never guess. " * 6
QUESTIONS = ["What is the capital of France?", "How do magnets work?", "Name three prime numbers."]


@pytest.fixture(scope="module")
def draft(small_gguf):
    return load_llamacpp_draft(ModelSource(small_gguf))


@pytest.fixture(scope="module")
def reference(draft) -> Reference:
    return Reference(draft)


@pytest.fixture(scope="module")
def system_ids(draft) -> list[int]:
    return draft.tokenizer(SYSTEM).input_ids


@pytest.fixture(scope="module")
def questions(draft) -> list[list[int]]:
    return [draft.tokenizer(" " + text).input_ids for text in QUESTIONS]


def _drafts(drafter: LlamaCppDrafter, context: list[int], num_tokens: int = 6, owner: str = "") -> tuple[list[int], int, int]:
    """(drafted tokens, tokens decoded, tokens reused) of one closed session's single proposal."""
    session = drafter.start_session(owner)
    decoded_before = drafter.num_decoded_tokens
    try:
        token_ids = session.propose(context, num_tokens, GREEDY).token_ids
    finally:
        session.close()
    return token_ids, drafter.num_decoded_tokens - decoded_before, session.num_cached_tokens


def test_a_new_session_starts_from_a_finished_ones_prefix_and_drafts_the_same(draft, reference, system_ids, questions):
    drafter = LlamaCppDrafter(draft, 1024, threads=1, max_sessions=2)
    try:
        first = system_ids + questions[0]
        assert _drafts(drafter, first) == (reference.greedy(first, 6), len(first) + 5, 0)
        second = system_ids + questions[1]
        shared = len(system_ids)
        assert second[shared] != first[shared]
        token_ids, num_decoded, num_reused = _drafts(drafter, second)
        assert (num_reused, num_decoded) == (shared, len(second) - shared + 5)
        assert token_ids == reference.greedy(second, 6)
    finally:
        drafter.close()


def test_greedy_drafts_are_identical_with_reuse_on_and_off(draft, system_ids, questions):
    """Several sessions, live and finished, drafting blocks for contexts that share a prefix."""
    outputs = []
    for max_retained in (0, 4):
        drafter = LlamaCppDrafter(draft, 1024, threads=1, max_sessions=2, max_retained=max_retained)
        try:
            contexts = [system_ids + question for question in questions + questions[:1]]
            drafted = []
            for context in contexts:
                session = drafter.start_session()
                for _ in range(3):
                    context = context + session.propose(context, 4, GREEDY).token_ids
                drafted.append(context)
                session.close()
            outputs.append(drafted)
        finally:
            drafter.close()
    assert outputs[0] == outputs[1]


def test_a_live_sessions_prefix_is_shared_and_never_disturbed(draft, reference, system_ids, questions):
    drafter = LlamaCppDrafter(draft, 1024, threads=1, max_sessions=2)
    first, second = drafter.start_session(), drafter.start_session()
    try:
        first_context = system_ids + questions[0]
        first_context += first.propose(first_context, 4, GREEDY).token_ids
        second_context = system_ids + questions[2]
        second_context += second.propose(second_context, 4, GREEDY).token_ids
        assert second.num_cached_tokens == len(system_ids)
        for _ in range(2):
            first_context += first.propose(first_context, 4, GREEDY).token_ids
            second_context += second.propose(second_context, 4, GREEDY).token_ids
        assert first_context[len(system_ids) + len(questions[0]) :] == reference.greedy(system_ids + questions[0], 12)
        assert second_context[len(system_ids) + len(questions[2]) :] == reference.greedy(system_ids + questions[2], 12)
    finally:
        first.close()
        second.close()
        drafter.close()


def test_shared_cells_count_once_against_the_bound(draft, reference, system_ids, questions):
    """256 cells; three sessions over a ~100-token system prompt would need ~330 unshared, so
    counting one owner per cell would drop the others' caches; shared, they fit. Dropping the
    first one's retained sequence then frees its own cells only."""
    drafter = LlamaCppDrafter(draft, 256, threads=1, max_sessions=3, max_retained=1)
    sessions = [drafter.start_session() for _ in questions]
    try:
        contexts = [system_ids + question for question in questions]
        assert sum(len(context) + 3 for context in contexts) > drafter.n_ctx
        blocks = [session.propose(context, 4, GREEDY).token_ids for session, context in zip(sessions, contexts, strict=True)]
        own_cells = [len(context) - len(system_ids) + 3 for context in contexts]
        assert drafter.num_used_cells == len(system_ids) + sum(own_cells)
        assert [session.cached_token_ids for session in sessions] == [c + b[:3] for c, b in zip(contexts, blocks, strict=True)]
        sessions[0].close()  # retained: nothing freed yet
        assert (drafter.num_retained, drafter.num_used_cells) == (1, len(system_ids) + sum(own_cells))
        # A context that fits only once the retained sequence's own cells are freed:
        num_unrelated = drafter.n_ctx - drafter.num_used_cells + own_cells[0] - 3
        unrelated = draft.tokenizer("alpha beta gamma delta epsilon zeta eta theta " * 30).input_ids[:num_unrelated]
        _drafts(drafter, unrelated, 4)
        assert drafter.num_used_cells == drafter.n_ctx
        decoded_before = drafter.num_decoded_tokens
        assert sessions[1].propose(contexts[1] + blocks[1], 4, GREEDY).token_ids == reference.greedy(contexts[1] + blocks[1], 4)
        assert drafter.num_decoded_tokens - decoded_before == 1 + 3  # its cache, the shared prompt's cells included, survived
    finally:
        for session in sessions:
            session.close()
        drafter.close()
    assert drafter.num_used_cells == 0


def test_retained_prefixes_leave_least_recently_used_first_when_room_is_needed(draft, reference, system_ids, questions):
    drafter = LlamaCppDrafter(draft, 256, threads=1, max_sessions=1, max_retained=2)
    try:
        unrelated = draft.tokenizer("alpha beta gamma delta epsilon zeta eta theta " * 12).input_ids[:100]
        _drafts(drafter, unrelated, 2)
        _drafts(drafter, system_ids + questions[0], 2)
        assert drafter.num_retained == 2
        _drafts(drafter, unrelated[:60] + questions[1], 2)  # reuses (touches) the unrelated prefix
        assert drafter.num_retained == 2  # the bound: the least recent (the system prompt's) went
        long_context = draft.tokenizer("one two three four five six seven eight nine ten " * 20).input_ids[:150]
        session = drafter.start_session()
        try:
            assert session.propose(long_context, 4, GREEDY).token_ids == reference.greedy(long_context, 4)
            assert drafter.num_used_cells <= drafter.n_ctx
            assert drafter.num_retained == 1  # room made by dropping the least recent retained one only
            assert drafter.num_used_cells == len(unrelated[:60] + questions[1]) + 1 + len(long_context) + 3
        finally:
            session.close()
    finally:
        drafter.close()


def test_owners_never_share_a_prefix(draft, system_ids, questions):
    drafter = LlamaCppDrafter(draft, 1024, threads=1, max_sessions=2, max_retained=4)
    try:
        _drafts(drafter, system_ids + questions[0], 2, owner="key-a|")
        assert _drafts(drafter, system_ids + questions[1], 2, owner="key-b|")[2] == 0
        assert _drafts(drafter, system_ids + questions[1], 2, owner="key-a|salt")[2] == 0
        assert _drafts(drafter, system_ids + questions[2], 2, owner="key-a|")[2] == len(system_ids)
    finally:
        drafter.close()


def test_a_closed_or_cancelled_session_frees_its_slot_and_its_retained_sequence_goes_when_ids_run_out(draft, system_ids, questions):
    drafter = LlamaCppDrafter(draft, 1024, threads=1, max_sessions=1, max_retained=1)
    try:
        for question in questions:
            session = drafter.start_session()  # refused (429) if the last one still held its slot
            session.propose(system_ids + question, 2, GREEDY)
            session.close()
            assert (drafter.num_sessions, drafter.num_retained) == (0, 1)
        assert drafter.num_used_cells == len(system_ids + questions[-1]) + 1
    finally:
        drafter.close()
