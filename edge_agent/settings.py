"""Edge agent configuration: every field is a CLI flag and an env var SPADE_EDGE_<FIELD>."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from edge_agent.draft_length import parse_draft_length
from edge_agent.verifier_client import ClientSettings


class EdgeSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="SPADE_EDGE_", protected_namespaces=())

    draft_model: str = Field("qwen2.5-coder-0.5b-instruct", description="Draft model: HF id, local directory, .gguf path or spade-models name.")
    gguf_file: str | None = Field(None, description="GGUF file inside --draft-model (a directory or hub repo) to load.")
    verifier_url: str = Field("http://127.0.0.1:8001", description="Base URL of the verifier service.")
    host: str = Field("127.0.0.1", description="Address to listen on.")
    port: int = Field(8000, ge=0, le=65535, description="Port to listen on.")
    device: str = Field("cpu", description="cpu, cuda, cuda:N or mps.")
    dtype: str = Field("float32", description="float32, bfloat16 or float16.")
    threads: int | None = Field(None, ge=1, description="torch CPU threads (default: torch's choice).")
    draft_length: str = Field("5", description="Tokens drafted per verify call: a positive integer, or 'auto' to adapt to acceptance and round trip.")
    max_draft_length: int = Field(16, ge=1, description="Upper bound of the adaptive draft length.")
    max_draft_support: int = Field(32, ge=1, description="Tokens kept in each drafted distribution sent to the verifier (temperature > 0).")
    verify_timeout_s: float = Field(60.0, gt=0, description="Timeout of one verify call.")
    verify_retries: int = Field(2, ge=0, description="Retries of a lost verify call or a 429/502/503/504 answer.")
    fallback: Literal["error", "draft"] = Field("error", description="When the verifier is unreachable: 'error' answers 503 (or an in-band stream error); 'draft' keeps serving the draft model's own tokens, unverified, counted in spade.fallback_tokens.")
    circuit_open_s: float = Field(5.0, gt=0, description="After the verifier is found unreachable, fail (or fall back) at once for this long before trying it again.")
    startup_timeout_s: float = Field(900.0, gt=0, description="How long to wait at start-up for the verifier's /health to report ok.")
    log_level: str = Field("info", description="Logging level.")

    @field_validator("draft_length")
    @classmethod
    def _check_draft_length(cls, value: str) -> str:
        parse_draft_length(value, 1)
        return value

    def client_settings(self) -> ClientSettings:
        return ClientSettings(timeout_s=self.verify_timeout_s, retries=self.verify_retries, circuit_open_s=self.circuit_open_s)
