"""Continuation (wire version 3): where the verifier advises blocks of 0 (saturated: no drafted
row pays), a call that allows ``max_continued_tokens`` gets the target's next tokens decoded by
the verifier itself, one target-only step per forward, instead of one call per token. The
tokens are exactly those block-less calls would get one by one (greedy and seeded sampling,
with logprobs); the verifier stops at the call's and its own limit, at an end-of-sequence token,
at the context limit and as soon as its advice is above 0; the edge checks them under the
verdict digest, emits them, and lets the verifier continue only within the request's budget."""

from __future__ import annotations

import dataclasses
import itertools
import random

import httpx
import pytest

from edge_agent.draft_length import FixedDraftLength
from edge_agent.engine import continued_allowance
from edge_agent.metrics import EdgeMetrics
from edge_agent.verifier_client import UntrustedAnswerError, checked_verdict
from scripted_support import PROMPT, ScriptedDrafter, ScriptedVerifier, generate, scripted_engine, target_continuation
from spade_bench.capacity.emulated_edge import verdict_error
from spade_bench.capacity.sessions import DraftTrace
from verifier_service.protocol import VerifyRequest, VerifyResponse, VerifyTimings, context_digest, verdict_digest
from verifier_support import (
    MAX_CONTEXT,
    greedy_continuation,
    new_session_id,
    post_verify,
    random_tokens,
    running_verifier,
    verify,
    verify_body,
)

SAMPLED = {"temperature": 0.8, "top_k": 0, "top_p": 1.0, "seed": 5}


@pytest.fixture(scope="module")
def client(tiny_pair):
    with running_verifier(tiny_pair) as client:
        yield client


@pytest.fixture
def saturated(client, monkeypatch):
    """The verifier's backend advises 0 to every session (its forwards past the knee)."""
    monkeypatch.setattr(client.app.state.service.backend, "advised_draft_length", lambda session_id: 0)
    return client


def committed_after(context: list[int], draft_tokens: list[int], answer: dict) -> list[int]:
    return context + draft_tokens[: answer["num_accepted"]] + [answer["next_token"]] + answer["continued_tokens"]


def metric(client, name: str) -> float:
    for line in client.get("/metrics").text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"{name} not on /metrics")


def one_call_per_token(client, context: list[int], num_tokens: int, extra: dict) -> list[dict]:
    """The answers of block-less calls, one per token, in a session of its own (``extra``: fields of every call)."""
    session_id, held, answers = new_session_id(), [], []
    for _ in range(num_tokens):
        body = verify_body(session_id, held, [], new_tokens=context[len(held) :]) | extra
        answers.append(verify(client, body))
        held = context = context + [answers[-1]["next_token"]]
    return answers


# --- the verifier ----------------------------------------------------------------------------


def test_a_saturated_verifier_continues_with_the_targets_greedy_tokens(saturated, target_model):
    client, context = saturated, random_tokens(random.Random(1), 9, 300)
    before = metric(client, "spade_verifier_continued_tokens_total")
    answer = verify(client, verify_body(new_session_id(), [], [], new_tokens=context) | {"max_continued_tokens": 5})
    expected = greedy_continuation(target_model.model, context, 6)
    assert [answer["next_token"], *answer["continued_tokens"]] == expected
    assert (answer["context_length"], answer["num_target_tokens"], answer["advised_draft_length"]) == (
        len(context) + 6,
        len(context) + 5,
        0,
    )
    assert metric(client, "spade_verifier_continued_tokens_total") - before == 5


@pytest.mark.parametrize("sampling", [None, SAMPLED], ids=["greedy", "sampled"])
def test_continued_tokens_and_their_logprobs_are_those_of_one_call_per_token(saturated, sampling):
    client, context = saturated, random_tokens(random.Random(2), 8, 300)
    extra = {"num_top_logprobs": 2} | ({} if sampling is None else {"sampling": sampling})
    session_id = new_session_id()
    first = verify(client, verify_body(session_id, [], [], new_tokens=context) | extra | {"max_continued_tokens": 3})
    held = committed_after(context, [], first)
    second = verify(client, verify_body(session_id, held, []) | extra | {"max_continued_tokens": 4})  # the session goes on in step
    singles = one_call_per_token(client, context, 9, extra)
    continued = [answer["next_token"] for answer in singles]
    assert [first["next_token"], *first["continued_tokens"], second["next_token"], *second["continued_tokens"]] == continued
    assert first["logprobs"] + second["logprobs"] == [answer["logprobs"][0] for answer in singles]
    assert first["top_logprobs"] + second["top_logprobs"] == [answer["top_logprobs"][0] for answer in singles]


