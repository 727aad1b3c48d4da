"""The request's sampling transform: raw logits -> the distribution a token is drawn from.

Both sides of the gateway apply this one function: the edge to its draft model's logits (the
distribution it really samples drafted tokens from) and the verifier to the target model's
logits (the distribution the output must follow). Exactness of speculative sampling only needs
each side to report the distribution it used, so there is a single definition here.

Temperature 0 means greedy: the distribution is one-hot at the argmax (ties go to the lowest
token id, as ``torch.argmax`` does), which makes greedy verification a special case of the
general acceptance rule.

Randomness is drawn from generators seeded by (request seed, absolute token position), so a
retried verify call, and a request repeated with the same seed, draw the same numbers.

The log-probabilities reported to users (OpenAI ``logprobs``) are ``reported_logprobs``: the
log of the distribution a token is drawn from, except at temperature 0, where they are the raw
log-softmax of the logits (as OpenAI reports them; the one-hot greedy distribution would make
every logprob 0).
"""

from __future__ import annotations

import hashlib

import torch

from spade_core.params import MAX_SEED, SamplingConfig


def processed_probs(logits: torch.Tensor, config: SamplingConfig) -> torch.Tensor:
    """Logits [..., vocab] -> float32 probabilities [..., vocab] after temperature/top-k/top-p."""
    logits = logits.float()
    if config.is_greedy:
        return one_hot_argmax(logits)
    probs = torch.softmax(_scaled_top_k_logits(logits, config), dim=-1)
    if config.top_p < 1.0:
        probs = _mask_outside_top_p(probs, config.top_p)
    return probs


def reported_logprobs(logits: torch.Tensor, config: SamplingConfig) -> torch.Tensor:
    """Logits [..., vocab] -> the float32 log-probabilities [..., vocab] reported to users.

    Temperature > 0: log of ``processed_probs`` (the distribution the token is drawn from,
    after temperature / top-k / top-p); tokens those filters remove are -inf. Computed in log
    space, so a kept token too unlikely for a float32 probability still gets its finite value.
    Temperature 0 (greedy): the raw ``log_softmax`` of the logits, what OpenAI reports at
    temperature 0 (the one-hot greedy distribution would make every logprob 0).
    Example: logits (2, 1, 0), temperature 1, top_k 2 -> (-0.313, -1.313, -inf).
    """
    logits = logits.float()
    if config.is_greedy:
        return torch.log_softmax(logits, dim=-1)
    scaled = _scaled_top_k_logits(logits, config)
    logprobs = torch.log_softmax(scaled, dim=-1)
    if config.top_p < 1.0:
        # processed_probs's very probabilities, so the kept set is the same bit for bit;
        # renormalised in log space.
        probs = torch.softmax(scaled, dim=-1)
        keep = _top_p_keep(probs, config.top_p)
        kept_mass = (probs * keep).sum(dim=-1, keepdim=True)
        # clamp: a lone kept token is log(1) = 0, not a rounding error above it
        logprobs = (logprobs.masked_fill(~keep, float("-inf")) - kept_mass.log()).clamp_max(0.0)
    return logprobs


def emitted_logprobs(logprob_rows: torch.Tensor, token_ids: list[int], num_top: int) -> tuple[list[float], list[list[tuple[int, float]]]]:
    """Per row i of ``logprob_rows`` [n, vocab] (``reported_logprobs``): the logprob of
    ``token_ids[i]`` and the ``num_top`` most likely (token id, logprob) pairs, most likely
    first; tokens at -inf (removed by top-k / top-p) are never listed, so a row may list fewer."""
    rows = torch.arange(len(token_ids), device=logprob_rows.device)
    chosen = logprob_rows[rows, torch.tensor(token_ids, device=logprob_rows.device)].tolist()
    if num_top == 0:
        return chosen, [[] for _ in token_ids]
    top = torch.topk(logprob_rows[: len(token_ids)], min(num_top, logprob_rows.shape[-1]), dim=-1)
    listed = [
        [(token_id, logprob) for token_id, logprob in zip(ids, values, strict=True) if logprob != float("-inf")]
        for ids, values in zip(top.indices.tolist(), top.values.tolist(), strict=True)
    ]
    return chosen, listed


