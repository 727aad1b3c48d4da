"""Helpers shared by the verifier's tests: the plain-forward reference every verify answer must
agree with, verify-call bodies, a verifier app on the tiny target with small limits and the
edge's side of a session, raw SSE reading and bounded polling."""

from __future__ import annotations

import contextlib
import json
import random
import uuid
from dataclasses import dataclass

import httpx
import torch
from fastapi.testclient import TestClient

from servers import wait_until
from verifier_service.app import create_app
from verifier_service.protocol import context_digest
from verifier_service.settings import VerifierSettings

GREEDY = {"temperature": 0.0}
FIRST_ORDINARY_ID = 3
"""The tiny tokenizer's ids 0-2 are special tokens; random contexts use the others."""


def plain_forward_logits(model, token_ids: list[int]) -> torch.Tensor:
    """[len(token_ids), vocab] fp32 logits of one full forward, no cache."""
    with torch.inference_mode():
        return model(input_ids=torch.tensor([token_ids]), use_cache=False).logits[0].float()


def reference_verdict(model, context: list[int], block: list[int]) -> tuple[int, int]:
    """Greedy verification by hand: accept while the drafted token is the argmax; the next token
    is the argmax at the first mismatch, or after the block. Returns (num_accepted, next)."""
    argmax = plain_forward_logits(model, context + block)[len(context) - 1 :].argmax(dim=-1).tolist()
    num_accepted = 0
    while num_accepted < len(block) and block[num_accepted] == argmax[num_accepted]:
        num_accepted += 1
    return num_accepted, argmax[num_accepted]


def greedy_continuation(model, context: list[int], num_tokens: int, stop_ids: frozenset[int] = frozenset()) -> list[int]:
    """The target's own greedy tokens after ``context`` (one plain forward per token), ending
    after the first of ``stop_ids``."""
    tokens: list[int] = []
    while len(tokens) < num_tokens:
        tokens.append(int(plain_forward_logits(model, context + tokens)[-1].argmax()))
        if tokens[-1] in stop_ids:
            break
    return tokens


def corrupted(block: list[int], position: int, vocab_size: int, rng: random.Random) -> list[int]:
    """``block`` with the token at ``position`` replaced by another ordinary token (no change
    when position == len(block))."""
    if position == len(block):
        return list(block)
    replacement = rng.choice([t for t in range(FIRST_ORDINARY_ID, vocab_size) if t != block[position]])
    return block[:position] + [replacement] + block[position + 1 :]


def random_tokens(rng: random.Random, length: int, vocab_size: int) -> list[int]:
    return [rng.randrange(FIRST_ORDINARY_ID, vocab_size) for _ in range(length)]


def verify_body(
    session_id: str,
    held: list[int],
    draft_tokens: list[int],
    *,
    new_tokens: list[int] = (),
    sampling: dict = GREEDY,
    draft_probs: list[dict] | None = None,
) -> dict:
    """A verify call from an edge that believes the verifier holds ``held``."""
    return {
        "session_id": session_id,
        "prefix_length": len(held),
        "prefix_digest": context_digest(held),
        "new_tokens": list(new_tokens),
        "draft_tokens": list(draft_tokens),
        "draft_probs": draft_probs,
        "sampling": sampling,
    }


def committed_after(context: list[int], draft_tokens: list[int], answer: dict) -> list[int]:
    """The committed context after a verify answer: context + accepted drafts + next token."""
    return context + draft_tokens[: answer["num_accepted"]] + [answer["next_token"]]


def sse_payloads(lines) -> list[str]:
    """The ``data:`` payloads of an SSE stream, in order (comments and blank lines dropped)."""
    return [line.removeprefix("data:").strip() for line in lines if line.startswith("data:")]


# --- a verifier on the tiny target, and the edge's side of a session -------------------------

MAX_CONTEXT = 96
MAX_DRAFT = 8
MAX_SUPPORT = 16
ENVELOPE_KEYS = {"message", "type", "param", "code"}


def verifier_app(tiny_pair, **overrides):
    settings = {
        "model": str(tiny_pair.target_dir),
        "max_context_length": MAX_CONTEXT,
        "max_draft_length": MAX_DRAFT,
        "max_draft_support": MAX_SUPPORT,
    }
    return create_app(VerifierSettings(**(settings | overrides)))


@contextlib.contextmanager
def running_client(app):
    """An in-process client of ``app`` once its model has loaded."""
    with TestClient(app) as client:
        assert wait_until(lambda: client.get("/health").status_code == 200)
        yield client


@contextlib.contextmanager
def running_verifier(tiny_pair, **overrides):
    """An in-process client of a verifier on the tiny target (``verifier_app``'s settings and
    ``overrides``) once its model has loaded."""
    with running_client(verifier_app(tiny_pair, **overrides)) as client:
        yield client


def new_session_id() -> str:
    return "s-" + uuid.uuid4().hex[:12]


def post_verify(client, body: dict | bytes) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body)  # json.dumps writes NaN
    return client.post("/v1/verify", content=content, headers={"content-type": "application/json"})


def verify(client, body: dict) -> dict:
    response = post_verify(client, body)
    assert response.status_code == 200, response.text
    return response.json()


def verdict(answer: dict) -> tuple[int, int]:
    return answer["num_accepted"], answer["next_token"]


def error_of(response: httpx.Response) -> tuple[int, set[str], str, str | None, str | None]:
    """(status, envelope keys, type, param, code) of an error answer."""
    error = response.json()["error"]
    return response.status_code, set(error), error["type"], error["param"], error["code"]


@dataclass
class Session:
    """One edge session as the edge sees it: its id and the committed context."""

    session_id: str
    committed: list[int]


def open_session(client, context: list[int], block: list[int]) -> Session:
    session_id = new_session_id()
    answer = verify(client, verify_body(session_id, [], block, new_tokens=context))
    return Session(session_id, committed_after(context, block, answer))


def greedy_block(model, context: list[int], length: int, corrupt_at: int, vocab_size: int, rng: random.Random) -> list[int]:
    """The target's greedy continuation of ``context``, one token corrupted at ``corrupt_at``
    (none when corrupt_at == length): exactly ``corrupt_at`` tokens are accepted."""
    return corrupted(greedy_continuation(model, context, length), corrupt_at, vocab_size, rng)
