"""Runs the benchmark's phases: starts the services, sweeps the link, measures every request.

Topology (two machines emulated on one, each pinned to its own cores):

    target:  bench ──proxy(RTT)──> verifier(target)           cloud-only: the user pays the RTT
    spade:   bench ──> edge(draft) ──proxy(RTT)──> verifier   the edge pays one RTT per verify call
    draft:   bench ──> verifier(draft) on the edge's cores     no link: the edge model alone

One verifier serves both the target-only and the SPADE phases; one edge process runs per draft
length. Phases run one request at a time (Spec-Bench's batch size 1), or ``--concurrency K``
items at once through one edge. Around each request (each batch of K) the services' /metrics
(CPU seconds, forward passes) and the proxy's byte counters are read, and the difference is that
request's cost (the batch's, shared by tokens).
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace

import httpx
import openai

from spade_bench.client import Generation, StreamResult, make_client, served_model, stream_chat
from spade_bench.config import DRAFT_MODE, SPADE_MODE, TARGET_MODE, BenchConfig
from spade_bench.data import BenchItem, conversation
from spade_bench.proxy import LinkConfig, LinkCounters, ProxyThread
from spade_bench.records import Phase, RequestRecord, SpadeCounts
from spade_bench.services import Service, ServiceSpec, edge_command, start_service, verifier_command

logger = logging.getLogger(__name__)

PASSES_METRIC = "spade_verifier_forward_passes_total"
TARGET_TOKENS_METRIC = "spade_verifier_target_tokens_total"


@dataclass(frozen=True)
class Endpoints:
    """What one phase sends requests to, and which processes and link it measures."""

    client_url: str
    verifier: Service | None = None
    edge: Service | None = None
    proxy: ProxyThread | None = None


@dataclass(frozen=True)
class Snapshot:
    verifier: dict[str, float] = field(default_factory=dict)
    verifier_cpu_s: float | None = None
    edge_cpu_s: float | None = None
    link: LinkCounters = LinkCounters()


def take_snapshot(endpoints: Endpoints) -> Snapshot:
    verifier_metrics = endpoints.verifier.metrics() if endpoints.verifier else {}
    return Snapshot(
        verifier=verifier_metrics,
        verifier_cpu_s=endpoints.verifier.cpu_seconds(verifier_metrics) if endpoints.verifier else None,
        edge_cpu_s=endpoints.edge.cpu_seconds(endpoints.edge.metrics()) if endpoints.edge else None,
        link=endpoints.proxy.counters() if endpoints.proxy else LinkCounters(),
    )


def _delta(after: float | None, before: float | None) -> float | None:
    return None if after is None or before is None else after - before


def _metric_delta(before: Snapshot, after: Snapshot, name: str) -> int | None:
    if name not in after.verifier:
        return None
    return int(round(after.verifier[name] - before.verifier.get(name, 0.0)))


def build_record(item: BenchItem, turn: int, phase: Phase, result: StreamResult, before: Snapshot, after: Snapshot) -> RequestRecord:
    """One request's record from its stream and the snapshots around it."""
    counts = SpadeCounts.from_payload(result.spade) if phase.mode != DRAFT_MODE else None
    link = after.link - before.link
    record = RequestRecord(
        dataset=item.dataset,
        item_id=item.item_id,
        category=item.category,
        turn=turn,
        mode=phase.mode,
        label=phase.label,
        draft_length=phase.draft_length,
        rtt_ms=phase.rtt_ms,
        text=result.text,
        finish_reason=result.finish_reason,
        prompt_tokens=result.prompt_tokens,
        completion_tokens=result.completion_tokens,
        wall_s=result.wall_s,
        ttft_s=result.ttft_s,
        verifier_cpu_s=_delta(after.verifier_cpu_s, before.verifier_cpu_s),
        edge_cpu_s=_delta(after.edge_cpu_s, before.edge_cpu_s),
        bytes_up=link.bytes_up,
        bytes_down=link.bytes_down,
        load_1m=os.getloadavg()[0],
    )
    if counts is not None:
        _add_target_counts(record, counts, before, after)
    return record


def _add_target_counts(record: RequestRecord, counts: SpadeCounts, before: Snapshot, after: Snapshot) -> None:
    """The response's own accounting, and the verifier's counters as the authority on passes."""
    record.verify_calls = counts.verify_calls
    record.drafted_tokens = counts.drafted_tokens
    record.accepted_tokens = counts.accepted_tokens
    record.resyncs = counts.resyncs
    record.draft_ms = counts.draft_ms
    record.draft_ahead_ms = counts.draft_ahead_ms
    record.overlap_hits = counts.overlap_hits
    record.overlap_misses = counts.overlap_misses
    record.verify_ms = counts.verify_ms
    record.verifier_forward_ms = counts.verifier_forward_ms
    record.used_draft_tokens = counts.used_draft_tokens
    record.rejected_draft_tokens = counts.rejected_draft_tokens
    record.discarded_ahead_tokens = counts.discarded_ahead_tokens
    passes = _metric_delta(before, after, PASSES_METRIC)
    target_tokens = _metric_delta(before, after, TARGET_TOKENS_METRIC)
    # A verifier that counts only /v1/verify forwards leaves target-only requests at 0 there;
    # then the response's own count (verify_calls = forward passes for target-only) stands.
    record.target_passes = passes if passes else counts.verify_calls
    record.target_tokens = target_tokens if target_tokens else counts.target_tokens


