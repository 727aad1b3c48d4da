"""Attention for the CPU kernels (``kernels``), registered with transformers'
AttentionInterface so any model built on it (Qwen2, Llama, Mistral, ...) picks them up.

``gqa_attention`` (fast mode) is transformers' eager attention without ``repeat_kv``: eager
copies every cached key and value once per query head of a group before two batched matmuls
(Qwen2.5-1.5B: 6 query heads share each KV head, so a 1,000-token cache is copied as 6,000
rows per layer and forward). Here the query heads of a group are stacked as extra rows against
their one KV head instead, with the same additive mask, so nothing is copied.

``rowwise_attention`` (batch-invariant mode) runs each query row on its own against exactly the
keys it may see, with no mask. A block's row at position p then performs the very operations,
on tensors of the very shapes, that a one-token forward at position p performs, so its output
does not depend on how many rows share the forward. Where the model's attention modules carry the
compiled kernel (``KERNEL_ATTRIBUTE``), it does the same in one C call per layer
(``kernels.c``, "batch-invariant attention"); else a few torch operations per row. It needs
what the verifier always has: one sequence (batch 1), no padding, no sliding window, and the new
rows at the end of the keys.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, eager_mask

GQA_ATTENTION = "spade_gqa"
ROWWISE_ATTENTION = "spade_rowwise"
KERNEL_ATTRIBUTE = "spade_attention_kernel"
"""Set on a model's attention modules by ``kernels.apply_cpu_kernels``: the compiled kernel
that runs ``rowwise_attention`` (one C call per layer instead of a few torch operations per row)."""


def register_attention() -> None:
    """Make both names known to transformers (idempotent). ``spade_gqa`` takes eager's additive
    mask; ``spade_rowwise`` has no mask function, so transformers builds no mask for it."""
    AttentionInterface.register(GQA_ATTENTION, gqa_attention)
    AttentionMaskInterface.register(GQA_ATTENTION, eager_mask)
    AttentionInterface.register(ROWWISE_ATTENTION, rowwise_attention)


def gqa_attention(
    module: nn.Module,
    query: torch.Tensor,  # [batch, heads, rows, head_dim]
    key: torch.Tensor,  # [batch, kv_heads, keys, head_dim]
    value: torch.Tensor,  # [batch, kv_heads, keys, head_dim]
    attention_mask: torch.Tensor | None,  # [batch, 1, rows, keys], additive
    scaling: float,
    dropout: float = 0.0,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    batch, num_heads, num_rows, head_dim = query.shape
    num_kv_heads, num_keys = key.shape[1], key.shape[2]
    group = num_heads // num_kv_heads
    # Head h uses KV head h // group (repeat_kv's order): [b, kv, group * rows, d] is a reshape.
    stacked = query.reshape(batch, num_kv_heads, group * num_rows, head_dim)
    scores = torch.matmul(stacked, key.transpose(2, 3)) * scaling
    scores = scores.view(batch, num_kv_heads, group, num_rows, num_keys)
    if attention_mask is not None:
        scores = scores + attention_mask[:, :, None, :, :num_keys]
    elif num_rows > 1:
        scores = scores + causal_mask(num_rows, num_keys, scores.dtype, scores.device)
    probs = nn.functional.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
    output = torch.matmul(probs.view(batch, num_kv_heads, group * num_rows, num_keys), value)
    return output.view(batch, num_heads, num_rows, head_dim).transpose(1, 2).contiguous(), None


def causal_mask(num_rows: int, num_keys: int, dtype: torch.dtype, device: torch.device | None = None) -> torch.Tensor:
    """[rows, keys] additive mask on ``device``: row i (at key position keys - rows + i) sees
    keys up to its own."""
    visible = torch.ones(num_rows, num_keys, dtype=torch.bool, device=device).tril(num_keys - num_rows)
    return torch.zeros(num_rows, num_keys, dtype=dtype, device=device).masked_fill(~visible, torch.finfo(dtype).min)


def rowwise_attention(
    module: nn.Module,
    query: torch.Tensor,  # [1, heads, rows, head_dim]
    key: torch.Tensor,  # [1, kv_heads, keys, head_dim]; the rows are the last `rows` keys
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,  # None: this implementation registers no mask
    scaling: float,
    dropout: float = 0.0,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    batch, num_heads, num_rows, head_dim = query.shape
    if batch != 1 or kwargs.get("sliding_window"):
        raise ValueError("batch-invariant attention takes one sequence without a sliding window")
    kernel = getattr(module, KERNEL_ATTRIBUTE, None)
    if kernel is not None and kernel.can_attend(query, key, value):
        return kernel.rowwise_attention(query, key, value, scaling), None
    num_kv_heads, num_keys = key.shape[1], key.shape[2]
    group = num_heads // num_kv_heads
    output = query.new_empty(1, num_rows, num_heads, head_dim)
    for row in range(num_rows):
        # Row `row` sits at position keys - rows + row and sees every key up to it; a one-row
        # forward at that position has exactly these keys in its cache.
        visible = num_keys - num_rows + row + 1
        row_query = query[0, :, row].reshape(num_kv_heads, group, head_dim)
        scores = torch.matmul(row_query, key[0, :, :visible].transpose(1, 2)) * scaling
        probs = nn.functional.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
        output[0, row] = torch.matmul(probs, value[0, :, :visible]).reshape(num_heads, head_dim)
    return output, None
