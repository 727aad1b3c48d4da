"""Settings both services share: where they listen, how they run their model, who may call
them, how much one request may ask, and how they stop. ``VerifierSettings`` and ``EdgeSettings``
inherit these fields, so each is a flag and an env var of both services (``--api-key``,
SPADE_VERIFIER_API_KEY / SPADE_EDGE_API_KEY).

A field a user would not touch carries ``json_schema_extra={"advanced": True}``: ``--help`` and
docs/configuration.md list it after the user-facing ones (``gateway.cli.is_advanced``). A
``default_note`` there says what an unset or machine-dependent default comes to."""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings

if TYPE_CHECKING:  # the settings module stays light: a CLI's --help imports it and nothing heavy
    from gateway.limits import RequestLimits

DEFAULT_MAX_REQUEST_BYTES = 2 * 1024 * 1024


class ServiceSettings(BaseSettings):
    host: str = Field("127.0.0.1", description="Address to listen on.")
    port: int = Field(8000, ge=0, le=65535, description="Port to listen on.")
    device: str = Field("cpu", description="cpu, cuda, cuda:N or mps.")
    dtype: str = Field("float32", description="float32, bfloat16 or float16 (float32 makes greedy output bit-exact).")
    threads: int | None = Field(
        None,
        ge=1,
        description=(
            "CPU threads of the model: torch's, and on the edge llama.cpp's (default: torch's choice; llama.cpp half the cores, 1 to 4)."
        ),
        json_schema_extra={"default_note": "depends on the machine: torch's choice; llama.cpp half the cores, 1 to 4"},
    )
    gguf_file: str | None = Field(
        None, description="GGUF file to load inside the model's directory or hub repo.", json_schema_extra={"advanced": True}
    )
    api_key: str | None = Field(
        None,
        description=(
            "API key(s) clients must send as 'Authorization: Bearer <key>'; comma-separated for rotation. "
            "Required on every route but /health (and /metrics with --no-metrics-require-key)."
        ),
    )
    api_key_file: str | None = Field(None, description="File of API keys, one per line (added to --api-key).")
    allow_no_auth: bool = Field(
        False, description="Listen on a non-loopback address without an API key (refused otherwise).", json_schema_extra={"advanced": True}
    )
    metrics_require_key: bool = Field(
        True,
        description="With API keys set, /metrics needs a key too; --no-metrics-require-key leaves it open to scrapers.",
        json_schema_extra={"advanced": True},
    )
    metrics_api_key: str | None = Field(
        None,
        description=(
            "The operator's key(s) for /metrics (comma-separated): when set, /metrics answers these alone, 403 to a client's "
            "key (the counters sum over every tenant), whatever --metrics-require-key says."
        ),
        json_schema_extra={"advanced": True},
    )
    max_request_bytes: int = Field(
        DEFAULT_MAX_REQUEST_BYTES,
        ge=1024,
        description="Largest request body in bytes; larger ones get 413 before they are read.",
        json_schema_extra={"advanced": True},
    )
    max_concurrent_requests: int = Field(
        64,
        ge=1,
        description="Generation requests (chat/completions) served at once; more get 429 with Retry-After.",
    )
    max_tokens_cap: int = Field(
        8192, ge=1, description="Largest max_tokens a request may ask for (400 above).", json_schema_extra={"advanced": True}
    )
    default_max_tokens: int = Field(
        1024, ge=1, description="max_tokens of a request that sets none (capped by the context left).", json_schema_extra={"advanced": True}
    )
    max_prompt_tokens: int | None = Field(
        None,
        ge=1,
        description="Longest prompt in tokens (400 above); default: the model's context length.",
        json_schema_extra={"advanced": True, "default_note": "the model's context length"},
    )
    shutdown_grace_s: float = Field(
        10.0,
        ge=0,
        description=(
            "On SIGTERM, in-flight requests get this long to finish; streams still running then end with an error event and [DONE]."
        ),
        json_schema_extra={"advanced": True},
    )
    ssl_certfile: str | None = Field(
        None,
        description="TLS certificate (PEM) to serve HTTPS directly; usually a reverse proxy terminates TLS instead.",
        json_schema_extra={"advanced": True},
    )
    ssl_keyfile: str | None = Field(None, description="TLS private key (PEM) for --ssl-certfile.", json_schema_extra={"advanced": True})
    log_level: Literal["critical", "error", "warning", "info", "debug"] = Field(
        "info",
        description=(
            "Logging level of the service and its web server (any case). Below debug the verifier's access log leaves out"
            " successful /v1/verify calls (tens a second per edge; counted on /metrics); failed ones are logged."
        ),
    )

    @field_validator("log_level", mode="before")
    @classmethod
    def _lower_log_level(cls, value):
        return value.lower() if isinstance(value, str) else value

    def api_keys(self) -> frozenset[str]:
        from gateway.security import load_api_keys

        return load_api_keys(self.api_key, self.api_key_file)

    def request_limits(self) -> RequestLimits:
        from gateway.limits import RequestLimits

        return RequestLimits(
            max_tokens_cap=self.max_tokens_cap,
            default_max_tokens=self.default_max_tokens,
            max_prompt_tokens=self.max_prompt_tokens,
        )
