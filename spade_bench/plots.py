"""The run's four plots (PNG, matplotlib's headless Agg backend).

tokens_per_s_vs_rtt.png        tokens/s against RTT, one line per mode
passes_vs_draft_length.png     target forward passes per token against draft length
accepted_per_category.png      mean accepted tokens per Spec-Bench category, per SPADE mode
verifier_cpu_per_token.png     verifier CPU seconds per generated token, per mode
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # before pyplot is imported: pyplot picks its backend on import
import matplotlib.pyplot as plt

from spade_bench.config import DRAFT_MODE, SPADE_MODE, TARGET_MODE
from spade_bench.data import CNNDM_CATEGORY
from spade_bench.metrics import find
from spade_bench.report import Summaries

PLOT_FILES = (
    "tokens_per_s_vs_rtt.png",
    "passes_vs_draft_length.png",
    "accepted_per_category.png",
    "verifier_cpu_per_token.png",
)


def write_plots(summaries: Summaries, directory: Path, title: str = "") -> list[Path]:
    directory.mkdir(parents=True, exist_ok=True)
    drawers = (_tokens_per_s_vs_rtt, _passes_vs_draft_length, _accepted_per_category, _verifier_cpu_per_token)
    paths = []
    for name, draw in zip(PLOT_FILES, drawers, strict=True):
        figure, axes = plt.subplots(figsize=(7, 4.5))
        draw(axes, summaries)
        subtitle = f"\n{title}" if title else ""
        axes.set_title(axes.get_title() + subtitle, fontsize=10)
        figure.tight_layout()
        path = directory / name
        figure.savefig(path, dpi=110)
        plt.close(figure)
        paths.append(path)
    return paths


def _labels(summaries: Summaries, mode: str | None = None) -> list[str]:
    labels = []
    for summary in summaries.pooled:
        if (mode is None or summary.mode == mode) and summary.label not in labels:
            labels.append(summary.label)
    return labels


def _tokens_per_s_vs_rtt(axes, summaries: Summaries) -> None:
    """Measured tokens/s (solid) and the CPU-bound rate (dashed, same colour: what an idle
    machine would give, so the gap between them is other work on the box)."""
    rtts = sorted({s.rtt_ms for s in summaries.by_rtt if s.rtt_ms is not None})
    for label in _labels(summaries):
        rows = sorted((s for s in summaries.by_rtt if s.label == label), key=lambda s: s.rtt_ms or 0.0)
        if all(s.rtt_ms is None for s in rows):
            if rtts:  # draft-only crosses no link: a flat reference line
                axes.plot(rtts, [rows[0].tokens_per_s] * len(rtts), linestyle=":", color="grey", label=f"{label} (local)")
            continue
        (line,) = axes.plot(
            [s.rtt_ms for s in rows],
            [s.tokens_per_s for s in rows],
            marker="o",
            linewidth=2.5 if label == TARGET_MODE else 1.5,
            label=label,
        )
        if all(s.cpu_bound_tokens_per_s is not None for s in rows):
            axes.plot(
                [s.rtt_ms for s in rows],
                [s.cpu_bound_tokens_per_s for s in rows],
                linestyle="--",
                color=line.get_color(),
                alpha=0.7,
                label=f"{label} (CPU-bound)",
            )
    axes.set(xlabel="round-trip time edge ↔ cloud (ms)", ylabel="generated tokens / s", title="Tokens/s vs RTT")
    axes.set_ylim(bottom=0)
    axes.grid(alpha=0.3)
    axes.legend(fontsize=7, ncol=2)


def _passes_vs_draft_length(axes, summaries: Summaries) -> None:
    numeric = sorted(
        (
            (int(s.draft_length), s)
            for s in summaries.pooled
            if s.mode == SPADE_MODE and s.draft_length is not None and s.draft_length.isdigit()
        ),
        key=lambda pair: pair[0],
    )
    lengths = [length for length, _ in numeric]
    if numeric:
        axes.plot(lengths, [s.passes_per_token or 0 for _, s in numeric], marker="o", label="SPADE, fixed draft length")
        axes.set_xticks(lengths)
        axes.set_xlim(0, max(lengths) + 1)
    for summary in summaries.pooled:
        if summary.mode == SPADE_MODE and summary.draft_length == "auto" and summary.passes_per_token is not None:
            axes.axhline(summary.passes_per_token, linestyle="--", color="tab:green", label="SPADE, auto")
    target = find(summaries.pooled, TARGET_MODE)
    if target and target.passes_per_token is not None:
        axes.axhline(target.passes_per_token, color="black", label="target-only")
    axes.set(xlabel="draft length", ylabel="target forward passes / generated token", title="Target passes per token vs draft length")
    axes.set_ylim(bottom=0)
    axes.grid(alpha=0.3)
    axes.legend(fontsize=8)


def _accepted_per_category(axes, summaries: Summaries) -> None:
    spade = [s for s in summaries.pooled_category if s.mode == SPADE_MODE and s.category != CNNDM_CATEGORY]
    categories = sorted({s.category for s in spade})
    labels = _labels(summaries, SPADE_MODE)
    width = 0.8 / max(1, len(labels))
    for index, label in enumerate(labels):
        values = [_value(spade, label, category) for category in categories]
        axes.bar([c + index * width for c in range(len(categories))], values, width, label=label)
    axes.set_xticks([c + 0.4 - width / 2 for c in range(len(categories))], categories, rotation=35, ha="right", fontsize=8)
    axes.axhline(1.0, color="black", linewidth=0.8, label="plain decoding")
    axes.set(ylabel="mean accepted tokens (tokens / verify call)", title="Mean accepted tokens per category")
    axes.legend(fontsize=8)


def _value(summaries, label: str, category: str) -> float:
    for summary in summaries:
        if summary.label == label and summary.category == category:
            return summary.mean_accepted_tokens or 0.0
    return 0.0


def _verifier_cpu_per_token(axes, summaries: Summaries) -> None:
    labels = [s.label for s in summaries.pooled if s.verifier_cpu_per_token is not None]
    values = [s.verifier_cpu_per_token for s in summaries.pooled if s.verifier_cpu_per_token is not None]
    colors = ["black" if label == TARGET_MODE else "tab:blue" for label in labels]
    axes.bar(labels, values, color=colors)
    draft = find(summaries.pooled, DRAFT_MODE)
    if draft and draft.edge_cpu_per_token is not None:
        axes.axhline(draft.edge_cpu_per_token, linestyle=":", color="grey", label="draft-only (edge CPU)")
        axes.legend(fontsize=8)
    axes.set(ylabel="verifier CPU seconds / generated token", title="Cloud CPU per token")
    axes.grid(axis="y", alpha=0.3)
