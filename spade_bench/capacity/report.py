"""Capacity benchmark numbers: per mode and user count N, from each emulated user's result and
the verifier's /metrics before and after the level ran.

    aggregate tok/s     all users' generated tokens / (last user done - first user started)
    user tok/s          one user's tokens / its own wall time; p50 and p99 (the speed 99 % of
                        users reach, i.e. the 1st percentile: with few users, the slowest)
    TTFT                request start -> first token (SPADE: first verify answer)
    CPU s/token         the verifier's CPU seconds over the level (its whole process tree, as
                        /proc counts it: vLLM's engine runs in child processes; else its
                        process_cpu_seconds_total) / all users' tokens
    queue ms            wait for the target per call: mean (spade_verifier_queue_seconds sum/count)
                        and p50 (interpolated in that histogram's buckets, as Prometheus does)
    batch               sessions per forward, averaged over calls (spade_verifier_batch_sessions)
    sessions/forward    calls answered by forwards / model forwards (the verifier's
                        spade_verifier_model_forwards_total; n/a where it has no such counter)
    rows/token          rows fed to the model (spade_verifier_model_forward_rows_total) / all
                        users' tokens: target-only computes 1 (+ its prefill), SPADE ~1.5
    block               drafted tokens per verify call (the emulated edges' policy at work); cut:
                        calls whose block the verifier verified only in part (its advice)
    max N at target     the largest N whose user tok/s p99 still meets --user-tokens-per-s
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from pathlib import Path

SPADE = "spade"
"""Emulated edges (``emulated_edge``) that ignore the verifier's advice."""
ADVICE = "spade+advice"
"""Emulated edges that cap each block at the verifier's advice."""
CONTINUE = "spade+continue"
"""Emulated edges that follow advice and let a saturated verifier continue their sessions by
itself (``--max-continued-tokens``; the real edge's default)."""
PIPE = "spade+pipe"
"""Emulated edges on the pipelined-session wire (``pipelined_edge``): drafting continuously,
proposing as they draft, the verifier decoding their sessions in every forward."""
REPLAY = "replay"
"""Edges replaying the recorded verify calls (fixed blocks)."""
TARGET = "target"
SPADE_MODES = (SPADE, ADVICE, CONTINUE, PIPE, REPLAY)
EMULATED_MODES = (SPADE, ADVICE, CONTINUE)
"""The modes whose users are emulated edges (``emulated_edge``)."""
VERIFIER_CPU = "verifier_tree_cpu_seconds"
"""The key run_level gives the verifier's process-tree CPU seconds in its metrics delta."""
QUEUE_P50_MS = "queue_ms_p50"
"""The key run_level gives the level's queue time p50 (from the histogram's buckets)."""
QUEUE_HISTOGRAM = "spade_verifier_queue_seconds"
MODEL_FORWARDS = "spade_verifier_model_forwards_total"
MODEL_ROWS = "spade_verifier_model_forward_rows_total"
AHEAD_USED = 'spade_verifier_ahead_tokens_total{outcome="used"}'
AHEAD_DROPPED = 'spade_verifier_ahead_tokens_total{outcome="dropped"}'
PIPE_PROPOSED = 'spade_verifier_pipeline_tokens_total{source="proposal"}'
PIPE_STALE = 'spade_verifier_pipeline_proposals_total{outcome="stale"}'


@dataclass(frozen=True)
class UserResult:
    mode: str
    tokens: int
    started_at: float
    finished_at: float
    ttft_s: float | None
    num_calls: int = 0
    num_mismatches: int = 0
    """Verify answers that differ from the recording (the session then replays inexactly)."""
    queue_ms: tuple[float, ...] = ()
    num_drafted: int = 0
    num_cut: int = 0
    """Calls whose block the verifier verified only in part (cut to its advice)."""
    num_continued: int = 0
    """Tokens the verifier continued with by itself (``CONTINUE``)."""

    @property
    def wall_s(self) -> float:
        return self.finished_at - self.started_at

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.wall_s if self.wall_s > 0 else 0.0


