"""The prefix store: which KV caches hold which token prefixes, so that a new session pays for a
prefix once (pure index logic: no tensors, testable without a model).

Glossary:
    source      a KV cache whose rows may be copied: a live session's cache (its committed
                context) or a retained cache (a finished session's, kept while memory allows)
    namespace   the isolation domain of a source (``verifier_service.prefix_sharing``): only lookups in the
                same namespace find it, so a prefix never leaks across salts or API keys
    block       ``BLOCK_TOKENS`` consecutive tokens from position 0; only whole blocks are indexed
                (a hit is found by its whole blocks, then runs token by token as far as the
                source and the request agree: a chat's next turn reuses the previous turn's
                last partial block too)
    chain hash  block i's key: a hash of block i-1's key and block i's token ids, the first
                seeded by the namespace, so one key names a whole prefix in one namespace

Layout (issue 21 item 7, chosen for this issue): caches stay per session and contiguous (CPU
attention reads each session's keys as one tensor; a paged layout would gather pages every
forward). Sharing is by copy: a session that finds a cached prefix copies its rows once into
its own fresh cache and feeds only the rest. One copy of the prefix rows is a memcpy of
bytes_per_token x L (Qwen2.5-1.5B fp32: 56 KiB a token, ~56 MB for 1,000 tokens, milliseconds)
against a prefill of L tokens (seconds on CPU). Because nothing is aliased, no session can
mutate another's prefix, and a source may be cropped, grown or dropped freely after the copy.

Hits are never trusted to the hash: the lookup compares the token ids of the source it picks
with the request's (``longest_prefix``), so a collision costs a miss, never a wrong cache.

Retained sources are bounded (``max_retained_tokens``, and below it by whoever owns the memory
budget: ``limit_retained``), least recently used out first. A live session's cache is never
dropped by the store: live sources leave only when the session does (``withdraw``).
"""

from __future__ import annotations

import hashlib
import threading
from array import array
from collections import OrderedDict
from collections.abc import Hashable
from dataclasses import dataclass, field

from spade_models.kv_cache import common_prefix_length

BLOCK_TOKENS = 16
"""Tokens per indexed block: a source is found by the whole blocks it shares with a request."""


def chain_hashes(namespace: str, token_ids: list[int], num_blocks: int) -> list[bytes]:
    """Keys of the first ``num_blocks`` whole blocks of ``token_ids`` in ``namespace``."""
    return extended_chain([], namespace, token_ids, num_blocks)


def extended_chain(keys: list[bytes], namespace: str, token_ids: list[int], num_blocks: int) -> list[bytes]:
    """``keys`` (the chain of token_ids' first len(keys) blocks) extended to ``num_blocks``."""
    if len(keys) >= num_blocks:
        return keys[:num_blocks]
    extended = list(keys)
    previous = keys[-1] if keys else hashlib.blake2b(namespace.encode(), digest_size=16).digest()
    for index in range(len(keys), num_blocks):
        block = array("q", token_ids[index * BLOCK_TOKENS : (index + 1) * BLOCK_TOKENS])
        previous = hashlib.blake2b(previous + block.tobytes(), digest_size=16).digest()
        extended.append(previous)
    return extended


@dataclass
class Indexed:
    """What the store knows of one source: its namespace, the tokens its cache covers, and the
    keys it is listed under (one per whole block of those tokens)."""

    namespace: str
    token_ids: list[int]
    keys: list[bytes] = field(default_factory=list)
    is_retained: bool = False


@dataclass(frozen=True)
class PrefixHit:
    source_id: Hashable
    num_tokens: int
    """Leading tokens of the request the source's cache covers (at least one whole block)."""


