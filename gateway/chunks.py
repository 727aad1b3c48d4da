"""Pure builders of the OpenAI streaming chunks (``data:`` payloads of the SSE stream).

Rules (OpenAI's, asserted one by one in the tests): one id for all chunks of a stream; the first
chat chunk carries only the role; content chunks carry only text (and, when the request asked,
``logprobs`` of the tokens that text completes: see ``gateway.logprobs``); the finish chunk
carries the finish_reason and no content; with ``stream_options.include_usage`` a last chunk
carries usage (and our ``spade`` stats) with empty ``choices``; then ``[DONE]``. ``logprobs``
is null wherever it is not asked for or carries nothing (role and finish chunks).
"""

from __future__ import annotations

from dataclasses import dataclass

from gateway.protocol import SpadeStats, Usage

DONE = "[DONE]"


@dataclass(frozen=True)
class StreamIdentity:
    """What every chunk of one stream repeats."""

    id: str
    model: str
    created: int
    object: str  # "chat.completion.chunk" or "text_completion"

    def envelope(self, choices: list[dict]) -> dict:
        return {"id": self.id, "object": self.object, "created": self.created, "model": self.model, "choices": choices}


def chat_role_chunk(identity: StreamIdentity) -> dict:
    return identity.envelope([{"index": 0, "delta": {"role": "assistant"}, "logprobs": None, "finish_reason": None}])


def chat_content_chunk(identity: StreamIdentity, text: str, logprobs: dict | None = None) -> dict:
    return identity.envelope([{"index": 0, "delta": {"content": text}, "logprobs": logprobs, "finish_reason": None}])


def chat_finish_chunk(identity: StreamIdentity, finish_reason: str) -> dict:
    return identity.envelope([{"index": 0, "delta": {}, "logprobs": None, "finish_reason": finish_reason}])


def completion_text_chunk(identity: StreamIdentity, text: str, logprobs: dict | None = None) -> dict:
    return identity.envelope([{"index": 0, "text": text, "logprobs": logprobs, "finish_reason": None}])


def completion_finish_chunk(identity: StreamIdentity, finish_reason: str) -> dict:
    return identity.envelope([{"index": 0, "text": "", "logprobs": None, "finish_reason": finish_reason}])


def usage_chunk(identity: StreamIdentity, usage: Usage, stats: SpadeStats) -> dict:
    chunk = identity.envelope([])
    chunk["usage"] = usage.model_dump()
    chunk["spade"] = stats.model_dump()
    return chunk
