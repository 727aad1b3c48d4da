"""The run's outputs: the JSON of every request, Markdown tables, and the goals, reported.

The goals come from the issue; they are measured and printed, never asserted: a benchmark that
refuses to report a bad number is no yardstick.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType

from spade_bench.config import DRAFT_MODE, SPADE_MODE, TARGET_MODE
from spade_bench.metrics import GroupSummary, cpu_bound_speedup, find, speedup, summarize
from spade_bench.records import RequestRecord

PAPER_CALLS = MappingProxyType({"spec_bench": (133.25, 30.16), "cnndm": (127.30, 30.79)})
"""The paper's cloud calls per sequence, target-only -> SPADE (greedy, no network)."""


@dataclass(frozen=True)
class Summaries:
    """Every grouping the report shows."""

    by_rtt: list[GroupSummary]
    """label x RTT, all categories pooled."""
    by_rtt_category: list[GroupSummary]
    pooled: list[GroupSummary]
    """label, all RTTs pooled (for what the network does not change)."""
    pooled_category: list[GroupSummary]
    by_dataset: dict[str, list[GroupSummary]]
    """label pooled over RTTs, per data set (for the paper's calls-per-sequence comparison)."""

    @classmethod
    def of(cls, records: list[RequestRecord]) -> Summaries:
        datasets = sorted({record.dataset for record in records})
        return cls(
            by_rtt=summarize(records),
            by_rtt_category=summarize(records, by_category=True),
            pooled=summarize(records, by_rtt=False),
            pooled_category=summarize(records, by_rtt=False, by_category=True),
            by_dataset={name: summarize([r for r in records if r.dataset == name], by_rtt=False) for name in datasets},
        )

    def to_dict(self) -> dict:
        return {
            "by_rtt": [summary.to_dict() for summary in self.by_rtt],
            "by_rtt_category": [summary.to_dict() for summary in self.by_rtt_category],
            "pooled": [summary.to_dict() for summary in self.pooled],
            "pooled_category": [summary.to_dict() for summary in self.pooled_category],
            "by_dataset": {name: [s.to_dict() for s in group] for name, group in self.by_dataset.items()},
        }


def _fmt(value: float | None, digits: int = 2, scale: float = 1.0, suffix: str = "") -> str:
    return "–" if value is None else f"{value * scale:.{digits}f}{suffix}"


def _rtt(value: float | None) -> str:
    return "local" if value is None else f"{value:g}"


def _table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in rows])


def main_table(summaries: Summaries) -> str:
    """Per mode and RTT: speed, target cost, edge cost, link bytes."""
    header = [
        "mode",
        "RTT ms",
        "req",
        "tokens",
        "tok/s",
        "× target",
        "CPU-bound tok/s",
        "× target (CPU-bound)",
        "TTFT s",
        "target passes/tok",
        "verifier CPU s/tok",
        "edge CPU s/tok",
        "up B/req",
        "down B/req",
        "load",
    ]
    rows = []
    for summary in summaries.by_rtt:
        rows.append(
            [
                summary.label,
                _rtt(summary.rtt_ms),
                str(summary.num_requests),
                str(summary.completion_tokens),
                _fmt(summary.tokens_per_s),
                _fmt(speedup(summaries.by_rtt, summary), suffix="×"),
                _fmt(summary.cpu_bound_tokens_per_s),
                _fmt(cpu_bound_speedup(summaries.by_rtt, summary), suffix="×"),
                _fmt(summary.mean_ttft_s),
                _fmt(summary.passes_per_token, 3),
                _fmt(summary.verifier_cpu_per_token, 3),
                _fmt(summary.edge_cpu_per_token, 3),
                f"{summary.bytes_up_per_request:,.0f}",
                f"{summary.bytes_down_per_request:,.0f}",
                _fmt(summary.mean_load_1m, 1),
            ]
        )
    return _table(header, rows)


