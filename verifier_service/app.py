"""The verifier's FastAPI app: verify API, sessions, health, and the shared OpenAI routes
(target-only decoding). Route handlers parse, call the service, return."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from typing import Literal

from fastapi import FastAPI, Query, Request
from fastapi.responses import JSONResponse, Response
from sse_starlette import EventSourceResponse

from gateway.errors import ServiceUnavailableError, install_error_handlers
from gateway.guards import install_guards
from gateway.openapi import error_responses
from gateway.routes import build_openai_router
from gateway.security import caller_key_id, is_trusted_caller
from verifier_service.audit import AuditLog
from verifier_service.backends import create_backend, pipelined_session_type
from verifier_service.backends.base import VerifierBackend
from verifier_service.kv_budget import KvBudget, RetainedKv
from verifier_service.metrics import VerifierMetrics
from verifier_service.pipeline import PipelineSessions
from verifier_service.pipeline_protocol import PipelineClosed, PipelineOpen, PipelineOpened, PipelineProposal
from verifier_service.protocol import (
    WIRE_VERSION,
    HealthStatus,
    SessionDeleted,
    VerifierHealth,
    VerifyRequest,
    VerifyResponse,
    health_fields,
)
from verifier_service.service import VerifierService
from verifier_service.sessions import SessionRegistry
from verifier_service.settings import VerifierSettings
from verifier_service.target_engine import create_target_engine

logger = logging.getLogger(__name__)

BackendFactory = Callable[[VerifierSettings], Awaitable[VerifierBackend]]


def create_app(settings: VerifierSettings, backend_factory: BackendFactory = create_backend) -> FastAPI:
    """The app loads its backend in the background at start-up; /health says "loading" (503)
    until then, and every model route answers 503."""

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        loading = asyncio.create_task(_load(app, settings, backend_factory))
        sweeping = asyncio.create_task(_sweep_expired_sessions(app, sweep_interval_s(settings.session_ttl_s)))
        try:
            yield
        finally:
            loading.cancel()
            sweeping.cancel()
            service: VerifierService | None = app.state.service
            if app.state.pipeline is not None:
                await app.state.pipeline.aclose()
            if service is not None:
                await service.backend.aclose()
                if service.audit is not None:
                    service.audit.close()

    app = FastAPI(title="SPADE verifier", lifespan=lifespan)
    app.state.settings = settings
    app.state.metrics = VerifierMetrics()
    app.state.service = None
    app.state.engine = None
    app.state.pipeline = None
    app.state.unlogged_paths = ("/v1/verify", "*/proposals")  # successful ones: see gateway.cli.QuietAccessLog
    install_error_handlers(app)
    install_guards(app, settings, settings.host)
    app.include_router(build_openai_router())
    _add_verifier_routes(app)
    if settings.pipelined_sessions:
        _add_pipeline_routes(app)
    return app


async def _load(app: FastAPI, settings: VerifierSettings, backend_factory: BackendFactory) -> None:
    try:
        backend = await backend_factory(settings)
    except Exception:
        logger.exception("loading the target model failed")
        raise
    backend.observe_forwards(app.state.metrics.observe_model_forward)
    retained = backend if isinstance(backend, RetainedKv) else None
    sessions = SessionRegistry(settings.session_limits(), _kv_budget(backend, settings), retained)
    audit = None if settings.audit_log is None else AuditLog(settings.audit_log)
    app.state.service = VerifierService(backend, sessions, settings.verify_limits(), app.state.metrics, settings.prefix_sharing, audit)
    if settings.pipelined_sessions:
        app.state.pipeline = PipelineSessions(
            backend,
            settings.pipeline_limits(),
            app.state.metrics,
            settings.prefix_sharing,
            kv=app.state.service,
            session_type=pipelined_session_type(backend),
        )
    route = settings.target_only_route()
    app.state.engine = create_target_engine(backend, route, app.state.metrics, settings.prefix_sharing)
    logger.info("verifier ready: %s (%s backend, target-only route %s)", backend.model.model_id, backend.name, route)


def sweep_interval_s(session_ttl_s: float) -> float:
    """How often idle sessions past their TTL are dropped when no call comes to drop them: a
    quarter of the TTL, at most a minute."""
    return min(60.0, session_ttl_s / 4)


async def _sweep_expired_sessions(app: FastAPI, interval_s: float) -> None:
    """Drop sessions idle past their TTL, and free their KV cache, even on a verifier no call
    reaches any more (an edge that died mid-request never deletes its session)."""
    while True:
        await asyncio.sleep(interval_s)
        service: VerifierService | None = app.state.service
        if service is not None:
            service.drop_expired_sessions()
        if app.state.pipeline is not None:
            app.state.pipeline.drop_idle()


def _kv_budget(backend: VerifierBackend, settings: VerifierSettings) -> KvBudget | None:
    """The byte budget of the backend's per-session caches (vLLM manages its own KV memory)."""
    bytes_per_token = getattr(backend, "kv_bytes_per_token", None)
    if bytes_per_token is None:
        return None
    return KvBudget.for_model(bytes_per_token, backend.model.max_context_length, settings.max_kv_cache_bytes)


