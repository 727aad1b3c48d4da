"""The chaos run's report: ``chaos_report.md`` (also printed), ``results.json`` (every request,
fault and sample) and plots of memory, descriptors and latency over time with the faults
shaded."""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import asdict
from pathlib import Path

from spade_bench.chaos.checks import Check, FaultRecord, MinuteStats, Sample, in_window, incarnations
from spade_bench.chaos.load import RequestRecord


def markdown(
    header: list[str],
    checks: list[Check],
    faults: list[FaultRecord],
    records: list[RequestRecord],
    minutes: list[MinuteStats],
    recovery_bound_s: float,
) -> str:
    lines = ["# Chaos run", "", *header, ""]
    lines += ["## Checks", "", "| check | result | numbers |", "| --- | --- | --- |"]
    lines += [f"| {c.name} | {'pass' if c.passed else '**FAIL**'} | {c.summary} |" for c in checks]
    for check in checks:
        if check.violations:
            lines += ["", f"{check.name}:", *[f"- {violation}" for violation in check.violations]]
    outcomes = Counter(record.outcome for record in records)
    kinds = Counter(
        (("greedy" if r.plan.greedy else "sampled"), ("stream" if r.plan.stream else "whole"), r.plan.endpoint) for r in records
    )
    lines += ["", "## Requests", "", ", ".join(f"{name} {count}" for name, count in sorted(outcomes.items())) or "none", ""]
    lines += [", ".join(f"{' '.join(kind)} {count}" for kind, count in sorted(kinds.items()))]
    lines += [
        "",
        "## Faults",
        "",
        f"Failed requests are counted in each fault's window (its start to its end plus {recovery_bound_s:.0f} s).",
    ]
    lines += [
        "",
        "| start s | kind | over at s | answered again after s | failed in window | detail |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    failed = [record for record in records if record.outcome == "failed"]
    for fault in faults:
        recovered = "n/a" if fault.edges == () else ("never" if fault.recovered_s is None else f"{fault.recovered_s:.1f}")
        in_it = sum(1 for record in failed if in_window(record, fault, recovery_bound_s))
        lines.append(f"| {fault.started_s:.1f} | {fault.kind} | {fault.ended_s:.1f} | {recovered} | {in_it} | {fault.detail} |")
    lines += ["", "## Per minute", "", "| minute | requests | TTFT p50 s | TTFT p99 s | tokens/s |", "| --- | --- | --- | --- | --- |"]
    for stats in minutes:
        ttfts = f"{_seconds(stats.ttft_p50_s)} | {_seconds(stats.ttft_p99_s)}"
        lines.append(f"| {stats.minute} | {stats.num_requests} | {ttfts} | {stats.tokens_per_s:.1f} |")
    return "\n".join(lines) + "\n"


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def write_results(path: Path, records: list[RequestRecord], faults: list[FaultRecord], samples: list[Sample], extra: dict) -> None:
    path.write_text(
        json.dumps(
            {
                **extra,
                "requests": [record.to_json() for record in records],
                "faults": [asdict(fault) for fault in faults],
                "samples": [asdict(sample) for sample in samples],
            },
            indent=1,
        )
    )


def plot(
    directory: Path, records: list[RequestRecord], faults: list[FaultRecord], samples: list[Sample], minutes: list[MinuteStats]
) -> list[Path]:
    """memory.png (RSS and descriptors per process) and latency.png (TTFT of every answer,
    p50/p99 and tokens/s per minute), the faults shaded."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    directory.mkdir(parents=True, exist_ok=True)
    by_name: dict[str, list[Sample]] = {}
    for (name, _pid), series in incarnations(samples).items():
        by_name.setdefault(name, []).extend(series)
    figure, (rss_axis, fd_axis) = plt.subplots(2, 1, figsize=(11, 8), sharex=True)
    for name, series in sorted(by_name.items()):
        series.sort(key=lambda sample: sample.at_s)
        times = [sample.at_s for sample in series]
        rss_axis.plot(times, [sample.rss_bytes / 2**20 for sample in series], label=name, linewidth=1)
        fd_axis.plot(times, [sample.fds for sample in series], label=name, linewidth=1)
    rss_axis.set_ylabel("RSS, MiB")
    fd_axis.set_ylabel("open descriptors")
    fd_axis.set_xlabel("seconds from the load's start")
    rss_axis.legend(fontsize=6, ncol=4)
    for axis in (rss_axis, fd_axis):
        _shade(axis, faults)
    figure.tight_layout()
    memory = directory / "memory.png"
    figure.savefig(memory, dpi=110)
    plt.close(figure)

    figure, (ttft_axis, rate_axis) = plt.subplots(2, 1, figsize=(11, 7), sharex=True)
    answered = [r for r in records if r.outcome == "ok" and r.first_byte_s is not None]
    ttft_axis.scatter([r.started_s for r in answered], [r.first_byte_s for r in answered], s=3, alpha=0.4, label="TTFT")
    failed = [r for r in records if r.outcome in ("failed", "hung")]
    ttft_axis.scatter([r.started_s for r in failed], [0.0] * len(failed), s=12, marker="x", color="red", label="failed")
    centres = [stats.minute * 60 + 30 for stats in minutes]
    ttft_axis.plot(centres, [stats.ttft_p50_s for stats in minutes], "o-", label="p50 per minute")
    ttft_axis.plot(centres, [stats.ttft_p99_s for stats in minutes], "s-", label="p99 per minute")
    ttft_axis.set_ylabel("TTFT, s")
    ttft_axis.legend(fontsize=7)
    rate_axis.plot(centres, [stats.tokens_per_s for stats in minutes], "o-")
    rate_axis.set_ylabel("answered tokens/s")
    rate_axis.set_xlabel("seconds from the load's start")
    for axis in (ttft_axis, rate_axis):
        _shade(axis, faults)
    figure.tight_layout()
    latency = directory / "latency.png"
    figure.savefig(latency, dpi=110)
    plt.close(figure)
    return [memory, latency]


def _shade(axis, faults: list[FaultRecord]) -> None:
    for fault in faults:
        axis.axvspan(fault.started_s, max(fault.ended_s, fault.started_s + 0.5), color="orange", alpha=0.15)
