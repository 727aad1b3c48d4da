"""OpenAI ``logprobs`` / ``top_logprobs`` on both services, chat and completions, streamed and not.

Specification:
- Values are the target's (``spade_core.sampling.reported_logprobs``): at temperature 0 the raw
  log-softmax of its logits, equal to a plain forward of the tiny fp32 target; at temperature > 0
  the log of ``processed_probs`` (temperature / top-k / top-p), tokens those remove never listed.
- The edge reports what the verifier's target-only route reports for the same greedy request:
  the same tokens, logprobs within 2e-5 (relative 3e-5 below -1: a block forward and a
  one-token forward differ in the last float bits).
- ``top_logprobs``: the requested number, most likely first; the chosen token's entry, when
  listed, holds exactly its logprob. ``token`` is the id decoded alone, ``bytes`` its own bytes
  (the bytes of a chunk's tokens join into its text, even where a character spans tokens).
- Streamed and non-streamed answers to one seeded request report the same tokens and values;
  each content chunk reports the tokens whose text it completes; tokens cut by a stop string and
  the EOS token are not reported (scripted engine, exact chunks).
- Not asked: ``logprobs`` null everywhere, no verify call asks, no logprob is computed.
- Bad values are 400s naming the param; a service that cannot report exact values refuses
  (400) instead; the edge's ``--fallback draft`` never serves a request that asked.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace

import httpx
import openai
import pytest
import torch
from fastapi import FastAPI

import verifier_service.backends.transformers.backend as transformers_backend
import verifier_service.backends.transformers.runner as transformers_runner
from edge_agent.app import build_engine
from edge_agent.metrics import EdgeMetrics
from edge_agent.settings import EdgeSettings
from edge_support import edge_app, verifier_app
from gateway.engine import GeneratedTokens, GenerationRequest, LogprobsSupport
from gateway.logprobs import TokenSpan, TokenSpans, token_bytes, token_text
from gateway.model import ModelDescription
from gateway.prompts import chat_prompt_ids, text_prompt_ids
from gateway.protocol import SpadeStats
from gateway.text import REPLACEMENT_CHAR
from gateway_support import gateway_app
from servers import serve
from spade_core.params import SamplingConfig
from spade_core.sampling import processed_probs
from spade_models.tiny import TinyPairSpec, build_tokenizer
from verifier_support import greedy_continuation, plain_forward_logits, running_client
from verifier_support import verifier_app as small_verifier_app

MODEL = "target"
SERVICES = ["verifier", "edge"]
CHAT = [{"role": "user", "content": "Tell me about the edge"}]
UNICODE_CHAT = [{"role": "user", "content": "café"}]
"""Its greedy answer holds characters split over several byte-level tokens."""
GREEDY = dict(temperature=0.0)
SEEDED = dict(temperature=0.8, top_k=3, top_p=0.9, seed=7)
"""top_k 3 < the 5 alternatives asked: the filters must show in what is listed."""
PLAIN_FORWARD_TOLERANCE = 1e-4
"""Against a plain transformers forward: the verifier's CPU kernels (--fast-kernels, on by
default) and its KV cache round differently in the last float bits (~1e-5 seen)."""
EDGE_TOLERANCE = dict(abs=2e-5, rel=3e-5)
"""Edge against verifier: a block forward and a one-token forward differ in the last float bits.
Measured (8 prompts x 40 greedy tokens x 6 values): at most 1.0e-5 apart for logprobs above -1,
at most 1.5e-5 relative below; twice that here."""


@pytest.fixture(scope="module")
def urls(tiny_pair) -> dict[str, str]:
    with serve(verifier_app(tiny_pair)) as verifier_url, serve(edge_app(tiny_pair, verifier_url, 3)) as edge_url:
        yield {"verifier": verifier_url, "edge": edge_url}


@pytest.fixture(scope="module")
def clients(urls) -> dict[str, openai.OpenAI]:
    return {name: openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0) for name, url in urls.items()}


@pytest.fixture(scope="module")
def tokenizer(target_model):
    return target_model.tokenizer


@pytest.fixture(scope="module")
def id_of_bytes(tokenizer, target_model) -> dict[bytes, int]:
    """Token bytes -> token id: a reported token's ``bytes`` name it exactly."""
    vocab_size = target_model.model.get_output_embeddings().weight.shape[0]
    table = {bytes(token_bytes(tokenizer, token_id, token_text(tokenizer, token_id))): token_id for token_id in range(vocab_size)}
    if len(table) != vocab_size:
        raise ValueError("two tokens of the tiny vocabulary share their bytes")
    return table


