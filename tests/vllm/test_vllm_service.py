"""The verifier service with ``backend="vllm"``: the same wire answers as with transformers, and
the edge's temperature-0 output through it equals vLLM's own greedy output.

The verifier is built exactly as ``spade-verifier --backend vllm`` builds it (its own engine,
started in the app's lifespan) and served by uvicorn on a loopback port. It is checked against
a plain transformers forward of the same fp32 target: greedy verdicts on fresh and follow-up
calls, the empty block (the edge's prompt-only first call), replayed retries, and every bad call
of the transformers suite's table refused with the same status, envelope, param and code. End to
end, the edge agent (drafting with the tiny draft model) serves completions whose text equals
vLLM's greedy generation of the same prompt, with the prompt-only first call and without.
"""

from __future__ import annotations

import random

import httpx
import openai
import pytest

from bad_input_support import AT_THE_LIMIT, BAD_VERIFY_CALLS, complete_past_the_limit, outcome, verify_past_the_limit
from edge_support import edge_app
from servers import serve
from verifier_service.protocol import WIRE_VERSION
from verifier_support import (
    ENVELOPE_KEYS,
    MAX_CONTEXT,
    committed_after,
    corrupted,
    error_of,
    greedy_continuation,
    plain_forward_logits,
    post_verify,
    random_tokens,
    reference_verdict,
    verify,
    verify_body,
)

pytestmark = pytest.mark.vllm

PROMPTS = ["The edge drafts", "def add(a, b):", "print(", "Tokens are", "東京"]
MAX_NEW_TOKENS = 40


@pytest.fixture(scope="module")
def verifier_url(native_verifier):
    """The transformers suite's app settings (max context, draft and support limits), vLLM backend
    (its default target-only route, native; the server is shared with test_vllm_native)."""
    return native_verifier.url


@pytest.fixture(scope="module")
def client(verifier_url):
    with httpx.Client(base_url=verifier_url, timeout=60) as client:
        yield client


@pytest.fixture(scope="module")
def model(hf_target):
    return hf_target.model


@pytest.fixture(scope="module")
def vocab_size(hf_target) -> int:
    return hf_target.model.get_output_embeddings().weight.shape[0]


def test_health_names_the_vllm_backend(client, vocab_size):
    health = client.get("/health").json()
    # One token short of --max-context-length (vLLM's max_model_len): room for the returned token.
    assert (health["backend"], health["vocab_size"], health["max_context_length"]) == ("vllm", vocab_size, MAX_CONTEXT - 1)
    assert health["wire_version"] == WIRE_VERSION


@pytest.mark.parametrize(("over", "status", "code"), AT_THE_LIMIT)
def test_the_context_limit_is_the_transformers_backends_rule(client, vocab_size, over, status, code):
    """At the limit /health states, both routes serve; one token past it, a 400 (was a 500)."""
    assert outcome(verify_past_the_limit(client, vocab_size, over), "draft_tokens") == (status, code)
    assert outcome(complete_past_the_limit(client, vocab_size, over), "max_tokens") == (status, code)


def test_an_empty_block_answers_the_targets_next_token_and_blocks_follow_it(client, model, vocab_size):
    """The edge's prompt-only first call, then greedy blocks through the session."""
    rng = random.Random(40)
    context = random_tokens(rng, 37, vocab_size)
    answer = verify(client, verify_body("svc-empty", [], [], new_tokens=context))
    assert (answer["num_accepted"], answer["next_token"]) == reference_verdict(model, context, [])
    assert (answer["next_token_kind"], answer["context_length"]) == ("bonus", len(context) + 1)
    context = held = committed_after(context, [], answer)
    for corrupt_at in (4, 1):
        block = corrupted(greedy_continuation(model, context, 4), corrupt_at, vocab_size, rng)
        answer = verify(client, verify_body("svc-empty", held, block))
        assert (answer["num_accepted"], answer["next_token"]) == reference_verdict(model, context, block)
        context = held = committed_after(context, block, answer)


@pytest.mark.parametrize("corrupt_at", [0, 2, 4])
def test_greedy_calls_match_a_plain_forward(client, model, vocab_size, corrupt_at):
    rng = random.Random(corrupt_at)
    context = random_tokens(rng, 20, vocab_size)
    session_id = f"svc-{corrupt_at}"
    held: list[int] = []
    for _ in range(3):  # a fresh call, then follow-ups through the session
        block = corrupted(greedy_continuation(model, context, 4), corrupt_at, vocab_size, rng)
        answer = verify(client, verify_body(session_id, held, block, new_tokens=context[len(held) :]))
        assert (answer["num_accepted"], answer["next_token"]) == reference_verdict(model, context, block)
        context = held = committed_after(context, block, answer)


