"""The edge agent's OpenAI-compatible surface, through real servers on loopback, the openai
client (sync and async), raw SSE (httpx) and ``curl -N``: streaming rules, stop strings, token
budgets, usage and speculative stats, errors, models, health and metrics.

One verifier and one edge (draft length 3) serve the whole module, on the tiny BPE pair.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess

import httpx
import openai
import pytest
import torch
from fastapi.testclient import TestClient

from edge_agent.health import EdgeHealth
from edge_support import DONE, edge_app, json_chunks, metric_value, sse_payloads, stream_payloads, verifier_app
from servers import serve

MODEL = "target"
DRAFT_LENGTH = 3
GREEDY_PROMPT = "The edge drafts"
"""Its greedy output runs 40 tokens without EOS (checked by test_max_tokens_is_exact)."""
GREEDY_TOKENS = 40
CHAT = [{"role": "user", "content": "Tell me about the edge"}]
SEEDED = dict(model=MODEL, temperature=0.8, seed=7, max_tokens=24)


@pytest.fixture(scope="module")
def urls(tiny_pair):
    with serve(verifier_app(tiny_pair)) as verifier_url, serve(edge_app(tiny_pair, verifier_url, DRAFT_LENGTH)) as edge_url:
        yield verifier_url, edge_url


@pytest.fixture(scope="module")
def edge_url(urls) -> str:
    return urls[1]


@pytest.fixture(scope="module")
def client(edge_url) -> openai.OpenAI:
    return openai.OpenAI(base_url=edge_url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture
def async_client(edge_url) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=edge_url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def tokenizer(target_model):
    return target_model.tokenizer


@pytest.fixture(scope="module")
def greedy_token_ids(target_model, tokenizer) -> list[int]:
    """The target's greedy continuation of GREEDY_PROMPT, computed from the model directly."""
    token_ids = tokenizer.encode(GREEDY_PROMPT)
    num_prompt = len(token_ids)
    with torch.inference_mode():
        for _ in range(GREEDY_TOKENS):
            token_ids.append(int(target_model.model(input_ids=torch.tensor([token_ids])).logits[0, -1].argmax()))
    return token_ids[num_prompt:]


@pytest.fixture(scope="module")
def greedy_completion(client):
    return client.completions.create(model=MODEL, prompt=GREEDY_PROMPT, max_tokens=GREEDY_TOKENS, temperature=0)


@pytest.fixture(scope="module")
def greedy_text(greedy_completion) -> str:
    return greedy_completion.choices[0].text


@pytest.fixture(scope="module")
def chat_stream(client) -> list:
    """A seeded sampled chat stream with usage, as the openai client parses it (a salt of its
    own: no prefix the other requests of this module cached is reused, as for chat_response)."""
    return list(
        client.chat.completions.create(
            messages=CHAT, stream=True, stream_options={"include_usage": True}, extra_body={"cache_salt": "chat-stream"}, **SEEDED
        )
    )


@pytest.fixture(scope="module")
def chat_response(client):
    """The same request as chat_stream, not streamed."""
    return client.chat.completions.create(messages=CHAT, extra_body={"cache_salt": "chat-response"}, **SEEDED)


def test_the_greedy_text_is_the_targets_own_continuation(greedy_token_ids, tokenizer, greedy_text):
    assert tokenizer.decode(greedy_token_ids) == greedy_text


# Streaming rules ------------------------------------------------------------------------------


def test_first_chat_chunk_carries_only_the_role(chat_stream):
    assert chat_stream[0].choices[0].delta.model_dump(exclude_none=True) == {"role": "assistant"}


def test_all_chunks_of_a_stream_share_one_id(chat_stream):
    assert len({chunk.id for chunk in chat_stream}) == 1


def test_content_chunks_carry_only_text(chat_stream):
    deltas = [chunk.choices[0].delta.model_dump(exclude_none=True) for chunk in chat_stream[1:-2]]
    assert all(list(delta) == ["content"] and delta["content"] for delta in deltas)


def test_streamed_deltas_concatenate_to_the_non_streamed_text(chat_stream, chat_response):
    streamed = "".join(chunk.choices[0].delta.content or "" for chunk in chat_stream if chunk.choices)
    assert streamed == chat_response.choices[0].message.content


def test_finish_chunk_has_the_finish_reason_and_no_content(chat_stream, chat_response):
    finish = chat_stream[-2].choices[0]
    assert (finish.finish_reason, finish.delta.model_dump(exclude_none=True)) == (chat_response.choices[0].finish_reason, {})


def test_usage_chunk_comes_last_with_empty_choices(chat_stream):
    assert (chat_stream[-1].choices, chat_stream[-1].usage is not None) == ([], True)


