"""The capacity replay's recorded sessions, as files hold them: each session's verify calls
(``record`` writes them from a real edge), and the draft's proposals along its target output
(``draft_trace`` adds them). Pure data: the recorder, the tracer and the replay all read it."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path


@dataclass(frozen=True)
class DraftTrace:
    """One prompt's target output and the draft's proposals along it."""

    prompt_token_ids: list[int]
    target_token_ids: list[int]
    """The committed tokens of the recorded generation (the target's own greedy output)."""
    proposals: list[int]
    """proposals[i]: the draft's greedy token after prompt + target_token_ids[:i]."""
    draft_s_per_token: float
    """Median seconds of one drafted token (one draft forward over one new token)."""
    draft_prefill_s: float
    """Seconds of the first proposal: the draft's prefill of the prompt, plus its first token."""

    def __post_init__(self) -> None:
        if len(self.proposals) != len(self.target_token_ids):
            raise ValueError(f"{len(self.proposals)} proposals for {len(self.target_token_ids)} target tokens")

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> DraftTrace:
        return cls(**data)


@dataclass(frozen=True)
class RecordedCall:
    request: dict
    """The VerifyRequest body as the edge sent it."""
    think_s: float
    status: int
    num_accepted: int | None = None
    next_token: int | None = None
    verify_s: float = 0.0
    """Answer left - call arrived, at recording time."""
    continued_tokens: list[int] = field(default_factory=list)
    """The tokens the verifier continued with after next_token (wire continuation; a recording's
    lone edge rarely gets any: the verifier continues only while saturated)."""

    @property
    def num_emitted(self) -> int:
        """Tokens the call committed (accepted + next + continued); 0 for a refused call."""
        return 0 if self.num_accepted is None else self.num_accepted + 1 + len(self.continued_tokens)


@dataclass(frozen=True)
class RecordedSession:
    item_id: str
    messages: list[dict]
    max_tokens: int
    completion_tokens: int
    text: str
    calls: list[RecordedCall] = field(default_factory=list)
    trace: DraftTrace | None = None
    """The draft's proposals along the target's output (``draft_trace``): an emulated edge can
    then draft any length. None: only the recorded calls can be replayed."""

    def with_trace(self, trace: DraftTrace) -> RecordedSession:
        return replace(self, trace=trace)

    @property
    def num_emitted(self) -> int:
        """Tokens the verifier emitted over the session (accepted + next + continued per call)."""
        return sum(call.num_emitted for call in self.calls)

    @property
    def is_clean(self) -> bool:
        """Every call answered 200 (no resync): a replay can follow it call for call."""
        return bool(self.calls) and all(call.status == 200 for call in self.calls)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> RecordedSession:
        calls = [RecordedCall(**call) for call in data.pop("calls")]
        trace = data.pop("trace", None)
        return cls(**data, calls=calls, trace=DraftTrace.from_dict(trace) if trace else None)


def write_sessions(sessions: list[RecordedSession], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(session.to_dict()) + "\n" for session in sessions))


def read_sessions(path: Path) -> list[RecordedSession]:
    return [RecordedSession.from_dict(json.loads(line)) for line in path.read_text().splitlines() if line.strip()]
