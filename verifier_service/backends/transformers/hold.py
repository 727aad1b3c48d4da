"""When a forward about to start should wait for sessions whose next call is due soon.

Glossary:
    queued      the sessions whose calls wait for the next forward (Q of them, R_q rows)
    due         sessions not queued whose next call is expected within the wait w (D, R_d rows)
    t(R)        a forward's seconds over R rows (``advice.ForwardCurve``, as measured)
    S           what merging saves: t(R_q) + t(R_d) - t(R_q + R_d); on a line t(R) = a + b R it
                is the fixed part a every forward pays (reading the weights: on the AVX2 CPU
                ~0.37 s of a 0.43 s one-row forward, on a GPU nearly all of a small forward)
    E           what the due rows add to the queued sessions' forward: t(R_q + R_d) - t(R_q)
                (b R_d on a line: each row's arithmetic)
    saturated   the target's forwards follow each other (``advice.Saturation``)

Two plans, the same rows either way:

    now     run the queued rows now; the due sessions arrive during that forward and get one of
            their own: the queued answered after t(R_q), the due after t(R_q) + t(R_d)
    hold    wait w, then one forward for all: everyone answered after w + t(R_q + R_d)

Summed over the sessions, hold - now = (Q + D) w - D S + Q E: the due sessions gain what merging
saves less the wait, the queued pay the wait and the due sessions' rows. With the target
saturated the queued sessions' next calls arrive before the due sessions' own forward ends and
wait for it: "now" costs them t(R_d) more in the next round, and hold - now = (Q + D)(w - S).
So, saturated, hold while w < S: merging saves that much target time, which is the committed
tokens per second of all sessions (the same tokens in w + t(R_q + R_d) instead of t(R_q) +
t(R_d)); once merged, their calls stay together.

Unless some queued sessions return at once (``returning``: steps the verifier continues a
session by, Q_r of them, R_r rows, committing T_r tokens): then "now" does not leave the due
sessions a forward of their own, they join the returning ones in the next, t(R_r + R_d), and
those commit another T_r tokens in it. Saturated, compare the rates: hold commits T_q + T_d in
w + t(R_q + R_d), now T_q + T_r + T_d in t(R_q) + t(R_r + R_d); hold while
w < (T_q + T_d) (t(R_q) + t(R_r + R_d)) / (T_q + T_r + T_d) - t(R_q + R_d), which is S when
nothing returns. Example, Run J's Zen 4 past its knee (t(2) = 0.247, t(6) = 0.266, t(8) = 0.274 s),
six continued sessions and an edge's block of one drafted token (2 rows, ~2 tokens): w < 34 ms,
where S would allow 238 ms (measured: the forwards waited 60-80 ms for such edges, 14 % of the
target's time at N = 8). Not saturated, hold while
(Q + D) w < D S - Q E: past the knee (rows dear) a forward rarely waits for others' rows. On a
measured curve S is large while R_q + R_d stays below the knee and shrinks past it.

Everything here is pure arithmetic on plain numbers: the scheduler feeds it its measurements.
"""

from __future__ import annotations

from dataclasses import dataclass

from verifier_service.backends.transformers.advice import ForwardTime


@dataclass(frozen=True)
class Sessions:
    """A group of sessions, the rows they feed the forward and the tokens that commits (at
    least one a session; None: one a session)."""

    count: int
    rows: int
    expected_tokens: float | None = None

    @property
    def tokens(self) -> float:
        return float(self.count) if self.expected_tokens is None else self.expected_tokens


NOBODY = Sessions(0, 0)


def hold_is_worth(
    wait_s: float,
    cost: ForwardTime,
    queued: Sessions,
    due: Sessions,
    saturated: bool,
    scale: float = 1.0,
    returning: Sessions = NOBODY,
) -> bool:
    """Whether waiting ``wait_s`` for the ``due`` sessions beats running the ``queued`` ones now
    (module docstring), under the forward cost ``cost`` (t(R)); ``returning``: those of the
    queued whose next call comes the moment they are answered. ``scale`` multiplies the wait the
    rule allows (0: never hold)."""
    if due.count == 0 or scale <= 0 or wait_s < 0:
        return False
    merged_s = cost.seconds(queued.rows + due.rows)
    saving_s = cost.seconds(queued.rows) + cost.seconds(due.rows) - merged_s
    if saturated:
        now_tokens = queued.tokens + returning.tokens + due.tokens
        now_s = cost.seconds(queued.rows) + cost.seconds(returning.rows + due.rows)
        allowed_s = (queued.tokens + due.tokens) * now_s / now_tokens - merged_s
    else:
        added_s = merged_s - cost.seconds(queued.rows)
        allowed_s = (due.count * saving_s - queued.count * added_s) / (queued.count + due.count)
    return wait_s < scale * allowed_s


def latest_worth_holding(
    due: list[tuple[float, int, float]],
    cost: ForwardTime,
    queued: Sessions,
    saturated: bool,
    scale: float = 1.0,
    returning: Sessions = NOBODY,
) -> float | None:
    """Of the sessions due after ``due`` = [(wait_s, rows, tokens), ...], the longest wait worth
    holding the forward for: the due sessions are taken in order of their wait, all those due
    sooner than the one waited for joining the forward too. None: start now."""
    best = None
    rows, tokens = 0, 0.0
    for count, (wait_s, session_rows, session_tokens) in enumerate(sorted(due), start=1):
        rows += session_rows
        tokens += session_tokens
        if hold_is_worth(wait_s, cost, queued, Sessions(count, rows, tokens), saturated, scale, returning):
            best = wait_s
    return best
