"""One request's speculative generation: the object the engine's loop hands from step to step
(as nano-vllm hands a ``Sequence``), and the rules for the length of its next block and of what
is drafted ahead of it.

Glossary: the *context* is the prompt and every committed token; a *block* is the drafted tokens
one verify call checks; the verdict *commits* the accepted drafts and the target's next token;
of those the request *delivers* the ones within its budget, through the first EOS."""

from __future__ import annotations

from dataclasses import dataclass

from edge_agent.draft_ahead import DraftAhead
from edge_agent.draft_length import FixedDraftLength, RequestDraftLength
from edge_agent.drafter import DraftSession
from edge_agent.edge_power import RequestDraftAhead
from edge_agent.estimates import RequestEstimate
from edge_agent.verifier_client import VerifierSession
from gateway.engine import GenerationRequest
from gateway.protocol import SpadeStats


def draft_length(chosen: int, num_left: int, room: int, verifier_advice: int | None = None) -> int:
    """The length of the next block: the policy's ``chosen`` length within every cap, never below 1
    unless the verifier advised 0 (its forwards are past the point where a drafted row pays: the
    call then carries no block, a target-only step). The prompt-only first call's empty block is
    decided elsewhere (``Generation.sends_prompt_only``).

    Caps: the budget (a block of d yields up to d + 1 tokens, so d <= ``num_left`` - 1), the
    context's ``room`` (context + block must fit: ``gateway.model``), and ``verifier_advice``, the
    longest block the last verdict advised (None: no verdict carried one). Example: chosen 5,
    4 tokens left, room 60 -> 3 (the block of 3 and the next token make the 4)."""
    if verifier_advice == 0:
        return 0
    caps = [num_left - 1, room] if verifier_advice is None else [num_left - 1, room, verifier_advice]
    return max(1, min(chosen, *caps))


def ahead_length(chosen: int, num_left: int, num_drafted: int, room_after_hit: int, verifier_advice: int | None = None) -> int:
    """Tokens worth drafting past a block of ``num_drafted`` while it is verified, ``num_left``
    tokens left: the guess of the target's next token, then the next block (``draft_length`` of
    ``chosen`` after a hit, whose context has ``room_after_hit``); none where a hit ends the
    request or the verifier advised 0 (the next call carries no block). Example: 10 tokens left,
    a block of 4 -> at best 5 come back and 5 remain: the guess + 4. The prompt-only call (a
    block of 0), 10 left, length 5 -> the guess + 5; drafting the guess is also the draft's
    prefill of the prompt."""
    num_left_after_hit = num_left - (num_drafted + 1)
    if num_left_after_hit <= 0 or verifier_advice == 0:
        return 0
    if min(num_left_after_hit - 1, room_after_hit) < 1:
        return 1  # the guess alone: after it, the budget or the context takes no drafted token
    return 1 + draft_length(chosen, num_left_after_hit, room_after_hit, verifier_advice)


@dataclass
class Generation:
    """Everything one request's speculative loop reads and changes, in one place."""

    request: GenerationRequest
    stats: SpadeStats
    """The request's own account (the ``spade`` object of its response)."""
    draft_session: DraftSession
    verifier_session: VerifierSession
    estimate: RequestEstimate
    """What the request knows of its acceptance (and, shared, of the edge's timings): both
    policies read it; it learns from each verified block."""
    policy: FixedDraftLength | RequestDraftLength
    """The request's draft-length policy: ``next_length()`` before a block."""
    ahead_policy: RequestDraftAhead
    """How far the request drafts ahead under a verify call (``--edge-power``): ``ahead_limit``."""
    context: list[int]
    """The prompt and every committed token."""
    sends_prompt_only: bool = False
    """The next verify call carries the prompt alone (prefill first: only the first call)."""
    num_generated: int = 0
    """Tokens delivered so far."""
    has_ended: bool = False
    """An EOS was delivered."""
    is_draft_prefilled: bool = False
    """A block was drafted for this request (the first one also prefilled the draft model)."""
    ahead: DraftAhead | None = None
    """What was drafted past the block last sent, while the verifier checked it."""
    verifier_advice: int | None = None
    """The longest block the last verdict advised, a cap of ``draft_length``; None until a verdict carries one."""

    @property
    def num_left(self) -> int:
        """Tokens the budget still allows."""
        return self.request.max_tokens - self.num_generated

    @property
    def is_finished(self) -> bool:
        return self.has_ended or self.num_left <= 0

    @property
    def wants_logprobs(self) -> bool:
        return self.request.num_top_logprobs is not None

    def commit(self, committed: list[int]) -> list[int]:
        """Add a call's committed tokens to the context; returns the ones to deliver. No token
        (the prompt-only call fell back to the draft) leaves nothing drafted ahead usable."""
        self.sends_prompt_only = False
        if not committed:
            self.drop_ahead()
            return []
        self.context += committed
        delivered = committed[: num_delivered(committed, self.num_left, self.request.eos_token_ids)]
        self.num_generated += len(delivered)
        self.has_ended = delivered[-1] in self.request.eos_token_ids
        return delivered

    def drop_ahead(self) -> int:
        """Give up what was drafted ahead (a proposal still running finishes on the drafting
        thread); returns how many drafted tokens that throws away, the running one included."""
        num_discarded = 0
        if self.ahead is not None:
            num_discarded = self.ahead.num_drafted
            self.ahead.discard()
        self.ahead = None
        return num_discarded


def num_delivered(committed: list[int], num_left: int, eos_token_ids: frozenset[int]) -> int:
    """How many of the committed tokens to deliver: up to the budget and through the first EOS."""
    for index, token_id in enumerate(committed[:num_left]):
        if token_id in eos_token_ids:
            return index + 1
    return min(len(committed), num_left)
