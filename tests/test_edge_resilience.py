"""The edge agent when the verifier misbehaves: a lost session is resynced without changing the
output, and an outage gives the client a clear OpenAI-shaped error while the edge keeps
running and serves again once the verifier is back."""

from __future__ import annotations

import asyncio
import contextlib
import json
from dataclasses import dataclass

import httpx
import openai
import pytest

from edge_support import DONE, edge_app, in_process_engine, metric_value, verifier_app
from gateway.engine import GenerationRequest
from gateway.protocol import SpadeStats
from servers import LoopbackServer, serve, wait_until
from spade_core.params import SamplingConfig

MODEL = "target"
PROMPTS = ["The edge drafts", "def add(a, b):"]
MAX_TOKENS = 60


def _target_only_texts(verifier_url: str) -> list[str]:
    client = openai.OpenAI(base_url=verifier_url + "/v1", api_key="unused", max_retries=0)
    return [
        client.completions.create(model=MODEL, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0).choices[0].text for prompt in PROMPTS
    ]


# Session loss: the verifier forgets sessions mid-generation ------------------------------------


@dataclass(frozen=True)
class Generation:
    token_ids: list[int]
    stats: SpadeStats


async def _generate_ending_sessions_after_each_block(pair) -> tuple[Generation, Generation]:
    """The same greedy request twice: by the verifier's target-only engine, and by the edge's
    speculative engine while every verifier session is ended after each block."""
    async with in_process_engine(pair, draft_length="3") as stack:
        request = GenerationRequest(
            "lost-session",
            stack.engine.tokenizer.encode(PROMPTS[0]),
            MAX_TOKENS,
            SamplingConfig(temperature=0),
            stack.engine.model.eos_token_ids,
        )
        target_only = await _collect(stack.verifier.state.engine, request)
        service = stack.verifier.state.service
        stats = SpadeStats()
        token_ids: list[int] = []
        batches = stack.engine.generate(request, stats)
        async with contextlib.aclosing(batches):
            async for batch in batches:
                token_ids += batch.token_ids
                for session_id in stack.transport.session_ids:
                    service.end_session(session_id)
        return target_only, Generation(token_ids, stats)


async def _collect(engine, request: GenerationRequest) -> Generation:
    stats = SpadeStats()
    token_ids = [token_id async for batch in engine.generate(request, stats) for token_id in batch.token_ids]
    return Generation(token_ids, stats)


@pytest.fixture(scope="module")
def lost_sessions(tiny_pair) -> tuple[Generation, Generation]:
    return asyncio.run(_generate_ending_sessions_after_each_block(tiny_pair))


def test_output_after_lost_sessions_equals_the_target_only_output(lost_sessions):
    target_only, speculative = lost_sessions
    assert speculative.token_ids == target_only.token_ids


def test_every_call_after_a_lost_session_resyncs(lost_sessions):
    _, speculative = lost_sessions
    assert speculative.stats.resyncs == speculative.stats.verify_calls - 1


@pytest.fixture(scope="module")
def crowded_verifier(tiny_pair):
    """A verifier that keeps one session: two concurrent requests evict each other's."""
    with serve(verifier_app(tiny_pair, max_sessions=1)) as verifier_url, serve(edge_app(tiny_pair, verifier_url, "3")) as edge_url:
        yield verifier_url, edge_url


async def _stream_concurrently(edge_url: str) -> list[tuple[str, dict]]:
    client = openai.AsyncOpenAI(base_url=edge_url + "/v1", api_key="unused", max_retries=0)

    async def stream(prompt: str) -> tuple[str, dict]:
        chunks = [
            chunk
            async for chunk in await client.completions.create(
                model=MODEL,
                prompt=prompt,
                max_tokens=MAX_TOKENS,
                temperature=0,
                stream=True,
                stream_options={"include_usage": True},
            )
        ]
        return "".join(chunk.choices[0].text for chunk in chunks if chunk.choices), chunks[-1].model_extra["spade"]

    return await asyncio.gather(*(stream(prompt) for prompt in PROMPTS))


@pytest.fixture(scope="module")
def evicting_streams(crowded_verifier) -> list[tuple[str, dict]]:
    _, edge_url = crowded_verifier
    return asyncio.run(_stream_concurrently(edge_url))


def test_streams_evicting_each_others_sessions_still_give_the_target_only_output(crowded_verifier, evicting_streams):
    verifier_url, _ = crowded_verifier
    assert [text for text, _ in evicting_streams] == _target_only_texts(verifier_url)


