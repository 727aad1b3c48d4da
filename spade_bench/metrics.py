"""Quality scores and aggregation of request records into per-group summaries.

Rates are ratios of sums, not means of per-request ratios: tokens/s of a group is its tokens
divided by its wall time, so a long request weighs as much as its tokens (the way a user's day
adds up). Worked example: requests of (10 tokens, 1 s) and (90 tokens, 9 s) give 10 tok/s;
(10 tokens, 1 s) and (90 tokens, 3 s) give 25 tok/s, not the mean 20.

Glossary of summary fields:
    passes_per_token        target forward passes / generated tokens (1.0 for target-only)
    passes_per_sequence     target forward passes per request (the paper's "calls per sequence")
    acceptance_rate         accepted / drafted tokens
    mean_accepted_tokens    generated tokens / verify calls (Spec-Bench's "mean accepted tokens";
                            1.00 for plain decoding)
    verifier_cpu_per_token  verifier CPU seconds / generated tokens
    identical_share         share of greedy outputs identical to target-only's, same prompt
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass
from statistics import mean, median

from spade_bench.config import DRAFT_MODE, SPADE_MODE, TARGET_MODE
from spade_bench.records import RequestRecord

ROUGE_TYPES = ("rouge1", "rouge2", "rougeL")
ALL = "all"


def annotate_identical(records: list[RequestRecord]) -> None:
    """Set ``identical_to_target`` on every non-target record whose prompt target-only answered.

    Target-only's text at the first RTT it ran is the reference (greedy target-only is the same
    at every RTT; a difference would itself be a finding, reported by its own identical share).
    """
    reference: dict[tuple, str] = {}
    for record in records:
        if record.mode == TARGET_MODE:
            reference.setdefault(record.key, record.text)
    for record in records:
        if record.key in reference:
            record.identical_to_target = record.text == reference[record.key]


def annotate_rouge(records: list[RequestRecord], references: dict[tuple[str, str], str]) -> None:
    """ROUGE-1/2/L F1 (stemmed) of each record whose (dataset, item_id) has a reference summary."""
    from rouge_score import rouge_scorer  # only the bench extra installs it

    scorer = rouge_scorer.RougeScorer(list(ROUGE_TYPES), use_stemmer=True)
    for record in records:
        reference = references.get((record.dataset, record.item_id))
        if reference is None:
            continue
        scores = scorer.score(reference, record.text)
        record.rouge1, record.rouge2, record.rougeL = (scores[kind].fmeasure for kind in ROUGE_TYPES)


@dataclass(frozen=True)
class GroupSummary:
    """Aggregates of one group of records (one mode/setting, optionally one category)."""

    label: str
    mode: str
    draft_length: str | None
    rtt_ms: float | None
    category: str
    num_requests: int
    completion_tokens: int
    wall_s: float
    tokens_per_s: float
    mean_ttft_s: float | None
    median_ttft_s: float | None
    target_passes: int | None
    passes_per_token: float | None
    passes_per_sequence: float | None
    target_tokens_per_token: float | None
    verify_calls: int | None
    drafted_tokens: int | None
    accepted_tokens: int | None
    acceptance_rate: float | None
    mean_accepted_tokens: float | None
    verifier_cpu_per_token: float | None
    edge_cpu_per_token: float | None
    bytes_up_per_request: float
    bytes_down_per_request: float
    identical_share: float | None
    rouge1: float | None
    rouge2: float | None
    rougeL: float | None
    mean_load_1m: float | None
    draft_s_per_token: float | None
    """The edge's drafting time per generated token (from the responses' ``spade.draft_ms``)."""
    verify_s_per_token: float | None
    """Verify round trips per token, as the edge timed them: link, queueing and the forward."""
    forward_s_per_token: float | None
    """The target's forward passes per token, as the verifier timed them."""
    cpu_bound_tokens_per_s: float | None
    """tokens / (CPU seconds of the serving processes + the link's waits): the rate on an idle
    machine, a yardstick that other work on a shared box does not move. Drafting done while a
    verify call was in flight (``spade.draft_ahead_ms``, overlap on) runs beside the verifier and
    is taken off the edge's CPU seconds; the rest of the edge's work alternates with the
    verifier's. Link waits: one RTT per verify call for SPADE, one per request for target-only
    (one stream)."""
    overlap_hit_rate: float | None = None
    """Share of blocks drafted ahead that started the next block (overlap on)."""
    draft_ahead_s_per_token: float | None = None
    """Drafting hidden under verify calls, per generated token."""
    used_drafts_per_token: float | None = None
    """Drafted tokens accepted (or drafted-ahead guesses confirmed) per generated token."""
    rejected_drafts_per_token: float | None = None
    """Drafted tokens sent and rejected per generated token."""
    discarded_ahead_per_token: float | None = None
    """Tokens drafted ahead and thrown away per generated token (what ``--edge-power`` trims)."""
    concurrency: int = 1
    aggregate_tokens_per_s: float | None = None
    """All requests' tokens over the phase's wall time (``--concurrency K``: K at once)."""
    edge_wait_share: float | None = None
    """Share of the requests' wall time spent waiting for the edge's drafting (``spade.draft_ms``)."""

    def to_dict(self) -> dict:
        return asdict(self)


