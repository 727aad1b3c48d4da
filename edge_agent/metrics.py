"""Prometheus metrics of the edge agent, in a registry of its own (no global state)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector

if TYPE_CHECKING:
    from edge_agent.drafter import Drafter
    from edge_agent.verifier_client import VerifyCall

LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class EdgeMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        ProcessCollector(registry=self.registry)  # process_cpu_seconds_total, memory
        r = self.registry
        self.requests = Counter("spade_edge_requests", "Generation requests started", registry=r)
        self.active_requests = Gauge("spade_edge_active_requests", "Generation requests in progress", registry=r)
        self.draft_sessions = Gauge(
            "spade_edge_draft_sessions", "Draft sessions (each with its KV cache) of requests in progress", registry=r
        )
        self.draft_retained = Gauge(
            "spade_edge_draft_retained_sessions", "Finished requests' draft caches kept as prefixes to copy from (bounded)", registry=r
        )
        self.draft_retained_tokens = Gauge("spade_edge_draft_retained_tokens", "Tokens of the retained draft caches", registry=r)
        self.generated_tokens = Counter(
            "spade_edge_generated_tokens",
            (
                "Tokens kept for clients; a final block's tokens past an end-of-sequence token or max_tokens "
                "are dropped here but counted in the verifier's spade_verifier_generated_tokens"
            ),
            registry=r,
        )
        self.verify_calls = Counter("spade_edge_verify_calls", "Verify calls made", registry=r)
        self.prompt_tokens = Counter("spade_edge_prompt_tokens", "Prompt tokens of the generation requests", registry=r)
        self.verifier_cached_tokens = Counter(
            "spade_edge_verifier_cached_tokens",
            "Prompt tokens the verifier did not prefill: a prefix it had cached (same salt and key) covered them",
            registry=r,
        )
        self.resyncs = Counter(
            "spade_edge_resyncs",
            "Sessions rebuilt on the verifier from the full context: a verify call repeated after a 409, or a pipelined session"
            " opened again after a 404 (a restarted or another replica)",
            registry=r,
        )
        self.rejected_answers = Counter(
            "spade_edge_rejected_answers",
            (
                "Verify answers rejected (garbled, invalid, failing the verdict digest, a 5xx) and asked for again, "
                "in calls that then got a valid answer (calls that never did count in spade_edge_verify_failures); "
                "on the pipelined-session wire, decided events dropped (failing their digest, or garbled) and read again"
            ),
            registry=r,
        )
        self.verify_failures = Counter("spade_edge_verify_failures", "Generations ended by an unreachable or failing verifier", registry=r)
        self.fallback_tokens = Counter(
            "spade_edge_fallback_tokens",
            "Unverified draft tokens served while the verifier was unreachable (--fallback draft)",
            registry=r,
        )
        self.drafted_tokens = Counter("spade_edge_drafted_tokens", "Tokens drafted", registry=r)
        self.accepted_tokens = Counter("spade_edge_accepted_tokens", "Drafted tokens accepted", registry=r)
        self.continued_tokens = Counter(
            "spade_edge_continued_tokens",
            "Tokens a saturated verifier decoded on by itself after a verdict (--max-continued-tokens)",
            registry=r,
        )
        self.overlap_hits = Counter(
            "spade_edge_overlap_hits",
            "Blocks started with tokens drafted while the previous block was verified",
            registry=r,
        )
        self.overlap_misses = Counter(
            "spade_edge_overlap_misses",
            "Blocks drafted ahead and rolled back (the verdict did not run through the guess)",
            registry=r,
        )
        self.draft_ahead_tokens = Counter("spade_edge_draft_ahead_tokens", "Tokens drafted while a verify call was in flight", registry=r)
        self.used_draft_tokens = Counter(
            "spade_edge_used_draft_tokens",
            "Drafted tokens that served: accepted, or a drafted-ahead guess of the target's next token that the verdict confirmed",
            registry=r,
        )
        self.rejected_draft_tokens = Counter(
            "spade_edge_rejected_draft_tokens", "Drafted tokens sent for verification and rejected", registry=r
        )
        self.discarded_ahead_tokens = Counter(
            "spade_edge_discarded_ahead_tokens",
            "Tokens drafted ahead and never sent (the verdict missed the guess, or the request ended)",
            registry=r,
        )
        self.skipped_ahead_blocks = Counter(
            "spade_edge_skipped_ahead_blocks",
            "Verify calls under which the edge did not draft ahead: not worth its CPU under --edge-power",
            registry=r,
        )
        self.bytes_sent = Counter("spade_edge_bytes_sent", "Request bytes sent to the verifier", registry=r)
        self.bytes_received = Counter("spade_edge_bytes_received", "Response bytes received from the verifier", registry=r)
        self.draft_lengths = Histogram(
            "spade_edge_draft_length",
            "Draft length: tokens drafted per verify call (0: the prompt-only first call of a request)",
            buckets=(1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 24, 32, 64),
            registry=r,
        )
        self.verifier_advice = Histogram(
            "spade_edge_verifier_advice",
            "The draft length each verdict advised (the verifier's limit while it has idle time; shorter under load)",
            buckets=(1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 24, 32, 64),
            registry=r,
        )
        self.advice_capped_blocks = Counter(
            "spade_edge_advice_capped_blocks",
            "Blocks drafted shorter than the draft-length policy chose, to follow the verifier's advice",
            registry=r,
        )
        self.draft_prompt_tokens = Counter(
            "spade_edge_draft_prompt_tokens", "Prompt tokens of the requests the draft model drafted for", registry=r
        )
        self.draft_prefix_hit_tokens = Counter(
            "spade_edge_draft_prefix_hit_tokens",
            "Context tokens the draft copied from another request's cached prefix, not decoded (hit rate: / draft_prompt_tokens)",
            registry=r,
        )
        self.draft_seconds = Histogram(
            "spade_edge_draft_seconds",
            "Waiting for drafting per block (drafting hidden under a verify call excluded)",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.verify_seconds = Histogram(
            "spade_edge_verify_seconds",
            "Verify round trip (network + queue + forward)",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.verifier_forward_seconds = Histogram(
            "spade_edge_verifier_forward_seconds",
            "Verifier-reported forward time per call",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )

    def watch_drafter(self, drafter: Drafter) -> None:
        """The draft gauges read ``drafter.contexts()`` at every scrape."""
        self.draft_sessions.set_function(lambda: drafter.contexts().live)
        self.draft_retained.set_function(lambda: drafter.contexts().retained)
        self.draft_retained_tokens.set_function(lambda: drafter.contexts().retained_tokens)

    def observe_call(self, call: VerifyCall, num_drafted: int, exposed_draft_s: float) -> None:
        """One verified block: its tokens, bytes and times."""
        self.verify_calls.inc()
        self.resyncs.inc(int(call.resynced))
        self.rejected_answers.inc(call.rejected_answers)
        self.drafted_tokens.inc(num_drafted)
        self.accepted_tokens.inc(call.verdict.num_accepted)
        self.continued_tokens.inc(len(call.verdict.continued_tokens))
        self.used_draft_tokens.inc(call.verdict.num_accepted)
        self.rejected_draft_tokens.inc(num_drafted - call.verdict.num_accepted)
        self.bytes_sent.inc(call.bytes_sent)
        self.bytes_received.inc(call.bytes_received)
        self.draft_lengths.observe(num_drafted)
        self.draft_seconds.observe(exposed_draft_s)
        self.verify_seconds.observe(call.round_trip_s)
        self.verifier_forward_seconds.observe(call.verdict.timings.forward_ms / 1e3)
        self.verifier_cached_tokens.inc(call.verdict.num_cached_tokens)