def test_a_drafted_block_is_verified_first_then_continued(saturated, target_model):
    # An edge that drafted before the advice fell to 0: its block is cut to nothing (the advice),
    # then the verifier goes on; every token is still the target's.
    client, context = saturated, random_tokens(random.Random(3), 7, 300)
    session_id = new_session_id()
    first = verify(client, verify_body(session_id, [], [], new_tokens=context))
    held = committed_after(context, [], first)
    block = greedy_continuation(target_model.model, held, 3)
    answer = verify(client, verify_body(session_id, held, block) | {"max_continued_tokens": 4})
    assert answer["num_accepted"] == 0
    assert [answer["next_token"], *answer["continued_tokens"]] == greedy_continuation(target_model.model, held, 5)


def test_an_idle_verifier_does_not_continue(client):
    context = random_tokens(random.Random(4), 7, 300)
    answer = verify(client, verify_body(new_session_id(), [], [], new_tokens=context) | {"max_continued_tokens": 8})
    assert (answer["continued_tokens"], answer["context_length"]) == ([], len(context) + 1)
    assert answer["advised_draft_length"] > 0


def test_continuing_stops_as_soon_as_the_advice_is_above_zero(client, monkeypatch):
    advice = itertools.chain([0, 0, 0], itertools.repeat(2))  # asked after the verdict, then after each step
    monkeypatch.setattr(client.app.state.service.backend, "advised_draft_length", lambda session_id: next(advice))
    context = random_tokens(random.Random(5), 7, 300)
    answer = verify(client, verify_body(new_session_id(), [], [], new_tokens=context) | {"max_continued_tokens": 8})
    assert (len(answer["continued_tokens"]), answer["advised_draft_length"]) == (3, 2)


def test_the_verifiers_own_limit_bounds_what_a_call_allows(tiny_pair, monkeypatch):
    with running_verifier(tiny_pair, max_continued_tokens=2) as client:
        monkeypatch.setattr(client.app.state.service.backend, "advised_draft_length", lambda session_id: 0)
        context = random_tokens(random.Random(6), 7, 300)
        answer = verify(client, verify_body(new_session_id(), [], [], new_tokens=context) | {"max_continued_tokens": 8})
        assert len(answer["continued_tokens"]) == 2


def test_continuing_stops_through_an_end_of_sequence_token(saturated, target_model, monkeypatch):
    client, context = saturated, random_tokens(random.Random(7), 7, 300)
    expected = greedy_continuation(target_model.model, context, 6)
    backend = client.app.state.service.backend
    ends_at_third = dataclasses.replace(backend.model, eos_token_ids=frozenset({expected[3]}))
    monkeypatch.setattr(type(backend), "model", property(lambda self: ends_at_third))
    answer = verify(client, verify_body(new_session_id(), [], [], new_tokens=context) | {"max_continued_tokens": 5})
    stop = expected.index(expected[3])  # the first occurrence ends it
    assert [answer["next_token"], *answer["continued_tokens"]] == expected[: stop + 1]


def test_continuing_stops_at_the_context_limit(saturated):
    context = random_tokens(random.Random(8), MAX_CONTEXT - 3, 300)
    answer = verify(saturated, verify_body(new_session_id(), [], [], new_tokens=context) | {"max_continued_tokens": 8})
    assert (len(answer["continued_tokens"]), answer["context_length"]) == (2, MAX_CONTEXT)


def test_a_retried_call_gets_the_same_continuation_from_memory(saturated):
    context = random_tokens(random.Random(9), 7, 300)
    body = verify_body(new_session_id(), [], [], new_tokens=context) | {"max_continued_tokens": 4}
    first, again = verify(saturated, body), verify(saturated, body)
    assert (again["replayed"], again["continued_tokens"], again["verdict_digest"]) == (
        True,
        first["continued_tokens"],
        first["verdict_digest"],
    )


def test_the_wire_bounds_what_a_call_may_allow(client):
    body = verify_body(new_session_id(), [], [], new_tokens=[5, 6, 7])
    for allowed in (-1, 1025, "4"):
        response = post_verify(client, body | {"max_continued_tokens": allowed})
        assert (response.status_code, response.json()["error"]["param"]) == (400, "max_continued_tokens")


# --- the edge --------------------------------------------------------------------------------

CONTEXT = [3, 1, 4, 1, 5]


def sealed_response(request: VerifyRequest, continued: list[int], *, digest_over: list[int] | None = None) -> httpx.Response:
    verdict = VerifyResponse(
        session_id=request.session_id,
        num_accepted=0,
        next_token=9,
        next_token_kind="bonus",
        continued_tokens=continued,
        context_length=len(CONTEXT) + 1 + len(continued),
        num_target_tokens=1 + len(continued),
        advised_draft_length=0,
        timings=VerifyTimings(queue_ms=0.0, forward_ms=1.0, total_ms=1.0),
    )
    committed = CONTEXT + [9] + (continued if digest_over is None else digest_over)
    verdict = verdict.model_copy(update={"verdict_digest": verdict_digest(request.fingerprint(), verdict, context_digest(committed))})
    return httpx.Response(200, content=verdict.model_dump_json().encode())