def share_batch(records: list[RequestRecord], before: Snapshot, after: Snapshot, batch_wall_s: float) -> list[RequestRecord]:
    """Requests that ran at once: the batch's CPU seconds and link bytes, which no one request's
    snapshots can separate, shared by tokens (a request of 30 tokens in a batch of 90 gets a
    third); so is the batch's wall time (summed over a phase: its wall, for aggregate tokens/s)."""
    total_tokens = sum(record.completion_tokens for record in records) or 1
    concurrency = len({record.item_id for record in records})
    link = after.link - before.link
    verifier_cpu_s = _delta(after.verifier_cpu_s, before.verifier_cpu_s)
    edge_cpu_s = _delta(after.edge_cpu_s, before.edge_cpu_s)
    for record in records:
        share = record.completion_tokens / total_tokens
        record.verifier_cpu_s = None if verifier_cpu_s is None else verifier_cpu_s * share
        record.edge_cpu_s = None if edge_cpu_s is None else edge_cpu_s * share
        record.bytes_up, record.bytes_down = round(link.bytes_up * share), round(link.bytes_down * share)
        record.concurrency, record.batch_wall_share_s = concurrency, batch_wall_s * share
    return records


class BenchRunner:
    """Runs every phase of ``config`` over ``items``; hands each record to ``on_record``."""

    def __init__(
        self,
        config: BenchConfig,
        items: list[BenchItem],
        on_record: Callable[[RequestRecord], None],
        on_progress: Callable[[str], None] = lambda _: None,
    ) -> None:
        if not items:
            raise ValueError("no items selected: check --data, --categories and --limit")
        self.config = config
        self.items = items
        self.on_record = on_record
        self.on_progress = on_progress
        self.observed_affinity: dict[str, list[int]] = {}
        self.failures: list[dict] = []
        self._generation = Generation(config.max_tokens, config.temperature, config.seed)

    @property
    def phases(self) -> list[Phase]:
        """Every phase, in the order they run."""
        config = self.config
        rtts = config.network.rtts_ms
        phases = [Phase(TARGET_MODE, None, rtt) for rtt in rtts] if TARGET_MODE in config.modes else []
        if SPADE_MODE in config.modes:
            phases += [
                Phase(SPADE_MODE, length, rtt, variant)
                for length in config.draft_lengths
                for variant in config.edge_variants
                for rtt in rtts
            ]
        return phases + ([Phase(DRAFT_MODE)] if DRAFT_MODE in config.modes else [])

    @property
    def num_requests(self) -> int:
        return len(self.phases) * sum(item.num_turns for item in self.items)

    def run(self) -> None:
        modes = self.config.modes
        if TARGET_MODE in modes or SPADE_MODE in modes:
            self._run_cloud_phases()
        if DRAFT_MODE in modes:
            with self._start(self._draft_spec()) as draft:
                self._run_phase(Phase(DRAFT_MODE), Endpoints(draft.url, edge=draft))

    def _run_cloud_phases(self) -> None:
        config = self.config
        with contextlib.ExitStack() as stack:
            verifier = stack.enter_context(self._start(self._verifier_spec()))
            proxy = stack.enter_context(ProxyThread("127.0.0.1", verifier.spec.port, self._link(config.network.rtts_ms[0])))
            proxy_url = f"http://127.0.0.1:{proxy.port}"
            for phase in self.phases:
                if phase.mode == TARGET_MODE:
                    self._run_linked_phase(phase, Endpoints(proxy_url, verifier, None, proxy))
            for phase in self.phases:
                if phase.mode == SPADE_MODE and phase.rtt_ms == config.network.rtts_ms[0]:
                    with self._start(self._edge_spec(phase, proxy_url)) as edge:
                        for rtt in config.network.rtts_ms:
                            self._run_linked_phase(replace(phase, rtt_ms=rtt), Endpoints(edge.url, verifier, edge, proxy))

    def _link(self, rtt_ms: float) -> LinkConfig:
        network = self.config.network
        return LinkConfig(rtt_ms=rtt_ms, jitter_ms=network.jitter_ms, bandwidth_mbps=network.bandwidth_mbps)

    def _run_linked_phase(self, phase: Phase, endpoints: Endpoints) -> None:
        if endpoints.proxy is None or phase.rtt_ms is None:
            raise ValueError(f"phase {phase.label} crosses the link: it needs the proxy and an RTT")
        endpoints.proxy.set_link(self._link(phase.rtt_ms))
        self._run_phase(phase, endpoints)

    def _run_phase(self, phase: Phase, endpoints: Endpoints) -> None:
        self.on_progress(f"{phase.label} rtt={phase.rtt_ms}")
        client = make_client(endpoints.client_url, self.config.request_timeout_s)
        with client:
            model = served_model(client)
            self._warm_up(client, model)
            if self.config.concurrency == 1:
                for item in self.items:
                    self._run_item(client, model, item, phase, endpoints)
                return
            size = self.config.concurrency
            for start in range(0, len(self.items), size):
                self._run_batch(client, model, self.items[start : start + size], phase, endpoints)

    def _warm_up(self, client, model: str) -> None:
        """One short unrecorded request: first-request costs and connection setup stay out."""
        if self.config.warmup_tokens > 0:
            warmup = Generation(self.config.warmup_tokens, self.config.temperature, self.config.seed)
            stream_chat(client, model, conversation(self.items[0], []), warmup)

    def _run_item(self, client, model: str, item: BenchItem, phase: Phase, endpoints: Endpoints) -> None:
        answers: list[str] = []
        for turn in range(1, item.num_turns + 1):
            before = take_snapshot(endpoints)
            try:
                result = stream_chat(client, model, conversation(item, answers), self._generation)
            except (openai.APIError, httpx.HTTPError) as error:
                # One failed request must not sink an hour of measurements: it is listed in the
                # results, and the item's later turns (which need this answer) are skipped.
                logger.error("%s item %s turn %d failed: %s", phase.label, item.item_id, turn, error)
                self.failures.append(
                    {"label": phase.label, "rtt_ms": phase.rtt_ms, "item_id": item.item_id, "turn": turn, "error": str(error)[:500]}
                )
                return
            after = take_snapshot(endpoints)
            record = build_record(item, turn, phase, result, before, after)
            answers.append(record.text)
            self.on_record(record)

    def _run_batch(self, client, model: str, items: list[BenchItem], phase: Phase, endpoints: Endpoints) -> None:
        """``items`` at once (each its turns in order), measured as one: the CPU seconds and
        link bytes of the batch are shared among its requests by their tokens."""
        before = take_snapshot(endpoints)
        started = time.perf_counter()
        with ThreadPoolExecutor(max_workers=len(items)) as pool:
            answered = list(pool.map(lambda item: self._conversation_results(client, model, item, phase), items))
        batch_wall_s = time.perf_counter() - started
        after = take_snapshot(endpoints)
        records = [
            build_record(item, turn, phase, result, before, before)
            for item, results in zip(items, answered, strict=True)
            for turn, result in enumerate(results, start=1)
        ]
        for record in share_batch(records, before, after, batch_wall_s):
            self.on_record(record)

    def _conversation_results(self, client, model: str, item: BenchItem, phase: Phase) -> list[StreamResult]:
        """One item's turns in order; a failed turn is listed and ends the item."""
        results: list[StreamResult] = []
        for turn in range(1, item.num_turns + 1):
            try:
                results.append(stream_chat(client, model, conversation(item, [result.text for result in results]), self._generation))
            except (openai.APIError, httpx.HTTPError) as error:
                logger.error("%s item %s turn %d failed: %s", phase.label, item.item_id, turn, error)
                self.failures.append(
                    {"label": phase.label, "rtt_ms": phase.rtt_ms, "item_id": item.item_id, "turn": turn, "error": str(error)[:500]}
                )
                break
        return results

    def _start(self, spec: ServiceSpec) -> Service:
        self.on_progress(f"starting {spec.name}")
        service = start_service(spec, self.config.startup_timeout_s)
        self.observed_affinity[spec.name] = service.affinity()
        return service

    def _verifier_spec(self) -> ServiceSpec:
        models, placement = self.config.models, self.config.placement
        command = verifier_command(models.target, models.target_gguf_file, models.dtype, placement.threads)
        command += self.config.verifier_args
        return ServiceSpec("verifier-target", command, placement.verifier_cores, placement.threads, self._log_dir)

    def _edge_spec(self, phase: Phase, verifier_url: str) -> ServiceSpec:
        models, placement = self.config.models, self.config.placement
        if phase.draft_length is None:
            raise ValueError(f"phase {phase.label} runs an edge: it needs a draft length")
        command = (
            edge_command(models.draft, models.draft_gguf_file, models.dtype, placement.threads, verifier_url, phase.draft_length)
            + phase.edge.edge_args
            + self.config.edge_args
        )
        return ServiceSpec(f"edge-{phase.label}", command, placement.edge_cores, placement.threads, self._log_dir)

    def _draft_spec(self) -> ServiceSpec:
        models, placement = self.config.models, self.config.placement
        command = verifier_command(models.draft, models.draft_gguf_file, models.dtype, placement.threads)
        command += self.config.verifier_args
        return ServiceSpec("verifier-draft", command, placement.edge_cores, placement.threads, self._log_dir)

    @property
    def _log_dir(self):
        return self.config.output_dir / "logs"
