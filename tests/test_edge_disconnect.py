"""A client that disconnects mid-stream stops the generation: drafting stops, the verifier's
session and KV cache are freed, and the edge no longer counts the request as active.

The stream asks for 1500 tokens (seconds of work) and is closed after its first chunks, so the
generation is still running when the client goes away. Waits are bounded polls, not timings.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

import httpx
import pytest

from edge_support import edge_app, metric_value, verifier_app
from gateway.model import ModelDescription
from servers import serve, wait_until
from verifier_service.app import create_app as create_verifier_app
from verifier_service.backends import create_backend
from verifier_service.backends.base import BlockToVerify, BlockVerdict, VerifierBackend
from verifier_service.settings import VerifierSettings

MAX_TOKENS = 1500
CHUNKS_BEFORE_CLOSING = 3


@dataclass(frozen=True)
class Disconnect:
    generated_before: float
    generated_after: float
    drafted_once_idle: float
    drafted_a_moment_later: float


@pytest.fixture(scope="module")
def servers(tiny_pair):
    verifier = verifier_app(tiny_pair)
    with serve(verifier) as verifier_url, serve(edge_app(tiny_pair, verifier_url, draft_length="3")) as edge_url:
        yield verifier, edge_url


@pytest.fixture(scope="module")
def disconnect(servers) -> Disconnect:
    """Stream, read the first chunks, close the connection, then wait for the edge to go idle."""
    _, edge_url = servers
    generated_before = metric_value(edge_url, "spade_edge_generated_tokens_total")
    body = {"model": "target", "prompt": "The edge drafts", "max_tokens": MAX_TOKENS, "temperature": 0, "stream": True}
    with httpx.stream("POST", edge_url + "/v1/completions", json=body, timeout=60) as response:
        lines = response.iter_lines()
        chunks = 0
        while chunks < CHUNKS_BEFORE_CLOSING:
            chunks += next(lines).startswith("data:")
    wait_until(lambda: metric_value(edge_url, "spade_edge_active_requests") == 0)
    drafted = metric_value(edge_url, "spade_edge_drafted_tokens_total")
    time.sleep(0.5)  # a generation still drafting would draft hundreds of tokens meanwhile
    return Disconnect(
        generated_before=generated_before,
        generated_after=metric_value(edge_url, "spade_edge_generated_tokens_total"),
        drafted_once_idle=drafted,
        drafted_a_moment_later=metric_value(edge_url, "spade_edge_drafted_tokens_total"),
    )


def test_the_edge_counts_no_active_request_after_the_client_left(servers, disconnect):
    _, edge_url = servers
    assert metric_value(edge_url, "spade_edge_active_requests") == 0


def test_the_draft_session_of_a_client_that_left_is_closed_and_its_cache_retained(servers, disconnect):
    """The drafter's gauges (what the chaos run watches for leaks): no live draft session once
    idle; the abandoned request's cache kept as one retained prefix, within the token bound."""
    _, edge_url = servers
    assert metric_value(edge_url, "spade_edge_draft_sessions") == 0
    assert metric_value(edge_url, "spade_edge_draft_retained_sessions") >= 1
    assert 0 < metric_value(edge_url, "spade_edge_draft_retained_tokens") <= 4096


def test_the_generation_ended_long_before_its_budget(disconnect):
    assert disconnect.generated_after - disconnect.generated_before < MAX_TOKENS / 2


def test_drafting_stops(disconnect):
    assert disconnect.drafted_a_moment_later == disconnect.drafted_once_idle


def test_the_verifier_session_is_freed(servers, disconnect):
    verifier, _ = servers
    assert wait_until(lambda: len(verifier.state.service.sessions) == 0)


def test_the_verifier_kv_cache_is_freed(servers, disconnect):
    verifier, _ = servers
    assert wait_until(lambda: verifier.state.service.backend.num_cached_sessions == 0)


# A client that leaves while the first verify call is in flight ----------------------------------


class HeldVerifyBackend(VerifierBackend):
    """The real backend, each verify call held for a while first: a wide window in which the
    edge's call is in flight and no answer has come back."""

    name = "held"

    def __init__(self, inner: VerifierBackend, hold_s: float) -> None:
        self.inner = inner
        self.hold_s = hold_s

    @property
    def model(self) -> ModelDescription:
        return self.inner.model

    @property
    def tokenizer(self):
        return self.inner.tokenizer

    async def verify_block(self, block: BlockToVerify) -> BlockVerdict:
        await asyncio.sleep(self.hold_s)
        return await self.inner.verify_block(block)

    def release_session(self, session_id: str, retain: bool = True) -> None:
        self.inner.release_session(session_id)

    async def aclose(self) -> None:
        await self.inner.aclose()


@pytest.fixture(scope="module")
def held_verifier_left_during_the_first_call(tiny_pair):
    """Stream, and close the connection once the verifier holds the session of the first call
    (before any answer); returns the verifier app."""

    async def held_backend(settings: VerifierSettings) -> VerifierBackend:
        return HeldVerifyBackend(await create_backend(settings), hold_s=0.5)

    verifier = create_verifier_app(VerifierSettings(model=str(tiny_pair.target_dir)), held_backend)
    with serve(verifier) as verifier_url, serve(edge_app(tiny_pair, verifier_url, draft_length="3")) as edge_url:
        body = {"model": "target", "prompt": "The edge drafts", "max_tokens": 200, "temperature": 0, "stream": True}
        with httpx.stream("POST", edge_url + "/v1/completions", json=body, timeout=60):
            assert wait_until(lambda: len(verifier.state.service.sessions) == 1)
        wait_until(lambda: metric_value(edge_url, "spade_edge_active_requests") == 0)
        yield verifier


def test_leaving_during_the_first_verify_call_frees_the_verifier_session(held_verifier_left_during_the_first_call):
    # Regression: the edge ended a session only after an answer, so this one stayed for the TTL.
    verifier = held_verifier_left_during_the_first_call
    assert wait_until(lambda: len(verifier.state.service.sessions) == 0)


def test_leaving_during_the_first_verify_call_frees_the_verifier_kv_cache(held_verifier_left_during_the_first_call):
    backend = held_verifier_left_during_the_first_call.state.service.backend.inner
    assert wait_until(lambda: backend.num_cached_sessions == 0)
