"""The chaos run's verdicts: pure functions of what was recorded (requests, faults, samples).
Each check returns a ``Check``: its name, whether it held, the numbers behind it, and the
violations (a few listed in full)."""

from __future__ import annotations

import statistics
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field

from spade_bench.chaos.load import RequestRecord
from spade_bench.chaos.plan import FaultPlan

MAX_LISTED = 8


@dataclass(frozen=True)
class FaultRecord:
    """A fault as it happened: seconds from the load's start."""

    kind: str
    started_s: float
    ended_s: float
    """When the fault was over: the process restarted and healthy, the link restored."""
    edges: tuple[int, ...] | None
    """The edges whose requests it may fail; None: every edge (a pool-wide fault)."""
    detail: str = ""
    recovered_s: float | None = None
    """Seconds from ``ended_s`` to the first answer of a probe through an affected edge."""
    expectation_met: bool = True
    """For faults with an expected outcome of their own (an edge of another wire version must
    refuse to start with a message naming both versions)."""


@dataclass(frozen=True)
class Sample:
    """One look at one process from outside, with what its /metrics said."""

    at_s: float
    process: str
    pid: int
    rss_bytes: int
    fds: int
    sockets: int
    metrics: dict[str, float] = field(default_factory=dict)
    client_sockets: int = 0
    """TCP connections this process opened (its HTTP clients' pools)."""
    server_sockets: int = 0
    """TCP connections accepted on its listening ports (its clients' keep-alive pools)."""


@dataclass(frozen=True)
class Check:
    name: str
    passed: bool
    summary: str
    violations: tuple[str, ...] = ()


def check_greedy_exact(records: Iterable[RequestRecord], references: dict[tuple, str]) -> Check:
    """Greedy answers equal target-only's text; one that ended early (failed or abandoned) is a
    prefix of it: nothing wrong, nothing duplicated."""
    checked, violations = 0, []
    for record in records:
        if not record.plan.greedy or record.outcome in ("refused", "hung") or record.plan.expects_refusal:
            continue
        reference = references.get(record.plan.reference_key())
        if reference is None:
            violations.append(f"request {record.plan.index}: no target-only reference for {record.plan.reference_key()}")
            continue
        checked += 1
        exact = record.text == reference if record.outcome == "ok" else reference.startswith(record.text)
        if not exact:
            violations.append(f"request {record.plan.index} ({record.outcome}): {record.text[:60]!r} against {reference[:60]!r}")
    return Check(
        "greedy text is target-only's", not violations, f"{checked} greedy answers compared, {len(violations)} wrong", _listed(violations)
    )


def check_no_server_errors(records: Iterable[RequestRecord]) -> Check:
    violations = [
        f"request {r.plan.index}: HTTP 500 {r.error}"
        for r in records
        if r.status is not None and r.status >= 500 and r.status not in (502, 503, 504)
    ]
    return Check("no HTTP 500", not violations, f"{len(violations)} answers with an internal error", _listed(violations))


def check_errors_shaped(records: Iterable[RequestRecord]) -> Check:
    """Every HTTP error and every stream error event is OpenAI-shaped; an errored stream still
    ends with [DONE]; what the API refuses (n > 1) is refused."""
    violations = []
    for record in records:
        if record.plan.expects_refusal and record.outcome == "ok":
            violations.append(f"request {record.plan.index}: n = {record.plan.n} answered instead of refused")
        if record.error is None or "transport" in record.error:
            continue
        if not record.error_shaped:
            violations.append(f"request {record.plan.index}: error not OpenAI-shaped: {record.error}")
        elif record.plan.stream and record.status == 200 and not record.done:
            violations.append(f"request {record.plan.index}: an error event without [DONE] after it")
    return Check("errors are OpenAI-shaped", not violations, f"{len(violations)} malformed errors", _listed(violations))


def check_not_hung(records: Iterable[RequestRecord], deadline_s: float) -> Check:
    hung = [f"request {r.plan.index} to edge {r.plan.edge} at {r.started_s:.1f} s" for r in records if r.outcome == "hung"]
    return Check("no hung request", not hung, f"{len(hung)} requests sent no byte for {deadline_s:.0f} s", _listed(hung))


def in_window(record: RequestRecord, fault: FaultRecord, recovery_bound_s: float) -> bool:
    """Whether ``record`` overlapped ``fault``'s window (its start to its end plus the bound) on
    an edge the fault could reach."""
    if fault.edges is not None and record.plan.edge not in fault.edges:
        return False
    return record.started_s <= fault.ended_s + recovery_bound_s and record.ended_s >= fault.started_s


def check_failures_in_windows(records: Iterable[RequestRecord], faults: list[FaultRecord], recovery_bound_s: float) -> Check:
    failed = [r for r in records if r.outcome == "failed"]
    outside = [r for r in failed if not any(in_window(r, fault, recovery_bound_s) for fault in faults)]
    violations = [
        f"request {r.plan.index} to edge {r.plan.edge}, {r.started_s:.1f}-{r.ended_s:.1f} s: {r.status} {r.error}" for r in outside
    ]
    summary = f"{len(failed)} failed requests, {len(outside)} outside every fault window (recovery bound {recovery_bound_s:.0f} s)"
    return Check("failures only inside fault windows", not outside, summary, _listed(violations))


