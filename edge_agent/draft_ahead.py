"""Drafting that overlaps verification: the tokens drafted past a block while it is verified,
and when they may start the next block.

While block b (following context c) is at the verifier, the edge keeps drafting as if all of
b will be accepted: first its guess g of the target's next token, then the block after it. The
verdict commits c + (accepted part of b) + next token. If that committed context runs through
the guess (all of b accepted and next == g), the tokens after g are exactly what the drafter
would propose for the new context, so they start the next block; otherwise they are dropped
(the draft session rolls its cache back on the next proposal). Proposals are only proposals:
the verifier checks every one, so exactness does not depend on any of this.

Example: c = [1, 2], b = [3, 4], drafted ahead [5, 6, 7] (5 is the guess):
    verdict "2 accepted, next 5" -> context [1, 2, 3, 4, 5]: the next block starts with [6, 7];
    verdict "2 accepted, next 9" or "1 accepted, next 8" -> nothing drafted ahead is usable.

A draft forward still running when the verdict lands is not waited for: the verdict's tokens go
to the user at once and the forward's token joins the others before the next block (``settle``).
This matters most for the prompt-only first call, where that forward is the draft's prefill of
the whole prompt: the first token does not wait for it.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from edge_agent.drafter import DraftBlock

EMPTY_BLOCK = DraftBlock([], None)


@dataclass(frozen=True)
class Drafting:
    """What drafting a block cost the request."""

    exposed_s: float
    """Time the request waited for drafting before the block could be sent."""
    seconds_per_token: float | None
    """Drafting time per token of this block (None when nothing was timed)."""


@dataclass
class DraftAhead:
    follows: list[int]
    """The context + block the tokens continue."""
    token_ids: list[int]
    probs: list | None
    """Per token, the distribution it was sampled from (SparseDistribution); None when greedy."""
    seconds: float
    pending: asyncio.Future[tuple[DraftBlock, float]] | None = None
    """A proposal of one more token still running when the verdict landed."""

    @property
    def sequence(self) -> list[int]:
        return self.follows + self.token_ids

    @property
    def seconds_per_token(self) -> float | None:
        return self.seconds / len(self.token_ids) if self.token_ids else None

    async def settle(self) -> tuple[DraftBlock, float]:
        """Wait for the proposal still running, if any, and take its token; returns what it
        added and the seconds it took."""
        if self.pending is None:
            return EMPTY_BLOCK, 0.0
        pending, self.pending = self.pending, None
        block, seconds = await pending
        self.extend(block, seconds)
        return block, seconds

    def discard(self) -> None:
        """Give up the proposal still running (its forward finishes on the drafting thread)."""
        if self.pending is not None:
            self.pending.cancel()
            self.pending = None

    def extend(self, block: DraftBlock, seconds: float) -> None:
        self.token_ids = self.token_ids + block.token_ids
        if block.probs is not None:
            self.probs = (self.probs or []) + block.probs
        self.seconds += seconds

    def is_continued_by(self, context: list[int]) -> bool:
        """Whether the committed ``context`` runs through at least the guess and agrees with
        everything drafted up to its end."""
        sequence = self.sequence
        return len(self.follows) < len(context) <= len(sequence) and sequence[: len(context)] == context

    def accepts_whole_block(self, context: list[int]) -> bool:
        """Whether the committed ``context`` took the whole block (so its next token tried the guess)."""
        return len(context) > len(self.follows) and context[: len(self.follows)] == self.follows

    def num_confirmed(self, context: list[int]) -> int:
        """Drafted-ahead tokens the committed ``context`` runs through itself (the guess, on a hit)."""
        return len(context) - len(self.follows) if self.is_continued_by(context) else 0

    @property
    def num_drafted(self) -> int:
        """Tokens drafted ahead, the forward still running counted (its CPU is spent or being spent)."""
        return len(self.token_ids) + (self.pending is not None)

    def continuation_of(self, context: list[int], max_tokens: int) -> DraftBlock:
        """Up to ``max_tokens`` drafted tokens that follow ``context``; empty on a miss."""
        if not self.is_continued_by(context):
            return EMPTY_BLOCK
        start = len(context) - len(self.follows)
        end = start + max_tokens
        return DraftBlock(self.token_ids[start:end], None if self.probs is None else self.probs[start:end])


def join_blocks(first: DraftBlock, second: DraftBlock) -> DraftBlock:
    """``first`` then ``second`` as one block (greedy blocks carry no distributions)."""
    if first.probs is None and second.probs is None:
        return DraftBlock(first.token_ids + second.token_ids, None)
    return DraftBlock(first.token_ids + second.token_ids, (first.probs or []) + (second.probs or []))
