"""Reading vLLM's FlatLogprobs (``backends.vllm.requests``) without vLLM: each position lists the
chosen token, then the top-N in rank order; vLLM 0.32's decode loop sometimes lists a rank-1
chosen token once instead of twice, and both shapes read the same."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from verifier_service.backends.vllm.requests import chosen_logprob, top_entries


def flat(*positions: list[tuple[int, float, int]]) -> SimpleNamespace:
    """A FlatLogprobs of (token id, logprob, rank) entries per position."""
    starts, token_ids, logprobs, ranks = [], [], [], []
    for entries in positions:
        starts.append(len(token_ids))
        for token_id, logprob, rank in entries:
            token_ids.append(token_id)
            logprobs.append(logprob)
            ranks.append(rank)
    ends = starts[1:] + [len(token_ids)]
    return SimpleNamespace(start_indices=starts, end_indices=ends, token_ids=token_ids, logprobs=logprobs, ranks=ranks)


TOP = [(5, -0.1, 1), (7, -2.0, 2), (9, -3.0, 3)]


def test_the_chosen_token_listed_twice_or_once_reads_the_same():
    listed_twice = flat([(5, -0.1, 1), *TOP])
    listed_once = flat(TOP)
    for logprobs in (listed_twice, listed_once):
        assert top_entries(logprobs, 0, 3) == [(5, -0.1), (7, -2.0), (9, -3.0)]
        assert chosen_logprob(logprobs, 0, 5) == -0.1


def test_a_chosen_token_outside_the_top_is_listed_first_and_not_an_alternative():
    logprobs = flat([(11, -4.0, 6), *TOP], TOP)
    assert top_entries(logprobs, 0, 3) == [(5, -0.1), (7, -2.0), (9, -3.0)]
    assert chosen_logprob(logprobs, 0, 11) == -4.0
    assert top_entries(logprobs, 1, 2) == [(5, -0.1), (7, -2.0)]  # fewer than listed: the most likely


def test_too_few_entries_or_an_unlisted_token_is_an_error():
    with pytest.raises(RuntimeError, match="alternatives"):
        top_entries(flat(TOP[:2]), 0, 3)
    with pytest.raises(RuntimeError, match="chosen token"):
        chosen_logprob(flat(TOP), 0, 99)
