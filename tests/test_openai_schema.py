"""The edge's responses against OpenAI's own response schemas (tests/openai_schemas/responses.yaml,
vendored from openai/openai-openapi with its licence and commit): non-streamed chat and
completions, every stream chunk, the usage chunk, the model list and a retrieved model, and
the error envelopes (400, 404, 405, 502 and an in-band stream error). Also the request side of
the schema: OpenAI's ignored fields type-checked, integral floats as integers, Allow on 405,
and the openai SDK's ``models.retrieve``."""

from __future__ import annotations

import copy
import json
import time
from pathlib import Path

import httpx
import jsonschema
import openai
import pytest
import yaml

from edge_support import DONE, edge_app, sse_payloads, verifier_app
from servers import serve
from spade_bench.fault_proxy import FaultProxy

MODEL = "target"
SCHEMAS = yaml.safe_load((Path(__file__).parent / "openai_schemas" / "responses.yaml").read_text())["components"]["schemas"]
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 6, "temperature": 0}
COMPLETION = {"model": MODEL, "prompt": "The edge drafts", "max_tokens": 6, "temperature": 0}


def json_schema(name: str, nullable_finish_reason: bool = False) -> dict:
    """OpenAI's schema ``name`` as JSON Schema: $refs inlined, OpenAPI 3.0's ``nullable`` as a
    union with null. ``nullable_finish_reason``: for completion stream chunks, whose published
    schema (shared with the non-streamed response) forgets that OpenAI's own streams send
    ``finish_reason: null`` until the last chunk."""
    schema = _converted(SCHEMAS[name])
    if nullable_finish_reason:
        choice = schema["properties"]["choices"]["items"]
        choice["properties"]["finish_reason"] = {"anyOf": [choice["properties"]["finish_reason"], {"type": "null"}]}
    return schema


def _converted(node):
    if isinstance(node, list):
        return [_converted(item) for item in node]
    if not isinstance(node, dict):
        return node
    if "$ref" in node:
        return _converted(SCHEMAS[node["$ref"].rsplit("/", 1)[-1]])
    converted = {key: _converted(value) for key, value in node.items() if key not in ("nullable", "deprecated")}
    return {"anyOf": [converted, {"type": "null"}]} if node.get("nullable") else converted


def assert_valid(instance: dict, name: str, **options) -> None:
    jsonschema.validate(instance, json_schema(name, **options))


@pytest.fixture(scope="module")
def urls(tiny_pair):
    with serve(verifier_app(tiny_pair)) as verifier_url, serve(edge_app(tiny_pair, verifier_url, "3")) as edge_url:
        yield verifier_url, edge_url


@pytest.fixture(scope="module")
def edge_url(urls) -> str:
    return urls[1]


def _stream(url: str, path: str, body: dict) -> list[dict]:
    with httpx.stream("POST", url + path, json=body | {"stream": True}, timeout=60) as response:
        payloads = sse_payloads(response.iter_lines())
    assert payloads[-1] == DONE
    return [json.loads(payload) for payload in payloads[:-1]]


# --- successful responses ---------------------------------------------------------------------


@pytest.mark.parametrize("extra", [{}, {"logprobs": True, "top_logprobs": 2}], ids=["plain", "logprobs"])
def test_a_chat_completion_matches_openais_schema(edge_url, extra):
    body = httpx.post(edge_url + "/v1/chat/completions", json=CHAT | extra, timeout=60).json()
    assert_valid(body, "CreateChatCompletionResponse")
    assert body["choices"][0]["message"]["refusal"] is None


@pytest.mark.parametrize("extra", [{}, {"logprobs": 2}], ids=["plain", "logprobs"])
def test_a_completion_matches_openais_schema(edge_url, extra):
    assert_valid(httpx.post(edge_url + "/v1/completions", json=COMPLETION | extra, timeout=60).json(), "CreateCompletionResponse")


