"""A transformers KV cache that remembers which tokens it covers, shared by the verifier's
target and the edge's draft model: both reuse the longest prefix a cache shares with the
committed context and crop off what was rejected."""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field

from transformers import DynamicCache, PreTrainedModel


@dataclass
class TokenCache:
    """The KV cache of one sequence and the tokens it covers."""

    cache: DynamicCache
    token_ids: list[int] = field(default_factory=list)

    @classmethod
    def empty(cls, model: PreTrainedModel) -> TokenCache:
        return cls(DynamicCache(config=model.config))

    def crop_to(self, length: int) -> None:
        if length < len(self.token_ids):
            # A negative argument removes that many tokens in every transformers release
            # (older ones take a length to keep, 5.x the number to remove).
            self.cache.crop(-(self.cache.get_seq_length() - length))
            self.token_ids = self.token_ids[:length]

    def reusable_length(self, context: list[int]) -> int:
        """How many of ``context``'s tokens this cache can keep: the longest shared prefix, with
        at least the context's last token left uncached (its logits are needed)."""
        return min(common_prefix_length(self.token_ids, context), len(context) - 1)

    def reuse_for(self, context: list[int]) -> list[int]:
        """Crop to ``reusable_length(context)``; return the tokens still to feed."""
        self.crop_to(self.reusable_length(context))
        return context[len(self.token_ids) :]


def common_prefix_length(first: list[int], second: list[int]) -> int:
    length = min(len(first), len(second))
    if first[:length] == second[:length]:  # the usual case, compared at C speed
        return length
    for index in range(length):
        if first[index] != second[index]:
            return index
    return length


def cache_argument_name(model: PreTrainedModel) -> str:
    """transformers 5.x names the KV cache argument ``cache``, earlier releases ``past_key_values``."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