# --- reading answers -----------------------------------------------------------------------------


@dataclass
class ChatAnswer:
    text: str
    entries: list[dict]
    """logprobs.content, all chunks joined."""
    chunks: list[tuple[str, list[dict]]] = field(default_factory=list)
    """Streamed: (text, logprobs.content) of each content chunk."""


def with_extensions(request: dict) -> dict:
    """``top_k`` is our extension: the SDK sends it in ``extra_body``."""
    if "top_k" not in request:
        return request
    return {name: value for name, value in request.items() if name != "top_k"} | {"extra_body": {"top_k": request["top_k"]}}


def ask_chat(client: openai.OpenAI, stream: bool, messages=CHAT, **request) -> ChatAnswer:
    request = with_extensions(dict(model=MODEL, messages=messages, logprobs=True) | request)
    if not stream:
        choice = client.chat.completions.create(**request).choices[0]
        return ChatAnswer(choice.message.content, [entry.model_dump() for entry in choice.logprobs.content])
    answer = ChatAnswer("", [])
    for chunk in client.chat.completions.create(stream=True, **request):
        choice = chunk.choices[0]
        if choice.delta.content is None:  # the role and finish chunks report nothing
            assert choice.logprobs is None
            continue
        entries = [entry.model_dump() for entry in choice.logprobs.content]
        answer.chunks.append((choice.delta.content, entries))
        answer.text += choice.delta.content
        answer.entries += entries
    return answer


