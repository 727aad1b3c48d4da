"""OpenAI-compatible request and response schemas, shared by the edge and the verifier.

Unknown request fields are accepted and ignored (clients send many we do not use); the ones we
do use are validated here, strictly (``max_tokens: true`` or ``stream: "yes"`` are refused, not
coerced), so a bad value becomes a 400 in the OpenAI error envelope. OpenAI's own fields that we
accept and ignore (``tools``, ``logit_bias``, penalties ...) are type-checked as OpenAI's schema
types them (``tools: "x"`` is a 400 naming the param). Where the schema says integer, an integral
number such as ``1.0`` is one (JSON Schema's rule); ``1.5`` and ``true`` are not. Text must be
valid Unicode: JSON can carry a lone UTF-16 surrogate ("a\\ud800b") that no tokenizer can encode.
"""

from __future__ import annotations

import time
from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from spade_core.params import MAX_SEED, MAX_TEMPERATURE

# The sampling parameters, with the bounds of spade_core.params: the OpenAI requests below and
# the edge <-> verifier wire (verifier_service.protocol) use these same fields.
Temperature = Annotated[float, Field(ge=0.0, le=MAX_TEMPERATURE, allow_inf_nan=False, description="0 is greedy; below 1e-5 counts as 0.")]
TopP = Annotated[float, Field(gt=0.0, le=1.0, allow_inf_nan=False)]
TopK = Annotated[int, Field(ge=-1, description="Extension: 0 or -1 disables.")]
# The documented maximum is 2**63 - 1024: MAX_SEED (2**63 - 1) is no double, and a client that
# writes JSON numbers through doubles reads it as 2**63, past the bound.
Seed = Annotated[int, Field(ge=0, le=MAX_SEED, json_schema_extra={"maximum": 2**63 - 1024})]


def integral_number(value: Any) -> Any:
    """An integral float (``1.0``) as the int it is; anything else unchanged, for the strict int check."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


# An integer as OpenAI's schema (JSON Schema) means it: 1 and 1.0, not 1.5 nor true. Written
# after a field's bounds (``Annotated[int, Field(ge=1), AsInteger]``), so the schema keeps them.
AsInteger = BeforeValidator(integral_number)
JsonInt = Annotated[int, AsInteger]


def narrowed_to(string: dict[str, Any], array: dict[str, Any]):
    """A ``json_schema_extra`` that declares a ``str | list[...] | None`` field's bounds (which a
    validator enforces, with a message naming the field) on the schema's string and array forms."""

    def narrow(schema: dict[str, Any]) -> None:
        for form in schema.get("anyOf", []):
            form.update(string if form.get("type") == "string" else array if form.get("type") == "array" else {})

    return narrow


Penalty = Annotated[float, Field(ge=-2.0, le=2.0, allow_inf_nan=False)]

MAX_TOP_LOGPROBS = 20
"""Alternatives per token: chat's ``top_logprobs`` (OpenAI's bound), and the wire's."""
MAX_COMPLETION_LOGPROBS = 5
"""Alternatives per token of the legacy completions API (``logprobs``, OpenAI's bound)."""

MAX_STOP_STRINGS = 8
MAX_CACHE_SALT_LENGTH = 256
"""Characters in a request's ``cache_salt``."""
MAX_STOP_LENGTH = 1024
"""Characters in one stop string (each generated delta is matched against every prefix)."""


