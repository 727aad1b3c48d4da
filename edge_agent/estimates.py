"""What the edge knows of its drafting, its link and the target's acceptance, estimated in one
place and read by both of its policies: the draft length (``draft_length``) and how far to draft
ahead (``edge_power``). ``EdgeEstimates`` is service-wide: timings (the machines' and the link's,
shared by every request), the acceptance prior a new request starts from and the rate at which
the target's next token is the draft's guess. ``RequestEstimate`` is one request's own acceptance,
started from that prior; it learns from each verified block (``observe``) and teaches the
service-wide part.

Acceptance is counted as trials: each drafted token up to the first rejection is one trial of
rate a (all accepted: d trials), and the estimate is the ratio of moving averages, accepted /
trials, which converges to a; the average of the per-block ratios k / (k + 1) does not (it reads
a = 0.8 as about 0.6 with blocks of 16, and so picks blocks too short).

Torch-free (the settings import the policies, and ``spade-edge --help`` must not load torch).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from edge_agent.tuning import TUNING


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
class EdgeEstimates:
    """The service-wide estimates: timings, the acceptance prior carried across requests, the
    guess rate. Every prior and weight is the edge's ``Tuning``."""

    smoothing: float = TUNING.smoothing
    """Weight of the newest observation in the moving averages (a request's too)."""
    prior_smoothing: float = TUNING.prior_smoothing
    """Weight of each block in the acceptance prior carried across requests."""
    prior_trials: float = TUNING.prior_trials
    """How many blocks' worth of trials the prior counts for in a new request's estimate."""
    initial_acceptance: float = TUNING.acceptance_prior
    """The acceptance prior before any block was verified."""
    draft_s_per_token: float = TUNING.draft_s_per_token_prior
    link_s: float = TUNING.link_s_prior
    """A verify call's round trip less the verifier's own time."""
    round_trip_s: float = TUNING.round_trip_s_prior
    """A block's verify round trip (link + verifier), from calls that fed the block alone."""
    guess_rate: float = TUNING.guess_rate_prior
    """Share of full acceptances whose next token was the draft's guess (measured where one was drafted)."""
    verify_curve: VerifyTimeCurve = field(default_factory=VerifyTimeCurve)
    prior_accepted: float = field(init=False)
    prior_trials_per_block: float = field(init=False)

    def __post_init__(self) -> None:
        if not 0 < self.smoothing <= 1 or not 0 < self.prior_smoothing <= 1:
            raise ValueError("smoothing and prior_smoothing must be in (0, 1]")
        if not 0 <= self.initial_acceptance < 1:
            raise ValueError("initial_acceptance must be in [0, 1)")
        self.prior_accepted, self.prior_trials_per_block = self.initial_acceptance, 1.0

    @property
    def acceptance_prior(self) -> float:
        """Accepted / trials over recent blocks of all requests (ratio of moving averages)."""
        return self.prior_accepted / self.prior_trials_per_block

    def for_request(self) -> RequestEstimate:
        return RequestEstimate(self)

    def observe_times(self, outcome: BlockOutcome) -> None:
        """Learn t_draft, t_link, t_verify(d) and a block's round trip. A call that also
        prefilled context (a prompt of hundreds of tokens: seconds, against a block's fraction of
        one) says nothing about t_verify(d) or a block's round trip, and once averaged in it would
        read as "this length is slow" for many blocks."""
        if outcome.draft_s_per_token is not None:
            self.draft_s_per_token = self._blend(self.draft_s_per_token, outcome.draft_s_per_token)
        self.link_s = self._blend(self.link_s, max(0.0, outcome.round_trip_s - outcome.verifier_s))
        if outcome.is_block_only:
            self.verify_curve.observe(outcome.num_drafted, outcome.verifier_s)
            self.round_trip_s = self._blend(self.round_trip_s, outcome.round_trip_s)

    def observe_acceptance(self, num_accepted: int, trials: int) -> None:
        weight = self.prior_smoothing
        self.prior_accepted = (1 - weight) * self.prior_accepted + weight * num_accepted
        self.prior_trials_per_block = (1 - weight) * self.prior_trials_per_block + weight * trials

    def observe_guess(self, is_right: bool) -> None:
        """A whole block was accepted after a guess was drafted: was the target's next token it?"""
        self.guess_rate = self._blend(self.guess_rate, float(is_right))

    def _blend(self, old: float, new: float) -> float:
        return (1 - self.smoothing) * old + self.smoothing * new


@dataclass
class RequestEstimate:
    """One request's acceptance estimate, started from the shared prior (worth ``prior_trials``
    trials at the prior rate), and the shared estimates it reads and teaches."""

    shared: EdgeEstimates
    accepted_per_block: float = field(init=False)
    trials_per_block: float = field(init=False)

    def __post_init__(self) -> None:
        self.trials_per_block = self.shared.prior_trials
        self.accepted_per_block = self.shared.acceptance_prior * self.shared.prior_trials

    @property
    def acceptance_rate(self) -> float:
        return min(0.99, self.accepted_per_block / self.trials_per_block)

    def observe(self, outcome: BlockOutcome) -> None:
        """One verified block. A block of 0 (the prompt-only first call) teaches nothing: no
        drafted token was tried, and its verifier time is the target's prefill of the whole
        prompt, not t_verify(0)."""
        if outcome.num_drafted < 1:
            return
        trials = outcome.num_accepted + (0 if outcome.num_accepted == outcome.num_drafted else 1)
        smoothing = self.shared.smoothing
        self.accepted_per_block = (1 - smoothing) * self.accepted_per_block + smoothing * outcome.num_accepted
        self.trials_per_block = (1 - smoothing) * self.trials_per_block + smoothing * trials
        self.shared.observe_acceptance(outcome.num_accepted, trials)
        self.shared.observe_times(outcome)
