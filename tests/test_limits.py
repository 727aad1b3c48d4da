"""What one request may ask, through real servers on loopback: bodies past the size limit get
413 before they are read, requests past the concurrency limit 429 with Retry-After, budgets
past the max_tokens cap 400, and the verifier's KV caches stay inside their byte budget; a
maximum-size prompt is tokenized off the event loop, so /health answers meanwhile."""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import random
import select
import socket
import threading

import httpx
import pytest
from fastapi import FastAPI

from edge_support import verifier_app
from gateway.errors import OverloadedError, install_error_handlers
from gateway.limits import BodySizeLimitMiddleware, ConcurrencyLimitMiddleware
from servers import serve, wait_until
from verifier_service.kv_budget import KvBudget, kv_bytes_per_token
from verifier_service.sessions import SessionLimits, SessionRegistry
from verifier_support import FIRST_ORDINARY_ID, running_client, verify, verify_body
from verifier_support import verifier_app as small_verifier_app

MODEL = "target"
MAX_BYTES = 64 * 1024


@pytest.fixture(scope="module")
def verifier_url(tiny_pair):
    with serve(verifier_app(tiny_pair, max_request_bytes=MAX_BYTES, max_tokens_cap=50, default_max_tokens=7)) as url:
        yield url


def _raw_exchange(port: int, head: bytes, body_part: bytes) -> bytes:
    """Send a request head and only part of its body, then read what the server answers."""
    with socket.create_connection(("127.0.0.1", port), timeout=30) as connection:
        connection.sendall(head + body_part)
        answer = b""
        while b"\r\n\r\n" not in answer or not _complete(answer):
            chunk = connection.recv(65536)
            if not chunk:
                break
            answer += chunk
    return answer


def _complete(answer: bytes) -> bool:
    head, _, body = answer.partition(b"\r\n\r\n")
    length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length:")), 0)
    return len(body) >= length


def _status_and_error(answer: bytes) -> tuple[int, dict]:
    head, _, body = answer.partition(b"\r\n\r\n")
    return int(head.split(b" ")[1]), json.loads(body)["error"]


def test_a_declared_oversized_body_is_refused_413_before_it_is_sent(verifier_url):
    port = int(verifier_url.rsplit(":", 1)[1])
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nContent-Length: {50 * 1024 * 1024}\r\n\r\n"
    )
    status, error = _status_and_error(_raw_exchange(port, head.encode(), b'{"model": "target", "prompt": "'))
    assert (status, error["type"], error["code"], str(MAX_BYTES) in error["message"]) == (
        413,
        "invalid_request_error",
        "request_too_large",
        True,
    )


def test_a_chunked_body_is_refused_413_once_it_passes_the_limit(verifier_url):
    port = int(verifier_url.rsplit(":", 1)[1])
    head = b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n"
    piece = b"x" * 16384
    chunks = (b"%x\r\n" % len(piece) + piece + b"\r\n") * 5  # 80 KiB sent, the body never finished
    status, error = _status_and_error(_raw_exchange(port, head, chunks))
    assert (status, error["code"]) == (413, "request_too_large")


def test_a_body_under_the_limit_is_served(verifier_url):
    body = {"model": MODEL, "prompt": "The edge drafts", "max_tokens": 2, "padding": "x" * (MAX_BYTES - 200)}
    assert httpx.post(verifier_url + "/v1/completions", json=body, timeout=60).status_code == 200


