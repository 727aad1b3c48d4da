"""One streamed chat completion, timed from the user's side with the real ``openai`` client.

Streaming is what a user of a chat product sees: time to first token (TTFT) is when the first
piece of text arrives, wall time is when the stream ends. The last chunk (``include_usage``)
carries the token counts and our ``spade`` accounting.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

from openai import OpenAI

if TYPE_CHECKING:
    from openai.types.chat import ChatCompletionMessageParam


@dataclass(frozen=True)
class Generation:
    """Sampling settings sent with every request of a run."""

    max_tokens: int
    temperature: float = 0.0
    seed: int = 0


@dataclass(frozen=True)
class StreamResult:
    text: str
    finish_reason: str | None
    prompt_tokens: int | None
    completion_tokens: int
    wall_s: float
    ttft_s: float | None
    spade: dict | None
    """The usage chunk's ``spade`` object (None if the server sent none)."""
    num_content_chunks: int


def make_client(base_url: str, timeout_s: float) -> OpenAI:
    """An OpenAI client for one of our servers (no key needed; retries off so nothing is hidden)."""
    return OpenAI(base_url=f"{base_url}/v1", api_key="spade-bench", timeout=timeout_s, max_retries=0)


def served_model(client: OpenAI) -> str:
    """The id the server lists first under /v1/models."""
    models = client.models.list().data
    if not models:
        raise ValueError(f"{client.base_url} lists no models")
    return models[0].id


def stream_chat(client: OpenAI, model: str, messages: list[dict], generation: Generation) -> StreamResult:
    started = time.perf_counter()
    stream = client.chat.completions.create(
        model=model,
        # Plain {"role", "content"} dicts (datasets, recorded sessions): the shape the SDK's TypedDicts describe.
        messages=cast("list[ChatCompletionMessageParam]", messages),
        max_tokens=generation.max_tokens,
        temperature=generation.temperature,
        seed=generation.seed,
        stream=True,
        stream_options={"include_usage": True},
        # A prompt of its own: the same prompts come back for every mode, length and RTT, and a
        # prefix cached by an earlier configuration (verifier or draft) would speed up the later ones.
        extra_body={"cache_salt": uuid.uuid4().hex},
    )
    pieces: list[str] = []
    ttft_s = finish_reason = usage = spade = None
    for chunk in stream:
        for choice in chunk.choices:
            if choice.delta.content:
                ttft_s = ttft_s if ttft_s is not None else time.perf_counter() - started
                pieces.append(choice.delta.content)
            finish_reason = choice.finish_reason or finish_reason
        usage = chunk.usage or usage
        spade = (chunk.model_extra or {}).get("spade") or spade
    wall_s = time.perf_counter() - started
    return StreamResult(
        text="".join(pieces),
        finish_reason=finish_reason,
        prompt_tokens=usage.prompt_tokens if usage else None,
        completion_tokens=usage.completion_tokens if usage else len(pieces),
        wall_s=wall_s,
        ttft_s=ttft_s,
        spade=spade,
        num_content_chunks=len(pieces),
    )