def test_usage_chunk_reports_the_same_usage_as_the_non_streamed_response(chat_stream, chat_response):
    assert chat_stream[-1].usage == chat_response.usage


def test_usage_chunk_carries_the_spade_counts_of_the_request(chat_stream, chat_response):
    counts = ("verify_calls", "drafted_tokens", "accepted_tokens", "target_tokens", "resyncs")
    streamed, answered = chat_stream[-1].model_extra["spade"], chat_response.model_extra["spade"]
    assert {name: streamed[name] for name in counts} == {name: answered[name] for name in counts}


def test_without_include_usage_no_chunk_carries_usage(client):
    chunks = list(client.chat.completions.create(messages=CHAT, stream=True, **SEEDED))
    assert [(chunk.usage, len(chunk.choices)) for chunk in chunks] == [(None, 1)] * len(chunks)


def test_raw_chat_stream_is_role_content_finish_usage_then_done(edge_url):
    payloads = stream_payloads(edge_url, "/v1/chat/completions", dict(messages=CHAT, stream_options={"include_usage": True}, **SEEDED))
    assert re.fullmatch("RC+FUD", "".join(_kind(payload) for payload in payloads))


def test_raw_completion_finish_chunk_has_empty_text(edge_url):
    body = dict(model=MODEL, prompt=GREEDY_PROMPT, max_tokens=5, temperature=0)
    finish = json_chunks(stream_payloads(edge_url, "/v1/completions", body))[-1]
    assert finish["choices"] == [{"index": 0, "text": "", "logprobs": None, "finish_reason": "length"}]


def test_curl_receives_the_events_then_done(edge_url):
    if shutil.which("curl") is None:
        pytest.skip("curl is not installed: the raw SSE stream is checked with httpx above")
    body = json.dumps(dict(messages=CHAT, stream=True, stream_options={"include_usage": True}, **SEEDED))
    result = subprocess.run(
        ["curl", "-N", "-sS", "--max-time", "60", "-H", "content-type: application/json", "-d", body, edge_url + "/v1/chat/completions"],
        capture_output=True,
        text=True,
        timeout=90,
        check=True,
    )
    assert re.fullmatch("RC+FUD", "".join(_kind(payload) for payload in sse_payloads(result.stdout.splitlines())))


def _kind(payload: str) -> str:
    """One letter per chat stream payload: R role, C content, F finish, U usage, D [DONE], and
    ? for a payload breaking the rules (a role with content, a finish with text...)."""
    if payload == DONE:
        return "D"
    chunk = json.loads(payload)
    if not chunk["choices"]:
        return "U" if {"usage", "spade"} <= chunk.keys() else "?"
    delta, finish_reason = chunk["choices"][0]["delta"], chunk["choices"][0]["finish_reason"]
    if delta == {"role": "assistant"} and finish_reason is None:
        return "R"
    if list(delta) == ["content"] and delta["content"] and finish_reason is None:
        return "C"
    if delta == {} and finish_reason in ("stop", "length"):
        return "F"
    return "?"


async def test_async_client_stream_concatenates_to_its_non_streamed_text(async_client):
    request = dict(prompt="def add(a, b):", **SEEDED)
    stream = await async_client.completions.create(stream=True, **request)
    streamed = "".join([chunk.choices[0].text async for chunk in stream])
    answered = await async_client.completions.create(**request)
    assert streamed == answered.choices[0].text


async def test_async_client_gets_the_sync_clients_greedy_text(async_client, greedy_text):
    answered = await async_client.completions.create(model=MODEL, prompt=GREEDY_PROMPT, max_tokens=GREEDY_TOKENS, temperature=0)
    assert answered.choices[0].text == greedy_text


# Stop strings ---------------------------------------------------------------------------------


def spanning_stops(token_ids: list[int], tokenizer, text: str) -> list[tuple[str, int]]:
    """Stop strings that start inside one token and end inside the next, with the offset where
    each first occurs in ``text``. Example: tokens "ab" + "cd" at offset 7 -> ("bc", 8)."""
    stops = []
    for index in range(len(token_ids) - 1):
        before = tokenizer.decode(token_ids[:index])
        piece, following = tokenizer.decode(token_ids[index : index + 1]), tokenizer.decode(token_ids[index + 1 : index + 2])
        if not (len(piece) >= 2 and following and (piece + following).isascii() and (piece + following).isprintable()):
            continue
        if not text.startswith(before + piece + following):
            continue  # decoding is not character-aligned here (a multi-byte character nearby)
        stop = piece[1:] + following[:1]
        if text.find(stop) == len(before) + 1:
            stops.append((stop, len(before) + 1))
    return stops


