"""Bad input every verifier backend must refuse alike: the table of bad verify calls and the
context-limit rule at its boundary on both routes. The transformers backend's suite
(``test_verifier_errors``) and the vLLM one's run the same cases."""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from dataclasses import dataclass

import httpx

from verifier_support import (
    ENVELOPE_KEYS,
    MAX_CONTEXT,
    MAX_DRAFT,
    MAX_SUPPORT,
    error_of,
    new_session_id,
    post_verify,
    random_tokens,
    verify_body,
)


def one_distribution(token_ids: list[int], probs: list[float]) -> list[dict]:
    return [{"token_ids": token_ids, "probs": probs}]


@dataclass(frozen=True)
class BadCall:
    change: Callable[[dict, int], dict | bytes]
    """(a good call drafting token 5, the vocabulary size) -> the bad call."""
    param: str | None
    code: str | None = None


def setting(**fields) -> Callable[[dict, int], dict]:
    return lambda body, vocab: body | fields


def setting_probs(token_ids: list[int], probs: list[float]) -> Callable[[dict, int], dict]:
    return setting(draft_probs=one_distribution(token_ids, probs))


def without(field: str) -> Callable[[dict, int], dict]:
    return lambda body, vocab: {key: value for key, value in body.items() if key != field}


def filling_the_context(body: dict, vocab: int) -> dict:
    """Context + one drafted token = MAX_CONTEXT + 1 tokens to feed."""
    return body | {"new_tokens": [5] * (MAX_CONTEXT - body["prefix_length"])}


TOO_WIDE_SUPPORT = one_distribution(list(range(5, 6 + MAX_SUPPORT)), [1 / (MAX_SUPPORT + 1)] * (MAX_SUPPORT + 1))

BAD_VERIFY_CALLS = {
    "new_token_above_vocab": BadCall(lambda body, vocab: body | {"new_tokens": [vocab]}, "new_tokens"),
    "negative_new_token": BadCall(setting(new_tokens=[-1]), "new_tokens"),
    "draft_token_above_vocab": BadCall(lambda body, vocab: body | {"draft_tokens": [5, vocab]}, "draft_tokens"),
    "negative_draft_token": BadCall(setting(draft_tokens=[-3]), "draft_tokens"),
    "draft_probs_token_above_vocab": BadCall(
        lambda body, vocab: body | {"draft_probs": one_distribution([5, vocab], [0.5, 0.5])}, "draft_probs.0"
    ),
    "draft_probs_not_summing_to_one": BadCall(setting_probs([5, 6], [0.5, 0.4]), "draft_probs.0"),
    "negative_draft_prob": BadCall(setting_probs([5, 6], [1.5, -0.5]), "draft_probs.0"),
    "nan_draft_prob": BadCall(setting_probs([5, 6], [float("nan"), 1.0]), "draft_probs.0"),
    "draft_probs_rows_mismatch": BadCall(setting(draft_probs=one_distribution([5], [1.0]) * 2), "draft_probs"),
    "drafted_token_without_mass": BadCall(setting_probs([5, 6], [0.0, 1.0]), "draft_probs.0"),
    "drafted_token_outside_support": BadCall(setting_probs([6, 7], [0.5, 0.5]), "draft_probs.0"),
    "repeated_support_token": BadCall(setting_probs([5, 5], [0.5, 0.5]), "draft_probs.0"),
    "support_over_limit": BadCall(setting(draft_probs=TOO_WIDE_SUPPORT), "draft_probs.0"),
    "draft_probs_for_an_empty_block": BadCall(setting(draft_tokens=[], draft_probs=one_distribution([5], [1.0])), "draft_probs"),
    "oversized_block": BadCall(setting(draft_tokens=[5] * (MAX_DRAFT + 1)), "draft_tokens"),
    "context_over_max_length": BadCall(filling_the_context, "draft_tokens", "context_length_exceeded"),
    "prefix_zero_without_context": BadCall(setting(prefix_length=0, new_tokens=[]), "new_tokens"),
    "negative_temperature": BadCall(setting(sampling={"temperature": -0.5}), "sampling.temperature"),
    "zero_top_p": BadCall(setting(sampling={"top_p": 0.0}), "sampling.top_p"),
    "missing_draft_tokens": BadCall(without("draft_tokens"), "draft_tokens"),
    "missing_session_id": BadCall(without("session_id"), "session_id"),
    "unknown_field": BadCall(setting(draft_logits=[0.0]), "draft_logits"),
    "malformed_json": BadCall(lambda body, vocab: json.dumps(body).encode()[:-7], None),
}


# The context-limit rule (gateway.model) at its boundary. The vLLM backend describes its model one
# token shorter: the limit is read from /health. ``over`` 0: exactly at the limit (served); 1: one
# token past it (400, not 500).

AT_THE_LIMIT = [(0, 200, None), (1, 400, "context_length_exceeded")]


def verify_past_the_limit(client, vocab_size: int, over: int) -> httpx.Response:
    """A fresh session's call whose context + 3 drafted tokens end ``over`` tokens past the limit."""
    limit = client.get("/health").json()["max_context_length"]
    context = random_tokens(random.Random(limit + over), limit - 3 + over, vocab_size)
    return post_verify(client, verify_body(new_session_id(), [], [5, 6, 7], new_tokens=context))


def complete_past_the_limit(client, vocab_size: int, over: int) -> httpx.Response:
    """A completion whose prompt + max_tokens end ``over`` tokens past the limit."""
    limit = client.get("/health").json()["max_context_length"]
    prompt = random_tokens(random.Random(limit), limit - 2, vocab_size)
    body = {"model": "target", "prompt": prompt, "max_tokens": 2 + over, "temperature": 0}
    return client.post("/v1/completions", json=body)


def outcome(response: httpx.Response, param: str) -> tuple[int, str | None]:
    if response.status_code == 200:
        return 200, None
    assert error_of(response)[1:4] == (ENVELOPE_KEYS, "invalid_request_error", param)
    return response.status_code, response.json()["error"]["code"]