def first_invalid_text(value: Any, path: str = "") -> str | None:
    """The path of the first string in a JSON value that is not valid Unicode (a lone
    surrogate cannot be encoded as UTF-8), or None."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return path or "(body)"
        return None
    if isinstance(value, dict):
        items = [(str(key), key) for key in value] + [(str(key), item) for key, item in value.items()]
    elif isinstance(value, list):
        items = [(str(index), item) for index, item in enumerate(value)]
    else:
        return None
    for name, item in items:
        found = first_invalid_text(item, f"{path}.{name}" if path else name)
        if found is not None:
            return found
    return None


class UnicodeChecked(BaseModel):
    """Refuses any string, anywhere in the request, that is not valid Unicode."""

    @model_validator(mode="before")
    @classmethod
    def _check_unicode(cls, data: Any) -> Any:
        invalid = first_invalid_text(data)
        if invalid is not None:
            raise ValueError(f"{invalid}: text must be valid Unicode (lone UTF-16 surrogates are not)")
        return data


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    include_usage: bool = False


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None

    @field_validator("content")
    @classmethod
    def _check_text_parts(cls, content: str | list[dict[str, Any]] | None) -> str | list[dict[str, Any]] | None:
        if isinstance(content, list) and any(part.get("type") == "text" and not isinstance(part.get("text"), str) for part in content):
            raise ValueError("a text content part needs a string 'text'")
        return content

    def text(self) -> str:
        """Plain text of the message; list content keeps its text parts (OpenAI content parts)."""
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        return "".join(part["text"] for part in self.content if part.get("type") == "text")


class _GenerationFields(UnicodeChecked):
    """What both endpoints accept beside their prompt."""

    model_config = ConfigDict(extra="ignore", strict=True)

    model: str
    max_tokens: Annotated[int, Field(ge=1), AsInteger] | None = None
    temperature: Temperature = 1.0
    top_p: TopP = 1.0
    top_k: Annotated[TopK, AsInteger] = 0
    seed: Annotated[Seed, AsInteger] | None = None
    stop: str | list[str] | None = Field(
        None,
        json_schema_extra=narrowed_to(
            {"minLength": 1, "maxLength": MAX_STOP_LENGTH}, {"maxItems": MAX_STOP_STRINGS, "items": {"type": "string", "minLength": 1}}
        ),
    )
    n: Annotated[int, Field(ge=1, json_schema_extra={"maximum": 1}, description="Only 1 (400 otherwise)."), AsInteger] = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    cache_salt: str | None = Field(
        None,
        min_length=1,
        max_length=MAX_CACHE_SALT_LENGTH,
        description="As vLLM's: only requests with the same salt share cached prompt prefixes (a prefix hit shows in the "
        "time to the first token); by default the verifier also never shares them across API keys.",
    )
    # Accepted and ignored (as OpenAI's schema types them, so a wrong type is still a 400):
    frequency_penalty: Penalty | None = None
    presence_penalty: Penalty | None = None
    logit_bias: dict[str, Annotated[int, Field(ge=-100, le=100), AsInteger]] | None = None

    @field_validator("stop")
    @classmethod
    def _check_stop(cls, value: str | list[str] | None) -> str | list[str] | None:
        stops = [value] if isinstance(value, str) else (value or [])
        if len(stops) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings are supported")
        if any(stop == "" for stop in stops):
            raise ValueError("stop strings must not be empty")
        if any(len(stop) > MAX_STOP_LENGTH for stop in stops):
            raise ValueError(f"stop strings must be at most {MAX_STOP_LENGTH} characters")
        return value

    @property
    def stop_strings(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    @property
    def include_usage_chunk(self) -> bool:
        return self.stream and self.stream_options is not None and self.stream_options.include_usage


class ChatCompletionRequest(_GenerationFields):
    # top_logprobs needs logprobs: true (OpenAI's rule, enforced below): declared in the schema too.
    model_config = ConfigDict(
        extra="ignore",
        strict=True,
        json_schema_extra={
            "anyOf": [
                {"not": {"required": ["top_logprobs"]}},
                {"properties": {"top_logprobs": {"type": "null"}}},
                {"properties": {"logprobs": {"const": True}}, "required": ["logprobs"]},
            ]
        },
    )
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Annotated[int, Field(ge=1), AsInteger] | None = None
    logprobs: bool | None = Field(default=False, description="Return each output token's log-probability.")
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS), AsInteger] | None = Field(
        default=None, description="Also its most likely alternatives (needs logprobs: true)."
    )
    # Accepted and ignored (no tool calling here), type-checked as OpenAI's schema types them:
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    functions: list[dict[str, Any]] | None = Field(None, min_length=1)
    function_call: str | dict[str, Any] | None = None
    response_format: dict[str, Any] | None = None
    service_tier: str | None = None

    @field_validator("top_logprobs")
    @classmethod
    def _check_top_logprobs(cls, value: int | None, info: ValidationInfo) -> int | None:
        # A field validator (not a model one) so that the 400 names the param.
        if value is not None and "logprobs" in info.data and not info.data["logprobs"]:
            raise ValueError("top_logprobs needs logprobs: true")
        return value

    @property
    def token_budget(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    @property
    def num_top_logprobs(self) -> int | None:
        """None: no logprobs; N: each token's logprob and N alternatives."""
        return (self.top_logprobs or 0) if self.logprobs else None


class CompletionRequest(_GenerationFields):
    prompt: str | list[JsonInt] = Field(
        description='Text, or token ids; not empty (OpenAI\'s schema allows "", which a model with no BOS token '
        "cannot continue: refused with 400, and declared so here).",
        json_schema_extra=narrowed_to({"minLength": 1}, {"minItems": 1}),
    )
    echo: bool = Field(False, json_schema_extra={"const": False}, description="Only false: echo is not supported (400).")
    logprobs: Annotated[int, Field(ge=0, le=MAX_COMPLETION_LOGPROBS), AsInteger] | None = Field(
        default=None,
        description="Return each output token's log-probability and this many most likely alternatives.",
    )
    # Accepted and ignored, type-checked as OpenAI's schema types them:
    best_of: Annotated[int, Field(ge=0, le=20), AsInteger] | None = None
    suffix: str | None = None

    @field_validator("prompt")
    @classmethod
    def _check_prompt(cls, value: str | list[int]) -> str | list[int]:
        if len(value) == 0:
            raise ValueError("the prompt must not be empty")
        return value

    @property
    def token_budget(self) -> int | None:
        return self.max_tokens

    @property
    def num_top_logprobs(self) -> int | None:
        return self.logprobs