def test_max_tokens_over_the_cap_is_400_naming_the_cap(verifier_url):
    response = httpx.post(verifier_url + "/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 51}, timeout=60)
    error = response.json()["error"]
    assert (response.status_code, error["param"], error["code"], "at most 50" in error["message"]) == (
        400,
        "max_tokens",
        "max_tokens_exceeded",
        True,
    )


def test_a_request_without_max_tokens_gets_the_default_budget(verifier_url):
    body = {"model": MODEL, "prompt": "The edge drafts", "temperature": 0}
    answer = httpx.post(verifier_url + "/v1/completions", json=body, timeout=60).json()
    num_completion_tokens = answer["usage"]["completion_tokens"]
    assert num_completion_tokens <= 7 and (answer["choices"][0]["finish_reason"] == "length") == (num_completion_tokens == 7)


def test_health_answers_while_a_maximum_size_prompt_is_tokenized_and_refused(tiny_pair):
    max_bytes = 2 * 1024 * 1024
    prompt = "The edge drafts a block " * (max_bytes // 24 - 10)  # seconds to tokenize
    body = json.dumps({"model": MODEL, "prompt": prompt, "max_tokens": 1}).encode()
    head = f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    with serve(verifier_app(tiny_pair, max_request_bytes=max_bytes)) as url:
        with socket.create_connection(("127.0.0.1", int(url.rsplit(":", 1)[1])), timeout=300) as big:
            big.sendall(head.encode() + body)  # returns once the server has read nearly all of it
            health_statuses = [httpx.get(url + "/health", timeout=300).status_code for _ in range(3)]
            still_running = select.select([big], [], [], 0)[0] == []
            answer = b""
            while not (b"\r\n\r\n" in answer and _complete(answer)):
                answer += big.recv(65536)
    status, error = _status_and_error(answer)
    # /health answered three times while the big request was still being worked on (a blocked
    # event loop answers nothing until the tokenization ends), and the prompt was refused.
    assert (health_statuses, still_running, status, error["code"]) == ([200, 200, 200], True, 400, "context_length_exceeded")


# --- concurrency ---------------------------------------------------------------------------


def _held_app(release: threading.Event, max_concurrent: int) -> FastAPI:
    """A service whose completions wait for ``release``, behind the real limiter."""
    app = FastAPI()
    app.state.num_entered = 0
    install_error_handlers(app)

    @app.post("/v1/completions")
    async def held() -> dict:
        app.state.num_entered += 1
        while not release.is_set():
            await asyncio.sleep(0.01)
        return {"ok": True}

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok", "num_entered": app.state.num_entered}

    app.add_middleware(ConcurrencyLimitMiddleware, max_concurrent=max_concurrent)
    app.add_middleware(BodySizeLimitMiddleware, max_bytes=MAX_BYTES)
    return app


def test_the_request_past_the_concurrency_limit_is_429_with_retry_after():
    release = threading.Event()
    with serve(_held_app(release, 2)) as url, concurrent.futures.ThreadPoolExecutor(2) as pool:
        held = [pool.submit(httpx.post, url + "/v1/completions", json={}, timeout=60) for _ in range(2)]
        assert wait_until(lambda: httpx.get(url + "/health", timeout=60).json()["num_entered"] == 2)
        extra = httpx.post(url + "/v1/completions", json={}, timeout=60)
        release.set()
        statuses = [future.result().status_code for future in held]
        after = httpx.post(url + "/v1/completions", json={}, timeout=60)
    error = extra.json()["error"]
    is_limit_named = "max_concurrent_requests=2" in error["message"]
    assert (extra.status_code, extra.headers["retry-after"], error["type"], error["code"], is_limit_named) == (
        429,
        "1",
        "rate_limit_error",
        "too_many_requests",
        True,
    )
    assert (statuses, after.status_code) == ([200, 200], 200)


# --- the verifier's KV budget ------------------------------------------------------------------


def test_kv_bytes_per_token_follow_the_model_config(target_model):
    # tiny target: 2 layers x (K and V) x 2 KV heads x head_dim 16 x 4 bytes (fp32)
    assert kv_bytes_per_token(target_model.model.config, target_model.model.dtype) == 2 * 2 * 2 * 16 * 4


def test_many_long_sessions_stay_inside_the_kv_budget(tiny_pair, target_model):
    bytes_per_token = kv_bytes_per_token(target_model.model.config, target_model.model.dtype)
    budget = 3 * 96 * bytes_per_token  # three full contexts of the 96-token test verifier
    rng = random.Random(5)
    vocab = target_model.model.get_output_embeddings().weight.shape[0]
    with running_client(small_verifier_app(tiny_pair, max_kv_cache_bytes=budget)) as client:
        service = client.app.state.service
        peaks = []
        for _ in range(12):
            context = [rng.randrange(FIRST_ORDINARY_ID, vocab) for _ in range(80)]
            verify(client, verify_body("s-" + str(rng.random()), [], [5, 6], new_tokens=context))
            peaks.append(service.sessions.kv_bytes)
        num_sessions = len(service.sessions)
    assert (max(peaks) <= budget, num_sessions) == (True, 3)


def test_a_call_that_cannot_fit_beside_calls_in_flight_is_429():
    registry = SessionRegistry(SessionLimits(), KvBudget(bytes_per_token=10, max_bytes=1000))  # 100 tokens
    busy, idle, new = (registry.get_or_create(name) for name in ("busy", "idle", "new"))
    busy.reserved_tokens, idle.token_ids = 60, [1] * 30
    evicted = registry.reserve(new, 40)  # 60 in flight + 40 fits once the idle session goes
    assert (evicted, registry.get("idle"), new.reserved_tokens) == (["idle"], None, 40)
    with pytest.raises(OverloadedError) as refused:
        registry.reserve(registry.get_or_create("another"), 10)
    assert (refused.value.code, refused.value.retry_after_s) == ("kv_cache_full", 1)


def test_held_kv_counts_in_the_budget_is_never_evicted_and_goes_back_on_release():
    registry = SessionRegistry(SessionLimits(), KvBudget(bytes_per_token=10, max_bytes=1000))  # 100 tokens
    idle = registry.get_or_create("idle")
    idle.token_ids = [1] * 30
    assert registry.hold("pipeline:a", "", 50) == []  # 30 + 50 fit
    assert registry.hold("pipeline:b", "", 40) == ["idle"]  # an idle session gives way, as for a call
    assert registry.kv_bytes == 900
    with pytest.raises(OverloadedError) as refused:
        registry.reserve(registry.get_or_create("new"), 20)  # held KV is never evicted
    assert refused.value.code == "kv_cache_full"
    with pytest.raises(OverloadedError):
        registry.hold("pipeline:c", "", 20)
    registry.release_hold("pipeline:a")
    assert registry.kv_bytes == 400 and registry.reserve(registry.get_or_create("new"), 20) == []


def test_a_budget_smaller_than_one_context_is_refused():
    with pytest.raises(ValueError, match="cannot hold one full context"):
        KvBudget.for_model(bytes_per_token=512, max_context_length=96, max_bytes=512 * 95)
