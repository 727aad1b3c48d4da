"""The verifier's OpenAI routes (target-only decoding) through the real ``openai`` client, sync
and async, streamed and not, against a real server on loopback.

Greedy outputs are compared with the target's own greedy tokens from plain forwards. The tiny
BPE model emits arbitrary bytes, so expected texts are always ``tokenizer.decode`` of those
tokens, never literals.
"""

from __future__ import annotations

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from servers import serve
from verifier_service.app import create_app
from verifier_service.settings import VerifierSettings
from verifier_support import greedy_continuation, sse_payloads

PROMPT = "def add(a, b):"
MESSAGES = [{"role": "user", "content": "Say something."}]
NUM_TOKENS = 12
SAMPLED = {"temperature": 1.0, "seed": 7}


@pytest.fixture(scope="module")
def verifier_url(tiny_pair):
    with serve(create_app(VerifierSettings(model=str(tiny_pair.target_dir)))) as url:
        yield url


@pytest.fixture(scope="module")
def client(verifier_url):
    return openai.OpenAI(base_url=verifier_url + "/v1", api_key="unused", max_retries=0)


def async_client(verifier_url: str) -> openai.AsyncOpenAI:
    """Made inside each async test: a client belongs to the event loop it first runs on."""
    return openai.AsyncOpenAI(base_url=verifier_url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def model_id(tiny_pair) -> str:
    return tiny_pair.target_id


@pytest.fixture(scope="module")
def tokenizer(target_model):
    return target_model.tokenizer


def greedy_ids(target_model, prompt_ids: list[int]) -> list[int]:
    eos_ids = frozenset({target_model.tokenizer.eos_token_id})
    token_ids = greedy_continuation(target_model.model, prompt_ids, NUM_TOKENS, stop_ids=eos_ids)
    assert len(token_ids) == NUM_TOKENS and not eos_ids & set(token_ids)  # the prompts run to the budget
    return token_ids


@pytest.fixture(scope="module")
def completion_greedy_ids(target_model, tokenizer) -> list[int]:
    return greedy_ids(target_model, tokenizer.encode(PROMPT))


@pytest.fixture(scope="module")
def chat_greedy_ids(target_model, tokenizer) -> list[int]:
    prompt = tokenizer.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    return greedy_ids(target_model, tokenizer.encode(prompt, add_special_tokens=False))


@pytest.fixture(scope="module")
def completion_greedy_text(tokenizer, completion_greedy_ids) -> str:
    return tokenizer.decode(completion_greedy_ids, skip_special_tokens=True)


@pytest.fixture(scope="module")
def chat_greedy_text(tokenizer, chat_greedy_ids) -> str:
    return tokenizer.decode(chat_greedy_ids, skip_special_tokens=True)


GREEDY_REQUEST = {"model": "target", "max_tokens": NUM_TOKENS, "temperature": 0.0}


def complete(client, **overrides):
    return client.completions.create(**(GREEDY_REQUEST | {"prompt": PROMPT} | overrides))


def chat(client, **overrides):
    return client.chat.completions.create(**(GREEDY_REQUEST | {"messages": MESSAGES} | overrides))


# --- non-streamed -----------------------------------------------------------------------------


def test_greedy_completion_is_the_targets_greedy_text(client, completion_greedy_text):
    assert complete(client).choices[0].text == completion_greedy_text


def test_greedy_chat_is_the_targets_greedy_text(client, chat_greedy_text):
    assert chat(client).choices[0].message.content == chat_greedy_text


def test_max_tokens_is_exact(client):
    completion = complete(client, max_tokens=5)
    assert (completion.usage.completion_tokens, completion.choices[0].finish_reason) == (5, "length")


def test_usage_counts_the_prompt_tokens(client, tokenizer):
    usage, num_prompt_tokens = complete(client).usage, len(tokenizer.encode(PROMPT))
    assert (usage.prompt_tokens, usage.total_tokens) == (num_prompt_tokens, num_prompt_tokens + NUM_TOKENS)


def test_chat_response_names_the_model_and_the_assistant_role(client, model_id):
    response = chat(client)
    described = (response.object, response.model, response.choices[0].message.role)
    assert described == ("chat.completion", model_id, "assistant")


def test_greedy_output_is_the_same_with_and_without_a_seed(client):
    assert complete(client, seed=3).choices[0].text == complete(client).choices[0].text


def test_seeded_sampling_is_reproducible(client):
    assert complete(client, **SAMPLED).choices[0].text == complete(client, **SAMPLED).choices[0].text


def test_different_seeds_sample_different_texts(client):
    assert len({complete(client, temperature=1.0, seed=seed).choices[0].text for seed in range(4)}) > 1


# --- EOS ------------------------------------------------------------------------------------

EOS_PROMPT = [350, 304, 217, 299]
"""Token ids after which the tiny target's greedy continuation ends with EOS as its fifth token."""


@pytest.fixture(scope="module")
def eos_greedy_ids(target_model) -> list[int]:
    eos_id = target_model.tokenizer.eos_token_id
    token_ids = greedy_continuation(target_model.model, EOS_PROMPT, NUM_TOKENS, stop_ids=frozenset({eos_id}))
    assert token_ids[-1] == eos_id  # the premise of the EOS tests
    return token_ids


def test_generation_ends_at_eos_with_finish_reason_stop(client, eos_greedy_ids):
    assert complete(client, prompt=EOS_PROMPT).choices[0].finish_reason == "stop"


def test_eos_counts_as_a_completion_token_but_adds_no_text(client, tokenizer, eos_greedy_ids):
    completion = complete(client, prompt=EOS_PROMPT)
    expected = (len(eos_greedy_ids), tokenizer.decode(eos_greedy_ids[:-1]))
    assert (completion.usage.completion_tokens, completion.choices[0].text) == expected


# --- stop strings -----------------------------------------------------------------------------


def spanning_stop(tokenizer, token_ids: list[int]) -> tuple[str, int]:
    """A two-letter stop string made of the last character of one token's text and the first
    of the next's, whose first occurrence in the text is at that boundary; and that index."""
    text = tokenizer.decode(token_ids)
    for boundary in range(1, len(token_ids)):
        left, right = tokenizer.decode(token_ids[:boundary]), tokenizer.decode(token_ids[boundary : boundary + 1])
        if left and right and text.startswith(left) and (left[-1] + right[0]).isalnum():
            stop = left[-1] + right[0]
            if text.find(stop) == len(left) - 1:
                return stop, len(left) - 1
    raise AssertionError(f"no two-letter stop spans a token boundary in {text!r}")


def test_completion_stops_before_a_stop_string_spanning_tokens(client, tokenizer, completion_greedy_ids, completion_greedy_text):
    stop, index = spanning_stop(tokenizer, completion_greedy_ids)
    choice = complete(client, stop=[stop]).choices[0]
    assert (choice.text, choice.finish_reason) == (completion_greedy_text[:index], "stop")


def test_streamed_completion_stops_before_a_stop_string_without_leaking_it(
    client, tokenizer, completion_greedy_ids, completion_greedy_text
):
    stop, index = spanning_stop(tokenizer, completion_greedy_ids)
    chunks = list(complete(client, stop=stop, stream=True))
    assert "".join(chunk.choices[0].text for chunk in chunks) == completion_greedy_text[:index]


def test_chat_stops_before_a_stop_string_spanning_tokens(client, tokenizer, chat_greedy_ids, chat_greedy_text):
    stop, index = spanning_stop(tokenizer, chat_greedy_ids)
    choice = chat(client, stop=[stop]).choices[0]
    assert (choice.message.content, choice.finish_reason) == (chat_greedy_text[:index], "stop")


def test_earliest_of_several_stop_strings_wins(client, tokenizer, completion_greedy_ids, completion_greedy_text):
    stop, index = spanning_stop(tokenizer, completion_greedy_ids)
    later = completion_greedy_text[index + 2 : index + 4]
    assert complete(client, stop=[later, stop]).choices[0].text == completion_greedy_text[:index]


# --- streamed: OpenAI's chunk rules, one assertion each ---------------------------------------


@pytest.fixture(scope="module")
def chat_chunks(client) -> list:
    return list(chat(client, stream=True, stream_options={"include_usage": True}))


@pytest.fixture(scope="module")
def completion_chunks(client) -> list:
    return list(complete(client, stream=True, stream_options={"include_usage": True}))


def test_first_chat_chunk_carries_only_the_role(chat_chunks):
    delta = chat_chunks[0].choices[0].delta
    assert (delta.role, delta.content, chat_chunks[0].choices[0].finish_reason) == ("assistant", None, None)


def test_no_later_chat_chunk_carries_the_role(chat_chunks):
    roles = [chunk.choices[0].delta.role for chunk in chat_chunks[1:] if chunk.choices]
    assert roles == [None] * len(roles)


def test_all_chat_chunks_share_one_id(chat_chunks):
    assert len({chunk.id for chunk in chat_chunks}) == 1


def test_all_completion_chunks_share_one_id(completion_chunks):
    assert len({chunk.id for chunk in completion_chunks}) == 1


def test_chat_finish_chunk_has_the_finish_reason_and_no_content(chat_chunks):
    finish = chat_chunks[-2].choices[0]
    assert (finish.finish_reason, finish.delta.content) == ("length", None)


def test_only_the_finish_chunk_has_a_finish_reason(chat_chunks):
    reasons = [chunk.choices[0].finish_reason for chunk in chat_chunks if chunk.choices]
    assert reasons == [None] * (len(reasons) - 1) + ["length"]


def test_completion_finish_chunk_has_the_finish_reason_and_no_text(completion_chunks):
    finish = completion_chunks[-2].choices[0]
    assert (finish.finish_reason, finish.text) == ("length", "")


def test_usage_comes_last_with_empty_choices(chat_chunks):
    last = chat_chunks[-1]
    assert (last.choices, last.usage.completion_tokens) == ([], NUM_TOKENS)


def test_only_the_last_chunk_carries_usage(chat_chunks):
    assert [chunk.usage is not None for chunk in chat_chunks] == [False] * (len(chat_chunks) - 1) + [True]


def test_streamed_chat_content_equals_the_greedy_text(chat_chunks, chat_greedy_text):
    assert "".join(chunk.choices[0].delta.content or "" for chunk in chat_chunks if chunk.choices) == chat_greedy_text


def test_streamed_completion_text_equals_the_greedy_text(completion_chunks, completion_greedy_text):
    assert "".join(chunk.choices[0].text for chunk in completion_chunks if chunk.choices) == completion_greedy_text


def test_stream_without_include_usage_ends_with_the_finish_chunk(client):
    chunks = list(chat(client, stream=True))
    assert (chunks[-1].choices[0].finish_reason, chunks[-1].usage) == ("length", None)


@pytest.mark.parametrize(
    "route,body",
    [
        ("/v1/chat/completions", {"messages": MESSAGES}),
        ("/v1/completions", {"prompt": PROMPT}),
    ],
)
def test_stream_ends_with_done(verifier_url, route, body):
    request = {"model": "target", "max_tokens": 3, "temperature": 0.0, "stream": True} | body
    with httpx.stream("POST", verifier_url + route, json=request, timeout=60) as response:
        payloads = sse_payloads(response.iter_lines())
    assert (payloads[-1], payloads.count("[DONE]")) == ("[DONE]", 1)


# --- the async client -------------------------------------------------------------------------


async def test_async_greedy_chat_is_the_targets_greedy_text(verifier_url, chat_greedy_text):
    async with async_client(verifier_url) as client:
        response = await client.chat.completions.create(**(GREEDY_REQUEST | {"messages": MESSAGES}))
    assert response.choices[0].message.content == chat_greedy_text


async def test_async_streamed_completion_is_the_targets_greedy_text(verifier_url, completion_greedy_text):
    async with async_client(verifier_url) as client:
        stream = await client.completions.create(**(GREEDY_REQUEST | {"prompt": PROMPT, "stream": True}))
        text = "".join([chunk.choices[0].text async for chunk in stream if chunk.choices])
    assert text == completion_greedy_text


async def test_async_streamed_chat_is_the_targets_greedy_text(verifier_url, chat_greedy_text):
    async with async_client(verifier_url) as client:
        stream = await client.chat.completions.create(**(GREEDY_REQUEST | {"messages": MESSAGES, "stream": True}))
        text = "".join([chunk.choices[0].delta.content or "" async for chunk in stream if chunk.choices])
    assert text == chat_greedy_text


# --- errors through the client ----------------------------------------------------------------


def test_unknown_model_raises_not_found(client):
    with pytest.raises(openai.NotFoundError) as raised:
        complete(client, model="nope")
    assert raised.value.body["code"] == "model_not_found"


def test_n_2_raises_bad_request(client):
    with pytest.raises(openai.BadRequestError) as raised:
        complete(client, n=2)
    assert raised.value.body["param"] == "n"


# --- models and metrics -----------------------------------------------------------------------


def test_models_lists_the_served_model(client, model_id):
    assert [model.id for model in client.models.list()] == [model_id]


VERIFIER_COUNTERS = [
    "verify_calls",
    "replayed_calls",
    "resyncs",
    "forward_passes",
    "target_tokens",
    "drafted_tokens",
    "accepted_tokens",
    "generated_tokens",
    "model_forwards",
    "model_forward_rows",
    "cut_blocks",
    "cut_tokens",
    "continued_tokens",
    "ahead_steps",  # --step-ahead-tokens: 0 here
    "ahead_tokens",
    "ahead_answers",
    "ahead_drafts",
    "pipeline_tokens",  # --pipelined-sessions: 0 here
    "pipeline_proposals",
    "native_requests",  # vLLM's own decode loop (--target-route native): 0 here
    "native_aborted",
    "prompt_tokens",
    "prefix_hit_tokens",
]


def metric_samples(verifier_url: str) -> dict[str, float]:
    text = httpx.get(verifier_url + "/metrics", timeout=10).text
    return {sample.name: sample.value for family in text_string_to_metric_families(text) for sample in family.samples}


def test_metrics_expose_the_verifier_counters(verifier_url):
    names = {name for name in metric_samples(verifier_url) if name.startswith("spade_verifier_")}
    names = {name for name in names if name.endswith("_total")}
    assert names == {f"spade_verifier_{counter}_total" for counter in VERIFIER_COUNTERS}


def test_target_only_decoding_counts_one_forward_pass_per_token(client, verifier_url):
    before = metric_samples(verifier_url)["spade_verifier_forward_passes_total"]
    complete(client, max_tokens=5)
    assert metric_samples(verifier_url)["spade_verifier_forward_passes_total"] - before == 5
