"""Helpers for the OpenAI layer's tests over a scripted engine: the shared routes mounted on a
bare app, as both services mount them."""

from __future__ import annotations

from fastapi import FastAPI

from gateway.errors import install_error_handlers
from gateway.routes import build_openai_router


def gateway_app(engine) -> FastAPI:
    """The OpenAI routes and the error envelope over ``engine`` (None: still loading)."""
    app = FastAPI()
    install_error_handlers(app)
    app.include_router(build_openai_router())
    app.state.engine = engine
    return app
