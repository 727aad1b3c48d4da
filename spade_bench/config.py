"""What one benchmark run does: models, modes, network sweep, CPU placement, outputs."""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

from edge_agent.draft_length import parse_draft_length
from edge_agent.edge_power import DEFAULT_EDGE_POWER
from spade_bench.data import DataSelection
from spade_bench.records import EdgeVariant

TARGET_MODE = "target"
SPADE_MODE = "spade"
DRAFT_MODE = "draft"
MODES = (TARGET_MODE, SPADE_MODE, DRAFT_MODE)
DRAFT_BACKENDS = ("auto", "llamacpp", "transformers")
EDGE_POWERS = ("performance", "balanced", "saver")

DEFAULT_TARGET = "qwen2.5-coder-1.5b-instruct"
DEFAULT_DRAFT = "qwen2.5-coder-0.5b-instruct"


@dataclass(frozen=True)
class ModelPair:
    """The target (cloud) and draft (edge) models, as the services' ``--model`` takes them."""

    target: str = DEFAULT_TARGET
    """A registry name, a local directory, a hub id or a .gguf path."""
    draft: str = DEFAULT_DRAFT
    target_gguf_file: str | None = None
    draft_gguf_file: str | None = None
    dtype: str = "float32"
    """fp32 makes greedy outputs comparable bit for bit with target-only decoding."""


@dataclass(frozen=True)
class Placement:
    """Which cores each emulated machine gets: two machines emulated on one box."""

    edge_cores: tuple[int, ...] = (0,)
    """The edge agent and the draft-only server run here."""
    verifier_cores: tuple[int, ...] = (1,)
    """The cloud verifier (target model) runs here."""
    threads: int = 1
    """torch threads per service (and OMP/MKL threads)."""

    def __post_init__(self) -> None:
        if not self.edge_cores or not self.verifier_cores:
            raise ValueError("edge_cores and verifier_cores must not be empty")
        available = available_cores()
        unknown = sorted(set(self.edge_cores + self.verifier_cores) - set(available))
        if unknown:
            raise ValueError(f"cores {unknown} not available to this process (have {sorted(available)})")
        if self.threads < 1:
            raise ValueError("threads must be >= 1")

    @property
    def is_disjoint(self) -> bool:
        return not set(self.edge_cores) & set(self.verifier_cores)

    @classmethod
    def default(cls, threads: int = 1) -> Placement:
        """First available core for the edge, the next for the verifier (the same if only one)."""
        cores = sorted(available_cores())
        return cls((cores[0],), (cores[min(1, len(cores) - 1)],), threads)


def available_cores() -> set[int]:
    return set(os.sched_getaffinity(0))


@dataclass(frozen=True)
class NetworkSweep:
    """The emulated edge <-> cloud link, swept over RTTs."""

    rtts_ms: tuple[float, ...] = (0.0, 10.0, 50.0, 100.0)
    jitter_ms: float = 0.0
    bandwidth_mbps: float | None = 100.0
    """Per direction; None is unlimited. 100 Mbit/s is a good wired edge uplink."""

    def __post_init__(self) -> None:
        if not self.rtts_ms or any(rtt < 0 for rtt in self.rtts_ms):
            raise ValueError("rtts_ms must be a non-empty list of values >= 0")
        if self.jitter_ms < 0:
            raise ValueError("jitter_ms must be >= 0")
        if self.bandwidth_mbps is not None and self.bandwidth_mbps <= 0:
            raise ValueError("bandwidth_mbps must be positive")


@dataclass(frozen=True)
class BenchConfig:
    """One run of ``spade-bench``."""

    data_paths: tuple[str, ...]
    output_dir: Path
    selection: DataSelection = DataSelection()
    models: ModelPair = ModelPair()
    modes: tuple[str, ...] = MODES
    draft_lengths: tuple[str, ...] = ("4", "8", "auto")
    """Values of the edge's ``--draft-length``: integers or ``auto``; one edge process each."""
    draft_backends: tuple[str, ...] = ("auto",)
    """Values of the edge's ``--draft-backend`` (auto, llamacpp, transformers); one edge each."""
    overlaps: tuple[bool, ...] = (True,)
    """Whether the edge drafts while a block is verified (``--overlap``); both to compare."""
    edge_powers: tuple[str, ...] = (DEFAULT_EDGE_POWER,)
    """Values of the edge's ``--edge-power`` (performance, balanced, saver); one edge each."""
    concurrency: int = 1
    """Requests sent at once through one edge (or to target-only): items run in batches of this many."""
    network: NetworkSweep = NetworkSweep()
    placement: Placement = field(default_factory=Placement.default)
    max_tokens: int = 128
    temperature: float = 0.0
    """0 is greedy (Spec-Bench's protocol); the identical-output check only applies then."""
    seed: int = 0
    startup_timeout_s: float = 900.0
    """Waiting for a service's /health (loading a GGUF model on a small machine takes a while)."""
    request_timeout_s: float = 1800.0
    warmup_tokens: int = 4
    """Each phase starts with one unrecorded request of this many tokens (0: none)."""
    verifier_args: tuple[str, ...] = ()
    """Extra flags for every ``spade-verifier`` (e.g. ``--max-sessions 64``)."""
    edge_args: tuple[str, ...] = ()
    """Extra flags for every ``spade-edge`` (e.g. ``--verify-timeout-s 300``)."""

    def __post_init__(self) -> None:
        if not self.data_paths:
            raise ValueError("at least one data path is needed")
        unknown = set(self.modes) - set(MODES)
        if unknown or not self.modes:
            raise ValueError(f"modes must be among {MODES}, got {self.modes}")
        for value in self.draft_lengths:
            parse_draft_length(value)  # the edge's own rule: a bad value fails here, not in a started edge
        unknown_backends = set(self.draft_backends) - set(DRAFT_BACKENDS)
        if unknown_backends or not self.draft_backends or not self.overlaps:
            raise ValueError(
                f"draft backends must be among {DRAFT_BACKENDS} and overlaps non-empty, got {self.draft_backends}, {self.overlaps}"
            )
        unknown_powers = set(self.edge_powers) - set(EDGE_POWERS)
        if unknown_powers or not self.edge_powers or self.concurrency < 1:
            raise ValueError(f"edge powers must be among {EDGE_POWERS} and concurrency >= 1, got {self.edge_powers}, {self.concurrency}")
        if SPADE_MODE in self.modes and not self.draft_lengths:
            raise ValueError("spade mode needs at least one draft length")
        if self.max_tokens < 1:
            raise ValueError("max_tokens must be >= 1")
        if self.temperature < 0:
            raise ValueError("temperature must be >= 0")

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0

    @property
    def edge_variants(self) -> list[EdgeVariant]:
        return [
            EdgeVariant(backend, overlap, power)
            for backend in self.draft_backends
            for overlap in self.overlaps
            for power in self.edge_powers
        ]

    def to_dict(self) -> dict:
        described = asdict(self)
        described["output_dir"] = str(self.output_dir)
        described["placement"]["is_disjoint"] = self.placement.is_disjoint
        return described
