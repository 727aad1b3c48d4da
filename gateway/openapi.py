"""The OpenAPI documents say what the services answer: errors in the OpenAI envelope with the
statuses the error table gives (400 for a malformed request, never FastAPI's 422), and the
Bearer key the routes require."""

from __future__ import annotations

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from gateway.protocol import ErrorResponse

ERROR_DESCRIPTIONS = {
    400: "Invalid request (the OpenAI error envelope names the parameter).",
    401: "Missing or invalid API key.",
    404: "Unknown model.",
    409: "Verifier session out of sync: resend the full context.",
    413: "Request body larger than max_request_bytes.",
    429: "Too many requests at once (see Retry-After), or no room for the session.",
    502: "The verifier's answers stayed garbled, invalid or failed their integrity check (edge).",
    503: "Model loading, verifier unreachable, or service shutting down.",
}


def error_responses(*statuses: int) -> dict[int | str, dict]:
    """``responses=`` for a route: each status with the error envelope as its body."""
    return {status: {"model": ErrorResponse, "description": ERROR_DESCRIPTIONS[status]} for status in statuses}


GENERATION_ERRORS = error_responses(400, 401, 404, 413, 429, 502, 503)


TOKEN_BUDGET_FIELDS = ("max_tokens", "max_completion_tokens")


def install_openapi(app: FastAPI, requires_key: bool, max_tokens_cap: int | None = None) -> None:
    """Drop FastAPI's 422 (validation errors answer 400 here), declare the service's
    ``max_tokens_cap`` as the token budgets' maximum (a request the document allows is one the
    service takes) and, when keys are required, Bearer authentication on every route but /health."""

    def openapi() -> dict:
        if app.openapi_schema is None:
            document = get_openapi(title=app.title, version=app.version, routes=app.routes)
            _drop_validation_error(document)
            if max_tokens_cap is not None:
                _declare_token_cap(document, max_tokens_cap)
            if requires_key:
                _declare_bearer(document)
            app.openapi_schema = document
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]  # FastAPI's documented way to customise the document


def _drop_validation_error(document: dict) -> None:
    for path_item in document.get("paths", {}).values():
        for operation in path_item.values():
            operation.get("responses", {}).pop("422", None)
    schemas = document.get("components", {}).get("schemas", {})
    for name in ("HTTPValidationError", "ValidationError"):
        schemas.pop(name, None)


def _declare_token_cap(document: dict, max_tokens_cap: int) -> None:
    for schema in document.get("components", {}).get("schemas", {}).values():
        for name in TOKEN_BUDGET_FIELDS:
            field = schema.get("properties", {}).get(name)
            for form in (field or {}).get("anyOf", [field] if field else []):
                if form.get("type") == "integer":
                    form["maximum"] = max_tokens_cap


def _declare_bearer(document: dict) -> None:
    document.setdefault("components", {}).setdefault("securitySchemes", {})["bearer"] = {"type": "http", "scheme": "bearer"}
    for path, path_item in document.get("paths", {}).items():
        if path == "/health":
            continue
        for operation in path_item.values():
            operation["security"] = [{"bearer": []}]
            operation.setdefault("responses", {}).setdefault(
                "401",
                {
                    "description": ERROR_DESCRIPTIONS[401],
                    "content": {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorResponse"}}},
                },
            )
