"""One table from exception kind to (OpenAI error type, HTTP status), and the handlers that
answer every failure in the OpenAI envelope ``{"error": {"message", "type", "param", "code"}}``.

Honest codes: the client's mistakes are 4xx, our faults 500, an unreachable or failing cloud
503, a cloud whose answers stay garbled or fail their integrity check 502, overload 429.
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from gateway.protocol import ErrorBody, ErrorResponse

logger = logging.getLogger(__name__)


class GatewayError(Exception):
    """Base of the errors we raise on purpose; subclasses pick the row of the table."""

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code


class InvalidRequestError(GatewayError):
    """The request is malformed or asks for something we cannot do."""


class AuthenticationError(GatewayError):
    """No API key, or a wrong one."""


class PermissionDeniedError(GatewayError):
    """A valid key that may not use this route (a client's key on an operator's route)."""


class RequestTooLargeError(GatewayError):
    """The request body is larger than the service accepts."""


class ModelNotFoundError(GatewayError):
    """The request names a model this service does not serve."""


class SessionNotFoundError(GatewayError):
    """A route names a session this service does not hold (never opened, closed or expired)."""


class SessionConflictError(GatewayError):
    """A verify call's prefix does not match the session (the edge must resend its context)."""


class OverloadedError(GatewayError):
    """Too many requests or sessions at once; the client may retry after ``retry_after_s``."""

    def __init__(self, message: str, *, retry_after_s: int = 1, **details) -> None:
        super().__init__(message, **details)
        self.retry_after_s = retry_after_s


class ServiceUnavailableError(GatewayError):
    """The model is still loading, or the verifier cannot be reached."""


class BadGatewayError(GatewayError):
    """The verifier answered, but every answer was garbled, invalid, failed its integrity check
    or was a server error (code ``verifier_bad_response``): no token of it was emitted."""


# exception kind -> (OpenAI error type, HTTP status)
ERROR_TABLE: dict[type[Exception], tuple[str, int]] = {
    InvalidRequestError: ("invalid_request_error", 400),
    RequestValidationError: ("invalid_request_error", 400),
    AuthenticationError: ("invalid_request_error", 401),
    PermissionDeniedError: ("permission_error", 403),
    ModelNotFoundError: ("not_found_error", 404),
    SessionNotFoundError: ("not_found_error", 404),
    SessionConflictError: ("conflict_error", 409),
    RequestTooLargeError: ("invalid_request_error", 413),
    OverloadedError: ("rate_limit_error", 429),
    ServiceUnavailableError: ("service_unavailable_error", 503),
    BadGatewayError: ("bad_gateway_error", 502),
    Exception: ("server_error", 500),
}


def classify(error: BaseException) -> tuple[str, int]:
    for kind in type(error).__mro__:
        if kind in ERROR_TABLE:
            return ERROR_TABLE[kind]
    return ERROR_TABLE[Exception]


def error_body(error: BaseException) -> tuple[ErrorResponse, int]:
    """The envelope and status for any exception (used for JSON responses and stream events)."""
    error_type, status = classify(error)
    if isinstance(error, GatewayError):
        body = ErrorBody(message=error.message, type=error_type, param=error.param, code=error.code)
    elif status == 500:
        body = ErrorBody(message="internal error: " + type(error).__name__, type=error_type)
    else:
        body = ErrorBody(message=str(error), type=error_type)
    return ErrorResponse(error=body), status


def error_response(error: BaseException) -> JSONResponse:
    body, status = error_body(error)
    headers = {"retry-after": str(error.retry_after_s)} if isinstance(error, OverloadedError) else None
    return JSONResponse(body.model_dump(), status_code=status, headers=headers)


def _validation_body(error: RequestValidationError) -> ErrorResponse:
    first: dict[str, Any] = error.errors()[0] if error.errors() else {"msg": "invalid request", "loc": ()}
    if first.get("type") == "json_invalid":  # its loc is ("body", character offset), not a field
        detail = first.get("ctx", {}).get("error", first["msg"])
        return ErrorResponse(error=ErrorBody(message=f"malformed JSON body: {detail}", type="invalid_request_error"))
    location = [str(part) for part in first.get("loc", ()) if part != "body"]
    param = ".".join(location) or None
    message = f"{param}: {first['msg']}" if param else str(first["msg"])
    return ErrorResponse(error=ErrorBody(message=message, type="invalid_request_error", param=param))


def _http_error_type(status: int) -> str:
    return {404: "not_found_error", 405: "invalid_request_error", 429: "rate_limit_error"}.get(
        status, "invalid_request_error" if status < 500 else "server_error"
    )


def install_error_handlers(app: FastAPI) -> None:
    """Answer every failure of ``app`` in the OpenAI envelope."""

    @app.exception_handler(RequestValidationError)
    async def _on_validation(_: Request, error: RequestValidationError) -> JSONResponse:
        return JSONResponse(_validation_body(error).model_dump(), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def _on_http(_: Request, error: StarletteHTTPException) -> JSONResponse:
        body = ErrorBody(message=str(error.detail), type=_http_error_type(error.status_code))
        # Starlette's 405 carries the route's methods in Allow (RFC 9110 requires it): keep its headers.
        return JSONResponse(ErrorResponse(error=body).model_dump(), status_code=error.status_code, headers=error.headers)

    @app.exception_handler(GatewayError)
    async def _on_gateway_error(request: Request, error: GatewayError) -> JSONResponse:
        log_failure(error, request_id(request), streamed=False)
        return error_response(error)

    @app.exception_handler(Exception)
    async def _on_unexpected(request: Request, error: Exception) -> JSONResponse:
        log_failure(error, request_id(request), streamed=False)
        return error_response(error)


def request_id(request: Request) -> str:
    """The response id the generation routes set once the request is prepared, else the route."""
    return getattr(request.state, "request_id", None) or f"{request.method} {request.url.path}"


def log_failure(error: BaseException, request_id: str, streamed: bool) -> None:
    """Our failures (500) are logged with their traceback; the service's own refusals at 5xx
    (loading, overloaded upstream, shutting down) as one warning line; a client's 4xx not at all
    beyond the access log. ``streamed``: the client got it as an in-band error event."""
    _, status = classify(error)
    where = "mid-stream" if streamed else "before responding"
    if status == 500:
        logger.error("request %s failed %s: internal error", request_id, where, exc_info=error)
    elif status >= 500:
        logger.warning("request %s failed %s: %d %s", request_id, where, status, error)
