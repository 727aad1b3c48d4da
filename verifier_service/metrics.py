"""Prometheus metrics of the verifier, in a registry of its own (no global state)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector

if TYPE_CHECKING:  # the backend contract pulls in torch; building the registry (docs/metrics.md) must not
    from verifier_service.backends.base import BlockVerdict, ForwardRecord

BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64)
ADVICE_BUCKETS = (1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 24, 32, 64)
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class VerifierMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        ProcessCollector(registry=self.registry)  # process_cpu_seconds_total, memory
        self.verify_calls = Counter("spade_verifier_verify_calls", "Verify calls answered", registry=self.registry)
        self.replayed_calls = Counter("spade_verifier_replayed_calls", "Retried verify calls answered from memory", registry=self.registry)
        self.resyncs = Counter(
            "spade_verifier_resyncs",
            "Verify calls refused with 409 (session unknown or diverged)",
            registry=self.registry,
        )
        self.forward_passes = Counter(
            "spade_verifier_forward_passes",
            "Target forward passes (verify calls and target-only steps)",
            registry=self.registry,
        )
        self.target_tokens = Counter("spade_verifier_target_tokens", "Tokens through the target's forward passes", registry=self.registry)
        self.drafted_tokens = Counter("spade_verifier_drafted_tokens", "Drafted tokens received", registry=self.registry)
        self.accepted_tokens = Counter("spade_verifier_accepted_tokens", "Drafted tokens accepted", registry=self.registry)
        self.generated_tokens = Counter(
            "spade_verifier_generated_tokens",
            (
                "Tokens the target committed (accepted + next, and each continued token), counted before the edge trims a final block "
                "at an end-of-sequence token or max_tokens: can exceed the edges' spade_edge_generated_tokens"
                " (target-only requests count here too)"
            ),
            registry=self.registry,
        )
        self.forward_seconds = Histogram(
            "spade_verifier_forward_seconds",
            "Forward pass + acceptance per call",
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.queue_seconds = Histogram(
            "spade_verifier_queue_seconds",
            "Wait for the target per call",
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.batch_sessions = Histogram(
            "spade_verifier_batch_sessions",
            "Sessions sharing each call's forward (batched verification)",
            buckets=BATCH_BUCKETS,
            registry=self.registry,
        )
        self.sessions = Gauge("spade_verifier_sessions", "Sessions held", registry=self.registry)
        self.prefix_store_bytes = Gauge(
            "spade_verifier_prefix_store_bytes",
            "KV bytes of ended sessions' caches kept as shared prefixes (part of spade_verifier_kv_cache_bytes)",
            registry=self.registry,
        )
        self.prefix_store_entries = Gauge(
            "spade_verifier_prefix_store_entries", "Ended sessions' caches kept as shared prefixes", registry=self.registry
        )
        self.kv_cache_bytes = Gauge(
            "spade_verifier_kv_cache_bytes",
            "Bytes of KV cache the sessions and retained shared prefixes hold or have reserved, within "
            "--max-kv-cache-bytes (0 where the backend keeps no budget, such as vLLM)",
            registry=self.registry,
        )
        self.prompt_tokens = Counter(
            "spade_verifier_prompt_tokens",
            "Context tokens of the calls that start a cache (new sessions, resyncs, target-only prompts)",
            registry=self.registry,
        )
        self.prefix_hit_tokens = Counter(
            "spade_verifier_prefix_hit_tokens",
            "Of those, tokens a shared cached prefix covered (copied, not prefilled; vLLM: its prefix cache's hits)",
            registry=self.registry,
        )
        self.model_forwards = Counter(
            "spade_verifier_model_forwards",
            "Model forwards run (one per forward, however many sessions and calls share it; prefill chunks included)",
            registry=self.registry,
        )
        self.model_forward_rows = Counter(
            "spade_verifier_model_forward_rows", "Rows (tokens) fed to the model over all forwards", registry=self.registry
        )
        self.forward_sessions = Histogram(
            "spade_verifier_forward_sessions",
            "Sessions sharing each model forward (per forward, not per call)",
            buckets=BATCH_BUCKETS,
            registry=self.registry,
        )
        self.advised_draft_length = Histogram(
            "spade_verifier_advised_draft_length",
            "The draft length each answer advised its session (the --max-draft-length while the target has idle time)",
            buckets=ADVICE_BUCKETS,
            registry=self.registry,
        )
        self.cut_blocks = Counter(
            "spade_verifier_cut_blocks", "Blocks longer than their session's advice, cut to it before verification", registry=self.registry
        )
        self.cut_tokens = Counter(
            "spade_verifier_cut_tokens", "Drafted tokens cut off blocks longer than the advice", registry=self.registry
        )
        self.continued_tokens = Counter(
            "spade_verifier_continued_tokens",
            "Tokens the verifier decoded on by itself after a verify call's verdict (its advice 0, the call allowing"
            " it: max_continued_tokens); each is also a target-only step in spade_verifier_forward_passes",
            registry=self.registry,
        )
        self.ahead_steps = Counter(
            "spade_verifier_ahead_steps",
            "Target-only steps the verifier decoded a session by between its edge's calls (--step-ahead-tokens); each is"
            " also in spade_verifier_forward_passes",
            registry=self.registry,
        )
        self.ahead_tokens = Counter(
            "spade_verifier_ahead_tokens",
            "Tokens decoded ahead that a later call committed (used) or that were dropped (the session ended or was"
            " evicted, or a call did not continue its context)",
            ["outcome"],
            registry=self.registry,
        )
        self.ahead_answers = Counter(
            "spade_verifier_ahead_answers",
            "Verify calls answered from tokens decoded ahead, with no forward of their own (a decided token contradicted"
            " the block, or the block ended before them)",
            registry=self.registry,
        )
        self.ahead_drafts = Counter(
            "spade_verifier_ahead_drafts",
            "Drafted tokens checked against tokens decoded ahead: confirmed (equal: accepted without a row) or stale (at or"
            " after the first contradiction: dropped without a row)",
            ["outcome"],
            registry=self.registry,
        )
        for outcome in ("used", "dropped"):  # exposed at 0 from the start
            self.ahead_tokens.labels(outcome)
        for outcome in ("confirmed", "stale"):
            self.ahead_drafts.labels(outcome)
        self.pipeline_sessions = Gauge(
            "spade_verifier_pipeline_sessions",
            "Pipelined sessions open (--pipelined-sessions), finished ones not yet closed included",
            registry=self.registry,
        )
        self.pipeline_tokens = Counter(
            "spade_verifier_pipeline_tokens",
            "Tokens pipelined sessions decided: accepted proposed drafts (proposal) or the target's own next token of a"
            " forward (verifier: the correction, the bonus, or a step with nothing proposed)",
            ["source"],
            registry=self.registry,
        )
        self.pipeline_proposals = Counter(
            "spade_verifier_pipeline_proposals",
            "Proposals of pipelined sessions by what became of them: read by a forward (used), contradicted by decided"
            " tokens before any forward read them (stale), replaced by a newer one before any forward read them"
            " (superseded), or passed by decided tokens without a contradiction before any forward read them (passed)",
            ["outcome"],
            registry=self.registry,
        )
        for source in ("proposal", "verifier"):
            self.pipeline_tokens.labels(source)
        for outcome in ("used", "stale", "superseded", "passed"):
            self.pipeline_proposals.labels(outcome)
        self.native_requests = Counter(
            "spade_verifier_native_requests",
            (
                "Target-only requests decoded by vLLM's own loop (--target-route native), one per generation; their"
                " tokens count in spade_verifier_target_tokens (uncached prompt + tokens fed back) and"
                " spade_verifier_generated_tokens, their forwards are vLLM's and are not in spade_verifier_forward_passes"
            ),
            registry=self.registry,
        )
        self.native_aborted = Counter(
            "spade_verifier_native_aborted",
            "Native target-only requests aborted in vLLM before it finished them (client gone, a stop string, an error)",
            registry=self.registry,
        )
        self.forward_seconds_by_block = Histogram(
            "spade_verifier_forward_seconds_by_block",
            "The model call alone per forward, by draft length (0 = a target-only step; 17+ pooled; "
            "'prefill' = calls that also fed uncached context): the curve t_verify(d)",
            ["num_drafted"],
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )

    def observe_native_request(self, num_target_tokens: int, num_generated: int, queue_s: float, *, is_aborted: bool) -> None:
        """One target-only request decoded by vLLM's own loop (``--target-route native``)."""
        self.native_requests.inc()
        self.native_aborted.inc(is_aborted)
        self.target_tokens.inc(num_target_tokens)
        self.generated_tokens.inc(num_generated)
        self.queue_seconds.observe(queue_s)

    def observe_forward(self, verdict: BlockVerdict, num_drafted: int = 0) -> None:
        """Every forward pass, whether for a verify call or a target-only step (num_drafted 0)."""
        self.forward_passes.inc()
        self.target_tokens.inc(verdict.num_target_tokens)
        self.prefix_hit_tokens.inc(verdict.num_cached_tokens)
        self.generated_tokens.inc(verdict.num_accepted + 1)
        self.forward_seconds.observe(verdict.forward_s)
        self.queue_seconds.observe(verdict.queue_s)
        self.batch_sessions.observe(verdict.num_batched)
        if verdict.model_s is not None and verdict.num_batched == 1:
            self.forward_seconds_by_block.labels(block_label(num_drafted, verdict.num_target_tokens)).observe(verdict.model_s)

    def observe_model_forward(self, record: ForwardRecord) -> None:
        """One model forward (the transformers backend reports each; vLLM's are its own)."""
        self.model_forwards.inc()
        self.model_forward_rows.inc(record.num_rows)
        self.forward_sessions.observe(record.num_sessions)

    def observe_verify(self, num_drafted: int, verdict: BlockVerdict) -> None:
        """A verify call's verdict (its continued steps are ``observe_forward``s of their own)."""
        self.observe_forward(verdict, num_drafted)
        self.verify_calls.inc()
        self.drafted_tokens.inc(num_drafted)
        self.accepted_tokens.inc(verdict.num_accepted)


MAX_BLOCK_LABEL = 16


def block_label(num_drafted: int, num_target_tokens: int) -> str:
    """The by-block histogram's label: a steady-state call feeds the previous next token plus
    the block (num_drafted + 1 rows); any call that fed more also prefilled context."""
    if num_target_tokens > num_drafted + 1:
        return "prefill"
    return str(num_drafted) if num_drafted <= MAX_BLOCK_LABEL else f"{MAX_BLOCK_LABEL + 1}+"
