"""The draft length d, the tokens drafted per verify call: fixed, or chosen for speed.

Vocabulary, the same everywhere: the *draft length* is how many tokens are drafted for one
verify call (``--draft-length``, its bound ``--max-draft-length`` on both services, the metric
``spade_edge_draft_length``); ``num_drafted`` counts the tokens of one given block; a
*draft-length policy* (``DraftLengthPolicy``) chooses it.

The adaptive rule picks, before each block, the length d that maximises expected tokens per
second of wall time:

    E(a, d) = (1 - a^(d+1)) / (1 - a)          tokens one block yields (accepted drafts + next)
    cycle(d) = exposed_draft(d) + t_link + t_verify(d)
    d* = argmax_d E(a, d) / cycle(d),  1 <= d <= max_length

a is the per-token acceptance rate, estimated online per request from a prior that carries over
from earlier requests; t_link is the round trip minus the verifier's own time; t_verify(d) is the
verifier's time for a block of d, learned per length and interpolated by a line (on a CPU a
longer block costs more, on a GPU almost nothing more). All of them are the edge's one set of
estimates (``estimates``), which the drafting-ahead policy reads too. Without overlap the drafting is exposed:
exposed_draft(d) = d * t_draft. With overlap the edge drafts the next block while this one is
verified; that work is used only when the whole block is accepted and the target's next token
is the draft's own guess (probability about a^(d+1)), and then only its part longer than the
round trip is exposed:

    exposed_draft(d) = h * max(0, (d + 1) * t_draft - t_link - t_verify(d)) + (1 - h) * d * t_draft,
    h = a^(d+1).

Worked example (no overlap), a = 0.8, t_draft = 20 ms, t_verify flat: t_link + t_verify = 100 ms
-> d = 4 (3.36 tokens per 180 ms); 300 ms -> d = 7 (4.16 tokens per 440 ms); 10 ms -> d = 1.
Long round trips favour long blocks; poor acceptance and slow drafting favour short ones.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Literal

from edge_agent.estimates import EdgeEstimates, RequestEstimate
from spade_core.block_yield import expected_tokens


def overlap_hit_probability(acceptance_rate: float, num_drafted: int) -> float:
    """Chance that the block drafted ahead is usable: all drafts accepted and the guess right."""
    return acceptance_rate ** (num_drafted + 1)


def exposed_draft_s(num_drafted: int, acceptance_rate: float, draft_s_per_token: float, round_trip_s: float, overlap: bool) -> float:
    """Drafting time the user waits for, per block (see the module docstring)."""
    drafting_s = num_drafted * draft_s_per_token
    if not overlap:
        return drafting_s
    hit = overlap_hit_probability(acceptance_rate, num_drafted)
    ahead_s = (num_drafted + 1) * draft_s_per_token
    return hit * max(0.0, ahead_s - round_trip_s) + (1.0 - hit) * drafting_s


def tokens_per_s(
    num_drafted: int,
    acceptance_rate: float,
    draft_s_per_token: float,
    link_s: float,
    verify_s: float,
    overlap: bool,
) -> float:
    """Expected tokens per second of blocks of ``num_drafted`` (``verify_s`` is t_verify(d))."""
    round_trip_s = link_s + verify_s
    cycle_s = exposed_draft_s(num_drafted, acceptance_rate, draft_s_per_token, round_trip_s, overlap) + round_trip_s
    return expected_tokens(acceptance_rate, num_drafted) / max(cycle_s, 1e-9)


@dataclass
class FixedDraftLength:
    length: int

    def __post_init__(self) -> None:
        if self.length < 1:
            raise ValueError(f"draft length must be >= 1, got {self.length}")

    def for_request(self, estimate: RequestEstimate | None = None) -> FixedDraftLength:
        """A fixed length is its own request's policy (it reads no estimate)."""
        return self

    def within(self, limit: int) -> FixedDraftLength:
        """This length, or ``limit`` if shorter (the verifier's longest block)."""
        return FixedDraftLength(min(self.length, limit))

    def next_length(self) -> int:
        return self.length


@dataclass(frozen=True)
class AdaptiveDraftLength:
    """The adaptive rule: the block length that maximises expected tokens per second, on the
    edge's estimates (``estimates``: a request's acceptance, the service's draft speed, link and
    t_verify(d)). Holds no state of its own: what it learns is the estimates'."""

    max_length: int = 16
    overlap: bool = False
    """Whether the engine drafts ahead while a block is verified (changes the cost model)."""

    def __post_init__(self) -> None:
        if self.max_length < 1:
            raise ValueError("max_length must be >= 1")

    def for_request(self, estimate: RequestEstimate) -> RequestDraftLength:
        return RequestDraftLength(self, estimate)

    def within(self, limit: int) -> AdaptiveDraftLength:
        """The same rule choosing at most ``limit`` (the verifier's longest block)."""
        return replace(self, max_length=min(self.max_length, limit))

    def best_length(self, acceptance_rate: float, estimates: EdgeEstimates) -> int:
        """argmax over d in [1, max_length] of expected tokens per second."""

        def rate(num_drafted: int) -> float:
            verify_s = estimates.verify_curve.seconds(num_drafted)
            return tokens_per_s(num_drafted, acceptance_rate, estimates.draft_s_per_token, estimates.link_s, verify_s, self.overlap)

        return max(range(1, self.max_length + 1), key=rate)


@dataclass(frozen=True)
class RequestDraftLength:
    """One request's adaptive rule: the rule on the request's own estimate."""

    rule: AdaptiveDraftLength
    estimate: RequestEstimate

    def next_length(self) -> int:
        return self.rule.best_length(self.estimate.acceptance_rate, self.estimate.shared)


DraftLengthPolicy = FixedDraftLength | AdaptiveDraftLength
"""What chooses the draft length, service-wide: ``for_request(estimate)`` gives one request's own
policy (a fixed length is its own), which answers ``next_length()`` before each block from the
request's estimate (``estimates.RequestEstimate``, which learns from each verified block)."""


def parse_draft_length(value: object) -> int | Literal["auto"]:
    """The ``--draft-length`` setting: ``"auto"`` (any case) or a positive integer (or its text)."""
    if isinstance(value, str) and value.strip().lower() == "auto":
        return "auto"
    try:
        length = int(value) if isinstance(value, int | str) and not isinstance(value, bool) else 0
    except ValueError:
        length = 0
    if length < 1:
        raise ValueError(f"draft length must be a positive integer or 'auto', got {value!r}")
    return length


def draft_length_policy(draft_length: int | Literal["auto"], max_draft_length: int, overlap: bool = False) -> DraftLengthPolicy:
    """``"auto"`` -> adaptive (up to ``max_draft_length``), an integer -> fixed."""
    if draft_length == "auto":
        return AdaptiveDraftLength(max_length=max_draft_length, overlap=overlap)
    return FixedDraftLength(draft_length)
