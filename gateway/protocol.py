"""OpenAI-compatible request and response schemas, shared by the edge and the verifier.

Unknown request fields are accepted and ignored (clients send many we do not use); the ones we
do use are validated here, so a bad value becomes a 400 in the OpenAI error envelope.
"""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

MAX_STOP_STRINGS = 8


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: bool = False


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None

    def text(self) -> str:
        """Plain text of the message; list content keeps its text parts (OpenAI content parts)."""
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        return "".join(part.get("text", "") for part in self.content if part.get("type") == "text")


class _GenerationFields(BaseModel):
    """What both endpoints accept beside their prompt."""

    model_config = ConfigDict(extra="ignore")

    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=-1, description="Extension: 0 or -1 disables.")
    seed: int | None = Field(None, ge=0)
    stop: str | list[str] | None = None
    n: int = Field(1, ge=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None

    @field_validator("stop")
    @classmethod
    def _check_stop(cls, value: str | list[str] | None) -> str | list[str] | None:
        stops = [value] if isinstance(value, str) else (value or [])
        if len(stops) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings are supported")
        if any(stop == "" for stop in stops):
            raise ValueError("stop strings must not be empty")
        return value

    @property
    def stop_strings(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    @property
    def include_usage_chunk(self) -> bool:
        return self.stream and self.stream_options is not None and self.stream_options.include_usage


class ChatCompletionRequest(_GenerationFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)

    @property
    def token_budget(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


class CompletionRequest(_GenerationFields):
    prompt: str | list[int]
    echo: bool = False

    @property
    def token_budget(self) -> int | None:
        return self.max_tokens


class SpadeStats(BaseModel):
    """Per-request speculative-decoding accounting (an extension to OpenAI's schema)."""

    verify_calls: int = 0
    """Calls to the verifier; for target-only decoding, the target's forward passes."""
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    target_tokens: int = 0
    """Tokens that went through the target's forward passes, rejected drafts included."""
    resyncs: int = 0
    """Verify calls repeated with the full context after a 409 (session lost on the verifier)."""
    fallback_tokens: int = 0
    """Tokens served by the draft model alone while the verifier was unreachable (only with
    the edge's ``--fallback draft``): NOT verified, so not the target's distribution."""
    draft_ms: float = 0.0
    verify_ms: float = 0.0
    """Round trips of the verify calls, network and queueing included."""
    verifier_forward_ms: float = 0.0


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class ChatMessageOut(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int = 0
    message: ChatMessageOut
    finish_reason: Literal["stop", "length"] | None
    logprobs: None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: Usage
    spade: SpadeStats


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    finish_reason: Literal["stop", "length"] | None
    logprobs: None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: Usage
    spade: SpadeStats


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "spade"
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorBody(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class ErrorResponse(BaseModel):
    error: ErrorBody
