"""Who may call a service: API keys (Bearer), the refusal to listen on a network without one,
and Host checking for a service bound to loopback (DNS rebinding: a web page on another
origin resolving its own name to 127.0.0.1 must not reach the local edge).

The key check is a pure ASGI middleware, so a stranger is refused before any body is read. It
also tells the routes who calls (``caller_key_id``): the verifier keeps each key's sessions
apart, and /health shows its details only to a caller with a key (where keys are configured).
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
from pathlib import Path

from starlette.requests import Request
from starlette.types import ASGIApp, Receive, Scope, Send

from gateway.errors import AuthenticationError, PermissionDeniedError, error_response

LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "::1"})
LOOPBACK_HOST_HEADERS = ["localhost", "127.0.0.1", "[::1]"]
OPEN_PATHS = frozenset({"/health"})
OPERATOR_PATHS = frozenset({"/metrics"})
"""Routes that, where operator keys are configured (``--metrics-api-key``), answer those keys
alone: the counters sum over every tenant, so a client's key reads none of them."""
CALLER_KEY_ID = "caller_key_id"
"""The request-state entry the key middleware sets: "" without keys configured, the caller's
``key_id`` with a valid key, None for a stranger on an open path."""


def load_api_keys(api_key: str | None, api_key_file: str | None) -> frozenset[str]:
    """The keys from a comma-separated value and a file of one key per line (blank lines and
    surrounding spaces ignored). Several keys allow rotation: add the new one, move clients,
    drop the old one."""
    keys = [part.strip() for part in (api_key or "").split(",")]
    if api_key_file:
        keys += [line.strip() for line in Path(api_key_file).read_text().splitlines()]
    return frozenset(key for key in keys if key)


def is_loopback(host: str) -> bool:
    if host in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:  # a host name other than localhost may resolve anywhere
        return False


def check_exposure(host: str, api_keys: frozenset[str], allow_no_auth: bool) -> None:
    """Refuse to serve a non-loopback address without a key unless explicitly allowed."""
    if not is_loopback(host) and not api_keys and not allow_no_auth:
        raise ValueError(
            f"refusing to listen on {host} without an API key: set --api-key (or --api-key-file), "
            "or pass --allow-no-auth if the network is trusted"
        )


def bearer_token(scope: Scope) -> bytes | None:
    for name, value in scope.get("headers", []):
        if name == b"authorization":
            scheme, _, token = value.partition(b" ")
            return token.strip() if scheme.lower() == b"bearer" and token.strip() else None
    return None


def key_id(key: bytes) -> str:
    """A name for a key that reveals nothing of it (a hash): what the verifier files sessions under."""
    return hashlib.blake2b(key, digest_size=12, person=b"spade-key-id").hexdigest()


def caller_key_id(request: Request) -> str | None:
    """The caller's key id ("" where no keys are configured, None for a caller without a valid key)."""
    return getattr(request.state, CALLER_KEY_ID, "")


def is_trusted_caller(request: Request) -> bool:
    """No keys are configured, or the caller presented a valid one."""
    return caller_key_id(request) is not None


def is_keyed_caller(request: Request) -> bool:
    """Keys are configured and the caller presented a valid one: who may read a service's internal
    addresses and paths (on a service without keys, anyone who reaches it could)."""
    return bool(caller_key_id(request))


def is_valid_key(presented: bytes | None, api_keys: frozenset[bytes]) -> bool:
    """Constant-time comparison against every key (no early exit on the first match)."""
    if presented is None:
        return False
    matched = False
    for key in api_keys:
        matched |= hmac.compare_digest(presented, key)
    return matched


class ApiKeyMiddleware:
    """Requires ``Authorization: Bearer <key>`` on every HTTP route but ``open_paths``; answers
    401 in the OpenAI envelope (type invalid_request_error, code invalid_api_key) otherwise."""

    def __init__(
        self, app: ASGIApp, api_keys: frozenset[str], open_paths: frozenset[str] = OPEN_PATHS, operator_keys: frozenset[str] = frozenset()
    ) -> None:
        """``operator_keys``: where given, the only keys ``OPERATOR_PATHS`` answer (403 to a
        client's valid key, 401 to anything else), whatever ``open_paths`` says."""
        self.app = app
        self.api_keys = frozenset(key.encode() for key in api_keys)
        self.open_paths = open_paths
        self.operator_keys = frozenset(key.encode() for key in operator_keys)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and self.operator_keys and scope["path"] in OPERATOR_PATHS:
            await self._operator_route(scope, receive, send)
            return
        if scope["type"] != "http" or not self.api_keys:
            await self.app(scope, receive, send)
            return
        presented = bearer_token(scope)
        is_valid = is_valid_key(presented, self.api_keys)
        scope.setdefault("state", {})[CALLER_KEY_ID] = key_id(presented) if is_valid and presented is not None else None
        if is_valid or scope["path"] in self.open_paths:
            await self.app(scope, receive, send)
            return
        reason = "missing API key: send 'Authorization: Bearer <key>'" if presented is None else "invalid API key"
        response = error_response(AuthenticationError(reason, code="invalid_api_key"))
        response.headers["www-authenticate"] = "Bearer"
        await response(scope, receive, send)

    async def _operator_route(self, scope: Scope, receive: Receive, send: Send) -> None:
        presented = bearer_token(scope)
        if is_valid_key(presented, self.operator_keys):
            await self.app(scope, receive, send)
            return
        if is_valid_key(presented, self.api_keys):
            error: Exception = PermissionDeniedError(
                "this route is for the operator's key (--metrics-api-key): a client's key may not read it", code="operator_key_required"
            )
        else:
            reason = "missing API key: send the operator's key" if presented is None else "invalid API key"
            error = AuthenticationError(reason, code="invalid_api_key")
        response = error_response(error)
        if isinstance(error, AuthenticationError):
            response.headers["www-authenticate"] = "Bearer"
        await response(scope, receive, send)


def open_paths(metrics_require_key: bool) -> frozenset[str]:
    return OPEN_PATHS if metrics_require_key else OPEN_PATHS | {"/metrics"}
