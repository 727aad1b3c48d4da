"""Helpers shared by the edge agent's end-to-end tests: apps on the tiny pair, raw SSE reading,
Prometheus samples, and bounded polling."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass

import httpx
from prometheus_client.parser import text_string_to_metric_families

from edge_agent.app import build_engine
from edge_agent.app import create_app as create_edge_app
from edge_agent.engine import SpeculativeEngine
from edge_agent.metrics import EdgeMetrics
from edge_agent.settings import EdgeSettings
from gateway.engine import GenerationRequest
from gateway.protocol import SpadeStats
from spade_core.params import SamplingConfig
from verifier_service.app import create_app as create_verifier_app
from verifier_service.settings import VerifierSettings

DONE = "[DONE]"
GREEDY = SamplingConfig(temperature=0.0)


def verifier_app(pair, **settings):
    return create_verifier_app(VerifierSettings(model=str(pair.target_dir), **settings))


def edge_app(pair, verifier_url: str, draft_length: str | int = "3", **settings):
    return create_edge_app(
        EdgeSettings(draft_model=str(pair.draft_dir), verifier_url=verifier_url, draft_length=str(draft_length), **settings)
    )


@dataclass(frozen=True)
class EdgeGeneration:
    prompt_ids: list[int]
    eos_token_ids: frozenset[int]
    """The request's end tokens."""
    token_ids: list[int]
    stats: SpadeStats


async def generate_once(
    settings: EdgeSettings,
    prompt: str,
    max_tokens: int,
    sampling: SamplingConfig = GREEDY,
    stop_ids: frozenset[int] | None = None,
    transport: httpx.AsyncBaseTransport | None = None,
) -> EdgeGeneration:
    """One request, to its end, through an edge engine built for it (its verifier client over
    ``transport``, the real HTTP one by default), closed after: the DELETEs that end its sessions
    are awaited. ``stop_ids``: the request's end tokens (None: the model's)."""
    engine = await build_engine(settings, EdgeMetrics(), transport=transport)
    prompt_ids = engine.tokenizer.encode(prompt)
    eos = engine.model.eos_token_ids if stop_ids is None else stop_ids
    request, stats = GenerationRequest("edge-test", prompt_ids, max_tokens, sampling, eos), SpadeStats()
    try:
        token_ids = [token async for batch in engine.generate(request, stats) for token in batch.token_ids]
    finally:
        await engine.aclose()
    return EdgeGeneration(prompt_ids, eos, token_ids, stats)


def sse_payloads(lines) -> list[str]:
    """The ``data:`` payloads of an SSE stream, in order (comments and blank lines dropped)."""
    return [line.removeprefix("data:").strip() for line in lines if line.startswith("data:")]


def stream_payloads(base_url: str, path: str, body: dict) -> list[str]:
    """POST a streamed request and return every ``data:`` payload, [DONE] included."""
    with httpx.stream("POST", base_url + path, json=body | {"stream": True}, timeout=60) as response:
        response.raise_for_status()
        return sse_payloads(response.iter_lines())


def json_chunks(payloads: list[str]) -> list[dict]:
    return [json.loads(payload) for payload in payloads if payload != DONE]


def metric_value(base_url: str, sample_name: str) -> float:
    """One sample of the service's /metrics, e.g. ``spade_edge_requests_total``."""
    text = httpx.get(base_url + "/metrics", timeout=10).text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == sample_name:
                return sample.value
    raise KeyError(f"{sample_name} not in {base_url}/metrics")


class RecordingTransport(httpx.ASGITransport):
    """Calls an ASGI app in this process and remembers the verify calls' bodies and session ids."""

    def __init__(self, app) -> None:
        super().__init__(app=app)
        self.session_ids: list[str] = []
        self.verify_bodies: list[dict] = []

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/verify":
            body = json.loads(request.content)
            self.verify_bodies.append(body)
            if body["session_id"] not in self.session_ids:
                self.session_ids.append(body["session_id"])
        return await super().handle_async_request(request)


@dataclass
class InProcessStack:
    engine: SpeculativeEngine
    verifier: object
    """The verifier's FastAPI app (its service at ``verifier.state.service``)."""
    transport: RecordingTransport
    metrics: EdgeMetrics
    """The engine's metrics (what the edge's /metrics would show)."""


@contextlib.asynccontextmanager
async def in_process_engine(
    pair, draft_length: str = "3", edge_settings: dict | None = None, transport_class=None, **verifier_settings
) -> AsyncIterator[InProcessStack]:
    """The edge's speculative engine over a verifier app in this process: the same engine and
    verifier code as the servers, with the HTTP hop replaced by an ASGI transport
    (``transport_class``, a RecordingTransport by default). ``edge_settings`` are EdgeSettings
    fields beyond the draft length."""
    verifier = verifier_app(pair, **verifier_settings)
    async with verifier.router.lifespan_context(verifier):
        await asyncio.wait_for(_loaded(verifier), timeout=120)
        transport = (transport_class or RecordingTransport)(verifier)
        settings = EdgeSettings(
            draft_model=str(pair.draft_dir), verifier_url="http://verifier", draft_length=draft_length, **(edge_settings or {})
        )
        metrics = EdgeMetrics()
        engine = await build_engine(settings, metrics, transport=transport)
        try:
            yield InProcessStack(engine, verifier, transport, metrics)
        finally:
            await engine.aclose()


async def _loaded(verifier) -> None:
    while verifier.state.service is None:  # the verifier loads its model in the background
        await asyncio.sleep(0.01)
