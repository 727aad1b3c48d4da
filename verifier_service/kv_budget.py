"""The verifier's KV-cache memory, bounded in bytes.

A session's cache holds, per committed token and per layer, one key and one value vector per
KV head: layers x 2 x kv_heads x head_dim x dtype bytes. Qwen2.5-1.5B in fp32: 28 x 2 x 2 x
128 x 4 = 57,344 bytes (56 KiB) per token, so the old 2,000,000-token cap allowed ~107 GiB.
The session registry admits a call only when the bytes of every session's cache, this call's
forward included, stay within the budget: it frees retained prefix caches (``RetainedKv``,
least recently used first) before any session, then evicts idle sessions (least recently used),
and answers 429 when even that cannot make room.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

DEFAULT_KV_CACHE_BYTES = 4 * 1024**3


def kv_bytes_per_token(config, dtype: torch.dtype) -> int:
    """Bytes one token occupies in a transformers model's KV cache, from its config."""
    num_heads = config.num_attention_heads
    num_kv_heads = getattr(config, "num_key_value_heads", None) or num_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // num_heads
    element_bytes = torch.finfo(dtype).bits // 8 if dtype.is_floating_point else torch.iinfo(dtype).bits // 8
    return config.num_hidden_layers * 2 * num_kv_heads * head_dim * element_bytes


@runtime_checkable
class RetainedKv(Protocol):
    """KV a backend keeps beyond its sessions (ended sessions' caches kept as shared prefixes):
    it counts against the budget, and is the first to go when a call needs room: the registry
    sets its room (``limit_retained``) whenever the sessions' share changes."""

    @property
    def num_retained_tokens(self) -> int: ...

    @property
    def num_retained(self) -> int:
        """Caches retained (entries of the prefix store)."""
        ...

    def limit_retained(self, max_tokens: int) -> None: ...


@dataclass(frozen=True)
class KvBudget:
    bytes_per_token: int
    max_bytes: int

    def __post_init__(self) -> None:
        if self.bytes_per_token < 1 or self.max_bytes < 1:
            raise ValueError("a KV budget needs positive bytes per token and a positive size")

    @property
    def max_tokens(self) -> int:
        return self.max_bytes // self.bytes_per_token

    @classmethod
    def for_model(cls, bytes_per_token: int, max_context_length: int, max_bytes: int | None) -> KvBudget:
        """``max_bytes`` as configured, else 4 GiB or one full context, whichever is larger. A
        configured budget must hold one full context (else the longest request could never run)."""
        full_context = bytes_per_token * max_context_length
        if max_bytes is None:
            return cls(bytes_per_token, max(DEFAULT_KV_CACHE_BYTES, full_context))
        if max_bytes < full_context:
            raise ValueError(
                f"--max-kv-cache-bytes {max_bytes} cannot hold one full context "
                f"({max_context_length} tokens x {bytes_per_token} bytes = {full_context} bytes)"
            )
        return cls(bytes_per_token, max_bytes)
