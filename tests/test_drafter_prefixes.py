"""Prefix reuse in the transformers drafter (tiny draft model): a session starts from a copy of
the longest prefix a live or retained cache of its owner holds and feeds only the rest; greedy
drafts are the same with reuse on and off; the copy is never the source's own tensors; retained
caches stay within their token bound, least recently used out first; owners never share."""

from __future__ import annotations

import pytest
import torch

from edge_agent.drafter import ModelDrafter, ModelDraftSession
from spade_core.params import SamplingConfig
from spade_models.kv_cache import common_prefix_length

GREEDY = SamplingConfig(temperature=0)


@pytest.fixture(scope="module")
def system_ids(draft_model) -> list[int]:
    return draft_model.tokenizer.encode("You are a helpful assistant who answers every question in one sentence.")


@pytest.fixture(scope="module")
def questions(draft_model) -> list[list[int]]:
    return [draft_model.tokenizer.encode(text) for text in (" Why is the sky blue?", " How far is the moon?", " Who wrote Hamlet?")]


def _chat(drafter: ModelDrafter, contexts: list[list[int]], owner: str = "") -> list[list[int]]:
    """Each context drafted for in three blocks of 3 by its own session, closed after."""
    outputs = []
    for context in contexts:
        session = drafter.start_session(owner)
        for _ in range(3):
            context = context + session.propose(context, 3, GREEDY).token_ids
        session.close()
        outputs.append(context)
    return outputs


def test_greedy_drafts_are_identical_with_reuse_on_and_off(draft_model, system_ids, questions):
    contexts = [system_ids + question for question in questions]
    contexts.append(_chat(ModelDrafter(draft_model, max_retained_tokens=0), contexts[:1])[0] + questions[1])  # a second turn
    without_reuse = _chat(ModelDrafter(draft_model, max_retained_tokens=0), contexts)
    with_reuse = _chat(ModelDrafter(draft_model), contexts)
    assert with_reuse == without_reuse


def _shared(first: list[int], second: list[int]) -> int:
    return common_prefix_length(first, second)


def test_a_new_session_feeds_only_what_a_retained_prefix_does_not_hold(draft_model, system_ids, questions, monkeypatch):
    drafter = ModelDrafter(draft_model)
    _chat(drafter, [system_ids + questions[0]])
    fed: list[int] = []
    forward = ModelDraftSession._forward
    monkeypatch.setattr(ModelDraftSession, "_forward", lambda self, entry, ids: fed.append(len(ids)) or forward(self, entry, ids))
    session = drafter.start_session()
    context = system_ids + questions[1]
    session.propose(context, 3, GREEDY)
    shared = _shared(system_ids + questions[0], context)
    assert shared >= len(system_ids)
    assert (session.num_cached_tokens, fed) == (shared, [len(context) - shared, 1, 1])


def test_a_copied_prefix_never_shares_tensors_with_its_source(draft_model, system_ids, questions):
    drafter = ModelDrafter(draft_model)
    first, second = drafter.start_session(), drafter.start_session()
    first.propose(system_ids + questions[0], 3, GREEDY)
    source_keys = [layer.keys.clone() for layer in first.entry.cache.layers]
    second.propose(system_ids + questions[1], 5, GREEDY)
    assert second.num_cached_tokens == _shared(system_ids + questions[0], system_ids + questions[1])
    for layer, other, kept in zip(first.entry.cache.layers, second.entry.cache.layers, source_keys, strict=True):
        assert layer.keys.data_ptr() != other.keys.data_ptr()
        assert torch.equal(layer.keys, kept)  # the source is untouched by the copy's growth


def test_retained_caches_stay_within_their_token_bound_least_recent_out_first(draft_model, system_ids, questions):
    one_chat = len(system_ids) + max(len(question) for question in questions) + 8
    drafter = ModelDrafter(draft_model, max_retained_tokens=2 * one_chat)
    _chat(drafter, [system_ids + questions[0]], owner="a")
    _chat(drafter, [system_ids + questions[1]], owner="b")
    _chat(drafter, [system_ids + questions[2]], owner="a")  # copies from the first: the most recent now
    assert drafter.num_retained_tokens <= 2 * one_chat
    probe = drafter.start_session("b")
    probe.propose(system_ids + questions[0], 1, GREEDY)
    assert probe.num_cached_tokens == 0  # b's cache was the least recently used: dropped


def test_owners_never_share_a_prefix(draft_model, system_ids, questions):
    drafter = ModelDrafter(draft_model)
    _chat(drafter, [system_ids + questions[0]], owner="key-a|")
    shared = _shared(system_ids + questions[0], system_ids + questions[1])
    for owner, expected in (("key-b|", 0), ("key-a|salt", 0), ("key-a|", shared)):
        session = drafter.start_session(owner)
        session.propose(system_ids + questions[1], 1, GREEDY)
        assert session.num_cached_tokens == expected
