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

Prefix reuse (``edge_agent.draft_prefixes``): a session whose context shares a longer prefix with
another sequence of its owner (a live session's cache, or a finished one's, retained up to
``max_retained_tokens`` tokens, least recently used out first) than with its own cache starts from
a copy of that prefix's KV rows and feeds only the rest. Copies, not shared tensors: a cache grows
in place, so two sessions must never hold one.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol, cast

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from edge_agent.draft_prefixes import PrefixMatch, Retained, RetainedPrefixes, longest_prefix
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

    @property
    def num_cached_tokens(self) -> int:
        """Context tokens taken from another sequence's cache instead of fed (prefix reuse)."""
        ...


@dataclass(frozen=True)
class DraftContexts:
    """What a drafter holds at one moment (the edge's /metrics; a leak shows as growth here)."""

    live: int
    """Sessions of requests in progress, each with its draft KV cache."""
    retained: int
    """Finished sessions' caches kept as prefixes to copy from (bounded)."""
    retained_tokens: int


class Drafter(Protocol):
    def contexts(self) -> DraftContexts: ...

    def start_session(self, prefix_owner: str = "") -> DraftSession:
        """A session for one request; it reuses prefixes only of sessions with the same
        ``prefix_owner`` (``draft_prefixes.prefix_owner``: the API key and cache_salt)."""
        ...

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
    max_retained_tokens: int = 4096
    """Tokens of finished sessions' caches kept as prefixes (0: no prefix reuse at all)."""
    cache_argument: str = field(init=False)
    _lock: threading.Lock = field(init=False, repr=False, default_factory=threading.Lock)
    """One proposal at a time: a proposal may copy another session's cache."""
    _live: dict[int, ModelDraftSession] = field(init=False, repr=False, default_factory=dict)
    _retained: RetainedPrefixes[int, TokenCache] = field(init=False, repr=False, default_factory=RetainedPrefixes)
    _session_ids: itertools.count = field(init=False, repr=False, default_factory=itertools.count)

    def __post_init__(self) -> None:
        self.cache_argument = cache_argument_name(self.loaded.model)
        if not has_copyable_cache(self.loaded.model):
            self.max_retained_tokens = 0  # a sliding-window or linear-attention layer: no prefix to copy

    @property
    def num_retained_tokens(self) -> int:
        return self._retained.num_tokens

    def contexts(self) -> DraftContexts:
        with self._lock:
            return DraftContexts(len(self._live), len(self._retained), self._retained.num_tokens)

    def start_session(self, prefix_owner: str = "") -> ModelDraftSession:
        with self._lock:
            session = ModelDraftSession(self, next(self._session_ids), prefix_owner)
            self._live[session.session_id] = session
            return session

    def close(self) -> None:
        """Drop the retained caches (each live session's cache goes with the session)."""
        with self._lock:
            self._retained = RetainedPrefixes()

    def _release(self, session: ModelDraftSession) -> None:
        """Retain the session's cache as a prefix (the most recently used), within the bound."""
        with self._lock:
            self._live.pop(session.session_id, None)
            entry, session.entry = session.entry, None
            if entry is None or not entry.token_ids or len(entry.token_ids) > self.max_retained_tokens:
                return
            self._retained.add(session.session_id, Retained(session.owner, entry.token_ids, entry))
            while self._retained.num_tokens > self.max_retained_tokens:
                self._retained.pop_least_recent()

    def _start_entry(self, session: ModelDraftSession, context: list[int]) -> TokenCache:
        """The session's cache for ``context``: its own, or a copy of a longer prefix that
        another session of its owner holds."""
        entry = session.entry if session.entry is not None else TokenCache.empty(self.loaded.model)
        match = self._longest_shared_prefix(session, context) if self.max_retained_tokens else None
        if match is None or match.length <= entry.reusable_length(context):
            return entry
        session.num_cached_tokens += match.length
        return copy_prefix(self._source_cache(match.source), match.length, self.loaded.model)

    def _source_cache(self, key: int) -> TokenCache:
        """The cache a prefix is copied from; a retained one becomes the most recently used."""
        retained = self._retained.entries.get(key)
        if retained is not None:
            self._retained.touch(key)
            return retained.held
        entry = self._live[key].entry
        if entry is None:
            raise RuntimeError(f"draft session {key} offered a prefix but holds no cache")
        return entry

    def _longest_shared_prefix(self, session: ModelDraftSession, context: list[int]) -> PrefixMatch[int] | None:
        live = [
            (other_id, other.entry.token_ids)
            for other_id, other in self._live.items()
            if other is not session and other.owner == session.owner and other.entry is not None
        ]
        return longest_prefix(context, live + self._retained.candidates(session.owner))