class SpadeStats(BaseModel):
    """Per-request speculative-decoding accounting (an extension to OpenAI's schema). Each
    field's docstring is its description (in the OpenAPI document and docs/metrics.md)."""

    model_config = ConfigDict(use_attribute_docstrings=True)

    verify_calls: int = 0
    """Calls to the verifier; for target-only decoding, the target's forward passes."""
    drafted_tokens: int = 0
    """Drafted tokens sent for verification: the blocks' lengths summed."""
    accepted_tokens: int = 0
    """Of those, tokens the target accepted."""
    target_tokens: int = 0
    """Tokens that went through the target's forward passes, rejected drafts included."""
    resyncs: int = 0
    """Verify calls repeated with the full context after a 409 (session lost on the verifier)."""
    fallback_tokens: int = 0
    """Tokens served by the draft model alone while the verifier was unreachable (only with
    the edge's ``--fallback draft``): NOT verified, so not the target's distribution."""
    overlap_hits: int = 0
    """Blocks that started with tokens drafted while the previous block was verified."""
    overlap_misses: int = 0
    """Blocks drafted ahead that the verdict made useless (rolled back)."""
    draft_ms: float = 0.0
    """Time spent waiting for drafting (drafting hidden under a verify call is not counted)."""
    draft_ahead_ms: float = 0.0
    """Drafting done while verify calls were in flight (hidden from the user's wait)."""
    verify_ms: float = 0.0
    """Round trips of the verify calls, network and queueing included."""
    verifier_forward_ms: float = 0.0
    """The verifier's forward passes and acceptance math for this request's calls, as it reported them (``timings.forward_ms``)."""
    advised_draft_length: int | None = None
    """The longest block the verifier's last verdict advised (its limit while it has idle time,
    shorter when its forwards follow each other, 0 where no drafted row pays); None for
    target-only decoding."""
    advice_capped_blocks: int = 0
    """Blocks drafted shorter than the draft-length policy chose, to follow the verifier's advice."""
    verifier_cached_tokens: int = 0
    """Prompt tokens the verifier did not prefill: a cached prefix (another request's, same
    salt and key) covered them. Also ``usage.prompt_tokens_details.cached_tokens``."""
    draft_cached_tokens: int = 0
    """Context tokens the edge's draft did not decode: it copied their KV from another request's
    sequence (same API key and salt) holding the same prefix. 0 for target-only decoding."""
    draft_ahead_tokens: int = 0
    """Tokens drafted while verify calls were in flight (the forward running at the end included)."""
    used_draft_tokens: int = 0
    """Drafted tokens that served: accepted by the target, or a drafted-ahead guess of the target's
    next token that the verdict confirmed. Every drafted token is exactly one of used, rejected
    or discarded ahead; each divided by ``completion_tokens`` is that share per generated token."""
    rejected_draft_tokens: int = 0
    """Drafted tokens sent for verification and rejected."""
    discarded_ahead_tokens: int = 0
    """Tokens drafted ahead and never sent: the verdict missed the guess, or the request ended."""
    skipped_ahead_blocks: int = 0
    """Verify calls under which the edge did not draft ahead because it was not worth its CPU
    (``--edge-power``)."""
    continued_tokens: int = 0
    """Tokens the verifier decoded on by itself after a verdict: while saturated it advises no
    drafting, and a call then brings up to ``--max-continued-tokens`` of the target's tokens."""


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0
    """Prompt tokens the verifier's prefix cache covered (not prefilled again)."""


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails = Field(default_factory=PromptTokensDetails)


FinishReason = Literal["stop", "length"]


class ChatMessageOut(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str
    refusal: str | None = Field(None, description="Always null (OpenAI's schema requires the field).")


class TopLogprob(BaseModel):
    """One token and its log-probability (``spade_core.sampling.reported_logprobs``)."""

    token: str = Field(description="The token's own text (its id decoded alone, as vLLM does).")
    logprob: float
    bytes: list[int] | None = Field(description="The token's UTF-8 bytes (a byte-level token's own bytes).")


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(description="The most likely tokens at this position, most likely first.")


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None
    refusal: list[ChatTokenLogprob] | None = Field(None, description="Always null (OpenAI's schema requires the field).")


class CompletionLogprobs(BaseModel):
    """The legacy completions API's logprobs: parallel lists, one entry per output token."""

    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]] = Field(description="The chosen token and the N most likely, by their text.")
    text_offset: list[int] = Field(description="Where each token's text starts in the choice's text.")


class ChatChoice(BaseModel):
    index: int = 0
    message: ChatMessageOut
    finish_reason: FinishReason | None
    logprobs: ChatLogprobs | None = None


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
    finish_reason: FinishReason | None
    logprobs: CompletionLogprobs | None = None


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
    created: int
    """Unix seconds: when this service began serving, the same in every listing and retrieval."""
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
