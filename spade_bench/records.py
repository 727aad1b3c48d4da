"""One measured request: what was asked, what came back, and what it cost where.

Glossary (per request, i.e. one turn of one conversation = one sequence):
    completion_tokens     tokens the user received
    verify_calls          edge -> verifier calls (for target-only: the target's forward passes)
    target_passes         the target's forward passes, read from the verifier's /metrics
    target_tokens         tokens through those passes, prompt and rejected drafts included
    drafted / accepted    drafted tokens sent for verification / kept by the target
    verifier_cpu_s        CPU seconds the verifier process spent (its own process accounting)
    edge_cpu_s            CPU seconds of the edge process (for draft-only: the draft server)
    bytes_up / bytes_down bytes on the emulated link, edge -> cloud / cloud -> edge
    used / rejected / discarded ahead   what became of each token the edge drafted
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields

from edge_agent.edge_power import DEFAULT_EDGE_POWER


@dataclass(frozen=True)
class EdgeVariant:
    """How the edge drafts: its drafter backend, whether it drafts while a block is verified, and
    how far (``--edge-power``)."""

    draft_backend: str = "auto"
    overlap: bool = True
    edge_power: str = DEFAULT_EDGE_POWER

    @property
    def suffix(self) -> str:
        """What a phase's label adds for this variant: nothing for the edge's defaults."""
        backend = "" if self.draft_backend == "auto" else f"-{self.draft_backend}"
        power = "" if self.edge_power == DEFAULT_EDGE_POWER else f"-{self.edge_power}"
        return backend + ("" if self.overlap else "-in-turn") + power

    @property
    def edge_args(self) -> tuple[str, ...]:
        return ("--draft-backend", self.draft_backend, "--overlap", str(self.overlap).lower(), "--edge-power", self.edge_power)


@dataclass(frozen=True)
class Phase:
    """One mode at one setting: every request of a phase runs under the same conditions."""

    mode: str
    draft_length: str | None = None
    rtt_ms: float | None = None
    """None when the mode does not cross the link (draft-only runs on the edge)."""
    edge: EdgeVariant = EdgeVariant()

    @property
    def label(self) -> str:
        """``target``, ``spade-k4``, ``spade-auto``, ``spade-k8-in-turn``, ``spade-auto-transformers``, ``draft``."""
        if self.draft_length is None:
            return self.mode
        length = f"k{self.draft_length}" if self.draft_length.isdigit() else self.draft_length
        return f"{self.mode}-{length}{self.edge.suffix}"


@dataclass(frozen=True)
class SpadeCounts:
    """The ``spade`` object of a response's usage (zeros where a field is missing)."""

    verify_calls: int = 0
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    target_tokens: int = 0
    resyncs: int = 0
    draft_ms: float = 0.0
    draft_ahead_ms: float = 0.0
    overlap_hits: int = 0
    overlap_misses: int = 0
    verify_ms: float = 0.0
    verifier_forward_ms: float = 0.0
    used_draft_tokens: int = 0
    rejected_draft_tokens: int = 0
    discarded_ahead_tokens: int = 0

    @classmethod
    def from_payload(cls, payload: dict | None) -> SpadeCounts | None:
        if payload is None:
            return None
        known = {field.name for field in fields(cls)}
        return cls(**{key: value for key, value in payload.items() if key in known})


@dataclass
class RequestRecord:
    """Everything measured for one request; serialised as one JSON object."""

    dataset: str
    item_id: str
    category: str
    turn: int
    mode: str
    label: str
    draft_length: str | None
    rtt_ms: float | None
    text: str
    finish_reason: str | None
    prompt_tokens: int | None
    completion_tokens: int
    wall_s: float
    ttft_s: float | None
    verify_calls: int | None = None
    drafted_tokens: int | None = None
    accepted_tokens: int | None = None
    target_tokens: int | None = None
    resyncs: int | None = None
    draft_ms: float | None = None
    draft_ahead_ms: float | None = None
    overlap_hits: int | None = None
    overlap_misses: int | None = None
    verify_ms: float | None = None
    verifier_forward_ms: float | None = None
    used_draft_tokens: int | None = None
    """Drafted tokens accepted, or drafted-ahead guesses the verdict confirmed (the edge's ``spade`` stats)."""
    rejected_draft_tokens: int | None = None
    discarded_ahead_tokens: int | None = None
    """Tokens the edge drafted ahead and threw away (a miss, or the request's end)."""
    concurrency: int = 1
    """Requests sent at once through the edge in this request's batch (``--concurrency``)."""
    batch_wall_share_s: float | None = None
    """The wall time of the batch the request ran in, times its share of the batch's tokens
    (None: one request at a time). With K at once, the batch's CPU seconds and link bytes are
    shared the same way; the shares of a phase add up to its wall time."""
    target_passes: int | None = None
    verifier_cpu_s: float | None = None
    edge_cpu_s: float | None = None
    bytes_up: int = 0
    bytes_down: int = 0
    load_1m: float | None = None
    """The machine's 1-minute load average when the request ended: above the core count, other
    work competed with the pinned services and the timings are pessimistic."""
    identical_to_target: bool | None = None
    rouge1: float | None = None
    rouge2: float | None = None
    rougeL: float | None = None

    @property
    def key(self) -> tuple[str, str, int]:
        """Which prompt this answers, across modes: (dataset, item, turn)."""
        return (self.dataset, self.item_id, self.turn)

    @property
    def tokens_per_s(self) -> float:
        return self.completion_tokens / self.wall_s if self.wall_s > 0 else 0.0

    def to_dict(self) -> dict:
        return asdict(self) | {"tokens_per_s": self.tokens_per_s}

    @classmethod
    def from_dict(cls, payload: dict) -> RequestRecord:
        known = {field.name for field in fields(cls)}
        return cls(**{key: value for key, value in payload.items() if key in known})