def test_streams_evicting_each_others_sessions_resync(evicting_streams):
    assert all(spade["resyncs"] > 0 for _, spade in evicting_streams)


# Outage: the verifier stops mid-stream, then comes back at the same URL ------------------------


@dataclass(frozen=True)
class Outage:
    verifier_url: str
    reference_text: str
    stream_payloads: list[str]
    unavailable: httpx.Response
    """A non-streamed request during the outage."""
    openai_stream_error: openai.APIError | None
    health: httpx.Response
    """The edge's /health during the outage."""
    verify_failures: float
    text_once_back: str


def _read_past_the_outage(edge_url: str, verifier: LoopbackServer) -> list[str]:
    """Stream a long greedy completion, stop the verifier after the first chunk, read the rest."""
    body = {"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 1500, "temperature": 0, "stream": True}
    payloads = []
    with httpx.stream("POST", edge_url + "/v1/completions", json=body, timeout=60) as response:
        for line in response.iter_lines():
            if line.startswith("data:"):
                payloads.append(line.removeprefix("data:").strip())
                if len(payloads) == 1:
                    verifier.stop()
    return payloads


def _openai_stream_error(edge_url: str) -> openai.APIError | None:
    client = openai.OpenAI(base_url=edge_url + "/v1", api_key="unused", max_retries=0)
    try:
        list(client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=8, stream=True))
    except openai.APIError as error:
        return error
    return None


@pytest.fixture(scope="module")
def outage(tiny_pair) -> Outage:
    verifier = LoopbackServer()
    verifier_url = verifier.start(verifier_app(tiny_pair))
    try:
        # A short open circuit: after the outage the edge tries the verifier again soon.
        with serve(edge_app(tiny_pair, verifier_url, "3", verify_retries=1, circuit_open_s=1.0)) as edge_url:
            body = {"model": MODEL, "prompt": PROMPTS[0], "max_tokens": MAX_TOKENS, "temperature": 0}
            reference_text = httpx.post(edge_url + "/v1/completions", json=body, timeout=60).json()["choices"][0]["text"]
            payloads = _read_past_the_outage(edge_url, verifier)
            unavailable = httpx.post(edge_url + "/v1/completions", json=body, timeout=60)
            health = httpx.get(edge_url + "/health", timeout=10)
            stream_error = _openai_stream_error(edge_url)
            verify_failures = metric_value(edge_url, "spade_edge_verify_failures_total")
            verifier.start(verifier_app(tiny_pair))
            wait_until(lambda: httpx.get(edge_url + "/health", timeout=10).json()["verifier"] == "ok")
            text_once_back = httpx.post(edge_url + "/v1/completions", json=body, timeout=60).json()["choices"][0]["text"]
    finally:
        verifier.stop()
    return Outage(verifier_url, reference_text, payloads, unavailable, stream_error, health, verify_failures, text_once_back)


def test_a_stream_cut_by_an_outage_ends_with_an_error_event_then_done(outage):
    assert [outage.stream_payloads[-1], list(json.loads(outage.stream_payloads[-2]))] == [DONE, ["error"]]


def test_the_in_band_error_is_service_unavailable_naming_no_internal_address(outage):
    error = json.loads(outage.stream_payloads[-2])["error"]
    assert (error["type"], error["code"], error["message"].startswith("the verifier is unavailable (")) == (
        "service_unavailable_error",
        "verifier_unavailable",
        True,
    )
    address = outage.verifier_url.removeprefix("http://")
    assert address not in error["message"] and address not in outage.unavailable.text


def test_a_request_during_the_outage_is_503_in_the_openai_envelope(outage):
    error = outage.unavailable.json()["error"]
    assert (outage.unavailable.status_code, error["type"], error["code"]) == (503, "service_unavailable_error", "verifier_unavailable")


def test_the_openai_client_raises_the_in_band_error_of_a_stream(outage):
    assert outage.openai_stream_error.message.startswith("the verifier is unreachable")


def test_the_edge_stays_up_and_reports_the_verifier_unreachable_with_503(outage):
    # 503 takes the edge out of a load balancer's rotation while it cannot serve (--fallback error).
    assert (outage.health.status_code, outage.health.json()["status"], outage.health.json()["verifier"]) == (503, "degraded", "unreachable")


def test_each_failed_generation_counts_one_verify_failure(outage):
    assert outage.verify_failures == 3


def test_the_edge_serves_again_once_the_verifier_is_back(outage):
    assert outage.text_once_back == outage.reference_text