@dataclass(frozen=True)
class LevelRow:
    mode: str
    num_users: int
    tokens: int
    makespan_s: float
    aggregate_tok_s: float
    user_tok_s_p50: float
    user_tok_s_p99: float
    ttft_p50_s: float | None
    ttft_p99_s: float | None
    cpu_s_per_token: float | None
    queue_ms_mean: float | None
    mean_batch: float | None
    num_mismatches: int
    sessions_per_forward: float | None = None
    rows_per_token: float | None = None
    queue_ms_p50: float | None = None
    mean_block: float | None = None
    """Drafted tokens per verify call (None for target-only)."""
    num_cut: int = 0
    user_wall_p50_s: float | None = None
    continued_share: float | None = None
    """Of the tokens, those the verifier continued with by itself (None for target-only)."""
    ahead_share: float | None = None
    """Of the tokens, those the verifier decided ahead of a call (``--step-ahead-tokens``) that a
    call then used (None: the verifier does not step ahead)."""
    ahead_dropped: float | None = None
    """Steps decided ahead and dropped, per token (wasted target rows)."""
    proposal_share: float | None = None
    """Of the tokens, accepted proposed drafts (``PIPE``; None for the other modes)."""
    stale_proposals: float | None = None
    """Proposals contradicted before a forward read them, per token (``PIPE``)."""
    drafted_per_token: float | None = None
    """Tokens the ``PIPE`` edges drafted per token, rolled-back and interrupted ones included: their
    drafting work (None for the other modes, whose drafts ahead of a call are not counted)."""

    def to_dict(self) -> dict:
        return asdict(self)


def percentile(values: list[float], q: float) -> float | None:
    """Linear-interpolated percentile ``q`` in [0, 100]; None for no values."""
    return percentile_of_some(values, q) if values else None


def percentile_of_some(values: list[float], q: float) -> float:
    """Linear-interpolated percentile ``q`` in [0, 100] of at least one value."""
    if not values:
        raise ValueError("no values to take a percentile of")
    ordered = sorted(values)
    position = (len(ordered) - 1) * q / 100.0
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def _ratio(numerator: float | None, denominator: float | None) -> float | None:
    if numerator is None or not denominator:
        return None
    return numerator / denominator


def level_row(mode: str, users: list[UserResult], metrics_delta: dict[str, float]) -> LevelRow:
    """One (mode, N) row from its users and the verifier's /metrics delta over the level."""
    tokens = sum(user.tokens for user in users)
    makespan = max(u.finished_at for u in users) - min(u.started_at for u in users)
    speeds = [user.tokens_per_s for user in users]
    ttfts = [user.ttft_s for user in users if user.ttft_s is not None]
    return LevelRow(
        mode=mode,
        num_users=len(users),
        tokens=tokens,
        makespan_s=makespan,
        aggregate_tok_s=tokens / makespan if makespan > 0 else 0.0,
        user_tok_s_p50=percentile_of_some(speeds, 50),
        user_tok_s_p99=percentile_of_some(speeds, 1),
        ttft_p50_s=percentile(ttfts, 50),
        ttft_p99_s=percentile(ttfts, 99),
        cpu_s_per_token=_ratio(metrics_delta.get(VERIFIER_CPU, metrics_delta.get("process_cpu_seconds_total")), tokens),
        queue_ms_mean=_ratio(
            _scaled(metrics_delta.get("spade_verifier_queue_seconds_sum"), 1e3), metrics_delta.get("spade_verifier_queue_seconds_count")
        ),
        mean_batch=_ratio(metrics_delta.get("spade_verifier_batch_sessions_sum"), metrics_delta.get("spade_verifier_batch_sessions_count")),
        num_mismatches=sum(user.num_mismatches for user in users),
        sessions_per_forward=_ratio(metrics_delta.get("spade_verifier_queue_seconds_count"), metrics_delta.get(MODEL_FORWARDS)),
        rows_per_token=_ratio(metrics_delta.get(MODEL_ROWS), tokens),
        queue_ms_p50=metrics_delta.get(QUEUE_P50_MS),
        mean_block=_ratio(sum(user.num_drafted for user in users), sum(user.num_calls for user in users)) if mode != TARGET else None,
        num_cut=sum(user.num_cut for user in users),
        user_wall_p50_s=percentile([user.wall_s for user in users], 50),
        continued_share=_ratio(sum(user.num_continued for user in users), tokens) if mode != TARGET else None,
        ahead_share=_ratio(metrics_delta.get(AHEAD_USED), tokens) if mode != TARGET and AHEAD_USED in metrics_delta else None,
        ahead_dropped=_ratio(metrics_delta.get(AHEAD_DROPPED), tokens) if mode != TARGET and AHEAD_DROPPED in metrics_delta else None,
        proposal_share=_ratio(metrics_delta.get(PIPE_PROPOSED), tokens) if mode.startswith(PIPE) else None,
        drafted_per_token=_ratio(sum(user.num_drafted for user in users), tokens) if mode.startswith(PIPE) else None,
        stale_proposals=_ratio(metrics_delta.get(PIPE_STALE), tokens) if mode.startswith(PIPE) else None,
    )