@pytest.fixture(scope="module")
def stops(greedy_token_ids, tokenizer, greedy_text) -> list[tuple[str, int]]:
    found = spanning_stops(greedy_token_ids, tokenizer, greedy_text)
    assert len(found) >= 2, "the greedy output needs two ASCII token pairs to build stop strings from"
    return found


def _greedy(client, **options):
    request = dict(model=MODEL, prompt=GREEDY_PROMPT, max_tokens=GREEDY_TOKENS, temperature=0) | options
    return client.completions.create(**request)


def test_stop_string_across_tokens_ends_the_text_right_before_it(client, stops, greedy_text):
    stop, offset = stops[0]
    assert _greedy(client, stop=stop).choices[0].text == greedy_text[:offset]


def test_stop_string_across_tokens_finishes_with_stop(client, stops):
    assert _greedy(client, stop=stops[0][0]).choices[0].finish_reason == "stop"


def test_stop_string_across_tokens_never_reaches_the_stream(client, stops, greedy_text):
    stop, offset = stops[0]
    streamed = "".join(chunk.choices[0].text for chunk in _greedy(client, stop=stop, stream=True))
    assert streamed == greedy_text[:offset]


def test_the_earliest_of_several_stop_strings_ends_the_text(client, stops, greedy_text):
    (first, offset), (later, _) = stops[0], stops[-1]
    assert _greedy(client, stop=[later, "~never in the output~", first]).choices[0].text == greedy_text[:offset]


# Budgets, usage and speculative stats ---------------------------------------------------------


def test_max_tokens_is_exact(greedy_completion):
    assert (greedy_completion.usage.completion_tokens, greedy_completion.choices[0].finish_reason) == (GREEDY_TOKENS, "length")


def test_max_completion_tokens_is_honoured(client):
    response = client.chat.completions.create(model=MODEL, messages=CHAT, max_completion_tokens=9, temperature=0)
    assert (response.usage.completion_tokens, response.choices[0].finish_reason) == (9, "length")


def test_completion_prompt_tokens_are_the_tokenizers_count(greedy_completion, tokenizer):
    assert greedy_completion.usage.prompt_tokens == len(tokenizer.encode(GREEDY_PROMPT))


def test_chat_prompt_tokens_are_the_templated_prompts_count(chat_response, tokenizer):
    templated = tokenizer.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
    assert chat_response.usage.prompt_tokens == len(tokenizer.encode(templated, add_special_tokens=False))


def test_total_tokens_are_prompt_plus_completion(greedy_completion):
    usage = greedy_completion.usage
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens


def test_accepted_tokens_never_exceed_drafted_tokens(greedy_completion):
    spade = greedy_completion.model_extra["spade"]
    assert spade["accepted_tokens"] <= spade["drafted_tokens"]


def test_no_block_is_longer_than_the_draft_length(greedy_completion):
    spade = greedy_completion.model_extra["spade"]
    assert spade["drafted_tokens"] <= DRAFT_LENGTH * spade["verify_calls"]


def test_each_verify_call_yields_its_accepted_tokens_plus_one(greedy_completion):
    # Without EOS only the budget truncates, and the last block is drafted short enough that it
    # loses at most its one extra token: completion = accepted + calls, or one less.
    spade = greedy_completion.model_extra["spade"]
    surplus = spade["accepted_tokens"] + spade["verify_calls"] - greedy_completion.usage.completion_tokens
    assert surplus in (0, 1)


def test_an_output_ending_at_eos_counts_the_eos_and_nothing_after_it(client):
    # The greedy output of "print(" ends with EOS as its 8th token (see test_edge_greedy).
    response = client.completions.create(model=MODEL, prompt="print(", max_tokens=32, temperature=0)
    spade = response.model_extra["spade"]
    emitted = spade["accepted_tokens"] + spade["verify_calls"]
    assert (response.usage.completion_tokens, response.choices[0].finish_reason, emitted >= 8) == (8, "stop", True)


def test_no_resync_happens_while_the_verifier_keeps_the_session(greedy_completion):
    assert greedy_completion.model_extra["spade"]["resyncs"] == 0


# Errors and the other routes ------------------------------------------------------------------


def test_n_2_is_refused_with_400_naming_n(client):
    with pytest.raises(openai.BadRequestError) as refused:
        client.completions.create(model=MODEL, prompt=GREEDY_PROMPT, max_tokens=4, n=2)
    error = refused.value
    assert (error.status_code, error.type, error.param, "n=1" in error.message) == (400, "invalid_request_error", "n", True)


