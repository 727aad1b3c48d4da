"""Bad input to the verifier: every case answers the right 4xx in the OpenAI envelope
{"error": {"message", "type", "param", "code"}} and leaves the session as it was (a good call
with the right prefix still gets the plain forward's answer, without a re-prefill); and the
503s while the model loads.
"""

from __future__ import annotations

import asyncio
import json
import random
import threading
from collections.abc import Callable
from dataclasses import dataclass

import httpx
import pytest
from fastapi.testclient import TestClient

from servers import wait_until
from verifier_service.app import create_app
from verifier_service.backends import create_backend
from verifier_service.settings import VerifierSettings
from verifier_support import (
    ENVELOPE_KEYS,
    MAX_CONTEXT,
    MAX_DRAFT,
    MAX_SUPPORT,
    error_of,
    greedy_block,
    new_session_id,
    open_session,
    post_verify,
    random_tokens,
    reference_verdict,
    running_client,
    verdict,
    verifier_app,
    verify,
    verify_body,
)


@pytest.fixture(scope="module")
def client(tiny_pair):
    with running_client(verifier_app(tiny_pair)) as client:
        yield client


@pytest.fixture(scope="module")
def model(target_model):
    return target_model.model


@pytest.fixture(scope="module")
def vocab_size(target_model) -> int:
    return target_model.model.get_output_embeddings().weight.shape[0]


# --- bad input: 4xx in the envelope, session untouched -----------------------------------------


def _draft_probs(token_ids: list[int], probs: list[float]) -> list[dict]:
    return [{"token_ids": token_ids, "probs": probs}]


@dataclass(frozen=True)
class BadCall:
    change: Callable[[dict, int], dict | bytes]
    """(a good call drafting token 5, the vocabulary size) -> the bad call."""
    param: str | None
    code: str | None = None


def setting(**fields) -> Callable[[dict, int], dict]:
    return lambda body, vocab: body | fields


def setting_probs(token_ids: list[int], probs: list[float]) -> Callable[[dict, int], dict]:
    return setting(draft_probs=_draft_probs(token_ids, probs))


def without(field: str) -> Callable[[dict, int], dict]:
    return lambda body, vocab: {key: value for key, value in body.items() if key != field}


def filling_the_context(body: dict, vocab: int) -> dict:
    """Context + one drafted token = MAX_CONTEXT + 1 tokens to feed."""
    return body | {"new_tokens": [5] * (MAX_CONTEXT - body["prefix_length"])}


TOO_WIDE_SUPPORT = _draft_probs(list(range(5, 6 + MAX_SUPPORT)), [1 / (MAX_SUPPORT + 1)] * (MAX_SUPPORT + 1))

BAD_VERIFY_CALLS = {
    "new_token_above_vocab": BadCall(lambda body, vocab: body | {"new_tokens": [vocab]}, "new_tokens"),
    "negative_new_token": BadCall(setting(new_tokens=[-1]), "new_tokens"),
    "draft_token_above_vocab": BadCall(lambda body, vocab: body | {"draft_tokens": [5, vocab]}, "draft_tokens"),
    "negative_draft_token": BadCall(setting(draft_tokens=[-3]), "draft_tokens"),
    "draft_probs_token_above_vocab": BadCall(
        lambda body, vocab: body | {"draft_probs": _draft_probs([5, vocab], [0.5, 0.5])}, "draft_probs.0"
    ),
    "draft_probs_not_summing_to_one": BadCall(setting_probs([5, 6], [0.5, 0.4]), "draft_probs.0"),
    "negative_draft_prob": BadCall(setting_probs([5, 6], [1.5, -0.5]), "draft_probs.0"),
    "nan_draft_prob": BadCall(setting_probs([5, 6], [float("nan"), 1.0]), "draft_probs.0"),
    "draft_probs_rows_mismatch": BadCall(setting(draft_probs=_draft_probs([5], [1.0]) * 2), "draft_probs"),
    "drafted_token_without_mass": BadCall(setting_probs([5, 6], [0.0, 1.0]), "draft_probs.0"),
    "drafted_token_outside_support": BadCall(setting_probs([6, 7], [0.5, 0.5]), "draft_probs.0"),
    "repeated_support_token": BadCall(setting_probs([5, 5], [0.5, 0.5]), "draft_probs.0"),
    "support_over_limit": BadCall(setting(draft_probs=TOO_WIDE_SUPPORT), "draft_probs.0"),
    "draft_probs_for_an_empty_block": BadCall(setting(draft_tokens=[], draft_probs=_draft_probs([5], [1.0])), "draft_probs"),
    "oversized_block": BadCall(setting(draft_tokens=[5] * (MAX_DRAFT + 1)), "draft_tokens"),
    "context_over_max_length": BadCall(filling_the_context, "draft_tokens", "context_length_exceeded"),
    "prefix_zero_without_context": BadCall(setting(prefix_length=0, new_tokens=[]), "new_tokens"),
    "negative_temperature": BadCall(setting(sampling={"temperature": -0.5}), "sampling.temperature"),
    "zero_top_p": BadCall(setting(sampling={"top_p": 0.0}), "sampling.top_p"),
    "missing_draft_tokens": BadCall(without("draft_tokens"), "draft_tokens"),
    "missing_session_id": BadCall(without("session_id"), "session_id"),
    "unknown_field": BadCall(setting(draft_logits=[0.0]), "draft_logits"),
    "malformed_json": BadCall(lambda body, vocab: json.dumps(body).encode()[:-7], None),
}