def prefill_bound(row: LevelRow) -> float | None:
    """What SPADE could reach against this target-only row if its decoding cost nothing: the
    users' time over their time to first token (p50s). The prefill is the same work in both
    modes, so with long prompts and short answers it bounds the gain."""
    return _ratio(row.user_wall_p50_s, row.ttft_p50_s) if row.mode == TARGET else None


def histogram_buckets(text: str, name: str) -> dict[float, float]:
    """A Prometheus histogram's cumulative bucket counts {upper bound: count} from /metrics text,
    summed over its other labels; ``le="+Inf"`` is ``math.inf``."""
    buckets: dict[float, float] = {}
    prefix = name + "_bucket{"
    for line in text.splitlines():
        if not line.startswith(prefix):
            continue
        labels, _, rest = line[len(prefix) :].rpartition("}")
        bound = next((label.split("=", 1)[1].strip('"') for label in labels.split(",") if label.startswith("le=")), None)
        try:
            upper, count = float(bound) if bound is not None else None, float(rest.split()[0])
        except (ValueError, IndexError):
            continue
        if upper is not None:
            buckets[upper] = buckets.get(upper, 0.0) + count
    return buckets


def histogram_quantile(buckets: dict[float, float], q: float) -> float | None:
    """Quantile ``q`` in [0, 1] of cumulative buckets, interpolated linearly within the bucket it
    falls in (Prometheus' histogram_quantile); in the +Inf bucket, the highest finite bound.
    None for no observations. Example: {0.01: 2, 0.1: 6, inf: 6}, q = 0.5 -> rank 3, one of the
    4 observations in (0.01, 0.1] -> 0.01 + 0.09 / 4 = 0.0325."""
    bounds = sorted(buckets)
    total = buckets[bounds[-1]] if bounds else 0.0
    if total <= 0:
        return None
    rank, lower, below = q * total, 0.0, 0.0
    for bound in bounds:
        count = buckets[bound]
        if count >= rank:
            if math.isinf(bound):
                return lower
            return lower + (bound - lower) * ((rank - below) / (count - below) if count > below else 0.0)
        lower, below = bound, count
    return lower


def _scaled(value: float | None, factor: float) -> float | None:
    return None if value is None else value * factor


def max_users_at(rows: list[LevelRow], mode: str, user_tokens_per_s: float) -> int | None:
    """The largest N whose p99 user speed meets the target (None: not even one user)."""
    meeting = [row.num_users for row in rows if row.mode == mode and row.user_tok_s_p99 >= user_tokens_per_s]
    return max(meeting) if meeting else None


def _fmt(value: float | None, digits: int = 2) -> str:
    return "–" if value is None else f"{value:.{digits}f}"


def _metric(value: float | None, digits: int = 2) -> str:
    """A value read from the verifier's /metrics: n/a while the verifier has no such metric."""
    return "n/a" if value is None else f"{value:.{digits}f}"


