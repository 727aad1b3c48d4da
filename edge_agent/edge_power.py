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
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Literal

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


@dataclass
class DraftAheadPolicy:
    """The service-wide half of the drafting-ahead policy (``--edge-power``): the draft's speed,
    the round trip of a block and the rate at which the target's next token is the draft's guess
    (timings are the machines' and the link's, shared by every request), and the acceptance
    prior a request starts from. Each request asks its own ``for_request()``."""

    power: EdgePower = DEFAULT_EDGE_POWER
    smoothing: float = TUNING.smoothing
    draft_s_per_token: float = TUNING.draft_s_per_token_prior
    round_trip_s: float = TUNING.round_trip_s_prior
    """A block's verify round trip (link + verifier), block-only calls."""
    acceptance_prior: float = TUNING.acceptance_prior
    guess_rate: float = TUNING.guess_rate_prior
    """Share of full acceptances whose next token was the draft's guess (measured where one was drafted)."""

    def __post_init__(self) -> None:
        if self.power not in MIN_SAVING_PER_CPU_S:
            raise ValueError(f"edge power must be one of {sorted(MIN_SAVING_PER_CPU_S)}, got {self.power!r}")

    @property
    def min_saving_per_cpu_s(self) -> float:
        return MIN_SAVING_PER_CPU_S[self.power]

    def for_request(self) -> RequestDraftAhead:
        return RequestDraftAhead(self)

    def fitting_tokens(self) -> int:
        """Tokens drafted ahead before the verdict lands (the loop stops there), at least one."""
        return max(1, math.ceil(self.round_trip_s / max(self.draft_s_per_token, 1e-6)))

    def observe_times(self, draft_s_per_token: float | None, round_trip_s: float | None) -> None:
        if draft_s_per_token is not None:
            self.draft_s_per_token = self._blend(self.draft_s_per_token, draft_s_per_token)
        if round_trip_s is not None:
            self.round_trip_s = self._blend(self.round_trip_s, round_trip_s)

    def observe_guess(self, is_right: bool) -> None:
        self.guess_rate = self._blend(self.guess_rate, float(is_right))

    def observe_acceptance(self, acceptance_rate: float) -> None:
        self.acceptance_prior = self._blend(self.acceptance_prior, acceptance_rate)

    def _blend(self, old: float, new: float) -> float:
        return (1 - self.smoothing) * old + self.smoothing * new


@dataclass
class RequestDraftAhead:
    """One request's drafting-ahead decisions: its own acceptance rate (accepted / trials, as
    ``draft_length.RequestDraftLength`` counts them), started from the shared prior."""

    shared: DraftAheadPolicy
    accepted_per_block: float = field(init=False)
    trials_per_block: float = field(init=False)

    def __post_init__(self) -> None:
        self.accepted_per_block, self.trials_per_block = self.shared.acceptance_prior, 1.0

    @property
    def acceptance_rate(self) -> float:
        return min(0.99, self.accepted_per_block / self.trials_per_block)

    def hit_probability(self, num_drafted: int) -> float:
        """Chance that the block's verdict runs through the guess: all ``num_drafted`` accepted
        (a^d), then the target's next token is the guess (measured, service-wide)."""
        return self.acceptance_rate**num_drafted * self.shared.guess_rate

    def ahead_limit(self, num_drafted: int, limit: int, prefills_draft: bool) -> int:
        """Of the ``limit`` tokens the engine could draft past a block of ``num_drafted`` while it
        is verified, how many to draft: all of them or none (the saving per CPU-second grows with
        the tokens drafted, so a part is never better than the whole that fits the round trip),
        and always the first when its forward is the draft's prefill of the prompt, which is due
        anyway (then only its guess could be wasted)."""
        if limit < 1 or self.shared.power == "performance":
            return limit
        num_ahead = min(limit, self.shared.fitting_tokens())
        worth = expected_saving_per_cpu_s(self.hit_probability(num_drafted), num_ahead) >= self.shared.min_saving_per_cpu_s
        return limit if worth else (1 if prefills_draft else 0)

    def observe_block(self, num_drafted: int, num_accepted: int) -> None:
        """One verified block: each drafted token up to the first rejection is a trial."""
        if num_drafted < 1:
            return
        trials = num_accepted + (0 if num_accepted == num_drafted else 1)
        smoothing = self.shared.smoothing
        self.accepted_per_block = (1 - smoothing) * self.accepted_per_block + smoothing * num_accepted
        self.trials_per_block = (1 - smoothing) * self.trials_per_block + smoothing * trials
        self.shared.observe_acceptance(self.acceptance_rate)
