"""The edge agent's FastAPI app: the shared OpenAI routes over speculative decoding, plus
/health and /metrics.

At start-up it loads the draft model, waits for the verifier's /health and refuses (start-up
fails with a clear message) a verifier whose tokenizer differs from the draft's."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from edge_agent.draft_length import parse_draft_length
from edge_agent.drafter import ModelDrafter
from edge_agent.engine import SpeculativeEngine, TargetDescription
from edge_agent.metrics import EdgeMetrics
from edge_agent.settings import EdgeSettings
from edge_agent.verifier_client import VerifierClient, check_tokenizer
from gateway.errors import install_error_handlers
from gateway.routes import build_openai_router
from spade_models.loader import LoadedModel, ModelSource, load_model, tokenizer_fingerprint

logger = logging.getLogger(__name__)

DraftLoader = Callable[[EdgeSettings], Awaitable[LoadedModel]]


async def load_draft(settings: EdgeSettings) -> LoadedModel:
    source = ModelSource(settings.draft_model, settings.gguf_file)
    return await asyncio.to_thread(load_model, source, settings.device, settings.dtype)


async def build_engine(
    settings: EdgeSettings,
    metrics: EdgeMetrics,
    draft_loader: DraftLoader = load_draft,
    transport: httpx.AsyncBaseTransport | None = None,
) -> SpeculativeEngine:
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
    except BaseExceptionGroup as group_error:
        await client.aclose()
        raise group_error.exceptions[0] from None
    except BaseException:
        await client.aclose()
        raise
    # The verifier refuses distributions wider than its limit: draft within both.
    max_support = min(settings.max_draft_support, health.max_draft_support)
    drafter = ModelDrafter(draft, max_support=max_support, vocab_limit=health.vocab_size)
    draft_length = parse_draft_length(settings.draft_length, settings.max_draft_length)
    logger.info(
        "edge ready: drafting with %s for %s at %s (draft length %s)",
        draft.model_id, health.model, settings.verifier_url, settings.draft_length,
    )
    target = TargetDescription.from_health(health)
    return SpeculativeEngine(drafter, draft.tokenizer, client, target, draft_length, metrics, settings.fallback == "draft")


def create_app(settings: EdgeSettings, draft_loader: DraftLoader = load_draft) -> FastAPI:
    """Start-up completes only once the draft is loaded and the verifier is checked, so a
    mismatched or unreachable verifier stops the service instead of serving errors."""

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        app.state.engine = await build_engine(settings, app.state.metrics, draft_loader)
        try:
            yield
        finally:
            await app.state.engine.aclose()

    app = FastAPI(title="SPADE edge agent", lifespan=lifespan)
    app.state.settings = settings
    app.state.metrics = EdgeMetrics()
    app.state.engine = None
    install_error_handlers(app)
    app.include_router(build_openai_router())

    @app.get("/health")
    async def health(request: Request) -> JSONResponse:
        engine: SpeculativeEngine | None = request.app.state.engine
        if engine is None:
            return JSONResponse({"status": "loading"}, status_code=503)
        return JSONResponse({
            "status": "ok",
            "verifier": "ok" if engine.verifier_reachable else "unreachable",
            "fallback": settings.fallback,
            "model": engine.model_id,
            "draft_model": settings.draft_model,
            "verifier_url": settings.verifier_url,
            "draft_length": settings.draft_length,
        })

    return app
