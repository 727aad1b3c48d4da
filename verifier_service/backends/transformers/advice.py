"""The verifier's advice to each edge: the longest block it wants next from that session.

Glossary:
    t(R)        the measured time of one forward over R rows (every session's share together)
    alpha       a session's acceptance rate per drafted token (the chance the target keeps the
                next drafted token, given it kept the ones before)
    E(d)        tokens a block of d commits on average: 1 + alpha + ... + alpha^d
                = (1 - alpha^(d + 1)) / (1 - alpha) (the accepted drafts, then one more)
    saturated   the target has been busy nearly all of the recent past: its forwards follow
                each other, and a row one session adds delays everyone's next token
                (``Saturation``: from 85 % busy on, until below 70 %)

Below saturation the verifier has idle time between forwards: a longer block costs the others
nothing, so the advice is the verifier's limit and no edge is held back. Nor is one session
alone, saturated or not (the scheduler's rule): its rows delay nobody else, and its edge's own
policy chooses its speed. Saturated, the verifier maximises the committed tokens per second of
all sessions together, sum E_s(d_s) / t(R) with R = sum (d_s + 1) plus the rows of prompts
being prefilled: starting from d_s = 0, it hands out one drafted row at a time to the session
whose next row is most likely kept (alpha_s^(d_s + 1)), while that raises the rate. Past the CPU's knee every row
costs its full arithmetic, so the blocks shorten toward target-only's one row per token (down
to no block at all, where even one drafted row costs more than it brings); below the knee rows
are nearly free and the blocks stay long.

Worked example: t(R) = 0.25 + 0.02 R s, two sessions of alpha 0.8 and 0.5: rows go to the first
session while 0.8^k beats the rate's break-even, so it gets d = 6 and the second d = 1.

A session the verifier continues (advice 0, its edge lets the verifier decode on: one row and one
token a forward, no round trip) is advised the block worth going back to its edge for
(``departure_length``), 0 where none is. The row plan assumes every session feeds every
forward, but a session that leaves to draft misses the forward that starts when it is answered
(the continued sessions keep the target busy), and more while its edge drafts and the round trip
lasts (``TimeAway``); and the forwards it left are those measured (``ForwardLoad``), not the
plan's. Where more sessions are active than a forward takes, a departing session's place goes
to a waiting one and the plan's frame holds: it leaves for its planned block only where that
pays for the forwards missed at the plan's row price (``departure_pays``). Without
this, past the knee the advice rose from 0 to 1-2 and back with every forward's noise, half the
tokens went through edges' round trips and the forwards waited for them (N = 8: 0.85x
target-only, the target idle 14 % of the time); and below it, a session continued once stayed
so in forwards of 3 rows where a block of 5 would have paid.

Everything here is pure arithmetic on plain numbers: the scheduler feeds it measurements.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass, field
from typing import Protocol, TypeVar

from spade_core.block_yield import expected_tokens
from verifier_service.tuning import TUNING

K = TypeVar("K")


@dataclass
class AcceptanceRate:
    """A session's alpha: accepted drafted tokens over tokens the target judged (every accepted
    one, plus the rejected one where a block stopped short), exponentially weighted."""

    kept: float = TUNING.acceptance_prior * TUNING.prior_weight
    judged: float = TUNING.prior_weight

    def observe(self, num_drafted: int, num_accepted: int) -> None:
        judged = num_accepted + (1 if num_accepted < num_drafted else 0)
        self.kept = self.kept * TUNING.acceptance_decay + num_accepted
        self.judged = self.judged * TUNING.acceptance_decay + judged

    @property
    def alpha(self) -> float:
        return min(0.99, max(0.0, self.kept / self.judged))


class ForwardTime(Protocol):
    """t(R): the seconds of one forward over R rows."""

    def seconds(self, num_rows: int) -> float: ...


@dataclass(frozen=True)
class CostLine:
    """t(R) = fixed_s + per_row_s * R."""

    fixed_s: float
    per_row_s: float

    def seconds(self, num_rows: int) -> float:
        return self.fixed_s + self.per_row_s * num_rows


def row_bucket(num_rows: int) -> int:
    """The row count a forward is filed under: itself up to 32 rows, then multiples of 8."""
    return num_rows if num_rows <= TUNING.exact_rows else 8 * round(num_rows / 8)


@dataclass
class ForwardCurve:
    """t(R) as measured: per row count (``row_bucket``), the moving mean of recent forwards'
    seconds; between row counts, straight lines; the points made non-decreasing in R first
    (pooled where noise put a longer forward below a shorter one); past the largest row count
    seen, the steeper of the last segment and the chord from the smallest. A CPU's forward is
    nearly flat up to its knee and a row's full arithmetic past it (docs/runs/run-j.md and run-r.md,
    the row tables): no line fits both, and a line through forwards on both sides makes rows below the
    knee look dear and merging forwards look cheap.

    Example: forwards of 2, 6 and 12 rows took 0.24, 0.26 and 0.38 s -> t(4) = 0.25,
    t(1) = 0.235, t(16) = 0.46 (the last segment's 0.02 s a row)."""

    decay: float = TUNING.curve_decay
    points: dict[int, float] = field(default_factory=dict)
    """Row count -> moving mean of the seconds of its forwards."""
    _monotone: tuple[list[int], list[float]] | None = field(default=None, init=False, repr=False)
    """``points`` sorted and made non-decreasing, until the next forward is observed."""
    _last_seen: dict[int, int] = field(default_factory=dict, init=False, repr=False)
    """Row count -> the number of the forward that last updated it."""
    _num_forwards: int = field(default=0, init=False, repr=False)

    def observe(self, num_rows: int, seconds: float) -> None:
        bucket = row_bucket(num_rows)
        previous = self.points.get(bucket)
        self.points[bucket] = seconds if previous is None else self.decay * previous + (1 - self.decay) * seconds
        self._num_forwards += 1
        self._last_seen[bucket] = self._num_forwards
        stale = [row for row in self.points if self._num_forwards - self._last_seen.get(row, 0) > TUNING.max_point_age]
        for row in stale[: max(0, len(self.points) - 2)]:
            del self.points[row]
            self._last_seen.pop(row, None)
        self._monotone = None

    @property
    def is_known(self) -> bool:
        """Forwards of two row counts at least have been seen (before that, no slope)."""
        return len(self.points) >= 2

    def seconds(self, num_rows: int) -> float:
        if not self.is_known:
            raise ValueError("the forward curve needs forwards of two row counts first")
        if self._monotone is None:
            self._monotone = _monotone_points(self.points)
        rows, times = self._monotone
        if num_rows <= rows[0]:
            slope = (times[1] - times[0]) / (rows[1] - rows[0])
            return max(0.0, times[0] - slope * (rows[0] - num_rows))
        if num_rows >= rows[-1]:
            slope = max((times[-1] - times[-2]) / (rows[-1] - rows[-2]), (times[-1] - times[0]) / (rows[-1] - rows[0]))
            return times[-1] + slope * (num_rows - rows[-1])
        right = bisect.bisect_left(rows, num_rows)
        left = right - 1
        share = (num_rows - rows[left]) / (rows[right] - rows[left])
        return times[left] + share * (times[right] - times[left])


def _monotone_points(points: dict[int, float]) -> tuple[list[int], list[float]]:
    """The points sorted by rows, their times made non-decreasing by pooling adjacent violators
    (each pool takes its mean)."""
    rows = sorted(points)
    pools: list[tuple[float, int]] = []  # (mean time, points pooled)
    for row in rows:
        mean, count = points[row], 1
        while pools and pools[-1][0] > mean:
            previous_mean, previous_count = pools.pop()
            mean = (previous_mean * previous_count + mean * count) / (previous_count + count)
            count += previous_count
        pools.append((mean, count))
    times = [mean for mean, count in pools for _ in range(count)]
    return rows, times


@dataclass
class BusyFraction:
    """How much of the recent past the target spent in forwards (exponential window)."""

    busy: float = 0.0
    elapsed: float = 0.0
    last_end: float | None = None

    def observe(self, started: float, ended: float) -> None:
        idle = 0.0 if self.last_end is None else max(0.0, started - self.last_end)
        span = idle + (ended - started)
        decay = math.exp(-span / TUNING.busy_window_s)
        self.busy = self.busy * decay + (ended - started)
        self.elapsed = self.elapsed * decay + span
        self.last_end = ended

    @property
    def fraction(self) -> float:
        return 0.0 if self.elapsed <= 0 else self.busy / self.elapsed


@dataclass
class Saturation:
    """Whether the verifier is saturated, from its busy fraction, with hysteresis: it becomes so
    at ``TUNING.saturation`` and stops only below ``TUNING.unsaturation``."""

    is_saturated: bool = False

    def observe(self, busy_fraction: float) -> bool:
        if busy_fraction >= TUNING.saturation:
            self.is_saturated = True
        elif busy_fraction < TUNING.unsaturation:
            self.is_saturated = False
        return self.is_saturated


def newcomer_length(alphas: dict[K, float], newcomer_alpha: float, cost: ForwardTime, other_rows: int, max_length: int) -> int:
    """The advice for a session that has not drafted yet (its first block comes next): what
    ``advised_lengths`` would give it as one more drafting session of acceptance
    ``newcomer_alpha`` (its prior), beside the drafting sessions ``alphas`` and ``other_rows``
    (which must not count its own row). The others' advice is left as it was planned. Without
    this a newcomer got the verifier's limit and sent a block of 16 into a saturated target."""
    newcomer = object()
    return advised_lengths({**alphas, newcomer: newcomer_alpha}, cost, other_rows, max_length)[newcomer]


def advised_lengths(alphas: dict[K, float], cost: ForwardTime, other_rows: int, max_length: int) -> dict[K, int]:
    """Per session, the block length that maximises all sessions' committed tokens per second
    under the forward cost ``cost`` (t(R)), with ``other_rows`` rows in the forward besides the
    blocks (prompts being prefilled). 0 where no drafted row pays: past the knee a call without
    a block buys one token with its one row (target-only's price), while a drafted row costs as
    much and is kept only with probability alpha (a block of 1 gets 1 + alpha tokens for 2 rows)."""
    lengths = dict.fromkeys(alphas, 0)
    rows = other_rows + len(alphas)
    tokens = float(len(alphas))
    while True:
        candidates = [session for session, length in lengths.items() if length < max_length]
        if not candidates:
            break
        best = max(candidates, key=lambda session: alphas[session] ** (lengths[session] + 1))
        gain = alphas[best] ** (lengths[best] + 1)
        if (tokens + gain) * cost.seconds(rows) <= tokens * cost.seconds(rows + 1):
            break
        lengths[best] += 1
        rows += 1
        tokens += gain
    return lengths


def forwards_missed(away_s: float, forward_s: float) -> int:
    """Forwards that pass while a session that left to draft is away ``away_s``, forwards of
    ``forward_s`` following each other: at least the one that starts when it is answered."""
    return 1 if forward_s <= 0 else max(1, math.ceil(away_s / forward_s))


@dataclass
class TimeAway:
    """How long an edge is away between an answer and its next call, as a line in the block it
    drafts: base_s + per_token_s d (the round trip and the call's handling, then the drafting),
    fitted by exponentially weighted least squares over the calls of all sessions. Until blocks
    of two lengths have been seen, the drafting is unknown (0 a token) and base_s the mean gap.

    Example: gaps of 0.035 s after empty calls and 0.105 s before blocks of 2 -> base 0.035 s,
    0.035 s a drafted token."""

    decay: float = TUNING.gap_line_decay
    weight: float = 0.0
    sum_blocks: float = 0.0
    sum_gaps: float = 0.0
    sum_blocks_squared: float = 0.0
    sum_blocks_gaps: float = 0.0

    def observe(self, num_drafted: int, gap_s: float) -> None:
        self.weight = self.decay * self.weight + 1.0
        self.sum_blocks = self.decay * self.sum_blocks + num_drafted
        self.sum_gaps = self.decay * self.sum_gaps + gap_s
        self.sum_blocks_squared = self.decay * self.sum_blocks_squared + num_drafted * num_drafted
        self.sum_blocks_gaps = self.decay * self.sum_blocks_gaps + num_drafted * gap_s

    def line(self) -> tuple[float, float]:
        """(base_s, per_token_s) of the fitted line; the slope is never below 0 (an edge that
        drafted ahead sent its longer blocks sooner)."""
        if self.weight <= 0:
            return 0.0, 0.0
        mean_block, mean_gap = self.sum_blocks / self.weight, self.sum_gaps / self.weight
        variance = self.sum_blocks_squared / self.weight - mean_block * mean_block
        per_token_s = 0.0 if variance < 1e-6 else max(0.0, (self.sum_blocks_gaps / self.weight - mean_block * mean_gap) / variance)
        return max(0.0, mean_gap - per_token_s * mean_block), per_token_s

    @property
    def per_token_s(self) -> float:
        return self.line()[1]

    @property
    def base_s(self) -> float:
        return self.line()[0]

    def seconds(self, num_drafted: int) -> float:
        base_s, per_token_s = self.line()
        return base_s + per_token_s * num_drafted


def row_price(cost: ForwardTime, num_rows: int, num_tokens: float) -> float:
    """What one more row costs a forward of ``num_rows`` rows that commits ``num_tokens`` tokens,
    in tokens: those the forward's sessions would commit in the time the row adds,
    num_tokens (t(R + 1) - t(R)) / t(R). ``advised_lengths`` gives a session another drafted row
    while the chance it is kept beats this."""
    forward_s = cost.seconds(num_rows)
    return 0.0 if forward_s <= 0 else num_tokens * (cost.seconds(num_rows + 1) - forward_s) / forward_s


def plan_load(alphas: dict[K, float], lengths: dict[K, int], other_rows: int, other_tokens: float) -> tuple[int, float]:
    """A plan's forward: its rows (each session's block + 1, and ``other_rows``) and the tokens
    it commits on average (each session's E(d), and ``other_tokens``)."""
    rows = other_rows + sum(length + 1 for length in lengths.values())
    tokens = other_tokens + sum(expected_tokens(alphas[session], length) for session, length in lengths.items())
    return rows, tokens


def departure_pays(alpha: float, length: int, missed: int, price: float) -> bool:
    """Whether a continued session should go back to its edge for the planned block of
    ``length`` where every forward is full (more sessions than a forward takes, so the row plan's
    frame holds): that commits E(length) tokens with length + 1 rows after ``missed`` forwards
    without it, where staying commits missed + 1 tokens with as many rows; each row priced at
    ``price`` tokens (``row_price``). Example, past a CPU's knee (price 0.7), alpha 0.93, one
    forward missed: a block of 1 gives 1.93 - 1.4 = 0.53 against 2 x 0.3 = 0.6, so it stays; a
    block of 3 (3.6 - 2.8 = 0.8) goes."""
    if length <= 0:
        return False
    return expected_tokens(alpha, length) - price * (length + 1) > (missed + 1) * (1.0 - price)


@dataclass
class ForwardLoad:
    """The rows and committed tokens of the recent forwards of blocks (moving means): the forward
    a continued session is part of, as it is, not as the row plan would have it."""

    decay: float = TUNING.curve_decay
    rows: float | None = None
    tokens: float = 0.0

    def observe(self, num_rows: int, num_tokens: int) -> None:
        if self.rows is None:
            self.rows, self.tokens = float(num_rows), float(num_tokens)
            return
        self.rows = self.decay * self.rows + (1 - self.decay) * num_rows
        self.tokens = self.decay * self.tokens + (1 - self.decay) * num_tokens


def departure_length(alpha: float, away: TimeAway, cost: ForwardTime, load: ForwardLoad, max_length: int) -> int:
    """For a session the verifier continues, part of forwards of ``load`` (its own row and token
    among them): the block worth going back to its edge for, or 0 (stay continued). Away for a
    block of d, it misses m(d) forwards (``forwards_missed`` of ``away``'s time). Over the
    m + 1 forwards its departure spans, staying commits (m + 1) T tokens in (m + 1) t(R);
    leaving, the others commit (m + 1)(T - 1), the session E(d) with its block in the last
    forward: in m t(R - 1) + t(R + d). The (shortest) d of the best such rate, where it beats
    staying by ``TUNING.departure_margin``.

    Example, Run J's Zen 4 (t(2) = 0.247, t(3) = 0.253, t(6) = 0.266, t(8) = 0.274 s, 27 ms a
    row past 8 rows), edges away 35 ms + 34 ms a drafted token: three sessions of alpha 0.75
    continued (R = T = 3): staying commits 11.9 tokens/s, a block of 5 (away 0.2 s, one forward
    missed) 14.0, so the session goes back with 5. Seven continued (R = T = 7): staying commits
    25.9 tokens/s, the best block of a session of alpha 0.93 (3) 26.1, within the margin, so it
    stays."""
    if load.rows is None or max_length <= 0:
        return 0
    num_rows, tokens = max(1, round(load.rows)), max(1.0, load.tokens)
    forward_s, without_s = cost.seconds(num_rows), cost.seconds(num_rows - 1) if num_rows > 1 else 0.0
    if forward_s <= 0:  # a curve extrapolated to nothing: no rate to compare
        return 0
    base_s, per_token_s = away.line()
    best_length, best_rate = 0, (1.0 + TUNING.departure_margin) * tokens / forward_s
    for length in range(1, max_length + 1):
        missed = forwards_missed(base_s + per_token_s * length, forward_s)
        rate = ((missed + 1) * (tokens - 1) + expected_tokens(alpha, length)) / (missed * without_s + cost.seconds(num_rows + length))
        if rate > best_rate:
            best_length, best_rate = length, rate
    return best_length