def cost_table(summaries: Summaries) -> str:
    """Per mode, pooled over RTTs: calls, acceptance, quality."""
    header = [
        "mode",
        "req",
        "passes/seq",
        "passes/tok",
        "fewer passes",
        "target tok/tok",
        "accepted/drafted",
        "mean accepted tokens",
        "identical to target",
        "ROUGE-1",
        "ROUGE-2",
        "ROUGE-L",
    ]
    target = find(summaries.pooled, TARGET_MODE)
    rows = []
    for summary in summaries.pooled:
        rows.append(
            [
                summary.label,
                str(summary.num_requests),
                _fmt(summary.passes_per_sequence, 1),
                _fmt(summary.passes_per_token, 3),
                _fmt(_reduction(summary, target), 1, 100, " %"),
                _fmt(summary.target_tokens_per_token),
                _fmt(summary.acceptance_rate, 1, 100, " %"),
                _fmt(summary.mean_accepted_tokens),
                _fmt(summary.identical_share, 0, 100, " %"),
                _fmt(summary.rouge1, 4),
                _fmt(summary.rouge2, 4),
                _fmt(summary.rougeL, 4),
            ]
        )
    return _table(header, rows)


def category_table(summaries: Summaries) -> str:
    """Mean accepted tokens and passes per token per category (SPADE modes, RTTs pooled)."""
    header = ["mode", "category", "req", "mean accepted tokens", "accepted/drafted", "passes/tok"]
    rows = [
        [
            s.label,
            s.category,
            str(s.num_requests),
            _fmt(s.mean_accepted_tokens),
            _fmt(s.acceptance_rate, 1, 100, " %"),
            _fmt(s.passes_per_token, 3),
        ]
        for s in summaries.pooled_category
        if s.mode == SPADE_MODE
    ]
    return _table(header, rows)


def time_split_table(summaries: Summaries) -> str:
    """Where SPADE's wall time goes, per token: drafting, then the verify round trip (of which the
    target's forward; the rest is link and queueing), then everything else (prefill on the edge,
    streaming, the client). Drafting that waited and verifying alternate, so the parts add up to
    the wall; drafting done during verify calls (overlap) is listed apart, as it costs no wait."""
    header = [
        "mode",
        "RTT ms",
        "wall s/tok",
        "draft s/tok",
        "verify round trip s/tok",
        "target forward s/tok",
        "link + queue s/tok",
        "other s/tok",
        "drafted during verify s/tok",
        "overlap hits",
    ]
    rows = []
    for s in summaries.by_rtt:
        if s.mode != SPADE_MODE or s.draft_s_per_token is None or s.verify_s_per_token is None:
            continue
        wall = s.wall_s / s.completion_tokens if s.completion_tokens else None
        link = None if s.forward_s_per_token is None else s.verify_s_per_token - s.forward_s_per_token
        other = None if wall is None else wall - s.draft_s_per_token - s.verify_s_per_token
        rows.append(
            [
                s.label,
                _rtt(s.rtt_ms),
                _fmt(wall, 3),
                _fmt(s.draft_s_per_token, 3),
                _fmt(s.verify_s_per_token, 3),
                _fmt(s.forward_s_per_token, 3),
                _fmt(link, 3),
                _fmt(other, 3),
                _fmt(s.draft_ahead_s_per_token, 3),
                _fmt(s.overlap_hit_rate, 0, 100, " %"),
            ]
        )
    return _table(header, rows)