def ask_completion(client: openai.OpenAI, stream: bool, **request) -> tuple[str, dict]:
    """(text, logprobs with the chunks' lists joined)."""
    request = with_extensions(dict(model=MODEL) | request)
    if not stream:
        choice = client.completions.create(**request).choices[0]
        return choice.text, choice.logprobs.model_dump()
    text, joined = "", {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for chunk in client.completions.create(stream=True, **request):
        choice = chunk.choices[0]
        text += choice.text
        if choice.finish_reason is not None:
            assert choice.logprobs is None
            continue
        for name, values in choice.logprobs.model_dump().items():
            joined[name] += values
    return text, joined


def token_ids_of(entries: list[dict], id_of_bytes: dict[bytes, int]) -> list[int]:
    return [id_of_bytes[bytes(entry["bytes"])] for entry in entries]


def target_rows(model, prompt: list[int], output: list[int]) -> torch.Tensor:
    """[len(output), vocab] fp32 logits of the target at each output position (plain forward)."""
    return plain_forward_logits(model, prompt + output)[len(prompt) - 1 : len(prompt) - 1 + len(output)]


def described(tokenizer, token_ids: list[int]) -> list[tuple[str, list[int]]]:
    return [(token_text(tokenizer, token_id), token_bytes(tokenizer, token_id, token_text(tokenizer, token_id))) for token_id in token_ids]


# --- values --------------------------------------------------------------------------------------


@pytest.mark.parametrize("service", SERVICES)
def test_greedy_chat_logprobs_are_the_target_log_softmax(clients, service, target_model, tokenizer, id_of_bytes):
    answer = ask_chat(clients[service], False, max_tokens=10, top_logprobs=4, **GREEDY)
    token_ids = token_ids_of(answer.entries, id_of_bytes)
    prompt = chat_prompt_ids(tokenizer, CHAT)
    log_probs = torch.log_softmax(target_rows(target_model.model, prompt, token_ids), dim=-1)
    assert len(token_ids) == 10
    assert token_ids == log_probs.argmax(dim=-1).tolist()  # greedy: each token is the target's argmax
    assert [(entry["token"], entry["bytes"]) for entry in answer.entries] == described(tokenizer, token_ids)
    for row, (entry, token_id) in enumerate(zip(answer.entries, token_ids, strict=True)):
        assert entry["logprob"] == pytest.approx(float(log_probs[row, token_id]), abs=PLAIN_FORWARD_TOLERANCE)
        top = torch.topk(log_probs[row], 4)
        listed = entry["top_logprobs"]
        assert [(item["token"], item["bytes"]) for item in listed] == described(tokenizer, top.indices.tolist())
        assert [item["logprob"] for item in listed] == pytest.approx(top.values.tolist(), abs=PLAIN_FORWARD_TOLERANCE)


@pytest.mark.parametrize("service", SERVICES)
def test_greedy_completion_logprobs_are_the_target_log_softmax(clients, service, target_model, tokenizer):
    prompt_text = "The edge drafts"
    text, logprobs = ask_completion(clients[service], False, prompt=prompt_text, max_tokens=8, logprobs=3, **GREEDY)
    prompt = text_prompt_ids(tokenizer, prompt_text)
    token_ids = greedy_continuation(target_model.model, prompt, 8)
    assert text == tokenizer.decode(token_ids)
    log_probs = torch.log_softmax(target_rows(target_model.model, prompt, token_ids), dim=-1)
    assert logprobs["tokens"] == [token_text(tokenizer, token_id) for token_id in token_ids]
    expected_logprobs = [float(log_probs[row, token_id]) for row, token_id in enumerate(token_ids)]
    assert logprobs["token_logprobs"] == pytest.approx(expected_logprobs, abs=PLAIN_FORWARD_TOLERANCE)
    # Its answer splits characters over tokens: a token inside a character starts where it does.
    assert logprobs["text_offset"] == [len(tokenizer.decode(token_ids[:index]).rstrip(REPLACEMENT_CHAR)) for index in range(8)]
    assert len(set(logprobs["text_offset"])) < 8
    for row, (token_id, by_text) in enumerate(zip(token_ids, logprobs["top_logprobs"], strict=True)):
        top = torch.topk(log_probs[row], 3)
        expected = {token_text(tokenizer, token_id): float(log_probs[row, token_id])}
        for alternative, value in zip(top.indices.tolist(), top.values.tolist(), strict=True):
            expected.setdefault(token_text(tokenizer, alternative), value)
        assert list(by_text) == list(expected)  # the chosen token first (OpenAI's legacy shape)
        assert list(by_text.values()) == pytest.approx(list(expected.values()), abs=PLAIN_FORWARD_TOLERANCE)


@pytest.mark.parametrize("service", SERVICES)
def test_seeded_logprobs_are_the_log_of_the_sampled_distribution(clients, service, target_model, tokenizer, id_of_bytes):
    answer = ask_chat(clients[service], False, max_tokens=12, top_logprobs=5, **SEEDED)
    token_ids = token_ids_of(answer.entries, id_of_bytes)
    config = SamplingConfig(**SEEDED)
    probs = processed_probs(target_rows(target_model.model, chat_prompt_ids(tokenizer, CHAT), token_ids), config)
    num_listed = []
    for row, (entry, token_id) in enumerate(zip(answer.entries, token_ids, strict=True)):
        assert probs[row, token_id] > 0
        assert entry["logprob"] == pytest.approx(float(probs[row, token_id].log()), abs=PLAIN_FORWARD_TOLERANCE)
        kept = int((probs[row] > 0).sum())
        top = torch.topk(probs[row], min(5, kept))
        listed = entry["top_logprobs"]
        assert [item["bytes"] for item in listed] == [item[1] for item in described(tokenizer, top.indices.tolist())]
        assert [item["logprob"] for item in listed] == pytest.approx(top.values.log().tolist(), abs=PLAIN_FORWARD_TOLERANCE)
        num_listed.append(len(listed))
    assert len(token_ids) >= 8 and max(num_listed) <= 3  # top_k 3: never 5, what it removed is not listed


@pytest.mark.parametrize("sampling", [GREEDY, SEEDED], ids=["greedy", "seeded"])
@pytest.mark.parametrize("top_logprobs", [0, 1, 5, 20])
@pytest.mark.parametrize("service", SERVICES)
def test_top_logprobs_are_sorted_of_the_asked_length_and_hold_the_chosen_value(clients, service, top_logprobs, sampling):
    answer = ask_chat(clients[service], False, max_tokens=6, top_logprobs=top_logprobs, **sampling)
    assert answer.entries
    for entry in answer.entries:
        listed = entry["top_logprobs"]
        values = [item["logprob"] for item in listed]
        assert values == sorted(values, reverse=True)
        if sampling is GREEDY:
            assert len(listed) == top_logprobs
            assert not listed or listed[0]["bytes"] == entry["bytes"]  # greedy: the chosen is the most likely
        else:  # top_k 3: never more than 3
            assert (len(listed) == 0) if top_logprobs == 0 else (1 <= len(listed) <= min(top_logprobs, 3))
        assert all(value <= 0 for value in values) and entry["logprob"] <= 0
        chosen = [item for item in listed if item["bytes"] == entry["bytes"]]
        assert all(item["logprob"] == entry["logprob"] for item in chosen)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_the_edge_reports_what_the_verifier_reports_for_a_greedy_chat(clients, stream):
    request = dict(messages=UNICODE_CHAT, max_tokens=16, top_logprobs=5, **GREEDY)
    edge, verifier = ask_chat(clients["edge"], stream, **request), ask_chat(clients["verifier"], stream, **request)
    assert edge.text == verifier.text
    assert_same_entries(edge.entries, verifier.entries)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_the_edge_reports_what_the_verifier_reports_for_a_greedy_completion(clients, stream):
    request = dict(prompt="東京", max_tokens=30, logprobs=5, **GREEDY)
    (edge_text, edge), (verifier_text, verifier) = (ask_completion(clients[name], stream, **request) for name in ("edge", "verifier"))
    assert (edge_text, edge["tokens"], edge["text_offset"]) == (verifier_text, verifier["tokens"], verifier["text_offset"])
    assert edge["token_logprobs"] == pytest.approx(verifier["token_logprobs"], **EDGE_TOLERANCE)
    assert [list(top) for top in edge["top_logprobs"]] == [list(top) for top in verifier["top_logprobs"]]
    for edge_top, verifier_top in zip(edge["top_logprobs"], verifier["top_logprobs"], strict=True):
        assert list(edge_top.values()) == pytest.approx(list(verifier_top.values()), **EDGE_TOLERANCE)


def assert_same_entries(entries: list[dict], expected: list[dict]) -> None:
    """Same tokens and alternatives; values within EDGE_TOLERANCE."""

    def shape(items: list[dict]) -> list:
        return [(item["token"], item["bytes"], [(top["token"], top["bytes"]) for top in item["top_logprobs"]]) for item in items]

    def values(items: list[dict]) -> list[float]:
        return [value for item in items for value in [item["logprob"]] + [top["logprob"] for top in item["top_logprobs"]]]

    assert shape(entries) == shape(expected)
    assert values(entries) == pytest.approx(values(expected), **EDGE_TOLERANCE)


# --- streams -------------------------------------------------------------------------------------


@pytest.mark.parametrize("service", SERVICES)
def test_streamed_and_whole_answers_report_the_same_for_a_seeded_chat(clients, service):
    request = dict(messages=UNICODE_CHAT, max_tokens=20, top_logprobs=5, **SEEDED)
    whole, streamed = ask_chat(clients[service], False, **request), ask_chat(clients[service], True, **request)
    assert (streamed.text, streamed.entries) == (whole.text, whole.entries)


@pytest.mark.parametrize("service", SERVICES)
def test_streamed_and_whole_answers_report_the_same_for_a_seeded_completion(clients, service):
    request = dict(prompt="東京", max_tokens=20, logprobs=2, **SEEDED)
    assert ask_completion(clients[service], True, **request) == ask_completion(clients[service], False, **request)


@pytest.mark.parametrize("service", SERVICES)
def test_each_chunk_reports_the_tokens_whose_bytes_make_its_text(clients, service):
    # The tiny model's answer holds stray bytes (b"\xc3\xc3ve", shown as U+FFFD U+FFFD "ve"):
    # bytes are the tokens' own, the text their lossy UTF-8 decoding.
    answer = ask_chat(clients[service], True, messages=UNICODE_CHAT, max_tokens=16, **GREEDY)
    assert any(len(entries) > 1 for _, entries in answer.chunks) and REPLACEMENT_CHAR in answer.text
    for text, entries in answer.chunks:
        assert b"".join(bytes(entry["bytes"]) for entry in entries).decode("utf-8", errors="replace") == text
        assert all(entry["top_logprobs"] == [] for entry in entries)  # logprobs without top_logprobs


# --- what is reported where: a scripted engine ---------------------------------------------------


def test_a_token_s_text_ends_where_the_detokenizer_releases_it():
    spans = TokenSpans()
    spans.add(2)  # "ab"
    spans.add(0)  # the first byte of "é": held back by the detokenizer
    spans.add(1)  # the second: "é" comes out, ending both tokens' text
    assert spans.release(1) == []  # a stop-string filter released only "a"
    assert spans.release(2) == [TokenSpan(0, 0, 2)]
    assert spans.release(3) == [TokenSpan(1, 2, 3), TokenSpan(2, 2, 3)]
    spans.add(0)  # a token that decodes to nothing, at the very end
    spans.flush(0)
    assert (spans.release(3), spans.release(3)) == ([TokenSpan(3, 3, 3)], [])


@dataclass
class ScriptedEngine:
    """Yields ``script`` (words of the tiny letters tokenizer) one per batch, with logprob
    -(index + 1) for the word at ``index`` and one alternative, ("a", -0.5)."""

    tokenizer: object
    script: list[str]
    logprobs_support: LogprobsSupport = "all"
    max_context_length: int = 256

    @property
    def model(self) -> ModelDescription:
        eos = frozenset({self.tokenizer.eos_token_id})
        return ModelDescription(MODEL, len(self.tokenizer), self.max_context_length, eos, logprobs_support=self.logprobs_support)

    async def generate(self, request: GenerationRequest, stats: SpadeStats) -> AsyncIterator[GeneratedTokens]:
        alternative = self.tokenizer.convert_tokens_to_ids("a")
        for index, word in enumerate(self.script[: request.max_tokens]):
            token_id = self.tokenizer.convert_tokens_to_ids(word)
            if request.num_top_logprobs is None:
                yield GeneratedTokens([token_id])
            else:
                yield GeneratedTokens([token_id], [-(index + 1.0)], [[(alternative, -0.5)][: request.num_top_logprobs]])


@pytest.fixture(scope="module")
def letters():
    return build_tokenizer(TinyPairSpec(vocab="letters"))


async def post(app: FastAPI, path: str, body: dict) -> httpx.Response:
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gateway") as client:
        return await client.post(path, json=body)


def events(response: httpx.Response) -> list[dict]:
    payloads = [line[len("data: ") :] for line in response.text.splitlines() if line.startswith("data: ")]
    return [json.loads(payload) for payload in payloads if payload != "[DONE]"]


def chat_body(**fields) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": "a"}], "logprobs": True, "top_logprobs": 1} | fields


def entry(token: str, logprob: float) -> dict:
    alternative = {"token": "a", "logprob": -0.5, "bytes": [97]}
    return {"token": token, "logprob": logprob, "bytes": list(token.encode()), "top_logprobs": [alternative]}


async def test_a_character_split_over_tokens_is_reported_with_the_chunk_that_completes_it():
    # Byte-level tokens "c" "af" then "é" as two byte tokens (0xC3 0xA9): the first decodes to
    # nothing yet, so "é" goes out in one chunk that reports both, each with its own byte.
    bpe = build_tokenizer(TinyPairSpec())
    app = gateway_app(ScriptedEngine(bpe, ["c", "af", "Ã", "©"]))
    streamed = events(await post(app, "/v1/chat/completions", chat_body(stream=True, top_logprobs=0)))
    contents = [
        (event["choices"][0]["delta"]["content"], [(item["token"], item["bytes"]) for item in event["choices"][0]["logprobs"]["content"]])
        for event in streamed
        if event["choices"][0]["delta"].get("content") is not None
    ]
    assert contents == [("c", [("c", [99])]), ("af", [("af", [97, 102])]), ("é", [(REPLACEMENT_CHAR, [0xC3]), (REPLACEMENT_CHAR, [0xA9])])]
    completion = (await post(app, "/v1/completions", {"model": MODEL, "prompt": "c", "logprobs": 0})).json()["choices"][0]
    assert (completion["text"], completion["logprobs"]["text_offset"]) == ("café", [0, 1, 3, 3])


async def test_a_stop_string_cuts_the_reports_with_the_text(letters):
    # Text "a b c d": the stop "c" cuts it to "a b "; the " " belongs to "c", which is not reported.
    app = gateway_app(ScriptedEngine(letters, ["a", "b", "c", "d"]))
    whole = (await post(app, "/v1/chat/completions", chat_body(stop="c"))).json()["choices"][0]
    assert (whole["message"]["content"], whole["finish_reason"]) == ("a b ", "stop")
    assert whole["logprobs"] == {"content": [entry("a", -1.0), entry("b", -2.0)], "refusal": None}
    streamed = events(await post(app, "/v1/chat/completions", chat_body(stop="c", stream=True)))
    contents = [(event["choices"][0]["delta"].get("content"), event["choices"][0]["logprobs"]) for event in streamed]
    assert contents == [
        (None, None),  # the role chunk
        ("a", {"content": [entry("a", -1.0)], "refusal": None}),
        (" b", {"content": [entry("b", -2.0)], "refusal": None}),
        (" ", {"content": [], "refusal": None}),
        (None, None),  # the finish chunk
    ]


async def test_a_stop_string_split_across_tokens_holds_the_report_until_the_text_is_released(letters):
    # Stop "b c x": "a b" may become the stop, so "b" waits (its " " goes out alone), as does
    # " c"; "d" shows it does not: one chunk releases "b c d" and reports all three.
    app = gateway_app(ScriptedEngine(letters, ["a", "b", "c", "d"]))
    streamed = events(await post(app, "/v1/chat/completions", chat_body(stop="b c x", stream=True)))
    contents = [
        (event["choices"][0]["delta"]["content"], [item["token"] for item in event["choices"][0]["logprobs"]["content"]])
        for event in streamed
        if event["choices"][0]["delta"].get("content") is not None
    ]
    assert contents == [("a", ["a"]), (" ", []), ("b c d", ["b", "c", "d"])]


async def test_the_eos_token_is_not_reported(letters):
    app = gateway_app(ScriptedEngine(letters, ["a", "b", "<|im_end|>"]))
    whole = (await post(app, "/v1/chat/completions", chat_body())).json()["choices"][0]
    assert (whole["message"]["content"], whole["finish_reason"]) == ("a b", "stop")
    assert whole["logprobs"] == {"content": [entry("a", -1.0), entry("b", -2.0)], "refusal": None}


async def test_completion_logprobs_list_the_chosen_token_with_its_alternatives_and_offsets(letters):
    app = gateway_app(ScriptedEngine(letters, ["b", "a", "c"]))
    body = {"model": MODEL, "prompt": "a", "logprobs": 1}
    whole = (await post(app, "/v1/completions", body)).json()["choices"][0]
    assert whole["text"] == "b a c"
    assert whole["logprobs"] == {
        "tokens": ["b", "a", "c"],
        "token_logprobs": [-1.0, -2.0, -3.0],
        "top_logprobs": [{"b": -1.0, "a": -0.5}, {"a": -2.0}, {"c": -3.0, "a": -0.5}],
        "text_offset": [0, 1, 3],
    }
    streamed = events(await post(app, "/v1/completions", body | {"stream": True}))
    offsets = [event["choices"][0]["logprobs"]["text_offset"] for event in streamed if event["choices"][0]["text"]]
    assert offsets == [[0], [1], [3]]  # offsets in the whole text, not in the chunk
    assert streamed[-1]["choices"][0]["logprobs"] is None  # the finish chunk


async def test_without_logprobs_every_logprobs_field_is_null(letters):
    app = gateway_app(ScriptedEngine(letters, ["a", "b"]))
    plain = {"model": MODEL, "messages": [{"role": "user", "content": "a"}]}
    assert (await post(app, "/v1/chat/completions", plain)).json()["choices"][0]["logprobs"] is None
    assert (await post(app, "/v1/chat/completions", plain | {"logprobs": False})).json()["choices"][0]["logprobs"] is None
    chat_stream = events(await post(app, "/v1/chat/completions", plain | {"stream": True}))
    assert [event["choices"][0]["logprobs"] for event in chat_stream] == [None] * 4
    completion = {"model": MODEL, "prompt": "a"}
    assert (await post(app, "/v1/completions", completion)).json()["choices"][0]["logprobs"] is None
    completion_stream = events(await post(app, "/v1/completions", completion | {"stream": True}))
    assert [event["choices"][0]["logprobs"] for event in completion_stream] == [None] * 3


@pytest.mark.parametrize(
    ("support", "temperature", "status"),
    [
        ("greedy", 0.0, 200),
        ("greedy", 0.7, 400),
        ("none", 0.0, 400),
        ("all", 0.7, 200),
    ],
)
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
async def test_an_engine_that_cannot_report_exact_logprobs_refuses_before_answering(letters, support, temperature, status, stream):
    app = gateway_app(ScriptedEngine(letters, ["a"], logprobs_support=support))
    response = await post(app, "/v1/chat/completions", chat_body(temperature=temperature, stream=stream))
    assert response.status_code == status
    if status == 400:
        error = response.json()["error"]
        assert (error["type"], error["param"], error["code"]) == ("invalid_request_error", "logprobs", "logprobs_unsupported")
    plain = await post(app, "/v1/chat/completions", chat_body(temperature=temperature, logprobs=False, top_logprobs=None))
    assert plain.status_code == 200  # without logprobs every engine serves


# --- bad values ----------------------------------------------------------------------------------

BAD_REQUESTS = [
    ("/v1/chat/completions", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ("/v1/chat/completions", {"logprobs": True, "top_logprobs": -1}, "top_logprobs"),
    ("/v1/chat/completions", {"logprobs": True, "top_logprobs": 1.5}, "top_logprobs"),
    ("/v1/chat/completions", {"top_logprobs": 2}, "top_logprobs"),
    ("/v1/chat/completions", {"logprobs": False, "top_logprobs": 0}, "top_logprobs"),
    ("/v1/chat/completions", {"logprobs": "yes"}, "logprobs"),
    ("/v1/chat/completions", {"logprobs": 1}, "logprobs"),
    ("/v1/completions", {"logprobs": 6}, "logprobs"),
    ("/v1/completions", {"logprobs": -1}, "logprobs"),
    ("/v1/completions", {"logprobs": True}, "logprobs"),
    ("/v1/completions", {"logprobs": "3"}, "logprobs"),
]


@pytest.mark.parametrize("service", SERVICES)
@pytest.mark.parametrize(("path", "fields", "param"), BAD_REQUESTS, ids=[f"{path[4:]}-{fields}" for path, fields, _ in BAD_REQUESTS])
def test_bad_logprobs_values_are_400s_naming_the_param(urls, service, path, fields, param):
    prompt = {"messages": CHAT} if "chat" in path else {"prompt": "The edge"}
    response = httpx.post(urls[service] + path, json={"model": MODEL, "max_tokens": 2} | prompt | fields, timeout=60)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert (set(error), error["type"], error["param"]) == ({"message", "type", "param", "code"}, "invalid_request_error", param)


def test_the_verify_wire_bounds_num_top_logprobs(urls):
    body = {"session_id": "s-bad", "prefix_length": 0, "prefix_digest": "", "new_tokens": [5, 6], "draft_tokens": [7]}
    for bad in (21, -1, True):
        response = httpx.post(urls["verifier"] + "/v1/verify", json=body | {"num_top_logprobs": bad}, timeout=60)
        assert (response.status_code, response.json()["error"]["param"]) == (400, "num_top_logprobs")


def test_the_verifier_says_which_calls_may_ask(urls):
    assert httpx.get(urls["verifier"] + "/health", timeout=10).json()["logprobs_support"] == "all"


def test_a_verifier_that_cannot_report_them_refuses_the_call(tiny_pair, monkeypatch):
    greedy_only = property(lambda self: replace(self._description, logprobs_support="greedy"))
    monkeypatch.setattr(transformers_backend.TransformersBackend, "model", greedy_only)
    body = {
        "session_id": "s-greedy-only",
        "prefix_length": 0,
        "prefix_digest": "",
        "new_tokens": [5, 6],
        "draft_tokens": [7],
        "num_top_logprobs": 2,
    }
    with running_client(small_verifier_app(tiny_pair)) as client:
        refused = client.post("/v1/verify", json=body | {"sampling": {"temperature": 0.7}})
        assert (refused.status_code, refused.json()["error"]["param"], refused.json()["error"]["code"]) == (
            400,
            "num_top_logprobs",
            "logprobs_unsupported",
        )
        answered = client.post("/v1/verify", json=body | {"sampling": {"temperature": 0.0}})
        assert answered.status_code == 200 and len(answered.json()["top_logprobs"][0]["token_ids"]) == 2


# --- only when asked: the wire and the work -------------------------------------------------------


class WireRecorder(httpx.ASGITransport):
    """The verifier app in this process; records the body of every verify call. With
    ``unreachable`` set, verify calls fail as if the verifier had gone."""

    def __init__(self, app) -> None:
        super().__init__(app=app)
        self.verify_bodies: list[dict] = []
        self.unreachable = False

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/verify":
            if self.unreachable:
                raise httpx.ConnectError("the verifier is gone", request=request)
            self.verify_bodies.append(json.loads(request.content))
        return await super().handle_async_request(request)


@contextlib.asynccontextmanager
async def edge_in_process(pair, **edge_settings) -> AsyncIterator[tuple[FastAPI, WireRecorder]]:
    """The edge's OpenAI routes over its speculative engine, its verifier through a WireRecorder."""
    verifier = verifier_app(pair)
    async with verifier.router.lifespan_context(verifier):
        while verifier.state.service is None:  # the verifier loads its model in the background
            await asyncio.sleep(0.01)
        recorder = WireRecorder(verifier)
        settings = EdgeSettings(draft_model=str(pair.draft_dir), verifier_url="http://verifier", draft_length="3", **edge_settings)
        engine = await build_engine(settings, EdgeMetrics(), transport=recorder)
        try:
            yield gateway_app(engine), recorder
        finally:
            await engine.aclose()


@pytest.fixture
def logprob_computations(monkeypatch) -> list[int]:
    """Counts the verifier's reported_logprobs calls (the only full-vocabulary logprob work)."""
    calls: list[int] = []
    original = transformers_runner.reported_logprobs

    def counted(logits, config):
        calls.append(logits.shape[0])
        return original(logits, config)

    monkeypatch.setattr(transformers_runner, "reported_logprobs", counted)
    return calls


async def test_not_asked_the_wire_asks_nothing_and_nothing_is_computed(tiny_pair, logprob_computations):
    async with edge_in_process(tiny_pair) as (app, recorder):
        plain = await post(app, "/v1/chat/completions", {"model": MODEL, "messages": CHAT, "max_tokens": 10, "temperature": 0})
        assert plain.json()["choices"][0]["logprobs"] is None
        assert recorder.verify_bodies and all("num_top_logprobs" not in body for body in recorder.verify_bodies)
        assert logprob_computations == []
        recorder.verify_bodies.clear()
        asked = await post(
            app,
            "/v1/chat/completions",
            {"model": MODEL, "messages": CHAT, "max_tokens": 10, "temperature": 0, "logprobs": True, "top_logprobs": 2},
        )
        assert len(asked.json()["choices"][0]["logprobs"]["content"]) == 10
        assert recorder.verify_bodies and all(body["num_top_logprobs"] == 2 for body in recorder.verify_bodies)
        assert len(logprob_computations) == len(recorder.verify_bodies)


async def test_the_prompt_only_first_call_reports_the_first_tokens_logprobs(tiny_pair, target_model):
    async with edge_in_process(tiny_pair) as (app, recorder):
        body = {"model": MODEL, "messages": CHAT, "max_tokens": 8, "temperature": 0, "logprobs": True, "top_logprobs": 3}
        entries = (await post(app, "/v1/chat/completions", body)).json()["choices"][0]["logprobs"]["content"]
    first = recorder.verify_bodies[0]
    assert (first["draft_tokens"], first["num_top_logprobs"]) == ([], 3)
    assert all(later["draft_tokens"] for later in recorder.verify_bodies[1:])
    row = plain_forward_logits(target_model.model, first["new_tokens"])[-1].log_softmax(dim=-1)
    assert len(entries) == 8
    assert entries[0]["logprob"] == pytest.approx(float(row.max()), abs=PLAIN_FORWARD_TOLERANCE)
    listed = [top["logprob"] for top in entries[0]["top_logprobs"]]
    assert listed == pytest.approx(row.topk(3).values.tolist(), abs=PLAIN_FORWARD_TOLERANCE)


def test_the_verifier_route_computes_logprobs_only_when_asked(clients, logprob_computations):
    clients["verifier"].chat.completions.create(model=MODEL, messages=CHAT, max_tokens=4, temperature=0)
    assert logprob_computations == []
    ask_chat(clients["verifier"], False, max_tokens=4, **GREEDY)
    assert logprob_computations == [1, 1, 1, 1]  # one row per target-only step


async def test_the_draft_fallback_never_serves_a_request_that_asked(tiny_pair):
    async with edge_in_process(tiny_pair, fallback="draft", verify_retries=0) as (app, recorder):
        recorder.unreachable = True
        body = {"model": MODEL, "messages": CHAT, "max_tokens": 6, "temperature": 0}
        asked = await post(app, "/v1/chat/completions", body | {"logprobs": True})
        assert (asked.status_code, asked.json()["error"]["code"]) == (503, "verifier_unavailable")
        served = await post(app, "/v1/chat/completions", body)  # the same request without logprobs: the draft's tokens
        assert served.status_code == 200
        # The failed prompt-only call serves nothing; the drafted blocks after it serve every token.
        assert served.json()["spade"]["fallback_tokens"] == served.json()["usage"]["completion_tokens"] == 6
