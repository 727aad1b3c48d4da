"""The acceptance rule (spade_core.acceptance) and the sampling transform (spade_core.sampling),
pure: tensors in, tensors out. Tested four ways, as vLLM tests its rejection sampler: forced
outcomes from hand-made distributions, seeded determinism, distribution equality with a fixed
tolerance, and vocabulary bounds.

Distribution tests need 2·10^5 trials per setting; one accept_block call costs ~50 µs, so most of
them run ``accept_blocks``, a vectorised copy of the rule over a batch of independent blocks, and
``test_vectorised_rule_equals_accept_block_trial_by_trial`` pins it to accept_block (same blocks,
same uniforms, same answers). One setting also runs the full 2·10^5 trials through accept_block.
"""

from __future__ import annotations

import pytest
import torch

from spade_core.acceptance import Acceptance, accept_block, residual_distribution
from spade_core.params import SamplingConfig
from spade_core.sampling import one_hot_argmax, position_uniforms, processed_probs, sample_from, truncate_to_top_n

XDIST_HEAVY = True
"""One statistical test takes half a minute: queued first (conftest.py)."""

VOCAB = 8
NUM_TRIALS = 200_000
MAX_TOTAL_VARIATION = 0.01
LARGEST_UNIFORM = 1.0 - 2.0**-53  # the largest float64 below 1

SETTINGS = [
    SamplingConfig(temperature=1.0),
    SamplingConfig(temperature=0.7, top_k=4),
    SamplingConfig(temperature=1.3, top_p=0.8),
    SamplingConfig(temperature=0.5, top_k=6, top_p=0.9),
]
SETTING_IDS = ["plain", "top_k", "top_p", "top_k_top_p"]


def probs(*values: float) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32)


def ids(*values: int) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.long)


def uniforms(*rows: tuple[float, float]) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.float64)


def one_hot(token_id: int, vocab: int = 4) -> torch.Tensor:
    return torch.nn.functional.one_hot(torch.tensor(token_id), vocab).float()


def total_variation(first: torch.Tensor, second: torch.Tensor) -> float:
    return 0.5 * float((first.double() - second.double()).abs().sum())


def empirical(token_ids: torch.Tensor, vocab: int) -> torch.Tensor:
    return torch.bincount(token_ids, minlength=vocab).double() / token_ids.numel()


# --- a vectorised copy of the rule, for 2·10^5 trials -----------------------------------------


def accept_blocks(
    draft_ids: torch.Tensor,  # [n, d] int64
    draft_probs: torch.Tensor | None,  # [n, d, vocab]; None = one-hot drafts
    target_probs: torch.Tensor,  # [n, d + 1, vocab]
    draws: torch.Tensor,  # [n, d + 1, 2] float64
) -> tuple[torch.Tensor, torch.Tensor]:
    """accept_block over n independent blocks -> (num_accepted [n], next_token_ids [n])."""
    num_blocks, num_drafted = draft_ids.shape
    vocab = target_probs.shape[-1]
    rows = torch.arange(num_blocks)
    target_at_drafted = target_probs[:, :num_drafted].gather(-1, draft_ids[..., None])[..., 0].double()
    if draft_probs is None:
        draft_probs = torch.nn.functional.one_hot(draft_ids, vocab).float()
    draft_at_drafted = draft_probs.gather(-1, draft_ids[..., None])[..., 0].double()
    accepted = draws[:, :num_drafted, 0] * draft_at_drafted < target_at_drafted
    num_accepted = accepted.long().cumprod(dim=1).sum(dim=1)
    target_row = target_probs[rows, num_accepted].double()
    # Row d of the draft is padding (so num_accepted == d can index it); the bonus is drawn from
    # the target row itself, as accept_block does.
    draft_row = torch.cat([draft_probs, torch.zeros(num_blocks, 1, vocab)], dim=1)[rows, num_accepted].double()
    residual = (target_row - draft_row).clamp_min(0.0)
    residual_total = residual.sum(dim=-1, keepdim=True)
    residual = torch.where(residual_total > 0, residual / residual_total, target_row)
    is_bonus = (num_accepted == num_drafted)[:, None]
    next_from = torch.where(is_bonus, target_row, residual)
    return num_accepted, inverse_cdf(next_from, draws[rows, num_accepted, 1])


