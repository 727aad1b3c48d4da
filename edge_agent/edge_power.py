"""How far the edge drafts ahead while a verify call is in flight (``--edge-power``): CPU
against the user's wait.

Drafting ahead (``draft_ahead.DraftAhead``) pays only on a *hit*: the verdict accepts the whole
block and the target's next token is the draft's guess; then the tokens drafted after the guess
start the next block instead of being drafted while the user waits. On a miss (most blocks:
measured hit rates 30-45 %) all of it is thrown away. Each drafted-ahead token costs one draft
forward of CPU either way, so on a battery it is worth drafting ahead only where the expected
saving in wall time per CPU-second clears the bar the setting puts (``MIN_SAVING_PER_CPU_S``).
The decision changes only when and how far the edge drafts, never what the verifier accepts:
the output is the same in every mode.

Torch-free (the settings import it, and ``spade-edge --help`` must not load torch).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Literal

from edge_agent.estimates import EdgeEstimates, RequestEstimate
from edge_agent.tuning import TUNING

EdgePower = Literal["performance", "balanced", "saver"]

DEFAULT_EDGE_POWER: EdgePower = "performance"
"""The default: on the measured machine (docs/runs/run-j.md) every mode that drafts ahead
less lost 3-9 % of the speed (balanced 0.91x at RTT 20 ms, 0.97x at 100 ms over three runs;
saver as fast as balanced for less CPU), so the default keeps the speed and a battery-bound edge
chooses ``saver``."""

MIN_SAVING_PER_CPU_S: Mapping[str, float] = MappingProxyType({"performance": 0.0, "balanced": 0.5, "saver": math.inf})
"""Seconds of the user's wait a CPU-second of drafting ahead must be expected to save, per
``--edge-power``. ``performance`` is not asked at all (it drafts ahead under every verify call,
the behaviour before the setting existed); ``saver`` never drafts ahead past the prompt's
prefill (which costs nothing extra: the draft must prefill the prompt anyway). ``balanced``
drafts ahead where a CPU-second buys at least half a second of wait (docs/design.md, "Edge power")."""


def expected_saving_per_cpu_s(hit_probability: float, num_ahead: int) -> float:
    """Wall seconds saved per CPU-second spent by drafting ``num_ahead`` tokens ahead (the guess,
    then ``num_ahead - 1`` tokens of the next block), per unit of draft time t:

        saving = h (L - 1) t - (1 - h) TUNING.pending_forward_share t      cpu = L t

    On a hit (probability h) the L - 1 tokens after the guess start the next block and are not
    drafted in line (the guess itself only confirms the target's next token); on a miss all L
    are thrown away and the next block waits for the forward in progress. t cancels, so the
    draft's speed enters through L alone (what fits in the round trip). Example: h = 0.4, L = 6
    -> (2.0 - 0.3) / 6 = 0.28 s saved per CPU-second; h = 0.7, L = 6 -> 0.56."""
    if num_ahead < 1:
        return 0.0
    saving = hit_probability * (num_ahead - 1) - (1.0 - hit_probability) * TUNING.pending_forward_share
    return saving / num_ahead


@dataclass(frozen=True)
class DraftAheadPolicy:
    """The drafting-ahead policy (``--edge-power``), service-wide: the bar a CPU-second of drafting
    ahead must clear. What it weighs (a request's acceptance, the draft's speed, a block's round
    trip, the guess rate) is the edge's one set of estimates (``estimates``), which the
    draft-length policy reads too. Each request asks its own ``for_request(estimate)``."""

    power: EdgePower = DEFAULT_EDGE_POWER

    def __post_init__(self) -> None:
        if self.power not in MIN_SAVING_PER_CPU_S:
            raise ValueError(f"edge power must be one of {sorted(MIN_SAVING_PER_CPU_S)}, got {self.power!r}")

    @property
    def min_saving_per_cpu_s(self) -> float:
        return MIN_SAVING_PER_CPU_S[self.power]

    def for_request(self, estimate: RequestEstimate) -> RequestDraftAhead:
        return RequestDraftAhead(self, estimate)


def fitting_tokens(estimates: EdgeEstimates) -> int:
    """Tokens drafted ahead before the verdict lands (the loop stops there), at least one."""
    return max(1, math.ceil(estimates.round_trip_s / max(estimates.draft_s_per_token, 1e-6)))


@dataclass(frozen=True)
class RequestDraftAhead:
    """One request's drafting-ahead decisions, on the request's own estimate."""

    policy: DraftAheadPolicy
    estimate: RequestEstimate

    def hit_probability(self, num_drafted: int) -> float:
        """Chance that the block's verdict runs through the guess: all ``num_drafted`` accepted
        (a^d), then the target's next token is the guess (measured, service-wide)."""
        return self.estimate.acceptance_rate**num_drafted * self.estimate.shared.guess_rate

    def ahead_limit(self, num_drafted: int, limit: int, prefills_draft: bool) -> int:
        """Of the ``limit`` tokens the engine could draft past a block of ``num_drafted`` while it
        is verified, how many to draft: all of them or none (the saving per CPU-second grows with
        the tokens drafted, so a part is never better than the whole that fits the round trip),
        and always the first when its forward is the draft's prefill of the prompt, which is due
        anyway (then only its guess could be wasted)."""
        if limit < 1 or self.policy.power == "performance":
            return limit
        num_ahead = min(limit, fitting_tokens(self.estimate.shared))
        worth = expected_saving_per_cpu_s(self.hit_probability(num_drafted), num_ahead) >= self.policy.min_saving_per_cpu_s
        return limit if worth else (1 if prefills_draft else 0)
