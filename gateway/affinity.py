"""Which requests should meet on one verifier replica: those that share a prefix.

Behind a pool of verifier replicas (docker/nginx/verifier-pool.conf) a prefix cached on one
replica helps only the requests routed there. Every request is a new session, so routing by
session scatters a chat's turns and the users of one system prompt over the replicas. The
*prefix key* names the prompt's first block instead: the same key, the same replica.

    chat        the first message, role and text: the system prompt when there is one (shared by
                every user of an app), else the opening user message (shared by a conversation's
                later turns, which resend it first)
    completion  the prompt's first ``FIRST_BLOCK_TOKENS`` token ids

Example: turns 1 and 2 of a chat under system prompt S, and another user's question under S,
all start with S: one key. A chat under system prompt T gets another key, and the proxy's
consistent hash spreads keys over the replicas (and moves a key to the next replica while its
own is down, as it did sessions).

The caller's ``user`` field is left out on purpose: users who share a system prompt should meet
on the replica that holds it. The cost is balance: all traffic under one system prompt goes to
one replica. The prefix-cache salt a request's verify calls carry (its ``cache_salt`` with the
edge's caller folded in) belongs in the key, since requests that may not share a prefix gain
nothing from meeting: ``route_key`` salts a prefix key with it.
"""

from __future__ import annotations

import hashlib
import json

FIRST_BLOCK_TOKENS = 256
"""A completion prompt's tokens that name its prefix: the opening of a shared system prompt or document."""

SESSION_HEADER = "X-Spade-Session"
"""The session id again, as a header: a proxy in front of several verifier replicas pins each
session to one of them (on either wire) without reading the body (docker/nginx/verifier-pool.conf)."""
ROUTE_HEADER = "X-Spade-Route"
"""The request's prefix key (``gateway.affinity``), on every call of its session: the pool's
proxy hashes it, when present, instead of the session id, so requests that share a prefix (a
chat's turns, the users of one system prompt) meet the replica that holds it."""


def _digest(payload: str) -> str:
    return hashlib.blake2b(payload.encode(), digest_size=16).hexdigest()


def chat_prefix_key(messages: list[dict]) -> str | None:
    """The key of a chat: its first message's role and text (None: no messages)."""
    if not messages:
        return None
    first = messages[0]
    return _digest(json.dumps([first["role"], first["content"]]))


def prompt_prefix_key(prompt_ids: list[int]) -> str | None:
    """The key of a completion prompt: its first ``FIRST_BLOCK_TOKENS`` token ids (None: empty)."""
    if not prompt_ids:
        return None
    return _digest(json.dumps(prompt_ids[:FIRST_BLOCK_TOKENS]))


def route_key(prefix_key: str | None, cache_salt: str | None) -> str | None:
    """What a session's calls are routed by: its prefix key, salted with the prefix-cache salt its
    calls carry (None: no key, the pool routes by session). Example: one system prompt under
    salts "a" and "b" gives two keys, free to land on different replicas."""
    if prefix_key is None or cache_salt is None:
        return prefix_key
    return _digest(json.dumps([cache_salt, prefix_key]))