def _scaled_top_k_logits(logits: torch.Tensor, config: SamplingConfig) -> torch.Tensor:
    """float32 logits / temperature, -inf outside the top k."""
    # Shifting by the max first keeps small temperatures finite: (logit - max) / t <= 0.
    logits = (logits - logits.amax(dim=-1, keepdim=True)) / config.temperature
    if config.top_k > 0 and config.top_k < logits.shape[-1]:
        logits = _mask_outside_top_k(logits, config.top_k)
    return logits


def one_hot_argmax(logits: torch.Tensor) -> torch.Tensor:
    top_ids = logits.argmax(dim=-1, keepdim=True)
    return torch.zeros_like(logits, dtype=torch.float32).scatter_(-1, top_ids, 1.0)


def _mask_outside_top_k(logits: torch.Tensor, top_k: int) -> torch.Tensor:
    kth_largest = torch.topk(logits, top_k, dim=-1).values[..., -1:]
    return logits.masked_fill(logits < kth_largest, float("-inf"))


def _mask_outside_top_p(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    kept = probs * _top_p_keep(probs, top_p)
    return kept / kept.sum(dim=-1, keepdim=True)


def _top_p_keep(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Boolean [..., vocab]: the tokens top-p keeps."""
    # Sort descending; a token is kept when the mass strictly before it is < top_p.
    # Example: probs (0.5, 0.3, 0.2), top_p 0.7 -> mass before = (0, 0.5, 0.8) -> keep 0.5 and 0.3.
    # The most likely token is always kept: a top_p below float32's smallest number (1e-46)
    # would otherwise keep nothing; any tiny top_p is top-1.
    sorted_probs, sorted_ids = probs.sort(dim=-1, descending=True)
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    sorted_keep = mass_before < top_p
    sorted_keep[..., 0] = True
    return torch.zeros_like(sorted_keep).scatter_(-1, sorted_ids, sorted_keep)


def truncate_to_top_n(probs: torch.Tensor, max_support: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One distribution [vocab] -> (token_ids [n], probs [n]) of its n <= max_support most likely
    tokens with non-zero mass, renormalised. Sampling from the truncated distribution and
    reporting it keeps verification exact, and keeps the upload small."""
    num_nonzero = int((probs > 0).sum())
    top = torch.topk(probs, min(max_support, num_nonzero))
    return top.indices, top.values / top.values.sum()


def position_generator(seed: int, position: int, stream: str = "target") -> torch.Generator:
    """A CPU generator for one absolute token position of one request.

    Seeded by a hash of (stream, seed, position), so positions and streams draw independently
    and a repeated call for the same position draws the same numbers.
    """
    digest = hashlib.blake2b(f"{stream}:{seed}:{position}".encode(), digest_size=8).digest()
    return torch.Generator(device="cpu").manual_seed(int.from_bytes(digest, "little") & MAX_SEED)


def position_uniforms(seed: int, first_position: int, count: int, stream: str = "target") -> torch.Tensor:
    """[count, 2] float64 uniforms in [0, 1): per position, one for the accept test and one for
    drawing a token. ``stream`` separates independent users of one seed (the verifier draws
    from "target", the edge's drafter from "draft")."""
    rows = [
        torch.rand(2, generator=position_generator(seed, first_position + offset, stream), dtype=torch.float64) for offset in range(count)
    ]
    return torch.stack(rows) if rows else torch.empty(0, 2, dtype=torch.float64)


def sample_from(probs: torch.Tensor, uniform: float) -> int:
    """Inverse-CDF draw of one token from a distribution [vocab] with a uniform in [0, 1).

    Never returns a token of zero mass: the draw is the first index whose cumulative mass
    exceeds ``uniform * total``, clamped to the last token with mass (guards the rounding case
    uniform * total == total).
    """
    cdf = probs.double().cumsum(dim=-1)
    total = cdf[-1]
    index = int(torch.searchsorted(cdf, (uniform * total).reshape(1), right=True))
    last_with_mass = int(torch.nonzero(probs > 0)[-1])
    return min(index, last_with_mass)