def inverse_cdf(distributions: torch.Tensor, draws: torch.Tensor) -> torch.Tensor:
    """sample_from over rows: [n, vocab] float64, [n] -> [n] token ids."""
    cdf = distributions.cumsum(dim=-1)
    index = torch.searchsorted(cdf, (draws * cdf[:, -1])[:, None], right=True)[:, 0]
    last_with_mass = (distributions > 0).long().cumsum(dim=-1).argmax(dim=-1)
    return torch.minimum(index, last_with_mass)


def random_setting_rows(config: SamplingConfig, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """(target p, draft q) over VOCAB tokens: each the request's transform of random logits."""
    target = processed_probs(torch.randn(VOCAB, generator=generator) * 1.5, config)
    draft = processed_probs(torch.randn(VOCAB, generator=generator) * 1.5, config)
    return target, draft


def first_emitted(target: torch.Tensor, draft: torch.Tensor, is_one_hot_draft: bool, generator: torch.Generator) -> torch.Tensor:
    """NUM_TRIALS one-token blocks drafted from ``draft`` -> the first emitted token of each."""
    drafted = torch.multinomial(draft, NUM_TRIALS, replacement=True, generator=generator)[:, None]
    draft_probs = None if is_one_hot_draft else draft.expand(NUM_TRIALS, 1, VOCAB)
    target_probs = target.expand(NUM_TRIALS, 2, VOCAB)
    draws = torch.rand(NUM_TRIALS, 2, 2, generator=generator, dtype=torch.float64)
    num_accepted, next_ids = accept_blocks(drafted, draft_probs, target_probs, draws)
    return torch.where(num_accepted == 1, drafted[:, 0], next_ids)


# --- forced outcomes --------------------------------------------------------------------------


def test_drafted_token_with_all_target_mass_is_accepted_even_with_the_largest_draw():
    target = torch.stack([one_hot(2), one_hot(0)])
    verdict = accept_block(ids(2), probs(0.1, 0.2, 0.3, 0.4)[None], target, uniforms((LARGEST_UNIFORM, 0.5), (0.5, 0.5)))
    assert verdict == Acceptance(num_accepted=1, next_token_id=0, is_bonus=True)


def test_drafted_token_with_zero_target_mass_is_rejected_even_with_the_smallest_draw():
    target = torch.stack([probs(0.5, 0.5, 0.0, 0.0), one_hot(3)])
    verdict = accept_block(ids(2), probs(0.0, 0.0, 1.0, 0.0)[None], target, uniforms((0.0, 0.0), (0.5, 0.5)))
    assert verdict == Acceptance(num_accepted=0, next_token_id=0, is_bonus=False)


def test_correction_is_drawn_from_the_residual_only():
    # p - q = (0, 0.5, -0.5, 0): token 0 has target mass but none left in the residual.
    target = torch.stack([probs(0.5, 0.5, 0.0, 0.0), one_hot(3)])
    draft = probs(0.5, 0.0, 0.5, 0.0)[None]
    corrections = {
        accept_block(ids(2), draft, target, uniforms((0.5, draw), (0.5, 0.5))).next_token_id
        for draw in torch.linspace(0.0, LARGEST_UNIFORM, 101).tolist()
    }
    assert corrections == {1}


def test_correction_follows_the_residual_by_inverse_cdf():
    # p (0.4, 0.4, 0.2, 0), q (0.2, 0, 0.8, 0): residual = norm((0.2, 0.4, 0, 0)) = (1/3, 2/3, 0, 0),
    # so draws below 1/3 give token 0 and the rest token 1.
    target = torch.stack([probs(0.4, 0.4, 0.2, 0.0), one_hot(3)])
    draft = probs(0.2, 0.0, 0.8, 0.0)[None]
    corrections = [
        accept_block(ids(2), draft, target, uniforms((LARGEST_UNIFORM, draw), (0.5, 0.5))).next_token_id
        for draw in (0.0, 0.3, 0.34, LARGEST_UNIFORM)
    ]
    assert corrections == [0, 0, 1, 1]


def test_all_accepted_draws_the_bonus_from_the_last_row():
    target = torch.stack([one_hot(1), one_hot(2), probs(0.25, 0.25, 0.5, 0.0)])
    bonuses = [
        accept_block(ids(1, 2), None, target, uniforms((0.5, 0.5), (0.5, 0.5), (0.0, draw))) for draw in (0.1, 0.3, 0.6, LARGEST_UNIFORM)
    ]
    assert bonuses == [Acceptance(2, token_id, is_bonus=True) for token_id in (0, 1, 2, 2)]


def test_block_ends_at_the_first_rejection_even_if_later_tokens_match():
    target = torch.stack([one_hot(1), one_hot(2), one_hot(3)])
    verdict = accept_block(ids(0, 2), None, target, uniforms((0.5, 0.5), (0.5, 0.5), (0.5, 0.5)))
    assert verdict == Acceptance(num_accepted=0, next_token_id=1, is_bonus=False)


def test_second_token_rejected_after_first_accepted():
    target = torch.stack([one_hot(1), one_hot(2), one_hot(3)])
    verdict = accept_block(ids(1, 0), None, target, uniforms((0.5, 0.5), (0.5, 0.5), (0.5, 0.5)))
    assert verdict == Acceptance(num_accepted=1, next_token_id=2, is_bonus=False)


GREEDY_LOGITS = torch.tensor([[0.0, 0.0, 0.0, 0.0, 9.0], [0.0, 5.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 2.0, 0.0]])
"""Three positions whose argmaxes are 4, 1, 3."""
EXTREME_DRAWS = uniforms((LARGEST_UNIFORM, 0.9), (LARGEST_UNIFORM, 0.9), (0.9, 0.9))


def test_greedy_target_rejects_at_the_first_drafted_token_that_is_not_the_argmax():
    target = processed_probs(GREEDY_LOGITS, SamplingConfig(temperature=0.0))
    assert accept_block(ids(4, 0), None, target, EXTREME_DRAWS) == Acceptance(1, 1, is_bonus=False)


def test_greedy_target_accepts_a_block_of_argmaxes_and_adds_the_next_argmax():
    target = processed_probs(GREEDY_LOGITS, SamplingConfig(temperature=0.0))
    assert accept_block(ids(4, 1), None, target, EXTREME_DRAWS) == Acceptance(2, 3, is_bonus=True)


def test_greedy_target_accepts_its_argmax_from_a_sampled_draft():
    target = processed_probs(GREEDY_LOGITS[1:], SamplingConfig(temperature=0.0))
    draft = probs(0.1, 0.6, 0.3, 0.0, 0.0)[None]
    assert accept_block(ids(1), draft, target, uniforms((LARGEST_UNIFORM, 0.0), (0.5, 0.5))).num_accepted == 1


def test_greedy_target_corrects_a_sampled_draft_to_the_argmax():
    target = processed_probs(GREEDY_LOGITS[1:], SamplingConfig(temperature=0.0))
    draft = probs(0.1, 0.6, 0.3, 0.0, 0.0)[None]
    assert accept_block(ids(2), draft, target, uniforms((0.0, 0.0), (0.5, 0.5))) == Acceptance(0, 1, is_bonus=False)


def test_missing_draft_probs_mean_one_hot_drafts():
    generator = torch.Generator().manual_seed(0)
    for _ in range(200):
        target = torch.softmax(torch.randn(3, VOCAB, generator=generator) * 2, dim=-1)
        drafted = torch.randint(VOCAB, (2,), generator=generator)
        draws = torch.rand(3, 2, generator=generator, dtype=torch.float64)
        one_hot_rows = torch.nn.functional.one_hot(drafted, VOCAB).float()
        assert accept_block(drafted, None, target, draws) == accept_block(drafted, one_hot_rows, target, draws)


def test_empty_block_draws_one_token_from_the_first_row():
    verdict = accept_block(ids(), None, probs(0.0, 0.5, 0.5, 0.0)[None], uniforms((0.0, 0.75)))
    assert verdict == Acceptance(num_accepted=0, next_token_id=2, is_bonus=True)


def test_target_rows_must_be_one_more_than_the_block():
    with pytest.raises(ValueError):
        accept_block(ids(1, 2), None, torch.full((2, 4), 0.25), uniforms((0.5, 0.5), (0.5, 0.5), (0.5, 0.5)))


def test_residual_without_mass_falls_back_to_the_target_row():
    target = probs(0.25, 0.75, 0.0, 0.0)
    assert torch.equal(residual_distribution(target, target), target.double())


# --- the sampling transform -------------------------------------------------------------------


def test_temperature_zero_is_one_hot_at_the_argmax():
    assert processed_probs(torch.tensor([1.0, 4.0, 2.0]), SamplingConfig(temperature=0.0)).tolist() == [0.0, 1.0, 0.0]


def test_temperature_zero_breaks_ties_toward_the_lowest_id():
    assert one_hot_argmax(torch.tensor([1.0, 4.0, 4.0])).tolist() == [0.0, 1.0, 0.0]


def test_top_k_one_is_one_hot_at_the_argmax():
    assert processed_probs(torch.tensor([1.0, 4.0, 2.0]), SamplingConfig(top_k=1)).tolist() == [0.0, 1.0, 0.0]


def test_top_p_keeps_the_smallest_set_reaching_it():
    # probs (0.5, 0.3, 0.2), top_p 0.7 -> keep 0.5 and 0.3, renormalised to (0.625, 0.375, 0).
    kept = processed_probs(torch.tensor([0.5, 0.3, 0.2]).log(), SamplingConfig(top_p=0.7))
    assert kept.tolist() == pytest.approx([0.625, 0.375, 0.0])


def test_tiny_top_p_keeps_only_the_most_likely_token():
    assert processed_probs(torch.tensor([1.0, 4.0, 2.0]), SamplingConfig(top_p=1e-9)).tolist() == [0.0, 1.0, 0.0]


def test_truncation_keeps_the_top_n_with_mass_renormalised():
    token_ids, kept = truncate_to_top_n(probs(0.1, 0.0, 0.6, 0.3), max_support=2)
    assert (token_ids.tolist(), kept.tolist()) == ([2, 3], pytest.approx([2 / 3, 1 / 3]))


def test_truncation_never_keeps_zero_mass_tokens():
    token_ids, _ = truncate_to_top_n(probs(0.0, 1.0, 0.0, 0.0), max_support=3)
    assert token_ids.tolist() == [1]


@pytest.mark.parametrize("bad", [dict(temperature=-0.1), dict(top_p=0.0), dict(top_p=1.5), dict(top_k=-2)])
def test_sampling_config_refuses_out_of_range_values(bad):
    with pytest.raises(ValueError):
        SamplingConfig(**bad)


# --- seeded determinism -----------------------------------------------------------------------


def test_same_seed_and_position_draw_the_same_uniforms():
    assert torch.equal(position_uniforms(7, 10, 4), position_uniforms(7, 10, 4))


def test_each_position_draws_the_same_whatever_block_it_is_in():
    # A retried or re-split block draws the same numbers for the same absolute positions.
    assert torch.equal(position_uniforms(7, 10, 4)[2:], position_uniforms(7, 12, 2))


def test_different_seeds_draw_different_uniforms():
    assert not torch.equal(position_uniforms(7, 10, 4), position_uniforms(8, 10, 4))


def test_target_and_draft_streams_draw_differently():
    assert not torch.equal(position_uniforms(7, 10, 4, "target"), position_uniforms(7, 10, 4, "draft"))


def seeded_verdict(seed: int) -> Acceptance:
    """One fixed block of three at positions 20-22, drawn with ``seed``."""
    generator = torch.Generator().manual_seed(1)
    target = torch.softmax(torch.randn(4, VOCAB, generator=generator), dim=-1)
    draft = torch.softmax(torch.randn(3, VOCAB, generator=generator), dim=-1)
    drafted = torch.multinomial(draft, 1, generator=generator)[:, 0]
    return accept_block(drafted, draft, target, position_uniforms(seed, 20, 4))


def test_same_seed_gives_the_same_verdict():
    assert [seeded_verdict(seed) for seed in range(16)] == [seeded_verdict(seed) for seed in range(16)]


def test_different_seeds_give_different_verdicts():
    assert len({seeded_verdict(seed) for seed in range(16)}) > 1


# --- distribution equality --------------------------------------------------------------------


@pytest.mark.parametrize("is_one_hot_draft", [False, True], ids=["dense_draft", "one_hot_draft"])
@pytest.mark.parametrize("config", SETTINGS, ids=SETTING_IDS)
def test_vectorised_rule_equals_accept_block_trial_by_trial(config, is_one_hot_draft):
    generator = torch.Generator().manual_seed(2)
    num_blocks, num_drafted = 500, 3
    target = processed_probs(torch.randn(num_blocks, num_drafted + 1, VOCAB, generator=generator) * 1.5, config)
    draft = processed_probs(torch.randn(num_blocks, num_drafted, VOCAB, generator=generator) * 1.5, config)
    drafted = torch.multinomial(draft.reshape(-1, VOCAB), 1, generator=generator).reshape(num_blocks, num_drafted)
    draws = torch.rand(num_blocks, num_drafted + 1, 2, generator=generator, dtype=torch.float64)
    draft_probs = None if is_one_hot_draft else draft
    num_accepted, next_ids = accept_blocks(drafted, draft_probs, target, draws)
    verdicts = [accept_block(drafted[i], None if is_one_hot_draft else draft[i], target[i], draws[i]) for i in range(num_blocks)]
    assert [(v.num_accepted, v.next_token_id) for v in verdicts] == list(zip(num_accepted.tolist(), next_ids.tolist(), strict=True))
    assert 0 < num_accepted.sum() < num_blocks * num_drafted  # both outcomes occurred


@pytest.mark.parametrize("is_one_hot_draft", [False, True], ids=["dense_draft", "one_hot_draft"])
@pytest.mark.parametrize("config", SETTINGS, ids=SETTING_IDS)
def test_first_emitted_token_follows_the_target(config, is_one_hot_draft):
    generator = torch.Generator().manual_seed(3)
    target, draft = random_setting_rows(config, generator)
    emitted = first_emitted(target, draft, is_one_hot_draft, generator)
    assert total_variation(empirical(emitted, VOCAB), target) < MAX_TOTAL_VARIATION


def test_first_emitted_token_follows_the_target_through_accept_block_itself():
    generator = torch.Generator().manual_seed(4)
    target, draft = random_setting_rows(SamplingConfig(temperature=0.9, top_k=6, top_p=0.9), generator)
    drafted = torch.multinomial(draft, NUM_TRIALS, replacement=True, generator=generator)
    draws = torch.rand(NUM_TRIALS, 2, 2, generator=generator, dtype=torch.float64)
    target_rows, draft_rows = torch.stack([target, target]), draft[None]
    emitted = torch.tensor(
        [
            _first_emitted_token(accept_block(drafted[i : i + 1], draft_rows, target_rows, draws[i]), int(drafted[i]))
            for i in range(NUM_TRIALS)
        ]
    )
    assert total_variation(empirical(emitted, VOCAB), target) < MAX_TOTAL_VARIATION


def _first_emitted_token(verdict: Acceptance, drafted: int) -> int:
    return drafted if verdict.num_accepted == 1 else verdict.next_token_id


@pytest.mark.parametrize("is_one_hot_draft", [False, True], ids=["dense_draft", "one_hot_draft"])
def test_second_emitted_token_follows_the_target_given_the_accepted_first(is_one_hot_draft):
    """Blocks of two; the target's and the draft's second rows depend on the first token, as a
    model's do. Given x1 = a accepted (probability min(q0(a), p0(a))), the second emitted token
    (x2 accepted, or the correction at row 1) must follow p1(. | a)."""
    vocab, num_trials = 6, 400_000
    config = SamplingConfig(temperature=0.8, top_p=0.95)
    generator = torch.Generator().manual_seed(5)
    target0, target1, draft0, draft1 = (
        processed_probs(torch.randn(shape, generator=generator) * 1.5, config)
        for shape in ((vocab,), (vocab, vocab), (vocab,), (vocab, vocab))
    )  # row a of target1 / draft1: the distributions after first token a
    first = torch.multinomial(draft0, num_trials, replacement=True, generator=generator)
    second = torch.multinomial(draft1[first], 1, generator=generator)[:, 0]
    drafted = torch.stack([first, second], dim=1)
    after_block = torch.full((num_trials, vocab), 1 / vocab)  # the bonus row; no part of this test
    target_probs = torch.stack([target0.expand(num_trials, vocab), target1[first], after_block], dim=1)
    draft_probs = None if is_one_hot_draft else torch.stack([draft0.expand(num_trials, vocab), draft1[first]], dim=1)
    draws = torch.rand(num_trials, 3, 2, generator=generator, dtype=torch.float64)
    num_accepted, next_ids = accept_blocks(drafted, draft_probs, target_probs, draws)
    kept = num_accepted >= 1
    second_emitted = torch.where(num_accepted == 2, second, next_ids)[kept]
    pairs = empirical(first[kept] * vocab + second_emitted, vocab * vocab)
    first_accepted = torch.minimum(target0, draft0) if not is_one_hot_draft else draft0 * target0
    expected = (first_accepted[:, None] * target1).flatten()
    assert total_variation(pairs, expected / expected.sum()) < MAX_TOTAL_VARIATION


# --- vocabulary bounds (regression) -----------------------------------------------------------

EXTREME_SETTINGS = [
    SamplingConfig(temperature=1.0, top_k=1),
    SamplingConfig(temperature=1.0, top_p=1e-6),
    SamplingConfig(temperature=1e-3),
    SamplingConfig(temperature=2.0, top_k=3, top_p=0.5),
    SamplingConfig(temperature=0.0),
]
EXTREME_IDS = ["top_k_1", "tiny_top_p", "tiny_temperature", "top_k_top_p", "greedy"]


@pytest.mark.parametrize("config", EXTREME_SETTINGS, ids=EXTREME_IDS)
def test_emitted_tokens_stay_in_the_vocabulary_with_target_mass(config):
    vocab, num_drafted = 16, 3
    generator = torch.Generator().manual_seed(6)
    violations = []
    for trial in range(300):
        logits = torch.randn(num_drafted + 1, vocab, generator=generator) * 8
        logits[:, -3:] = float("-inf")  # the last ids never have mass (padding rows of a real vocab)
        target = processed_probs(logits, config)
        draft = processed_probs(torch.randn(num_drafted, vocab, generator=generator) * 8, SamplingConfig(top_k=4))
        drafted = torch.multinomial(draft, 1, generator=generator)[:, 0]
        draws = torch.rand(num_drafted + 1, 2, generator=generator, dtype=torch.float64)
        if trial % 3:  # two trials in three draw tokens with the extreme uniforms
            draws[:, 1] = 0.0 if trial % 3 == 1 else LARGEST_UNIFORM
        verdict = accept_block(drafted, draft if trial % 2 else None, target, draws)
        if not (0 <= verdict.next_token_id < vocab - 3 and target[verdict.num_accepted, verdict.next_token_id] > 0):
            violations.append((trial, verdict))
    assert violations == []


def test_correction_from_a_residual_of_one_rounding_step_is_the_token_holding_it():
    # q is p with one float32 step of mass moved from token 5 to token 2: drafted token 2 is
    # rejected by the largest draw, and the residual is one step of mass at token 5 alone.
    target = torch.softmax(torch.randn(VOCAB, generator=torch.Generator().manual_seed(7)), dim=-1)
    draft = target.clone()
    draft[2] = torch.nextafter(target[2], torch.tensor(1.0))
    draft[5] = torch.nextafter(target[5], torch.tensor(0.0))
    draws = uniforms((LARGEST_UNIFORM, LARGEST_UNIFORM), (0.5, 0.5))
    assert accept_block(ids(2), draft[None], torch.stack([target, target]), draws) == Acceptance(0, 5, is_bonus=False)


def test_sample_from_never_returns_a_zero_mass_token():
    distribution = probs(0.0, 0.5, 0.0, 0.5, 0.0)
    assert [sample_from(distribution, draw) for draw in (0.0, 0.5, LARGEST_UNIFORM)] == [1, 3, 3]
