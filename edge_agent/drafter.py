"""Drafters: what proposes the block the verifier checks.

A drafter opens one session per generation, and a session ``propose``s a block for the committed
context. Unlike transformers' CandidateGenerator (propose / update) there is no update step: the
verdict reaches the draft as the next proposal's context. The model drafter runs the small
model with its own KV cache kept across blocks: the cache is cropped to the longest prefix it
shares with the committed context, so a block costs one forward per drafted token and the
verdict's next token is fed with the first of them.

At temperature 0 the drafter is greedy and sends no distributions (the verifier treats each
drafted token as one-hot). Otherwise each token is sampled from the draft model's distribution
after the request's transform, truncated to the ``max_support`` most likely tokens and
renormalised; that truncated distribution is exactly what the token was sampled from, and it is
sent along, which keeps verification exact.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch

from spade_core.params import SamplingConfig
from spade_core.sampling import position_uniforms, processed_probs, sample_from, truncate_to_top_n
from spade_models.kv_cache import TokenCache, cache_argument_name
from spade_models.loader import LoadedModel
from verifier_service.protocol import SparseDistribution

DRAFT_STREAM = "draft"


@dataclass(frozen=True)
class DraftBlock:
    token_ids: list[int]
    probs: list[SparseDistribution] | None
    """Per drafted token, the distribution it was sampled from; None for a greedy draft."""


class DraftSession(Protocol):
    def propose(self, context: list[int], num_tokens: int, sampling: SamplingConfig) -> DraftBlock:
        """Draft ``num_tokens`` after ``context``; the session's cache follows whatever context
        it is given (rejected drafts are rolled back here, at the next proposal)."""
        ...

    def close(self) -> None: ...


class Drafter(Protocol):
    def start_session(self) -> DraftSession: ...

    def close(self) -> None:
        """Free what the drafter holds; the engine calls it once, at shutdown."""
        ...


@dataclass(frozen=True)
class DraftLimits:
    """What the verifier accepts of a drafted block (from its /health); a drafter keeps within it."""

    max_support: int = 32
    """Tokens kept in a sampled token's distribution: the most likely ones, renormalised."""
    vocab_limit: int | None = None
    """Token ids at or above this are never drafted (the verifier's vocabulary size)."""


@dataclass
class ModelDrafter:
    """Drafts with a small causal LM (transformers)."""

    loaded: LoadedModel
    limits: DraftLimits = DraftLimits()
    cache_argument: str = field(init=False)

    def __post_init__(self) -> None:
        self.cache_argument = cache_argument_name(self.loaded.model)

    def start_session(self) -> ModelDraftSession:
        return ModelDraftSession(self)

    def close(self) -> None:
        """Nothing to free: each session's cache goes with the session."""


@dataclass
class ModelDraftSession:
    drafter: ModelDrafter
    entry: TokenCache | None = None

    def propose(self, context: list[int], num_tokens: int, sampling: SamplingConfig) -> DraftBlock:
        """``num_tokens`` drafted tokens following ``context`` (one forward per token)."""
        if self.entry is None:
            self.entry = TokenCache.empty(self.drafter.loaded.model)
        entry = self.entry
        pending = entry.reuse_for(context)
        uniforms = position_uniforms(sampling.seed, len(context), num_tokens, stream=DRAFT_STREAM)
        token_ids: list[int] = []
        distributions: list[SparseDistribution] = []
        for index in range(num_tokens):
            logits = self._forward(entry, pending)
            token_id, distribution = self._choose(logits, sampling, float(uniforms[index, 0]))
            token_ids.append(token_id)
            if distribution is not None:
                distributions.append(distribution)
            pending = [token_id]
        return DraftBlock(token_ids, None if sampling.is_greedy else distributions)

    def close(self) -> None:
        self.entry = None

    def _forward(self, entry: TokenCache, input_ids: list[int]) -> torch.Tensor:
        model = self.drafter.loaded.model
        with torch.inference_mode():
            output = model(
                input_ids=torch.tensor([input_ids], device=model.device),
                use_cache=True,
                logits_to_keep=1,
                **{self.drafter.cache_argument: entry.cache},
            )
        entry.token_ids = entry.token_ids + input_ids
        logits = output.logits[0, -1].float()
        vocab_limit = self.drafter.limits.vocab_limit
        if vocab_limit is not None and vocab_limit < logits.shape[-1]:
            # Out of place: the logits are an inference tensor, which refuses in-place updates here.
            beyond_limit = torch.arange(logits.shape[-1], device=logits.device) >= vocab_limit
            logits = logits.masked_fill(beyond_limit, float("-inf"))
        return logits

    def _choose(self, logits: torch.Tensor, sampling: SamplingConfig, uniform: float) -> tuple[int, SparseDistribution | None]:
        if sampling.is_greedy:
            return int(logits.argmax()), None
        return sample_draft_token(logits, sampling, uniform, self.drafter.limits.max_support)


def sample_draft_token(logits: torch.Tensor, sampling: SamplingConfig, uniform: float, max_support: int) -> tuple[int, SparseDistribution]:
    """One drafted token from logits [vocab] at temperature > 0, with the distribution it was
    drawn from: the request's transform, truncated to the ``max_support`` most likely tokens."""
    support_ids, support_probs = truncate_to_top_n(processed_probs(logits, sampling), max_support)
    index = sample_from(support_probs.cpu(), uniform)
    distribution = SparseDistribution(token_ids=support_ids.tolist(), probs=support_probs.tolist())
    return int(support_ids[index]), distribution