def edge_cost_table(summaries: Summaries) -> str:
    """What the edge spends per generated token (SPADE modes, per RTT): its CPU, and every token
    it drafted split by fate: used (accepted, or a drafted-ahead guess confirmed), rejected by
    the target, or drafted ahead and thrown away; beside the speed, the aggregate speed of the
    requests sent at once (``--concurrency``) and the share of their wait spent on drafting."""
    header = [
        "mode",
        "RTT ms",
        "at once",
        "tok/s",
        "aggregate tok/s",
        "edge CPU s/tok",
        "drafted/tok",
        "used/tok",
        "rejected/tok",
        "discarded ahead/tok",
        "edge share of wait",
    ]
    rows = []
    for s in summaries.by_rtt:
        if s.mode != SPADE_MODE:
            continue
        parts = (s.used_drafts_per_token, s.rejected_drafts_per_token, s.discarded_ahead_per_token)
        drafted = None if any(part is None for part in parts) else sum(part or 0.0 for part in parts)
        rows.append(
            [
                s.label,
                _rtt(s.rtt_ms),
                str(s.concurrency),
                _fmt(s.tokens_per_s),
                _fmt(s.aggregate_tokens_per_s),
                _fmt(s.edge_cpu_per_token, 3),
                _fmt(drafted),
                _fmt(s.used_drafts_per_token),
                _fmt(s.rejected_drafts_per_token),
                _fmt(s.discarded_ahead_per_token),
                _fmt(s.edge_wait_share, 0, 100, " %"),
            ]
        )
    return _table(header, rows)


def paper_table(summaries: Summaries) -> str:
    """Cloud calls (target forward passes) per sequence, next to the paper's."""
    header = ["data set", "paper target-only", "paper SPADE", "ours target-only", "ours SPADE (best)", "ours SPADE mode"]
    rows = []
    for dataset, group in summaries.by_dataset.items():
        paper = PAPER_CALLS.get(dataset, (None, None))
        target = find(group, TARGET_MODE)
        best = _best_spade(group)
        rows.append(
            [
                dataset,
                _fmt(paper[0]),
                _fmt(paper[1]),
                _fmt(target.passes_per_sequence if target else None),
                _fmt(best.passes_per_sequence if best else None),
                best.label if best else "–",
            ]
        )
    return _table(header, rows)


def _best_spade(group: list[GroupSummary]) -> GroupSummary | None:
    scored = [(s.passes_per_token, s) for s in group if s.mode == SPADE_MODE and s.passes_per_token is not None]
    return min(scored, key=lambda pair: pair[0])[1] if scored else None


def _reduction(summary: GroupSummary, target: GroupSummary | None) -> float | None:
    if target is None or summary.passes_per_token is None or not target.passes_per_token:
        return None
    return 1.0 - summary.passes_per_token / target.passes_per_token


def goals(summaries: Summaries, is_greedy: bool) -> list[str]:
    """The issue's goals, one line each: measured value, and whether it was met."""
    target = find(summaries.pooled, TARGET_MODE)
    draft = find(summaries.pooled, DRAFT_MODE)
    lines = []
    for spade in (s for s in summaries.pooled if s.mode == SPADE_MODE):
        lines += _spade_goals(summaries, spade, target, draft, is_greedy)
    return lines or ["(no SPADE mode ran: nothing to compare)"]


def _mark(ok: bool | None) -> str:
    return "n/a" if ok is None else ("met" if ok else "NOT met")


def _spade_goals(
    summaries: Summaries, spade: GroupSummary, target: GroupSummary | None, draft: GroupSummary | None, is_greedy: bool
) -> list[str]:
    reduction = _reduction(spade, target)
    cpu_ratio = _ratio(spade.verifier_cpu_per_token, target.verifier_cpu_per_token if target else None)
    lines = [
        f"- {spade.label}: target passes {_fmt(reduction, 1, 100, ' %')} fewer than target-only "
        f"(goal ≥ 76 %{'' if is_greedy else ', stated for temperature 0'}): {_mark(None if reduction is None else reduction >= 0.76)}",
        f"- {spade.label}: verifier CPU s/token {_fmt(cpu_ratio, 1, 100, ' %')} of target-only (goal ≤ 35 %): "
        f"{_mark(None if cpu_ratio is None else cpu_ratio <= 0.35)}",
    ]
    if is_greedy:
        share = spade.identical_share
        lines.append(
            f"- {spade.label}: greedy outputs identical to target-only {_fmt(share, 1, 100, ' %')} "
            f"(goal 100 %): {_mark(None if share is None else share == 1.0)}"
        )
    if spade.rouge1 is not None:
        lines.append(_rouge_goal(spade, target, draft))
    lines.append(_speed_goal(summaries, spade))
    return lines


