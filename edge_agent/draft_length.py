"""How many tokens to draft per verify call: fixed, or adapted to acceptance and round trip.

The adaptive rule picks the block length d that maximises expected tokens per second. With a
per-token acceptance rate a, a block of d drafted tokens yields on average
    E[tokens](d) = (1 - a^(d+1)) / (1 - a)        (accepted drafts + the next token)
and costs d * t_draft (drafting one token) + t_verify (round trip + the target's forward).
Example, a = 0.8 and t_draft = 20 ms: t_verify = 100 ms -> best d = 4 (3.36 tokens per 180 ms);
t_verify = 300 ms -> d = 7 (4.16 tokens per 440 ms); t_verify = 10 ms -> d = 1. Long round trips
favour long blocks; poor acceptance and slow drafting favour short ones.

a, t_draft and t_verify are exponential moving averages of what the edge measures.
"""

from __future__ import annotations

from dataclasses import dataclass, field


def expected_tokens(acceptance_rate: float, num_drafted: int) -> float:
    if acceptance_rate >= 1.0:
        return num_drafted + 1.0
    return (1.0 - acceptance_rate ** (num_drafted + 1)) / (1.0 - acceptance_rate)


def best_draft_length(acceptance_rate: float, draft_s: float, verify_s: float, max_length: int) -> int:
    """argmax over d in [1, max_length] of expected tokens per second of one block."""
    def rate(num_drafted: int) -> float:
        return expected_tokens(acceptance_rate, num_drafted) / (num_drafted * draft_s + verify_s)

    return max(range(1, max_length + 1), key=rate)


@dataclass
class FixedDraftLength:
    length: int

    def __post_init__(self) -> None:
        if self.length < 1:
            raise ValueError(f"draft length must be >= 1, got {self.length}")

    def next_length(self) -> int:
        return self.length

    def observe(self, num_drafted: int, num_accepted: int, draft_s: float, verify_s: float) -> None:
        """A fixed length learns nothing."""


@dataclass
class AdaptiveDraftLength:
    """Chooses the block length from running estimates; starts from a neutral prior."""

    max_length: int = 16
    smoothing: float = 0.2
    """Weight of the newest observation in the moving averages."""
    acceptance_rate: float = 0.7
    """Per-token acceptance estimate: accepted_per_block / trials_per_block."""
    draft_s_per_token: float = 0.02
    verify_s: float = 0.05
    accepted_per_block: float = field(init=False)
    trials_per_block: float = field(init=False)

    def __post_init__(self) -> None:
        if self.max_length < 1 or not 0 < self.smoothing <= 1:
            raise ValueError("max_length must be >= 1 and smoothing in (0, 1]")
        # The prior counts as one trial at the prior rate.
        self.accepted_per_block, self.trials_per_block = self.acceptance_rate, 1.0

    def next_length(self) -> int:
        return best_draft_length(self.acceptance_rate, self.draft_s_per_token, self.verify_s, self.max_length)

    def observe(self, num_drafted: int, num_accepted: int, draft_s: float, verify_s: float) -> None:
        if num_drafted < 1:
            return
        # Each drafted token up to the first rejection is one trial of rate a (all accepted: d
        # trials). The estimate is the ratio of the averages, accepted / trials, which converges
        # to a; the average of the per-block ratios k / (k + 1) does not (it reads a = 0.8 as
        # about 0.6 with blocks of 16, and so picks blocks too short).
        trials = num_accepted + (0 if num_accepted == num_drafted else 1)
        self.accepted_per_block = self._blend(self.accepted_per_block, num_accepted)
        self.trials_per_block = self._blend(self.trials_per_block, trials)
        self.acceptance_rate = min(0.99, self.accepted_per_block / self.trials_per_block)
        self.draft_s_per_token = self._blend(self.draft_s_per_token, draft_s / num_drafted)
        self.verify_s = self._blend(self.verify_s, verify_s)

    def _blend(self, old: float, new: float) -> float:
        return (1 - self.smoothing) * old + self.smoothing * new


def parse_draft_length(value: str | int, max_length: int) -> FixedDraftLength | AdaptiveDraftLength:
    """``"auto"`` -> adaptive (up to max_length), an integer -> fixed."""
    if str(value).strip().lower() == "auto":
        return AdaptiveDraftLength(max_length=max_length)
    try:
        return FixedDraftLength(int(value))
    except ValueError:
        raise ValueError(f"draft length must be a positive integer or 'auto', got {value!r}") from None
