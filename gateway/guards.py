"""Everything a service puts in front of its routes, installed in one call by both apps.

Order, outermost first: Host check (loopback only) -> API key -> body size -> concurrency ->
the app. A stranger is refused before its body is read; a request over the concurrency limit
is refused before it is parsed.
"""

from __future__ import annotations

from fastapi import FastAPI
from starlette.middleware.trustedhost import TrustedHostMiddleware

from gateway.lifecycle import Drain
from gateway.limits import GENERATION_PATHS, BodySizeLimitMiddleware, ConcurrencyLimitMiddleware
from gateway.openapi import install_openapi
from gateway.security import LOOPBACK_HOST_HEADERS, ApiKeyMiddleware, check_exposure, is_loopback, load_api_keys, open_paths
from gateway.settings import ServiceSettings


def install_guards(app: FastAPI, settings: ServiceSettings, host: str, trusted_hosts: list[str] | None = None) -> None:
    """Keys, limits, the shutdown drain and the OpenAPI error documents for ``app`` serving on
    ``host``; raises ValueError for a non-loopback host without a key (unless allowed)."""
    api_keys = settings.api_keys()
    check_exposure(host, api_keys, settings.allow_no_auth)
    app.state.request_limits = settings.request_limits()
    app.state.drain = Drain(settings.shutdown_grace_s)
    install_openapi(app, requires_key=bool(api_keys), max_tokens_cap=app.state.request_limits.max_tokens_cap)
    app.add_middleware(ConcurrencyLimitMiddleware, max_concurrent=settings.max_concurrent_requests, paths=GENERATION_PATHS)
    app.add_middleware(BodySizeLimitMiddleware, max_bytes=settings.max_request_bytes)
    app.add_middleware(
        ApiKeyMiddleware,
        api_keys=api_keys,
        open_paths=open_paths(settings.metrics_require_key),
        operator_keys=load_api_keys(settings.metrics_api_key, None),
    )
    if trusted_hosts:
        app.add_middleware(TrustedHostMiddleware, allowed_hosts=trusted_hosts)


def default_trusted_hosts(host: str, configured: str | None) -> list[str] | None:
    """The Host headers to answer: as configured (comma-separated, '*' = any); by default the
    loopback names when listening on loopback (a DNS-rebinding page sends its own name), and
    any otherwise."""
    if configured:
        names = [name.strip() for name in configured.split(",") if name.strip()]
        return None if "*" in names else names
    return list(LOOPBACK_HOST_HEADERS) if is_loopback(host) else None