def markdown_table(rows: list[LevelRow], user_tokens_per_s: float) -> str:
    """The capacity table: per N, target-only, then each SPADE mode; SPADE's aggregate also as a
    multiple of target-only's at the same N."""
    target_rate = {row.num_users: row.aggregate_tok_s for row in rows if row.mode == TARGET}
    lines = [
        "| N | mode | aggregate tok/s | × target | user tok/s p50 | user tok/s p99 | TTFT p50 s | TTFT p99 s "
        "| verifier CPU s/tok | sessions/forward | rows/token | queue ms p50 | block | cut | continued | ahead used / dropped "
        "| proposed / stale | mismatches |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in sorted(rows, key=lambda r: (r.num_users, r.mode != TARGET, r.mode)):
        ratio = _ratio(row.aggregate_tok_s, target_rate.get(row.num_users))
        is_spade = row.mode != TARGET
        lines.append(
            f"| {row.num_users} | {row.mode} | {row.aggregate_tok_s:.2f} | {_fmt(ratio)}× | {row.user_tok_s_p50:.2f} "
            f"| {row.user_tok_s_p99:.2f} | {_fmt(row.ttft_p50_s)} | {_fmt(row.ttft_p99_s)} | {_fmt(row.cpu_s_per_token, 3)} "
            f"| {_metric(row.sessions_per_forward)} | {_metric(row.rows_per_token)} | {_metric(row.queue_ms_p50, 0)} "
            f"| {_fmt(row.mean_block, 1)} | {row.num_cut if is_spade else '–'} | {_fmt(row.continued_share)} "
            f"| {_ahead(row)} | {_proposed(row)} | {row.num_mismatches if is_spade else '–'} |"
        )
    bounds = [f"N = {row.num_users}: {_fmt(prefill_bound(row))}×" for row in sorted(rows, key=lambda r: r.num_users) if row.mode == TARGET]
    if bounds:
        lines.append(
            "\nPrefill bound (target-only's user time / its TTFT, p50s: SPADE's ceiling were decoding free) — " + ", ".join(bounds) + "."
        )
    modes = sorted({row.mode for row in rows})
    capacity = ", ".join(f"{mode}: {max_users_at(rows, mode, user_tokens_per_s) or 0}" for mode in modes)
    lines.append(f"\nLargest N with every user (p99) at ≥ {user_tokens_per_s:g} tok/s — {capacity} (of the N run).")
    return "\n".join(lines)


def _ahead(row: LevelRow) -> str:
    """Tokens decided ahead and used / dropped, per token; – where the verifier stepped none."""
    if not row.ahead_share and not row.ahead_dropped:
        return "–"
    return f"{_fmt(row.ahead_share)} / {_fmt(row.ahead_dropped)}"


def _proposed(row: LevelRow) -> str:
    """Tokens from accepted proposals / stale proposals, per token; – off the pipelined wire."""
    if row.proposal_share is None:
        return "–"
    return f"{_fmt(row.proposal_share)} / {_fmt(row.stale_proposals)}"


def write_plots(rows: list[LevelRow], directory: Path, title: str = "") -> list[Path]:
    """aggregate tok/s and verifier CPU s/token against N, one line per mode."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    directory.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, field, label in (
        ("capacity_tokens_per_s.png", "aggregate_tok_s", "aggregate tokens/s"),
        ("capacity_cpu_per_token.png", "cpu_s_per_token", "verifier CPU s / token"),
    ):
        figure, axes = plt.subplots(figsize=(6.5, 4.2))
        for mode in sorted({row.mode for row in rows}):
            points = sorted((r.num_users, getattr(r, field)) for r in rows if r.mode == mode and getattr(r, field) is not None)
            axes.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=mode)
        axes.set_xscale("log", base=2)
        axes.set_xlabel("concurrent users N")
        axes.set_ylabel(label)
        axes.set_title(f"{label} vs N" + (f"\n{title}" if title else ""), fontsize=10)
        axes.legend()
        axes.grid(alpha=0.3)
        figure.tight_layout()
        path = directory / name
        figure.savefig(path, dpi=110)
        plt.close(figure)
        paths.append(path)
    return paths
