"""The OpenAI routes both services mount: a thin router over ``gateway.serving``.

The engine hangs off ``app.state.engine`` (set once the model is loaded); until then every
route answers 503 in the OpenAI envelope.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import replace

from fastapi import APIRouter, Request
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from sse_starlette import EventSourceResponse
from starlette.responses import Response

from gateway.engine import GenerationEngine
from gateway.errors import ModelNotFoundError, ServiceUnavailableError
from gateway.lifecycle import SHUTDOWN_MARGIN_S, Drain, run_while_wanted
from gateway.limits import RequestLimits
from gateway.openapi import GENERATION_ERRORS, error_responses
from gateway.protocol import ChatCompletionRequest, ChatCompletionResponse, CompletionRequest, CompletionResponse, ModelCard, ModelList
from gateway.security import caller_key_id
from gateway.serving import (
    PreparedRequest,
    TextGeneration,
    complete_response,
    prepare_chat,
    prepare_completion,
    stream_events,
)


def current_engine(request: Request) -> GenerationEngine:
    engine = getattr(request.app.state, "engine", None)
    if engine is None:
        raise ServiceUnavailableError("the model is still loading; retry when /health reports ok")
    return engine


def _streamed_or(model) -> dict:
    """The 200 of a generation route: the JSON body, or an SSE stream with ``stream: true``."""
    return {200: {"model": model, "content": {"text/event-stream": {}}, "description": "The completion, or its SSE stream."}}


def build_openai_router() -> APIRouter:
    router = APIRouter()
    # A model card's ``created``: one time for every listing and retrieval, when the service began.
    served_since = int(time.time())

    @router.post("/v1/chat/completions", response_model=None, responses=_streamed_or(ChatCompletionResponse) | GENERATION_ERRORS)
    async def create_chat_completion(body: ChatCompletionRequest, request: Request):
        engine = current_engine(request)
        # Templating and tokenizing a large prompt take seconds: off the event loop.
        prepared = await asyncio.to_thread(prepare_chat, engine, body, _limits(request))
        return await _respond(engine, prepared, request)

    @router.post("/v1/completions", response_model=None, responses=_streamed_or(CompletionResponse) | GENERATION_ERRORS)
    async def create_completion(body: CompletionRequest, request: Request):
        engine = current_engine(request)
        prepared = await asyncio.to_thread(prepare_completion, engine, body, _limits(request))
        return await _respond(engine, prepared, request)

    @router.get("/v1/models", responses=error_responses(401, 503))
    async def list_models(request: Request) -> ModelList:
        return ModelList(data=[_model_card(current_engine(request), served_since)])

    @router.get("/v1/models/{model_id:path}", responses=error_responses(401, 404, 503))
    async def retrieve_model(model_id: str, request: Request) -> ModelCard:
        """OpenAI's ``models.retrieve``: the served model, or 404 for any other id (a model id may hold '/')."""
        engine = current_engine(request)
        if model_id != engine.model.model_id:
            raise ModelNotFoundError(f"the model {model_id!r} does not exist here", param="model", code="model_not_found")
        return _model_card(engine, served_since)

    metrics_responses: dict[int | str, dict] = {200: {"content": {"text/plain": {}}, "description": "Prometheus metrics."}}

    @router.get("/metrics", response_class=Response, responses=metrics_responses | error_responses(401))
    async def metrics(request: Request) -> Response:
        registry: CollectorRegistry = request.app.state.metrics.registry
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    return router


def _model_card(engine: GenerationEngine, created: int) -> ModelCard:
    return ModelCard(id=engine.model.model_id, created=created, max_model_len=engine.model.max_context_length)


def _limits(request: Request) -> RequestLimits:
    return getattr(request.app.state, "request_limits", None) or RequestLimits()


async def _respond(engine: GenerationEngine, prepared: PreparedRequest, request: Request):
    """Stream, or answer once complete; either way the generation stops when the client goes
    or the shutdown grace period ends (see gateway.lifecycle)."""
    owner = caller_key_id(request) or ""
    generation = TextGeneration(engine, replace(prepared, generation=replace(prepared.generation, cache_owner=owner)))
    request.state.request_id = prepared.identity.id  # what the error log names (gateway.errors)
    drain: Drain | None = getattr(request.app.state, "drain", None)
    if prepared.stream:
        # sse-starlette cancels streams at shutdown after its own grace: keep it past ours, so
        # each stream ends itself with an error event and [DONE].
        grace_s = drain.grace_s + SHUTDOWN_MARGIN_S if drain is not None else 0
        return EventSourceResponse(stream_events(generation, drain), ping=15, shutdown_grace_period=grace_s)
    return await run_while_wanted(complete_response(generation), request, drain)
