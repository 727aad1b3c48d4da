"""Prometheus metrics of the verifier, in a registry of its own (no global state)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector

from verifier_service.backends.base import BlockVerdict

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class VerifierMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        ProcessCollector(registry=self.registry)  # process_cpu_seconds_total, memory
        self.verify_calls = Counter("spade_verifier_verify_calls", "Verify calls answered", registry=self.registry)
        self.replayed_calls = Counter("spade_verifier_replayed_calls", "Retried verify calls answered from memory", registry=self.registry)
        self.resyncs = Counter("spade_verifier_resyncs", "Verify calls refused with 409 (session unknown or diverged)", registry=self.registry)
        self.forward_passes = Counter("spade_verifier_forward_passes", "Target forward passes (verify calls and target-only steps)", registry=self.registry)
        self.target_tokens = Counter("spade_verifier_target_tokens", "Tokens through the target's forward passes", registry=self.registry)
        self.drafted_tokens = Counter("spade_verifier_drafted_tokens", "Drafted tokens received", registry=self.registry)
        self.accepted_tokens = Counter("spade_verifier_accepted_tokens", "Drafted tokens accepted", registry=self.registry)
        self.generated_tokens = Counter("spade_verifier_generated_tokens", "Tokens emitted (accepted + next)", registry=self.registry)
        self.forward_seconds = Histogram("spade_verifier_forward_seconds", "Forward pass + acceptance per call", buckets=LATENCY_BUCKETS, registry=self.registry)
        self.queue_seconds = Histogram("spade_verifier_queue_seconds", "Wait for the target per call", buckets=LATENCY_BUCKETS, registry=self.registry)
        self.sessions = Gauge("spade_verifier_sessions", "Sessions held", registry=self.registry)

    def observe_forward(self, verdict: BlockVerdict) -> None:
        """Every forward pass, whether for a verify call or a target-only step."""
        self.forward_passes.inc()
        self.target_tokens.inc(verdict.num_target_tokens)
        self.generated_tokens.inc(verdict.num_accepted + 1)
        self.forward_seconds.observe(verdict.forward_s)
        self.queue_seconds.observe(verdict.queue_s)

    def observe_verify(self, num_drafted: int, verdict: BlockVerdict) -> None:
        self.observe_forward(verdict)
        self.verify_calls.inc()
        self.drafted_tokens.inc(num_drafted)
        self.accepted_tokens.inc(verdict.num_accepted)
