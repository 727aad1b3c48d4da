"""The verifier's tuning constants, in one place: how the transformers backend's scheduler learns
each session's pace and the cost of a forward, and how its advice and holding weigh them. None is
a flag (docs/configuration.md has the knobs a deployment sets): each is a measured or reasoned
choice, documented where it is defined, and read as ``TUNING.<name>``. A benchmark that wants to
try another value builds its own ``VerifierTuning`` and hands it where the field is read (the
classes that use one take it as a default, so a test can give another)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class VerifierTuning:
    # --- acceptance: what the advice expects of a session's next block ---------------------------
    acceptance_prior: float = 0.6
    """A new session's acceptance rate (the verifier's one prior), worth ``prior_weight`` drafted
    tokens of evidence."""
    prior_weight: float = 4.0
    acceptance_decay: float = 0.9
    """Per verified block, the weight of what came before (recent blocks count most)."""

    # --- the cost curve t(R) --------------------------------------------------------------------
    curve_decay: float = 0.8
    """Per forward of a row count, the weight of earlier forwards of that row count in t(R)."""
    exact_rows: int = 32
    """Row counts t(R) keeps apart; longer forwards are filed by multiples of 8 rows."""
    max_point_age: int = 500
    """A row count not seen in this many forwards leaves t(R) (the machine's speed may have changed
    since), unless fewer than two would remain."""

    # --- saturation: whether the target's forwards follow each other ---------------------------
    busy_window_s: float = 4.0
    """The recent past the busy fraction is measured over (an exponential window of this scale)."""
    saturation: float = 0.85
    """Busy fraction of the recent past at which the verifier becomes saturated."""
    unsaturation: float = 0.7
    """Busy fraction below which a saturated verifier is no longer so. Between the two it stays as
    it was: under load each forward is followed by a gap of HTTP and answering (idle for the
    target), which puts the fraction near ``saturation``, and without this band the advice
    flickered between the saturated lengths and the verifier's limit (measured at N = 16: 91 of
    244 calls advised 64, and edges sent blocks of 16 into a saturated verifier)."""

    # --- continued sessions: when leaving the forwards for a drafted block pays -----------------
    gap_line_decay: float = 0.95
    """Per observed gap, the weight of the earlier ones in ``advice.TimeAway``'s line."""
    departure_margin: float = 0.05
    """How much more per second a continued session's departure must commit than its staying
    (``advice.departure_length``): what the timeline leaves out, the call's handling on the core
    the forwards run on, a hold it may cause, the measured curve's noise at the knee. Without it
    (and with one forward missed whatever the block), N = 8 on an AVX-512 CPU fell to 0.88x
    target-only: sessions left for gains the timeline put at 0.5-1 % (docs/runs/run-n.md)."""

    # --- the scheduler: chunked prompts and each session's pace --------------------------------
    min_chunk_rows: int = 16
    """Rows of every forward kept for the oldest big call (a long prompt) while one waits."""
    active_s: float = 10.0
    """A session answered this recently, and not known to have ended, counts as active."""
    gap_decay: float = 0.7
    """Weight of the earlier gaps in a session's expected gap between answer and next call."""
    typical_gap_decay: float = 0.9
    """The same for the gap of all sessions together (a session's guess until it has gaps of its own)."""

    # --- the vLLM session route (--backend vllm --pipelined-sessions) -----------------------------
    vllm_speculative_tokens: int = 8
    """Proposed tokens one vLLM step verifies per session at most (vLLM's ``num_speculative_tokens``;
    it sizes every step's buffers for it). An edge's proposal runs a few tokens past what the
    verifier has decided; 8 covers the 4-5 tokens a block is usually accepted for, and is about the
    knee of an AVX-512 CPU's block cost (~9 rows, docs/runs/run-z.md)."""

    def __post_init__(self) -> None:
        fractions = (
            self.acceptance_prior,
            self.acceptance_decay,
            self.curve_decay,
            self.gap_line_decay,
            self.gap_decay,
            self.typical_gap_decay,
        )
        if not all(0 <= value <= 1 for value in fractions) or not 0 < self.unsaturation <= self.saturation <= 1:
            raise ValueError("priors and decays must be within [0, 1], and 0 < unsaturation <= saturation <= 1")
        if (
            min(self.prior_weight, self.busy_window_s, self.active_s, self.departure_margin) < 0
            or min(self.exact_rows, self.max_point_age, self.min_chunk_rows, self.vllm_speculative_tokens) < 1
        ):
            raise ValueError("weights, windows and margins must be >= 0, row counts and ages >= 1")


TUNING = VerifierTuning()
"""The verifier's tuning (frozen: nothing changes it at run time)."""
