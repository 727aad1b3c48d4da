"""An edge's proposal: drafted token ids from an absolute start position, read by a verifier that
has decided tokens of its own since the edge drafted them. One definition for every consumer
(the pipelined sessions of ``verifier_service.pipeline``, vLLM's proposer hook in
``verifier_service.backends.vllm.proposals``), and what an edge keeps of its drafts once decided
tokens arrive (``rebased_drafts``: the edge's pipelined engine and the capacity replay's)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Proposal:
    start: int
    """The position of its first token (absolute: the prompt's first token is position 0)."""
    token_ids: np.ndarray


def aligned_proposal(row_tokens: np.ndarray | Sequence[int], num_tokens: int, proposal: Proposal, limit: int) -> list[int]:
    """The proposal's next tokens (at most ``limit``) for a request whose tokens are
    ``row_tokens[:num_tokens]``: [] when the proposal starts past the request (a gap), when the
    request has passed all of it, or when the part it has passed contradicts the request's tokens.

    Example: tokens [1, 2, 3, 4], proposal [3, 4, 5, 6] from position 2, limit 8 -> [5, 6];
    proposal [3, 9, 5] from 2 -> [] (the 9 is contradicted by the request's 4)."""
    passed = num_tokens - proposal.start
    if passed < 0 or passed >= len(proposal.token_ids) or limit <= 0:
        return []
    if passed and not np.array_equal(np.asarray(row_tokens[proposal.start : num_tokens]), proposal.token_ids[:passed]):
        return []
    return [int(token) for token in proposal.token_ids[passed : passed + limit]]


def rebased_drafts(seen: list[int], base: int, drafts: list[int]) -> list[int]:
    """The drafts (from position ``base``) still worth having once ``seen`` holds what was
    decided: those after it, where the decided ones after ``base`` confirm them; else none.

    Example: base 2, drafts [c, d, e], seen [a, b, c, d] -> [e]; seen [a, b, x] -> []."""
    decided = seen[base:]
    if drafts[: len(decided)] != decided:
        return []
    return drafts[len(decided) :]
