"""What a request samples with: the parameters, their bounds, and a fresh seed. No torch here,
so the HTTP layer (``gateway``) and the settings import it for nothing; the math that applies
these parameters to logits is ``spade_core.sampling``.

The bounds are the one definition both wires validate against: the OpenAI schemas
(``gateway.protocol``) and the edge <-> verifier wire (``verifier_service.protocol``) build
their fields from them, and ``SamplingConfig`` checks them again for callers in Python.
"""

from __future__ import annotations

import hashlib
import math
import secrets
from dataclasses import dataclass

MAX_SEED = 2**63 - 1
MAX_TEMPERATURE = 2.0
"""OpenAI's bound; also the wire's (a temperature of Infinity is not a distribution)."""
MAX_CONTINUED_TOKENS = 1024
"""The most tokens one verify call may let the verifier decode on by itself (the wire's
``max_continued_tokens``; each service's own ``--max-continued-tokens`` may set fewer)."""
GREEDY_BELOW_TEMPERATURE = 1e-5
"""A temperature below this samples greedily (vLLM's _SAMPLING_EPS). Such a temperature's
distribution is one-hot at the argmax in float32 anyway, except between near-ties, and
logits / temperature would overflow to inf (NaN probabilities) as it approaches 0."""


@dataclass(frozen=True)
class SamplingConfig:
    """How one request samples its tokens."""

    temperature: float = 1.0
    """0 is greedy; larger values flatten the distribution."""
    top_k: int = 0
    """Keep only the k most likely tokens; 0 (or -1) keeps all."""
    top_p: float = 1.0
    """Keep the smallest set of most likely tokens whose mass reaches top_p (always the top one)."""
    seed: int = 0
    """Seeds every random draw of the request, together with the token's absolute position."""

    def __post_init__(self) -> None:
        if not (math.isfinite(self.temperature) and 0 <= self.temperature <= MAX_TEMPERATURE):
            raise ValueError(f"temperature must be in [0, {MAX_TEMPERATURE}], got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            raise ValueError(f"top_k must be -1, 0 or positive, got {self.top_k}")
        if not 0 <= self.seed <= MAX_SEED:
            raise ValueError(f"seed must be in [0, {MAX_SEED}], got {self.seed}")

    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW_TEMPERATURE


def random_seed() -> int:
    """A fresh seed for a request that did not bring one."""
    return secrets.randbelow(MAX_SEED)


def continued_seed(seed: int, num_generated: int) -> int:
    """The seed of a request that goes on from ``num_generated`` tokens of an earlier one with
    ``seed``: the seed itself from the start, another (the same every time) for each later start.
    An engine whose generator restarts with each request (vLLM) would otherwise draw the same
    uniforms again at later positions, tying their tokens to earlier ones. Used where a session's
    decoding starts again: vLLM's session route adding a request again after a window stop, and an
    edge opening its session again on another verifier replica.

    Example: (7, 0) -> 7; (7, 40) -> another seed, the same every time."""
    if num_generated == 0:
        return seed
    return int.from_bytes(hashlib.blake2b(f"{seed}:{num_generated}".encode(), digest_size=8).digest(), "little") >> 1
