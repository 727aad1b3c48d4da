"""The native target-only route (``--target-route native``, the default with ``--backend vllm``):
one vLLM request per generation, streamed from vLLM's own decode loop.

Specification:
- Greedy, the native route produces the verify-steps route's tokens, logprobs and alternatives
  (one verify call with an empty block per token), for contexts around vLLM's block boundaries;
  it stops after an end token, as the verify-steps route does.
- Sampling parameters reach vLLM: one seed, one answer; top_k = 1 is the greedy answer.
- Closing the stream (a client gone, a stop string) aborts the request in vLLM: nothing is left
  running, and the verifier counts it as aborted.
- Over HTTP: streamed text and usage equal the non-streamed answer; the requests run on the
  native route (vLLM requests counted, no verify-steps forwards); stop strings and max_tokens
  as on the verify-steps route; bad requests refused with the same OpenAI envelope, status,
  param and code on both routes.
- Greedy SPADE (the edge drafting with the tiny draft, verified by the vLLM backend) equals the
  native route's output, and the verify-steps route's, on several prompts and draft lengths.
"""

from __future__ import annotations

import random
import uuid

import httpx
import openai
import pytest

from edge_support import edge_app, json_chunks, metric_value, stream_payloads
from gateway.engine import GenerationRequest
from gateway.protocol import SpadeStats
from servers import serve, wait_until
from spade_core.params import SamplingConfig
from verifier_support import ENVELOPE_KEYS, MAX_CONTEXT, error_of

pytestmark = pytest.mark.vllm

GREEDY = SamplingConfig(temperature=0.0)
# Lengths around block boundaries (block size 32): a whole-block prompt is served from the cache.
CONTEXT_LENGTHS = [1, 5, 31, 32, 33, 64, 200]
PROMPTS = ["The edge drafts", "def add(a, b):", "print(", "Tokens are", "東京", "Once upon a time"]
MAX_NEW_TOKENS = 40


def random_tokens(rng: random.Random, count: int, vocab_size: int) -> list[int]:
    return [rng.randrange(3, vocab_size) for _ in range(count)]


def generation(prompt: list[int], max_tokens: int, sampling: SamplingConfig = GREEDY, **fields) -> GenerationRequest:
    fields = {"eos_token_ids": frozenset(), **fields}
    return GenerationRequest(f"test-{uuid.uuid4().hex}", prompt, max_tokens, sampling, **fields)


async def run_engine(engine, request: GenerationRequest) -> tuple[list, SpadeStats]:
    """Every batch the engine yields, and the request's stats."""
    stats = SpadeStats()
    return [batch async for batch in engine.generate(request, stats)], stats


def tokens_of(batches) -> list[int]:
    return [token_id for batch in batches for token_id in batch.token_ids]


def aborted_count(metrics) -> float:
    return metrics.registry.get_sample_value("spade_verifier_native_aborted_total") or 0.0


@pytest.fixture(scope="module")
def engines(vllm_backend):
    """(native, verify-steps) engines on the suite's one vLLM engine, with their metrics."""
    from verifier_service.metrics import VerifierMetrics
    from verifier_service.target_engine import create_target_engine

    metrics = VerifierMetrics()
    return create_target_engine(vllm_backend, "native", metrics), create_target_engine(vllm_backend, "verify-steps", metrics), metrics


# --- the engine ---------------------------------------------------------------------------------


@pytest.mark.asyncio(loop_scope="session")
@pytest.mark.parametrize("context_length", CONTEXT_LENGTHS)
async def test_greedy_native_tokens_and_logprobs_equal_the_verify_steps_routes(engines, vllm_backend, context_length):
    native, steps, _ = engines
    prompt = random_tokens(random.Random(context_length), context_length, vllm_backend.model.vocab_size)
    request = generation(prompt, 24, num_top_logprobs=3)
    native_batches, native_stats = await run_engine(native, request)
    steps_batches, _ = await run_engine(steps, request)
    assert all(len(batch.token_ids) >= 1 for batch in native_batches)  # streamed, no empty batch
    assert tokens_of(native_batches) == tokens_of(steps_batches)
    native_logprobs = [value for batch in native_batches for value in batch.logprobs]
    steps_logprobs = [value for batch in steps_batches for value in batch.logprobs]
    assert native_logprobs == pytest.approx(steps_logprobs, abs=1e-4)
    native_top = [[token for token, _ in top] for batch in native_batches for top in batch.top_logprobs]
    steps_top = [[token for token, _ in top] for batch in steps_batches for top in batch.top_logprobs]
    assert native_top == steps_top and all(len(top) == 3 for top in native_top)
    assert native_stats.verify_calls == 24  # one vLLM forward per generated token


