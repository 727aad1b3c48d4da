"""The chaos run's clients: each request of the mix sent to a real edge's OpenAI API (httpx,
streamed or not) and recorded as the client saw it: when it started, its first byte, its end,
its status, its text, and how it ended.

Outcomes: ``ok`` (a complete answer: a finish reason, and [DONE] on a stream), ``refused`` (a
4xx the request asked for: n > 1, or 429 from a rate burst), ``failed`` (an HTTP error, an error
event in a stream, a transport error), ``abandoned`` (the client hung up on purpose), ``hung``
(no byte for the hung deadline)."""

from __future__ import annotations

import asyncio
import json
from dataclasses import asdict, dataclass
from typing import Any, Literal

import httpx

from spade_bench.chaos.plan import SYSTEM_PROMPT, RequestPlan, prompt_text

Outcome = Literal["ok", "refused", "failed", "abandoned", "hung"]
DISCONNECT_AFTER_CHUNKS = 3
SLOW_READ_S = 0.2
"""A slow reader's pause after each chunk it reads."""


@dataclass
class RequestRecord:
    plan: RequestPlan
    started_s: float
    """Seconds from the load's start."""
    ended_s: float
    first_byte_s: float | None
    """Seconds from the request's start to its first content (TTFT), None if none came."""
    outcome: Outcome
    status: int | None
    text: str
    finish_reason: str | None
    completion_tokens: int
    error: dict | None
    """The OpenAI-shaped error the client got (``{"message", "type", "param", "code"}``), or
    ``{"transport": "ReadTimeout"}``-style for a failure below HTTP."""
    error_shaped: bool
    """False: an error body or event that is not OpenAI-shaped."""
    done: bool
    """A stream's [DONE] arrived."""

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def request_body(plan: RequestPlan, model: str, long_words: int) -> dict[str, Any]:
    """The JSON body of ``plan``'s request."""
    text = prompt_text(plan.prompt_id, plan.long_prompt, long_words)
    body: dict[str, Any] = {"model": model, "max_tokens": plan.max_tokens, "temperature": plan.temperature, "stream": plan.stream}
    if plan.temperature > 0:
        body["seed"] = plan.seed
    if plan.n > 1:
        body["n"] = plan.n
    if plan.endpoint == "chat":
        messages = ([{"role": "system", "content": SYSTEM_PROMPT}] if plan.shared_system else []) + [{"role": "user", "content": text}]
        body["messages"] = messages
        if plan.logprobs:
            body |= {"logprobs": True, "top_logprobs": 2}
    else:
        body["prompt"] = (SYSTEM_PROMPT + "\n" if plan.shared_system else "") + text
        if plan.logprobs:
            body["logprobs"] = 2
    if plan.stream:
        body["stream_options"] = {"include_usage": True}
    return body


def route(plan: RequestPlan) -> str:
    return "/v1/chat/completions" if plan.endpoint == "chat" else "/v1/completions"


def is_openai_error(body: object) -> bool:
    """``{"error": {"message", "type", "param", "code"}}`` with a non-empty message."""
    if not isinstance(body, dict) or not isinstance(body.get("error"), dict):
        return False
    error = body["error"]
    return {"message", "type", "param", "code"} <= set(error) and bool(error["message"])


def choice_text(plan: RequestPlan, choice: dict) -> str:
    """The text of one choice (a whole answer) or one chunk's delta."""
    if plan.endpoint == "completions":
        return choice.get("text") or ""
    holder = choice.get("delta") if "delta" in choice else choice.get("message")
    return (holder or {}).get("content") or ""


class Client:
    """Sends plans to edges and records them; ``clock`` gives seconds from the load's start."""

    def __init__(self, http: httpx.AsyncClient, model: str, long_words: int, hung_deadline_s: float, clock) -> None:
        self.http = http
        self.model = model
        self.long_words = long_words
        self.hung_deadline_s = hung_deadline_s
        self.clock = clock

    async def send(self, plan: RequestPlan, edge_url: str) -> RequestRecord:
        started = self.clock()
        record = RequestRecord(plan, started, started, None, "failed", None, "", None, 0, None, True, False)
        timeout = httpx.Timeout(connect=10.0, read=self.hung_deadline_s, write=10.0, pool=self.hung_deadline_s)
        body = request_body(plan, self.model, self.long_words)
        try:
            if plan.stream:
                await self._stream(plan, edge_url, body, timeout, record)
            else:
                await self._whole(plan, edge_url, body, timeout, record)
        except httpx.ReadTimeout:
            record.outcome, record.error = "hung", {"transport": "ReadTimeout"}
        except httpx.TransportError as error:
            record.outcome, record.error = "failed", {"transport": type(error).__name__}
        record.ended_s = self.clock()
        return record

    async def _whole(self, plan: RequestPlan, url: str, body: dict, timeout: httpx.Timeout, record: RequestRecord) -> None:
        response = await self.http.post(url + route(plan), json=body, timeout=timeout)
        record.status = response.status_code
        record.first_byte_s = self.clock() - record.started_s
        try:
            payload = response.json()
        except ValueError:
            payload = None
        if response.status_code != 200:
            self._error(plan, record, payload, response.status_code)
            return
        choice = payload["choices"][0]
        record.text = choice_text(plan, choice)
        record.finish_reason = choice.get("finish_reason")
        record.completion_tokens = (payload.get("usage") or {}).get("completion_tokens", 0)
        record.outcome = "ok" if record.finish_reason else "failed"

    async def _stream(self, plan: RequestPlan, url: str, body: dict, timeout: httpx.Timeout, record: RequestRecord) -> None:
        async with self.http.stream("POST", url + route(plan), json=body, timeout=timeout) as response:
            record.status = response.status_code
            if response.status_code != 200:
                raw = await response.aread()
                try:
                    payload = json.loads(raw)
                except ValueError:
                    payload = None
                self._error(plan, record, payload, response.status_code)
                return
            chunks = 0
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[len("data:") :].strip()
                if data == "[DONE]":
                    record.done = True
                    break
                event = json.loads(data)
                if "error" in event:
                    record.error, record.error_shaped = event.get("error"), is_openai_error(event)
                    continue
                for choice in event.get("choices") or []:
                    piece = choice_text(plan, choice)
                    if piece and record.first_byte_s is None:
                        record.first_byte_s = self.clock() - record.started_s
                    record.text += piece
                    record.finish_reason = choice.get("finish_reason") or record.finish_reason
                if event.get("usage"):
                    record.completion_tokens = event["usage"].get("completion_tokens", 0)
                chunks += 1
                if plan.behaviour == "disconnect" and chunks >= DISCONNECT_AFTER_CHUNKS:
                    record.outcome = "abandoned"
                    return  # leaving the block closes the connection mid-stream
                if plan.behaviour == "slow":
                    await asyncio.sleep(SLOW_READ_S)
        if record.error is not None:
            record.outcome = "failed"
        elif record.done and record.finish_reason:
            record.outcome = "ok"
        else:
            record.outcome, record.error = "failed", {"transport": "stream ended without [DONE] or a finish reason"}

    @staticmethod
    def _error(plan: RequestPlan, record: RequestRecord, payload: object, status: int) -> None:
        record.error = payload.get("error") if isinstance(payload, dict) else {"body": "not JSON"}
        record.error_shaped = is_openai_error(payload)
        refused = (plan.expects_refusal and status == 400) or (plan.burst and status == 429)
        record.outcome = "refused" if refused else "failed"
