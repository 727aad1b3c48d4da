"""The runner's shared prefixes: the prefix store's sources as KV caches, and the one copy that
starts a session from another's prefix (``prefix_store`` holds the index and the design).

Sources are the live sessions' caches (the runner's table, id ``("live", session_id)``) and
retained caches of ended sessions (held here, id ``("kept", n)``). Everything here runs on the
backend's worker thread, except ``limit`` and ``num_retained_tokens`` (the memory budget's,
from the event loop: the store locks, and dict removals are atomic).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Hashable

from spade_models.kv_cache import TokenCache
from verifier_service.backends.base import BlockToVerify
from verifier_service.backends.transformers.prefix_store import BLOCK_TOKENS, PrefixStore


def live_source(session_id: str) -> tuple[str, str]:
    return ("live", session_id)


class PrefixCache:
    """Retained caches, the live sessions' namespaces, and seeding a new cache from a source."""

    def __init__(self, store: PrefixStore, new_cache: Callable[[], TokenCache]) -> None:
        self.store = store
        self._new_cache = new_cache
        self._retained: dict[Hashable, TokenCache] = {}
        self._namespaces: dict[str, str] = {}
        """Live session -> the namespace its cache is published in."""
        self._serial = itertools.count()

    @property
    def num_retained_tokens(self) -> int:
        return self.store.num_retained_tokens

    @property
    def num_retained(self) -> int:
        return self.store.num_retained

    def hit_length(self, block: BlockToVerify) -> int:
        """Context tokens a new cache for this call would start with (0: none shared)."""
        if block.cache_namespace is None:
            return 0
        hit = self.store.longest_prefix(block.cache_namespace, block.context_token_ids, len(block.context_token_ids) - 1)
        return 0 if hit is None else hit.num_tokens

    def seeded(self, block: BlockToVerify, live: dict[str, TokenCache]) -> tuple[TokenCache, int] | None:
        """A new cache for the call's session holding the longest shared prefix of its context
        (one copy of those rows), and that prefix's length; None when nothing is shared."""
        if block.cache_namespace is None:
            return None
        hit = self.store.longest_prefix(block.cache_namespace, block.context_token_ids, len(block.context_token_ids) - 1)
        if hit is None:
            return None
        source = self._retained.get(hit.source_id)
        if source is None and isinstance(hit.source_id, tuple) and hit.source_id[0] == "live":
            source = live.get(hit.source_id[1])
        if source is None or source.token_ids[: hit.num_tokens] != block.context_token_ids[: hit.num_tokens]:
            self.store.withdraw(hit.source_id)  # its cache is gone (a failed forward): not a source
            return None
        entry = self._new_cache()
        copy_prefix(source, hit.num_tokens, entry)
        return entry, hit.num_tokens

    def publish(self, session_id: str, namespace: str | None, entry: TokenCache) -> None:
        """The live session's cache now covers ``entry.token_ids`` (all committed context)."""
        if namespace is None:
            return
        self._namespaces[session_id] = namespace
        self.store.publish(live_source(session_id), namespace, entry.token_ids)

    def end(self, session_id: str, entry: TokenCache | None, retain: bool) -> None:
        """The session is gone: its cache is no longer live; with ``retain`` (and a whole
        block to share) it stays a source until memory is wanted."""
        namespace = self._namespaces.pop(session_id, None)
        self.store.withdraw(live_source(session_id))
        if retain and entry is not None and namespace is not None:
            self.keep(entry, namespace)

    def keep(self, entry: TokenCache, namespace: str) -> None:
        if len(entry.token_ids) < BLOCK_TOKENS:
            return
        source_id = ("kept", next(self._serial))
        self._retained[source_id] = entry
        self.store.publish(source_id, namespace, entry.token_ids)
        self._drop(self.store.retain(source_id))

    def limit(self, max_tokens: int) -> None:
        """Retain at most ``max_tokens`` from now on: free the least recently used beyond."""
        self._drop(self.store.limit_retained(max_tokens))

    def clear(self) -> None:
        self._drop(self.store.shrink_retained(0))
        for session_id in list(self._namespaces):
            self.end(session_id, None, retain=False)

    def _drop(self, source_ids: list[Hashable]) -> None:
        for source_id in source_ids:
            self._retained.pop(source_id, None)


def copy_prefix(source: TokenCache, num_tokens: int, target: TokenCache) -> None:
    """Append the first ``num_tokens`` rows of every layer of ``source`` to the empty ``target``
    (a GrowingLayer writes them into its own new buffer: one copy, nothing aliased)."""
    for layer_index, layer in enumerate(source.cache.layers):
        keys, values = getattr(layer, "keys", None), getattr(layer, "values", None)
        if keys is None or values is None:  # ragged forwards take full-attention layers only
            raise ValueError("copy_prefix: the source cache has a layer without keys and values")
        target.cache.update(keys[:, :, :num_tokens], values[:, :, :num_tokens], layer_index)
    target.token_ids = source.token_ids[:num_tokens]
