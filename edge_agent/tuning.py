"""The edge's tuning constants, in one place: the priors its draft-length and drafting-ahead
policies start from before anything is measured, how fast their estimates follow what is, and its
health probe's timing. None is a flag (docs/configuration.md has the knobs a user sets): each is a
measured or reasoned choice, documented here, and read as ``TUNING.<name>``; the policy classes
take them as defaults, so a test or benchmark can hand another value."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class EdgeTuning:
    # --- priors: what the policies assume before a block was verified --------------------------
    acceptance_prior: float = 0.7
    """The edge's one acceptance prior: the per-token acceptance rate a new service's first request
    starts from (both the draft-length and the drafting-ahead policy). Later requests start from
    the rate earlier ones measured."""
    guess_rate_prior: float = 0.7
    """Share of full acceptances whose next token is the draft's own guess, until measured."""
    draft_s_per_token_prior: float = 0.02
    """The draft's seconds per token, until a block was drafted."""
    link_s_prior: float = 0.005
    """The link's share of a verify round trip (round trip - the verifier's own time), until measured."""
    round_trip_s_prior: float = 0.1
    """A block's verify round trip (link + verifier), until measured."""
    verify_s_prior: float = 0.05
    """The verifier's time for a block of one drafted token, until measured."""
    relative_slope_prior: float = 0.1
    """Before two draft lengths have been timed, each drafted token is assumed to add this fraction
    of a one-token verify (what a CPU target showed before its kernels packed their weights; it now
    adds less, as a GPU target does: docs/benchmarks.md, "Component measurements"; the learned line
    replaces it)."""

    # --- how estimates follow measurements ------------------------------------------------------
    smoothing: float = 0.2
    """Weight of the newest observation in the moving averages (a request's acceptance, the
    draft's speed, the round trip, the guess rate)."""
    prior_smoothing: float = 0.05
    """Weight of each block in the acceptance prior carried across requests."""
    prior_trials: float = 2.0
    """How many blocks' worth of trials the prior counts for in a new request's estimate."""
    max_point_weight: int = 20
    """A draft length's weight in the verify-time line fit stops growing after this many observations."""

    # --- drafting ahead -----------------------------------------------------------------------
    pending_forward_share: float = 0.5
    """On a miss the forward still running when the verdict lands delays the next block by, on
    average, this share of a draft forward (the drafting thread cannot be interrupted mid-forward)."""

    # --- the pipelined-session wire (--verifier-wire pipelined) --------------------------------
    pipeline_lead_tokens: int = 8
    """Tokens the edge drafts past the decided tokens it holds, at most: a verifier step verifies
    up to about a block's worth (the vLLM route takes 8), and drafts further ahead are more often
    thrown away at a rejection than used (the capacity replay's emulated edges use the same lead)."""

    # --- the health probe ---------------------------------------------------------------------
    probe_ttl_s: float = 1.5
    """How long /health reuses its last probe of the verifier (a health-check storm must not
    become a verifier storm)."""
    probe_timeout_s: float = 1.0
    """The probe's timeout."""

    def __post_init__(self) -> None:
        shares = (self.acceptance_prior, self.guess_rate_prior, self.pending_forward_share)
        if not all(0 <= value <= 1 for value in shares) or not 0 <= self.acceptance_prior < 1:
            raise ValueError("the acceptance prior must be in [0, 1), rates and shares within [0, 1]")
        if not 0 < self.smoothing <= 1 or not 0 < self.prior_smoothing <= 1 or self.max_point_weight < 1:
            raise ValueError("smoothings must be in (0, 1] and max_point_weight >= 1")
        if self.pipeline_lead_tokens < 1:
            raise ValueError("pipeline_lead_tokens must be >= 1")
        if (
            min(
                self.draft_s_per_token_prior,
                self.link_s_prior,
                self.round_trip_s_prior,
                self.verify_s_prior,
                self.probe_ttl_s,
                self.probe_timeout_s,
            )
            < 0
        ):
            raise ValueError("times must be >= 0")


TUNING = EdgeTuning()
"""The edge's tuning (frozen: nothing changes it at run time)."""