def _rouge_goal(spade: GroupSummary, target: GroupSummary | None, draft: GroupSummary | None) -> str:
    def triple(summary: GroupSummary | None) -> str:
        return "–" if summary is None else "/".join(_fmt(v, 4) for v in (summary.rouge1, summary.rouge2, summary.rougeL))

    rouge1 = spade.rouge1
    equal = rouge1 is not None and target is not None and target.rouge1 is not None and abs(rouge1 - target.rouge1) < 1e-9
    above = rouge1 is not None and draft is not None and draft.rouge1 is not None and rouge1 > draft.rouge1
    return (
        f"- {spade.label}: ROUGE-1/2/L {triple(spade)} vs target-only {triple(target)} and draft-only "
        f"{triple(draft)} (goal: equal to target, above draft): {_mark(equal and above)}"
    )


def _speed_goal(summaries: Summaries, spade: GroupSummary) -> str:
    rows = [s for s in summaries.by_rtt if s.label == spade.label]
    curve = ", ".join(f"{_rtt(s.rtt_ms)} ms: {_fmt(speedup(summaries.by_rtt, s), suffix='×')}" for s in rows)
    cpu_curve = ", ".join(f"{_rtt(s.rtt_ms)} ms: {_fmt(cpu_bound_speedup(summaries.by_rtt, s), suffix='×')}" for s in rows)
    low_rtt = [speedup(summaries.by_rtt, s) for s in rows if s.rtt_ms is not None and s.rtt_ms <= 20]
    low = [value for value in low_rtt if value is not None]
    verdict = _mark(None if not low else min(low) >= 1.3)
    return f"- {spade.label}: tokens/s vs target-only by RTT — {curve} (CPU-bound: {cpu_curve}) (goal ≥ 1.3× at RTT ≤ 20 ms): {verdict}"


def _ratio(numerator: float | None, denominator: float | None) -> float | None:
    return None if numerator is None or not denominator else numerator / denominator


def markdown_report(summaries: Summaries, is_greedy: bool, conditions: dict) -> str:
    """All tables, the goals, and the run's conditions (placement, link, load) as a list."""
    sections = [
        "## Speed and cost per mode and RTT\n\n" + main_table(summaries),
        "## Target calls, acceptance and quality (RTTs pooled)\n\n" + cost_table(summaries),
        "## Where SPADE's time goes (per generated token)\n\n" + time_split_table(summaries),
        "## The edge's cost per generated token\n\n" + edge_cost_table(summaries),
        "## Cloud calls per sequence vs the paper\n\n" + paper_table(summaries),
        "## Per category (SPADE modes, RTTs pooled)\n\n" + category_table(summaries),
        "## Goals (reported, not asserted)\n\n" + "\n".join(goals(summaries, is_greedy)),
        "## Run conditions\n\n" + "\n".join(f"- {key}: {value}" for key, value in conditions.items()),
    ]
    return "\n\n".join(sections) + "\n"


def write_results(path: Path, records: list[RequestRecord], summaries: Summaries, run_info: dict) -> None:
    """The run's JSON: settings and placement, every request, every summary."""
    payload = {
        "run": run_info,
        "requests": [record.to_dict() for record in records],
        "summaries": summaries.to_dict(),
    }
    path.write_text(json.dumps(payload, indent=1, ensure_ascii=False))


def load_records(path: Path) -> list[RequestRecord]:
    """Records back from a results JSON (or the JSON-lines file written while running)."""
    text = path.read_text()
    if path.suffix == ".jsonl":
        return [RequestRecord.from_dict(json.loads(line)) for line in text.splitlines() if line.strip()]
    return [RequestRecord.from_dict(payload) for payload in json.loads(text)["requests"]]
