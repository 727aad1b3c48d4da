"""What the verifier checks of a verify call before anything changes: everything that does not
depend on the session (the block's length, token ids, the context's fit, logprobs support, the
drafted distributions), each problem an OpenAI-shaped 400 naming its parameter. The drafted
distributions come back dense, as a backend takes them."""

from __future__ import annotations

import math

import torch

from gateway.engine import check_logprobs_support
from gateway.errors import InvalidRequestError
from gateway.model import ModelDescription
from verifier_service.protocol import SparseDistribution, VerifyRequest

PROB_SUM_TOLERANCE = 1e-3
"""How far a drafted distribution's probabilities may sum from 1 (floats sent as JSON)."""


def check_token_ids(token_ids: list[int], vocab_size: int, param: str, code: str | None = None) -> None:
    bad = [token_id for token_id in token_ids if not 0 <= token_id < vocab_size]
    if bad:
        raise InvalidRequestError(f"token id {bad[0]} is outside the vocabulary [0, {vocab_size})", param=param, code=code)


def checked_request(request: VerifyRequest, model: ModelDescription, max_draft_length: int, max_draft_support: int) -> torch.Tensor | None:
    """Check everything of ``request`` that does not depend on its session; returns its drafted
    distributions dense ([num_drafted, vocab] float32), or None where it sent none."""
    num_drafted = len(request.draft_tokens)  # 0: the prompt-only call, answered with the target's next token
    if num_drafted > max_draft_length:
        raise InvalidRequestError(f"at most {max_draft_length} drafted tokens per call, got {num_drafted}", param="draft_tokens")
    check_token_ids(request.new_tokens, model.vocab_size, "new_tokens")
    check_token_ids(request.draft_tokens, model.vocab_size, "draft_tokens")
    if request.prefix_length == 0 and not request.new_tokens:
        raise InvalidRequestError("a call with prefix_length 0 must send the context in new_tokens", param="new_tokens")
    model.check_fits(request.prefix_length + len(request.new_tokens), num_drafted, param="draft_tokens")
    if request.num_top_logprobs is not None:
        check_logprobs_support(model.logprobs_support, request.sampling.to_config(), param="num_top_logprobs")
    if request.draft_probs is None:
        return None
    if len(request.draft_probs) != num_drafted:
        raise InvalidRequestError(f"draft_probs has {len(request.draft_probs)} rows for {num_drafted} drafted tokens", param="draft_probs")
    if num_drafted == 0:  # [] for an empty block: nothing drafted, nothing to weigh
        return None
    return checked_draft_probs(request.draft_probs, request.draft_tokens, model.vocab_size, max_draft_support)


def checked_draft_probs(rows: list[SparseDistribution], draft_tokens: list[int], vocab_size: int, max_draft_support: int) -> torch.Tensor:
    """Each drafted position's distribution checked (size, token ids, finite non-negative
    probabilities summing to 1, mass on the drafted token), then made dense."""
    for index, (row, drafted) in enumerate(zip(rows, draft_tokens, strict=True)):
        param = f"draft_probs.{index}"
        if len(row.token_ids) > max_draft_support:
            raise InvalidRequestError(f"at most {max_draft_support} tokens per distribution", param=param)
        check_token_ids(row.token_ids, vocab_size, param)
        if any(not math.isfinite(prob) or prob < 0 for prob in row.probs):
            raise InvalidRequestError("probabilities must be finite and non-negative", param=param)
        total = math.fsum(row.probs)
        if abs(total - 1.0) > PROB_SUM_TOLERANCE:
            raise InvalidRequestError(f"probabilities sum to {total:.6f}, not 1", param=param)
        support = dict(zip(row.token_ids, row.probs, strict=True))
        if support.get(drafted, 0.0) <= 0:
            raise InvalidRequestError(f"drafted token {drafted} has no mass in its distribution", param=param)
    return dense_draft_probs(rows, vocab_size)


def dense_draft_probs(rows: list[SparseDistribution], vocab_size: int) -> torch.Tensor:
    """The drafted distributions as a backend takes them: [len(rows), vocab_size] float32, each
    sparse row spread over the vocabulary and renormalised (it sums to 1 within PROB_SUM_TOLERANCE)."""
    dense = torch.zeros(len(rows), vocab_size, dtype=torch.float32)
    for index, row in enumerate(rows):
        dense[index, row.token_ids] = torch.tensor(row.probs, dtype=torch.float32) / math.fsum(row.probs)
    return dense
