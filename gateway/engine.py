"""The interface between the OpenAI routes and whatever produces tokens.

The verifier plugs in target-only decoding, the edge speculative decoding; the routes in
``gateway.serving`` handle everything else (prompts, text, stop strings, streaming, usage).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Protocol

from gateway.protocol import SpadeStats
from spade_core.params import SamplingConfig


@dataclass(frozen=True)
class GenerationRequest:
    request_id: str
    prompt_token_ids: list[int]
    max_tokens: int
    """The engine yields at most this many tokens in total."""
    sampling: SamplingConfig
    eos_token_ids: frozenset[int]
    """The engine stops after yielding any of these."""


@dataclass(frozen=True)
class GeneratedTokens:
    """Tokens the target accepted or produced, in order, with their raw target log-probs."""

    token_ids: list[int]
    logprobs: list[float]


class GenerationEngine(Protocol):
    @property
    def model_id(self) -> str: ...

    @property
    def tokenizer(self): ...

    @property
    def max_context_length(self) -> int: ...

    @property
    def eos_token_ids(self) -> frozenset[int]: ...

    @property
    def vocab_size(self) -> int: ...

    def generate(self, request: GenerationRequest, stats: SpadeStats) -> AsyncIterator[GeneratedTokens]:
        """Yield token batches until EOS or max_tokens; update ``stats`` as it goes. Closing the
        iterator early (stop string, client gone) must free whatever the engine holds."""
        ...
