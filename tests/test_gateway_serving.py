"""The OpenAI layer on its own: ``gateway`` routes over a scripted engine, in process.

No model and no server: the engine yields token ids from a script (letters "a".."i" of the tiny
word-level tokenizer, one word per token), so each test states exactly what the routes must make
of them: chunk order, EOS, stop strings, the token budget, usage, errors before and during a
stream, and what is logged about them.
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import httpx
import pytest

from gateway.engine import GeneratedTokens, GenerationRequest
from gateway.errors import ServiceUnavailableError
from gateway.model import ModelDescription
from gateway.protocol import SpadeStats
from gateway_support import gateway_app
from spade_models.tiny import TinyPairSpec, build_tokenizer

MODEL = "stub-model"


@dataclass
class ScriptedEngine:
    """Yields ``script`` (words) in batches of ``batch_size``; raises ``fail_with`` after
    ``fail_after`` tokens; records what it was asked and whether its iterator was closed."""

    tokenizer: object
    script: list[str]
    batch_size: int = 2
    fail_with: BaseException | None = None
    fail_after: int = 0
    requests: list[GenerationRequest] = field(default_factory=list)
    closed: int = 0

    max_context_length: int = 256

    @property
    def model(self) -> ModelDescription:
        return ModelDescription(MODEL, len(self.tokenizer), self.max_context_length, frozenset({self.tokenizer.eos_token_id}))

    async def generate(self, request: GenerationRequest, stats: SpadeStats) -> AsyncIterator[GeneratedTokens]:
        self.requests.append(request)
        token_ids = [self.tokenizer.convert_tokens_to_ids(word) for word in self.script][: request.max_tokens]
        try:
            for start in range(0, len(token_ids), self.batch_size):
                if self.fail_with is not None and start >= self.fail_after:
                    raise self.fail_with
                batch = token_ids[start : start + self.batch_size]
                stats.verify_calls += 1
                yield GeneratedTokens(batch, [0.0] * len(batch))
                if any(token_id in request.eos_token_ids for token_id in batch):
                    return
        finally:
            self.closed += 1


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer(TinyPairSpec(vocab="letters"))


async def post(engine, path: str, body: dict) -> httpx.Response:
    transport = httpx.ASGITransport(app=gateway_app(engine), raise_app_exceptions=False)
    async with httpx.AsyncClient(transport=transport, base_url="http://stub") as client:
        return await client.post(path, json=body)


def events(response: httpx.Response) -> list[dict | str]:
    payloads = [line[len("data: ") :] for line in response.text.splitlines() if line.startswith("data: ")]
    return [payload if payload == "[DONE]" else json.loads(payload) for payload in payloads]


def chat(content: str = "a b", **fields) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": content}]} | fields


def content_of(stream: list) -> str:
    return "".join(event["choices"][0]["delta"].get("content", "") for event in stream if isinstance(event, dict) and event.get("choices"))


# --- streams -------------------------------------------------------------------------------------


async def test_a_chat_stream_is_role_contents_finish_usage_done(tokenizer):
    engine = ScriptedEngine(tokenizer, ["a", "b", "c", "<|im_end|>"])
    stream = events(await post(engine, "/v1/chat/completions", chat(stream=True, stream_options={"include_usage": True})))
    assert stream[0]["choices"][0]["delta"] == {"role": "assistant"}
    assert content_of(stream) == "a b c"
    finish, usage, done = stream[-3:]
    assert finish["choices"][0]["finish_reason"] == "stop"
    assert (usage["choices"], usage["usage"]["completion_tokens"]) == ([], 4)  # EOS counts, is not shown
    assert usage["usage"]["total_tokens"] == usage["usage"]["prompt_tokens"] + 4
    assert usage["spade"]["verify_calls"] == 2
    assert done == "[DONE]"
    assert len({event["id"] for event in stream if isinstance(event, dict)}) == 1


async def test_a_stream_without_include_usage_has_no_usage_chunk(tokenizer):
    stream = events(await post(ScriptedEngine(tokenizer, ["a", "b"]), "/v1/chat/completions", chat(stream=True)))
    assert not any("usage" in event and event["usage"] for event in stream if isinstance(event, dict))
    assert stream[-1] == "[DONE]"


async def test_the_budget_ends_a_generation_with_length(tokenizer):
    engine = ScriptedEngine(tokenizer, list("abcdefgh"))
    response = await post(engine, "/v1/chat/completions", chat(max_tokens=3))
    body = response.json()
    assert engine.requests[0].max_tokens == 3
    assert (body["choices"][0]["message"]["content"], body["choices"][0]["finish_reason"]) == ("a b c", "length")
    assert body["usage"]["completion_tokens"] == 3


async def test_a_stop_string_across_tokens_ends_the_stream_unleaked_and_closes_the_engine(tokenizer):
    engine = ScriptedEngine(tokenizer, list("abcdefgh"), batch_size=1)
    stream = events(await post(engine, "/v1/completions", {"model": MODEL, "prompt": "a", "stop": ["c d"], "stream": True}))
    text = "".join(event["choices"][0]["text"] for event in stream if isinstance(event, dict) and event["choices"])
    assert text == "a b "
    assert stream[-2]["choices"][0]["finish_reason"] == "stop"
    assert engine.closed == 1  # the engine's iterator was closed early, not drained


async def test_a_non_streamed_completion_carries_text_usage_and_spade(tokenizer):
    body = (await post(ScriptedEngine(tokenizer, ["d", "e", "<|im_end|>"]), "/v1/completions", {"model": MODEL, "prompt": "a b c"})).json()
    assert body["object"] == "text_completion" and body["id"].startswith("cmpl-")
    assert (body["choices"][0]["text"], body["choices"][0]["finish_reason"]) == ("d e", "stop")
    assert body["usage"] == {"prompt_tokens": 3, "completion_tokens": 3, "total_tokens": 6, "prompt_tokens_details": {"cached_tokens": 0}}
    assert body["spade"]["verify_calls"] == 2


# --- errors --------------------------------------------------------------------------------------


async def test_an_unknown_model_is_a_404_before_the_engine_runs(tokenizer):
    engine = ScriptedEngine(tokenizer, ["a"])
    response = await post(engine, "/v1/chat/completions", chat() | {"model": "other"})
    assert response.status_code == 404
    assert response.json()["error"]["code"] == "model_not_found"
    assert engine.requests == []


async def test_an_internal_error_mid_stream_is_an_event_then_done_and_logged_with_its_traceback(tokenizer, caplog):
    engine = ScriptedEngine(tokenizer, list("abcdef"), fail_with=RuntimeError("kaboom"), fail_after=2)
    with caplog.at_level(logging.ERROR, logger="gateway"):
        stream = events(await post(engine, "/v1/chat/completions", chat(stream=True)))
    assert content_of(stream) == "a b"
    error, done = stream[-2:]
    assert error["error"]["type"] == "server_error" and "kaboom" not in error["error"]["message"]
    assert done == "[DONE]"
    (record,) = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert stream[0]["id"] in record.getMessage() and "mid-stream" in record.getMessage()
    assert record.exc_info is not None and "kaboom" in str(record.exc_info[1])


async def test_an_internal_error_without_a_stream_is_a_500_logged_with_the_request_id(tokenizer, caplog):
    engine = ScriptedEngine(tokenizer, list("abc"), fail_with=RuntimeError("kaboom"))
    with caplog.at_level(logging.ERROR, logger="gateway"):
        response = await post(engine, "/v1/chat/completions", chat())
    assert response.status_code == 500
    assert response.json()["error"] == {"message": "internal error: RuntimeError", "type": "server_error", "param": None, "code": None}
    (record,) = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert "chatcmpl-" in record.getMessage() and record.exc_info is not None


async def test_a_refusal_at_503_is_one_warning_line_without_a_traceback(tokenizer, caplog):
    engine = ScriptedEngine(tokenizer, list("abc"), fail_with=ServiceUnavailableError("verifier away"))
    with caplog.at_level(logging.WARNING, logger="gateway"):
        response = await post(engine, "/v1/completions", {"model": MODEL, "prompt": "a"})
    assert response.status_code == 503
    (record,) = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert record.levelno == logging.WARNING and record.exc_info is None
    assert "cmpl-" in record.getMessage() and "verifier away" in record.getMessage()


async def test_a_client_error_is_not_logged_as_a_failure(tokenizer, caplog):
    with caplog.at_level(logging.WARNING, logger="gateway"):
        response = await post(ScriptedEngine(tokenizer, ["a"]), "/v1/chat/completions", chat(n=2))
    assert response.status_code == 400 and response.json()["error"]["param"] == "n"
    assert [r for r in caplog.records if r.levelno >= logging.WARNING] == []


class TemplateRaising:
    """A tokenizer whose chat template raises ``error`` (wraps a real one for the rest)."""

    def __init__(self, tokenizer, error: BaseException) -> None:
        self._tokenizer, self._error = tokenizer, error

    def apply_chat_template(self, *args, **kwargs):
        raise self._error

    def __getattr__(self, name):
        return getattr(self._tokenizer, name)

    def __len__(self) -> int:
        return len(self._tokenizer)


async def test_a_template_rejecting_the_messages_is_a_400(tokenizer):
    from jinja2 import TemplateError

    engine = ScriptedEngine(TemplateRaising(tokenizer, TemplateError("Conversation roles must alternate")), ["a"])
    response = await post(engine, "/v1/chat/completions", chat())
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "messages"
    assert "roles must alternate" in response.json()["error"]["message"]


async def test_a_broken_template_call_is_our_500_not_the_users_400(tokenizer, caplog):
    engine = ScriptedEngine(TemplateRaising(tokenizer, KeyError("internal")), ["a"])
    with caplog.at_level(logging.ERROR, logger="gateway"):
        response = await post(engine, "/v1/chat/completions", chat())
    assert response.status_code == 500
    assert any(r.exc_info is not None for r in caplog.records)


async def test_a_model_without_a_chat_template_points_to_completions(tokenizer):
    class NoTemplate(TemplateRaising):
        chat_template = None

    response = await post(ScriptedEngine(NoTemplate(tokenizer, AssertionError()), ["a"]), "/v1/chat/completions", chat())
    assert response.status_code == 400
    assert "/v1/completions" in response.json()["error"]["message"]


async def test_no_engine_yet_is_a_503_loading(tokenizer):
    transport = httpx.ASGITransport(app=gateway_app(None), raise_app_exceptions=False)
    async with httpx.AsyncClient(transport=transport, base_url="http://stub") as client:
        response = await client.get("/v1/models")
    assert response.status_code == 503
    assert response.json()["error"]["type"] == "service_unavailable_error"