def _total(records: list[RequestRecord], pick: Callable[[RequestRecord], float | None]) -> float | None:
    """Sum of a field over the records, None if any record lacks it."""
    values = [pick(record) for record in records]
    present = [value for value in values if value is not None]
    return None if len(present) < len(values) else sum(present)


def _ratio(numerator: float | None, denominator: float | None) -> float | None:
    if numerator is None or not denominator:
        return None
    return numerator / denominator


def _mean_of(values: Iterable[float | None]) -> float | None:
    present = [value for value in values if value is not None]
    return mean(present) if present else None


def summarize_group(records: list[RequestRecord], category: str = ALL) -> GroupSummary:
    if not records:
        raise ValueError("cannot summarise an empty group")
    first = records[0]
    tokens = sum(record.completion_tokens for record in records)
    wall_s = sum(record.wall_s for record in records)
    is_target_side = first.mode != DRAFT_MODE
    passes = _total(records, lambda record: record.target_passes) if is_target_side else None
    verify_calls = _total(records, lambda record: record.verify_calls) if is_target_side else None
    drafted = _total(records, lambda record: record.drafted_tokens) if is_target_side else None
    accepted = _total(records, lambda record: record.accepted_tokens) if is_target_side else None
    ttfts = [record.ttft_s for record in records if record.ttft_s is not None]
    return GroupSummary(
        label=first.label,
        mode=first.mode,
        draft_length=first.draft_length,
        rtt_ms=first.rtt_ms,
        category=category,
        num_requests=len(records),
        completion_tokens=tokens,
        wall_s=wall_s,
        tokens_per_s=tokens / wall_s if wall_s > 0 else 0.0,
        mean_ttft_s=mean(ttfts) if ttfts else None,
        median_ttft_s=median(ttfts) if ttfts else None,
        target_passes=None if passes is None else int(passes),
        passes_per_token=_ratio(passes, tokens),
        passes_per_sequence=_ratio(passes, len(records)),
        target_tokens_per_token=_ratio(_total(records, lambda record: record.target_tokens), tokens) if is_target_side else None,
        verify_calls=None if verify_calls is None else int(verify_calls),
        drafted_tokens=None if drafted is None else int(drafted),
        accepted_tokens=None if accepted is None else int(accepted),
        acceptance_rate=_ratio(accepted, drafted),
        mean_accepted_tokens=_ratio(tokens, verify_calls),
        verifier_cpu_per_token=_ratio(_total(records, lambda record: record.verifier_cpu_s), tokens),
        edge_cpu_per_token=_ratio(_total(records, lambda record: record.edge_cpu_s), tokens),
        bytes_up_per_request=sum(record.bytes_up for record in records) / len(records),
        bytes_down_per_request=sum(record.bytes_down for record in records) / len(records),
        identical_share=_mean_of(None if record.identical_to_target is None else float(record.identical_to_target) for record in records),
        rouge1=_mean_of(record.rouge1 for record in records),
        rouge2=_mean_of(record.rouge2 for record in records),
        rougeL=_mean_of(record.rougeL for record in records),
        mean_load_1m=_mean_of(record.load_1m for record in records),
        draft_s_per_token=_seconds_per_token(records, lambda record: record.draft_ms),
        verify_s_per_token=_seconds_per_token(records, lambda record: record.verify_ms),
        forward_s_per_token=_seconds_per_token(records, lambda record: record.verifier_forward_ms),
        cpu_bound_tokens_per_s=_cpu_bound_rate(records),
        overlap_hit_rate=_overlap_hit_rate(records),
        draft_ahead_s_per_token=_seconds_per_token(records, lambda record: record.draft_ahead_ms),
        used_drafts_per_token=_ratio(_total(records, lambda record: record.used_draft_tokens), tokens),
        rejected_drafts_per_token=_ratio(_total(records, lambda record: record.rejected_draft_tokens), tokens),
        discarded_ahead_per_token=_ratio(_total(records, lambda record: record.discarded_ahead_tokens), tokens),
        concurrency=max(record.concurrency for record in records),
        aggregate_tokens_per_s=_aggregate_rate(records),
        edge_wait_share=_ratio(_total(records, lambda record: record.draft_ms), wall_s * 1000.0),
    )