def test_another_model_is_404_in_the_openai_envelope(edge_url):
    response = httpx.post(edge_url + "/v1/completions", json={"model": "gpt-4o", "prompt": "hi", "max_tokens": 4}, timeout=30)
    error = response.json()["error"]
    assert (response.status_code, error["type"], error["param"], error["code"], "gpt-4o" in error["message"]) == (
        404,
        "not_found_error",
        "model",
        "model_not_found",
        True,
    )


def test_models_lists_the_targets_id(client):
    assert [model.id for model in client.models.list()] == [MODEL]


def test_unknown_request_fields_are_ignored(client, greedy_text):
    unknown = {"frequency_penalty": 0.0, "logit_bias": {"5": 1}, "a_field_from_the_future": {"nested": [1, 2]}}
    assert _greedy(client, extra_body=unknown).choices[0].text == greedy_text


def test_health_is_ok_and_names_the_target_but_no_internal_address(urls):
    verifier_url, edge_url = urls
    response = httpx.get(edge_url + "/health", timeout=10)
    health = EdgeHealth.model_validate_json(response.content)
    assert (response.status_code, health.status, health.verifier) == (200, "ok", "ok")
    assert health.model == MODEL
    assert (health.draft_length, health.prefill_first, health.fallback) == (3, True, "error")
    # No keys configured: anyone who reaches the edge reads its /health, so the verifier's address
    # and the draft's path are left out (a caller with a valid key sees them: test_key_sessions).
    assert set(response.json()) == set(EdgeHealth.model_fields) - {"verifier_url", "draft_model"}
    assert verifier_url.removeprefix("http://") not in response.text


def test_health_is_typed_in_the_openapi_schema(edge_url):
    get = httpx.get(edge_url + "/openapi.json", timeout=10).json()["paths"]["/health"]["get"]
    schemas = {code: answer["content"]["application/json"]["schema"]["$ref"] for code, answer in get["responses"].items()}
    assert schemas == {"200": "#/components/schemas/EdgeHealth", "503": "#/components/schemas/EdgeHealth"}


def test_health_while_loading_is_503_with_the_status_alone(tiny_pair):
    app = edge_app(tiny_pair, "http://127.0.0.1:9")  # no lifespan run: the draft never loads
    response = TestClient(app, base_url="http://127.0.0.1").get("/health")
    assert (response.status_code, response.json()) == (503, {"status": "loading"})
    assert EdgeHealth.model_validate(response.json()).status == "loading"


def test_metrics_counters_increase_by_what_a_request_did(client, edge_url):
    names = ["requests", "generated_tokens", "verify_calls", "drafted_tokens", "accepted_tokens"]
    before = {name: metric_value(edge_url, f"spade_edge_{name}_total") for name in names}
    response = _greedy(client)
    after = {name: metric_value(edge_url, f"spade_edge_{name}_total") for name in names}
    spade = response.model_extra["spade"]
    expected = {
        "requests": 1,
        "generated_tokens": response.usage.completion_tokens,
        "verify_calls": spade["verify_calls"],
        "drafted_tokens": spade["drafted_tokens"],
        "accepted_tokens": spade["accepted_tokens"],
    }
    assert {name: after[name] - before[name] for name in names} == expected


def test_no_request_is_active_after_a_response(client, edge_url):
    _greedy(client, max_tokens=3)
    assert metric_value(edge_url, "spade_edge_active_requests") == 0


# The context limit ------------------------------------------------------------------------------

SHORT_CONTEXT = 32


@pytest.fixture(scope="module")
def short_context_client(tiny_pair) -> openai.OpenAI:
    """An edge in front of a verifier that allows 32 tokens of context."""
    verifier = verifier_app(tiny_pair, max_context_length=SHORT_CONTEXT)
    with serve(verifier) as verifier_url, serve(edge_app(tiny_pair, verifier_url, DRAFT_LENGTH)) as edge_url:
        yield openai.OpenAI(base_url=edge_url + "/v1", api_key="unused", max_retries=0)


def test_without_max_tokens_the_output_runs_to_the_targets_context_limit(short_context_client):
    # The last verify call feeds context + one drafted token = the whole context, and its next
    # token is emitted without being fed (regression: a 500 at the last token).
    response = short_context_client.completions.create(model=MODEL, prompt=GREEDY_PROMPT, temperature=0)
    assert (response.usage.total_tokens, response.choices[0].finish_reason) == (SHORT_CONTEXT, "length")


def test_a_budget_past_the_context_limit_is_400_context_length_exceeded(short_context_client, tokenizer):
    budget = SHORT_CONTEXT - len(tokenizer.encode(GREEDY_PROMPT)) + 1
    with pytest.raises(openai.BadRequestError) as refused:
        short_context_client.completions.create(model=MODEL, prompt=GREEDY_PROMPT, max_tokens=budget, temperature=0)
    assert refused.value.code == "context_length_exceeded"
