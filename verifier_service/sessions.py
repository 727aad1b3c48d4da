"""The verifier's session registry: what each edge session has committed, and its last answer.

Pure bookkeeping (no tensors): the committed token list and its digest, the fingerprint and
response of the last call (to answer a retry from memory), a lock that serialises calls of one
session, and least-recently-used eviction bounded by session count, total tokens and idle time.
With a KV budget (``kv_budget``), a call reserves the tokens its forward will cache before it
runs: idle sessions are evicted to make room, and the call is refused (429) when even that
cannot. The backend's caches follow it: whoever evicts a session tells the backend to release it.
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from dataclasses import dataclass, field

from gateway.errors import OverloadedError
from verifier_service.kv_budget import KvBudget, RetainedKv
from verifier_service.protocol import VerifyResponse, context_digest


@dataclass
class Session:
    session_id: str
    token_ids: list[int] = field(default_factory=list)
    digest: str = field(default_factory=lambda: context_digest([]))
    last_fingerprint: str | None = None
    last_response: VerifyResponse | None = None
    last_used: float = field(default_factory=time.monotonic)
    lock: asyncio.Lock = field(default_factory=asyncio.Lock, repr=False)
    reserved_tokens: int = 0
    """Tokens the call in flight will hold in the cache (its context + block), while it runs."""
    advised_draft_length: int | None = None
    """What the last answer advised: a longer next block is cut to it."""
    owner: str = ""
    """The key id of the caller that created it ("" without keys): each owner has a fair share."""

    @property
    def num_cached_tokens(self) -> int:
        return max(len(self.token_ids), self.reserved_tokens)

    def matches(self, prefix_length: int, prefix_digest: str) -> bool:
        return len(self.token_ids) == prefix_length and self.digest == prefix_digest

    def commit(self, token_ids: list[int], digest: str, fingerprint: str, response: VerifyResponse) -> None:
        """``digest``: context_digest(token_ids), computed once by the caller (it also seals the response)."""
        self.token_ids = token_ids
        self.digest = digest
        self.last_fingerprint = fingerprint
        self.last_response = response


@dataclass(frozen=True)
class SessionLimits:
    max_sessions: int = 256
    """Sessions kept at once; the least recently used beyond this is evicted."""
    max_total_tokens: int = 2_000_000
    """Committed tokens over all sessions (bounds the backend's KV caches)."""
    ttl_s: float = 600.0
    """A session idle this long is evicted."""

    def __post_init__(self) -> None:
        if self.max_sessions < 1 or self.max_total_tokens < 1 or self.ttl_s <= 0:
            raise ValueError("session limits must be positive")


def fair_share(capacity: int, holdings: dict[str, int], owner: str) -> int:
    """An owner's fair share of ``capacity`` (sessions, or KV tokens): an equal split among the
    owners holding some (``holdings``), ``owner`` counted too, rounded up. One owner (a verifier
    without keys) has all of it."""
    owners = set(holdings) | {owner}
    return -(-capacity // len(owners))


class SessionRegistry:
    """The verifier's sessions, one per edge generation: what each has committed (tokens and
    digest) and its last answer (for retries), a lock serialising one session's calls, and
    least-recently-used eviction by session count, total tokens and idle time; with a KV budget,
    a call reserves the cache its forward will hold, evicting idle sessions or answering 429."""

    def __init__(self, limits: SessionLimits, kv_budget: KvBudget | None = None, retained: RetainedKv | None = None) -> None:
        """``retained``: the backend's shared-prefix caches, inside ``kv_budget`` too."""
        self._limits = limits
        self.kv_budget = kv_budget
        self.retained = retained
        self._sessions: OrderedDict[str, Session] = OrderedDict()
        self._held: dict[str, Session] = {}
        """KV held for caches the registry does not serve as sessions (pipelined sessions'), by key:
        counted in the budget, never evicted, given back by ``release_hold``."""
        self._limit_retained(0)  # the budget bounds retained caches from the start, whichever route fills them

    def __len__(self) -> int:
        return len(self._sessions)

    @property
    def num_tokens(self) -> int:
        return sum(len(session.token_ids) for session in self._sessions.values())

    @property
    def kv_bytes(self) -> int:
        """Bytes the sessions' KV caches hold (or will, for calls in flight)."""
        if self.kv_budget is None:
            return 0
        retained = 0 if self.retained is None else self.retained.num_retained_tokens
        return (self._session_tokens() + retained) * self.kv_budget.bytes_per_token

    def _session_tokens(self) -> int:
        """Tokens the sessions' caches hold (or will, for calls in flight), held KV included."""
        sessions = list(self._sessions.values()) + list(self._held.values())  # a snapshot, whatever else runs
        return sum(session.num_cached_tokens for session in sessions)

    def hold(self, key: str, owner: str, num_tokens: int) -> list[str]:
        """Reserve ``num_tokens`` of the KV budget for a cache the registry does not serve as a
        session (a pipelined session's, for its whole life), as a call's reservation does:
        idle sessions are evicted to make room, an owner within its share loses nothing to
        another, and OverloadedError (429, ``kv_cache_full``) answers when no room can be made.
        Returns the evicted ids (the caller frees their caches); ``release_hold`` gives it back."""
        holder = Session(key, owner=owner)
        evicted = self.reserve(holder, num_tokens)
        if self.kv_budget is not None:
            self._held[key] = holder
        return evicted

    def release_hold(self, key: str) -> None:
        if self._held.pop(key, None) is not None:
            self._limit_retained(self._session_tokens())

    def reserve(self, session: Session, num_tokens: int) -> list[str]:
        """Reserve cache room for ``session``'s call feeding ``num_tokens`` in all; evicts idle
        sessions (least recently used first, never one with a call in flight) when needed.
        Retained prefix caches give way first (a live session is never evicted for them).
        Returns the evicted ids; raises OverloadedError (429) when no room can be made."""
        if self.kv_budget is None:
            return []
        others = [s for s in self._sessions.values() if s is not session]
        kept = [s for s in self._held.values() if s is not session]  # held KV: counted, never evicted
        held = sum(s.num_cached_tokens for s in others + kept)
        self._limit_retained(held + num_tokens)
        owner_tokens: dict[str, int] = {session.owner: num_tokens}
        for other in others + kept:
            owner_tokens[other.owner] = owner_tokens.get(other.owner, 0) + other.num_cached_tokens
        share = fair_share(self.kv_budget.max_tokens, {owner: 1 for owner in owner_tokens}, session.owner)
        evicted = []
        for other in others:
            if held + num_tokens <= self.kv_budget.max_tokens:
                break
            if other.lock.locked() or other.reserved_tokens:
                continue
            if other.owner != session.owner and owner_tokens[other.owner] <= share:
                continue  # an owner within its share of the KV budget loses nothing to another
            held -= other.num_cached_tokens
            owner_tokens[other.owner] -= other.num_cached_tokens
            del self._sessions[other.session_id]
            evicted.append(other.session_id)
        if held + num_tokens > self.kv_budget.max_tokens:
            raise OverloadedError(
                f"the KV cache budget ({self.kv_budget.max_bytes} bytes, max_kv_cache_bytes) is held by calls in "
                f"flight or by other keys within their share; this call needs {num_tokens * self.kv_budget.bytes_per_token} "
                "bytes: retry shortly",
                code="kv_cache_full",
                retry_after_s=1,
            )
        session.reserved_tokens = num_tokens
        return evicted

    def get(self, session_id: str) -> Session | None:
        """The session, or None when unknown or idle past the TTL (an expired one stays listed
        until the next evict(), which drops it and tells the backend)."""
        session = self._sessions.get(session_id)
        if session is None or self._is_expired(session):
            return None
        session.last_used = time.monotonic()
        self._sessions.move_to_end(session_id)
        return session

    def get_or_create(self, session_id: str, owner: str = "") -> Session:
        """The session, or a new one of ``owner``'s. With the table full and other owners in it,
        an owner already holding its fair share (``fair_share``) makes room from its own idle
        sessions (``evict`` then drops its least recently used); with none idle it gets 429: it
        never pushes out the sessions of an owner within its share."""
        session = self.get(session_id)
        if session is None:
            live = self.owner_counts()
            full = sum(live.values()) >= self._limits.max_sessions
            at_share = live.get(owner, 0) >= fair_share(self._limits.max_sessions, live, owner)
            if full and len(live | {owner: 0}) > 1 and at_share and not self._has_idle_session(owner):
                raise OverloadedError(
                    f"this API key holds its share of the verifier's sessions ({live.get(owner, 0)} of "
                    f"{self._limits.max_sessions}, shared by {len(live | {owner: 0})} keys), all in use: retry shortly",
                    code="session_share_full",
                    retry_after_s=1,
                )
            self._sessions.pop(session_id, None)  # an expired one is replaced (newest, not in its old place)
            session = self._sessions[session_id] = Session(session_id, owner=owner)
        return session

    def owner_counts(self) -> dict[str, int]:
        """Sessions held per owner, those past their TTL left out (they go at the next evict)."""
        counts: dict[str, int] = {}
        for session in self._sessions.values():
            if not self._is_expired(session):
                counts[session.owner] = counts.get(session.owner, 0) + 1
        return counts

    def remove(self, session_id: str) -> bool:
        removed = self._sessions.pop(session_id, None) is not None
        self._limit_retained(self._session_tokens())
        return removed

    def _limit_retained(self, num_session_tokens: int) -> None:
        """Retained prefix caches get what the sessions (and the call being admitted) leave."""
        if self.retained is not None and self.kv_budget is not None:
            self.retained.limit_retained(self.kv_budget.max_tokens - num_session_tokens)

    def evict(self, keep: str | None = None) -> list[str]:
        """Drop expired sessions, then, beyond the limits, the least recently used session of an
        owner holding at least its fair share (never ``keep``, the session being served): an
        owner within its share loses nothing to another. Returns the evicted ids."""
        evicted = self._evict_expired(keep)
        total_tokens = self.num_tokens
        while len(self._sessions) > self._limits.max_sessions or total_tokens > self._limits.max_total_tokens:
            victim = self._fair_victim(keep)
            if victim is None:
                break
            total_tokens -= len(self._sessions.pop(victim).token_ids)
            evicted.append(victim)
        if evicted:
            self._limit_retained(self._session_tokens())
        return evicted

    def _fair_victim(self, keep: str | None) -> str | None:
        """The least recently used session (not ``keep``) of an owner holding the most, an idle
        one before one with a call in flight."""
        counts = self.owner_counts()
        largest = max(counts.values(), default=0)
        candidates = [sid for sid, s in self._sessions.items() if sid != keep and counts.get(s.owner, 0) == largest]
        idle = [sid for sid in candidates if not self._sessions[sid].lock.locked()]
        return next(iter(idle or candidates), None) or next((sid for sid in self._sessions if sid != keep), None)

    def _has_idle_session(self, owner: str) -> bool:
        return any(s.owner == owner and not s.lock.locked() and not s.reserved_tokens for s in self._sessions.values())

    def _is_expired(self, session: Session) -> bool:
        return session.last_used < time.monotonic() - self._limits.ttl_s

    def _evict_expired(self, keep: str | None) -> list[str]:
        expired = [sid for sid, s in self._sessions.items() if self._is_expired(s) and sid != keep]
        for session_id in expired:
            del self._sessions[session_id]
        return expired
