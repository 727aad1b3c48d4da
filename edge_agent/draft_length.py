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
longer block costs more, on a GPU almost nothing more). Without overlap the drafting is exposed:
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

from dataclasses import dataclass, field, replace
from typing import Literal

from edge_agent.tuning import TUNING
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
class VerifyTimeCurve:
    """t_verify(d): the verifier's time for a block of d drafted tokens, learned per length
    (moving averages) and read off a weighted least-squares line through them."""

    prior_s: float = TUNING.verify_s_prior
    """t_verify(1) until something is measured."""
    smoothing: float = TUNING.smoothing
    points: dict[int, tuple[float, int]] = field(default_factory=dict)
    """draft length -> (moving average of its seconds, observations)."""

    def observe(self, num_drafted: int, seconds: float) -> None:
        average, count = self.points.get(num_drafted, (seconds, 0))
        self.points[num_drafted] = ((1 - self.smoothing) * average + self.smoothing * seconds, count + 1)

    def seconds(self, num_drafted: int) -> float:
        intercept, slope = self.line()
        return max(0.0, intercept + slope * num_drafted)

    def line(self) -> tuple[float, float]:
        """(intercept, slope) of t_verify(d) = intercept + slope * d."""
        if not self.points:
            return self._through(1, self.prior_s)
        if len(self.points) == 1:
            ((length, (average, _)),) = self.points.items()
            return self._through(length, average)
        weights = {length: min(count, TUNING.max_point_weight) for length, (_, count) in self.points.items()}
        total = sum(weights.values())
        mean_d = sum(weight * length for length, weight in weights.items()) / total
        mean_t = sum(weights[length] * average for length, (average, _) in self.points.items()) / total
        spread = sum(weight * (length - mean_d) ** 2 for length, weight in weights.items())
        covariance = sum(weights[length] * (length - mean_d) * (average - mean_t) for length, (average, _) in self.points.items())
        slope = max(0.0, covariance / spread)  # a longer block never costs less
        return mean_t - slope * mean_d, slope

    @staticmethod
    def _through(length: int, seconds: float) -> tuple[float, float]:
        """A line through one point with the default relative slope: t(d) = t(1) * (1 + s (d - 1))."""
        one_token_s = seconds / (1 + TUNING.relative_slope_prior * (length - 1))
        slope = TUNING.relative_slope_prior * one_token_s
        return one_token_s - slope, slope


@dataclass(frozen=True)
class BlockOutcome:
    """What one verified block taught: acceptance and the three times of the speed model."""

    num_drafted: int
    num_accepted: int
    draft_s_per_token: float | None
    """Measured drafting time per token (None when nothing was drafted for this block)."""
    round_trip_s: float
    verifier_s: float
    """The verifier's own time for the call (its ``timings.total_ms``): round trip - link."""
    num_target_tokens: int | None = None
    """Tokens in the target's forward for the call (the response's ``num_target_tokens``): the
    block and the token before it, or more when the call also prefilled context (a request's
    first call, a resync). None: not known."""

    @property
    def is_block_only(self) -> bool:
        """Whether the verifier's time is that of the block alone, with no prefill in it."""
        return self.num_target_tokens is None or self.num_target_tokens <= self.num_drafted + 1


@dataclass
class FixedDraftLength:
    length: int

    def __post_init__(self) -> None:
        if self.length < 1:
            raise ValueError(f"draft length must be >= 1, got {self.length}")

    def for_request(self) -> FixedDraftLength:
        return self

    def within(self, limit: int) -> FixedDraftLength:
        """This length, or ``limit`` if shorter (the verifier's longest block)."""
        return FixedDraftLength(min(self.length, limit))

    def next_length(self) -> int:
        return self.length

    def observe(self, outcome: BlockOutcome) -> None:
        """A fixed length learns nothing."""


