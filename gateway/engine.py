"""The interface between the OpenAI routes and whatever produces tokens.

The verifier plugs in target-only decoding, the edge speculative decoding; the routes in
``gateway.serving`` handle everything else (prompts, text, stop strings, streaming, usage).
"""

from __future__ import annotations

from collections.abc import AsyncGenerator
from dataclasses import dataclass
from typing import Protocol

from gateway.errors import InvalidRequestError
from gateway.model import LogprobsSupport, ModelDescription
from gateway.protocol import SpadeStats
from spade_core.params import SamplingConfig

__all__ = ["GeneratedTokens", "GenerationEngine", "GenerationRequest", "LogprobsSupport", "TopLogprobs", "check_logprobs_support"]

TopLogprobs = list[tuple[int, float]]
"""One token's most likely alternatives: (token id, logprob) pairs, most likely first."""


@dataclass(frozen=True)
class GenerationRequest:
    request_id: str
    prompt_token_ids: list[int]
    max_tokens: int
    """The engine yields at most this many tokens in total."""
    sampling: SamplingConfig
    eos_token_ids: frozenset[int]
    """The engine stops after yielding any of these."""
    num_top_logprobs: int | None = None
    """None: no logprobs wanted (nothing computed). N >= 0: each token's logprob and its N most
    likely alternatives (``spade_core.sampling.reported_logprobs``)."""
    cache_salt: str | None = None
    """The request's ``cache_salt``: only requests with the same one share cached prefixes."""
    cache_owner: str = ""
    """The caller's API key id ("" without keys): prefixes are shared per key by default."""
    prefix_key: str | None = None
    """What the prompt shares with other requests, as a digest (``gateway.affinity``): an edge
    sends it with its verify calls so that a pool of verifier replicas routes requests that
    share a prefix to the same replica. None: route by session."""


@dataclass(frozen=True)
class GeneratedTokens:
    """Tokens the target accepted or produced, in order; with logprobs when the request asked."""

    token_ids: list[int]
    logprobs: list[float] | None = None
    """Per token, the target's log-probability of it (``spade_core.sampling.reported_logprobs``);
    None when not asked."""
    top_logprobs: list[TopLogprobs] | None = None
    """Per token, the request's ``num_top_logprobs`` most likely alternatives; None when not asked."""


def check_logprobs_support(support: LogprobsSupport, sampling: SamplingConfig, param: str) -> None:
    """Refuse (400) logprobs that the engine could not report exactly for this sampling."""
    if support == "all" or (support == "greedy" and sampling.is_greedy):
        return
    if support == "greedy":
        reason = (
            "at temperature > 0 this verifier (vLLM backend: the sample_match route, or vLLM's own decode loop) cannot "
            "report them: use temperature 0, or run the verifier with --vllm-exact-route full_logprobs (and, for its own "
            "OpenAI routes, --target-route verify-steps)"
        )
    else:
        reason = "the verifier is too old to report them: upgrade it"
    raise InvalidRequestError(f"{param}: {reason}", param=param, code="logprobs_unsupported")


class GenerationEngine(Protocol):
    @property
    def model(self) -> ModelDescription:
        """The model whose output this engine produces: id, limits, end tokens, logprobs."""
        ...

    @property
    def tokenizer(self):
        """A transformers tokenizer for the model's token ids (chat template, decoding)."""
        ...

    def generate(self, request: GenerationRequest, stats: SpadeStats) -> AsyncGenerator[GeneratedTokens, None]:
        """Yield token batches until EOS or max_tokens; update ``stats`` as it goes. Closing the
        iterator early (stop string, client gone) must free whatever the engine holds."""
        ...
