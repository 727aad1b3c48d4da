"""The verdict audit: every verify call's verdict with the inputs that decided it, one JSON line
each (``--audit-log``), so the acceptance rule can be re-checked offline by recomputing the
target's distributions (``python -m spade_bench.chaos.audit``): the context, the drafted tokens and
the distributions the edge says it sampled them from, the sampling transform and its seed (the
draws are a function of the seed and each token's position), and what the verifier answered.

For tests and chaos runs: a line per call costs the context's size on disk."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

from pydantic import BaseModel, ValidationError

from verifier_service.protocol import SparseDistribution, WireSampling


class VerdictAudit(BaseModel):
    context: list[int]
    """The committed context the block was verified after (the first drafted token's position is its length)."""
    draft_tokens: list[int]
    """The drafted tokens verified (after any cut to the advice)."""
    draft_probs: list[SparseDistribution] | None
    """Their drafted distributions as the edge sent them; None: a greedy draft."""
    sampling: WireSampling
    num_accepted: int
    next_token: int


class AuditLog:
    """Appends ``VerdictAudit`` lines to a file, one writer at a time."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = self.path.open("a", buffering=1)
        self._lock = threading.Lock()

    def record(self, audit: VerdictAudit) -> None:
        line = audit.model_dump_json() + "\n"
        with self._lock:
            self._file.write(line)

    def close(self) -> None:
        with self._lock:
            self._file.close()


def read_audit(path: str | Path) -> Iterator[VerdictAudit]:
    """The audit's verdicts; a line a killed verifier left half-written is skipped."""
    with Path(path).open() as lines:
        for line in lines:
            try:
                yield VerdictAudit.model_validate_json(line)
            except ValidationError:
                continue
