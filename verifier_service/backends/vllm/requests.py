"""What the vLLM backend sends to vLLM and how it reads the answers: request parameters and
pure functions over RequestOutput / FlatLogprobs (see vllm_backend's glossary for rows).

Nothing here imports vLLM at module level: the parameter builders import it when called.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import torch

from spade_core.params import SamplingConfig
from spade_core.sampling import position_generator

GREEDY = SamplingConfig(temperature=0.0)


@dataclass(frozen=True)
class RowEntry:
    """One token of a row: its id and log-probability, as vLLM reports it raw (temperature 1,
    untruncated); see RouteResult.emitted for the one exception."""

    token_id: int
    logprob: float


def vllm_seed(seed: int, position: int) -> int:
    """The seed of the vLLM request that samples absolute ``position`` (same hash as our draws)."""
    return position_generator(seed, position, stream="vllm").initial_seed()


def computed_tokens(outputs: list[Any]) -> int:
    """Tokens the engine actually ran: prompt tokens not served from the prefix cache."""
    return sum(len(out.prompt_token_ids) - (out.num_cached_tokens or 0) for out in outputs)


def engine_queue_seconds(outputs: list[Any]) -> float:
    """Longest wait between entering vLLM's scheduler and being scheduled (0 without stats)."""
    waits = [out.metrics.scheduled_ts - out.metrics.queued_ts for out in outputs if out.metrics is not None]
    return max([0.0, *waits])


def flat_entries(flat: Any, index: int) -> tuple[list[int], list[float], list[int | None]]:
    """(token ids, logprobs, ranks) of one position of vLLM's FlatLogprobs."""
    start, end = flat.start_indices[index], flat.end_indices[index]
    return flat.token_ids[start:end], flat.logprobs[start:end], flat.ranks[start:end]


def top1_entry(flat: Any, index: int) -> RowEntry:
    token_ids, logprobs, ranks = flat_entries(flat, index)
    for token_id, logprob, rank in zip(token_ids, logprobs, ranks, strict=True):
        if rank == 1:
            return RowEntry(token_id, logprob)
    raise RuntimeError(f"vLLM returned no rank-1 token at position {index}")


def top_entries(flat: Any, index: int, num_top: int) -> list[tuple[int, float]]:
    """The ``num_top`` most likely (token id, raw logprob) of one position, most likely first, in
    vLLM's top-k order. The request must have asked for at least ``num_top``. vLLM lists the
    prompt's or sampled token first whatever its rank, then the top-k (ranks r, 1, 2, ...); its
    0.32 decode loop sometimes lists a rank-1 sampled token once (ranks 1, 2, ...): the top-k
    alone. Told apart by the second entry's rank."""
    token_ids, logprobs, ranks = flat_entries(flat, index)
    listed = list(zip(token_ids, logprobs, strict=True))
    alternatives = listed[1:] if len(ranks) > 1 and ranks[1] == 1 else listed
    if len(alternatives) < num_top:
        raise RuntimeError(f"vLLM returned {len(alternatives)} alternatives at position {index}, not {num_top}")
    return alternatives[:num_top]


def chosen_logprob(flat: Any, index: int, token_id: int) -> float:
    """The raw logprob of ``token_id``, the token chosen at one position (listed among its entries)."""
    token_ids, logprobs, _ = flat_entries(flat, index)
    if token_id not in token_ids:
        raise RuntimeError(f"vLLM listed no logprob for the chosen token {token_id} at position {index}")
    return logprobs[token_ids.index(token_id)]


def sampled_entry(output: Any) -> RowEntry:
    """The one token a request sampled and its raw logprob (listed first in its position)."""
    token_id = output.outputs[0].token_ids[0]
    token_ids, logprobs, _ = flat_entries(output.outputs[0].logprobs, 0)
    return RowEntry(token_id, logprobs[token_ids.index(token_id)])


def dense_row(flat: Any, index: int, vocab_size: int) -> torch.Tensor:
    """A full-vocabulary position of FlatLogprobs -> raw logprobs [vocab] (the chosen token is
    listed twice, first and at its rank, with the same value)."""
    token_ids, logprobs, _ = flat_entries(flat, index)
    row = torch.full((vocab_size,), float("-inf"), dtype=torch.float32)
    row[torch.tensor(token_ids, dtype=torch.long)] = torch.tensor(logprobs, dtype=torch.float32)
    return row


def first_mismatch(draft_token_ids: list[int], chosen: list[RowEntry]) -> int:
    """Leading drafted tokens equal to their row's chosen token (top-1 or vLLM's sample)."""
    for index, token_id in enumerate(draft_token_ids):
        if chosen[index].token_id != token_id:
            return index
    return len(draft_token_ids)


def num_stale_rows(num_cached: int, context_length: int, num_drafted: int) -> int:
    """Row j is stale when position n + j <= num_cached (its hidden state n + j - 1 was cached).
    Example: n = 64, block size 32, context cached -> num_cached = 64 -> row 0 stale."""
    return max(0, min(num_drafted, num_cached - context_length + 1))


def token_prompt(prompt_ids: list[int], cache_salt: str | None = None) -> Any:
    """vLLM's input for ``prompt_ids``; ``cache_salt``: only requests with the same salt share
    prefix-cache blocks (vLLM's ``cache_salt``)."""
    try:
        from vllm.inputs import tokens_input  # a pre-rendered engine input (newer vLLM)
    except ImportError:
        from vllm.inputs import TokensPrompt

        prompt = TokensPrompt(prompt_token_ids=prompt_ids)
        if cache_salt is not None:
            prompt["cache_salt"] = cache_salt
        return prompt
    return tokens_input(prompt_ids, cache_salt=cache_salt)


def vllm_cache_salt(cache_namespace: str | None, session_id: str) -> str:
    """The ``cache_salt`` of a block's vLLM requests: its prefix-sharing namespace; a call that
    shares nothing (None: ``--prefix-sharing off``) gets its session's own salt, so it still
    reuses its own earlier calls' prefix (each verify call is a new vLLM request), nobody else's."""
    if cache_namespace is not None:
        return cache_namespace
    return json.dumps(["session", session_id, ""])  # 3 parts: never a (key, salt) namespace


def one_token_params(sampling: SamplingConfig, seed: int | None, num_logprobs: int, num_prompt_logprobs: int | None = None) -> Any:
    """A one-token request returning raw logprobs (0: the sampled token's only; -1: all).
    With prompt logprobs, reading the prefix cache stays allowed (vLLM skips it by default);
    the caller refetches the stale rows that this leaves."""
    from vllm.sampling_params import RequestOutputKind

    from vllm import SamplingParams

    return SamplingParams(
        temperature=sampling.temperature,
        top_k=sampling.top_k,
        top_p=sampling.top_p,
        seed=None if sampling.is_greedy else seed,
        max_tokens=1,
        logprobs=num_logprobs,
        prompt_logprobs=num_prompt_logprobs,
        skip_reading_prefix_cache=False,
        flat_logprobs=True,
        detokenize=False,
        output_kind=RequestOutputKind.FINAL_ONLY,
    )


def scoring_params(num_drafted: int, num_prompt_logprobs: int, num_logprobs: int) -> Any:
    """Greedy one-token request over context + block that also scores the drafted tokens."""
    return one_token_params(GREEDY, None, num_logprobs, num_prompt_logprobs if num_drafted else None)
