"""The transformers backend's runner: it owns the model and every session's KV cache, and runs
one forward over whatever share of work the scheduler hands it.

The scheduler decides what runs (which calls, how many rows each may feed); the runner decides
nothing, it executes: per call, the rows its session's cache lacks, cut to the call's row
allowance. A call whose uncached context exceeds the allowance is prefilled a chunk at a time
(``rows_to_feed``): its chunk's rows share the forward with others' blocks and score nothing;
the call is answered by the forward that feeds its last context token and its drafted block
(the block's d + 1 scored rows). Caches stay per session and grow in place (``ragged``).

Shared prefixes (``prefix_store``, ``prefix_cache``): a call whose session has no cache yet (a
new session, a resync, a target-only request) starts from a copy of the longest prefix of its
context another cache in its namespace holds, before anything in the forward changes a cache;
every cache is published once a forward leaves it (its committed context), and an ended
session's cache is retained as a source until memory is wanted.

Every change to a cache runs on the backend's one worker thread (no lock); the scheduler only
reads them (``cached_length``) between forwards. Acceptance and logprobs (``_conclude``) follow
each answered call's forward.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace

import torch

from gateway.engine import TopLogprobs
from spade_core.acceptance import Acceptance, accept_block
from spade_core.sampling import emitted_logprobs, position_uniforms, processed_probs, reported_logprobs
from spade_models.kv_cache import TokenCache
from verifier_service.backends.base import BlockToVerify, ForwardRecord
from verifier_service.backends.transformers.growing_cache import growing_cache
from verifier_service.backends.transformers.prefix_cache import PrefixCache
from verifier_service.backends.transformers.prefix_store import PrefixStore
from verifier_service.backends.transformers.ragged import RaggedCache, ragged_forward, register_ragged_attention


@dataclass
class Share:
    """One call's part in one forward, as the scheduler hands it to the runner."""

    block: BlockToVerify
    max_rows: int
    """Rows this call may feed in this forward (its chunk of a long prompt, or all it needs)."""
    keep_cache: bool = True
    """False once the session was released while the call waited: answer it, keep no cache."""


@dataclass(frozen=True)
class ShareResult:
    """What one forward did for one call: a prefill chunk (``acceptance`` None: the call waits
    for its next share) or the call's answer."""

    num_rows: int
    acceptance: Acceptance | None = None
    logprobs: list[float] | None = None
    top_logprobs: list[TopLogprobs] | None = None
    num_cached_tokens: int = 0
    """Context tokens copied from a shared prefix when this forward started the call's cache."""


@dataclass
class FedRows:
    """A share's rows in the forward: the tokens fed and how many of the last are scored."""

    token_ids: list[int]
    first_position: int
    num_scored: int


