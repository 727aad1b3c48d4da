"""Who may share whose cached prompt prefixes: the isolation of the verifier's prefix cache.

A shared prefix saves its prefill, and that saving is visible: a request whose prompt starts
like one somebody else sent recently reaches its first token sooner. Shared across tenants, the
time to first token tells one tenant what another's prompts begin with (a system prompt, a
document). Two controls, as vLLM offers them:

- ``cache_salt`` (per request, on the OpenAI routes and the verify wire): only requests with the
  same salt share prefixes; a client that wants no sharing sends a random salt.
- ``--prefix-sharing`` (the verifier's setting): ``per-key`` (the default) shares only among
  requests of one API key (and one salt), so keys never see each other's prefixes while the
  users of one application (one key) share its system prompt; ``global`` shares across keys
  (one tenant, or keys that trust each other); ``off`` shares nothing. Without API keys
  configured, ``per-key`` and ``global`` are the same: every caller is one tenant.

Per-key by default because the side channel crosses exactly the boundary keys draw: a deployment
with keys has declared its callers distinct, and one without keys has not.
"""

from __future__ import annotations

import json
from typing import Literal

PrefixSharing = Literal["per-key", "global", "off"]


def prefix_namespace(mode: PrefixSharing, owner: str, cache_salt: str | None) -> str | None:
    """The namespace a request's prefixes live in (``BlockToVerify.cache_namespace``), or None
    when it shares none. ``owner``: the caller's key id ("" without keys)."""
    if mode == "off":
        return None
    if mode not in ("global", "per-key"):
        raise ValueError(f"unknown prefix sharing mode {mode!r}")
    return json.dumps([owner if mode == "per-key" else "", cache_salt or ""])