@dataclass
class AdaptiveDraftLength:
    """The service-wide state of the adaptive rule: timings (a property of the machines and the
    link, shared by all requests) and the acceptance prior a new request starts from."""

    max_length: int = 16
    overlap: bool = False
    """Whether the engine drafts ahead while a block is verified (changes the cost model)."""
    smoothing: float = TUNING.smoothing
    """Weight of the newest observation in a request's moving averages."""
    prior_smoothing: float = TUNING.prior_smoothing
    """Weight of each block in the acceptance prior carried across requests."""
    prior_trials: float = TUNING.prior_trials
    """How many blocks' worth of trials the prior counts for in a new request's estimate."""
    initial_acceptance: float = TUNING.acceptance_prior
    """The acceptance prior before any block was verified."""
    draft_s_per_token: float = TUNING.draft_s_per_token_prior
    link_s: float = TUNING.link_s_prior
    verify_curve: VerifyTimeCurve = field(default_factory=VerifyTimeCurve)
    prior_accepted: float = field(init=False)
    prior_trials_per_block: float = field(init=False)

    def __post_init__(self) -> None:
        if self.max_length < 1 or not 0 < self.smoothing <= 1 or not 0 < self.prior_smoothing <= 1:
            raise ValueError("max_length must be >= 1 and smoothing, prior_smoothing in (0, 1]")
        if not 0 <= self.initial_acceptance < 1:
            raise ValueError("initial_acceptance must be in [0, 1)")
        self.prior_accepted, self.prior_trials_per_block = self.initial_acceptance, 1.0

    @property
    def acceptance_prior(self) -> float:
        """Accepted / trials over recent blocks of all requests (ratio of moving averages)."""
        return self.prior_accepted / self.prior_trials_per_block

    def for_request(self) -> RequestDraftLength:
        return RequestDraftLength(self)

    def within(self, limit: int) -> AdaptiveDraftLength:
        """The same rule choosing at most ``limit`` (the verifier's longest block)."""
        return replace(self, max_length=min(self.max_length, limit))

    def best_length(self, acceptance_rate: float) -> int:
        """argmax over d in [1, max_length] of expected tokens per second."""

        def rate(num_drafted: int) -> float:
            verify_s = self.verify_curve.seconds(num_drafted)
            return tokens_per_s(num_drafted, acceptance_rate, self.draft_s_per_token, self.link_s, verify_s, self.overlap)

        return max(range(1, self.max_length + 1), key=rate)

    def observe_times(self, outcome: BlockOutcome) -> None:
        """Learn t_draft, t_link and t_verify(d). A call that also prefilled context (a prompt
        of hundreds of tokens: seconds, against a block's fraction of one) says nothing about
        t_verify(d), and once averaged in it would read as "this length is slow" for many blocks."""
        if outcome.draft_s_per_token is not None:
            self.draft_s_per_token = self._blend(self.draft_s_per_token, outcome.draft_s_per_token)
        self.link_s = self._blend(self.link_s, max(0.0, outcome.round_trip_s - outcome.verifier_s))
        if outcome.is_block_only:
            self.verify_curve.observe(outcome.num_drafted, outcome.verifier_s)

    def observe_acceptance(self, num_accepted: int, trials: int) -> None:
        weight = self.prior_smoothing
        self.prior_accepted = (1 - weight) * self.prior_accepted + weight * num_accepted
        self.prior_trials_per_block = (1 - weight) * self.prior_trials_per_block + weight * trials

    def _blend(self, old: float, new: float) -> float:
        return (1 - self.smoothing) * old + self.smoothing * new


@dataclass
class RequestDraftLength:
    """One request's policy: its own acceptance estimate, started from the shared prior."""

    shared: AdaptiveDraftLength
    accepted_per_block: float = field(init=False)
    trials_per_block: float = field(init=False)

    def __post_init__(self) -> None:
        # The prior counts as prior_trials trials at the prior rate.
        self.trials_per_block = self.shared.prior_trials
        self.accepted_per_block = self.shared.acceptance_prior * self.shared.prior_trials

    @property
    def acceptance_rate(self) -> float:
        return min(0.99, self.accepted_per_block / self.trials_per_block)

    def next_length(self) -> int:
        return self.shared.best_length(self.acceptance_rate)

    def observe(self, outcome: BlockOutcome) -> None:
        # A block of 0 (the prompt-only first call) teaches nothing: no drafted token was tried,
        # and its verifier time is the target's prefill of the whole prompt, not t_verify(0).
        if outcome.num_drafted < 1:
            return
        # Each drafted token up to the first rejection is one trial of rate a (all accepted: d
        # trials). The estimate is the ratio of the averages, accepted / trials, which converges
        # to a; the average of the per-block ratios k / (k + 1) does not (it reads a = 0.8 as
        # about 0.6 with blocks of 16, and so picks blocks too short).
        trials = outcome.num_accepted + (0 if outcome.num_accepted == outcome.num_drafted else 1)
        smoothing = self.shared.smoothing
        self.accepted_per_block = (1 - smoothing) * self.accepted_per_block + smoothing * outcome.num_accepted
        self.trials_per_block = (1 - smoothing) * self.trials_per_block + smoothing * trials
        self.shared.observe_acceptance(outcome.num_accepted, trials)
        self.shared.observe_times(outcome)


DraftLengthPolicy = FixedDraftLength | AdaptiveDraftLength
"""What chooses the draft length, service-wide: ``for_request()`` gives one request's own policy
(a fixed length is its own), which answers ``next_length()`` before each block and
``observe``s each verified block."""


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
