"""Start-up of the edge agent: it serves only once the draft is loaded and the verifier is
checked, refuses a verifier it cannot work with instead of serving errors, and adopts the
verifier's limits on what one verify call may carry."""

from __future__ import annotations

import socket

import httpx
import pytest

from edge_agent.app import build_engine
from edge_agent.metrics import EdgeMetrics
from edge_agent.settings import EdgeSettings
from edge_agent.verifier_client import TokenizerMismatchError
from edge_support import edge_app, verifier_app
from gateway.errors import ServiceUnavailableError
from servers import serve


@pytest.fixture(scope="module")
def other_tokenizer_verifier_url(other_tokenizer_pair):
    with serve(verifier_app(other_tokenizer_pair)) as url:
        yield url


@pytest.fixture
def dead_url() -> str:
    """A loopback URL nothing listens on: a port the OS just handed out, then closed."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    return f"http://127.0.0.1:{port}"


async def test_a_verifier_with_another_tokenizer_stops_the_start_up(tiny_pair, other_tokenizer_verifier_url):
    app = edge_app(tiny_pair, other_tokenizer_verifier_url)
    with pytest.raises(TokenizerMismatchError):
        async with app.router.lifespan_context(app):
            pass


async def test_the_tokenizer_refusal_names_the_problem(tiny_pair, other_tokenizer_verifier_url):
    settings = EdgeSettings(draft_model=str(tiny_pair.draft_dir), verifier_url=other_tokenizer_verifier_url)
    with pytest.raises(TokenizerMismatchError, match="different tokenizer than the draft model"):
        await build_engine(settings, EdgeMetrics())


async def test_a_refused_start_up_leaves_the_app_without_an_engine(tiny_pair, other_tokenizer_verifier_url):
    app = edge_app(tiny_pair, other_tokenizer_verifier_url)
    with pytest.raises(TokenizerMismatchError):
        async with app.router.lifespan_context(app):
            pass
    assert app.state.engine is None


async def test_an_unreachable_verifier_gives_service_unavailable_naming_its_url(tiny_pair, dead_url):
    app = edge_app(tiny_pair, dead_url, startup_timeout_s=0.5)
    with pytest.raises(ServiceUnavailableError, match=f"verifier at {dead_url} not ready"):
        async with app.router.lifespan_context(app):
            pass


async def test_a_verifier_with_the_same_tokenizer_is_accepted_and_its_model_adopted_whole(tiny_pair):
    """One description of the served model: the verifier's backend produces it, its /health
    carries it, and the edge serves under exactly that (id, limits, end tokens, logprobs)."""
    verifier = verifier_app(tiny_pair, served_model_name="served-target", max_context_length=80)
    with serve(verifier) as verifier_url:
        app = edge_app(tiny_pair, verifier_url)
        async with app.router.lifespan_context(app):
            adopted = app.state.engine.model
        assert adopted == verifier.state.service.backend.model
    assert (adopted.model_id, adopted.max_context_length, adopted.logprobs_support) == ("served-target", 80, "all")


@pytest.fixture(scope="module")
def strict_verifier_edge(tiny_pair):
    """An edge configured for blocks of 8 with 32-token distributions, in front of a verifier
    that accepts at most 2 drafted tokens of at most 4 tokens' support per call."""
    verifier = verifier_app(tiny_pair, max_draft_length=2, max_draft_support=4)
    with serve(verifier) as verifier_url, serve(edge_app(tiny_pair, verifier_url, "8", max_draft_support=32)) as edge_url:
        yield edge_url


def _sampled(edge_url: str) -> httpx.Response:
    body = {"model": "target", "prompt": "The edge drafts", "max_tokens": 12, "temperature": 1.0, "seed": 3}
    return httpx.post(edge_url + "/v1/completions", json=body, timeout=60)


def test_the_edge_drafts_within_the_verifiers_support_limit(strict_verifier_edge):
    # Regression: the edge sent its own 32-token distributions and every sampled request got a 500.
    response = _sampled(strict_verifier_edge)
    assert (response.status_code, response.json()["usage"]["completion_tokens"]) == (200, 12)


def test_the_edge_drafts_within_the_verifiers_block_limit(strict_verifier_edge):
    spade = _sampled(strict_verifier_edge).json()["spade"]
    assert spade["drafted_tokens"] <= 2 * spade["verify_calls"]
