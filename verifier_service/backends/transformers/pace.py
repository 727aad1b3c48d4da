"""Each session's pace, as the scheduler learns it for holding: the gap between its answer and
its next call (mean and spread; a new session is expected after the gap typical of all), the rows
and block its last call fed, its acceptance and its advice. Steps the service continues a session
by (``continued_step``) come with no round trip and teach no gap.

A session held for is awaited a little past its expected time (``hold_late_deviations`` of its
gaps' spread, at most a one-row forward): an edge's gap varies with its block length, and one that
came 10 ms late after its mean would otherwise find the forward gone and fall out of phase.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from verifier_service.backends.transformers.advice import AcceptanceRate
from verifier_service.tuning import TUNING


@dataclass
class GapEstimate:
    """Gaps between an answer and the next call: their moving mean and mean absolute deviation."""

    decay: float = TUNING.gap_decay
    mean_s: float | None = None
    deviation_s: float = 0.0

    def observe(self, gap_s: float) -> None:
        if self.mean_s is None:
            self.mean_s = gap_s
            return
        self.deviation_s = self.decay * self.deviation_s + (1 - self.decay) * abs(gap_s - self.mean_s)
        self.mean_s = self.decay * self.mean_s + (1 - self.decay) * gap_s


@dataclass(frozen=True)
class Arrival:
    """When a session's next call should come, seen from now: its expected wait and the latest
    wait still worth holding for (a call a little late is still likely to come)."""

    expected_s: float
    latest_s: float


def expected_arrival(answered_at: float, gap: GapEstimate, now: float, late_s: float) -> Arrival | None:
    """The next call of a session answered at ``answered_at``, whose gaps are ``gap``: due at
    answered_at + the mean gap, still awaited until ``late_s`` after that. Past its expected
    time, the expected wait is half of what is left of the window; past the window, None.

    Example: answered at 10.0, mean gap 0.1, late_s 0.04: at 10.05 -> (0.05, 0.09); at 10.12 ->
    (0.01, 0.02); at 10.15 -> None."""
    if gap.mean_s is None:
        return None
    due_at = answered_at + gap.mean_s
    latest_s = due_at + late_s - now
    if latest_s < 0:
        return None
    expected_s = due_at - now if now <= due_at else latest_s / 2
    return Arrival(expected_s, latest_s)


@dataclass
class SessionPace:
    """When a session's next call is due: its last answer and its gaps until the next call."""

    answered_at: float | None = None
    gap: GapEstimate = field(default_factory=GapEstimate)
    acceptance: AcceptanceRate = field(default_factory=AcceptanceRate)
    drafts: bool = False
    """The session has sent a drafted block (target-only steps never do)."""
    advice: int | None = None
    rows: int = 1
    """The rows its last answered call fed (what its next call is expected to add to a forward)."""
    drafted: int = 0
    """The block its last answered call carried."""
    continued: bool = False
    """The verifier continues the session (a continued step was answered since its edge last
    sent a block): it is advised the block worth leaving for (``advice.departure_length``)."""

    def arrived(self, now: float) -> float | None:
        """The call came; returns the gap since its last answer (None for its first call)."""
        if self.answered_at is None:
            return None
        gap_s = now - self.answered_at
        self.gap.observe(gap_s)
        self.answered_at = None
        return gap_s

    def arrival(self, now: float, typical: GapEstimate, late_deviations: float, max_late_s: float) -> Arrival | None:
        """When its next call should come (None: not awaited); a session with no gap of its own
        yet is expected after the gap typical of all sessions."""
        if self.answered_at is None:
            return None
        gap = self.gap if self.gap.mean_s is not None else typical
        return expected_arrival(self.answered_at, gap, now, min(late_deviations * gap.deviation_s, max_late_s))