def check_fault_expectations(faults: list[FaultRecord], planned: list[FaultPlan]) -> Check:
    """Every planned fault ran, met its own expectation, and an affected edge answered after it."""
    not_run = [f"{plan.kind} planned at {plan.start_s:.0f} s: never ran" for plan in planned[len(faults) :]]
    unmet = [f"{f.kind} at {f.started_s:.1f} s: {f.detail}" for f in faults if not f.expectation_met]
    unrecovered = [f"{f.kind} at {f.started_s:.1f} s: no answer after it" for f in faults if f.recovered_s is None and f.edges != ()]
    violations = not_run + unmet + unrecovered
    summary = f"{len(faults)} of {len(planned)} faults ran, {len(violations)} not as expected"
    return Check("every fault ran and recovered as expected", not violations, summary, _listed(violations))


def incarnations(samples: Iterable[Sample]) -> dict[tuple[str, int], list[Sample]]:
    grouped: dict[tuple[str, int], list[Sample]] = defaultdict(list)
    for sample in samples:
        grouped[(sample.process, sample.pid)].append(sample)
    return grouped


SOCKET_POOL_BOUND = 20
"""Idle keep-alive connections one HTTP client pool may hold (httpx's default
``max_keepalive_connections``: the edge's client to the verifier, the verifier's none): they close
on the pool's next use, so after a burst an idle edge may keep up to this many connections it
opened. Connections it accepted are its callers' pools, bounded by theirs (``server_bound``)."""
HARNESS = "runner"
"""The chaos run's own process (clients, proxies, records): sampled and plotted, never judged."""


def socket_violation(process: str, before: Sample | None, after: Sample, server_bound: int, what: str) -> str | None:
    """Whether ``after`` holds more connections than ``before`` plus the pools' bounds: those it
    opened past ``SOCKET_POOL_BOUND``, those it accepted past ``server_bound``."""
    opened_before = 0 if before is None else before.client_sockets
    accepted_before = 0 if before is None else before.server_sockets
    if after.client_sockets > opened_before + SOCKET_POOL_BOUND:
        return f"{process}: {after.client_sockets} connections it opened against {opened_before} {what}"
    if after.server_sockets > accepted_before + server_bound:
        return f"{process}: {after.server_sockets} connections it accepted against {accepted_before} {what}"
    return None


RSS_SLACK_BYTES = 8 * 2**20
"""Growth of a process's RSS that is never a leak's verdict, whatever its size: nginx's workers
hold ~7 MiB, and 10 % of that is one connection's buffers."""


def judged_from(series: list[Sample], warm_s: float) -> float:
    """When the judged stretch of a process a fault (re)started begins: the load's warm-up
    counted from its first answer on /metrics (while it loads its model its RSS climbs and its
    descriptors open: that is a start, not a leak), or from its first sample for a process
    without metrics (nginx)."""
    serving = next((s for s in series if s.metrics), series[0])
    return serving.at_s + warm_s


def check_flat(
    samples: list[Sample],
    warm_s: float,
    load_end_s: float,
    tolerance: float = 0.10,
    fd_slack: int = 8,
    server_bound: int = 64,
    rss_slack_bytes: int = RSS_SLACK_BYTES,
) -> Check:
    """After warm-up, each service process that ran through the load keeps its RSS within
    ``tolerance`` (or ``rss_slack_bytes``, whichever is larger) and its descriptors other than
    sockets within ``tolerance`` (or ``fd_slack``): the median of its first three samples after warm-up against the median
    of its last three before the load ended; and its connections within the pools' bounds
    (``socket_violation``). A process started by a fault during the load has a warm-up of its own
    (``judged_from``): it is judged if it ran long enough after it, and named as not judged if not."""
    violations, judged, too_short = [], 0, []
    span = load_end_s - warm_s
    grouped = incarnations(samples)
    first_pids: dict[str, int] = {}  # the incarnation of each process that the stack started
    for process, pid in sorted(grouped, key=lambda incarnation: grouped[incarnation][0].at_s):
        first_pids.setdefault(process, pid)
    for (process, pid), series in grouped.items():
        if process == HARNESS:
            continue
        restarted = first_pids[process] != pid
        own_warm_s = judged_from(series, warm_s) if restarted else warm_s
        during = [s for s in series if own_warm_s <= s.at_s <= load_end_s]
        if len(during) < 6 or during[-1].at_s - during[0].at_s < span / 2:
            if restarted:  # (a process a fault stopped early is judged in its restart)
                too_short.append(f"{process} (pid {pid}, judged from {own_warm_s:.0f} s)")
            continue
        judged += 1
        early, late = during[:3], during[-3:]
        rss_early, rss_late = statistics.median(s.rss_bytes for s in early), statistics.median(s.rss_bytes for s in late)
        files_early, files_late = (statistics.median(s.fds - s.sockets for s in part) for part in (early, late))
        if rss_late > max(rss_early * (1 + tolerance), rss_early + rss_slack_bytes):
            violations.append(f"{process} (pid {pid}): RSS {rss_early / 2**20:.0f} -> {rss_late / 2**20:.0f} MiB")
        if files_late > max(files_early * (1 + tolerance), files_early + fd_slack):
            violations.append(f"{process} (pid {pid}): descriptors other than sockets {files_early:.0f} -> {files_late:.0f}")
        sockets = socket_violation(f"{process} (pid {pid})", early[0], late[-1], server_bound, "after warm-up")
        if sockets is not None:
            violations.append(sockets)
    return Check(
        "memory and descriptors flat after warm-up",
        not violations,
        f"{judged} processes judged from {warm_s:.0f} s to {load_end_s:.0f} s, "
        f"within {tolerance:.0%} or {rss_slack_bytes / 2**20:.0f} MiB of RSS"
        + (f"; restarted too late to judge: {', '.join(too_short)}" if too_short else ""),
        _listed(violations),
    )