@pytest.mark.asyncio(loop_scope="session")
async def test_the_native_route_stops_after_an_end_token_as_the_verify_steps_route_does(engines, vllm_backend):
    native, steps, _ = engines
    prompt = random_tokens(random.Random(7), 9, vllm_backend.model.vocab_size)
    free_run = tokens_of((await run_engine(native, generation(prompt, 12)))[0])
    end_token = free_run[5]
    cut = free_run[: free_run.index(end_token) + 1]
    request = generation(prompt, 12, eos_token_ids=frozenset({end_token}))
    assert tokens_of((await run_engine(native, request))[0]) == cut
    assert tokens_of((await run_engine(steps, request))[0]) == cut


@pytest.mark.asyncio(loop_scope="session")
async def test_sampling_parameters_reach_vllm(engines, vllm_backend):
    native, _, _ = engines
    prompt = random_tokens(random.Random(8), 12, vllm_backend.model.vocab_size)
    sampled = SamplingConfig(temperature=1.5, seed=21)
    first, again = [tokens_of((await run_engine(native, generation(prompt, 20, sampled)))[0]) for _ in range(2)]
    other_seed = tokens_of((await run_engine(native, generation(prompt, 20, SamplingConfig(temperature=1.5, seed=22))))[0])
    greedy = tokens_of((await run_engine(native, generation(prompt, 20)))[0])
    top_one = tokens_of((await run_engine(native, generation(prompt, 20, SamplingConfig(temperature=1.5, top_k=1, seed=21))))[0])
    assert first == again and first != other_seed  # 20 draws at temperature 1.5 on a random model
    assert first != greedy and top_one == greedy


@pytest.mark.asyncio(loop_scope="session")
async def test_closing_the_stream_aborts_the_request_in_vllm(engines, vllm_backend):
    native, _, metrics = engines
    prompt = random_tokens(random.Random(9), 10, vllm_backend.model.vocab_size)
    aborted_before = aborted_count(metrics)
    stats = SpadeStats()
    stream = native.generate(generation(prompt, 800), stats)
    for _ in range(3):
        await anext(stream)
    assert vllm_backend.engine.get_num_unfinished_requests() == 1
    await stream.aclose()
    assert vllm_backend.engine.get_num_unfinished_requests() == 0
    assert aborted_count(metrics) == aborted_before + 1
    assert 3 <= stats.verify_calls < 800


# --- over HTTP ----------------------------------------------------------------------------------


def completion(url: str, prompt: str, **fields) -> dict:
    body = {"model": "target", "prompt": prompt, "max_tokens": MAX_NEW_TOKENS, "temperature": 0} | fields
    response = httpx.post(url + "/v1/completions", json=body, timeout=120)
    response.raise_for_status()
    return response.json()


def streamed_chat(url: str, messages: list[dict]) -> tuple[str, dict]:
    body = {"model": "target", "messages": messages, "max_tokens": MAX_NEW_TOKENS, "temperature": 0}
    chunks = json_chunks(stream_payloads(url, "/v1/chat/completions", body | {"stream_options": {"include_usage": True}}))
    text = "".join(chunk["choices"][0]["delta"].get("content") or "" for chunk in chunks if chunk["choices"])
    return text, chunks[-1]["usage"]


def test_the_native_route_streams_its_unstreamed_answer_without_verify_steps(native_verifier):
    url = native_verifier.url
    native_before = metric_value(url, "spade_verifier_native_requests_total")
    forwards_before = metric_value(url, "spade_verifier_forward_passes_total")
    for prompt in PROMPTS[:3]:
        messages = [{"role": "user", "content": prompt}]
        whole = httpx.post(
            url + "/v1/chat/completions",
            json={"model": "target", "messages": messages, "max_tokens": MAX_NEW_TOKENS, "temperature": 0},
            timeout=120,
        ).json()
        text, usage = streamed_chat(url, messages)
        assert text == whole["choices"][0]["message"]["content"] and usage == whole["usage"]
        assert usage["completion_tokens"] == whole["spade"]["verify_calls"] >= 1
    assert metric_value(url, "spade_verifier_native_requests_total") == native_before + 6
    assert metric_value(url, "spade_verifier_forward_passes_total") == forwards_before


