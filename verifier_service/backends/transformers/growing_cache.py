"""A KV cache that appends in place, for the verifier's CPU fast path.

transformers' DynamicLayer appends a forward's keys and values with torch.cat: every forward
copies the whole cache into freshly allocated memory (and maps as many new pages). On CPU that
is most of what attention costs at long contexts (docs/benchmarks.md, "Component measurements").
``GrowingLayer`` keeps keys and values as views into buffers with room for ``GROWTH_TOKENS``
more tokens: a forward writes only its own rows, and cropping rejected drafts is a view, as in
DynamicLayer. The memory held beyond the tokens is at most GROWTH_TOKENS per layer (Qwen2.5-1.5B:
64 tokens = 3.7 MB per session).
"""

from __future__ import annotations

import torch
from transformers import DynamicCache, PretrainedConfig
from transformers.cache_utils import DynamicLayer

GROWTH_TOKENS = 64


class GrowingLayer(DynamicLayer):
    """DynamicLayer whose ``keys``/``values`` are views of larger buffers (same values, same
    shapes; only their storage has spare room)."""

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        if self.keys is None or self.values is None:  # lazy_initialization sets both
            raise RuntimeError("GrowingLayer: keys and values missing after initialization")
        length, num_new = self.get_seq_length(), key_states.shape[-2]
        if not self._has_room(self.keys, self.values, key_states, length + num_new):
            self._key_buffer = self._regrown(self.keys, key_states, length + num_new)
            self._value_buffer = self._regrown(self.values, value_states, length + num_new)
        self._key_buffer[..., length : length + num_new, :] = key_states
        self._value_buffer[..., length : length + num_new, :] = value_states
        self.keys = self._key_buffer[..., : length + num_new, :]
        self.values = self._value_buffer[..., : length + num_new, :]
        return self.keys, self.values

    def _has_room(self, keys: torch.Tensor, values: torch.Tensor, key_states: torch.Tensor, needed: int) -> bool:
        """True while keys/values are still (cropped) views of our buffers and these fit."""
        buffer = getattr(self, "_key_buffer", None)
        return (
            buffer is not None
            and keys.data_ptr() == buffer.data_ptr()
            and values.data_ptr() == self._value_buffer.data_ptr()
            and keys.shape[:2] == key_states.shape[:2] == buffer.shape[:2]
            and buffer.shape[-2] >= needed
        )

    @staticmethod
    def _regrown(current: torch.Tensor, new_states: torch.Tensor, needed: int) -> torch.Tensor:
        batch, heads, _, head_dim = new_states.shape
        buffer = new_states.new_empty(batch, heads, needed + GROWTH_TOKENS, head_dim)
        if current.numel():
            buffer[..., : current.shape[-2], :] = current
        return buffer


def growing_cache(config: PretrainedConfig) -> DynamicCache:
    """A DynamicCache for ``config`` whose full-attention layers grow in place (sliding-window
    and other special layers stay transformers' own)."""
    cache = DynamicCache(config=config)
    cache.layers = [GrowingLayer() if type(layer) is DynamicLayer else layer for layer in cache.layers]
    return cache
