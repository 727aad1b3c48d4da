"""The one-hot acceptance micro-benchmark's pure parts (``spade_bench.micro.onehot_acceptance``)."""

from __future__ import annotations

import pytest
import torch

from spade_bench.micro.onehot_acceptance import rule_acceptances, tokens_per_forward


def test_each_rule_is_the_acceptance_of_its_own_draws():
    target_probs = torch.tensor([[0.6, 0.4], [0.1, 0.9]])
    draft_probs = torch.tensor([[0.5, 0.5], [0.8, 0.2]])
    acceptances = rule_acceptances(target_probs, draft_probs)
    assert acceptances["min(p,q)"] == pytest.approx([0.9, 0.3])
    assert acceptances["p.q"] == pytest.approx([0.5, 0.26])
    assert acceptances["p(argmax q)"] == pytest.approx([0.6, 0.1])


def test_sampled_drafts_verified_one_hot_never_beat_the_rule_with_q_but_greedy_drafts_can():
    # p.q <= min(p, q) * max(p, q) <= min(p, q) token by token; p(argmax q) has no such bound:
    # with p = [1, 0] and q = [0.5, 0.5] it is 1 against 0.5.
    generator = torch.Generator().manual_seed(3)
    target_probs = torch.softmax(torch.randn(200, 50, generator=generator) * 2, -1)
    draft_probs = torch.softmax(torch.randn(200, 50, generator=generator) * 2, -1)
    acceptances = rule_acceptances(target_probs, draft_probs)
    assert all(one_hot <= exact + 1e-6 for one_hot, exact in zip(acceptances["p.q"], acceptances["min(p,q)"], strict=True))
    peaked = rule_acceptances(torch.tensor([[1.0, 0.0]]), torch.tensor([[0.5, 0.5]]))
    assert (peaked["p(argmax q)"], peaked["min(p,q)"]) == (pytest.approx([1.0]), pytest.approx([0.5]))


def test_tokens_per_forward_runs_the_acceptances_along_the_path():
    assert tokens_per_forward([1.0, 0.5, 0.0], 2) == pytest.approx((2.5 + 1.5 + 1.0) / 3)
    assert tokens_per_forward([1.0] * 10, 4) == pytest.approx((5 * 7 + 4 + 3 + 2) / 10)
    assert tokens_per_forward([0.0] * 5, 8) == 1.0