def test_stop_strings_and_max_tokens_end_both_routes_alike(native_verifier, steps_verifier):
    free_run = completion(native_verifier.url, "Tokens are")["choices"][0]["text"]
    stop = free_run[len(free_run) // 2 : len(free_run) // 2 + 2]
    aborted_before = metric_value(native_verifier.url, "spade_verifier_native_aborted_total")
    answers = [completion(server.url, "Tokens are", stop=[stop]) for server in (native_verifier, steps_verifier)]
    assert [answer["choices"][0] for answer in answers][0] == answers[1]["choices"][0]
    assert answers[0]["choices"][0]["finish_reason"] == "stop" and stop not in answers[0]["choices"][0]["text"]
    assert metric_value(native_verifier.url, "spade_verifier_native_aborted_total") == aborted_before + 1
    short = [completion(server.url, "Tokens are", max_tokens=5) for server in (native_verifier, steps_verifier)]
    assert short[0]["choices"] == short[1]["choices"] and short[0]["usage"]["completion_tokens"] == 5


def test_a_client_gone_mid_stream_aborts_the_request_in_vllm(native_verifier):
    url, engine = native_verifier.url, native_verifier.app.state.service.backend.engine
    aborted_before = metric_value(url, "spade_verifier_native_aborted_total")
    body = {"model": "target", "prompt": "print(", "max_tokens": MAX_CONTEXT - 10, "temperature": 0, "stream": True}
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as response:
        lines = response.iter_lines()
        assert sum(1 for line, _ in zip(lines, range(4), strict=False) if line.startswith("data:")) >= 1
    assert wait_until(lambda: metric_value(url, "spade_verifier_native_aborted_total") == aborted_before + 1)
    assert wait_until(lambda: engine.get_num_unfinished_requests() == 0)


BAD_REQUESTS = {
    "unknown_model": ({"model": "nope"}, 404, "not_found_error", "model", "model_not_found"),
    "n_2": ({"n": 2}, 400, "invalid_request_error", "n", None),
    "past_the_context": ({"max_tokens": MAX_CONTEXT}, 400, "invalid_request_error", "max_tokens", "context_length_exceeded"),
    "logprobs_sampled": ({"logprobs": 2, "temperature": 0.8}, 400, "invalid_request_error", "logprobs", "logprobs_unsupported"),
    "negative_temperature": ({"temperature": -1}, 400, "invalid_request_error", "temperature", None),
    "token_above_vocab": ({"prompt": [10**6]}, 400, "invalid_request_error", "prompt", None),
}


@pytest.mark.parametrize("case", list(BAD_REQUESTS))
@pytest.mark.parametrize("stream", [False, True])
def test_bad_requests_are_refused_alike_on_both_routes(native_verifier, steps_verifier, case, stream):
    change, status, error_type, param, code = BAD_REQUESTS[case]
    body = {"model": "target", "prompt": "hi", "max_tokens": 4, "stream": stream} | change
    refusals = [error_of(httpx.post(server.url + "/v1/completions", json=body, timeout=60)) for server in (native_verifier, steps_verifier)]
    assert refusals[0] == refusals[1]
    assert refusals[0][:3] == (status, ENVELOPE_KEYS, error_type) and refusals[0][3] == param
    if code is not None:
        assert refusals[0][4] == code


@pytest.mark.parametrize("draft_length", [1, 4, 8])
def test_greedy_spade_output_equals_both_target_only_routes(vllm_pair, native_verifier, steps_verifier, draft_length):
    """The edge verified by the native-route verifier; the reference texts from each route."""
    native = [completion(native_verifier.url, prompt)["choices"][0]["text"] for prompt in PROMPTS]
    steps = [completion(steps_verifier.url, prompt)["choices"][0]["text"] for prompt in PROMPTS]
    with serve(edge_app(vllm_pair, native_verifier.url, draft_length=draft_length)) as edge_url:
        edge = openai.OpenAI(base_url=edge_url + "/v1", api_key="unused", max_retries=0)
        spade = [
            edge.completions.create(model="target", prompt=prompt, max_tokens=MAX_NEW_TOKENS, temperature=0).choices[0].text
            for prompt in PROMPTS
        ]
    assert spade == steps  # the promise by construction
    assert spade == native  # the promise on vLLM's own decode loop (tested, not constructed)