@pytest.mark.parametrize("extra", [{}, {"logprobs": True, "top_logprobs": 2}], ids=["plain", "logprobs"])
def test_every_chat_stream_chunk_and_the_usage_chunk_match_openais_schema(edge_url, extra):
    chunks = _stream(edge_url, "/v1/chat/completions", CHAT | extra | {"stream_options": {"include_usage": True}})
    for chunk in chunks:
        assert_valid(chunk, "CreateChatCompletionStreamResponse")
    assert (chunks[-1]["choices"], set(chunks[-1]["usage"])) == (
        [],
        {"prompt_tokens", "completion_tokens", "total_tokens", "prompt_tokens_details"},
    )


@pytest.mark.parametrize("extra", [{}, {"logprobs": 2}], ids=["plain", "logprobs"])
def test_every_completion_stream_chunk_and_the_usage_chunk_match_openais_schema(edge_url, extra):
    chunks = _stream(edge_url, "/v1/completions", COMPLETION | extra | {"stream_options": {"include_usage": True}})
    for chunk in chunks:
        assert_valid(chunk, "CreateCompletionResponse", nullable_finish_reason=True)
    assert chunks[-1]["choices"] == []


def test_the_model_list_and_a_retrieved_model_match_openais_schema(edge_url):
    listed = httpx.get(edge_url + "/v1/models", timeout=30).json()
    # The card is the same whenever it is asked for: its ``created`` does not follow the clock.
    second = int(time.time())
    while int(time.time()) == second:
        time.sleep(0.05)
    retrieved = httpx.get(edge_url + f"/v1/models/{MODEL}", timeout=30).json()
    assert_valid(listed, "ListModelsResponse")
    assert_valid(retrieved, "Model")
    assert retrieved == listed["data"][0]
    assert retrieved["created"] <= second


def test_the_openai_sdk_retrieves_the_model(edge_url):
    client = openai.OpenAI(base_url=edge_url + "/v1", api_key="unused", max_retries=0)
    assert client.models.retrieve(MODEL).id == MODEL


