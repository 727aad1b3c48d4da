"""Every verdict is checked before the edge emits a token of it: ``verdict_digest`` binds the
verdict to its call and to the committed context after it, both sides compute it the same way,
and an answer that fails (rewritten, garbled, foreign, a 5xx) is treated as lost: retried, then
resynced from the edge's own context, never emitted. (The loopback proxy version, with every
kind of fault over 200+ requests, is tests/test_link_faults.py.)"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time

import httpx
import pytest

from edge_agent.verifier_client import SessionLostError, UntrustedAnswerError, VerifierProtocolError, checked_verdict
from edge_support import RecordingTransport, in_process_engine
from gateway.engine import GenerationRequest
from gateway.errors import RequestTooLargeError, ServiceUnavailableError, classify
from gateway.protocol import SpadeStats
from spade_core.params import SamplingConfig
from verifier_service.protocol import UNDIGESTED_FIELDS, VerifyRequest, VerifyResponse, VerifyTimings, context_digest, verdict_digest

CONTEXT = [5, 6, 7, 8]
BLOCK = [9, 10, 11]


def _request() -> VerifyRequest:
    return VerifyRequest(session_id="s", prefix_length=4, prefix_digest=context_digest(CONTEXT), draft_tokens=BLOCK, num_top_logprobs=None)


def _sealed(request: VerifyRequest, **fields) -> VerifyResponse:
    verdict = VerifyResponse(
        session_id="s",
        num_accepted=2,
        next_token=42,
        next_token_kind="correction",
        context_length=7,
        num_target_tokens=4,
        advised_draft_length=64,
        timings=VerifyTimings(queue_ms=0.1, forward_ms=2.5, total_ms=3.25),
    ).model_copy(update=fields)
    emitted = request.draft_tokens[: verdict.num_accepted] + [verdict.next_token]
    return verdict.model_copy(update={"verdict_digest": verdict_digest(request.fingerprint(), verdict, context_digest(CONTEXT + emitted))})


def _answer(verdict: VerifyResponse | bytes, status: int = 200) -> httpx.Response:
    content = verdict if isinstance(verdict, bytes) else verdict.model_dump_json().encode()
    return httpx.Response(status, content=content)


def _check(response: httpx.Response, request: VerifyRequest | None = None, context: list[int] = CONTEXT) -> VerifyResponse:
    request = request or _request()
    verdict, committed_digest = checked_verdict(response, request, request.fingerprint(), context)
    assert committed_digest == context_digest(context + request.draft_tokens[: verdict.num_accepted] + [verdict.next_token])
    return verdict


def test_a_sealed_verdict_passes_and_a_replayed_one_too():
    verdict = _sealed(_request())
    assert [_check(_answer(verdict)), _check(_answer(verdict.model_copy(update={"replayed": True}))).replayed] == [verdict, True]


@pytest.mark.parametrize("name", sorted(set(VerifyResponse.model_fields) - UNDIGESTED_FIELDS))
def test_the_digest_covers_every_field_of_the_verdict(name):
    # Generic over VerifyResponse's fields: a field added later is covered without edits here.
    request = _request()
    verdict = _sealed(request)
    changed_values = {
        "session_id": "t",
        "num_accepted": 1,
        "next_token": 43,
        "next_token_kind": "bonus",
        "logprobs": [-0.5],
        "top_logprobs": [],
        "context_length": 8,
        "num_target_tokens": 5,
        "timings": VerifyTimings(queue_ms=0.1, forward_ms=2.5, total_ms=3.5),
    }
    changed = verdict.model_copy(update={name: changed_values.get(name, _another(getattr(verdict, name)))})
    assert verdict_digest(request.fingerprint(), changed, "c") != verdict_digest(request.fingerprint(), verdict, "c")


def _another(value):
    """A value other than ``value`` of its kind (for a field added to VerifyResponse later)."""
    if isinstance(value, bool):
        return not value
    if isinstance(value, int | float):
        return value + 1
    if isinstance(value, str):
        return value + "x"
    return 1 if value is None else None


@pytest.mark.parametrize(
    "spoil",
    [
        {"next_token": 43},
        {"num_accepted": 3},
        {"num_accepted": 1},
        {"context_length": 8},
        {"verdict_digest": ""},
    ],
    ids=lambda spoil: "-".join(spoil),
)
def test_a_rewritten_verdict_is_untrusted(spoil):
    with pytest.raises(UntrustedAnswerError):
        _check(_answer(_sealed(_request()).model_copy(update=spoil)))


def test_a_verdict_of_another_call_is_untrusted():
    other = _request().model_copy(update={"draft_tokens": [9, 10, 12]})
    with pytest.raises(UntrustedAnswerError):
        _check(_answer(_sealed(other)))


def test_a_verdict_for_another_context_is_untrusted():
    # What the issue saw: the verifier's context and the edge's differ; the digest says so.
    with pytest.raises(UntrustedAnswerError):
        _check(_answer(_sealed(_request())), context=[5, 6, 7, 9])


@pytest.mark.parametrize(
    "response",
    [
        httpx.Response(200, content=b"<html>502 Bad Gateway</html>"),
        httpx.Response(200, content=b'{"session_id": "s"}'),
        httpx.Response(500, content=b"Internal Server Error"),
        httpx.Response(501, content=b"{}"),
    ],
    ids=["not-json", "schema-invalid", "500", "501"],
)
def test_garbled_invalid_and_5xx_answers_are_untrusted(response):
    with pytest.raises(UntrustedAnswerError):
        _check(response)


def _refusal(status: int, code: str | None) -> httpx.Response:
    return httpx.Response(status, json={"error": {"message": "m", "type": "invalid_request_error", "param": None, "code": code}})


@pytest.mark.parametrize(
    ("response", "kind", "code"),
    [
        (_refusal(409, "session_resync_required"), SessionLostError, None),
        (_refusal(400, None), VerifierProtocolError, None),
        (_refusal(422, None), VerifierProtocolError, None),
        (_refusal(401, "invalid_api_key"), ServiceUnavailableError, "verifier_auth_failed"),
        (_refusal(403, None), ServiceUnavailableError, "verifier_auth_failed"),
        (_refusal(413, "request_too_large"), RequestTooLargeError, "request_too_large"),
    ],
    ids=["409-resync", "400", "422", "401", "403", "413"],
)
def test_a_refusal_is_told_by_whose_it_is(response, kind, code):
    # A resync is the protocol's; a refused key the operator's (503); a body over the
    # verifier's limit the prompt's (413); any other refusal a call we built wrong (500).
    with pytest.raises(kind) as raised:
        _check(response)
    assert type(raised.value) is kind
    if code is not None:
        assert (raised.value.code, classify(raised.value)[1]) == (code, 503 if kind is ServiceUnavailableError else 413)


def test_the_check_costs_well_under_a_millisecond_per_call():
    """A micro-benchmark (printed, no threshold): the whole check of one verify answer with a
    2,048-token context and a block of 8: the parse the edge did before anyway, the request's
    fingerprint, the context digest after the call (which the next call reuses as its
    prefix_digest instead of hashing the context again) and the verdict's digest."""
    context = list(range(3, 2051))
    request = VerifyRequest(session_id="s", prefix_length=2048, prefix_digest=context_digest(context), draft_tokens=list(range(8)))
    verdict = VerifyResponse(
        session_id="s",
        num_accepted=5,
        next_token=1,
        next_token_kind="correction",
        context_length=2054,
        num_target_tokens=9,
        advised_draft_length=64,
        timings=VerifyTimings(queue_ms=0.1, forward_ms=2.5, total_ms=3.25),
    )
    emitted = request.draft_tokens[:5] + [1]
    digest = verdict_digest(request.fingerprint(), verdict, context_digest(context + emitted))
    verdict = verdict.model_copy(update={"verdict_digest": digest})
    response = _answer(verdict)
    repeats = 500
    started = time.perf_counter()
    for _ in range(repeats):
        checked_verdict(response, request, request.fingerprint(), context)
    per_call_ms = (time.perf_counter() - started) / repeats * 1e3
    committed_digest = context_digest(context + emitted)
    started = time.perf_counter()
    for _ in range(repeats):
        verdict_digest(request.fingerprint(), verdict, committed_digest)
    new_work_ms = (time.perf_counter() - started) / repeats * 1e3
    print(
        f"\nintegrity check per verify call (2,048-token context, block of 8): {per_call_ms:.3f} ms in all; "
        f"{new_work_ms:.3f} ms of it new work (fingerprint + verdict digest: the parse was done before, and the "
        "context digest replaces the next call's prefix digest)"
    )
    assert per_call_ms > 0


