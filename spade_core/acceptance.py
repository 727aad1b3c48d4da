"""Speculative-sampling acceptance: which drafted tokens the target keeps, and what comes next.

Glossary
    drafted tokens   the block x_1..x_d the edge sampled from its draft distributions.
    draft_probs      q_i, the distribution x_i was really sampled from ([d, vocab]); None means a
                     greedy draft, i.e. q_i is one-hot at x_i.
    target_probs     p_i, the target's distribution at each of the d + 1 positions after the
                     request's sampling transform ([d + 1, vocab]); row d follows the whole block.
    accepted         x_i is kept with probability min(1, p_i(x_i) / q_i(x_i)), in order, until the
                     first rejection.
    correction       (a.k.a. recovered token) at the first rejected position i, a token drawn
                     from norm(max(0, p_i - q_i)); the block ends there.
    bonus token      when all d are accepted, one more token drawn from p_d.
    next token       the correction or the bonus: every call emits num_accepted + 1 tokens.

Each emitted token is then distributed exactly as sampling from the target alone would give
(Leviathan et al. 2023; Chen et al. 2023). Temperature 0 is the same rule with one-hot p: a
drafted token is accepted iff it is the target's argmax, and the next token is the argmax.

Randomness is passed in as uniforms ([d + 1, 2]: per position, one for the accept test and one
for drawing a token), drawn by the caller from generators seeded by (request seed, absolute
position), so the same call always returns the same answer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from spade_core.sampling import sample_from


@dataclass(frozen=True)
class Acceptance:
    num_accepted: int
    next_token_id: int
    is_bonus: bool


def accept_block(
    draft_token_ids: torch.Tensor,  # [d] int64
    draft_probs: torch.Tensor | None,  # [d, vocab] float, rows sum to 1; None = greedy draft
    target_probs: torch.Tensor,  # [d + 1, vocab] float, rows sum to 1
    uniforms: torch.Tensor,  # [d + 1, 2] float64 in [0, 1)
) -> Acceptance:
    num_drafted = draft_token_ids.shape[0]
    if target_probs.shape[0] != num_drafted + 1:
        raise ValueError(f"target_probs needs {num_drafted + 1} rows, got {target_probs.shape[0]}")
    draft_token_ids = draft_token_ids.to(target_probs.device)
    num_accepted = count_accepted(draft_token_ids, draft_probs, target_probs, uniforms[:num_drafted, 0])
    if num_accepted == num_drafted:
        bonus = sample_from(target_probs[num_drafted], float(uniforms[num_drafted, 1]))
        return Acceptance(num_accepted, bonus, is_bonus=True)
    residual = residual_distribution(
        target_probs[num_accepted],
        draft_row(draft_probs, draft_token_ids, num_accepted, target_probs.shape[-1]),
    )
    correction = sample_from(residual, float(uniforms[num_accepted, 1]))
    return Acceptance(num_accepted, correction, is_bonus=False)


def count_accepted(
    draft_token_ids: torch.Tensor,  # [d]
    draft_probs: torch.Tensor | None,  # [d, vocab] or None
    target_probs: torch.Tensor,  # [d + 1, vocab]
    accept_uniforms: torch.Tensor,  # [d] float64
) -> int:
    """Leading drafted tokens that pass u_i < p_i(x_i) / q_i(x_i)."""
    num_drafted = draft_token_ids.shape[0]
    if num_drafted == 0:
        return 0
    positions = torch.arange(num_drafted, device=target_probs.device)
    target_at_drafted = target_probs[positions, draft_token_ids].double()
    if draft_probs is None:
        draft_at_drafted = torch.ones_like(target_at_drafted)
    else:
        draft_at_drafted = draft_probs[positions, draft_token_ids].double()
    accepted = accept_uniforms.to(target_at_drafted.device) * draft_at_drafted < target_at_drafted
    # Example: accepted = (T, T, F, T) -> cumprod (1, 1, 0, 0) -> 2 leading acceptances.
    return int(accepted.long().cumprod(dim=0).sum())


def draft_row(draft_probs: torch.Tensor | None, draft_token_ids: torch.Tensor, index: int, vocab_size: int) -> torch.Tensor:
    """q_i as a dense row: the sent distribution, or one-hot at the drafted token."""
    if draft_probs is not None:
        return draft_probs[index]
    row = torch.zeros(vocab_size, dtype=torch.float32, device=draft_token_ids.device)
    row[draft_token_ids[index]] = 1.0
    return row


def residual_distribution(target_row: torch.Tensor, draft_row_probs: torch.Tensor) -> torch.Tensor:
    """norm(max(0, p - q)). If rounding leaves no mass (p == q, where a rejection has probability
    zero anyway), fall back to p rather than divide by zero."""
    residual = (target_row.double() - draft_row_probs.double()).clamp_min(0.0)
    total = residual.sum()
    if total <= 0:
        return target_row.double()
    return residual / total
