"""What a drafted block commits on average, given the acceptance rate: the arithmetic the edge's
draft-length policy and the verifier's advice share (plain floats, no torch: the services'
``--help`` imports it)."""

from __future__ import annotations


def expected_tokens(acceptance_rate: float, num_drafted: int) -> float:
    """Tokens a block of ``num_drafted`` commits on average where each drafted token is kept with
    probability ``acceptance_rate`` given the ones before: the accepted drafts + the next token,
    1 + a + ... + a^d."""
    if acceptance_rate >= 1.0:
        return num_drafted + 1.0
    return (1.0 - acceptance_rate ** (num_drafted + 1)) / (1.0 - acceptance_rate)
