"""Who may call the services, through real servers on loopback: every route but /health needs
a Bearer key (401 in the OpenAI envelope otherwise), several keys rotate, /metrics can be left
open to scrapers, the edge sends its verifier key, a non-loopback address without a key is
refused, and a loopback edge answers only loopback Host headers (DNS rebinding)."""

from __future__ import annotations

import httpx
import openai
import pytest

from edge_support import edge_app, verifier_app
from gateway.security import load_api_keys
from servers import serve

MODEL = "target"
KEY, OLD_KEY = "key-now-0123456789", "key-old-9876543210"
COMPLETION = {"model": MODEL, "prompt": "The edge drafts", "max_tokens": 4, "temperature": 0}

VERIFIER_ROUTES = [
    ("POST", "/v1/verify", {"session_id": "s", "prefix_length": 0, "prefix_digest": "", "new_tokens": [5], "draft_tokens": [6]}),
    ("DELETE", "/v1/sessions/s", None),
    ("POST", "/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}),
    ("POST", "/v1/completions", COMPLETION),
    ("GET", "/v1/models", None),
    ("GET", "/metrics", None),
    ("GET", "/openapi.json", None),
    ("GET", "/docs", None),
]
EDGE_ROUTES = [route for route in VERIFIER_ROUTES if not route[1].startswith(("/v1/verify", "/v1/sessions"))]


@pytest.fixture(scope="module")
def urls(tiny_pair):
    verifier = verifier_app(tiny_pair, api_key=f"{KEY},{OLD_KEY}")
    with serve(verifier) as verifier_url:
        edge = edge_app(tiny_pair, verifier_url, verifier_api_key=KEY, api_key=KEY)
        with serve(edge) as edge_url:
            yield verifier_url, edge_url


def _call(base_url: str, method: str, path: str, body: dict | None, key: str | None) -> httpx.Response:
    headers = {"authorization": f"Bearer {key}"} if key else {}
    return httpx.request(method, base_url + path, json=body, headers=headers, timeout=60)


def _refusal(response: httpx.Response) -> tuple:
    error = response.json()["error"]
    return response.status_code, error["type"], error["code"], response.headers.get("www-authenticate")


@pytest.mark.parametrize("key", [None, "wrong-key", KEY + "x"], ids=["no_key", "wrong_key", "key_with_suffix"])
@pytest.mark.parametrize("method,path,body", VERIFIER_ROUTES, ids=[f"{m} {p}" for m, p, _ in VERIFIER_ROUTES])
def test_every_verifier_route_refuses_a_missing_or_wrong_key_with_401(urls, method, path, body, key):
    assert _refusal(_call(urls[0], method, path, body, key)) == (401, "invalid_request_error", "invalid_api_key", "Bearer")


@pytest.mark.parametrize("key", [None, "wrong-key"], ids=["no_key", "wrong_key"])
@pytest.mark.parametrize("method,path,body", EDGE_ROUTES, ids=[f"{m} {p}" for m, p, _ in EDGE_ROUTES])
def test_every_edge_route_refuses_a_missing_or_wrong_key_with_401(urls, method, path, body, key):
    assert _refusal(_call(urls[1], method, path, body, key)) == (401, "invalid_request_error", "invalid_api_key", "Bearer")


@pytest.mark.parametrize("key", [KEY, OLD_KEY], ids=["current", "previous"])
def test_either_rotated_key_opens_the_verifier(urls, key):
    assert _call(urls[0], "POST", "/v1/completions", COMPLETION, key).status_code == 200


def test_health_needs_no_key(urls):
    assert [httpx.get(url + "/health", timeout=30).status_code for url in urls] == [200, 200]


def test_the_edge_reaches_a_keyed_verifier_with_its_verifier_key(urls):
    client = openai.OpenAI(base_url=urls[1] + "/v1", api_key=KEY, max_retries=0)
    response = client.completions.create(**COMPLETION)
    assert (response.usage.completion_tokens, response.model_extra["spade"]["verify_calls"] > 0) == (4, True)


def test_the_openai_client_with_a_wrong_key_raises_authentication_error(urls):
    client = openai.OpenAI(base_url=urls[1] + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as refused:
        client.completions.create(**COMPLETION)
    assert (refused.value.status_code, refused.value.code) == (401, "invalid_api_key")


def test_metrics_can_be_left_open_to_scrapers(tiny_pair):
    with serve(verifier_app(tiny_pair, api_key=KEY, metrics_require_key=False)) as url:
        statuses = [httpx.get(url + path, timeout=30).status_code for path in ("/metrics", "/v1/models")]
    assert statuses == [200, 401]


OPERATOR_KEY = "operator-key-0123456789"


@pytest.mark.parametrize("open_metrics", [True, False], ids=["metrics_open", "metrics_keyed"])
def test_with_an_operator_key_metrics_answer_it_alone(tiny_pair, open_metrics):
    # Every tenant's activity sums into /metrics: a client's key reads none of it (403), a
    # stranger gets 401, the operator's key reads it, and the client's key still serves models.
    app = verifier_app(tiny_pair, api_key=KEY, metrics_api_key=OPERATOR_KEY, metrics_require_key=not open_metrics)
    with serve(app) as url:

        def status(path: str, key: str | None) -> int:
            headers = {"authorization": f"Bearer {key}"} if key else {}
            return httpx.get(url + path, headers=headers, timeout=30).status_code

        client_refused = httpx.get(url + "/metrics", headers={"authorization": f"Bearer {KEY}"}, timeout=30).json()["error"]
        assert [status("/metrics", OPERATOR_KEY), status("/metrics", KEY), status("/metrics", None)] == [200, 403, 401]
        assert [status("/v1/models", KEY), status("/v1/models", OPERATOR_KEY)] == [200, 401]
    assert (client_refused["type"], client_refused["code"]) == ("permission_error", "operator_key_required")


def test_keys_come_from_the_value_and_the_file_one_per_line(tmp_path):
    key_file = tmp_path / "keys"
    key_file.write_text("file-key-1\n\n  file-key-2  \n")
    assert load_api_keys("a, b,", str(key_file)) == {"a", "b", "file-key-1", "file-key-2"}


def test_a_key_file_opens_the_verifier(tiny_pair, tmp_path):
    key_file = tmp_path / "keys"
    key_file.write_text(KEY + "\n")
    with serve(verifier_app(tiny_pair, api_key_file=str(key_file))) as url:
        statuses = [_call(url, "GET", "/v1/models", None, key).status_code for key in (KEY, None)]
    assert statuses == [200, 401]


@pytest.mark.parametrize("host", ["0.0.0.0", "192.0.2.7", "verifier.example"])
def test_a_non_loopback_address_without_a_key_is_refused(tiny_pair, host):
    with pytest.raises(ValueError, match="without an API key"):
        verifier_app(tiny_pair, host=host)


@pytest.mark.parametrize("settings", [{"api_key": KEY}, {"allow_no_auth": True}], ids=["with_key", "allow_no_auth"])
def test_a_non_loopback_address_is_served_with_a_key_or_when_allowed(tiny_pair, settings):
    assert verifier_app(tiny_pair, host="0.0.0.0", **settings).state.request_limits is not None


@pytest.mark.parametrize("host,status", [("evil.example", 400), ("localhost", 200), ("127.0.0.1", 200)])
def test_a_loopback_edge_answers_only_loopback_host_headers(urls, host, status):
    response = httpx.get(urls[1] + "/health", headers={"host": host}, timeout=30)
    assert response.status_code == status