def check_back_to_idle(
    before: list[Sample], after: list[Sample], tolerance: float = 0.10, fd_slack: int = 8, server_bound: int = 64
) -> Check:
    """After the load and the idle wait (longer than the verifiers' session TTL and sweep): the
    verifiers hold no session (retained shared prefixes may stay: they are a cache within the KV
    budget), the edges no live draft session (retained draft prefixes may stay, bounded), and
    every service process has about the descriptors other than sockets its name had before the
    load (within ``tolerance`` or ``fd_slack``), and its connections within the pools' bounds
    (``socket_violation``)."""
    violations = []
    baselines = {s.process: s for s in before}
    looked_at = [sample for sample in after if sample.process != HARNESS]
    for sample in looked_at:
        sessions = sample.metrics.get("spade_verifier_sessions")
        if sessions:
            kv_bytes = sample.metrics.get("spade_verifier_kv_cache_bytes", 0.0)
            violations.append(
                f"{sample.process}: {sessions:.0f} sessions still held ({kv_bytes / 2**20:.1f} MiB of KV with retained prefixes)"
            )
        drafting = sample.metrics.get("spade_edge_draft_sessions")
        if drafting:
            violations.append(f"{sample.process}: {drafting:.0f} draft sessions still live (each holds a draft KV cache)")
        baseline = baselines.get(sample.process)
        if baseline is None:
            continue
        files, baseline_files = sample.fds - sample.sockets, baseline.fds - baseline.sockets
        if files > max(baseline_files * (1 + tolerance), baseline_files + fd_slack):
            violations.append(f"{sample.process}: {files} descriptors other than sockets against {baseline_files} before the load")
        sockets = socket_violation(sample.process, baseline, sample, server_bound, "before the load")
        if sockets is not None:
            violations.append(sockets)
    return Check("back to idle after the load", not violations, f"{len(looked_at)} processes looked at", _listed(violations))


def check_verdicts(num_checked: int, num_sampled: int, num_recorded: int, mismatches: tuple[str, ...]) -> Check:
    """The verifiers' recorded verdicts, recomputed offline from their inputs (``chaos.audit``)."""
    summary = f"{num_checked} of {num_recorded} recorded verdicts re-checked ({num_sampled} sampled), {len(mismatches)} not the rule's"
    return Check("verdicts follow the acceptance rule", num_checked > 0 and not mismatches, summary, _listed(list(mismatches)))


@dataclass(frozen=True)
class MinuteStats:
    minute: int
    num_requests: int
    ttft_p50_s: float | None
    ttft_p99_s: float | None
    tokens_per_s: float


def per_minute(records: Iterable[RequestRecord]) -> list[MinuteStats]:
    """By the minute a request ended in: its TTFT's p50/p99 (answered requests) and the tokens
    of answered requests per second."""
    by_minute: dict[int, list[RequestRecord]] = defaultdict(list)
    for record in records:
        by_minute[int(record.ended_s // 60)].append(record)
    stats = []
    for minute in sorted(by_minute):
        group = by_minute[minute]
        ttfts = sorted(r.first_byte_s for r in group if r.outcome == "ok" and r.first_byte_s is not None)
        tokens = sum(r.completion_tokens for r in group if r.outcome == "ok")
        stats.append(MinuteStats(minute, len(group), percentile(ttfts, 50), percentile(ttfts, 99), tokens / 60.0))
    return stats


def percentile(values: list[float], pct: float) -> float | None:
    if not values:
        return None
    index = min(len(values) - 1, max(0, round(pct / 100 * (len(values) - 1))))
    return sorted(values)[index]


def _listed(violations: list[str]) -> tuple[str, ...]:
    extra = [f"... and {len(violations) - MAX_LISTED} more"] if len(violations) > MAX_LISTED else []
    return tuple(violations[:MAX_LISTED] + extra)