def test_the_openai_sdk_gets_404_for_another_model(edge_url):
    client = openai.OpenAI(base_url=edge_url + "/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.NotFoundError) as missing:
        client.models.retrieve("gpt-4o")
    assert (missing.value.code, missing.value.param) == ("model_not_found", "model")


# --- errors -----------------------------------------------------------------------------------

ERROR_CASES = {
    "400 bad value": ("POST", "/v1/chat/completions", CHAT | {"temperature": "hot"}, 400),
    "404 unknown model": ("GET", "/v1/models/gpt-4o", None, 404),
    "404 unknown route": ("GET", "/v1/nothing", None, 404),
    "405 wrong method": ("GET", "/v1/completions", None, 405),
}


@pytest.mark.parametrize("case", list(ERROR_CASES))
def test_error_envelopes_match_openais_schema(edge_url, case):
    method, path, body, status = ERROR_CASES[case]
    response = httpx.request(method, edge_url + path, json=body, timeout=30)
    assert response.status_code == status
    assert_valid(response.json(), "ErrorResponse")


@pytest.fixture(scope="module")
def bad_gateway(tiny_pair, urls) -> tuple[httpx.Response, list[dict]]:
    """A 502 and an in-band stream error, from an edge whose every verify answer is a 500."""
    proxy = FaultProxy(urls[0], rate=1.0, kinds=("server_error",))
    with serve(proxy) as proxy_url, serve(edge_app(tiny_pair, proxy_url, "3", verify_retries=1)) as edge:
        refused = httpx.post(edge + "/v1/completions", json=COMPLETION, timeout=60)
        proxy.spare_until = proxy.num_answers + 1  # the first block goes out, then every answer fails
        body = COMPLETION | {"max_tokens": 40, "stream": True}
        with httpx.stream("POST", edge + "/v1/completions", json=body, timeout=60) as response:
            payloads = sse_payloads(response.iter_lines())
    return refused, [{"done": True} if payload == DONE else json.loads(payload) for payload in payloads]


def test_a_502_matches_openais_error_schema(bad_gateway):
    refused, _ = bad_gateway
    assert (refused.status_code, refused.json()["error"]["code"]) == (502, "verifier_bad_response")
    assert_valid(refused.json(), "ErrorResponse")


def test_an_in_band_stream_error_matches_openais_error_schema_and_ends_with_done(bad_gateway):
    _, events = bad_gateway
    assert (events[0]["choices"][0]["text"] != "", events[-1], events[-2]["error"]["code"]) == (
        True,
        {"done": True},
        "verifier_bad_response",
    )
    assert_valid(events[-2], "ErrorResponse")


# --- the request side: types as OpenAI's schema has them --------------------------------------


def _param_of(response: httpx.Response) -> tuple[int, str | None]:
    return response.status_code, response.json()["error"]["param"]


@pytest.mark.parametrize(
    "field,value",
    [("tools", "x"), ("tool_choice", 3), ("logit_bias", {"5": "up"}), ("frequency_penalty", "none"), ("response_format", [])],
)
def test_openais_ignored_chat_fields_are_type_checked(edge_url, field, value):
    assert _param_of(httpx.post(edge_url + "/v1/chat/completions", json=CHAT | {field: value}, timeout=30))[0] == 400


def test_a_wrongly_typed_ignored_field_is_named(edge_url):
    assert _param_of(httpx.post(edge_url + "/v1/chat/completions", json=CHAT | {"tools": "x"}, timeout=30)) == (400, "tools")


def test_well_typed_ignored_fields_are_accepted(edge_url):
    extra = {"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "none", "presence_penalty": 0.5, "user": "u"}
    assert httpx.post(edge_url + "/v1/chat/completions", json=CHAT | extra, timeout=60).status_code == 200


@pytest.mark.parametrize("extra", [{"n": 1.0}, {"max_tokens": 4.0}, {"seed": 3.0}, {"logprobs": 1.0}, {"prompt": [84.0, 104.0]}])
def test_integral_floats_are_integers(edge_url, extra):
    assert httpx.post(edge_url + "/v1/completions", json=COMPLETION | extra, timeout=60).status_code == 200


@pytest.mark.parametrize("field,value", [("n", 1.5), ("max_tokens", True), ("seed", 2.5)])
def test_fractions_and_booleans_are_not_integers(edge_url, field, value):
    assert _param_of(httpx.post(edge_url + "/v1/completions", json=COMPLETION | {field: value}, timeout=30)) == (400, field)


def test_an_empty_prompt_is_refused_naming_the_prompt(edge_url):
    status, param = _param_of(httpx.post(edge_url + "/v1/completions", json=COMPLETION | {"prompt": ""}, timeout=30))
    assert (status, param.split(".")[0]) == (400, "prompt")


def test_every_405_says_which_methods_are_allowed(urls):
    allowed = []
    for url in urls:
        for route in httpx.get(url + "/openapi.json", timeout=30).json()["paths"]:
            path = route.replace("{session_id}", "s").replace("{model_id}", MODEL)
            response = httpx.request("PUT", url + path, timeout=30)
            allowed.append((path, response.status_code, bool(response.headers.get("allow"))))
    assert all(status == 405 and has_allow for _, status, has_allow in allowed), allowed


def test_the_schemas_are_openais_own(tiny_pair):
    # The vendored file names its source and licence; a schema we did not take would be a KeyError.
    text = (Path(__file__).parent / "openai_schemas" / "responses.yaml").read_text()
    assert ("578000861507cd19620e3f1092adf62303757c0a" in text, "MIT" in text, copy.deepcopy(SCHEMAS["Error"])["required"]) == (
        True,
        True,
        ["type", "message", "param", "code"],
    )