def _aggregate_rate(records: list[RequestRecord]) -> float | None:
    """Tokens per second of the phase's wall time: each batch counted once (its requests'
    shares of it add up to it); one request at a time, the requests' own walls."""
    wall_s = sum(record.wall_s if record.batch_wall_share_s is None else record.batch_wall_share_s for record in records)
    return _ratio(sum(record.completion_tokens for record in records), wall_s)


def _overlap_hit_rate(records: list[RequestRecord]) -> float | None:
    hits = sum(record.overlap_hits or 0 for record in records)
    misses = sum(record.overlap_misses or 0 for record in records)
    return _ratio(hits, hits + misses)


def _cpu_bound_rate(records: list[RequestRecord]) -> float | None:
    busy_s = 0.0
    for record in records:
        cpu_s = [value for value in (record.verifier_cpu_s, record.edge_cpu_s) if value is not None]
        if not cpu_s:
            return None
        round_trips = record.verify_calls if record.mode == SPADE_MODE else 1
        hidden_s = min(record.edge_cpu_s or 0.0, (record.draft_ahead_ms or 0.0) / 1000.0)
        busy_s += sum(cpu_s) - hidden_s + (round_trips or 0) * (record.rtt_ms or 0.0) / 1000.0
    return _ratio(sum(record.completion_tokens for record in records), busy_s)


def _seconds_per_token(records: list[RequestRecord], pick_ms: Callable[[RequestRecord], float | None]) -> float | None:
    tokens = sum(record.completion_tokens for record in records)
    total_ms = _total(records, pick_ms)
    return None if total_ms is None else _ratio(total_ms / 1000.0, tokens)


def _group(records: list[RequestRecord], key: Callable[[RequestRecord], tuple]) -> dict[tuple, list[RequestRecord]]:
    groups: dict[tuple, list[RequestRecord]] = defaultdict(list)
    for record in records:
        groups[key(record)].append(record)
    return groups


def summarize(records: list[RequestRecord], by_rtt: bool = True, by_category: bool = False) -> list[GroupSummary]:
    """One summary per label (x RTT) (x category), in the order the groups first appear.

    Without ``by_rtt`` a label's records at every RTT are pooled: use it for quantities the
    network does not change (passes, acceptance, CPU, quality), never for time.
    """

    def key(record: RequestRecord) -> tuple:
        return (record.label, record.rtt_ms if by_rtt else None, record.category if by_category else ALL)

    summaries = []
    for (_, _, category), group in _group(records, key).items():
        summary = summarize_group(group, category)
        summaries.append(summary if by_rtt else _without_rtt(summary))
    return summaries


def _without_rtt(summary: GroupSummary) -> GroupSummary:
    return GroupSummary(**(summary.to_dict() | {"rtt_ms": None}))


def find(summaries: list[GroupSummary], label: str, rtt_ms: float | None = None, category: str = ALL) -> GroupSummary | None:
    for summary in summaries:
        if summary.label == label and summary.rtt_ms == rtt_ms and summary.category == category:
            return summary
    return None


def speedup(summaries: list[GroupSummary], summary: GroupSummary) -> float | None:
    """tokens/s of ``summary`` over target-only's at the same RTT and category."""
    reference = find(summaries, TARGET_MODE, summary.rtt_ms, summary.category)
    return _ratio(summary.tokens_per_s, reference.tokens_per_s) if reference else None


def cpu_bound_speedup(summaries: list[GroupSummary], summary: GroupSummary) -> float | None:
    """CPU-bound tokens/s of ``summary`` over target-only's at the same RTT and category."""
    reference = find(summaries, TARGET_MODE, summary.rtt_ms, summary.category)
    return _ratio(summary.cpu_bound_tokens_per_s, reference.cpu_bound_tokens_per_s) if reference else None
