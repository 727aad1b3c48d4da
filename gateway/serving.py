"""Serving the OpenAI routes over any ``GenerationEngine``.

``prepare_*`` turn a validated request into a ``GenerationRequest`` (prompt tokens, budget,
sampling, logprobs wanted); ``TextGeneration`` runs the engine and turns its tokens into text
deltas, applying EOS, stop strings and the token budget, each delta with the tokens whose
logprobs it reports (``gateway.logprobs``); ``*_response`` and ``*_events`` build the
non-streamed body or the SSE events from it.
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass, field, replace

from jinja2 import TemplateError

from gateway import chunks
from gateway.affinity import chat_prefix_key, prompt_prefix_key
from gateway.engine import GeneratedTokens, GenerationEngine, GenerationRequest, TopLogprobs, check_logprobs_support
from gateway.errors import InvalidRequestError, ModelNotFoundError, error_body, log_failure
from gateway.lifecycle import Drain, until_expired
from gateway.limits import RequestLimits
from gateway.logprobs import ReportedToken, TokenSpans, chat_logprobs, completion_logprobs
from gateway.prompts import chat_prompt_ids, text_prompt_ids
from gateway.protocol import (
    ChatChoice,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatMessageOut,
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    FinishReason,
    PromptTokensDetails,
    SpadeStats,
    Usage,
)
from gateway.text import IncrementalDetokenizer, StopStringFilter
from spade_core.params import SamplingConfig, random_seed

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class PreparedRequest:
    kind: str  # "chat" or "completion"
    identity: chunks.StreamIdentity
    generation: GenerationRequest
    stop_strings: list[str]
    stream: bool
    include_usage: bool

    @property
    def wants_logprobs(self) -> bool:
        return self.generation.num_top_logprobs is not None


@dataclass(frozen=True)
class TextDelta:
    text: str
    tokens: list[ReportedToken]
    """The tokens whose logprobs this delta reports (none unless the request asked)."""


def prepare_chat(engine: GenerationEngine, request: ChatCompletionRequest, limits: RequestLimits = RequestLimits()) -> PreparedRequest:
    """Templating and tokenization take seconds on a large prompt: call it off the event loop."""
    check_common(engine, request)
    messages = [{"role": message.role, "content": message.text()} for message in request.messages]
    if not getattr(engine.tokenizer, "chat_template", None):
        raise InvalidRequestError(
            f"the model {engine.model.model_id!r} has no chat template: send the prompt to /v1/completions", param="messages"
        )
    try:
        prompt_ids = chat_prompt_ids(engine.tokenizer, messages)
    except TemplateError as error:  # the template rejecting these messages (raise_exception); anything else is ours: 500
        raise InvalidRequestError(f"the chat template rejected the messages: {error}", param="messages") from error
    prepared = _prepare(engine, request, "chat", "chat.completion.chunk", prompt_ids, limits)
    return replace(prepared, generation=replace(prepared.generation, prefix_key=chat_prefix_key(messages)))


def prepare_completion(engine: GenerationEngine, request: CompletionRequest, limits: RequestLimits = RequestLimits()) -> PreparedRequest:
    check_common(engine, request)
    if request.echo:
        raise InvalidRequestError("echo is not supported", param="echo")
    if isinstance(request.prompt, str):
        prompt_ids = text_prompt_ids(engine.tokenizer, request.prompt)
    else:
        prompt_ids = list(request.prompt)
        vocab_size = engine.model.vocab_size
        if any(not 0 <= token_id < vocab_size for token_id in prompt_ids):
            raise InvalidRequestError(f"prompt token ids must be in [0, {vocab_size})", param="prompt")
    prepared = _prepare(engine, request, "completion", "text_completion", prompt_ids, limits)
    return replace(prepared, generation=replace(prepared.generation, prefix_key=prompt_prefix_key(prompt_ids)))


def check_common(engine: GenerationEngine, request: ChatCompletionRequest | CompletionRequest) -> None:
    if request.model != engine.model.model_id:
        raise ModelNotFoundError(
            f"the model {request.model!r} does not exist here; this service serves {engine.model.model_id!r}",
            param="model",
            code="model_not_found",
        )
    if request.n != 1:
        raise InvalidRequestError("only n=1 is supported", param="n")


def _prepare(engine, request, kind: str, chunk_object: str, prompt_ids: list[int], limits: RequestLimits) -> PreparedRequest:
    if not prompt_ids:
        raise InvalidRequestError("the prompt is empty", param="prompt" if kind == "completion" else "messages")
    limits.check_prompt(len(prompt_ids))
    model = engine.model
    budget = limits.budget(request.token_budget, model.room(len(prompt_ids)))
    model.check_fits(len(prompt_ids), max(budget, 1), param="max_tokens")
    request_id = ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex
    sampling = SamplingConfig(
        temperature=request.temperature,
        top_k=request.top_k,
        top_p=request.top_p,
        seed=request.seed if request.seed is not None else random_seed(),
    )
    if request.num_top_logprobs is not None:
        check_logprobs_support(model.logprobs_support, sampling, param="logprobs")
    generation = GenerationRequest(
        request_id=request_id,
        prompt_token_ids=prompt_ids,
        max_tokens=budget,
        sampling=sampling,
        eos_token_ids=model.eos_token_ids,
        num_top_logprobs=request.num_top_logprobs,
        cache_salt=request.cache_salt,
    )
    identity = chunks.StreamIdentity(request_id, model.model_id, int(time.time()), chunk_object)
    return PreparedRequest(kind, identity, generation, request.stop_strings, request.stream, request.include_usage_chunk)


@dataclass
class TextGeneration:
    """Runs one request through the engine and yields its text deltas."""

    engine: GenerationEngine
    prepared: PreparedRequest
    stats: SpadeStats = field(default_factory=SpadeStats)
    completion_tokens: int = 0
    finish_reason: FinishReason = "length"
    scored: list[tuple[int, float, TopLogprobs]] = field(default_factory=list)
    """(token id, logprob, alternatives) of each token the engine produced, when asked."""

    @property
    def usage(self) -> Usage:
        prompt_tokens = len(self.prepared.generation.prompt_token_ids)
        return Usage(
            prompt_tokens=prompt_tokens,
            completion_tokens=self.completion_tokens,
            total_tokens=prompt_tokens + self.completion_tokens,
            prompt_tokens_details=PromptTokensDetails(cached_tokens=self.stats.verifier_cached_tokens),
        )

    async def deltas(self) -> AsyncGenerator[TextDelta, None]:
        detokenizer = IncrementalDetokenizer(self.engine.tokenizer)
        stop_filter = StopStringFilter(self.prepared.stop_strings)
        spans = TokenSpans()
        generation = self.prepared.generation
        token_ids = self._token_ids()
        async with contextlib.aclosing(token_ids):
            async for token_id in token_ids:
                self.completion_tokens += 1
                if token_id in generation.eos_token_ids:
                    self.finish_reason = "stop"
                    break
                text = detokenizer.add(token_id)
                spans.add(len(text))
                delta = stop_filter.append(text)
                if delta:
                    yield TextDelta(delta, self._released(spans, stop_filter.num_released))
                if stop_filter.is_stopped:
                    self.finish_reason = "stop"
                    return
                if self.completion_tokens >= generation.max_tokens:
                    break
        flushed = detokenizer.flush()
        spans.flush(len(flushed))
        tail = stop_filter.append(flushed)
        if stop_filter.is_stopped:
            self.finish_reason = "stop"
        else:
            tail += stop_filter.flush()
        last = TextDelta(tail, self._released(spans, stop_filter.num_released))
        if last.text or last.tokens:  # tokens without text: only with logprobs
            yield last

    def _released(self, spans: TokenSpans, num_released_chars: int) -> list[ReportedToken]:
        released = spans.release(num_released_chars)
        if not self.prepared.wants_logprobs:
            return []
        return [ReportedToken(*self.scored[span.index], text_offset=span.start) for span in released]

    async def _token_ids(self) -> AsyncGenerator[int, None]:
        batches = self.engine.generate(self.prepared.generation, self.stats)
        async with contextlib.aclosing(batches):
            async for batch in batches:
                if self.prepared.wants_logprobs:
                    self.scored += scored_tokens(batch)
                for token_id in batch.token_ids:
                    yield token_id


def scored_tokens(batch: GeneratedTokens) -> list[tuple[int, float, TopLogprobs]]:
    """(token id, logprob, alternatives) per token of a batch the request asked logprobs for."""
    num_tokens = len(batch.token_ids)
    if batch.logprobs is None or batch.top_logprobs is None or not len(batch.logprobs) == len(batch.top_logprobs) == num_tokens:
        raise RuntimeError("the engine returned no logprobs, or not one per token, for a request that asked for them")
    return list(zip(batch.token_ids, batch.logprobs, batch.top_logprobs, strict=True))


async def complete_response(generation: TextGeneration) -> ChatCompletionResponse | CompletionResponse:
    """The non-streamed body: the whole text, for a chat or a text completion."""
    deltas = [delta async for delta in generation.deltas()]
    text = "".join(delta.text for delta in deltas)
    tokens = [token for delta in deltas for token in delta.tokens]
    prepared, tokenizer = generation.prepared, generation.engine.tokenizer
    identity, finish_reason = prepared.identity, generation.finish_reason
    if prepared.kind == "chat":
        logprobs = chat_logprobs(tokenizer, tokens) if prepared.wants_logprobs else None
        return ChatCompletionResponse(
            id=identity.id,
            created=identity.created,
            model=identity.model,
            usage=generation.usage,
            spade=generation.stats,
            choices=[ChatChoice(message=ChatMessageOut(content=text), finish_reason=finish_reason, logprobs=logprobs)],
        )
    text_logprobs = completion_logprobs(tokenizer, tokens) if prepared.wants_logprobs else None
    return CompletionResponse(
        id=identity.id,
        created=identity.created,
        model=identity.model,
        usage=generation.usage,
        spade=generation.stats,
        choices=[CompletionChoice(text=text, finish_reason=finish_reason, logprobs=text_logprobs)],
    )


async def stream_events(generation: TextGeneration, drain: Drain | None = None) -> AsyncIterator[str]:
    """The SSE ``data:`` payloads of a streamed request, [DONE] last; an error after the stream
    started (the shutdown grace period expiring included) is sent as a ``{"error": ...}`` event
    before [DONE]."""
    prepared = generation.prepared
    identity = prepared.identity
    is_chat = prepared.kind == "chat"
    try:
        if is_chat:
            yield json.dumps(chunks.chat_role_chunk(identity))
        async for delta in until_expired(generation.deltas(), drain):
            logprobs = _chunk_logprobs(generation, delta)
            if is_chat:
                chunk = chunks.chat_content_chunk(identity, delta.text, logprobs)
            else:
                chunk = chunks.completion_text_chunk(identity, delta.text, logprobs)
            yield json.dumps(chunk, ensure_ascii=False)
        finish = chunks.chat_finish_chunk if is_chat else chunks.completion_finish_chunk
        yield json.dumps(finish(identity, generation.finish_reason))
        if prepared.include_usage:
            yield json.dumps(chunks.usage_chunk(identity, generation.usage, generation.stats))
    except Exception as error:  # the status line is already sent: report in-band
        body, _ = error_body(error)
        log_failure(error, identity.id, streamed=True)
        yield json.dumps(body.model_dump())
    yield chunks.DONE


def _chunk_logprobs(generation: TextGeneration, delta: TextDelta) -> dict | None:
    """A content chunk's ``logprobs``: the tokens its text completes, or null when not asked."""
    if not generation.prepared.wants_logprobs:
        return None
    build = chat_logprobs if generation.prepared.kind == "chat" else completion_logprobs
    return build(generation.engine.tokenizer, delta.tokens).model_dump()
