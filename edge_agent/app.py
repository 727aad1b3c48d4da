"""The edge agent's FastAPI app: the shared OpenAI routes over speculative decoding, plus
/health and /metrics.

At start-up it loads the draft model, waits for the verifier's /health and refuses (start-up
fails with a clear message) a verifier of another wire version or whose tokenizer differs from
the draft's."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Coroutine
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from edge_agent.draft_backend import build_drafter, draft_backend_name, load_draft_model
from edge_agent.engine import EngineOptions, ServedModel, SpeculativeEngine
from edge_agent.health import EdgeHealth, VerifierProbe, health_status
from edge_agent.llamacpp_drafter import LlamaCppDraftModel
from edge_agent.metrics import EdgeMetrics
from edge_agent.pipelined_engine import PipelinedEngine, chosen_wire
from edge_agent.settings import EdgeSettings
from edge_agent.tuning import TUNING
from edge_agent.verifier_client import VerifierClient, VerifierState, check_tokenizer
from gateway.errors import install_error_handlers
from gateway.guards import default_trusted_hosts, install_guards
from gateway.routes import build_openai_router
from gateway.security import is_keyed_caller, is_trusted_caller
from spade_models.loader import LoadedModel, tokenizer_fingerprint
from verifier_service.protocol import described_model

logger = logging.getLogger(__name__)

DraftLoader = Callable[[EdgeSettings], Coroutine[Any, Any, LoadedModel | LlamaCppDraftModel]]


async def load_draft(settings: EdgeSettings) -> LoadedModel | LlamaCppDraftModel:
    """The draft, opened by the runtime --draft-backend picks (llama.cpp or transformers)."""
    return await asyncio.to_thread(load_draft_model, settings)


async def build_engine(
    settings: EdgeSettings,
    metrics: EdgeMetrics,
    draft_loader: DraftLoader = load_draft,
    transport: httpx.AsyncBaseTransport | None = None,
) -> SpeculativeEngine | PipelinedEngine:
    """Load the draft, check the verifier, build the engine. ``transport`` replaces the HTTP
    hop (tests run the verifier app in-process through an ASGI transport)."""
    client = VerifierClient(settings.verifier_url, settings.client_settings(), transport=transport)
    try:
        # Load the draft while waiting for the verifier; if either fails the other is cancelled.
        async with asyncio.TaskGroup() as group:
            loading = group.create_task(draft_loader(settings))
            waiting = group.create_task(client.wait_until_ready(settings.startup_timeout_s))
        draft, health = loading.result(), waiting.result()
        check_tokenizer(health, tokenizer_fingerprint(draft.tokenizer))
        # Within the verifier's limits (vocabulary, distribution width, context); a llama.cpp
        # context is allocated here, which takes a second or two for a long one.
        drafter = await asyncio.to_thread(build_drafter, draft, settings, health)
    except BaseExceptionGroup as group_error:
        await client.aclose()
        raise group_error.exceptions[0] from None
    except BaseException:
        await client.aclose()
        raise
    # The verifier's limit caps the draft length once, here: the engine never drafts past it.
    policy = settings.draft_length_policy().within(health.max_draft_length)
    logger.info(
        "edge ready: drafting with %s (%s) for %s at %s (draft length %s)",
        draft.model_id,
        draft_backend_name(draft),
        health.model,
        settings.verifier_url,
        settings.draft_length,
    )
    options = EngineOptions(
        policy,
        settings.draft_ahead_policy(),
        fallback_to_draft=settings.fallback == "draft",
        overlap=settings.overlap,
        prefill_first=settings.prefill_first,
        max_continued_tokens=settings.max_continued_tokens,
    )
    metrics.watch_drafter(drafter)
    engine = SpeculativeEngine(drafter, client, ServedModel(described_model(health), draft.tokenizer), metrics, options)
    wire = chosen_wire(settings.verifier_wire, health)
    logger.info("speaking the %s wire to the verifier (--verifier-wire %s)", wire, settings.verifier_wire)
    if wire == "pipelined":
        return PipelinedEngine(engine, drafter, client.pipeline_client(), metrics, engine.draft_executor, TUNING.pipeline_lead_tokens)
    return engine


def create_app(settings: EdgeSettings, draft_loader: DraftLoader = load_draft) -> FastAPI:
    """Start-up completes only once the draft is loaded and the verifier is checked, so a
    mismatched or unreachable verifier stops the service instead of serving errors."""

    async def loading_and_recording_backend(draft_settings: EdgeSettings) -> LoadedModel | LlamaCppDraftModel:
        draft = await draft_loader(draft_settings)
        app.state.draft_backend = draft_backend_name(draft)
        return draft

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        app.state.engine = await build_engine(settings, app.state.metrics, loading_and_recording_backend)
        app.state.probe = VerifierProbe(VerifierClient(settings.verifier_url, settings.client_settings()))
        try:
            yield
        finally:
            await app.state.probe.aclose()
            await app.state.engine.aclose()

    app = FastAPI(title="SPADE edge agent", lifespan=lifespan)
    app.state.settings = settings
    app.state.metrics = EdgeMetrics()
    app.state.engine = None
    app.state.draft_backend = None
    install_error_handlers(app)
    install_guards(app, settings, settings.host, default_trusted_hosts(settings.host, settings.trusted_hosts))
    app.include_router(build_openai_router())

    @app.get(
        "/health",
        response_model=EdgeHealth,
        response_model_exclude_none=True,
        responses={503: {"model": EdgeHealth, "description": "Loading, or the verifier cannot be used (without --fallback draft)."}},
    )
    async def health(request: Request) -> JSONResponse:
        engine: SpeculativeEngine | None = request.app.state.engine
        if engine is None:
            return JSONResponse(EdgeHealth(status="loading").model_dump(exclude_none=True), status_code=503)
        verifier: VerifierState = await request.app.state.probe.state() if engine.verifier_reachable else "unreachable"
        status, status_code = health_status(verifier, settings.fallback)
        if not is_trusted_caller(request):  # keys configured, none presented: the status alone
            return JSONResponse(EdgeHealth(status=status).model_dump(exclude_none=True), status_code=status_code)
        internals = is_keyed_caller(request)  # addresses and paths: never for a caller without a key
        body = EdgeHealth(
            status=status,
            verifier=verifier,
            fallback=settings.fallback,
            model=engine.model.model_id,
            draft_model=settings.draft_model if internals else None,
            draft_backend=request.app.state.draft_backend,
            verifier_url=settings.verifier_url if internals else None,
            draft_length=settings.draft_length,
            overlap=settings.overlap,
            prefill_first=engine.prefill_first,
        )
        return JSONResponse(body.model_dump(exclude_none=True), status_code=status_code)

    return app