class PrefixStore:
    """The index of sources by chain hash, and the LRU order of retained ones. Thread-safe: the
    runner publishes and looks up on its worker thread, the memory budget shrinks from the
    event loop."""

    def __init__(self, max_retained_tokens: int) -> None:
        if max_retained_tokens < 0:
            raise ValueError("max_retained_tokens must be >= 0")
        self.max_retained_tokens = max_retained_tokens
        self._sources: dict[Hashable, Indexed] = {}
        self._index: dict[bytes, dict[Hashable, None]] = {}
        """Key -> the sources listed under it, oldest first (an insertion-ordered set)."""
        self._retained: OrderedDict[Hashable, int] = OrderedDict()
        """Retained source -> its tokens, least recently used first."""
        self._lock = threading.Lock()

    @property
    def num_retained_tokens(self) -> int:
        return sum(self._retained.values())

    @property
    def num_retained(self) -> int:
        """Retained sources (ended sessions' caches kept as shared prefixes)."""
        return len(self._retained)

    @property
    def num_sources(self) -> int:
        return len(self._sources)

    def publish(self, source_id: Hashable, namespace: str, token_ids: list[int]) -> None:
        """The source's cache now covers ``token_ids``: list it under the keys of their whole
        blocks (only the blocks that changed are rehashed: a verify call appends a few tokens)."""
        with self._lock:
            indexed = self._sources.get(source_id)
            if indexed is None or indexed.namespace != namespace:
                self._unlist(source_id)
                indexed = self._sources[source_id] = Indexed(namespace, [])
            num_kept = common_prefix_length(indexed.token_ids, token_ids) // BLOCK_TOKENS
            for key in indexed.keys[num_kept:]:
                self._index[key].pop(source_id, None)
                if not self._index[key]:
                    del self._index[key]
            new_keys = extended_chain(indexed.keys[:num_kept], namespace, token_ids, len(token_ids) // BLOCK_TOKENS)
            for key in new_keys[num_kept:]:
                self._index.setdefault(key, {})[source_id] = None
            indexed.keys, indexed.token_ids = new_keys, list(token_ids)

    def withdraw(self, source_id: Hashable) -> None:
        with self._lock:
            self._unlist(source_id)

    def retain(self, source_id: Hashable) -> list[Hashable]:
        """Mark a published source as retained (its session ended): it now counts against
        ``max_retained_tokens``. Retained sources whose tokens are a prefix of this one's add
        nothing and go; then the least recently used while over the bound. Returns the ids
        dropped (the caller frees their caches); this one among them when it is too large."""
        with self._lock:
            indexed = self._sources.get(source_id)
            if indexed is None:
                return []
            covered = [
                other
                for other in self._retained
                if self._sources[other].namespace == indexed.namespace
                and len(self._sources[other].token_ids) <= len(indexed.token_ids)
                and indexed.token_ids[: len(self._sources[other].token_ids)] == self._sources[other].token_ids
            ]
            for other in covered:
                self._unlist(other)
            indexed.is_retained = True
            self._retained[source_id] = len(indexed.token_ids)
            return covered + self._shrink(self.max_retained_tokens)

    def limit_retained(self, max_tokens: int) -> list[Hashable]:
        """From now on retain at most ``max_tokens`` (the memory budget's room for them);
        returns the ids dropped to fit (the caller frees their caches)."""
        with self._lock:
            self.max_retained_tokens = max(0, max_tokens)
            return self._shrink(self.max_retained_tokens)

    def shrink_retained(self, max_tokens: int) -> list[Hashable]:
        """Drop retained sources, least recently used first, until they hold at most
        ``max_tokens``; returns their ids (the caller frees their caches)."""
        with self._lock:
            return self._shrink(max_tokens)

    def longest_prefix(self, namespace: str, token_ids: list[int], max_tokens: int) -> PrefixHit | None:
        """The source covering the most whole blocks of ``token_ids`` in ``namespace``, its tokens
        checked, and how far past them it agrees with ``token_ids`` (at most ``max_tokens`` in all);
        a retained hit becomes most recently used. Example: a source of 40 tokens sharing 37 with a
        request -> found by its 2 whole blocks, a hit of 37."""
        num_blocks = max_tokens // BLOCK_TOKENS
        if num_blocks == 0:
            return None
        with self._lock:
            keys = chain_hashes(namespace, token_ids, num_blocks)
            depth = 0
            while depth < len(keys) and keys[depth] in self._index:
                depth += 1
            for num_blocks_hit in range(depth, 0, -1):
                for source_id in reversed(self._index[keys[num_blocks_hit - 1]]):
                    length = num_blocks_hit * BLOCK_TOKENS
                    source_tokens = self._sources[source_id].token_ids
                    if source_tokens[:length] == token_ids[:length]:
                        if source_id in self._retained:
                            self._retained.move_to_end(source_id)
                        return PrefixHit(source_id, length + common_prefix_length(source_tokens[length:], token_ids[length:max_tokens]))
            return None

    def _unlist(self, source_id: Hashable) -> None:
        indexed = self._sources.pop(source_id, None)
        self._retained.pop(source_id, None)
        if indexed is None:
            return
        for key in indexed.keys:
            listed = self._index.get(key)
            if listed is not None:
                listed.pop(source_id, None)
                if not listed:
                    del self._index[key]

    def _shrink(self, max_tokens: int) -> list[Hashable]:
        dropped: list[Hashable] = []
        while self._retained and sum(self._retained.values()) > max_tokens:
            source_id = next(iter(self._retained))
            self._unlist(source_id)
            dropped.append(source_id)
        return dropped