def current_service(request: Request) -> VerifierService:
    service = request.app.state.service
    if service is None:
        raise ServiceUnavailableError("the target model is still loading; retry when /health reports ok")
    return service


def preferred_wire(serves_pipelined_sessions: bool, backend: VerifierBackend) -> Literal["verify", "pipelined"]:
    """``/health``'s ``preferred_wire``: the pipelined-session wire where this verifier serves it
    and its backend does better with it (``prefers_pipelined_sessions``), else the verify wire."""
    return "pipelined" if serves_pipelined_sessions and backend.prefers_pipelined_sessions else "verify"


def current_pipeline(request: Request) -> PipelineSessions:
    pipeline = request.app.state.pipeline
    if pipeline is None:
        raise ServiceUnavailableError("the target model is still loading; retry when /health reports ok")
    return pipeline


def _add_pipeline_routes(app: FastAPI) -> None:
    """The pipelined-session wire (``verifier_service.pipeline_protocol``), experimental."""

    @app.post("/v1/pipeline/sessions", status_code=201, responses=error_responses(400, 401, 429, 503))
    async def open_session(body: PipelineOpen, request: Request) -> PipelineOpened:
        return current_pipeline(request).open(body, owner=caller_key_id(request) or "")

    @app.post("/v1/pipeline/sessions/{session_id}/proposals", status_code=204, responses=error_responses(400, 401, 404, 503))
    async def propose(session_id: str, body: PipelineProposal, request: Request) -> Response:
        current_pipeline(request).propose(session_id, body, owner=caller_key_id(request) or "")
        return Response(status_code=204)

    @app.get("/v1/pipeline/sessions/{session_id}/decided", responses=error_responses(400, 401, 404, 503))
    async def decided(session_id: str, request: Request, after: int = Query(0, ge=0)) -> EventSourceResponse:
        events = current_pipeline(request).decided(session_id, after, owner=caller_key_id(request) or "")

        async def stream():
            async for event in events:
                yield {"event": "decided", "data": event.model_dump_json()}

        return EventSourceResponse(stream(), ping=15)

    @app.delete("/v1/pipeline/sessions/{session_id}", responses=error_responses(401, 404, 503))
    async def close_session(session_id: str, request: Request) -> PipelineClosed:
        return current_pipeline(request).close(session_id, owner=caller_key_id(request) or "")


def _add_verifier_routes(app: FastAPI) -> None:
    @app.post("/v1/verify", responses=error_responses(400, 401, 409, 413, 429, 503))
    async def verify(body: VerifyRequest, request: Request) -> VerifyResponse:
        return await current_service(request).verify(body, owner=caller_key_id(request) or "")

    @app.delete("/v1/sessions/{session_id}", responses=error_responses(401, 503))
    async def delete_session(session_id: str, request: Request) -> SessionDeleted:
        return current_service(request).end_session(session_id, owner=caller_key_id(request) or "")

    @app.get(
        "/health",
        response_model=VerifierHealth | HealthStatus,
        responses={503: {"model": VerifierHealth | HealthStatus, "description": "Still loading the model."}},
        description="The state, limits and served model; where keys are configured, a caller without a valid key gets the status alone.",
    )
    async def health(request: Request) -> JSONResponse:
        service: VerifierService | None = request.app.state.service
        settings: VerifierSettings = request.app.state.settings
        if not is_trusted_caller(request):
            status = HealthStatus(status="loading" if service is None else "ok")
            return JSONResponse(status.model_dump(), status_code=503 if service is None else 200)
        if service is None:
            body = VerifierHealth(
                status="loading",
                wire_version=WIRE_VERSION,
                model=settings.served_model_name or settings.model,
                vocab_size=0,
                tokenizer_fingerprint="",
                max_context_length=0,
                max_draft_length=settings.max_draft_length,
                max_draft_support=settings.max_draft_support,
                eos_token_ids=[],
                backend=settings.backend,
                logprobs_support="none",  # nothing is served while loading
            )
            return JSONResponse(body.model_dump(), status_code=503)
        body = VerifierHealth(
            status="ok",
            wire_version=WIRE_VERSION,
            **health_fields(service.backend.model),
            max_draft_length=service.limits.max_draft_length,
            max_draft_support=service.limits.max_draft_support,
            backend=service.backend.name,
            preferred_wire=preferred_wire(request.app.state.pipeline is not None, service.backend),
        )
        return JSONResponse(body.model_dump())