def test_retried_sampled_call_is_replayed_with_the_same_answer(client, vocab_size):
    context = random_tokens(random.Random(3), 12, vocab_size)
    body = verify_body("svc-retry", [], [5, 6, 7], new_tokens=context, sampling={"temperature": 0.9, "seed": 8})
    first, again = verify(client, body), verify(client, body)
    assert again["replayed"] and (again["num_accepted"], again["next_token"]) == (first["num_accepted"], first["next_token"])


@pytest.mark.parametrize("case", list(BAD_VERIFY_CALLS))
def test_bad_verify_call_is_refused_like_the_transformers_backend(client, vocab_size, case):
    bad = BAD_VERIFY_CALLS[case]
    context = random_tokens(random.Random(24), 8, vocab_size)
    opened = verify(client, verify_body(f"svc-bad-{case}", [], [5], new_tokens=context))
    held = committed_after(context, [5], opened)
    response = post_verify(client, bad.change(verify_body(f"svc-bad-{case}", held, [5]), vocab_size))
    assert error_of(response) == (400, ENVELOPE_KEYS, "invalid_request_error", bad.param, bad.code)


def test_logprobs_are_served_greedy_only_on_the_sample_match_route(client, verifier_url, model, vocab_size):
    """The default route (sample_match) reports logprobs at temperature 0 and refuses them
    above, on the wire and on the OpenAI routes (400 before any stream starts)."""
    assert client.get("/health").json()["logprobs_support"] == "greedy"
    context = random_tokens(random.Random(5), 12, vocab_size)
    body = verify_body("svc-logprobs", [], [5, 6], new_tokens=context) | {"num_top_logprobs": 2}
    refused = post_verify(client, body | {"sampling": {"temperature": 0.9, "seed": 1}})
    assert error_of(refused) == (400, ENVELOPE_KEYS, "invalid_request_error", "num_top_logprobs", "logprobs_unsupported")
    answer = verify(client, body)
    emitted = [5, 6][: answer["num_accepted"]] + [answer["next_token"]]
    rows = plain_forward_logits(model, context + [5, 6])[len(context) - 1 :].log_softmax(dim=-1)
    assert answer["logprobs"] == pytest.approx([float(rows[index, token]) for index, token in enumerate(emitted)], abs=1e-3)
    assert [top["token_ids"] for top in answer["top_logprobs"]] == [rows[index].topk(2).indices.tolist() for index in range(len(emitted))]
    chat = {"model": "target", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "logprobs": True}
    for stream in (False, True):
        response = httpx.post(verifier_url + "/v1/chat/completions", json=chat | {"temperature": 0.7, "stream": stream}, timeout=60)
        assert (response.status_code, response.json()["error"]["param"]) == (400, "logprobs")
    greedy = httpx.post(verifier_url + "/v1/chat/completions", json=chat | {"temperature": 0}, timeout=60)
    assert greedy.status_code == 200 and len(greedy.json()["choices"][0]["logprobs"]["content"]) >= 1


async def vllm_greedy_text(backend, tokenizer, prompt: str) -> str:
    """vLLM's own greedy generation of ``prompt`` (stopping at EOS), decoded."""
    from vllm import SamplingParams

    params = SamplingParams(
        temperature=0.0, max_tokens=MAX_NEW_TOKENS, detokenize=False, stop_token_ids=sorted(backend.model.eos_token_ids)
    )
    output = await backend.generate_tokens(tokenizer(prompt)["input_ids"], params)
    return tokenizer.decode(output.outputs[0].token_ids, skip_special_tokens=True)


@pytest.mark.asyncio(loop_scope="session")
@pytest.mark.parametrize(
    ("draft_length", "prefill_first"), [(1, True), (4, True), (8, True), (4, False)], ids=["1", "4", "8", "4-block-first"]
)
async def test_edge_greedy_output_equals_vllm_greedy_output(vllm_backend, hf_target, vllm_pair, verifier_url, draft_length, prefill_first):
    """With the prompt-only first call (the default) and with a drafted first block."""
    expected = [await vllm_greedy_text(vllm_backend, hf_target.tokenizer, prompt) for prompt in PROMPTS]
    with serve(edge_app(vllm_pair, verifier_url, draft_length=draft_length, prefill_first=prefill_first)) as edge_url:
        edge = openai.OpenAI(base_url=edge_url + "/v1", api_key="unused", max_retries=0)
        outputs = [
            edge.completions.create(model="target", prompt=prompt, max_tokens=MAX_NEW_TOKENS, temperature=0).choices[0].text
            for prompt in PROMPTS
        ]
    assert outputs == expected
