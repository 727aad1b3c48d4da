"""Shared prefixes through the services: the verify wire after a resync, after an eviction and
under the KV byte budget; isolation by ``cache_salt`` and by API key (``--prefix-sharing``);
the reuse reported in ``usage.prompt_tokens_details.cached_tokens``, the ``spade`` stats and
/metrics of both services."""

from __future__ import annotations

import random

import httpx
import pytest

from edge_support import edge_app
from servers import serve
from verifier_service.protocol import VerifyRequest
from verifier_support import (
    MAX_CONTEXT,
    committed_after,
    new_session_id,
    random_tokens,
    running_verifier,
    verifier_app,
    verify,
    verify_body,
)

KEY_A, KEY_B = "key-a-0123456789", "key-b-9876543210"


def _prompt(seed: int, length: int, vocab_size: int) -> list[int]:
    return random_tokens(random.Random(seed), length, vocab_size)


def _metric(text: str, name: str) -> float:
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith((name + " ", name + "{")))


def test_a_resent_context_starts_from_its_own_retained_cache(tiny_pair, vocab_size):
    context = _prompt(1, 40, vocab_size)
    with running_verifier(tiny_pair) as client:
        first = verify(client, verify_body("s", [], [], new_tokens=context))
        client.delete("/v1/sessions/s")
        again = verify(client, verify_body("s", [], [], new_tokens=context))
        metrics = client.get("/metrics").text
    # All but the last token (whose logits the call needs) come from the retained cache.
    assert (first["num_cached_tokens"], again["num_cached_tokens"]) == (0, 39)
    assert (again["next_token"], again["num_target_tokens"]) == (first["next_token"], 40 - 39)
    assert (_metric(metrics, "spade_verifier_prompt_tokens_total"), _metric(metrics, "spade_verifier_prefix_hit_tokens_total")) == (80, 39)


def test_a_session_evicted_for_another_resyncs_from_its_retained_cache(tiny_pair, vocab_size):
    context = _prompt(2, 40, vocab_size)
    with running_verifier(tiny_pair, max_sessions=1) as client:
        opened = verify(client, verify_body("s1", [], [], new_tokens=context))
        committed = committed_after(context, [], opened)
        verify(client, verify_body("s2", [], [], new_tokens=_prompt(3, 40, vocab_size)))  # evicts s1
        assert client.post("/v1/verify", json=verify_body("s1", committed, [5])).status_code == 409
        resynced = verify(client, verify_body("s1", [], [5], new_tokens=committed))
    assert resynced["num_cached_tokens"] == len(committed) - 1


@pytest.mark.parametrize(("budget_tokens", "hit"), [(MAX_CONTEXT, 0), (3 * MAX_CONTEXT, 60)], ids=["tight", "roomy"])
def test_retained_caches_live_within_the_byte_budget(tiny_pair, vocab_size, budget_tokens, hit):
    # An ended 60-token session is retained; an 80-token call then needs the room: with one
    # context's budget the retained cache gives way (no 429), with three it stays and is reused.
    first = _prompt(4, 60, vocab_size)
    with running_verifier(tiny_pair) as probe:
        bytes_per_token = probe.app.state.service.backend.kv_bytes_per_token
    with running_verifier(tiny_pair, max_kv_cache_bytes=budget_tokens * bytes_per_token) as client:
        verify(client, verify_body("a", [], [], new_tokens=first))
        client.delete("/v1/sessions/a")
        assert client.post("/v1/verify", json=verify_body("b", [], [], new_tokens=_prompt(5, 80, vocab_size))).status_code == 200
        sessions = client.app.state.service.sessions
        assert sessions.kv_bytes <= budget_tokens * bytes_per_token
        client.delete("/v1/sessions/b")
        again = verify(client, verify_body("c", [], [], new_tokens=first + [7]))
    assert again["num_cached_tokens"] == hit


def test_the_budget_bounds_retained_caches_filled_by_the_openai_route_before_any_verify_call(tiny_pair, vocab_size):
    # Distinct prompts on the target-only route each leave a retained cache; with no verify call
    # ever coming, the budget (one context) must still bound them at every moment, and /metrics
    # must say what the store holds.
    with running_verifier(tiny_pair) as probe:
        bytes_per_token = probe.app.state.service.backend.kv_bytes_per_token
    budget = MAX_CONTEXT * bytes_per_token
    with serve(verifier_app(tiny_pair, max_kv_cache_bytes=budget)) as url:
        for seed in range(8):
            _completion(url, _prompt(100 + seed, 40, vocab_size))  # 8 x ~43 tokens: 3.6 contexts in all
            metrics = httpx.get(url + "/metrics", timeout=30).text
            assert 0 < _metric(metrics, "spade_verifier_prefix_store_bytes") <= budget
            assert _metric(metrics, "spade_verifier_kv_cache_bytes") <= budget
        assert 1 <= _metric(metrics, "spade_verifier_prefix_store_entries") <= MAX_CONTEXT // 40