# --- through the engine: a verifier whose answers are spoiled on the way ----------------------


class SpoilingTransport(RecordingTransport):
    """Rewrites next_token in every third verify answer (as the issue's proxy did)."""

    def __init__(self, app) -> None:
        super().__init__(app)
        self.num_answers = 0
        self.num_spoiled = 0

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        response = await super().handle_async_request(request)
        if request.url.path != "/v1/verify" or response.status_code != 200:
            return response
        content = await response.aread()
        self.num_answers += 1
        if self.num_answers % 3 == 0:
            verdict = json.loads(content)
            verdict["next_token"] ^= 1
            content = json.dumps(verdict).encode()
            self.num_spoiled += 1
        return httpx.Response(200, content=content, headers={"content-type": "application/json"})


async def _spoiled_generation(pair) -> tuple[list[int], list[int], SpadeStats, int, float]:
    async with in_process_engine(pair, draft_length="3", transport_class=SpoilingTransport) as stack:
        tokenizer = stack.engine.tokenizer
        request = GenerationRequest("spoiled", tokenizer.encode("The edge drafts"), 40, SamplingConfig(temperature=0), frozenset())
        stats = SpadeStats()
        target_only = [t async for batch in stack.verifier.state.engine.generate(request, SpadeStats()) for t in batch.token_ids]
        batches = stack.engine.generate(request, stats)
        async with contextlib.aclosing(batches):
            speculative = [t async for batch in batches for t in batch.token_ids]
        rejected = stack.metrics.registry.get_sample_value("spade_edge_rejected_answers_total")
        return target_only, speculative, stats, stack.transport.num_spoiled, rejected


@pytest.fixture(scope="module")
def spoiled(tiny_pair):
    return asyncio.run(_spoiled_generation(tiny_pair))


def test_spoiled_verdicts_never_reach_the_output(spoiled):
    target_only, speculative, _, num_spoiled, _ = spoiled
    assert (speculative, num_spoiled > 0) == (target_only, True)


def test_every_rejected_answer_is_counted_on_the_metrics(spoiled):
    *_, num_spoiled, rejected = spoiled
    assert rejected == num_spoiled


def test_a_spoiled_verdict_is_retried_not_resynced(spoiled):
    # The retry is answered from the verifier's memory: the session never had to be rebuilt.
    _, _, stats, _, _ = spoiled
    assert stats.resyncs == 0