def has_copyable_cache(model) -> bool:
    """Whether every layer of the model's cache holds all positions' keys and values (a plain
    DynamicLayer), so that a prefix of it is a slice."""
    return all(type(layer) is DynamicLayer for layer in DynamicCache(config=model.config).layers)


def copy_prefix(source: TokenCache, length: int, model) -> TokenCache:
    """A new cache holding the first ``length`` positions of ``source`` (its KV rows copied;
    ``has_copyable_cache`` says the layers are DynamicLayers)."""
    copied = TokenCache.empty(model)
    for layer_index, layer in enumerate(cast(list[DynamicLayer], source.cache.layers)):
        keys, values = cast(torch.Tensor, layer.keys), cast(torch.Tensor, layer.values)
        copied.cache.update(keys[:, :, :length].clone(), values[:, :, :length].clone(), layer_index)
    copied.token_ids = source.token_ids[:length]
    return copied


@dataclass(eq=False)
class ModelDraftSession:
    drafter: ModelDrafter = field(repr=False)
    session_id: int = 0
    owner: str = ""
    """The isolation key: prefixes are shared only between sessions of one owner."""
    entry: TokenCache | None = None
    num_cached_tokens: int = 0
    """Context tokens copied from another session's cache instead of fed (prefix reuse)."""

    def propose(self, context: list[int], num_tokens: int, sampling: SamplingConfig) -> DraftBlock:
        """``num_tokens`` drafted tokens following ``context`` (one forward per token)."""
        with self.drafter._lock:
            entry = self.entry = self.drafter._start_entry(self, context)

            def next_token(input_ids: list[int], uniform: float | None) -> tuple[int, SparseDistribution | None]:
                return self._choose(self._forward(entry, input_ids), sampling, uniform)

            return draft_block(entry.reuse_for(context), len(context), num_tokens, sampling, next_token)

    def close(self) -> None:
        """Hand the cache to the drafter's retained prefixes (idempotent)."""
        self.drafter._release(self)

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

    def _choose(self, logits: torch.Tensor, sampling: SamplingConfig, uniform: float | None) -> tuple[int, SparseDistribution | None]:
        if sampling.is_greedy:
            return int(logits.argmax()), None
        if uniform is None:
            raise ValueError("a sampled draft token needs its uniform draw")
        return sample_draft_token(logits, sampling, uniform, self.drafter.limits.max_support)


def draft_block(
    uncached: list[int],
    context_length: int,
    num_tokens: int,
    sampling: SamplingConfig,
    next_token: Callable[[list[int], float | None], tuple[int, SparseDistribution | None]],
) -> DraftBlock:
    """The propose loop every drafter shares: ``num_tokens`` tokens after a context of
    ``context_length``, one forward each. ``next_token(input_ids, uniform)`` feeds ``input_ids``
    after the drafter's cache (first the context's ``uncached`` tail, then each drafted token) and
    chooses the next token with its distribution (None when greedy). At temperature > 0 the
    position's uniform draw comes from the request's seed and the token's absolute position
    (``position_uniforms``, the draft's own stream), so a block is the same however the blocks
    before it were cut."""
    uniforms = None if sampling.is_greedy else position_uniforms(sampling.seed, context_length, num_tokens, stream=DRAFT_STREAM)
    token_ids: list[int] = []
    distributions: list[SparseDistribution] = []
    pending = uncached
    for index in range(num_tokens):
        token_id, distribution = next_token(pending, None if uniforms is None else float(uniforms[index, 0]))
        token_ids.append(token_id)
        if distribution is not None:
            distributions.append(distribution)
        pending = [token_id]
    return DraftBlock(token_ids, None if sampling.is_greedy else distributions)


def sample_draft_token(logits: torch.Tensor, sampling: SamplingConfig, uniform: float, max_support: int) -> tuple[int, SparseDistribution]:
    """One drafted token from logits [vocab] at temperature > 0, with the distribution it was
    drawn from: the request's transform, truncated to the ``max_support`` most likely tokens."""
    support_ids, support_probs = truncate_to_top_n(processed_probs(logits, sampling), max_support)
    index = sample_from(support_probs.cpu(), uniform)
    distribution = SparseDistribution(token_ids=support_ids.tolist(), probs=support_probs.tolist())
    return int(support_ids[index]), distribution
