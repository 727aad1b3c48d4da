"""The OpenAI routes both services mount: a thin router over ``gateway.serving``.

The engine hangs off ``app.state.engine`` (set once the model is loaded); until then every
route answers 503 in the OpenAI envelope.
"""

from __future__ import annotations

from fastapi import APIRouter, Request
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from sse_starlette import EventSourceResponse
from starlette.responses import Response

from gateway.engine import GenerationEngine
from gateway.errors import ServiceUnavailableError
from gateway.protocol import ChatCompletionRequest, CompletionRequest, ModelCard, ModelList
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


def build_openai_router() -> APIRouter:
    router = APIRouter()

    @router.post("/v1/chat/completions")
    async def create_chat_completion(body: ChatCompletionRequest, request: Request):
        engine = current_engine(request)
        return await _respond(engine, prepare_chat(engine, body))

    @router.post("/v1/completions")
    async def create_completion(body: CompletionRequest, request: Request):
        engine = current_engine(request)
        return await _respond(engine, prepare_completion(engine, body))

    @router.get("/v1/models")
    async def list_models(request: Request) -> ModelList:
        engine = current_engine(request)
        return ModelList(data=[ModelCard(id=engine.model_id, max_model_len=engine.max_context_length)])

    @router.get("/metrics")
    async def metrics(request: Request) -> Response:
        registry: CollectorRegistry = request.app.state.metrics.registry
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    return router


async def _respond(engine: GenerationEngine, prepared: PreparedRequest):
    generation = TextGeneration(engine, prepared)
    if prepared.stream:
        return EventSourceResponse(stream_events(generation), ping=15)
    return await complete_response(generation)