@pytest.mark.parametrize("case", list(BAD_VERIFY_CALLS))
def test_bad_verify_call_is_refused_400_in_the_envelope(client, vocab_size, case):
    bad = BAD_VERIFY_CALLS[case]
    session = open_session(client, random_tokens(random.Random(24), 8, vocab_size), [5])
    response = post_verify(client, bad.change(verify_body(session.session_id, session.committed, [5]), vocab_size))
    assert error_of(response) == (400, ENVELOPE_KEYS, "invalid_request_error", bad.param, bad.code)


@pytest.mark.parametrize("case", list(BAD_VERIFY_CALLS))
def test_bad_verify_call_leaves_the_session_intact(client, model, vocab_size, case):
    rng = random.Random(25)
    session = open_session(client, random_tokens(rng, 8, vocab_size), [5])
    good = verify_body(session.session_id, session.committed, [5])
    post_verify(client, BAD_VERIFY_CALLS[case].change(good, vocab_size))
    block = greedy_block(model, session.committed, 4, 2, vocab_size, rng)
    answer = verify(client, verify_body(session.session_id, session.committed, block))
    expected = reference_verdict(model, session.committed, block)
    assert (verdict(answer), answer["num_target_tokens"]) == (expected, 1 + 4)  # the cache is intact too


def test_block_reaching_exactly_the_max_context_length_is_accepted(client, vocab_size):
    context = random_tokens(random.Random(26), MAX_CONTEXT - 3, vocab_size)
    assert post_verify(client, verify_body(new_session_id(), [], [5, 6, 7], new_tokens=context)).status_code == 200


# --- the context-limit rule (gateway.model) at its boundary, on both routes ----------------------
# Shared with the vLLM suite, whose model is described one token shorter: the limit is read
# from /health. ``over`` 0: exactly at the limit (served); 1: one token past it (400, not 500).

AT_THE_LIMIT = [(0, 200, None), (1, 400, "context_length_exceeded")]


def verify_past_the_limit(client, vocab_size: int, over: int) -> httpx.Response:
    """A fresh session's call whose context + 3 drafted tokens end ``over`` tokens past the limit."""
    limit = client.get("/health").json()["max_context_length"]
    context = random_tokens(random.Random(limit + over), limit - 3 + over, vocab_size)
    return post_verify(client, verify_body(new_session_id(), [], [5, 6, 7], new_tokens=context))


def complete_past_the_limit(client, vocab_size: int, over: int) -> httpx.Response:
    """A completion whose prompt + max_tokens end ``over`` tokens past the limit."""
    limit = client.get("/health").json()["max_context_length"]
    prompt = random_tokens(random.Random(limit), limit - 2, vocab_size)
    body = {"model": "target", "prompt": prompt, "max_tokens": 2 + over, "temperature": 0}
    return client.post("/v1/completions", json=body)


def outcome(response: httpx.Response, param: str) -> tuple[int, str | None]:
    if response.status_code == 200:
        return 200, None
    assert error_of(response)[1:4] == (ENVELOPE_KEYS, "invalid_request_error", param)
    return response.status_code, response.json()["error"]["code"]


@pytest.mark.parametrize(("over", "status", "code"), AT_THE_LIMIT)
def test_the_verify_route_applies_the_context_limit_at_its_boundary(client, vocab_size, over, status, code):
    assert outcome(verify_past_the_limit(client, vocab_size, over), "draft_tokens") == (status, code)


@pytest.mark.parametrize(("over", "status", "code"), AT_THE_LIMIT)
def test_the_openai_route_applies_the_context_limit_at_its_boundary(client, vocab_size, over, status, code):
    assert outcome(complete_past_the_limit(client, vocab_size, over), "max_tokens") == (status, code)