def test_calls_with_another_salt_share_nothing(tiny_pair, vocab_size):
    context = _prompt(6, 40, vocab_size)
    with running_verifier(tiny_pair) as client:
        verify(client, verify_body(new_session_id(), [], [], new_tokens=context) | {"cache_salt": "tenant-1"})
        other = verify(client, verify_body(new_session_id(), [], [], new_tokens=context) | {"cache_salt": "tenant-2"})
        unsalted = verify(client, verify_body(new_session_id(), [], [], new_tokens=context))
        same = verify(client, verify_body(new_session_id(), [], [], new_tokens=context) | {"cache_salt": "tenant-1"})
    assert [other["num_cached_tokens"], unsalted["num_cached_tokens"], same["num_cached_tokens"]] == [0, 0, 39]


def test_the_salt_is_in_the_verdict_digests_fingerprint():
    body = verify_body("s", [], [], new_tokens=[5, 6, 7])
    unsalted, salted = VerifyRequest.model_validate(body), VerifyRequest.model_validate(body | {"cache_salt": "x"})
    assert unsalted.fingerprint() != salted.fingerprint()
    assert unsalted.fingerprint() == VerifyRequest.model_validate(body | {"cache_salt": None}).fingerprint()


def _completion(url: str, prompt: list[int], key: str | None = None, **extra) -> dict:
    headers = {} if key is None else {"authorization": f"Bearer {key}"}
    body = {"model": "target", "prompt": prompt, "max_tokens": 3, "temperature": 0} | extra
    response = httpx.post(url + "/v1/completions", json=body, headers=headers, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()


def _cached(answer: dict) -> int:
    return answer["usage"]["prompt_tokens_details"]["cached_tokens"]


@pytest.mark.parametrize(("sharing", "other_key_hit"), [("per-key", 0), ("global", 39)])
def test_keys_share_prefixes_only_in_global_mode(tiny_pair, vocab_size, sharing, other_key_hit):
    prompt = _prompt(7, 40, vocab_size)
    app_settings = {"api_key": f"{KEY_A},{KEY_B}", "served_model_name": "target", "prefix_sharing": sharing}
    with serve(verifier_app(tiny_pair, **app_settings)) as url:
        first = _completion(url, prompt, KEY_A)
        other_key = _completion(url, prompt, KEY_B)
        same_key = _completion(url, prompt, KEY_A)
    assert [_cached(first), _cached(other_key), _cached(same_key)] == [0, other_key_hit, 39]
    assert first["choices"][0]["text"] == same_key["choices"][0]["text"] == other_key["choices"][0]["text"]


def test_prefix_sharing_off_shares_nothing(tiny_pair, vocab_size):
    prompt = _prompt(8, 40, vocab_size)
    with serve(verifier_app(tiny_pair, served_model_name="target", prefix_sharing="off")) as url:
        answers = [_completion(url, prompt) for _ in range(2)]
    assert [_cached(answer) for answer in answers] == [0, 0]


def test_the_edge_reports_the_verifiers_reuse_in_usage_stats_and_metrics(tiny_pair, vocab_size):
    prompt = _prompt(9, 40, vocab_size)
    with serve(verifier_app(tiny_pair)) as verifier_url, serve(edge_app(tiny_pair, verifier_url)) as edge_url:
        model = httpx.get(edge_url + "/v1/models", timeout=30).json()["data"][0]["id"]
        answers = [_completion(edge_url, prompt, model=model, cache_salt=salt) for salt in ("x", "x", "y")]
        edge_metrics = httpx.get(edge_url + "/metrics", timeout=30).text
        verifier_metrics = httpx.get(verifier_url + "/metrics", timeout=30).text
    assert [_cached(answer) for answer in answers] == [0, 39, 0]
    assert [answer["spade"]["verifier_cached_tokens"] for answer in answers] == [0, 39, 0]
    assert answers[0]["choices"][0]["text"] == answers[1]["choices"][0]["text"]
    assert _metric(edge_metrics, "spade_edge_verifier_cached_tokens_total") == 39
    assert _metric(edge_metrics, "spade_edge_prompt_tokens_total") == 120
    assert _metric(verifier_metrics, "spade_verifier_prefix_hit_tokens_total") == 39
