"""How much one request may ask of a service, each limit refused with an honest 4xx that names
it: the body size (413, refused before the body is read whole), concurrent generation requests
(429 with Retry-After), and the token budget of a request (400).

Both middlewares are pure ASGI: they see the request before FastAPI parses anything, and the
concurrency slot is held until the response (a whole SSE stream) has been sent.
"""

from __future__ import annotations

from dataclasses import dataclass

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gateway.errors import InvalidRequestError, OverloadedError, RequestTooLargeError, error_response

GENERATION_PATHS = frozenset({"/v1/chat/completions", "/v1/completions"})


@dataclass(frozen=True)
class RequestLimits:
    max_tokens_cap: int = 8192
    """Largest max_tokens a request may ask for."""
    default_max_tokens: int = 1024
    """The budget of a request that sets none (capped by the context left)."""
    max_prompt_tokens: int | None = None
    """Longest prompt in tokens; None = the model's context length."""

    def __post_init__(self) -> None:
        if self.max_tokens_cap < 1 or self.default_max_tokens < 1:
            raise ValueError("token limits must be positive")
        if self.max_prompt_tokens is not None and self.max_prompt_tokens < 1:
            raise ValueError("max_prompt_tokens must be positive")

    def check_prompt(self, num_prompt_tokens: int) -> None:
        if self.max_prompt_tokens is not None and num_prompt_tokens > self.max_prompt_tokens:
            raise InvalidRequestError(
                f"the prompt has {num_prompt_tokens} tokens; this service accepts at most {self.max_prompt_tokens}",
                param="prompt",
                code="prompt_too_long",
            )

    def budget(self, asked: int | None, room: int) -> int:
        """The token budget: what the request asked (at most max_tokens_cap), else the default;
        never more than the context left (the caller refuses an ask beyond it)."""
        if asked is not None and asked > self.max_tokens_cap:
            raise InvalidRequestError(
                f"max_tokens is {asked}; this service allows at most {self.max_tokens_cap}",
                param="max_tokens",
                code="max_tokens_exceeded",
            )
        return asked if asked is not None else min(self.default_max_tokens, room)


def declared_length(scope: Scope) -> int | None:
    for name, value in scope.get("headers", []):
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None


class BodySizeLimitMiddleware:
    """Refuses a body larger than ``max_bytes`` with 413: at once when Content-Length says so,
    else as soon as the bytes received pass the limit (chunked uploads). The body is read here
    (at most ``max_bytes``) and replayed to the app."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = declared_length(scope)
        if length is not None and length > self.max_bytes:
            await self._refuse(scope, receive, send, f"{length} bytes")
            return
        messages, num_bytes = [], 0
        while True:
            message = await receive()
            messages.append(message)
            if message["type"] != "http.request":
                break
            num_bytes += len(message.get("body", b""))
            if num_bytes > self.max_bytes:
                await self._refuse(scope, receive, send, f"more than {self.max_bytes} bytes")
                return
            if not message.get("more_body", False):
                break
        await self.app(scope, _replaying(messages, receive), send)

    async def _refuse(self, scope: Scope, receive: Receive, send: Send, size: str) -> None:
        error = RequestTooLargeError(
            f"the request body has {size}; this service accepts at most {self.max_bytes} bytes (max_request_bytes)",
            code="request_too_large",
        )
        await error_response(error)(scope, receive, send)


def _replaying(messages: list[Message], receive: Receive) -> Receive:
    pending = list(messages)

    async def replay() -> Message:
        return pending.pop(0) if pending else await receive()

    return replay


class ConcurrencyLimitMiddleware:
    """At most ``max_concurrent`` requests on ``paths`` at once (a stream counts until its last
    event); one more gets 429 with Retry-After instead of queueing without bound."""

    def __init__(self, app: ASGIApp, max_concurrent: int, paths: frozenset[str] = GENERATION_PATHS, retry_after_s: int = 1) -> None:
        self.app = app
        self.max_concurrent = max_concurrent
        self.paths = paths
        self.retry_after_s = retry_after_s
        self.num_active = 0

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] not in self.paths:
            await self.app(scope, receive, send)
            return
        if self.num_active >= self.max_concurrent:
            error = OverloadedError(
                f"{self.num_active} requests are running, the most this service serves at once "
                f"(max_concurrent_requests={self.max_concurrent}); retry shortly",
                code="too_many_requests",
                retry_after_s=self.retry_after_s,
            )
            await error_response(error)(scope, receive, send)
            return
        self.num_active += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.num_active -= 1