def test_valid_draft_probs_are_accepted(client, model, vocab_size):
    context = random_tokens(random.Random(27), 8, vocab_size)
    body = verify_body(new_session_id(), [], [5], new_tokens=context, draft_probs=_draft_probs([5, 6], [0.25, 0.75]))
    assert verify(client, body)["next_token"] == reference_verdict(model, context, [5])[1]


HI = [{"role": "user", "content": "hi"}]
STOPS = list("abcdefghi")  # one more than allowed
CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
NOT_FOUND, INVALID = (404, "not_found_error"), (400, "invalid_request_error")

# case id -> (route, body, (status, error type), param, code)
BAD_OPENAI_CALLS = {
    "unknown_model_chat": (CHAT, {"model": "nope", "messages": HI}, NOT_FOUND, "model", "model_not_found"),
    "unknown_model_completion": (COMPLETIONS, {"model": "nope", "prompt": "hi"}, NOT_FOUND, "model", "model_not_found"),
    "n_2": (COMPLETIONS, {"model": "target", "prompt": "hi", "n": 2}, INVALID, "n", None),
    "negative_temperature": (CHAT, {"model": "target", "messages": HI, "temperature": -1}, INVALID, "temperature", None),
    "missing_messages": (CHAT, {"model": "target"}, INVALID, "messages", None),
    "empty_messages": (CHAT, {"model": "target", "messages": []}, INVALID, "messages", None),
    "missing_model": (COMPLETIONS, {"prompt": "hi"}, INVALID, "model", None),
    "max_tokens_over_context": (
        COMPLETIONS,
        {"model": "target", "prompt": "hi", "max_tokens": MAX_CONTEXT},
        INVALID,
        "max_tokens",
        "context_length_exceeded",
    ),
    "prompt_token_above_vocab": (COMPLETIONS, {"model": "target", "prompt": [5, 100_000]}, INVALID, "prompt", None),
    "echo": (COMPLETIONS, {"model": "target", "prompt": "hi", "echo": True}, INVALID, "echo", None),
    "too_many_stop_strings": (COMPLETIONS, {"model": "target", "prompt": "hi", "stop": STOPS}, INVALID, "stop", None),
}


@pytest.mark.parametrize("case", list(BAD_OPENAI_CALLS))
def test_bad_openai_call_is_refused_in_the_envelope(client, case):
    route, body, (status, error_type), param, code = BAD_OPENAI_CALLS[case]
    assert error_of(client.post(route, json=body)) == (status, ENVELOPE_KEYS, error_type, param, code)


@pytest.mark.parametrize("route", [CHAT, COMPLETIONS])
def test_malformed_json_on_openai_routes_is_400(client, route):
    response = client.post(route, content=b'{"model": "target", ', headers={"content-type": "application/json"})
    assert error_of(response) == (400, ENVELOPE_KEYS, "invalid_request_error", None, None)


# --- loading ----------------------------------------------------------------------------------


@pytest.fixture
def loading(tiny_pair):
    """A verifier whose model loads only once ``release`` is set."""
    release = threading.Event()

    async def held_backend(settings):
        while not release.is_set():
            await asyncio.sleep(0.01)
        return await create_backend(settings)

    app = create_app(VerifierSettings(model=str(tiny_pair.target_dir)), backend_factory=held_backend)
    with TestClient(app) as client:
        yield client, release
        release.set()


def test_health_is_503_loading_while_the_model_loads(loading):
    client, _ = loading
    response = client.get("/health")
    assert (response.status_code, response.json()["status"]) == (503, "loading")


def test_health_turns_ok_once_the_model_is_loaded(loading):
    client, release = loading
    release.set()
    assert wait_until(lambda: client.get("/health").json()["status"] == "ok")


LOADING_ROUTES = [
    ("POST", "/v1/chat/completions", {"model": "target", "messages": [{"role": "user", "content": "hi"}]}),
    ("POST", "/v1/completions", {"model": "target", "prompt": "hi"}),
    ("GET", "/v1/models", None),
    ("POST", "/v1/verify", verify_body("s", [], [5], new_tokens=[6])),
    ("DELETE", "/v1/sessions/s", None),
]


@pytest.mark.parametrize("method,route,body", LOADING_ROUTES, ids=[route for _, route, _ in LOADING_ROUTES])
def test_model_routes_answer_503_while_the_model_loads(loading, method, route, body):
    client, _ = loading
    response = client.request(method, route, json=body)
    assert error_of(response)[:3] == (503, ENVELOPE_KEYS, "service_unavailable_error")