def request_allowing(max_continued_tokens: int) -> VerifyRequest:
    return VerifyRequest(
        session_id="s",
        prefix_length=len(CONTEXT),
        prefix_digest=context_digest(CONTEXT),
        draft_tokens=[],
        max_continued_tokens=max_continued_tokens,
    )


def test_the_edge_takes_continued_tokens_under_the_digest():
    request = request_allowing(3)
    verdict, committed_digest = checked_verdict(sealed_response(request, [7, 8, 2]), request, request.fingerprint(), CONTEXT)
    assert (verdict.continued_tokens, committed_digest) == ([7, 8, 2], context_digest(CONTEXT + [9, 7, 8, 2]))


def test_the_edge_rejects_rewritten_or_unasked_continued_tokens():
    request = request_allowing(3)
    rewritten = sealed_response(request, [7, 8, 2], digest_over=[7, 8, 3])  # a token changed on the way
    with pytest.raises(UntrustedAnswerError, match="digest"):
        checked_verdict(rewritten, request, request.fingerprint(), CONTEXT)
    too_many = sealed_response(request, [7, 8, 2, 4])
    with pytest.raises(UntrustedAnswerError, match="another call"):
        checked_verdict(too_many, request, request.fingerprint(), CONTEXT)


def test_the_allowance_stays_within_the_requests_budget():
    assert continued_allowance(8, 10, 0) == 8
    assert continued_allowance(8, 6, 0) == 5
    assert continued_allowance(8, 10, 4) == 5
    assert continued_allowance(8, 1, 0) == 0
    assert continued_allowance(0, 10, 0) == 0
    assert continued_allowance(8, 10, 0, brings_first_token=True) == 0  # the first token goes out at once


@pytest.mark.parametrize("overlap", [False, True], ids=["in-line", "overlap"])
async def test_a_saturated_verifier_serves_the_edge_several_tokens_a_call(overlap):
    verifier, metrics = ScriptedVerifier(latency_s=0.01, advice=0), EdgeMetrics()
    engine = scripted_engine(
        ScriptedDrafter(), verifier, FixedDraftLength(4), metrics, overlap=overlap, prefill_first=True, max_continued_tokens=8
    )
    tokens, stats = await generate(engine, 20)
    assert tokens == target_continuation(PROMPT, 20)
    # The prompt-only call brings the first token and allows no continuation (the token goes out
    # at once); then 1 + 8, 1 + 8, and the 1 left. Each call allows only what the budget leaves.
    assert verifier.allowed_continuations == [0, 8, 8, 0]
    assert (stats.verify_calls, stats.continued_tokens) == (4, 16)
    assert f"spade_edge_continued_tokens_total {16.0}" in metrics_text(metrics)


async def test_without_continuation_the_edge_allows_none():
    verifier = ScriptedVerifier(latency_s=0.01, advice=0)
    tokens, _ = await generate(scripted_engine(ScriptedDrafter(), verifier, FixedDraftLength(4), prefill_first=True), 6)
    assert tokens == target_continuation(PROMPT, 6)
    assert verifier.allowed_continuations == [0] * 6


def metrics_text(metrics: EdgeMetrics) -> str:
    from prometheus_client import generate_latest

    return generate_latest(metrics.registry).decode()


# --- the capacity benchmark's emulated edge --------------------------------------------------


def test_the_emulated_edge_checks_continued_tokens_against_the_targets_output():
    trace = DraftTrace(
        prompt_token_ids=[1, 2], target_token_ids=[5, 9, 2, 7, 1], proposals=[5, 9, 4, 7, 3], draft_s_per_token=0.01, draft_prefill_s=0.1
    )
    good = VerifyResponse.model_validate(_verdict_payload(0, 5, [9, 2], context_length=5))
    assert verdict_error(trace, 0, [], good) is None
    wrong = VerifyResponse.model_validate(_verdict_payload(0, 5, [9, 3], context_length=5))
    assert "the target's output has [5, 9, 2]" in verdict_error(trace, 0, [], wrong)
    miscounted = VerifyResponse.model_validate(_verdict_payload(0, 5, [9, 2], context_length=4))
    assert "context_length 4" in verdict_error(trace, 0, [], miscounted)


def _verdict_payload(num_accepted: int, next_token: int, continued: list[int], context_length: int) -> dict:
    return {
        "session_id": "s",
        "num_accepted": num_accepted,
        "next_token": next_token,
        "next_token_kind": "bonus",
        "continued_tokens": continued,
        "context_length": context_length,
        "num_target_tokens": 1 + len(continued),
        "advised_draft_length": 0,
        "timings": {"queue_ms": 0.0, "forward_ms": 1.0, "total_ms": 1.0},
    }