class ModelRunner:
    """The target model, the sessions' caches, and the ragged forward over several sessions."""

    def __init__(
        self,
        model,
        device: torch.device,
        *,
        batch_invariant: bool,
        prefix_store: PrefixStore | None = None,
        packed_attention: bool | None = None,
    ) -> None:
        """``prefix_store``: share prefixes between sessions through it; None shares nothing.
        ``packed_attention``: one attention call per layer for all sessions (``ragged``); by
        default off a CPU only."""
        register_ragged_attention()
        self.model = model
        self.device = device
        self.batch_invariant = batch_invariant
        self.packed_attention = device.type != "cpu" if packed_attention is None else packed_attention
        self._caches: dict[str, TokenCache] = {}
        self.prefixes = None if prefix_store is None else PrefixCache(prefix_store, self._new_cache)

    @property
    def num_cached_sessions(self) -> int:
        return len(self._caches)

    @property
    def shares_prefixes(self) -> bool:
        return self.prefixes is not None

    def has_cache(self, session_id: str) -> bool:
        """Whether the session has a cache of its own (else its next forward starts one)."""
        return session_id in self._caches

    def release(self, session_id: str, retain: bool = True) -> None:
        """Drop the session's cache; with ``retain`` it may stay a shared prefix's source."""
        entry = self._caches.pop(session_id, None)
        if self.prefixes is not None:
            self.prefixes.end(session_id, entry, retain)

    def clear(self) -> None:
        self._caches.clear()
        if self.prefixes is not None:
            self.prefixes.clear()

    def cached_length(self, block: BlockToVerify) -> int:
        """Context tokens the session's cache can keep for this call (read by the scheduler on
        the event loop: an estimate, exact unless a forward changes the cache meanwhile)."""
        entry = self._caches.get(block.session_id)
        if entry is None:
            return 0 if self.prefixes is None else self.prefixes.hit_length(block)
        return entry.reusable_length(block.context_token_ids)

    def run(self, shares: list[Share]) -> tuple[list[ShareResult], ForwardRecord]:
        """One forward over every share's rows; then acceptance for the calls it answers."""
        num_seeded = self._seed(shares)
        entries = [self._take_cache(share.block.session_id) for share in shares]
        fed = [rows_to_feed(entry, share) for entry, share in zip(entries, shares, strict=True)]
        started = time.perf_counter()
        logits = self._forward(entries, fed)
        record = ForwardRecord(len(shares), sum(len(rows.token_ids) for rows in fed), time.perf_counter() - started)
        results = []
        for entry, share, rows, share_logits in zip(entries, shares, fed, logits, strict=True):
            result = self._conclude(entry, share, rows, share_logits)
            results.append(replace(result, num_cached_tokens=num_seeded.get(share.block.session_id, 0)))
        return results, record

    def _seed(self, shares: list[Share]) -> dict[str, int]:
        """Start the cache of every share's session that has none from its longest shared
        prefix (before any cache of this forward changes); per seeded session, the tokens copied."""
        num_seeded: dict[str, int] = {}
        if self.prefixes is None:
            return num_seeded
        for share in shares:
            session_id = share.block.session_id
            if session_id in self._caches:
                continue
            seeded = self.prefixes.seeded(share.block, self._caches)
            if seeded is not None:
                self._caches[session_id], num_seeded[session_id] = seeded
        return num_seeded

    def _take_cache(self, session_id: str) -> TokenCache:
        """The session's cache, out of the table while its forward runs (put back by ``_keep``)."""
        entry = self._caches.pop(session_id, None)
        return entry if entry is not None else self._new_cache()

    def _new_cache(self) -> TokenCache:
        """A cache that appends in place (``growing_cache``): a forward writes only its rows."""
        return TokenCache(growing_cache(self.model.config))

    def _forward(self, entries: list[TokenCache], fed: list[FedRows]) -> list[torch.Tensor]:
        """The ragged forward; per share, the logits of its scored rows [k_i, vocab]."""
        segments: list[tuple[int, int]] = []
        scored: list[int] = []
        start = 0
        for rows in fed:
            end = start + len(rows.token_ids)
            segments.append((start, end))
            scored.extend(range(end - rows.num_scored, end))
            start = end
        ragged_cache = RaggedCache([entry.cache for entry in entries], segments, self.batch_invariant, self.packed_attention)
        positions = [rows.first_position for rows in fed]
        logits = ragged_forward(self.model, ragged_cache, [rows.token_ids for rows in fed], positions, scored)
        per_share, offset = [], 0
        for rows in fed:
            per_share.append(logits[offset : offset + rows.num_scored])
            offset += rows.num_scored
        return per_share

    def _conclude(self, entry: TokenCache, share: Share, rows: FedRows, logits: torch.Tensor) -> ShareResult:
        """A chunk: the cache now covers more of the context. An answer: acceptance over the
        block's logits [d + 1, vocab]; the cache keeps the context and the accepted drafts."""
        block = share.block
        if rows.num_scored == 0:
            entry.token_ids = block.context_token_ids[: len(entry.token_ids) + len(rows.token_ids)]
            # Kept even for a released session: its next chunk continues from it (the answering
            # forward frees it; the scheduler frees it if the caller leaves first).
            self._caches[block.session_id] = entry
            self._publish(block, entry)
            return ShareResult(len(rows.token_ids))
        acceptance = accept(block, logits, self.device)
        entry.token_ids = block.context_token_ids + block.draft_token_ids
        entry.crop_to(len(block.context_token_ids) + acceptance.num_accepted)
        self._keep(entry, share)
        emitted = block.draft_token_ids[: acceptance.num_accepted] + [acceptance.next_token_id]
        logprobs, top_logprobs = asked_logprobs(logits, emitted, block)
        return ShareResult(len(rows.token_ids), acceptance, logprobs, top_logprobs)

    def _keep(self, entry: TokenCache, share: Share) -> None:
        """The answered call's cache goes back to its session; a released session's may be
        retained as a shared prefix's source."""
        if share.keep_cache:
            self._caches[share.block.session_id] = entry
            self._publish(share.block, entry)
        elif self.prefixes is not None and share.block.cache_namespace is not None:
            self.prefixes.keep(entry, share.block.cache_namespace)

    def _publish(self, block: BlockToVerify, entry: TokenCache) -> None:
        if self.prefixes is not None:
            self.prefixes.publish(block.session_id, block.cache_namespace, entry)


def rows_to_feed(entry: TokenCache, share: Share) -> FedRows:
    """The rows a share feeds: the context the cache lacks and the block, when they fit its
    allowance; else a chunk of the context (never its last token: the answering forward needs
    that row's logits to score the first drafted token). Crops the cache to what it can keep.

    Example: 1,000-token prompt, nothing cached, a block of 4, allowance 256 -> chunks of 256,
    256, 256, then the last 232 context tokens + 4 drafted (236 rows, 5 scored)."""
    block = share.block
    context = block.context_token_ids
    uncached = entry.reuse_for(context)
    first_position = len(entry.token_ids)
    if len(uncached) + block.num_drafted <= share.max_rows or len(uncached) <= 1:
        return FedRows(uncached + block.draft_token_ids, first_position, block.num_drafted + 1)
    chunk = max(1, min(share.max_rows, len(uncached) - 1))  # len(uncached) >= 2 here
    return FedRows(uncached[:chunk], first_position, 0)


def accept(block: BlockToVerify, logits: torch.Tensor, device: torch.device) -> Acceptance:
    """The acceptance rule over the block's rows of target logits [d + 1, vocab]."""
    target_probs = processed_probs(logits, block.sampling)  # [d + 1, vocab]
    uniforms = position_uniforms(block.sampling.seed, block.first_draft_position, block.num_drafted + 1)
    draft_ids = torch.tensor(block.draft_token_ids, dtype=torch.long)
    draft_probs = None if block.draft_probs is None else block.draft_probs.to(device)
    return accept_block(draft_ids, draft_probs, target_probs, uniforms)


def asked_logprobs(logits: torch.Tensor, emitted: list[int], block: BlockToVerify) -> tuple[list[float] | None, list[TopLogprobs] | None]:
    """The emitted tokens' logprobs and alternatives from their rows of the block's logits
    [d + 1, vocab], or (None, None) when the block did not ask: no log-softmax then."""
    if block.num_top_logprobs is None:
        return None, None
    rows = reported_logprobs(logits[: len(emitted)], block.sampling)
    return emitted_logprobs(rows, emitted, block.num_top_logprobs)
