"""Bad input to the verifier: every case answers the right 4xx in the OpenAI envelope
{"error": {"message", "type", "param", "code"}} and leaves the session as it was (a good call
with the right prefix still gets the plain forward's answer, without a re-prefill); and the
503s while the model loads. The table of bad verify calls is ``bad_input_support``'s (the vLLM
suite runs it too).
"""

from __future__ import annotations

import asyncio
import random
import threading

import pytest
from fastapi.testclient import TestClient

from bad_input_support import AT_THE_LIMIT, BAD_VERIFY_CALLS, complete_past_the_limit, one_distribution, outcome, verify_past_the_limit
from servers import wait_until
from verifier_service.app import create_app
from verifier_service.backends import create_backend
from verifier_service.settings import VerifierSettings
from verifier_support import (
    ENVELOPE_KEYS,
    MAX_CONTEXT,
    error_of,
    greedy_block,
    new_session_id,
    open_session,
    post_verify,
    random_tokens,
    reference_verdict,
    verdict,
    verify,
    verify_body,
)

# --- bad input: 4xx in the envelope, session untouched -----------------------------------------


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
# The cases and helpers are bad_input_support's, shared with the vLLM suite.


@pytest.mark.parametrize(("over", "status", "code"), AT_THE_LIMIT)
def test_the_verify_route_applies_the_context_limit_at_its_boundary(client, vocab_size, over, status, code):
    assert outcome(verify_past_the_limit(client, vocab_size, over), "draft_tokens") == (status, code)


@pytest.mark.parametrize(("over", "status", "code"), AT_THE_LIMIT)
def test_the_openai_route_applies_the_context_limit_at_its_boundary(client, vocab_size, over, status, code):
    assert outcome(complete_past_the_limit(client, vocab_size, over), "max_tokens") == (status, code)


def test_valid_draft_probs_are_accepted(client, model, vocab_size):
    context = random_tokens(random.Random(27), 8, vocab_size)
    body = verify_body(new_session_id(), [], [5], new_tokens=context, draft_probs=one_distribution([5, 6], [0.25, 0.75]))
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
