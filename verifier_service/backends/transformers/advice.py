"""The verifier's advice to each edge: the longest block it wants next from that session.

Glossary:
    t(R)        the measured time of one forward over R rows (every session's share together)
    alpha       a session's acceptance rate per drafted token (the chance the target keeps the
                next drafted token, given it kept the ones before)
    E(d)        tokens a block of d commits on average: 1 + alpha + ... + alpha^d
                = (1 - alpha^(d + 1)) / (1 - alpha) (the accepted drafts, then one more)
    saturated   the target has been busy nearly all of the recent past: its forwards follow
                each other, and a row one session adds delays everyone's next token

Below saturation the verifier has idle time between forwards: a longer block costs the others
nothing, so the advice is the verifier's limit and no edge is held back (one user alone is never
slowed down). Saturated, the verifier maximises the committed tokens per second of all sessions
together, sum E_s(d_s) / t(R) with R = sum (d_s + 1) plus the rows of prompts being prefilled:
starting from d_s = 0, it hands out one drafted row at a time to the session whose next row is
most likely kept (alpha_s^(d_s + 1)), while that raises the rate. Past the CPU's knee every row
costs its full arithmetic, so the blocks shorten toward target-only's one row per token; below
the knee rows are nearly free and the blocks stay long.

Worked example: t(R) = 0.25 + 0.02 R s, two sessions of alpha 0.8 and 0.5: rows go to the first
session while 0.8^k beats the rate's break-even, so it gets d = 6 and the second d = 1.

Everything here is pure arithmetic on plain numbers: the scheduler feeds it measurements.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TypeVar

K = TypeVar("K")

ACCEPTANCE_PRIOR = 0.6
"""A new session's acceptance rate, worth PRIOR_WEIGHT drafted tokens of evidence."""
PRIOR_WEIGHT = 4.0
ACCEPTANCE_DECAY = 0.9
"""Per verified block, the weight of what came before (recent blocks count most)."""
COST_DECAY = 0.97
"""Per forward, the weight of earlier forwards in the fit of t(R)."""
SATURATION = 0.85
"""Busy fraction of the recent past above which the verifier is saturated."""
BUSY_WINDOW_S = 4.0
"""The recent past the busy fraction is measured over (an exponential window of this scale)."""


@dataclass
class AcceptanceRate:
    """A session's alpha: accepted drafted tokens over tokens the target judged (every accepted
    one, plus the rejected one where a block stopped short), exponentially weighted."""

    kept: float = ACCEPTANCE_PRIOR * PRIOR_WEIGHT
    judged: float = PRIOR_WEIGHT

    def observe(self, num_drafted: int, num_accepted: int) -> None:
        judged = num_accepted + (1 if num_accepted < num_drafted else 0)
        self.kept = self.kept * ACCEPTANCE_DECAY + num_accepted
        self.judged = self.judged * ACCEPTANCE_DECAY + judged

    @property
    def alpha(self) -> float:
        return min(0.99, max(0.0, self.kept / self.judged))


@dataclass
class ForwardCost:
    """t(R) = fixed_s + per_row_s * R, a least-squares line through recent forwards (R rows,
    t seconds), exponentially weighted: the local slope of the real curve where the verifier
    works now (below the knee nearly flat, past it the arithmetic of one more row)."""

    sums: list[float] = field(default_factory=lambda: [0.0] * 5)
    """Weighted sums of 1, R, R^2, t, R t."""

    def observe(self, num_rows: int, seconds: float) -> None:
        terms = (1.0, num_rows, num_rows * num_rows, seconds, num_rows * seconds)
        self.sums = [total * COST_DECAY + term for total, term in zip(self.sums, terms, strict=True)]

    def line(self) -> tuple[float, float] | None:
        """(fixed_s, per_row_s), or None until forwards of different row counts were seen."""
        weight, rows, rows_squared, seconds, rows_seconds = self.sums
        spread = weight * rows_squared - rows * rows
        if weight < 2 or spread <= 1e-9 * max(1.0, weight * rows_squared):
            return None
        per_row_s = max(0.0, (weight * rows_seconds - rows * seconds) / spread)
        fixed_s = max(1e-6, (seconds - per_row_s * rows) / weight)
        return fixed_s, per_row_s


@dataclass
class BusyFraction:
    """How much of the recent past the target spent in forwards (exponential window)."""

    busy: float = 0.0
    elapsed: float = 0.0
    last_end: float | None = None

    def observe(self, started: float, ended: float) -> None:
        idle = 0.0 if self.last_end is None else max(0.0, started - self.last_end)
        span = idle + (ended - started)
        decay = math.exp(-span / BUSY_WINDOW_S)
        self.busy = self.busy * decay + (ended - started)
        self.elapsed = self.elapsed * decay + span
        self.last_end = ended

    @property
    def fraction(self) -> float:
        return 0.0 if self.elapsed <= 0 else self.busy / self.elapsed


def advised_lengths(alphas: dict[K, float], cost: tuple[float, float], other_rows: int, max_length: int) -> dict[K, int]:
    """Per session, the block length that maximises all sessions' committed tokens per second
    under the forward cost ``cost`` = (fixed_s, per_row_s), with ``other_rows`` rows in the
    forward besides the blocks (prompts being prefilled). Never below 1."""
    fixed_s, per_row_s = cost
    lengths = dict.fromkeys(alphas, 0)
    rows = other_rows + len(alphas)
    tokens = float(len(alphas))
    while True:
        candidates = [session for session, length in lengths.items() if length < max_length]
        if not candidates:
            break
        best = max(candidates, key=lambda session: alphas[session] ** (lengths[session] + 1))
        gain = alphas[best] ** (lengths[best] + 1)
        if (tokens + gain) * (fixed_s + per_row_s * rows) <= tokens * (fixed_s + per_row_s * (rows + 1)):
            break
        lengths[best] += 1
        rows += 1
        tokens += gain
    return {session: max(1, length) for session, length in lengths.items()}
